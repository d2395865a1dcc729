"""The strategy-choice ILP in general: pick one candidate per node, minimizing node + edge
costs under memory constraints (the formulation: `formulation`'s docstring; docs/planner.md).

Lives here: `formulation` (the problem and its solution as plain values), `solvers` (the problem
as sparse matrices; the LP by HiGHS, the MIP by OR-Tools) and `solving` (the solve over
relaxations, cutoffs, and the brute-force oracle). Imports run one way: solving -> solvers ->
formulation. Lives elsewhere: what the costs mean (`timing`, `memory`, `problem`).
"""

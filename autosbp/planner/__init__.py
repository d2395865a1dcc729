"""The planner: a captured graph, a mesh of devices and a cost model become the fastest plan that fits.

Grouped by what each folder decides, so that a question has one folder as its answer:
- `api`: `auto_parallelize`, the public entry (checks, capture, the cluster's prices);
- `space/`: what a search may choose: a strategy's `Space` (hand plans as restrictions),
  configurations (`Config`: stage count, stage mesh, micro-batch count, recomputation), the
  graph cut into stages, what recomputation recomputes, repeated blocks tied;
- `memory/`: where memory is priced: what backward keeps (read from autograd), the bytes of
  every candidate and edge pair on a device;
- `timing/`: where a plan's time is priced: every candidate's compute and exchanges, every
  edge's boxing, the update, and the step they make (the ILP's objective);
- `problem/`: the ILP of one configuration, built from those prices per stage, and its solve;
- `bounds/`: where a configuration's lower bounds are computed (floors, nodes, forest);
- `ilp/`: the strategy-choice ILP in general: its values, its matrices and solvers, the solve
  over relaxations;
- `search/`: which configuration wins: the best-first search by proven bounds, over processes
  and over the schedules `auto` tries; why nothing fits;
- `assemble`: the winner as a `Plan`, with alternatives for `explain`.
Imports run one way: ilp, space, memory, timing, problem, bounds, search, then api and
assemble (tests/test_layering.py).
Lives elsewhere: the graph (`capturing`), signature rules (`rules`), boxing chains (`boxing`),
the actor rules the prediction simulates (`schedule`), the plan format (`plan`), hardware
prices (`costmodel`). The formulation, with its proofs: docs/planner.md.
"""

"""Where a configuration's lower bounds are computed: what no plan of it can beat.

Lives here: `nodes` (bounds from per-node times alone: the floors (0) and the nodes (1)),
`forest` (bound (1b): each stage's nodes and a spanning forest of its edges), `memory_floor`
(the fewest bytes a stage can hold, on such a forest: which `full:K` may fit) and `lp` (bound
(2): the LP relaxation of a configuration's ILP, which the shared bound (2a) takes of the least
recomputing mode). Lives elsewhere:
the order the search tries them in and why each is a bound (`search`, docs/planner.md).
"""

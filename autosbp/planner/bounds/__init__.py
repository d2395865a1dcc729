"""Where a configuration's lower bounds are computed: what no plan of it can beat.

Lives here: `nodes` (bounds from per-node times alone: the floors (0) and the nodes (1)) and
`forest` (bound (1b): each stage's nodes and a spanning forest of its edges). Lives elsewhere:
the order the search tries them in and why each is a bound (`search`, docs/planner.md).
"""

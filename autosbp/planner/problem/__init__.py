"""The ILP of one configuration: its prices summed per stage, its objective and memory
constraints, its solve and what its solution predicts.

Lives here: `priced` (the prices of a graph on a stage mesh that every configuration of that
mesh shares), `stage_terms` (per-stage sums of time and bytes), `build` (the `MeshProblem` of
one configuration), `solve` (its solve, cut to the simulated step) and `simulation_cuts` (the
simulation's critical paths as cuts). Lives elsewhere: the prices (`timing`, `memory`), the ILP solver
(`ilp`), the bounds (`bounds`), the search over configurations (`search`).
"""

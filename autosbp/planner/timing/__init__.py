"""Where a plan's time is priced: per candidate, per edge, per update, and the step they make.

Lives here: `boxing_prices` (the `Prices` a hardware profile provides; a boxing chain's time),
`candidates` (each node's candidate signatures with their compute time, each edge's boxing
matrices), `op_exchanges` (communication inside an op), `param_candidates` (a parameter's
ZeRO candidates, its update and accumulation times), `finite_check` (the runtime's non-finite
check), `objective` (the ILP's objective: a lower bound of the simulated step), `predict` (a
solution's step by the actor simulation) and `zero_bubble_price` (the zb1 schedule's step). Lives elsewhere: the hardware numbers
(`costmodel`), bytes (`memory`), the per-stage sums (`problem.stage_terms`), the actor
simulation the step is predicted by (`autosbp.schedule`).
"""

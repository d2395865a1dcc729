"""The planner: a captured graph, a mesh of devices and a cost model become the fastest plan that fits.

Lives here, in the order a search uses them:
- `api`: `auto_parallelize`, the public entry (checks, capture, the cluster's prices);
- `hand_plans`: hand plans (`dp`, `fsdp`, `megatron:...`) as restrictions of the search space;
- `space`, `search`, `bounds`, `nofit`: every configuration (stage count, stage mesh,
  micro-batch count, recomputation), searched best-first by proven lower bounds to a gap
  proven over the whole space; why nothing fits;
- `pipeline`, `reduce`: stages and recomputation; repeated blocks tied to one set of variables;
- `candidates`, `memory`: every signature's and boxing's time, every candidate's bytes;
- `problem`, `objective`: the ILP of one configuration (its objective a lower bound of the
  simulated step), its bound, solve and predicted step;
- `ilp_problem`, `ilp_solvers`, `ilp`: the ILP's types, its matrices and solvers, and the
  solve over relaxations (imports run one way: ilp -> ilp_solvers -> ilp_problem);
- `assemble`: the winner as a `Plan`, with alternatives for `explain`.
Lives elsewhere: the graph (`capturing`), signature rules (`rules`), boxing chains (`boxing`),
the actor rules the prediction simulates (`schedule`), the plan format (`plan`), hardware
prices (`costmodel`).
"""

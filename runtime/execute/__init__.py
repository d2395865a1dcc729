"""Executing one rank's program: the plan's signatures read (`signatures`), the captured graph as
prebuilt closures (`program`, built by `builder`, recomputed runs by `recompute_runs`;
`instructions`), boxing steps as autograd-aware collectives (`collectives`) on process groups of
every mesh dim (`groups`)."""

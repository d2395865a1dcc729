"""Executing one rank's program: the captured graph as prebuilt closures (`program`,
`instructions`), boxing steps as autograd-aware collectives (`collectives`) on process groups of
every mesh dim (`groups`)."""

"""What a search may choose: the space of configurations and what a configuration means.

Lives here: `strategy` (a strategy, `auto` or a hand plan such as `megatron:tp=..,pp=..`, as the
`Space` it lets the search choose from, and the usual hand plans of a device count), `configs`
(a configuration, `Config`, and the stage meshes and micro-batch counts it is drawn from),
`stages` (a graph cut into pipeline stages), `recomputation` (what a recomputation mode
recomputes) and `ties` (repeated blocks tied to one set of variables). Lives elsewhere: the prices of a choice
(`timing`, `memory`), the search over configurations (`search`).
"""

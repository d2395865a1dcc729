"""CLI command modules: each has `configure(parser, name)` and `run(args, console) -> int`."""

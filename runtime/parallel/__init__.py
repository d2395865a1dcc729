"""The parallel dimensions the program runs inside: gradient sync (`grad_sync`), parameter gathers
as FSDP runs them (`gathers`: which and in what units; `prefetch`: when)."""

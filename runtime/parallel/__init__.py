"""The parallel dimensions the program runs inside, one module each, composed by the Engine: the
pipeline (`pipeline`: stages, their traffic, the firing loop), gradient sync (`grad_sync`),
parameter gathers as FSDP runs them (`gathers`: which and in what units; `prefetch`: when)."""

"""Verification of a running plan: each step against one device (`step_check`: the bounds and the
comparison; `one_device`: the reference's evaluations), the verdict (`verdict`), and measured
peak memory (`peak_memory`)."""

"""Verification of a running plan: each step against one device (`step_check`), the verdict
(`verdict`), and measured peak memory (`peak_memory`)."""

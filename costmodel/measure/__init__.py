"""Measuring this machine for a profile: what to time (`items`), timing it on N ranks (`profiler`,
the parent's side; `worker`, a rank's), fitting the measurements into a `Profile` (`fitting`) and
a plot of them (`plot`). `autosbp profile` (autosbp.commands.profile) is its command.
"""

"""Defaults of a training job, in one place: the runtime applies them and the CLI states them.

Light on purpose (no torch): `autosbp train --help` reads them without loading the runtime.
"""

from __future__ import annotations

__all__ = ["CHECKPOINT_EVERY", "EVAL_BATCHES", "OPTIMIZERS", "SCHEDULES", "STALL_TIMEOUT_S"]

# No progress for this long ends a job (`autosbp train --stall-timeout`): far beyond one firing
# (a forward or backward of one micro-batch) of a model that trains on this machine (milliseconds to seconds), short enough that a
# wedged job does not hold its machine for long. Collectives time out a few seconds later
# (launching.workers.COLLECTIVE_MARGIN_S), so the watchdog names the stalled ranks first.
STALL_TIMEOUT_S = 600.0
CHECKPOINT_EVERY = 100  # steps between checkpoints by default (`--checkpoint-every`)
EVAL_BATCHES = 20  # global batches per evaluation by default (`--eval-batches`)
# The optimizers and learning-rate schedules a job runs (`runtime.optim`), by the names the
# command line and plans use.
OPTIMIZERS = ("adam", "adamw", "sgd", "sgd_momentum")
SCHEDULES = ("constant", "linear", "cosine", "wsd")

"""A rank's state: what every rank agrees on at start (`startup`), and checkpoints saved under one
plan and loaded under any other (`checkpoint`, its manifest `checkpoint_format`)."""

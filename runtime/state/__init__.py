"""A rank's state: what every rank agrees on (`startup`), its pieces of the parameters and buffers
(`shards`), and checkpoints saved under one plan and loaded under any other (`checkpoint`: the
format and saving; `checkpoint_load`; the manifest: `checkpoint_format`)."""

"""Training data for a plan: each rank reads only the rows its placement needs, in an order that
is the same on every rank, and resumes exactly.

Lives here (one concept per module): what a rank needs of each global batch (`layout`:
`InputSpec`, `input_specs`, `BatchLayout`, `RankBatch`), a user's data loaded and checked (`sources`:
`load_data`, `as_data`, the built-in data sets by name), which samples make each batch and
where a job is in them (`sampler`), the loaders (`loader`: `RankLoader` for training,
`EvalLoader` for evaluation, `LoadInfo`) and token data sets (`tokens`: `stdlib_text`,
`token_file`). Lives elsewhere: how a plan's input layouts become a `BatchLayout` and what a
step does with the pieces (`runtime.engine`), the job and its flags (`runtime.jobs`,
`autosbp.commands.train`), checkpoints that hold `RankLoader.state()` (`runtime.state`).

A data function (`--data path/to/file.py:function`, `--data-args k=v,...`) returns a map-style
data set whose items are tuples of per-sample tensors, one per model input in forward's order,
or an iterable of whole global batches. Every rank calls it: it must be deterministic.

The rules, from torchtitan and Megatron-LM (/work/shared/reference/trainers.md, "Data"): only
the data-parallel share of a batch differs between ranks, tensor-, context- and
expert-parallel replicas read the same rows, and a rank whose stages read no input (a middle
pipeline stage) reads nothing; here all of it follows from the boxes the plan's input layouts
give a rank. Batches are shuffled per epoch from (seed, epoch) alone, the last partial batch
of an epoch is dropped, and the position (epoch, samples consumed) resumes bit-exactly, from
the consumed samples when the global batch changed (Megatron's consumed-samples sampler).
"""

from runtime.data.layout import BatchLayout, Box, InputSpec, RankBatch, input_specs
from runtime.data.loader import EvalLoader, LoadInfo, RankLoader
from runtime.data.sampler import Position, Sampler
from runtime.data.sources import BUILT_IN, BatchData, Data, SampleData, as_data, load_data
from runtime.data.tokens import TokenWindows, stdlib_text, token_file

__all__ = [
    "BUILT_IN",
    "BatchData",
    "BatchLayout",
    "Box",
    "Data",
    "EvalLoader",
    "InputSpec",
    "LoadInfo",
    "Position",
    "RankBatch",
    "RankLoader",
    "SampleData",
    "Sampler",
    "TokenWindows",
    "as_data",
    "input_specs",
    "load_data",
    "stdlib_text",
    "token_file",
]

"""A Hugging Face decoder builds its key/value cache in training too (`use_cache`, on by default):
each layer joins its keys and values onto an empty 1-D tensor with `torch.cat`, which skips such
an input. The cat rule skips it too (`rules.indexing.cat_signatures`), so the keys keep the
batch split under data parallelism. Seen as a 1-D input, it left only B and P: each device held
the whole batch's keys and values, gathered across data parallelism every micro-batch (3.4 s of
Llama 3 405B's 5.0 s exposed communication at its published 8192-GPU layout).

Oracle: under pure data parallelism every op of attention can run on its own rows, so each
of its joins (rotate_half's and the cache's) keeps the batch split."""

from __future__ import annotations

import importlib.util

import pytest

from autosbp.planner.api import auto_parallelize
from tests.support import real_models

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="needs transformers"
)


def test_a_key_value_cache_keeps_the_batch_split_under_data_parallelism() -> None:
    model, inputs = real_models.llama()
    plan = auto_parallelize(
        model, inputs, devices=2, strategy="megatron:tp=1,pp=1,dp=2,mb=1", recompute="none",
        profile="dgx-a100", time_limit_s=60,
    )  # fmt: skip
    joins = [
        n for n in plan.nodes.values()
        if n.op == "aten.cat.default" and n.path.endswith("self_attn")
    ]  # fmt: skip
    cache = [n for n in joins if n.inputs[0] == "B"]
    assert len(cache) == 4, "each layer's cats of keys and of values onto an empty tensor"
    assert all(n.outputs == ("S(0)",) and n.inputs[-1] == "S(0)" for n in joins), joins

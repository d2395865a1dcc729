"""runtime.data: each rank reads only its rows, the pieces are the whole batch's, resumes are exact.

Oracles: the whole global batch collated on one process, cut into micro-batches
(`split_micro_batches`) and each rank's piece taken by its SBP (`autosbp.layout.shard_tensor`),
against the pieces a rank's loader built from its hand-written boxes; the uninterrupted loader
against a resumed one (bit for bit); the epoch's order (`Sampler.order`) against the batches
handed out; the token array against the token windows; two other processes (other hash seeds)
against this one. Layouts are data, so no process world is started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from autosbp.capturing.batches import split_micro_batches
from autosbp.errors import AutosbpError, DataError
from autosbp.layout import shard_tensor
from autosbp.zoo import build_model
from runtime.data import (
    BatchData,
    BatchLayout,
    EvalLoader,
    InputSpec,
    RankLoader,
    Sampler,
    as_data,
    input_specs,
    load_data,
    stdlib_text,
    token_file,
)
from runtime.data.tokens import STDLIB_MODULES

REPO = Path(__file__).resolve().parents[2]
SEQ, GLOBAL, MICRO = 6, 8, 2  # rows per micro-batch: 4
# A model input of floats (the plan's graph in bf16) and one of token ids.
SPECS = (InputSpec((SEQ,), torch.bfloat16, "x"), InputSpec((SEQ,), torch.int64, "y"))

USER_DATA = """
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset


def samples(n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 256, (n, 6), generator=g))


def images(n=16, seed=0, image=8, classes=10):
    g = torch.Generator().manual_seed(seed)
    pictures = torch.randn(n, 3, image, image, generator=g)
    return TensorDataset(pictures, torch.randint(0, classes, (n,), generator=g))


class Batches(IterableDataset):
    def __init__(self, batches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


def batches(count=5, rows=8):
    data = samples(count * rows)
    return Batches([tuple(t[k * rows : (k + 1) * rows] for t in data.tensors) for k in range(count)])


def generator(count=3, rows=8):
    yield from batches(count, rows)


def raises():
    raise ValueError("no such corpus")


def number():
    return 42


def mapping():
    return {"x": torch.zeros(8, 6)}


class Items(Dataset):
    def __init__(self, make, n=16):
        self.make, self.n = make, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= self.n:
            raise IndexError(i)
        return self.make(i)


def tensors():
    return Items(lambda i: torch.zeros(6))


def dicts():
    return Items(lambda i: {"x": torch.zeros(6), "y": torch.zeros(6, dtype=torch.long)})


def three():
    return Items(lambda i: (torch.zeros(6), torch.zeros(6, dtype=torch.long), torch.zeros(1)))


def short_rows():
    return Items(lambda i: (torch.zeros(5), torch.zeros(6, dtype=torch.long)))


def float_ids():
    return Items(lambda i: (torch.zeros(6), torch.zeros(6)))


def whole_batches_as_items():
    return Items(lambda i: (torch.zeros(8, 6), torch.zeros(8, 6, dtype=torch.long)))


def tiny():
    return samples(n=3)


def _item(i):
    if i == 13:
        raise ZeroDivisionError("division by zero")
    return torch.zeros(6), torch.zeros(6, dtype=torch.long)


def broken_item():
    return Items(_item)


def empty():
    return iter([])


class Once(IterableDataset):
    def __iter__(self):
        raise RuntimeError("the stream is closed")


def closed():
    return Once()
"""


@pytest.fixture(scope="module")
def data_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "data.py"
    path.write_text(USER_DATA)
    return path


class Counting(Dataset[tuple[torch.Tensor, ...]]):
    """A data set that records the indices read from it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.read.append(index)
        return self.inner[index]


def _samples(n: int = 40) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(n, SEQ, generator=g), torch.randint(0, 256, (n, SEQ), generator=g)
    )


# ------------------------------------------------------------------------- rows read per rank
# A rank: per input, its SBP on the stage's mesh (None: the rank's stage does not read it), the
# mesh and the rank's coordinates. Its boxes are written by hand beside it; the oracle cuts the
# whole batch with shard_tensor by the SBP.
Rank = tuple[tuple[str | None, ...], tuple[int, ...], tuple[int, ...], tuple[Any, ...]]
ROWS = slice(None)
WORLDS: dict[str, list[Rank]] = {
    # stage 0 reads x, stage 1 reads y; each stage data-parallel over 2 ranks.
    "pp2xdp2": [
        (("S(0)", None), (2,), (0,), ((slice(0, 2),), None)),
        (("S(0)", None), (2,), (1,), ((slice(2, 4),), None)),
        ((None, "S(0)"), (2,), (0,), (None, (slice(0, 2),))),
        ((None, "S(0)"), (2,), (1,), (None, (slice(2, 4),))),
    ],
    "tp2": [(("B", "B"), (2,), (t,), ((ROWS,), (ROWS,))) for t in range(2)],
    "dp2xtp2": [
        (("S(0)B", "S(0)B"), (2, 2), (d, t), ((slice(2 * d, 2 * d + 2),),) * 2)
        for d in range(2)
        for t in range(2)
    ],
    "cp2": [
        (("S(1)", "S(1)"), (2,), (c,), ((ROWS, slice(3 * c, 3 * c + 3)),) * 2) for c in range(2)
    ],
    # a middle stage reads nothing; the last reads y whole.
    "pp3": [
        (("B", None), (1,), (0,), ((ROWS,), None)),
        ((None, None), (1,), (0,), (None, None)),
        ((None, "B"), (1,), (0,), (None, (ROWS,))),
    ],
}


def _oracle(whole: tuple[torch.Tensor, ...], rank: Rank) -> list[list[torch.Tensor | None]]:
    sbps, mesh, coords, _ = rank
    micro = split_micro_batches(whole, MICRO)
    return [
        [
            None if sbp is None else shard_tensor(x, sbp, mesh, coords).to(spec.dtype)
            for x, sbp, spec in zip(micro[j], sbps, SPECS, strict=True)
        ]
        for j in range(MICRO)
    ]


def _rows_used(rank: Rank) -> set[int]:
    """The global batch's rows in a rank's pieces: its SBPs' pieces of a tensor of row numbers."""
    row_ids = torch.arange(GLOBAL)[:, None].expand(GLOBAL, SEQ)
    pieces = _oracle((row_ids, row_ids), rank)
    return {
        int(r) for micro in pieces for piece in micro if piece is not None for r in piece.unique()
    }


@pytest.mark.parametrize("world", list(WORLDS))
def test_each_rank_reads_only_its_rows_and_gets_the_whole_batchs_pieces(world: str) -> None:
    data = _samples(22)  # 2 whole batches per epoch, 6 samples dropped: 4 steps cross an epoch
    sampler = Sampler(len(data), GLOBAL, seed=5)
    datasets = [Counting(data) for _ in WORLDS[world]]
    loaders = [
        RankLoader(d, BatchLayout(GLOBAL, MICRO, SPECS, rank[3]), seed=5)
        for d, rank in zip(datasets, WORLDS[world], strict=True)
    ]
    for d in datasets:
        d.read.clear()  # the check of item 0 before the first step
    for _ in range(4):
        indices = sampler.next_batch()
        whole = tuple(torch.stack(t) for t in zip(*(data[int(i)] for i in indices), strict=True))
        union: set[int] = set()
        for d, loader, rank in zip(datasets, loaders, WORLDS[world], strict=True):
            batch, info = next(loader)
            expected = _oracle(whole, rank)
            for j in range(MICRO):
                for got, want in zip(batch[j], expected[j], strict=True):
                    assert (got is None) == (want is None)
                    if got is not None and want is not None:
                        assert got.dtype == want.dtype and got.is_contiguous()
                        assert torch.equal(got, want)
            used = {int(indices[r]) for r in _rows_used(rank)}
            assert sorted(d.read) == sorted(used), "a rank read a row it does not use"
            assert info.rows_read == len(d.read)
            union |= set(d.read)
            d.read.clear()
        assert union == set(indices.tolist()), "the ranks together did not read the batch"
    assert loaders[0].state()["epoch"] == 1


def test_a_middle_stage_reads_nothing_and_keeps_the_position() -> None:
    data = Counting(_samples())
    loader = RankLoader(data, BatchLayout(GLOBAL, MICRO, SPECS, (None, None)))
    data.read.clear()
    batch, info = next(loader)
    assert batch == ((None, None),) * MICRO and info.rows_read == 0 and data.read == []
    reader = RankLoader(_samples(), BatchLayout.whole(GLOBAL, SPECS, MICRO))
    next(reader)
    assert loader.state() == reader.state()


# ------------------------------------------------------------------------- order and epochs
def test_epochs_are_new_permutations_with_the_tail_dropped() -> None:
    sampler = Sampler(22, GLOBAL, seed=1)
    epochs = [torch.cat([sampler.next_batch() for _ in range(2)]) for _ in range(3)]
    for e, seen in enumerate(epochs):
        assert torch.equal(seen, sampler.order(e)[:16]) and len(set(seen.tolist())) == 16
    assert not torch.equal(epochs[0], epochs[1]) and not torch.equal(epochs[1], epochs[2])
    assert sampler.position.epoch == 2 and sampler.batches_left() == 0
    ordered = Sampler(22, GLOBAL, shuffle=False)
    assert torch.equal(torch.cat([ordered.next_batch() for _ in range(2)]), torch.arange(16))
    assert torch.equal(ordered.next_batch(), torch.arange(8)), "epoch 1 starts over"
    assert not torch.equal(Sampler(22, GLOBAL, seed=2).order(0), sampler.order(0))


def _run(loader: RankLoader, steps: int) -> list[Any]:
    return [next(loader)[0] for _ in range(steps)]


def _same(a: list[Any], b: list[Any]) -> bool:
    """Bit-exact equality of lists of RankBatches."""
    flat_a = [t for batch in a for micro in batch for t in micro]
    flat_b = [t for batch in b for micro in batch for t in micro]
    return len(flat_a) == len(flat_b) and all(
        (x is None and y is None)
        or (x is not None and y is not None and x.dtype == y.dtype and torch.equal(x, y))
        for x, y in zip(flat_a, flat_b, strict=True)
    )


DATA_KINDS: dict[str, Callable[[], object]] = {
    "samples": lambda: _samples(22),
    "batches": lambda: BatchData(
        [tuple(t[k * 8 : k * 8 + 8] for t in _samples(40).tensors) for k in range(5)], "batches"
    ),
}


@pytest.mark.parametrize("kind", list(DATA_KINDS))
@pytest.mark.parametrize("stop", [1, 3, 5], ids=lambda s: f"stop{s}")
def test_a_resumed_loader_yields_the_uninterrupted_batches_bit_exactly(
    kind: str, stop: int
) -> None:
    layout = BatchLayout(GLOBAL, MICRO, SPECS, ((slice(0, 2),), (slice(0, 2), slice(1, 4))))
    whole_run = _run(RankLoader(DATA_KINDS[kind](), layout, seed=9), 12)  # crosses epochs
    first = RankLoader(DATA_KINDS[kind](), layout, seed=9)
    before = _run(first, stop)
    state = json.loads(json.dumps(first.state()))  # through a checkpoint's JSON
    resumed = RankLoader(DATA_KINDS[kind](), layout, seed=123, state=state)  # the state's seed
    assert _same(before + _run(resumed, 12 - stop), whole_run)
    assert not _same(_run(RankLoader(DATA_KINDS[kind](), layout, seed=9), 2), whole_run[1:3])


def test_a_resume_with_another_global_batch_goes_on_from_the_consumed_samples() -> None:
    data = Counting(_samples(40))
    first = RankLoader(data, BatchLayout.whole(GLOBAL, SPECS), seed=4)
    data.read.clear()
    _run(first, 2)
    resumed = RankLoader(data, BatchLayout.whole(12, SPECS), seed=4, state=first.state())
    data.read.clear()
    _run(resumed, 3)  # 16 consumed + 12 + 12 = 40: the epoch's end; then epoch 1
    order = Sampler(40, GLOBAL, seed=4).order
    assert data.read[:24] == order(0)[16:40].tolist()
    assert data.read[24:] == order(1)[:12].tolist()


# ------------------------------------------------------------------------- other processes
DIGEST = """
import hashlib
import torch
from runtime.data import BatchLayout, InputSpec, RankLoader, load_data


def digest(spec):
    specs = (InputSpec((32,), torch.int64), InputSpec((32,), torch.int64))
    layout = BatchLayout(16, 2, specs, ((slice(0, 4),), (slice(4, 8),)))
    sha = hashlib.sha256()
    for name, args in (("stdlib_text", {"seq": 32}), (spec, {})):
        loader = RankLoader(load_data(name, args), layout, seed=7)
        for _ in range(3):
            batch, _ = next(loader)
            for t in (t for micro in batch for t in micro if t is not None):
                sha.update(t.numpy().tobytes())
    return sha.hexdigest()
"""
USER_TOKENS = """
import numpy as np
from runtime.data import TokenWindows


def windows():
    return TokenWindows(np.arange(40 * 33) % 251, 32)
"""


@pytest.mark.slow
def test_the_order_is_the_same_in_other_processes_and_hash_seeds(tmp_path: Path) -> None:
    (tmp_path / "tokens.py").write_text(USER_TOKENS)
    spec = f"{tmp_path / 'tokens.py'}:windows"
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", DIGEST + "\nimport sys\nprint(digest(sys.argv[1]))", spec],
            env={**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        for seed in ("1", "2")
    ]
    here: dict[str, Any] = {}
    exec(DIGEST, here)  # this process too, while the others run
    ours = here["digest"](spec)
    outputs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert all(run.returncode == 0 for run in runs)
    assert len(ours) == 64 and outputs == [ours, ours]


# ------------------------------------------------------------------------- evaluation
def test_evaluation_is_one_ordered_pass_of_whole_batches_each_time() -> None:
    data = stdlib_text(seq=16, split="eval")
    layout = BatchLayout.whole(32, (InputSpec((16,), torch.int64),) * 2, micro_batches=2)
    loader = EvalLoader(data, layout)
    passes = [[batch for batch, _ in loader] for _ in range(2)]
    assert len(passes[0]) == len(data) // 32 and _same(passes[0], passes[1])
    ids = torch.cat([torch.cat([micro[0] for micro in batch]) for batch in passes[0]])
    assert torch.equal(ids, torch.stack([data[i][0] for i in range(len(ids))]))


def test_evaluation_of_an_iterable_dataset_of_batches_and_of_a_generator(data_file: Path) -> None:
    layout = BatchLayout.whole(GLOBAL, SPECS)
    reiterable = EvalLoader(load_data(f"{data_file}:batches"), layout)
    assert [len(list(reiterable)) for _ in range(2)] == [5, 5]
    once = EvalLoader(load_data(f"{data_file}:generator"), layout)
    assert len(list(once)) == 3
    with pytest.raises(DataError, match="gave no batch"):
        list(once)


# ------------------------------------------------------------------------- data sets
@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
@pytest.mark.parametrize("labels", ["shifted", "same"])
def test_a_token_file_is_cut_into_windows(tmp_path: Path, dtype: str, labels: str) -> None:
    tokens = (np.arange(1000) * 7919 % 70000).astype(dtype)
    tokens.tofile(tmp_path / "train.bin")
    data = token_file(str(tmp_path / "train.bin"), seq=10, dtype=dtype, labels=labels)
    assert len(data) == 99  # windows of 11 tokens, one shared with the next
    for k in (0, 57, 98):
        ids, target = data[k]
        window = torch.from_numpy(tokens[k * 10 : k * 10 + 11].astype(np.int64))
        assert ids.dtype == target.dtype == torch.int64
        assert torch.equal(ids, window[:-1])
        assert torch.equal(target, window[1:] if labels == "shifted" else window[:-1])
    with pytest.raises(IndexError):
        data[99]


def test_stdlib_text_is_byte_tokens_split_into_held_out_text() -> None:
    train, held_out = stdlib_text(seq=64), stdlib_text(seq=64, split="eval")
    assert len(train) > 9 * len(held_out) > 0
    assert bytes(train[0][0].tolist()).decode().startswith("# Author: Steven J. Bethard")
    ids, labels = held_out[3]
    assert torch.equal(ids[1:], labels[:-1]) and int(ids.max()) < 256
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / f"{m}.py" for m in STDLIB_MODULES]
    files = [f if f.is_file() else f.with_suffix("") / "__init__.py" for f in files]
    assert len(train.tokens) + len(held_out.tokens) == sum(f.stat().st_size for f in files)
    assert bytes(held_out.tokens[-20:]) == files[-1].read_bytes()[-20:]


def test_an_image_data_set_feeds_a_non_text_model(data_file: Path) -> None:
    model, example = build_model("resnet")
    specs = input_specs(example, ("images", "labels"), torch.float64)
    assert specs == (
        InputSpec((3, 8, 8), torch.float64, "images"),
        InputSpec((), torch.int64, "labels"),
    )
    data = load_data(f"{data_file}:images", {"n": 16})
    batch, info = next(RankLoader(data, BatchLayout.whole(4, specs, micro_batches=2), seed=0))
    assert info.rows_read == 4 and batch[0][0] is not None and batch[0][0].shape == (2, 3, 8, 8)
    assert batch[0][0].dtype == torch.float64  # the plan's dtype, from float32 data
    loss = model.double()(*batch[0])
    assert loss.shape == () and torch.isfinite(loss)


# ------------------------------------------------------------------------- bad data
def _loader(
    spec: str, args: dict[str, Any] | None = None, layout: BatchLayout | None = None
) -> RankLoader:
    return RankLoader(load_data(spec, args), layout or BatchLayout.whole(GLOBAL, SPECS))


def _train(spec: str, steps: int) -> None:
    loader = _loader(spec)
    for _ in range(steps):
        next(loader)


# (call on the data file's path, cause words, fix words).
BAD: list[Any] = [
    pytest.param(lambda f: _loader(f"{f}:raises"), ("failed with ValueError: no such corpus",), ("Fix the function",), id="function-raises"),
    pytest.param(lambda f: _loader(f"{f}:number"), ("returned an int",), ("it must return a map-style Dataset", "deterministic"), id="returns-an-int"),
    pytest.param(lambda f: _loader(f"{f}:mapping"), ("returned a dict",), ("iterable of whole global batches",), id="returns-a-dict"),
    pytest.param(lambda f: _loader(f"{f}:nothere"), ("has no function 'nothere'",), ("Name one that returns a map-style Dataset",), id="no-such-function"),
    pytest.param(lambda f: _loader(f"{f.parent}/missing.py:samples"), ("does not exist", "(from --data)"), ("check the path",), id="no-such-file"),
    pytest.param(lambda f: _loader(f"{f}:samples", {"rows": 3}), ("cannot take {'rows': 3}",), ("Check --data-args",), id="wrong-argument"),
    pytest.param(lambda f: _loader("corpus"), ("Unknown data set 'corpus'",), ("stdlib_text", "path/to/file.py:function"), id="unknown-name"),
    pytest.param(lambda f: _loader(f"{f}:tensors"), ("item 0 of", ":tensors (--data) is a Tensor"), ("a tuple of 2 tensors", "`x`, input #1 `y`"), id="items-not-tuples"),
    pytest.param(lambda f: _loader(f"{f}:dicts"), ("is a dict",), ("(item['input_ids'], item['labels'])",), id="items-are-dicts"),
    pytest.param(lambda f: _loader(f"{f}:three"), ("holds 3 tensors but the model takes 2 inputs",), ("one tensor per model input",), id="items-of-three"),
    pytest.param(lambda f: _loader(f"{f}:short_rows"), ("input #0 `x` has shape [5] but the model takes [6]",), ("Make the data match the example inputs",), id="wrong-sample-shape"),
    pytest.param(lambda f: _loader(f"{f}:float_ids"), ("input #1 `y` is torch.float32 but the model's example input is torch.int64",), ("`.to(torch.int64)`",), id="wrong-dtype"),
    pytest.param(lambda f: _loader(f"{f}:whole_batches_as_items"), ("has shape [8, 6] but the model takes [6]",), ("return them from an IterableDataset or a generator",), id="batches-as-items"),
    pytest.param(lambda f: _loader(f"{f}:tiny"), ("has 3 samples, fewer than one global batch of 8",), ("smaller global batch",), id="fewer-samples-than-a-batch"),
    pytest.param(lambda f: _train(f"{f}:broken_item", 2), ("Reading item 13 of", "ZeroDivisionError"), ("[i] works for every i",), id="item-raises"),
    pytest.param(lambda f: _loader(f"{f}:batches", {"rows": 7}), ("batch 0 of", "has shape [7, 6] but the model takes [8, 6] (whole batches)"), ("Make the data match",), id="batch-of-wrong-size"),
    pytest.param(lambda f: _loader(f"{f}:empty"), ("gave no batch",), ("a list, or an IterableDataset",), id="empty-iterable"),
    pytest.param(lambda f: _loader(f"{f}:closed"), ("iter() of", "RuntimeError: the stream is closed"), ("Fix the iterable",), id="iterable-raises"),
    pytest.param(lambda f: _train(f"{f}:generator", 4), ("ran out of batches after epoch 0",), ("iter() starts over", "train fewer steps"), id="generator-runs-out"),
    pytest.param(lambda f: RankLoader(_samples(30), BatchLayout.whole(8, SPECS), state=RankLoader(_samples(40), BatchLayout.whole(8, SPECS)).state()), ("saved over a data set of 40 samples", "now has 30"), ("Resume with the same data set",), id="resume-other-data-size"),
    pytest.param(lambda f: RankLoader(_samples(), BatchLayout.whole(8, SPECS), state={"kind": "batches"}), ("was not saved for a data set of samples",), ("resume with the data the position was saved with",), id="resume-other-kind"),
    pytest.param(lambda f: RankLoader(_samples(), BatchLayout.whole(8, SPECS), state={"kind": "samples", "size": "40"}), ("is not one a data loader saved",), ("start the data afresh",), id="resume-damaged-state"),
    pytest.param(lambda f: BatchLayout(10, 4, SPECS, (None, None)), ("10 samples cannot be cut into 4 equal micro-batches",), ("a positive multiple",), id="layout-uneven-micro-batches"),
    pytest.param(lambda f: BatchLayout(8, 2, SPECS, ((slice(0, 9),), None)), ("cuts dim 0 (size 4)",), ("step 1 within 0..4",), id="layout-box-outside"),
    pytest.param(lambda f: token_file(f"{f.parent}/none.bin", 8, dtype="uint32"), ("cannot hold uint32 tokens (no such file)",), ("np.array(ids, np.uint32).tofile(path)",), id="token-file-not-tokens"),
    pytest.param(lambda f: token_file(f"{f}", 8, dtype="int8"), ("'int8' is not one",), ("give uint16 or uint32",), id="token-file-dtype"),
    pytest.param(lambda f: stdlib_text(split="test"), ("cannot take split='test'",), ("'train' or 'eval'",), id="stdlib-text-split"),
    pytest.param(lambda f: load_data("stdlib_text", {"seq": 0}), ("seq=0 is not a sequence length",), ("whole number >= 1",), id="stdlib-text-seq"),
    pytest.param(lambda f: stdlib_text(labels="next"), ("labels='next'",), ("'shifted'", "'same'"), id="stdlib-text-labels"),
    pytest.param(lambda f: as_data(3, "data.py:f"), ("data.py:f returned an int",), ("map-style Dataset",), id="as-data-int"),
]  # fmt: skip


@pytest.mark.parametrize(("call", "cause", "fix"), BAD)
def test_bad_data_is_refused_with_cause_and_fix(
    call: Callable[[Path], object], cause: tuple[str, ...], fix: tuple[str, ...], data_file: Path
) -> None:
    with pytest.raises(DataError) as caught:
        call(data_file)
    message = str(caught.value)
    assert isinstance(caught.value, AutosbpError) and "\n" not in message
    for word in cause + fix:
        assert word in message, f"{word!r} missing from: {message}"


def test_the_data_function_is_named_in_every_refusal(data_file: Path) -> None:
    with pytest.raises(DataError, match=r"data\.py:float_ids \(--eval-data\)"):
        EvalLoader(
            load_data(f"{data_file}:float_ids", flag="--eval-data"), BatchLayout.whole(8, SPECS)
        )
    with pytest.raises(DataError, match="Check --eval-args"):
        load_data(f"{data_file}:samples", {"rows": 1}, flag="--eval-data", args_flag="--eval-args")

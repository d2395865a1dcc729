"""Checkpoints: saved under plan A, loaded under plan B, training continues as if uninterrupted.

Oracle: the tiny gpt (2 or 4 blocks where a plan has pipeline stages) trained on one
device for SAVED + RESUMED Adam steps. A run that trains SAVED steps under plan A, saves, loads
under plan B (other mesh, other SBPs, other world size, other pipeline stages and micro-batches)
and trains RESUMED more must give the same losses at every step and the same parameters at the
end (fp32, rel <= 1e-5; GPT's attention key bias is left out of the parameter check, see
tests/runtime/test_runtime.py `_comparable`). Also: the files (one per rank, `weights_only` loadable, B
copies saved once, each tensor saved by the stage that owns it, a manifest with SBPs, stages,
the steps trained and the job's extra state), atomic replacement of an old checkpoint, and clear
errors for another model (at the same and at another micro-batch size), another optimizer, a
truncated manifest, an older format version, a missing or damaged rank file, an unfinished
save, saving over a directory that is not one, extra state that is not JSON or differs between
ranks, and an optimizer whose state is not elementwise.

The resume matrix (issue 48 item 4: a checkpoint of dp or cp=2 resumed under zero=1 or zero=2
gave step 4's loss 3.590502 where the uninterrupted run has 2.512922): a 4-block gpt under each
of dp, tp=2, pp=2, vp=2, zero=1, zero=2 and cp=2 trains SAVED + RESUMED steps uninterrupted,
saving after SAVED (once per plan); MATRIX_SLICE's pairs load plan A's checkpoint under plan B.
Two oracles: (1) the conversion is exact, bit for bit: the checkpoint saved again under B right
after the load holds exactly A's tensors (parameters, buffers, every optimizer state: whole
tensors assembled from the pieces); (2) B's resumed steps and state continue B's uninterrupted
run: bit for bit where A's checkpoint holds B's state bit for bit (their arithmetic agreed
for SAVED steps: dp, pp=2, vp=2, zero=1, zero=2), else within fp32 rounding (rel 1e-5;
measured: 8.7e-7 at most). bench/checkpoint_matrix.py runs all 42 pairs. Every torch optimizer with elementwise state converts too: AdamW, SGD and SGD with
momentum saved under zero=1 and resumed under dp follow one device; a checkpoint of version 2
(written by the release before, tests/runtime/data/checkpoint-v2-mlp-dp) still loads; a save
on a full disk (a file size limit on rank 1: its write fails with EFBIG) leaves no `.tmp` and
the last checkpoint intact.

How it runs: two `run_workers` calls. 4 processes train and save under every 4-process plan A
(megatron:tp=2,dp=2 on a 2x2 mesh, fsdp, 2 stages of tp=2) and load the 4-process plans B; then
the parent damages copies of the megatron checkpoint, and 2 processes save and load the 2-process
pairs, load the 4-process checkpoints under dp, try every bad input, and run the matrix, the
optimizers and the full disk. Lives elsewhere: the workers (tests/support/checkpoint_workers.py).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from autosbp.errors import ExecutionError
from autosbp.layout import assemble_tensor, shard_tensor
from autosbp.sbp import Mesh, parse_nd_sbp
from launching.workers import run_workers
from runtime.state.checkpoint import MANIFEST, read_manifest
from tests.runtime.test_runtime import MEGATRON, MODELS, _build, _plan_json
from tests.support.bad_inputs_corpus import ESCAPING_MANIFEST
from tests.support.checkpoint_workers import OPTIMIZERS, run_checkpoint_cases

SAVED, RESUMED = 2, 2
LR = 1e-2
REL_TOL = 1e-5
WORKER_TIMEOUT_S = 120.0
# (case id, plan A (world, strategy), plan B (world, strategy)): resume pairs.
# Pipelined plans (2 stages of 1 or 2 devices) need 2 blocks or more: stages split repeated
# blocks. (2 processes: the matrix's gpt-4l, whose graphs the workers capture once.)
PP2_MB2 = "megatron:tp=1,pp=2,dp=1/mb2"
TP2_PP2, DP2_PP2 = "megatron:tp=2,pp=2,dp=1/mb2", "megatron:tp=1,pp=2,dp=2/mb2"
# (case id, model, plan A (world, strategy), plan B (world, strategy)): resume pairs. Plan B of a
# 4-process load is saved under a 4-process plan A too (that world runs first).
RESUMES: list[tuple[str, str, tuple[int, str], tuple[int, str]]] = [
    ("megatron4-to-dp2", "gpt", (4, MEGATRON), (2, "dp")),
    ("fsdp4-to-auto4", "gpt", (4, "fsdp"), (4, "auto")),
    # 2 stages -> 1 (and micro-batches of 2 -> 4 samples: the graph fingerprints differ).
    ("pp2-to-fsdp2", "gpt-4l", (2, PP2_MB2), (2, "fsdp")),
    # 2 stages of 2 devices -> other stage meshes (same micro-batches), tp x dp, fewer processes.
    ("tp2pp2-to-dp2pp2", "gpt-2l", (4, TP2_PP2), (4, DP2_PP2)),
]
SOURCE = ("gpt", (4, MEGATRON))  # the checkpoint the file and refusal tests look into
# (case id, model the engine trains, optimizer, checkpoint directory, expected error start, text)
# (A checkpoint directory is `_dir(*SOURCE)` or one of `_damage_copies`.)
REFUSALS: list[tuple[str, str, str, str, str, str]] = [
    ("wrong-model", "mlp", "adam", "source", "PlanError", "state was compared"),
    ("wrong-model-same-batch", "gpt-tied", "adam", "source", "PlanError", "has fingerprint"),
    ("wrong-optimizer", "gpt", "sgd", "source", "PlanError", "holds Adam state"),
    ("truncated-manifest", "gpt", "adam", "truncated", "ExecutionError", "is damaged"),
    ("missing-rank-file", "gpt", "adam", "missing", "ExecutionError", "are missing"),
    ("damaged-rank-file", "gpt", "adam", "damaged", "ExecutionError", "is damaged"),
    ("unfinished-save", "gpt", "adam", "unfinished", "ExecutionError", "incomplete"),
    ("old-version", "gpt", "adam", "old-version", "ExecutionError", "version 1, but"),
    ("no-checkpoint", "gpt", "adam", "nowhere", "ExecutionError", "does not exist"),
]

# The resume matrix: a 4-block gpt (vp=2 runs 2 x 2 chunks) on 2 processes, every plan once.
MATRIX_MODEL = "gpt-4l"
MATRIX_PLANS = {
    "dp": "dp",  # 1 micro-batch (4 samples), the pipelines 2 (2 samples): fingerprints differ
    "tp2": "megatron:tp=2,pp=1,dp=1",
    "pp2": PP2_MB2,
    "vp2": "megatron:tp=1,pp=2,dp=1,vp=2/mb2",
    "zero1": "megatron:tp=1,pp=1,dp=2,zero=1",
    "zero2": "megatron:tp=1,pp=1,dp=2,zero=2",
    "cp2": "megatron:tp=1,pp=1,dp=1,cp=2",
    # the mixed recipe: fp32 masters saved from 2 micro-batches, loaded under 1 (whose traced
    # graph's bf16 parameters are not the masters the engine holds)
    "pp2-bf16": f"{PP2_MB2}/bf16",
    "dp-bf16": "dp/bf16",
    # fp32 masters held only as ZeRO-1's shards (runtime.parallel.precision.Weights.release):
    # saved from the shards, loaded into them and into the bf16 copies
    "zero1-bf16": "megatron:tp=1,pp=1,dp=2,zero=1/bf16",
    "dp-fp16": "dp/fp16",  # its dynamic loss scale resumed (steps skipped on overflow)
}
# (plan A, plan B): every plan saved and loaded at least once, and the failing pairs.
MATRIX_SLICE = [
    ("dp", "zero1"), ("dp", "zero2"), ("cp2", "zero1"), ("zero1", "vp2"), ("vp2", "tp2"),
    ("tp2", "pp2"), ("pp2", "cp2"), ("zero2", "dp"), ("pp2-bf16", "dp-bf16"),
    ("dp-bf16", "zero1-bf16"), ("zero1-bf16", "pp2-bf16"), ("dp-fp16", "dp-fp16"),
]  # fmt: skip
# Two plans computing in bf16 round each op's result differently: a loss of theirs may differ
# by a rounding on each side (2 x 2**-8 relative), an fp32 master by one update's rounding of
# those (lr-scaled, far below); bounded together by 2**-6.
BF16_REL_TOL = 2**-6
# Optimizers with elementwise state (not Adam), saved under zero=1 and resumed under dp.
RESUMED_OPTIMIZERS = ("adamw", "sgd", "sgd_momentum")
ZERO1 = MATRIX_PLANS["zero1"].split("/")[0]
V2_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint-v2-mlp-dp"  # Adam, 2 steps
FULL_DISK_LIMIT_BYTES = 1024  # rank 1's rank file of the zero=1 mlp with AdamW is ~4x that


def _extra(plan: str) -> dict[str, Any]:
    """The job state a matrix run saves beside its tensors (what `Manifest.extra` gives back)."""
    return {"plan": plan, "sampler": {"epoch": 0, "next": 16}, "seeds": [7, 8], "lr": 0.5}


def _matrix(root: Path, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Each plan's uninterrupted run (saving after SAVED steps), then the loads of `pairs`
    (each saved again at once). bench/checkpoint_matrix.py runs every pair."""
    runs = [
        _case(f"matrix-{a}", MATRIX_MODEL, (2, s), steps=SAVED + RESUMED, save_at=SAVED,
              save=str(root / f"m-{a}"), extra=_extra(a), state=True)
        for a, s in MATRIX_PLANS.items()
    ]  # fmt: skip
    loads = [
        _case(f"{a}>{b}", MATRIX_MODEL, (2, MATRIX_PLANS[b]), load=str(root / f"m-{a}"),
              resave=str(root / f"m-{a}>{b}"), steps=RESUMED, state=True)
        for a, b in pairs
    ]  # fmt: skip
    return [*runs, *loads]


def _full_disk(root: Path) -> dict[str, Any]:
    """The mlp's zero=1 AdamW checkpoint loaded, one step, saved again over it with rank 1's
    files limited to FULL_DISK_LIMIT_BYTES."""
    at = str(root / "opt-adamw")
    return _case(
        "full-disk", "mlp", (2, ZERO1), optimizer="adamw", load=at, steps=1, save=at,
        limit_file_bytes={1: FULL_DISK_LIMIT_BYTES},
    )  # fmt: skip


def _optimizer_cases(root: Path) -> list[dict[str, Any]]:
    """Each of RESUMED_OPTIMIZERS saved under zero=1 and resumed under dp; a version 2
    checkpoint loaded under zero=1; saves refused: extra state that is not JSON or differs
    between ranks, and Adafactor (not elementwise)."""
    cases = []
    for opt in RESUMED_OPTIMIZERS:
        at = str(root / f"opt-{opt}")
        cases.append(_case(f"save-{opt}", "mlp", (2, ZERO1), optimizer=opt, steps=SAVED, save=at))
        cases.append(_case(f"load-{opt}", "mlp", (2, "dp"), optimizer=opt, load=at, steps=RESUMED))
    refused = {"extra-not-json": {"extra": {"generator": torch.zeros(2)}}, "extra-differs":
               {"extra": "rank"}, "adafactor": {"optimizer": "adafactor", "steps": 1}}  # fmt: skip
    cases += [
        _case(i, "mlp", (2, "dp"), save=str(root / i), **fields) for i, fields in refused.items()
    ]
    cases.append(_case("v2", "mlp", (2, ZERO1), load=str(V2_CHECKPOINT), steps=RESUMED))
    return cases


def _dir(model: str, plan: tuple[int, str]) -> str:
    """A checkpoint's directory name: "gpt-4-megatron-tp-2-dp-2" for (gpt, (4, MEGATRON))."""
    return re.sub(r"\W+", "-", f"{model}-{plan[0]}-{plan[1]}")


def _case(case_id: str, model: str, plan: tuple[int, str], **fields: Any) -> dict[str, Any]:
    zoo_name, kwargs = MODELS[model]
    case: dict[str, Any] = {
        "id": case_id,
        "model": zoo_name,
        "model_kwargs": kwargs,
        "plan": _plan_json(model, *plan),
    }
    case.update({"optimizer": "adam", "lr": LR, "load": None, "steps": 0, "save": None})
    case.update({"state": False, **fields})
    return case


def _resumes(root: Path, world_size: int) -> list[dict[str, Any]]:
    """This world's saves (each plan A once), then its loads (a case's plan B)."""
    saves = {
        (m, a): _case(f"save-{_dir(m, a)}", m, a, steps=SAVED, save=str(root / _dir(m, a)))
        for _, m, a, _ in RESUMES
        if a[0] == world_size
    }
    loads = [
        _case(i, m, b, load=str(root / _dir(m, a)), steps=RESUMED, state=True)
        for i, m, a, b in RESUMES
        if b[0] == world_size
    ]
    return [*saves.values(), *loads]


def _world4(root: Path) -> list[dict[str, Any]]:
    return _resumes(root, 4)


def _world2(root: Path) -> list[dict[str, Any]]:
    ckpt = {"source": _dir(*SOURCE)}
    refusals = [
        _case(i, model, (2, "dp"), optimizer=opt, load=str(root / ckpt.get(name, name)))
        for i, model, opt, name, _, _ in REFUSALS
    ]
    resave = _case(
        "resave", "gpt", (2, "dp"), load=str(root / _dir(*SOURCE)), save=str(root / "resaved")
    )
    foreign = _case("save-over-foreign", "gpt", (2, "dp"), save=str(root / "foreign"))
    matrix = [*_matrix(root, MATRIX_SLICE), *_optimizer_cases(root), _full_disk(root)]
    return [*_resumes(root, 2), *refusals, resave, foreign, *matrix]


def _damage_copies(root: Path) -> None:
    """Damaged copies of the megatron checkpoint, an old checkpoint to be replaced with the
    leftover of a crashed save beside it, and a directory that is no checkpoint."""
    source = root / _dir(*SOURCE)
    names = (
        "truncated",
        "missing",
        "damaged",
        "unfinished",
        "old-version",
        "resaved",
        "resaved.tmp",
    )
    for name in names:
        shutil.copytree(source, root / name)
    text = (source / MANIFEST).read_text()
    (root / "truncated" / MANIFEST).write_text(text[: len(text) // 2])
    (root / "old-version" / MANIFEST).write_text(json.dumps({**json.loads(text), "version": 1}))
    (root / "missing" / "rank00001.pt").unlink()
    data = bytearray((root / "damaged" / "rank00001.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / "damaged" / "rank00001.pt").write_bytes(bytes(data))
    for name in ("unfinished", "resaved.tmp"):
        (root / name / MANIFEST).unlink()  # a save that crashed before publishing
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("not a checkpoint")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    """(checkpoint root, case id -> per-rank results) of both worlds."""
    root = tmp_path_factory.mktemp("checkpoints")
    results: dict[str, list[dict[str, Any]]] = {}
    for world_size, make in ((4, _world4), (2, _world2)):
        if world_size == 2:
            _damage_copies(root)
        cases = make(root)
        per_rank = run_workers(
            run_checkpoint_cases, world_size, (cases,), timeout_s=WORKER_TIMEOUT_S
        )
        results.update({c["id"]: [r[i] for r in per_rank] for i, c in enumerate(cases)})
    return root, results


@cache
def _single_device(
    model: str, optimizer_kind: str = "adam"
) -> tuple[list[float], dict[str, np.ndarray]]:
    """The oracle: losses of SAVED + RESUMED eager steps (Adam, or OPTIMIZERS[optimizer_kind])
    on one device, and the state."""
    module, inputs = _build(model)
    optimizer = OPTIMIZERS[optimizer_kind](module.parameters(), lr=LR)
    losses = []
    for _ in range(SAVED + RESUMED):
        optimizer.zero_grad()
        loss = module(*inputs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: t.detach().numpy().copy() for name, t in module.state_dict().items()}


def _comparable(model: str, name: str, tensor: np.ndarray) -> np.ndarray:
    """The part of a tensor that training determines. GPT's attention key bias adds q.b_k to
    every score of a row, which softmax ignores: its exact gradient is 0, so in fp32 it is
    rounding noise (~1e-9) that Adam, dividing by the noise's own size, turns into steps of up
    to lr either way. Nothing downstream depends on it (the loss is invariant)."""
    if MODELS[model][0] == "gpt" and name.endswith("attn.qkv.bias"):
        hidden = MODELS[model][1]["hidden"]
        return np.concatenate([tensor[:hidden], tensor[2 * hidden :]])
    return tensor


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    diff = np.linalg.norm((got - want).astype(np.float64).ravel())
    return float(diff / max(np.linalg.norm(want.astype(np.float64).ravel()), 1e-30))


# ------------------------------------------------------------------------------------ tests
@pytest.mark.dist
@pytest.mark.parametrize(
    ("case_id", "model", "plan_a", "plan_b"), RESUMES, ids=[r[0] for r in RESUMES]
)
def test_resumed_training_matches_single_device(
    runs: Any, case_id: str, model: str, plan_a: tuple[int, str], plan_b: tuple[int, str]
) -> None:
    _, results = runs
    saved, resumed = results[f"save-{_dir(model, plan_a)}"], results[case_id]
    for result in (*saved, *resumed):
        assert "error" not in result, result["error"]
    want_losses, want_state = _single_device(model)
    got_losses = saved[0]["losses"] + resumed[0]["losses"]
    np.testing.assert_allclose(got_losses, want_losses, rtol=REL_TOL, atol=0)
    got_state = resumed[0]["state"]
    assert set(got_state) == set(want_state)
    bad = {
        name: rel
        for name, want in want_state.items()
        if (rel := _rel(_comparable(model, name, got_state[name]), _comparable(model, name, want)))
        > REL_TOL
    }
    assert not bad, f"tensors differ from uninterrupted single-device training: {bad}"


@pytest.mark.dist
def test_files_hold_each_piece_once_with_its_sbp(runs: Any) -> None:
    root, _ = runs
    manifest = read_manifest(root / _dir(*SOURCE))
    assert (manifest.mesh_shape, manifest.stages) == ((2, 2), ((0, 1, 2, 3),))
    assert (manifest.optimizer_kind, manifest.step, manifest.extra) == ("Adam", SAVED, {})
    entry = manifest.tensors["state/blocks.0.attn.qkv.weight"]
    assert (entry.nd_sbp, entry.stage, entry.pieces) == ("BS(0)", 0, (0, 1, 0, 1))  # B copies once
    assert manifest.tensors["optim/blocks.0.attn.qkv.weight/exp_avg"].nd_sbp == "BS(0)"
    assert manifest.tensors["optim/blocks.0.attn.qkv.weight/step"].shape == ()
    files = {
        f.rank: torch.load(root / _dir(*SOURCE) / f.name, weights_only=True) for f in manifest.files
    }
    assert sorted(files) == [0, 1]  # ranks 2 and 3 hold only copies of what 0 and 1 saved
    assert not list(root.glob("*.tmp")) and not list(root.glob("*.old"))
    # The two saved pieces are the plan's shards of one tensor (rank 1 holds the second half).
    key = "state/blocks.0.attn.qkv.weight"
    whole = torch.cat([files[0][key], files[1][key]])
    piece = shard_tensor(whole, parse_nd_sbp(entry.nd_sbp), Mesh((2, 2)), (0, 1))
    assert torch.equal(piece, files[1][key])


@pytest.mark.dist
@pytest.mark.parametrize(
    ("model", "plan"), [("gpt-4l", (2, PP2_MB2)), ("gpt-2l", (4, TP2_PP2))], ids=["pp2", "tp2pp2"]
)
def test_staged_files_hold_each_stage_pieces_once(
    runs: Any, model: str, plan: tuple[int, str]
) -> None:
    root, _ = runs
    manifest = read_manifest(root / _dir(model, plan))
    assert len(manifest.stages) == 2 and manifest.micro_batches == int(plan[1][-1])
    # Every tensor is saved by its owning stage: its pieces lie in that stage's rank files.
    owners = {e.stage for e in manifest.tensors.values()}
    assert owners == {0, 1}
    assert all(set(e.pieces) <= set(manifest.stages[e.stage]) for e in manifest.tensors.values())
    # One parameter group for the whole model, though each stage has its own optimizer.
    params = {name for name, _ in _build(model)[0].named_parameters()}
    assert [set(g["params"]) for g in manifest.param_groups] == [params]
    # A rank file holds exactly the pieces the manifest names it for (so only its stage's).
    for record in manifest.files:
        held = torch.load(root / _dir(model, plan) / record.name, weights_only=True)
        assert set(held) == {k for k, e in manifest.tensors.items() if record.rank in e.pieces}


@pytest.mark.dist
def test_save_replaces_an_old_checkpoint_atomically(runs: Any) -> None:
    root, results = runs
    assert all("error" not in r for r in results["resave"]), results["resave"][0]
    manifest = json.loads((root / "resaved" / MANIFEST).read_text())
    assert manifest["plan"]["mesh_shape"] == [2]  # the new dp checkpoint, not the old copy
    # dp holds everything B: rank 0 alone writes, and nothing of the old 4-rank copy is left.
    assert sorted(p.name for p in (root / "resaved").iterdir()) == [MANIFEST, "rank00000.pt"]
    assert not (root / "resaved.tmp").exists() and not (root / "resaved.old").exists()


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case_id", "error", "text"),
    [(r[0], r[4], r[5]) for r in REFUSALS],
    ids=[r[0] for r in REFUSALS],
)
def test_load_refuses_bad_checkpoints(runs: Any, case_id: str, error: str, text: str) -> None:
    _, results = runs
    for result in results[case_id]:
        assert "error" in result and result["error"].startswith(error), result
        assert text in result["error"]


@pytest.mark.dist
def test_save_refuses_to_replace_a_non_checkpoint(runs: Any) -> None:
    root, results = runs
    for result in results["save-over-foreign"]:
        assert "error" in result and "is not a checkpoint" in result["error"], result
    assert (root / "foreign" / "notes.txt").read_text() == "not a checkpoint"


def _whole_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (state and optimizer), assembled whole from its pieces."""
    manifest = read_manifest(directory)
    files = {f.rank: torch.load(directory / f.name, weights_only=True) for f in manifest.files}
    out = {}
    for key, entry in manifest.tensors.items():
        mesh = Mesh(manifest.mesh_shape, device_ids=manifest.stages[entry.stage])
        pieces = [files[rank][key] for rank in entry.pieces]
        out[key] = assemble_tensor(pieces, parse_nd_sbp(entry.nd_sbp), mesh)
    return out


@dataclass(frozen=True)
class Resumed:
    """What a matrix pair shows: whether the checkpoint saved again under B right after the
    load holds exactly A's tensors; whether A's state after SAVED steps is B's bit for bit;
    how A's losses then B's resumed ones differ from B's uninterrupted run (largest relative
    difference; whether B's resumed ones are equal bit for bit), and B's final state (the
    same)."""

    converted_exactly: bool
    same_state: bool
    losses_rel: float
    losses_equal: bool
    state_rel: float
    state_equal: bool


def resumed(root: Path, results: dict[str, list[dict[str, Any]]], a: str, b: str) -> Resumed:
    """The matrix pair (a, b) of a world's results (every run's error raised first)."""
    ran, loaded, uninterrupted = (results[k] for k in (f"matrix-{a}", f"{a}>{b}", f"matrix-{b}"))
    for result in (*ran, *loaded, *uninterrupted):
        assert "error" not in result, result["error"]
    saved, again = _whole_tensors(root / f"m-{a}"), _whole_tensors(root / f"m-{a}>{b}")
    at_b = _whole_tensors(root / f"m-{b}")
    got = np.array(ran[0]["losses"][:SAVED] + loaded[0]["losses"])
    want = np.array(uninterrupted[0]["losses"])
    states = [
        tuple(_comparable(MATRIX_MODEL, n, t) for t in (loaded[0]["state"][n], want_t))
        for n, want_t in uninterrupted[0]["state"].items()
    ]
    return Resumed(
        converted_exactly=_same_tensors(saved, again),
        same_state=_same_tensors(saved, at_b),
        losses_rel=float(np.max(np.abs(got / want - 1))),
        losses_equal=bool(np.array_equal(got[SAVED:], want[SAVED:])),
        state_rel=max(_rel(g, w) for g, w in states),
        state_equal=all(np.array_equal(g, w) for g, w in states),
    )


def _same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("source", "target"), MATRIX_SLICE, ids=[f"{a}>{b}" for a, b in MATRIX_SLICE]
)
def test_a_resume_under_another_plan_continues_the_uninterrupted_run(
    runs: Any, source: str, target: str
) -> None:
    root, results = runs
    found = resumed(root, results, source, target)
    loaded = results[f"{source}>{target}"][0]
    assert (loaded["step"], loaded["extra"]) == (SAVED, _extra(source))
    # (1) The conversion is exact: saved again under B at once, the checkpoint is A's.
    assert found.converted_exactly
    # (2) B's steps continue B's uninterrupted run: bit for bit where A's state after SAVED
    # steps is B's bit for bit (the checkpoints; their losses may agree where states do not),
    # A's losses before within the plans' rounding of B's.
    tolerance = BF16_REL_TOL if MATRIX_PLANS[target].endswith("16") else REL_TOL
    assert found.losses_rel <= tolerance and found.state_rel <= tolerance, found
    if found.same_state:
        assert found.losses_equal and found.state_equal, found


@pytest.mark.dist
def test_a_save_on_a_full_disk_leaves_no_tmp_and_the_last_checkpoint_intact(runs: Any) -> None:
    root, results = runs
    for rank, result in enumerate(results["full-disk"]):
        error = result.get("error", "")
        assert error.startswith("ExecutionError"), result
        assert "rank 1 failed" in error or rank == 1, error
        assert "writing rank00001.pt" in error and "This checkpoint was not saved" in error, error
        assert "Free space" in error, error
    assert not list(root.glob("*.tmp")) and not list(root.glob("*.old"))
    manifest = read_manifest(root / "opt-adamw")  # the step-2 checkpoint, every file whole
    assert manifest.step == SAVED
    for record in manifest.files:
        data = (root / "opt-adamw" / record.name).read_bytes()
        assert hashlib.sha256(data).hexdigest() == record.sha256, record.name


@pytest.mark.dist
@pytest.mark.parametrize("kind", RESUMED_OPTIMIZERS)
def test_any_elementwise_optimizer_resumes_under_another_plan(runs: Any, kind: str) -> None:
    """Saved under zero=1 (the states split over dp), resumed under dp (whole): one device's
    losses. Each oracle is told apart from Adam's."""
    root, results = runs
    saved, resumed = results[f"save-{kind}"], results[f"load-{kind}"]
    for result in (*saved, *resumed):
        assert "error" not in result, result["error"]
    manifest = read_manifest(root / f"opt-{kind}")
    assert (manifest.optimizer_kind, manifest.step) == (
        type(OPTIMIZERS[kind]([torch.zeros(1)])).__name__,
        SAVED,
    )
    want, _ = _single_device("mlp", kind)
    np.testing.assert_allclose(saved[0]["losses"] + resumed[0]["losses"], want, rtol=REL_TOL)
    assert want[SAVED:] != pytest.approx(_single_device("mlp")[0][SAVED:], rel=REL_TOL)


@pytest.mark.dist
def test_a_version_2_checkpoint_still_loads(runs: Any) -> None:
    """Written by the release before (Adam's step was its step count; no extra state)."""
    _, results = runs
    for result in results["v2"]:
        assert "error" not in result, result["error"]
        assert (result["step"], result["extra"]) == (SAVED, {})
    want, _ = _single_device("mlp")
    np.testing.assert_allclose(results["v2"][0]["losses"], want[SAVED:], rtol=REL_TOL)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("case_id", "text"),
    [
        ("extra-not-json", "extra['generator'] (a Tensor) is not JSON"),
        ("extra-differs", "rank 1 passed step and extra"),
        ("adafactor", "Adafactor is not elementwise"),
    ],
)
def test_save_refuses_state_it_cannot_hold(runs: Any, case_id: str, text: str) -> None:
    root, results = runs
    for result in results[case_id]:
        assert result.get("error", "").startswith("ExecutionError"), result
        assert text in result["error"], result["error"]
    assert not (root / case_id).exists() and not (root / f"{case_id}.tmp").exists()


@pytest.mark.parametrize(
    "name",
    ["../../../../../etc/hostname", "/etc/hostname", "..", "sub/rank00000.pt", "link.pt"],
    ids=["dot-dot", "absolute", "parent", "subfolder", "symlink-out"],
)
def test_manifest_file_names_stay_in_the_checkpoint(tmp_path: Path, name: str) -> None:
    (tmp_path / "link.pt").symlink_to("/etc/hostname")
    manifest = {**ESCAPING_MANIFEST, "files": [{**ESCAPING_MANIFEST["files"][0], "name": name}]}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ExecutionError, match="is not a file of"):
        read_manifest(tmp_path)

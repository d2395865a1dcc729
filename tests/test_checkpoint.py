"""Checkpoints: saved under plan A, loaded under plan B, training continues as if uninterrupted.

Oracle: gpt (tiny) trained on one device for SAVED + RESUMED Adam steps. A run that trains
SAVED steps under plan A, saves, loads under plan B (other mesh, other SBPs, other world size)
and trains RESUMED more must give the same losses at every step and the same parameters at the
end (fp32, rel <= 1e-5; GPT's attention key bias is left out of the parameter check, see
tests/test_runtime.py `_comparable`). Also: the files (one per rank, `weights_only` loadable, B
copies saved once, a manifest with SBPs and the optimizer's step), atomic replacement of an old
checkpoint, and clear errors for another model, another optimizer, a truncated manifest, a
missing or damaged rank file, an unfinished save, and saving over a directory that is not one.

How it runs: two `run_workers` calls. 4 processes train and save under megatron:tp=2,dp=2
(mesh 2x2) and fsdp (mesh 4), and load the fsdp checkpoint under auto (4 processes); then the
parent damages copies of the megatron checkpoint, and 2 processes load it under dp and try
every bad input. Lives elsewhere: the workers (tests/checkpoint_workers.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from autosbp.layout import shard_tensor
from autosbp.sbp import Mesh, parse_nd_sbp
from costmodel.launch import run_workers
from runtime.checkpoint import MANIFEST, read_manifest
from tests.checkpoint_workers import run_checkpoint_cases
from tests.oracle import train_single_device
from tests.test_runtime import MEGATRON, MODELS, _build, _comparable, _plan_json, _rel

SAVED, RESUMED = 2, 2
LR = 1e-2
REL_TOL = 1e-5
WORKER_TIMEOUT_S = 120.0
# (case id, plan A (world, strategy), plan B (world, strategy)): resume pairs.
RESUMES: list[tuple[str, tuple[int, str], tuple[int, str]]] = [
    ("megatron4-to-dp2", (4, MEGATRON), (2, "dp")),
    ("fsdp4-to-auto4", (4, "fsdp"), (4, "auto")),
]
# (case id, model the engine trains, optimizer, checkpoint directory, expected error start, text)
REFUSALS: list[tuple[str, str, str, str, str, str]] = [
    ("wrong-model", "mlp", "adam", "megatron", "PlanError", "fingerprint"),
    ("wrong-optimizer", "gpt", "sgd", "megatron", "PlanError", "holds Adam state"),
    ("truncated-manifest", "gpt", "adam", "truncated", "ExecutionError", "is damaged"),
    ("missing-rank-file", "gpt", "adam", "missing", "ExecutionError", "are missing"),
    ("damaged-rank-file", "gpt", "adam", "damaged", "ExecutionError", "is damaged"),
    ("unfinished-save", "gpt", "adam", "unfinished", "ExecutionError", "incomplete"),
    ("no-checkpoint", "gpt", "adam", "nowhere", "ExecutionError", "does not exist"),
]


def _dir(strategy: str) -> str:
    """A checkpoint's directory name: the strategy without its degrees ("megatron")."""
    return strategy.split(":")[0]


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


def _world4(root: Path) -> list[dict[str, Any]]:
    saves = {
        a: _case(f"save-{a[1]}", "gpt", a, steps=SAVED, save=str(root / _dir(a[1])))
        for _, a, _ in RESUMES
    }
    loads = [
        _case(i, "gpt", b, load=str(root / _dir(a[1])), steps=RESUMED, state=True)
        for i, a, b in RESUMES
        if b[0] == 4
    ]
    return [*saves.values(), *loads]


def _world2(root: Path) -> list[dict[str, Any]]:
    loads = [
        _case(i, "gpt", b, load=str(root / _dir(a[1])), steps=RESUMED, state=True)
        for i, a, b in RESUMES
        if b[0] == 2
    ]
    refusals = [
        _case(i, model, (2, "dp"), optimizer=opt, load=str(root / ckpt))
        for i, model, opt, ckpt, _, _ in REFUSALS
    ]
    resave = _case(
        "resave", "gpt", (2, "dp"), load=str(root / "megatron"), save=str(root / "resaved")
    )
    foreign = _case("save-over-foreign", "gpt", (2, "dp"), save=str(root / "foreign"))
    return [*loads, *refusals, resave, foreign]


def _damage_copies(root: Path) -> None:
    """Damaged copies of the megatron checkpoint, an old checkpoint to be replaced with the
    leftover of a crashed save beside it, and a directory that is no checkpoint."""
    source = root / "megatron"
    for name in ("truncated", "missing", "damaged", "unfinished", "resaved", "resaved.tmp"):
        shutil.copytree(source, root / name)
    text = (source / MANIFEST).read_text()
    (root / "truncated" / MANIFEST).write_text(text[: len(text) // 2])
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


def _single_device(steps: int) -> tuple[list[float], dict[str, np.ndarray]]:
    return train_single_device(*_build("gpt"), steps=steps, lr=LR)


# ------------------------------------------------------------------------------------ tests
@pytest.mark.dist
@pytest.mark.parametrize(("case_id", "plan_a", "plan_b"), RESUMES, ids=[r[0] for r in RESUMES])
def test_resumed_training_matches_single_device(
    runs: Any, case_id: str, plan_a: tuple[int, str], plan_b: tuple[int, str]
) -> None:
    _, results = runs
    saved, resumed = results[f"save-{plan_a[1]}"], results[case_id]
    for result in (*saved, *resumed):
        assert "error" not in result, result["error"]
    want_losses, want_state = _single_device(SAVED + RESUMED)
    got_losses = saved[0]["losses"] + resumed[0]["losses"]
    np.testing.assert_allclose(got_losses, want_losses, rtol=REL_TOL, atol=0)
    got_state = resumed[0]["state"]
    assert set(got_state) == set(want_state)
    bad = {
        name: rel
        for name, want in want_state.items()
        if (rel := _rel(_comparable("gpt", name, got_state[name]), _comparable("gpt", name, want)))
        > REL_TOL
    }
    assert not bad, f"tensors differ from uninterrupted single-device training: {bad}"


@pytest.mark.dist
def test_files_hold_each_piece_once_with_its_sbp(runs: Any) -> None:
    root, _ = runs
    manifest = read_manifest(root / "megatron")
    assert (manifest.mesh_shape, manifest.device_ids) == ((2, 2), (0, 1, 2, 3))
    assert (manifest.optimizer_kind, manifest.optimizer_step) == ("Adam", SAVED)
    entry = manifest.tensors["state/blocks.0.attn.qkv.weight"]
    assert (entry.nd_sbp, entry.pieces) == ("BS(0)", (0, 1, 0, 1))  # B copies saved once
    assert manifest.tensors["optim/blocks.0.attn.qkv.weight/exp_avg"].nd_sbp == "BS(0)"
    assert manifest.tensors["optim/blocks.0.attn.qkv.weight/step"].shape == ()
    files = {
        f.rank: torch.load(root / "megatron" / f.name, weights_only=True) for f in manifest.files
    }
    assert sorted(files) == [0, 1]  # ranks 2 and 3 hold only copies of what 0 and 1 saved
    assert not list(root.glob("*.tmp")) and not list(root.glob("*.old"))
    # The two saved pieces are the plan's shards of one tensor (rank 1 holds the second half).
    key = "state/blocks.0.attn.qkv.weight"
    whole = torch.cat([files[0][key], files[1][key]])
    piece = shard_tensor(whole, parse_nd_sbp(entry.nd_sbp), Mesh((2, 2)), (0, 1))
    assert torch.equal(piece, files[1][key])


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

"""Damaged plans and profiles, and models that cannot train: the corpus the bad-input tests
(tests/cli/test_bad_inputs.py) and the robustness probe (bench/robustness.py) share.

Lives here: `PLAN_EDITS` (name -> the plan it edits: "dp" (one stage) or "pp" (two stages of an
mlp with at least 3 blocks), or "cp" (the zoo gpt under megatron:cp=2: attention exchanges keys
and values inside the op, as the plan states), and the edit of its JSON), `PROFILE_EDITS`, `MODELS` (a user model
file, bad_models.py), `ESCAPING_MANIFEST`, and `write_corpus`, which writes them all as files
next to the two plans. Lives elsewhere: what each must give (the tests' tables), making the two
plans (the callers).

Every edit makes a plan that `autosbp plan` never writes: inconsistent in itself (devices,
meshes, stages, layouts, numbers), against its model (nodes, data flow, parameters, batch, the
collectives an op runs inside itself), newer than this autosbp writes, or not a plan at all
(NaN, 10^400, 2.0 devices, control characters, 100,000 brackets).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autosbp.plan import VERSION

__all__ = ["ESCAPING_MANIFEST", "MODELS", "PLAN_EDITS", "PROFILE_EDITS", "write_corpus"]

MODELS = """
import os
import sys

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return (self.fc(x) - y).pow(2).mean()


class NoParams(nn.Module):
    def forward(self, x, y):
        return (x - y).pow(2).mean()


class Unused(Net):
    def forward(self, x, y):
        return (x - y).pow(2).mean()


class ValidConv(nn.Module):  # a patch embedding as SigLIP's: conv2d.padding, padding="valid"
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, 4, padding="valid")
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(self.patch(x).flatten(2).transpose(1, 2)).pow(2).mean()


class Nonzero(Net):
    def forward(self, x, y):
        h = self.fc(x)
        return h[h.nonzero()[:, 0]].sum() + (h - y).pow(2).mean()


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def noparams():
    return NoParams(), _data()


def unused():
    return Unused(), _data()


def nonzero():
    return Nonzero(), _data()


def validconv():
    return ValidConv(), (torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(0)),)


def exits():
    sys.exit(3)


def exits0():
    os._exit(0)  # ends the process at once: no exception, no atexit


def unseeded():
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # each process draws its own
    return Net(), _data()
"""

Edit = Callable[[dict[str, Any]], None]


def _set(path: str, value: object) -> Edit:
    """Set the field at `path` ("a/b/0/c": keys, and list indices) to `value`."""

    def edit(data: dict[str, Any]) -> None:
        *keys, last = path.split("/")
        node: Any = data
        for key in keys:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = value

    return edit


def _blocks(data: dict[str, Any]) -> int:
    return sum(1 for name in data["params"] if name.endswith(".fc.weight"))


def _head_to_stage0(data: dict[str, Any]) -> None:
    """The mlp's head (its last linear) on stage 0: the last block (stage 1) feeds it, and it
    feeds the loss (stage 1): data flowing 0 -> 1 -> 0 -> 1."""
    for name in ("p_head_weight", "p_head_bias", f"linear_{_blocks(data) + 1}"):
        data["nodes"][name]["stage"] = 0
    for name in ("head.weight", "head.bias"):
        data["params"][name]["stage"] = 0


def _param_layout_s0(data: dict[str, Any]) -> None:
    """inp.weight S(0) in the parameter table (and its optimizer state and gradient), B in its
    node."""
    data["params"]["inp.weight"].update(sbp="S(0)", optimizer_state_sbp="S(0)", gradient_sbp="S(0)")


def _all_on_stage0(data: dict[str, Any]) -> None:
    for entry in (*data["nodes"].values(), *data["params"].values()):
        entry["stage"] = 0


def _delete_block1(data: dict[str, Any]) -> None:
    for name in ("p_blocks_1_fc_weight", "p_blocks_1_fc_bias", "linear_2", "gelu_2"):
        del data["nodes"][name]


ATTENTION = "scaled_dot_product_attention"  # the cp plan's first attention (it exchanges k, v)


def _exchanges_removed(data: dict[str, Any]) -> None:
    del data["nodes"][ATTENTION]["exchanges"]


def _exchanges_swapped(data: dict[str, Any]) -> None:
    data["nodes"][ATTENTION]["exchanges"].reverse()


def _exchanges_added(data: dict[str, Any]) -> None:
    """The attention's collectives stated on the linear before it, which runs none."""
    data["nodes"]["linear"]["exchanges"] = data["nodes"][ATTENTION]["exchanges"]


PLAN_EDITS: dict[str, tuple[str, Edit]] = {
    "cycle": ("pp", _head_to_stage0),
    "mesh3": ("dp", _set("mesh/shape", [3])),
    "dupdev": ("dp", _set("stages/0/devices", [0, 0])),
    "devrange": ("dp", _set("stages/0/devices", [0, 5])),
    "nostage": ("pp", _set("nodes/gelu/stage", 7)),
    "paramsbp": ("dp", _param_layout_s0),
    "paramstage": ("pp", _set("params/head.weight/stage", 0)),
    "emptystage": ("pp", _all_on_stage0),
    "deleted": ("pp", _delete_block1),
    "stagemesh": ("dp", _set("stages/0/mesh_shape", [1])),
    "meshdims": ("dp", _set("mesh/dims", ["d0", "d1"])),
    "mb3": ("dp", _set("micro_batches", 3)),
    "badsig": ("dp", _set("nodes/gelu/outputs", ["S(1)"])),
    "mb1e7": ("pp", _set("micro_batches", 10**7)),
    "dev1e7": ("dp", _set("cluster/devices", 10**7)),
    "nan": ("dp", _set("predicted/step_time_s", float("nan"))),
    "inf": ("pp", _set("stages/0/forward_s", float("inf"))),
    "mem400": ("dp", _set("cluster/memory_limit_bytes", 10**400)),
    "batch30": ("dp", _set("global_batch", 10**30)),
    "batch16": ("dp", _set("global_batch", 16)),
    "optsbp": ("dp", _set("params/inp.weight/optimizer_state_sbp", "S(7)")),
    "devfloat": ("dp", _set("cluster/devices", 2.0)),
    "escape": ("dp", _set("model/name", "mlp\x1b[2J\x1b]0;owned\x07")),
    "block99": ("pp", _set("stages/1/blocks", [1, 99])),
    "tiedangling": ("dp", _set("nodes/p_blocks_1_fc_weight/tied_to", "nosuch")),
    "longname": ("dp", _set("model/name", "m" * 1_000_000)),
    "vnext": ("dp", _set("version", VERSION + 1)),  # written by a newer autosbp
    "exchanges-removed": ("cp", _exchanges_removed),
    "exchanges-swapped": ("cp", _exchanges_swapped),
    "exchanges-added": ("cp", _exchanges_added),
}
PROFILE_EDITS: dict[str, tuple[tuple[str, ...], float]] = {
    "nan-bandwidth": (
        ("links", "intra_node", "collectives", "all_reduce", "bus_bandwidth"),
        float("nan"),
    ),
    "inf-memory-bandwidth": (("device", "memory_bandwidth"), float("inf")),
    "nan-flops": (("device", "peak_flops", "fp32"), float("nan")),
    "1e300-flops": (("device", "peak_flops", "fp32"), 1e300),
}


# A checkpoint manifest of 1 rank that names /etc/hostname through `..` (the rest is valid).
ESCAPING_MANIFEST: dict[str, Any] = {
    "format": "autosbp.checkpoint", "version": 2,
    "model": {"name": "mlp", "fingerprint": "0"},
    "plan": {"strategy": "dp", "mesh_shape": [1], "stages": [[0]], "micro_batches": 1,
             "global_batch": 8},
    "optimizer": {"kind": "Adam", "step": 1, "param_groups": []},
    "files": [{"rank": 0, "name": "../../../../../etc/hostname", "size_bytes": 1, "sha256": "0"}],
    "tensors": {},
}  # fmt: skip


# A checkpoint folder's lock held by a job on another host (runtime.state.checkpoint_lock).
LOCK_ELSEWHERE: dict[str, Any] = {
    "host": "elsewhere.example", "pid": 4242, "started": None, "since": "2026-12-07 10:00:00",
}  # fmt: skip


def _duplicated_param(plan: dict[str, Any], name: str) -> str:
    """`plan`'s JSON text with parameter `name` listed three times, with three SBPs (a JSON
    reader would keep the last one silently)."""
    entry = plan["params"][name]
    pairs = [*plan["params"].items()] + [(name, {**entry, "sbp": sbp}) for sbp in ("S(0)", "S(1)")]
    params = ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in pairs)
    return json.dumps({**plan, "params": "@params"}).replace('"@params"', "{" + params + "}")


def write_corpus(root: Path, plans: dict[str, dict[str, Any]], profile: dict[str, Any]) -> None:
    """plan-<name>.json for every PLAN_EDITS (from `plans`: "dp", "pp", "cp" -> plan JSON), plan-nested.json
    (100,000 brackets deep), plan-dupparams.json (a parameter listed three times), profile-<name>.json for every PROFILE_EDITS (from `profile`),
    bad_models.py (MODELS), ckpt-escape/manifest.json (ESCAPING_MANIFEST),
    ckpt-negstep/manifest.json (the same, naming its own rank file, at step -7),
    ckpt-newer/manifest.json (version 4), ckpt-badextra/manifest.json (version 3 whose extra
    state is a list), ckpt-locked.lock (LOCK_ELSEWHERE) and ckpt-badlock.lock (not JSON)."""
    (root / "bad_models.py").write_text(MODELS)
    (root / "ckpt-escape").mkdir()
    (root / "ckpt-escape" / "manifest.json").write_text(json.dumps(ESCAPING_MANIFEST))
    negative = {**ESCAPING_MANIFEST, "optimizer": {**ESCAPING_MANIFEST["optimizer"], "step": -7}}
    negative["files"] = [{**ESCAPING_MANIFEST["files"][0], "name": "rank00000.pt"}]
    (root / "ckpt-negstep").mkdir()
    (root / "ckpt-negstep" / "manifest.json").write_text(json.dumps(negative))
    own_file = {**ESCAPING_MANIFEST, "files": negative["files"]}
    manifests = {
        "ckpt-newer": {**own_file, "version": 4},
        "ckpt-badextra": {**own_file, "version": 3, "training": {"step": 1, "extra": [1]}},
    }
    for name, manifest in manifests.items():
        (root / name).mkdir()
        (root / name / "manifest.json").write_text(json.dumps(manifest))
    (root / "ckpt-locked.lock").write_text(json.dumps(LOCK_ELSEWHERE))
    (root / "ckpt-badlock.lock").write_text("{")
    for name, (base, edit) in PLAN_EDITS.items():
        data = json.loads(json.dumps(plans[base]))
        edit(data)
        (root / f"plan-{name}.json").write_text(json.dumps(data))
    (root / "plan-nested.json").write_text("[" * 100_000 + "]" * 100_000)
    (root / "plan-dupparams.json").write_text(_duplicated_param(plans["dp"], "inp.weight"))
    for name, (path, value) in PROFILE_EDITS.items():
        data = json.loads(json.dumps(profile))
        node = data
        for key in path:
            node = node[key]
        node["value"] = value
        (root / f"profile-{name}.json").write_text(json.dumps(data))

"""A corpus of bad inputs to the CLI and the API: each gives one clear error, and nothing else.

Every case asserts: a one-paragraph message that names the cause and the fix (key words of
both), no traceback (nor torch's own failure report, nor an escape sequence from an input file)
in the output, a non-zero exit code (CLI) or an `AutosbpError` subclass (API), and nothing
written (the working directory, where `plan` would write its --out, stays empty). One model with
an op that has no SBP rule is the exception that proves the rule: it warns, naming the op, and
still plans.

The issue "Real jobs" (#18) adds every class it found, from the corpus shared with
bench/robustness.py (tests/support/bad_inputs_corpus.py): plans inconsistent in themselves or with their
model (refused before any process starts, never a hang or a rank's traceback), numbers that are
not numbers (NaN, Infinity, 10^400, 2.0 devices) in plans and profiles, files nested 100,000
deep, control characters, models that cannot train, checkpoint arguments and a manifest naming
a file outside its folder; and the sizes `show` refuses to simulate or draw.

Speed: tiny zoo models (mlp at defaults), the plans made once per module, and no process is
launched (a fake launcher fails the test if `train` gets that far).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import autosbp
from autosbp.boxing import plan_boxing
from autosbp.cli import main
from autosbp.errors import AutosbpError, CaptureError, PlanError, ProfileError, SbpError
from autosbp.layout import shard_tensor
from autosbp.plan import VERSION, Plan, load_plan, save_plan
from autosbp.rules import UnknownOpWarning
from autosbp.sbp import Mesh, P, S, parse_nd_sbp
from autosbp.timeline import Event, draw_timelines, predicted_events
from autosbp.zoo import build_model, load_model, parse_model_args
from costmodel import load_profile, save_profile
from costmodel.profile_codec import profile_from_dict
from launching.errors import ExecutionError
from runtime.state.checkpoint_format import read_manifest
from runtime.state.checkpoint_lock import hold_checkpoint_dir
from tests.plan.test_plan_json import sample_plan
from tests.support.bad_inputs_corpus import write_corpus

REPO = Path(__file__).resolve().parents[2]

USER_MODELS = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y):
        return (self.fc(x) - y).pow(2).mean()


class NoLoss(Net):
    def forward(self, x, y):
        return self.fc(x) - y


class Branchy(Net):
    def forward(self, x, y):
        h = self.fc(x)
        if h.sum() > 0:
            h = h * 2
        return (h - y).pow(2).mean()


class Unknown(Net):
    def forward(self, x, y):
        return (self.fc(x) - y).pow(2).mean() + torch.prod(self.fc(x).tanh())


def _data():
    return torch.randn(8, 4), torch.randn(8, 4)


def wrong():
    return 42


def raises():
    raise ValueError("width must be even")


def noloss():
    return NoLoss(), _data()


def branchy():
    return Branchy(), _data()


def unknown():
    return Unknown(), _data()


def too_few_inputs():
    return Net(), _data()[:1]


def wrong_shape():
    return Net(), (torch.randn(8, 3), torch.randn(8, 4))
"""

# Output that means an internal report leaked: a Python traceback, torch.export's partial graph,
# or an escape sequence from an input file reaching the terminal.
LEAKS = ("Traceback", "def forward(", "\x1b")
PP = "megatron:tp=1,pp=2,dp=1"  # the two-stage plan the corpus edits (mlp: 3 blocks)
CP = "megatron:tp=1,pp=1,dp=1,cp=2"  # the plan whose attention exchanges the corpus edits (gpt)
VP = "megatron:tp=1,pp=2,dp=1,vp=2"  # interleaved: 2 chunks per device (mlp with 4 blocks)
TP = "megatron:tp=2,pp=1,dp=1"


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def inputs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The user model file, a real plan (mlp on 2 devices) and damaged plans and profiles."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "models.py").write_text(USER_MODELS)
    (root / "data.py").write_text(USER_DATA)
    model, inputs = build_model("mlp")
    plan = autosbp.auto_parallelize(model, inputs, devices=2, time_limit_s=10)
    good = save_plan(plan, root / "plan.json")
    _write_damaged(root, "plan", good.read_text())
    _write_damaged(root, "profile", (REPO / "costmodel" / "profiles" / "cpu-gloo.json").read_text())
    plans = {
        name: autosbp.auto_parallelize(*made, devices=2, strategy=s, time_limit_s=10).to_json()
        for name, made, s in (("dp", (model, inputs), "dp"), ("pp", (model, inputs), PP),
                              ("cp", build_model("gpt"), CP))
    }  # fmt: skip
    profile = json.loads((REPO / "costmodel" / "profiles" / "cpu-gloo.json").read_text())
    write_corpus(root, plans, profile)
    return root


def _write_damaged(root: Path, kind: str, text: str) -> None:
    """{kind}-truncated/-malformed/-foreign/-v99/-list.json, and profile-nodevice.json."""
    data = json.loads(text)
    (root / f"{kind}-truncated.json").write_text(text[: len(text) // 3])
    (root / f"{kind}-malformed.json").write_text('{"format": "x",, "version": 1}')
    (root / f"{kind}-foreign.json").write_text(json.dumps({"hello": "world"}))
    (root / f"{kind}-v99.json").write_text(json.dumps({**data, "version": 99}))
    (root / f"{kind}-list.json").write_text("[1, 2]")
    if kind == "profile":
        (root / "profile-nodevice.json").write_text(
            json.dumps({k: v for k, v in data.items() if k != "device"})
        )
    else:
        first = next(iter(data["nodes"]))
        data["nodes"][first]["inputs"] = ["X(3)"]
        (root / "plan-badsbp.json").write_text(json.dumps(data))


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty working directory (where a default --out would land); launching is forbidden."""
    import runtime.jobs

    def no_launch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a bad input reached the process launcher")

    monkeypatch.setattr(runtime.jobs, "run_workers", no_launch)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "250")
    return tmp_path


def _run_cli(argv: list[str]) -> int:
    """`main(argv)`; argparse's usage errors (SystemExit) count as the exit code they carry."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def _assert_words(message: str, words: tuple[str, ...]) -> None:
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


# ------------------------------------------------------------------------------ CLI cases
TRAIN = ["train", "mlp", "--nproc", "2", "--plan"]  # + a plan file
TRAIN_GPT = ["train", "gpt", "--nproc", "2", "--plan"]  # + a plan file edited from the cp plan
PLAN_MLP4 = ["plan", "mlp", "--model-args", "layers=4", "--devices", "2", "--strategy"]
# (argv, cause words, fix words). {in} is the inputs directory; the working directory is empty.
USER_DATA = """
import torch


def raises():
    raise ValueError("no such corpus")


def number():
    return 3


def _samples(n, x_shape=(32,), dtype=torch.float32):
    return [(torch.zeros(x_shape, dtype=dtype), torch.zeros(8)) for _ in range(n)]


def wrong_shape():
    return _samples(64, x_shape=(5,))


def wrong_dtype():
    return _samples(64, dtype=torch.int64)


def too_small():
    return _samples(3)
"""

CLI_CASES = [
    # models
    pytest.param(
        ["capture", "{in}/missing.py:make"], ("does not exist",), ("check the path",),
        id="capture-missing-model-file",
    ),
    pytest.param(
        ["capture", "{in}/models.py:nothere"], ("has no function 'nothere'",),
        ("Name one that returns (model, example_inputs)",), id="capture-file-without-function",
    ),
    pytest.param(
        ["capture", "{in}/models.py:wrong"], ("returned an int",),
        ("must return a pair (model, example_inputs)",), id="capture-function-returns-int",
    ),
    pytest.param(
        ["capture", "{in}/models.py:raises"], ("failed with ValueError: width must be even",),
        ("Fix the function",), id="capture-function-raises",
    ),
    pytest.param(
        ["plan", "{in}/models.py:noloss", "--devices", "2"], ("returns a tensor of shape [8, 4]",),
        ("forward must return the scalar training loss",), id="plan-no-scalar-loss",
    ),
    pytest.param(
        ["plan", "{in}/models.py:branchy", "--devices", "2"],
        ("`if` on a tensor value", "models.py:"), ("torch.where",), id="plan-data-dependent-if",
    ),
    pytest.param(
        ["plan", "{in}/models.py:too_few_inputs", "--devices", "2"],
        ("cannot take the 1 example input(s)", "missing a required argument: 'y'"),
        ("one example tensor per forward argument",), id="plan-too-few-example-inputs",
    ),
    pytest.param(
        ["plan", "{in}/models.py:wrong_shape", "--devices", "2"],
        ("failed while forward was traced", "[8, 3]"), ("runs without capture",),
        id="plan-example-input-wrong-shape",
    ),
    pytest.param(
        ["plan", "nosuch", "--devices", "2"], ("Unknown model 'nosuch'",), ("give a zoo model",),
        id="plan-unknown-zoo-model",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--model-args", "bogus=1"],
        ("has no argument 'bogus'",), ("it accepts layers=3",), id="model-args-unknown-key",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--model-args", "layers"],
        ("Bad --model-args item 'layers'",), ("key=value pairs",), id="model-args-malformed",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--model-args", "hidden=-1"],
        ("cannot be built with hidden=-1",), ("Check the values of --model-args",),
        id="model-args-negative-size",
    ),
    # planning
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--memory-gib", "0.0001"], ("no plan fits",),
        ("Raise --memory-gib",), id="plan-infeasible-memory",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--strategy", "zigzag"], ("unknown strategy 'zigzag'",),
        ("megatron:tp=T,pp=P,dp=D",), id="plan-unknown-strategy",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "4", "--strategy", "megatron:tp=x"],
        ("cannot read 'megatron:tp=x'",), ("megatron:tp=2,pp=2,dp=1",), id="plan-malformed-megatron",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "4", "--strategy", "megatron:tp=3,dp=2"],
        ("cannot form",), ("multiply to 4",), id="plan-megatron-degrees-not-devices",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "8", "--strategy", "megatron:tp=1,pp=8,dp=1"],
        ("8 pipeline stages need at least 8 repeated blocks",), ("use fewer stages",),
        id="plan-more-stages-than-blocks",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--out", "nodir/plan.json"],
        ("cannot write the plan to nodir/plan.json", "No such file or directory"),
        ("existing, writable directory",), id="plan-out-in-missing-directory",
    ),
    # counts and sizes (argparse refuses them: usage line, exit 2)
    *(
        pytest.param(
            [*argv, flag, value], (f"argument {flag}: must be", repr(value)), ("e.g.",),
            id=f"{argv[0]}{flag}={value}",
        )
        for argv, flag, value in (
            (["plan", "mlp", "--devices", "2"], "--devices", "0"),
            (["plan", "mlp", "--devices", "2"], "--devices", "-2"),
            (["plan", "mlp", "--devices", "2"], "--memory-gib", "0"),
            (["plan", "mlp", "--devices", "2"], "--memory-gib", "-1"),
            (["plan", "mlp", "--devices", "2"], "--global-batch", "0"),
            (["plan", "mlp", "--devices", "2"], "--time-limit-s", "0"),
            (["train", "mlp", "--nproc", "2"], "--nproc", "0"),
            (["train", "mlp", "--nproc", "2"], "--nproc", "-3"),
            (["train", "mlp", "--nproc", "2"], "--steps", "-1"),
            (["train", "mlp", "--nproc", "2"], "--stall-timeout", "0"),
            (["train", "mlp", "--nproc", "2"], "--stall-timeout", "nan"),
            (["train", "mlp", "--nproc", "2"], "--checkpoint-every", "0"),
            (["demo"], "--nproc", "0"),
            (["demo"], "--steps", "0"),
        )
    ),
    # profiles
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "nosuch"],
        ("no shipped profile named 'nosuch'", "cpu-gloo"), ("Pass a path",),
        id="profile-unknown-name",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/absent.json"],
        ("cannot be read", "No such file"), ("Pass the path of a profile JSON",),
        id="profile-missing-file",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/profile-malformed.json"],
        ("invalid JSON at line 1",), ("repair the JSON",), id="profile-malformed-json",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/profile-truncated.json"],
        ("ends early",), ("re-run `autosbp profile`",), id="profile-truncated",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/profile-foreign.json"],
        ("not an autosbp profile",), ("pass a file written by `autosbp profile`",),
        id="profile-foreign-json",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/profile-list.json"],
        ("not an autosbp profile",), ("pass a file written by `autosbp profile`",),
        id="profile-json-list",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/profile-v99.json"],
        ("schema version 99 is not supported",), ("re-run `autosbp profile`",),
        id="profile-wrong-version",
    ),
    pytest.param(
        ["plan", "mlp", "--devices", "2", "--profile", "{in}/profile-nodevice.json"],
        ("missing field 'device'",), ("add 'device'",), id="profile-missing-field",
    ),
    # plans
    pytest.param(
        ["explain", "{in}/absent.json"], ("does not exist",), ("make one with `autosbp plan`",),
        id="explain-missing-file",
    ),
    pytest.param(
        ["explain", "{in}"], ("cannot be read", "directory"), ("pass a plan JSON file",),
        id="explain-directory",
    ),
    pytest.param(
        ["explain", "{in}/plan.json", "--node", "nosuch"], ("node 'nosuch' is not in",),
        ("lists every node",), id="explain-unknown-node",
    ),
    pytest.param(
        ["explain", "{in}/plan-truncated.json"], ("not valid JSON",), ("make it again",),
        id="plan-truncated",
    ),
    pytest.param(
        ["explain", "{in}/plan-malformed.json"], ("not valid JSON",), ("make it again",),
        id="plan-malformed-json",
    ),
    pytest.param(
        ["explain", "{in}/plan-foreign.json"], ("not an autosbp plan",),
        ("pass a file written by `autosbp plan`",), id="plan-foreign-json",
    ),
    pytest.param(
        ["explain", "{in}/plan-list.json"], ("does not match the plan schema",),
        ("make it again with `autosbp plan`",), id="plan-json-list",
    ),
    pytest.param(
        ["explain", "{in}/plan-v99.json"], ("plan version 99",), ("make the plan again",),
        id="plan-wrong-version",
    ),
    pytest.param(
        ["explain", "{in}/plan-badsbp.json"], ("does not match the plan schema", "'X(3)'"),
        ("make it again with `autosbp plan`",), id="plan-bad-sbp-text",
    ),
    # a plan used with another model or world size: refused before any process starts
    pytest.param(
        ["train", "gpt", "--plan", "{in}/plan.json", "--nproc", "2"],
        ("graph fingerprint", "model `gpt`"), ("Make a new plan for this model",),
        id="train-plan-of-another-model",
    ),
    pytest.param(
        ["train", "mlp", "--model-args", "layers=4", "--plan", "{in}/plan.json", "--nproc", "2"],
        ("graph fingerprint",), ("Make a new plan for this model",),
        id="train-plan-of-other-model-args",
    ),
    pytest.param(
        ["train", "mlp", "--plan", "{in}/plan.json", "--nproc", "4"],
        ("plan is for 2 devices but the job has 4",), ("launch with --nproc 2",),
        id="train-nproc-larger-than-plan",
    ),
    pytest.param(
        ["train", "mlp", "--plan", "{in}/plan.json", "--nproc", "1"],
        ("plan is for 2 devices but the job has 1",), ("make a plan for 1",),
        id="train-nproc-smaller-than-plan",
    ),
    pytest.param(
        ["train", "mlp", "--plan", "{in}/absent.json", "--nproc", "2"], ("does not exist",),
        ("make one with `autosbp plan`",), id="train-plan-missing",
    ),
    pytest.param(
        ["train", "mlp", "--plan", "zigzag", "--nproc", "2"], ("unknown strategy 'zigzag'",),
        ("use auto, dp, fsdp",), id="train-unknown-strategy",
    ),
    pytest.param(
        ["train", "mlp", "--meta", "--nproc", "2"], ("needs real parameters",), ("drop --meta",),
        id="train-meta",
    ),
    # plans inconsistent in themselves or with their model: refused before launch (#18)
    *(
        pytest.param(
            [*argv, f"{{in}}/plan-{name}.json", *extra], cause, ("make it again",),
            id=f"{argv[0]}-plan-{name}",
        )
        for argv, extra, name, cause in (
            (TRAIN, (), "cycle", ("data flows back to an earlier stage", "linear_4 (stage 0)")),
            (TRAIN, (), "mesh3", ("stage(s) of mesh [3] hold 3 devices, but the plan is for 2",)),
            (TRAIN, (), "dupdev", ("devices [0] are listed more than once",)),
            (TRAIN, (), "devrange", ("stage 0 lists devices [5], outside 0..1",)),
            (TRAIN, (), "nostage", ("nodes gelu are on stage 7, but the plan has 2 stage(s)",)),
            (TRAIN, (), "paramsbp", ("'inp.weight' has SBP S(0) in the parameter table but B",)),
            (TRAIN, (), "paramstage", ("'head.weight' is on stage 0 in the parameter table",)),
            (TRAIN, (), "emptystage", ("stages [1] hold no node",)),
            (TRAIN, (), "deleted", ("no entry for nodes p_blocks_1_fc_weight",)),
            (TRAIN, (), "stagemesh", ("stage 0 has mesh [1], the plan [2]",)),
            (TRAIN, (), "meshdims", ("shape [2] but dims ['d0', 'd1']",)),
            (TRAIN, (), "mb3", ("3 micro-batches do not divide the global batch of 8",)),
            (TRAIN, (), "badsig", ("nodes gelu", "signatures their rules do not offer"),),
            (TRAIN, (), "batch16", ("a global batch of 16 samples", "example inputs hold 8"),),
            (TRAIN, (), "optsbp", ("optimizer states: SBP S(7) splits dim 7",)),
            (["show"], (), "mb1e7", ("10000000 micro-batches do not divide",)),
            (["explain"], (), "dev1e7", ("hold 2 devices, but the plan is for 10000000",)),
            # not numbers, not a plan
            (TRAIN, (), "nan", ("holds NaN, which is not a finite number",)),
            (["show"], (), "inf", ("holds Infinity, which is not a finite number",)),
            (TRAIN, (), "mem400", ("401-digit number at cluster/memory_limit_bytes",)),
            (TRAIN, (), "batch30", ("31-digit number at global_batch",)),
            (TRAIN, (), "devfloat", ("at cluster/devices: 2.0 is not of type 'integer'",)),
            (["explain"], (), "nested", ("nests deeper than a JSON reader goes",)),
            (["show"], (), "escape", ("holds the text", "mlp\\x1b[2J", "control characters")),
            (TRAIN, (), "block99", ("stage 1 lists repeated blocks 99, but the model has blocks 0..2",)),
            (TRAIN, (), "tiedangling", ("tied to nodes the plan does not have: p_blocks_1_fc_weight -> nosuch",)),
            (["show"], (), "longname", ("a text of 1000000 characters at model/name", "at most 4096")),
            (TRAIN, (), "dupparams", ("names 'inp.weight' 3 times in one object", "keeps only the last")),
            # issue #48: collectives inside an op other than the rule runs, refused before launch
            (TRAIN_GPT, (), "exchanges-removed", ("nodes scaled_dot_product_attention (stated: none)",
                                                   "state other collectives inside the op")),
            (TRAIN_GPT, (), "exchanges-swapped", ("nodes scaled_dot_product_attention (stated: send_recv",
                                                   "state other collectives inside the op")),
            (TRAIN_GPT, (), "exchanges-added", ("nodes linear (stated: all_gather on mesh dim 0",
                                                 "state other collectives inside the op")),
        )
    ),
    pytest.param(
        ["explain", "{in}/plan-vnext.json"],
        (f"plan version {VERSION + 1}, newer than any this autosbp writes",),
        ("Upgrade autosbp",), id="explain-plan-newer-than-this-autosbp",
    ),
    # issue #48: what the search refuses names the real cause, and the device's own numbers
    pytest.param(
        [*PLAN_MLP4, f"{VP},mb=1"],
        ("1 micro-batches is not a multiple of 2",), ("use a multiple",),
        id="plan-interleaved-micro-batches-not-a-multiple-of-pp",
    ),
    pytest.param(
        [*PLAN_MLP4, f"{PP},mb=1"],
        ("a pipeline of 2 stages needs at least 2",), ("use mb >= 2",),
        id="plan-fewer-micro-batches-than-stages",
    ),
    pytest.param(
        [*PLAN_MLP4, "megatron:tp=2,pp=2,dp=1,vp=2"],
        ("a mesh that 2 devices cannot form",), ("multiply to 2",),
        id="plan-interleaved-degrees-not-devices",
    ),
    pytest.param(  # SigLIP's patch conv (conv2d.padding) cannot read a tp-split weight
        ["plan", "{in}/bad_models.py:validconv", "--devices", "2", "--strategy", TP],
        ("no consistent choice of signatures, though the memory fits",
         "a weight that some op cannot read in the layout it is stored in"), ("Try auto",),
        id="plan-no-plan-is-not-a-memory-problem",
    ),
    pytest.param(
        [*PLAN_MLP4, f"{VP},mb=2", "--memory-gib", "0.0001"],
        ("no plan fits in 104.86 KiB per device (the 2 model chunks it interleaves together",),
        ("Raise --memory-gib",), id="plan-interleaved-no-fit-names-the-device-budget",
    ),
    *(
        pytest.param(
            ["plan", "mlp", "--devices", "2", "--profile", f"{{in}}/profile-{name}.json"],
            cause, (("Fix: write the measured",), ("check the number",))[name == "1e300-flops"],
            id=f"profile-{name}",
        )
        for name, cause in (
            ("nan-bandwidth", ("holds NaN, which is not a number a profile can price with",)),
            ("inf-memory-bandwidth", ("holds Infinity",)),
            ("nan-flops", ("holds NaN",)),
            ("1e300-flops", ("1e+300 GFLOP/s is beyond any hardware", "at most 1e+18 flop/s")),
        )
    ),
    # models that cannot train
    pytest.param(
        ["train", "{in}/bad_models.py:noparams", "--nproc", "2", "--plan", "dp"],
        ("has no parameters",), ("give it layers with parameters",), id="train-no-parameters",
    ),
    pytest.param(
        ["train", "{in}/bad_models.py:unused", "--nproc", "2", "--plan", "dp"],
        ("depends on none of its 2 parameter tensors",), ("through the model's layers",),
        id="train-loss-ignores-parameters",
    ),
    pytest.param(
        ["capture", "{in}/bad_models.py:exits"], ("failed with SystemExit: 3",),
        ("Fix the function",), id="capture-model-calls-sys-exit",
    ),
    pytest.param(
        ["capture", "{in}/bad_models.py:exits0"], ("failed with a call of os._exit(0)",),
        ("Fix the function",), id="capture-model-calls-os-exit",
    ),
    pytest.param(
        ["capture", "mlp", "--model-args", "hidden=0"],
        ("cannot be built with hidden=0", "a whole number >= 1"),
        ("Check the values of --model-args",), id="model-args-zero-size",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--device", "cuda", "--backend", "gloo"],
        ("--device cuda", "sees no GPU on this machine"), ("--device cpu --backend gloo",),
        id="train-cuda-without-a-gpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--device", "cuda"],
        ("--device cuda", "sees no GPU on this machine"), ("--device cpu --backend gloo",),
        id="train-cuda-nccl-without-a-gpu",
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU"),
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "1", "--device", "cuda", "--backend", "gloo"],
        ("--device cuda --backend gloo", "with NCCL"), ("use --backend nccl",),
        id="train-cuda-over-gloo",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU: refused first"),
    ),
    # checkpoint arguments
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--resume"], ("--resume needs --checkpoint-dir DIR",),
        ("the folder the job keeps its checkpoint in",), id="train-resume-without-dir",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-every", "5"],
        ("--checkpoint-every needs --checkpoint-dir",), ("DIR",), id="train-every-without-dir",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}"],
        ("exists and is not a checkpoint",), ("choose a new folder",),
        id="train-checkpoint-dir-not-a-checkpoint",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}/ckpt-escape", "--resume"],
        ("names the rank file '../../../../../etc/hostname'", "not a file of"),
        ("Use another checkpoint",), id="train-manifest-names-a-file-outside",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}/ckpt-negstep", "--resume"],
        ("is damaged", "optimizer.step is -7, expected a whole number >= 0"),
        ("Use another checkpoint",), id="train-manifest-negative-step",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}/ckpt-newer", "--resume"],
        ("version 4", "reads versions 2 to 3"), ("written by a newer autosbp",),
        id="train-checkpoint-of-a-newer-version",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}/ckpt-badextra", "--resume"],
        ("is damaged", "training.extra is a list"), ("Use another checkpoint",),
        id="train-manifest-extra-not-an-object",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}/ckpt-locked"],
        ("is in use by the job of pid 4242 on host elsewhere.example",
         "destroy each other's checkpoints"),
        ("remove", "ckpt-locked.lock and start again"),
        id="train-checkpoint-dir-held-by-another-host",
    ),
    # the training job's data, recipe and outputs (issue #44), each before any process starts
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--data", "{in}/data.py:raises"],
        ("failed with ValueError: no such corpus",), ("Fix the function",),
        id="train-data-function-raises",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--data", "{in}/data.py:number"],
        ("returned an int",), ("map-style Dataset",), id="train-data-function-returns-int",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--data", "{in}/data.py:wrong_shape"],
        ("shape [5]", "[32]"), ("example inputs",), id="train-data-wrong-sample-shape",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--data", "{in}/data.py:wrong_dtype"],
        ("int64", "float32"), ("example inputs",), id="train-data-wrong-dtype",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--data", "{in}/data.py:too_small"],
        ("3 samples", "global batch of 8"), ("--global-batch",), id="train-data-smaller-than-a-batch",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--eval-every", "5"],
        ("--eval-every needs --eval-data",), ("built-in data set",),
        id="train-eval-every-without-eval-data",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--steps", "10", "--warmup-steps", "20"],
        ("--warmup-steps 20 must be between 0 and --steps (10)",), ("warm up for fewer steps",),
        id="train-warmup-longer-than-the-job",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--lr", "0.01", "--min-lr", "0.1", "--lr-schedule",
         "cosine"],
        ("--min-lr 0.1 must be between 0 and --lr 0.01",), ("decays from the peak",),
        id="train-min-lr-above-lr",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--min-lr", "0.001"],
        ("has no effect with --lr-schedule constant",), ("choose linear, cosine or wsd",),
        id="train-min-lr-without-decay",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--weight-decay", "0.1"],
        ("with adam adds an L2 term",), ("--optimizer adamw",), id="train-weight-decay-with-adam",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--plan", "{in}/plan.json", "--clip-grad-norm", "1"],
        ("was priced without gradient clipping",), ("autosbp plan ... --clip-grad-norm",),
        id="train-clipping-a-plan-priced-without",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--plan", "{in}/plan.json", "--dtype", "bf16"],
        ("was made for --dtype fp32", "asks for --dtype bf16"), ("autosbp plan ... --dtype bf16",),
        id="train-plan-file-of-another-dtype",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--save-model", "model.bin"],
        ("must end in .safetensors or .pt",), ("safetensors",), id="train-save-model-suffix",
    ),
    pytest.param(
        ["export", "{in}/missing-checkpoint", "--out", "m.safetensors"],
        ("missing-checkpoint",), ("",), id="export-missing-checkpoint",
    ),
    pytest.param(
        ["train", "mlp", "--nproc", "2", "--checkpoint-dir", "{in}/ckpt-badlock"],
        ("locked by {in}/ckpt-badlock.lock", "does not name a job"),
        ("If no job uses this folder, remove",), id="train-checkpoint-dir-damaged-lock",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "cause", "fix"), CLI_CASES)
def test_cli_bad_input(
    argv: list[str],
    cause: tuple[str, ...],
    fix: tuple[str, ...],
    inputs_dir: Path,
    workdir: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    argv = [a.replace("{in}", str(inputs_dir)) for a in argv]
    cause = tuple(c.replace("{in}", str(inputs_dir)) for c in cause)
    if argv[0] == "plan" and "--out" not in argv:
        argv += ["--out", "plan.json"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownOpWarning)  # none of these models has unknown ops
        code = _run_cli(argv)
    out, err = capfd.readouterr()
    assert code == 2, f"exit code {code}; stdout: {out}; stderr: {err}"
    for leak in LEAKS:
        assert leak not in out + err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err  # one paragraph: the message is a single line
    _assert_words(errors[0], cause + fix)
    assert list(workdir.iterdir()) == []  # nothing written, not even half a plan


# ------------------------------------------------------------------------------ API cases
def _mlp() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    return build_model("mlp")


def _plan(ctx: SimpleNamespace) -> Plan:
    return load_plan(ctx.inputs / "plan.json")


# (call on ctx, exception class, cause words, fix words). ctx.inputs: the inputs directory.
API_CASES = [
    # SBP text and meshes
    pytest.param(
        lambda ctx: parse_nd_sbp("X(3)"), SbpError, ("cannot read SBP text 'X(3)'",),
        ("write it like 'S(0)B'",), id="parse-bad-sbp-text",
    ),
    pytest.param(
        lambda ctx: parse_nd_sbp("P(avg)"), SbpError, ("cannot read SBP text 'P(avg)'",),
        ("'P(max)'",), id="parse-unknown-partial-op",
    ),
    pytest.param(
        lambda ctx: parse_nd_sbp(""), SbpError, ("empty SBP text",), ("one SBP per mesh dim",),
        id="parse-empty-sbp-text",
    ),
    pytest.param(
        lambda ctx: parse_nd_sbp(3), SbpError, ("must be a string", "int 3"),
        ("a tuple of S(dim), B and P",), id="parse-sbp-not-text",
    ),
    pytest.param(
        lambda ctx: P("avg"), SbpError, ("not a partial reduce op",), ("use one of",),
        id="partial-unknown-op",
    ),
    pytest.param(
        lambda ctx: Mesh((0, 2)), SbpError, ("mesh shape (0, 2)",), ("e.g. Mesh((2, 2))",),
        id="mesh-zero-size",
    ),
    pytest.param(
        lambda ctx: Mesh("2x2"), SbpError, ("mesh shape '2x2'",), ("e.g. Mesh((2, 2))",),
        id="mesh-shape-text",
    ),
    pytest.param(
        lambda ctx: Mesh((2,), device_ids=(0, 0)), SbpError, ("distinct: 1",),
        ("give each device once",), id="mesh-duplicate-devices",
    ),
    # non-divisible and mismatched splits
    pytest.param(
        lambda ctx: shard_tensor(torch.zeros(5, 4), (S(0),), Mesh((2,)), (0,)), SbpError,
        ("splits dim 0 of length 5 into 2 parts",), ("a size divisible by 2",),
        id="shard-tensor-non-divisible",
    ),
    pytest.param(
        lambda ctx: shard_tensor(torch.zeros(4, 4), "S(2)", (2,), (0,)), SbpError,
        ("splits dim 2", "has 2 dims"), ("split a dim in 0..1",), id="shard-tensor-missing-dim",
    ),
    pytest.param(
        lambda ctx: shard_tensor(torch.zeros(4, 4), "S(0)", (2,), (5,)), SbpError,
        ("coords (5,) are not a device of mesh (2,)",), ("each in 0..size-1",),
        id="shard-tensor-coords-off-mesh",
    ),
    pytest.param(
        lambda ctx: plan_boxing("S(0)", "B", (6, 4), (4,)), SbpError,
        ("boxing source", "splits dim 0 of length 6 into 4 parts"), ("a size divisible by 4",),
        id="boxing-non-divisible",
    ),
    pytest.param(
        lambda ctx: plan_boxing("S(0)B", "B", (4, 4), 2), SbpError,
        ("has 2 entries but the mesh (2,) has 1 dims",), ("one SBP per mesh dim",),
        id="boxing-sbp-rank-not-mesh-rank",
    ),
    pytest.param(
        lambda ctx: plan_boxing("P(max)", "S(0)", (4, 4), 2), SbpError,
        ("converts only P (sum) partials",), ("Reduce the P(max) tensor",),
        id="boxing-partial-max",
    ),
    # models
    pytest.param(
        lambda ctx: load_model(f"{ctx.inputs}/models.py:nothere"), CaptureError,
        ("has no function 'nothere'",), ("Name one that returns",), id="load-model-no-function",
    ),
    pytest.param(
        lambda ctx: load_model("mlp", {"hidden": "big"}), CaptureError,
        ("cannot be built with hidden='big'",), ("Check the values of --model-args",),
        id="load-model-bad-value",
    ),
    pytest.param(
        lambda ctx: parse_model_args("layers=2,layers=3"), CaptureError, ("'layers' twice",),
        ("give it once",), id="model-args-duplicate-key",
    ),
    pytest.param(
        lambda ctx: autosbp.capture(lambda x: x.sum(), (torch.ones(2),)), CaptureError,
        ("needs an nn.Module", "function"), ("wrap it in a module",),
        id="capture-not-a-module",
    ),
    pytest.param(
        lambda ctx: autosbp.capture(_mlp()[0], (torch.ones(8, 32), 3)), CaptureError,
        ("#1 (int)",), ("constructor",), id="capture-non-tensor-input",
    ),
    pytest.param(
        lambda ctx: autosbp.capture(*load_model(f"{ctx.inputs}/models.py:branchy")),
        CaptureError, ("`if` on a tensor value",), ("torch.where",), id="capture-data-dependent",
    ),
    # planning
    pytest.param(
        lambda ctx: autosbp.auto_parallelize(*_mlp(), devices=0), PlanError,
        ("devices must be a positive integer, got 0",), ("e.g. devices=8",),
        id="auto-parallelize-zero-devices",
    ),
    pytest.param(
        lambda ctx: autosbp.auto_parallelize(*_mlp(), devices=2, memory_limit=0), PlanError,
        ("memory_limit must be positive, got 0",), ("leave it out for the default",),
        id="auto-parallelize-zero-memory",
    ),
    pytest.param(
        lambda ctx: autosbp.auto_parallelize(*_mlp(), devices=2, global_batch=-8), PlanError,
        ("global_batch must be positive, got -8",), ("leave it out for the default",),
        id="auto-parallelize-negative-batch",
    ),
    pytest.param(
        lambda ctx: autosbp.auto_parallelize(*_mlp(), devices=2, memory_limit=1000), PlanError,
        ("no plan fits",), ("Raise --memory-gib",), id="auto-parallelize-infeasible-memory",
    ),
    pytest.param(
        lambda ctx: autosbp.auto_parallelize(*_mlp(), devices=2, strategy="tp"), PlanError,
        ("unknown strategy 'tp'",), ("use auto, dp, fsdp",), id="auto-parallelize-bad-strategy",
    ),
    pytest.param(
        lambda ctx: autosbp.auto_parallelize(*_mlp(), devices=2, profile="dgx-z"), ProfileError,
        ("no shipped profile named 'dgx-z'",), ("Pass a path",),
        id="auto-parallelize-unknown-profile",
    ),
    # profiles
    *(
        pytest.param(
            lambda ctx, name=name: load_profile(ctx.inputs / f"profile-{name}.json"),
            ProfileError, (cause,), (fix,), id=f"load-profile-{name}",
        )
        for name, cause, fix in (
            ("malformed", "invalid JSON", "repair the JSON"),
            ("truncated", "ends early", "re-run `autosbp profile`"),
            ("foreign", "not an autosbp profile", "pass a file written by `autosbp profile`"),
            ("v99", "schema version 99", "re-run `autosbp profile`"),
        )
    ),
    # plans
    pytest.param(
        lambda ctx: load_plan(ctx.inputs / "plan-foreign.json"), PlanError,
        ("not an autosbp plan",), ("pass a file written by `autosbp plan` or autosbp.plan.save_plan()",),
        id="plan-load-foreign",
    ),
    pytest.param(
        lambda ctx: Plan.from_json(None), PlanError, ("None is not of type 'object'",),
        ("make it again",), id="plan-from-json-none",
    ),
    pytest.param(
        lambda ctx: _plan(ctx).check_world(8), PlanError, ("plan is for 2 devices",),
        ("launch with --nproc 2 or make a plan for 8",), id="plan-other-world-size",
    ),
    pytest.param(
        lambda ctx: _plan(ctx).check_model("0123456789abcdef", "model `gpt`"), PlanError,
        ("model `gpt` has fingerprint 0123456789abcdef",), ("Make a new plan",),
        id="plan-other-model",
    ),
    pytest.param(
        lambda ctx: save_plan(_plan(ctx), ctx.inputs / "nodir" / "plan.json"), PlanError,
        ("cannot write the plan",), ("existing, writable directory",),
        id="plan-save-missing-directory",
    ),
    # numbers, sizes and files that are not what they claim (#18)
    pytest.param(
        lambda ctx: Plan.from_json(_edited(ctx.inputs / "plan.json", "solver", "gap", NAN)),
        PlanError, ("holds nan at solver/gap: not a finite number",), ("make it again",),
        id="plan-from-json-nan",
    ),
    pytest.param(
        lambda ctx: Plan.from_json(_edited(ctx.inputs / "plan.json", "model", "name", "a\x9bb")),
        PlanError, ("'a\\x9bb' at model/name, with control characters",), ("make it again",),
        id="plan-from-json-control-character",
    ),
    pytest.param(
        lambda ctx: profile_from_dict(
            _edited(REPO / "costmodel" / "profiles" / "cpu-gloo.json", "device", "memory", {"value": NAN}),
            "api",
        ),
        ProfileError, ("at $.device.memory.value: nan is not a number",),
        ("write the measured or spec-sheet value",), id="profile-from-dict-nan",
    ),
    pytest.param(
        lambda ctx: save_profile(_nan_memory_profile(), ctx.inputs / "nodir" / "profile.json"),
        ProfileError, ("(being saved): at $.device.memory.value: nan is not a number",),
        ("write the measured or spec-sheet value",), id="profile-save-nan",
    ),
    pytest.param(
        lambda ctx: predicted_events(
            dataclasses.replace(sample_plan(), micro_batches=60_000, global_batch=60_000)
        ),
        PlanError, ("120000 firings", "more than the 100000 a timeline simulates"),
        ("predicted step time is in the plan's summary",), id="timeline-too-many-firings",
    ),
    pytest.param(
        lambda ctx: draw_timelines(
            ctx.inputs / "nodir" / "t.png",
            [Event(rank, 0, "forward", 0, 0.0, 1.0) for rank in range(200)], title="t",
        ),
        PlanError, ("200 ranks are more than the 128 a chart can show",),
        ("leave out --timeline",), id="timeline-too-many-ranks",
    ),
    pytest.param(
        lambda ctx: read_manifest(ctx.inputs / "ckpt-escape"), ExecutionError,
        ("names the rank file '../../../../../etc/hostname'", "is not a file of"),
        ("Use another checkpoint",), id="manifest-names-a-file-outside",
    ),
    pytest.param(
        lambda ctx: read_manifest(ctx.inputs / "ckpt-newer"), ExecutionError,
        ("version 4", "reads versions 2 to 3"), ("written by a newer autosbp",),
        id="manifest-of-a-newer-version",
    ),
    pytest.param(
        lambda ctx: hold_checkpoint_dir(ctx.inputs / "ckpt-locked").__enter__(), ExecutionError,
        ("pid 4242 on host elsewhere.example",), ("Wait for that job to end", "remove"),
        id="checkpoint-dir-held-by-another-host",
    ),
]  # fmt: skip
NAN = float("nan")


def _nan_memory_profile() -> Any:
    """cpu-gloo with a NaN device memory: what a profiler fit that went wrong would hold."""
    profile = load_profile("cpu-gloo")
    memory = dataclasses.replace(profile.device.memory, value=NAN)
    return dataclasses.replace(profile, device=dataclasses.replace(profile.device, memory=memory))


def _edited(path: Path, section: str, key: str, value: Any) -> dict[str, Any]:
    """The JSON in `path` with data[section][key] set to `value` (merged into a dict there)."""
    data = json.loads(path.read_text())
    old = data[section][key]
    data[section][key] = {**old, **value} if isinstance(old, dict) else value
    return data


@pytest.mark.parametrize(("call", "error", "cause", "fix"), API_CASES)
def test_api_bad_input(
    call: Callable[[SimpleNamespace], Any],
    error: type[AutosbpError],
    cause: tuple[str, ...],
    fix: tuple[str, ...],
    inputs_dir: Path,
    capfd: pytest.CaptureFixture[str],
) -> None:
    assert issubclass(error, AutosbpError)
    with pytest.raises(error) as info:
        call(SimpleNamespace(inputs=inputs_dir))
    message = str(info.value)
    assert "\n" not in message  # one paragraph
    _assert_words(message, cause + fix)
    out, err = capfd.readouterr()
    for leak in LEAKS:
        assert leak not in message + out + err
    assert not (inputs_dir / "nodir").exists()


# ---------------------------------------------------------------- warnings and atomic writes
def test_unknown_op_warns_and_still_plans(
    inputs_dir: Path, workdir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", f"{inputs_dir}/models.py:unknown", "--devices", "2", "--out", "plan.json"]
    assert _run_cli(argv) == 0  # said in the command's words (a note), not a raw warning
    out, err = capfd.readouterr()
    assert "note: 1 op(s) have no SBP rule" in " ".join(out.split())
    assert "aten.prod.default" in out and "UnknownOpWarning" not in out + err
    assert "Traceback" not in out + err and "error:" not in err
    plan = load_plan(workdir / "plan.json")
    assert any(node.op == "aten.prod.default" for node in plan.nodes.values())
    assert [p.name for p in workdir.iterdir()] == ["plan.json"]  # no temporary file left


def test_failed_plan_save_keeps_the_old_file(
    inputs_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save that fails at the last step (the rename) leaves the previous plan whole and no
    temporary file; the error names the path and the fix."""
    path = tmp_path / "plan.json"
    path.write_text("the previous plan")

    def disk_full(src: Any, dst: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("autosbp.plan.files.os.replace", disk_full)
    with pytest.raises(PlanError, match=r"No space left on device.*writable directory"):
        save_plan(load_plan(inputs_dir / "plan.json"), path)
    assert path.read_text() == "the previous plan"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_plan_out_in_a_read_only_folder_is_one_clear_error(
    inputs_dir: Path,
    workdir: Path,
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a read-only filesystem the write fails, and so does removing the temporary file that
    was never made (EROFS: Linux checks the mount before it looks the name up); the cleanup's
    error once escaped as a traceback. Root ignores folder permissions, so the filesystem's two
    refusals are what this test gives `write_atomically`."""

    def read_only(*args: Any, **kwargs: Any) -> Any:
        raise OSError(30, "Read-only file system")

    (workdir / "ro").mkdir()
    monkeypatch.setattr("autosbp.plan.files.os.replace", read_only)
    monkeypatch.setattr(Path, "unlink", read_only)
    code = _run_cli(["plan", "mlp", "--devices", "2", "--out", "ro/plan.json"])
    out, err = capfd.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in out + err
    _assert_words(err, ("cannot write the plan to ro/plan.json", "Read-only file system"))
    _assert_words(err, ("existing, writable directory",))


def test_timeline_of_a_large_plan_without_a_trace_says_what_to_do(
    workdir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Without a trace there is no trace to shorten: the refusal points at the summary."""
    argv = ["plan", "mlp", "--devices", "256", "--strategy", "dp", "--global-batch", "256"]
    assert _run_cli([*argv, "--profile", "dgx-a100", "--out", "big.json"]) == 0
    capfd.readouterr()
    assert _run_cli(["show", "big.json", "--timeline", "t.png"]) == 2
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "a trace of fewer ranks" not in err, err
    _assert_words(err.replace("\n", " "), ("256 ranks", "the predicted step is in the summary"))
    assert not (workdir / "t.png").exists()

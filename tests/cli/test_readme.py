"""README.md runs as written, on a CPU machine, and so do docs/cluster.md's torchrun commands.
Every block and command is read from the page, never copied here, so an edit that breaks one
breaks this test; `test_every_block_of_the_readme_has_a_runner` fails on a block nobody runs.

Who runs each block of the README:
- "Start": its set-up and test commands are .ci/run's own, which CI runs on a fresh machine
  (asserted equal here); `autosbp demo` runs with fewer steps in tests/cli/test_demo.py, and
  here its defaults are checked to be what the block says (2 processes, 200 steps).
- "Train your model on your data": not run here. tests/runtime/test_training_job.py reads that
  command from the README and runs it (60 steps, in fp32 and in bf16, against a plain PyTorch
  loop); it takes minutes, and twice would add nothing.
- "Plan, and train in your own loop": the planning Python in this process; `train.py` under
  torchrun with 2 processes, as the README says to run it.
- "Commands": every row in order, in this process (`autosbp.cli.main`), in one folder.
- docs/cluster.md: its bash blocks under torchrun, on this machine, with the Commands table's
  gpt2.json (the two-node command as two agents on loopback).
What each asserts is what a user reads in the output and relies on.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from autosbp.cli import build_parser, main
from autosbp.plan import load_plan
from autosbp.zoo import ZOO_MODELS, build_model
from tests.support.readme import REPO, blocks, options, page, section, shell_commands

README = page("README.md")
CLUSTER = page("docs/cluster.md")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun script runs
TIMEOUT_S = 300
# Every fenced block of the README, by section and language, and who runs it (the docstring).
RUNNERS = {
    ("## Start", "bash"): "test_the_start_block_is_what_ci_and_the_demo_run",
    ("## Train your model on your data", "bash"): "tests/runtime/test_training_job.py",
    ("## Plan, and train in your own loop", "python"): "test_the_tour_plans_in_this_process",
    ("## Plan, and train in your own loop", "python", 2): "test_train_py_trains_under_torchrun",
}


def ranks_env() -> dict[str, str]:
    """This checkout first on the path (the commands run in a temporary folder), gloo on
    loopback."""
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo"}


def run_torchrun(argv: list[str], cwd: Path) -> str:
    assert argv[0] == "torchrun", argv
    done = subprocess.run(
        [*TORCHRUN, *argv[1:]], cwd=cwd, env=ranks_env(), capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def run_two_agents(argv: list[str], cwd: Path) -> tuple[list[str], list[str]]:
    """The two-node command as two torchrun agents on this machine, at a free port (the page's
    own may be taken): their stdout (rank 0's first) and stderr."""
    assert argv[0] == "torchrun", argv
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = [re.sub(r"^127\.0\.0\.1:\d+$", f"127.0.0.1:{port}", a) for a in argv]
    agents = [
        subprocess.Popen(
            [*TORCHRUN, *argv[1:]],
            cwd=cwd,
            env=ranks_env(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    try:
        done = [agent.communicate(timeout=TIMEOUT_S) for agent in agents]
    finally:
        for agent in agents:
            agent.kill()  # only where a timeout left it running
    for agent, (out, err) in zip(agents, done, strict=True):
        assert agent.returncode == 0, out + err
    outs = sorted((out for out, _ in done), key=len, reverse=True)  # rank 0's table first
    return outs, [err for _, err in done]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one folder every command runs in, as a user's shell would."""
    return tmp_path_factory.mktemp("readme")


@pytest.fixture(scope="module")
def table(folder: Path) -> dict[str, str]:
    """Every row of the Commands table run in order in `folder`: the output of each, by its
    name (`commands_by_name`)."""
    outputs = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        for name, command in commands_by_name().items():
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                code = main(shlex.split(command)[1:])
            assert code == 0, f"{command}\n{printed.getvalue()}"
            outputs[name] = printed.getvalue()
    return outputs


def commands_by_name() -> dict[str, str]:
    """The Commands table's rows in order, each named by its subcommand (plans by their kind)."""
    commands = re.findall(r"^\| `(autosbp [^`]*)` \|", section(README, "## Commands"), re.M)
    named = {}
    for command in commands:
        name = command.split()[1]
        if name == "plan":
            name = (
                "compare"
                if "--compare" in command
                else "hand"
                if "--strategy" in command
                else "plan"
            )
        assert name not in named, f"two rows of the Commands table are `{name}`: name them here"
        named[name] = command
    return named


def test_every_block_of_the_readme_has_a_runner() -> None:
    found: dict[tuple[str, ...], int] = {}
    for title in re.findall(r"^## .+$", README, re.M):
        for language in re.findall(r"^```(\w+)$", section(README, title), re.M):
            seen = found[(title, language)] = found.get((title, language), 0) + 1
            key = (title, language) if seen == 1 else (title, language, seen)
            assert key in RUNNERS, f"README block {key} is run by no test: run it here"
    assert sum(found.values()) == len(RUNNERS) == len(blocks(README)), (found, RUNNERS)


def test_the_start_block_is_what_ci_and_the_demo_run() -> None:
    (block,) = blocks(section(README, "## Start"), "bash")
    (demo_line, tests_line) = shell_commands(block)
    ci = shell_commands((REPO / ".ci" / "run").read_text())
    (ci_install,) = [line for line in ci if line[:4] == ["python3", "-m", "pip", "install"]]
    for line, then in ((demo_line, ["autosbp", "demo"]), (tests_line, ci[-1])):
        install, rest = line[: line.index("&&")], line[line.index("&&") + 1 :]
        assert install == [word for word in ci_install if word != "-q"], install
        assert rest == then, rest  # the demo; the tests as CI runs them
    demo = build_parser().parse_args(["demo"])
    said = re.search(r"small GPT for (\d+) CPU processes,\s*#?\s*train it (\d+) steps", block)
    assert said is not None, block
    processes, steps = int(said.group(1)), int(said.group(2))
    assert demo.nproc == min(processes, os.cpu_count() or 1) and demo.steps == steps
    assert demo.gpt3_layers == 96  # "then plan GPT-3 175B"
    fast = re.search(r'-m "([^"]+)"', section(README, "## Start"))
    assert fast is not None
    markers = re.findall(r'^\s+"(\w+):', (REPO / "pyproject.toml").read_text(), re.M)
    assert set(re.findall(r"not (\w+)", fast.group(1))) <= set(markers), fast.group(1)


@pytest.mark.slow
def test_the_tour_plans_in_this_process(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(folder)
    code, _ = blocks(section(README, "## Plan, and train in your own loop"), "python")
    (folder / "tour.py").write_text(code)
    runpy.run_path(str(folder / "tour.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "auto plan on 8 x dgx-a100" in out and "object at 0x" not in out, out
    priced = re.findall(r"^\((.+) -> (.+)\) (\d\.\d+(?:e-\d+)?)$", out, re.M)
    assert len(priced) >= 2, out  # each signature of blocks.0.attn.qkv with its step time
    plan = load_plan(folder / "tour-plan.json")
    assert (plan.device_count, plan.dtype) == (8, "bf16")


@pytest.mark.slow
@pytest.mark.dist
def test_train_py_trains_under_torchrun(folder: Path) -> None:
    text = section(README, "## Plan, and train in your own loop")
    _, code = blocks(text, "python")
    (folder / "train.py").write_text(code)
    line = re.search(r"run `(torchrun [^`]*train\.py)`", text)
    assert line is not None
    out = run_torchrun(shlex.split(line.group(1)), folder)
    said = re.findall(r"^loss (\d+\.\d+), held-out loss (\d+\.\d+)$", out, re.M)
    assert len(said) == 1, out  # rank 0 alone prints
    loss, held_out = map(float, said[0])
    assert held_out < math.log(256) - 1 and loss < math.log(256) - 1, out  # it learned bytes
    assert load_plan(folder / "p.json").device_count == 2


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_the_commands_table_runs_in_order(table: dict[str, str], folder: Path) -> None:
    assert list(table) == [
        "zoo", "capture", "profiles", "compare", "hand", "explain", "plan", "train", "show",
        "export",
    ]  # fmt: skip
    for name in ZOO_MODELS:
        assert re.search(rf"^│ {name} ", table["zoo"], re.M), table["zoo"]
    assert "layers=2, hidden=64" in table["zoo"]  # every model's arguments with their defaults

    assert re.search(r"parameters +\d+ tensors, 17\d\.\d+ G values", table["capture"])
    assert "96 x `blocks.<k>`" in table["capture"], table["capture"]

    for profile in ("cpu-gloo", "dgx-a100", "dgx-h100", "dgx1-v100"):
        assert f"│ {profile} " in table["profiles"], table["profiles"]
    assert "machine:" in table["profiles"]  # this machine's, measured or not yet

    compare = load_plan(folder / "gpt8.json")
    assert compare.device_count == 8 and compare.hand_plans
    for hand in compare.hand_plans:  # every hand plan priced beside the plan, in the table
        row = next(  # a table row: under load, progress lines ("searching dp") come first
            line
            for line in table["compare"].splitlines()
            if line.startswith("│") and f" {hand.strategy} " in line
        )
        assert re.search(r"\d\.\d\dx │ .* │ +│$", row), row  # a ratio, an empty note
    assert "plan written to gpt8.json" in table["compare"]

    hand = load_plan(folder / "gpt-megatron-tp2-pp2-dp2-8.json")  # the default name it says
    assert "plan written to gpt-megatron-tp2-pp2-dp2-8.json" in table["hand"]
    assert hand.strategy == "megatron:tp=2,pp=2,dp=2" and len(hand.stages) == 2

    chose = re.search(r"blocks\.0\.attn\.qkv linear .*chose \((.+)\)", table["explain"], re.S)
    assert chose is not None, table["explain"]
    assert len(re.findall(r"│ +\(.+\) │ .* ms │ +\d\.\d{3}x │", table["explain"])) >= 2
    assert re.search(r"│ +1\.000x │", table["explain"])  # the chosen signature, itself

    assert load_plan(folder / "gpt2.json").device_count == 2
    assert "training 10 steps on 2 processes: done" in table["train"]  # progress, piped
    assert re.search(
        r"step 10: loss [\d.]+, [\d,]+ tokens/s, [\d.]+ ms/step, 10/10", table["train"]
    )
    assert "matches single-device training" in table["train"]
    assert (folder / "t.json").is_file() and any((folder / "ck").iterdir())

    assert "predicted step" in table["show"] and "measured step" in table["show"]
    assert (folder / "t.png").stat().st_size > 0

    assert "tensors written to gpt.safetensors" in table["export"]
    model, _ = build_model("gpt")
    model.load_state_dict(load_file(folder / "gpt.safetensors"), strict=True)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(600)
def test_the_cluster_page_runs_under_torchrun(table: dict[str, str], folder: Path) -> None:
    """docs/cluster.md's commands, with the table's gpt2.json: one machine, then two agents."""
    (local,), (two_nodes,) = (shell_commands(b) for b in blocks(CLUSTER, "bash"))
    out = run_torchrun(local, folder)
    steps = options(local)["--steps"]
    assert f"training {steps} steps on 2 processes: done" in out, out
    assert "gpt: auto plan" in out and "matches single-device training" in out, out
    outs, errs = run_two_agents(two_nodes, folder)
    assert "matches single-device training" in outs[0], outs[0]
    for err in errs:  # torchrun takes the command as written: no flag ignored, no warning
        assert "Traceback" not in err and "ignored" not in err and "Warning" not in err, err
    (gpu,) = blocks(CLUSTER, "text")
    assert "--node-rank" not in gpu  # c10d numbers the nodes; torchrun ignores it, and says so

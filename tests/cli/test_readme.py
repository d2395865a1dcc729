"""The README runs as written, in order, on a CPU machine: the tour's Python (the planning
part in this process, `train.py` under torchrun with 2 processes), every row of the CLI table,
and the torchrun command. Each block is read from README.md, never copied here, so a README
edit that breaks a command breaks this test."""

from __future__ import annotations

import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autosbp.cli import main

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]  # what the torchrun script runs


def section(title: str) -> str:
    """The README from the heading `title` to the next heading of its level or above (lines
    inside code blocks are code, never headings)."""
    level = len(title.split(" ", 1)[0])
    lines = README[README.index(title) :].splitlines(keepends=True)
    fenced = False
    for index, line in enumerate(lines[1:], start=1):
        fenced ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fenced and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            return "".join(lines[:index])
    return "".join(lines)


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def table_commands(text: str) -> list[str]:
    return re.findall(r"^\| `(autosbp [^`]*)` \|", text, re.M)


def ranks_env() -> dict[str, str]:
    """This checkout first on the path (the commands run in a temporary folder), gloo on
    loopback."""
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path, "GLOO_SOCKET_IFNAME": "lo"}


def run_torchrun(argv: list[str], cwd: Path) -> str:
    assert argv[0] == "torchrun", argv
    done = subprocess.run(
        [*TORCHRUN, *argv[1:]], cwd=cwd, env=ranks_env(), capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def run_two_agents(argv: list[str], cwd: Path) -> tuple[list[str], list[str]]:
    """The README's two-node command as two torchrun agents on this machine, at a free port
    (the README's own may be taken): their stdout and stderr."""
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
    done = [agent.communicate(timeout=300) for agent in agents]
    for agent, (out, err) in zip(agents, done, strict=True):
        assert agent.returncode == 0, out + err
    outs = sorted((out for out, _ in done), key=len, reverse=True)  # rank 0's table first
    return outs, [err for _, err in done]


def test_readme_runs_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    tour = section("## A five-minute tour")
    plan_code, train_code = blocks(tour, "python")
    runpy.run_path(str(_write(tmp_path / "tour.py", plan_code)), run_name="__main__")
    out = capsys.readouterr().out
    assert "auto plan on 8 x dgx-a100" in out and "object at 0x" not in out, out
    assert (tmp_path / "tour-plan.json").is_file()

    (tmp_path / "train.py").write_text(train_code)
    line = re.search(r"run `(torchrun [^`]*train\.py)`", tour)
    assert line is not None
    out = run_torchrun(shlex.split(line.group(1)), tmp_path)
    assert re.search(r"Shard\(dim=0\)", out) and re.search(r"^loss \d+\.\d+$", out, re.M), out

    commands = table_commands(tour)
    assert len(commands) >= 8, commands
    outputs = {}
    for command in commands:
        assert main(shlex.split(command)[1:]) == 0, command
        outputs[command] = capsys.readouterr().out
    out_of = {c.split()[1] if "--compare" not in c else "compare": o for c, o in outputs.items()}
    assert "layers=2, hidden=64" in out_of["zoo"]
    for strategy in ("dp", "fsdp", "megatron:tp=1,pp=2,dp=4", "megatron:tp=8,pp=1,dp=1"):
        row = next(line for line in out_of["compare"].splitlines() if f" {strategy} " in line)
        assert re.search(r"\d\.\d\dx │ .* │ +│$", row), row  # priced: a ratio, an empty note
    assert "training 10 steps on 2 processes: done" in out_of["train"]  # progress, piped
    assert re.search(r"step 10: loss [\d.]+, [\d.]+ ms/step, 10/10", out_of["train"])
    assert "matches single-device training" in out_of["train"]
    assert "measured step" in out_of["show"] and (tmp_path / "t.png").is_file()

    cluster = section("### On a cluster: torchrun")
    local, two_nodes = blocks(cluster, "bash")
    out = run_torchrun(shlex.split(local), tmp_path)
    assert "matches single-device training" in out, out
    assert out.count("gpt: ") >= 1 and "training 10 steps on 2 processes: done" in out, out
    outs, errs = run_two_agents(shlex.split(two_nodes), tmp_path)
    assert "matches single-device training" in outs[0], outs[0]
    for err in errs:  # torchrun takes the command as written: no flag ignored, no warning
        assert "Traceback" not in err and "ignored" not in err and "Warning" not in err, err
    (gpu,) = blocks(cluster, "text")
    assert "--node-rank" not in gpu  # c10d numbers the nodes; torchrun ignores it, and says so


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path

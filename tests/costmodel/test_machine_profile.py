"""This machine's profile, local CPU work's default: the fingerprint, the cache (hit, machine
change, a killed write, the opt-out) and `autosbp profiles`' line on it.

tests/conftest.py points AUTOSBP_DEFAULT_PROFILE at cpu-gloo for the suite; the tests here unset
it (`machine_default`) and give every test a cache folder of its own. One test measures for real
(the machine changed); the others stage the cache with the shipped cpu-gloo's numbers stamped
with a fingerprint, so a cache hit is told from a measurement by the numbers planned with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from rich.console import Console

from autosbp.cli import main
from autosbp.commands.profile import default_profile
from costmodel import load_profile, save_profile
from costmodel.machine import LOADED_MIN, Fingerprint, this_machine, usable_cores
from costmodel.machine_profile import (
    DEFAULT_PROFILE_ENV,
    cached_machine_profile,
)
from costmodel.profile import MeasuredOn, Profile
from costmodel.profile_io import (
    CACHE_DIR_ENV,
    MACHINE_PROFILE,
    cache_dir,
    machine_profile_path,
)

REPO = Path(__file__).resolve().parents[2]
FAKE = Fingerprint("Fake CPU 9000", 96, 2**40, "0.0.1")
STAMP = "2026-01-01T00:00:00+00:00"


@pytest.fixture
def machine_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Local CPU work's default is this machine's profile, cached in a fresh folder."""
    monkeypatch.delenv(DEFAULT_PROFILE_ENV, raising=False)
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def stamped(machine: Fingerprint) -> Profile:
    """The shipped cpu-gloo as if measured here on `machine`."""
    on = MeasuredOn(machine, STAMP, "autosbp profile --refresh --nproc 2 --quick", "testhost")
    return dataclasses.replace(load_profile("cpu-gloo"), name=MACHINE_PROFILE, machine=on)


def console() -> tuple[Console, list[str]]:
    lines: list[str] = []
    return Console(file=_Lines(lines), width=200), lines


class _Lines:
    """A file that keeps what a console prints."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> int:
        self.lines.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_fingerprint_is_this_machine() -> None:
    here = this_machine()
    assert here.torch == torch.__version__
    assert here.cores == usable_cores() == len(os.sched_getaffinity(0))
    page_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert page_bytes - 2**20 < here.memory_bytes <= page_bytes
    assert here == this_machine()  # stable: what the cache is keyed by


def test_machine_block_round_trips(tmp_path: Path) -> None:
    profile = stamped(this_machine())
    assert load_profile(save_profile(profile, tmp_path / "m.json")) == profile


def test_cache_folder_follows_xdg_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/x/cache")
    assert cache_dir() == Path("/x/cache/autosbp/profiles")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "autosbp" / "profiles"
    monkeypatch.setenv(CACHE_DIR_ENV, "/y")
    assert machine_profile_path() == Path("/y/machine.json")


def test_cache_hit_plans_with_the_cached_profile(
    machine_default: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cached = save_profile(stamped(this_machine()), machine_profile_path())
    before = cached.read_bytes()
    args = ["plan", "mlp", "--devices", "2", "--strategy", "dp", "--time-limit-s", "20"]
    assert main([*args, "--out", str(tmp_path / "default.json")]) == 0
    out = capsys.readouterr().out
    assert "measuring" not in out and "2 x machine" in out
    assert cached.read_bytes() == before  # read, not re-measured
    assert main([*args, "--profile", "cpu-gloo", "--out", str(tmp_path / "shipped.json")]) == 0
    plans = [read_json(tmp_path / name) for name in ("default.json", "shipped.json")]
    assert plans[0]["cluster"]["profile"] == MACHINE_PROFILE
    assert plans[1]["cluster"]["profile"] == "cpu-gloo"
    assert plans[0]["predicted"] == plans[1]["predicted"]  # the cached numbers are cpu-gloo's


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize(
    "field", ["cpu", "cores", "memory_bytes", "torch"], ids=lambda f: f"other-{f}"
)
def test_any_fingerprint_change_makes_the_cache_stale(machine_default: Path, field: str) -> None:
    other = dataclasses.replace(this_machine(), **{field: getattr(FAKE, field)})
    save_profile(stamped(other), machine_profile_path())
    state = cached_machine_profile()
    assert state.profile is None and "measured on another machine" in state.why_not
    assert cached_machine_profile(other).profile == stamped(other)  # fresh for that machine


@pytest.mark.parametrize(
    ("load_then", "load_now", "fresh"),
    [
        pytest.param(None, 0.0, True, id="load-not-recorded"),
        pytest.param(0.1, 0.0, True, id="measured-quiet"),
        pytest.param(6.8, 7.5, True, id="measured-loaded-still-loaded"),
        pytest.param(6.8, 0.2, False, id="measured-loaded-quiet-now"),
    ],
)
def test_a_profile_measured_on_a_loaded_machine_is_re_measured_once_quiet(
    machine_default: Path, load_then: float | None, load_now: float, fresh: bool
) -> None:
    two_cores = dataclasses.replace(this_machine(), cores=2)  # 2 ranks measured on 2 cores
    profile = stamped(two_cores)
    assert profile.machine is not None
    on = dataclasses.replace(profile.machine, load_1min=load_then)
    save_profile(dataclasses.replace(profile, machine=on), machine_profile_path())
    state = cached_machine_profile(two_cores, load_now=load_now)
    assert (state.profile is not None) is fresh
    if not fresh:
        assert state.why_not.startswith("measured while the machine was loaded (other work ran")
        assert state.why_not.endswith("and it is quiet now")


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_machine_change_re_measures(machine_default: Path) -> None:
    path = save_profile(stamped(FAKE), machine_profile_path())
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], check=True,
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    leftover = path.with_name(f".{path.name}.{dead}.tmp")  # a writer killed before its rename
    leftover.write_text('{"format": "autosbp.prof')
    out, lines = console()
    assert default_profile(out) == MACHINE_PROFILE
    text = "".join(lines)
    assert "measured on another machine (Fake CPU 9000" in text and "measured in" in text
    fresh = cached_machine_profile()
    assert fresh.profile is not None and fresh.profile.machine is not None
    assert fresh.profile.machine.fingerprint == this_machine()
    assert fresh.profile.machine.date > STAMP and fresh.profile.machine.load_1min is not None
    measured_by = fresh.profile.device.peak_flops.fp32.source.command
    assert measured_by == "autosbp profile --refresh --nproc 2 --quick"  # not cpu-gloo's
    assert not leftover.exists()
    again = cached_machine_profile(load_now=LOADED_MIN)  # not quiet: whatever load it ran at
    assert again.profile == fresh.profile  # kept: the next use reads it


KILL = {
    "before-rename": "os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)",
    "mid-write": textwrap.dedent("""
        real = pathlib.Path.write_text
        def half(self, text, *a, **k):
            real(self, text[: len(text) // 2], *a, **k)
            os.kill(os.getpid(), signal.SIGKILL)
        pathlib.Path.write_text = half
    """),
}


@pytest.mark.parametrize("previous", [False, True], ids=["first-write", "over-a-cached-one"])
@pytest.mark.parametrize("when", list(KILL))
def test_killed_write_leaves_nothing_half_written(
    machine_default: Path, when: str, previous: bool
) -> None:
    path = machine_profile_path()
    old = save_profile(stamped(this_machine()), path).read_bytes() if previous else None
    script = "\n".join([
        "import os, pathlib, signal, dataclasses",
        "from costmodel import load_profile, save_profile",
        "from costmodel.profile_io import machine_profile_path",
        KILL[when],
        "p = dataclasses.replace(load_profile('cpu-gloo'), name='machine')",
        "save_profile(p, machine_profile_path())",
    ])  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=120, check=False)
    assert done.returncode == -9  # killed, its cleanup never ran
    if previous:
        assert path.read_bytes() == old
        assert cached_machine_profile().profile == stamped(this_machine())
    else:
        assert not path.exists()
        assert cached_machine_profile().why_not == "not measured yet"
    assert [p.name for p in machine_default.glob("*.json")] == ([path.name] if previous else [])


def test_opt_out_never_measures(
    machine_default: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(DEFAULT_PROFILE_ENV, "cpu-gloo")
    out, lines = console()
    assert default_profile(out) == "cpu-gloo" and lines == []
    monkeypatch.delenv(DEFAULT_PROFILE_ENV)
    args = ["plan", "mlp", "--devices", "2", "--strategy", "dp", "--profile", "cpu-gloo"]
    assert main([*args, "--out", str(tmp_path / "p.json")]) == 0
    assert not machine_default.exists()  # neither measured nor cached


@pytest.mark.parametrize("requested", [None, MACHINE_PROFILE], ids=["default", "named"])
def test_torchrun_does_not_measure(machine_default: Path, requested: str | None) -> None:
    out, lines = console()
    assert default_profile(out, requested, may_measure=False) == "cpu-gloo"
    assert "not measured yet" in "".join(lines) and not machine_default.exists()


def test_a_named_profile_wins(machine_default: Path) -> None:
    out, lines = console()
    assert default_profile(out, "dgx-a100") == "dgx-a100" and lines == []
    assert not machine_default.exists()


def test_profiles_lists_the_cached_machine_profile(
    machine_default: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["profiles"]) == 0
    assert "machine: this machine's profile is not measured yet" in capsys.readouterr().out
    save_profile(stamped(this_machine()), machine_profile_path())
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    assert f"measured {STAMP} on testhost" in out
    assert this_machine().describe() in out
    save_profile(stamped(FAKE), machine_profile_path())
    assert main(["profiles"]) == 0
    assert "measured on another machine (Fake CPU 9000" in capsys.readouterr().out

"""Probe: bad inputs and faults through the `autosbp` CLI, each classified as a user sees it.

Run: python bench/robustness.py [--only TEXT] [--timeout-s 120] [--no-faults]

Every case runs `python -m autosbp.cli ...` in a process of its own (a new session, so a case
that hangs is stopped with everything it started) and is classified:
- clean: the expected outcome: a bad input exits 2 with one `error:` paragraph and no traceback;
  a good one (`ok` cases) exits 0;
- hang: still running after --timeout-s (stopped);
- silent: a bad input that exits 0 (accepted, so trained or shown as if it were right), or
  output that carries an escape sequence from an input file to the terminal;
- traceback: any other end (a Python traceback, a rank's traceback, another exit code).
Faults: the parent of a training job killed (SIGKILL, SIGTERM): clean when no process of the
job is left 5 s later; the job's listening sockets: clean when none listens beyond loopback.
The last lines print tried / clean / hang / silent / traceback. Figures of the issue "Real
jobs" (#18) were measured with it, before and after; it takes several minutes on 2 cores.

Lives elsewhere: the corpus of damaged inputs (tests/support/bad_inputs_corpus.py, shared with the
tests), the tests of the same cases (tests/cli/test_bad_inputs.py, tests/capturing/test_failures.py,
tests/runtime/test_job_control.py), which run without launching where they can.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from tests.support.bad_inputs_corpus import write_corpus  # noqa: E402

MARKER_ENV = "AUTOSBP_PROBE_MARKER"  # set in a fault case's environment; ranks inherit it
KILL_WAIT_S = 5.0  # the bar: no process of the job left 5 s after its parent died


@dataclass(frozen=True, slots=True)
class Case:
    """`argv` after `autosbp`, `{in}` standing for the inputs folder; `ok`: the expected end is
    success (exit 0, nothing unsafe printed), else a clean error."""

    id: str
    group: str
    argv: tuple[str, ...]
    ok: bool = False


def _train(plan: str, *extra: str, model: str = "mlp", args: str = "layers=4") -> tuple[str, ...]:
    return ("train", model, "--model-args", args, "--nproc", "2", "--plan", plan, *extra)


CASES: tuple[Case, ...] = (
    # plans inconsistent in themselves or with the model (item 3)
    Case("stage-data-cycle", "bad plan", _train("{in}/plan-cycle.json")),
    Case("mesh-3-on-2-devices", "bad plan", _train("{in}/plan-mesh3.json")),
    Case("duplicate-device", "bad plan", _train("{in}/plan-dupdev.json")),
    Case("device-out-of-range", "bad plan", _train("{in}/plan-devrange.json")),
    Case("node-on-missing-stage", "bad plan", _train("{in}/plan-nostage.json")),
    Case("param-layout-not-node", "bad plan", _train("{in}/plan-paramsbp.json")),
    Case("param-stage-not-node", "bad plan", _train("{in}/plan-paramstage.json")),
    Case("empty-stage", "bad plan", _train("{in}/plan-emptystage.json")),
    Case("block-nodes-deleted", "bad plan", _train("{in}/plan-deleted.json")),
    Case("stage-mesh-not-plan-mesh", "bad plan", _train("{in}/plan-stagemesh.json")),
    Case("mesh-dims-not-shape", "bad plan", _train("{in}/plan-meshdims.json")),
    Case("micro-batches-not-dividing", "bad plan", _train("{in}/plan-mb3.json")),
    Case("signature-not-offered", "bad plan", _train("{in}/plan-badsig.json")),
    Case("show-10M-micro-batches", "bad plan", ("show", "{in}/plan-mb1e7.json")),
    Case("explain-10M-devices", "bad plan", ("explain", "{in}/plan-dev1e7.json")),
    # numbers (item 4)
    Case("plan-nan-prediction", "bad number", _train("{in}/plan-nan.json")),
    Case("plan-infinite-stage-time", "bad number", ("show", "{in}/plan-inf.json")),
    Case("plan-memory-1e400", "bad number", _train("{in}/plan-mem400.json")),
    Case("plan-global-batch-1e30", "bad number", _train("{in}/plan-batch30.json")),
    Case("plan-global-batch-not-model", "bad number", _train("{in}/plan-batch16.json")),
    Case("plan-optimizer-sbp-S7", "bad number", _train("{in}/plan-optsbp.json")),
    *(
        Case(
            f"profile-{name}",
            "bad number",
            (
                "plan",
                "mlp",
                "--devices",
                "2",
                "--profile",
                f"{{in}}/profile-{name}.json",
                "--out",
                "{in}/out.json",
            ),
        )
        for name in ("nan-bandwidth", "inf-memory-bandwidth", "nan-flops", "1e300-flops")
    ),
    # files that end in a raw traceback (item 5)
    Case("plan-nested-100k", "raw traceback", ("explain", "{in}/plan-nested.json")),
    Case("plan-devices-2.0", "raw traceback", _train("{in}/plan-devfloat.json")),
    Case(
        "model-nonzero",
        "raw traceback",
        ("plan", "{in}/bad_models.py:nonzero", "--devices", "2", "--out", "{in}/out.json"),
    ),
    Case(
        "model-no-parameters",
        "raw traceback",
        _train("dp", model="{in}/bad_models.py:noparams", args=""),
    ),
    Case(
        "model-loss-ignores-params",
        "raw traceback",
        _train("dp", model="{in}/bad_models.py:unused", args=""),
    ),
    Case("model-sys-exit", "raw traceback", ("capture", "{in}/bad_models.py:exits")),
    # silently wrong numerics, and what reaches the terminal (items 4, 6)
    Case(
        "unseeded-model-check",
        "silent",
        _train("dp", "--check", "--steps", "3", model="{in}/bad_models.py:unseeded", args=""),
        ok=True,
    ),
    # issue #48: real causes before launch, and the numbers a user sees
    *(
        Case(f"plan-{name}", "bad plan", _train(f"{{in}}/plan-{name}.json", model="gpt", args=""))
        for name in ("exchanges-removed", "exchanges-swapped", "exchanges-added")
    ),
    Case("explain-plan-version-next", "bad plan", ("explain", "{in}/plan-vnext.json")),
    *(
        Case(
            f"plan-{name}",
            "wrong message",
            (
                "plan",
                "mlp",
                "--model-args",
                "layers=4",
                "--devices",
                "2",
                "--strategy",
                strategy,
                *extra,
                "--out",
                "{in}/out.json",
            ),
        )
        for name, strategy, extra in (
            ("vp2-mb1", "megatron:tp=1,pp=2,dp=1,vp=2,mb=1", ()),
            ("pp2-mb1", "megatron:tp=1,pp=2,dp=1,mb=1", ()),
            ("vp2-degrees-4-on-2", "megatron:tp=2,pp=2,dp=1,vp=2", ()),
            ("vp2-no-fit", "megatron:tp=1,pp=2,dp=1,vp=2,mb=2", ("--memory-gib", "0.0001")),
        )
    ),
    Case(
        "plan-tp2-valid-conv-not-memory",
        "wrong message",
        (
            "plan",
            "{in}/bad_models.py:validconv",
            "--devices",
            "2",
            "--strategy",
            "megatron:tp=2,pp=1,dp=1",
            "--out",
            "{in}/out.json",
        ),
    ),
    Case("escapes-in-plan-show", "security", ("show", "{in}/plan-escape.json")),
    Case("escapes-in-plan-explain", "security", ("explain", "{in}/plan-escape.json")),
    Case(
        "manifest-names-etc-hostname",
        "security",
        _train("dp", "--checkpoint-dir", "{in}/ckpt-escape", "--resume"),
    ),
)


# ------------------------------------------------------------------------------- inputs
def prepare(root: Path) -> None:
    """Three real plans (mlp with 4 blocks: data parallel, and 2 stages; the zoo gpt under
    context parallelism), and every damaged plan and profile and bad model of the shared corpus
    (tests/support/bad_inputs_corpus.py)."""
    for name, model, strategy in (
        ("dp", ("mlp", "--model-args", "layers=4"), "dp"),
        ("pp", ("mlp", "--model-args", "layers=4"), "megatron:tp=1,pp=2,dp=1"),
        ("cp", ("gpt",), "megatron:tp=1,pp=1,dp=1,cp=2"),
    ):
        out = str(root / f"{name}.json")
        _cli(["plan", *model, "--devices", "2", "--strategy", strategy, "--out", out])
    plans = {n: json.loads((root / f"{n}.json").read_text()) for n in ("dp", "pp", "cp")}
    profile = json.loads((REPO / "costmodel" / "profiles" / "cpu-gloo.json").read_text())
    write_corpus(root, plans, profile)


# ------------------------------------------------------------------------------ running
def _cli(argv: list[str]) -> None:
    subprocess.run([sys.executable, "-m", "autosbp.cli", *argv], check=True, capture_output=True)


def run_case(case: Case, root: Path, timeout_s: float) -> tuple[str, float, str]:
    """(class, seconds, the last line of output) of one case."""
    argv = [a.replace("{in}", str(root)) for a in case.argv]
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "autosbp.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=root,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the case's own session: it and its ranks
        proc.communicate()
        return "hang", time.monotonic() - start, f"still running after {timeout_s:.0f} s"
    elapsed_s = time.monotonic() - start
    text = out.decode(errors="replace")
    last = next((line for line in reversed(text.splitlines()) if line.strip()), "")
    if "\x1b" in text:
        return "silent", elapsed_s, "an escape sequence from the input reached the output"
    if case.ok:
        return ("clean" if proc.returncode == 0 else "traceback"), elapsed_s, last
    if proc.returncode == 0:
        return "silent", elapsed_s, "exit 0: accepted"
    clean = proc.returncode == 2 and "Traceback" not in text and "error:" in text
    return ("clean" if clean else "traceback"), elapsed_s, f"exit {proc.returncode}: {last}"


def _job_pids(marker: str) -> set[int]:
    """Processes whose environment holds `marker` (the job and its ranks, nothing else)."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    pids.add(int(entry.name))
            except OSError:
                continue
    return pids


def _wildcard_listeners(pids: set[int]) -> list[str]:
    """`ss -ltnp` lines of `pids` listening beyond loopback."""
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    lines = [line for line in out.splitlines() if any(f"pid={p}," in line for p in pids)]
    return [line for line in lines if not re.search(r"\s(127\.0\.0\.1|\[::1\]):\d+\s", line)]


def run_fault(sig: signal.Signals, timeout_s: float) -> list[tuple[str, str, float, str]]:
    """Kill the parent of a long training job with `sig`: (id, class, seconds, detail) for the
    processes left and for the sockets the job listened on."""
    marker = uuid.uuid4().hex
    env = {**os.environ, MARKER_ENV: marker}
    argv = _train("dp", "--steps", "1000000", args="layers=2,hidden=64")
    proc = subprocess.Popen(
        [sys.executable, "-m", "autosbp.cli", *argv],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout_s
    while len(_job_pids(marker)) < 3 and time.monotonic() < deadline:  # parent + 2 ranks
        time.sleep(0.5)
    time.sleep(10.0)  # let the ranks reach training
    listeners = _wildcard_listeners(_job_pids(marker))
    os.kill(proc.pid, sig)
    killed = time.monotonic()
    proc.wait()
    while _job_pids(marker) and time.monotonic() < killed + KILL_WAIT_S:
        time.sleep(0.1)
    left = _job_pids(marker)
    for pid in left:  # ours (they carry our marker): stop them
        os.kill(pid, signal.SIGKILL)
    rows = [
        (
            f"parent-{sig.name}",
            "clean" if not left else "silent",
            time.monotonic() - killed,
            f"{len(left)} process(es) of the job left after {KILL_WAIT_S:.0f} s",
        ),
    ]
    if sig is signal.SIGKILL:
        detail = listeners[0].strip() if listeners else "loopback only"
        rows.append(("listens-beyond-loopback", "silent" if listeners else "clean", 0.0, detail))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose id contains this")
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--no-faults", action="store_true", help="skip the parent-kill cases")
    args = parser.parse_args()
    rows: list[tuple[str, str, str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="autosbp-probe-") as tmp:
        root = Path(tmp)
        prepare(root)
        for case in CASES:
            if args.only in case.id:
                kind, seconds, detail = run_case(case, root, args.timeout_s)
                rows.append((case.group, case.id, kind, seconds, detail))
                print(f"{case.id:28} {kind:9} {seconds:6.1f} s  {detail[:110]}", flush=True)
    if not args.no_faults and not args.only:
        for sig in (signal.SIGKILL, signal.SIGTERM):
            for case_id, kind, seconds, detail in run_fault(sig, args.timeout_s):
                rows.append(("fault", case_id, kind, seconds, detail))
                print(f"{case_id:28} {kind:9} {seconds:6.1f} s  {detail[:110]}", flush=True)
    counts = Counter(kind for *_, kind, _, _ in rows)
    print(
        f"tried {len(rows)} / clean {counts['clean']} / hang {counts['hang']} / silent "
        f"{counts['silent']} / traceback {counts['traceback']}"
    )


if __name__ == "__main__":
    main()

"""This machine's own profile: the default for local CPU work, measured once, cached, kept fresh.

Lives here: which profile local CPU work uses when none is named (`default_profile_name`: the
environment's AUTOSBP_DEFAULT_PROFILE, else "machine"), the state of the cached one
(`cached_machine_profile`: fresh, or why not), and measuring it (`measure_machine_profile`: the
profiler's quick mode on 2 gloo ranks, a few seconds, the result stamped with this machine's
`Fingerprint`, where and when, and saved atomically). Lives elsewhere: the cache folder and the
name's resolution (`profile_io`), the fingerprint (`machine`), the measurement itself
(`measure`), the progress line (the CLI, `autosbp.commands.profile.default_profile`).

Why: a shipped CPU profile describes the machine it was measured on; another machine runs the
same ops at 0.3-0.6x or 2x its prices, and every prediction inherits that error. A profile
measured here prices this machine.

Invariants: a cached profile is used only while its fingerprint is this machine's (another CPU,
core count, memory size or torch version re-measures it), and one measured while other work
loaded the machine only until it is quiet (then it is re-measured: a loaded machine measures
slow, and the cache would keep that for good); a file that cannot be read counts as
missing (re-measured), never as an error; the cache file is replaced atomically (`save_profile`),
so a killed measurement leaves the previous profile or none, never half of one.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from costmodel.errors import ProfileError
from costmodel.machine import LOADED_MIN, Fingerprint, LoadSample, load_average, this_machine
from costmodel.profile import MeasuredOn, Profile
from costmodel.profile_io import (
    MACHINE_PROFILE,
    load_profile,
    machine_profile_path,
    save_profile,
)

DEFAULT_PROFILE_ENV = "AUTOSBP_DEFAULT_PROFILE"  # a name or path: local CPU work's default
MACHINE_NPROC = 2  # ranks measured: the smallest even count (send/recv needs a partner)
ProgressFn = Callable[[int, int, str], None]  # (done, total, label), as the profiler reports


def default_profile_name() -> str:
    """The profile local CPU work uses when the command names none: $AUTOSBP_DEFAULT_PROFILE
    (a name or a path; `cpu-gloo` opts out of measuring), else this machine's ("machine")."""
    return os.environ.get(DEFAULT_PROFILE_ENV) or MACHINE_PROFILE


@dataclass(frozen=True, slots=True)
class CachedProfile:
    """The cache's state: its file, the profile if it is fresh, else why it is not."""

    path: Path
    profile: Profile | None
    why_not: str = ""  # "" when fresh


def cached_machine_profile(
    machine: Fingerprint | None = None, load_now: float | None = None
) -> CachedProfile:
    """The cached profile of this machine (`machine`, by default `this_machine()`), if it
    exists, reads, was measured on this machine, and not on a loaded machine that is quiet now
    (`load_now`, by default the 1-minute load average)."""
    path = machine_profile_path()
    if not path.is_file():
        return CachedProfile(path, None, "not measured yet")
    try:
        profile = load_profile(path)
    except ProfileError as exc:  # truncated by hand, or written by another autosbp version
        return CachedProfile(path, None, f"unreadable ({exc})")
    here = machine or this_machine()
    if profile.machine is None:
        return CachedProfile(path, None, "it does not say which machine it measured")
    if profile.machine.fingerprint != here:
        return CachedProfile(
            path,
            None,
            f"measured on another machine ({profile.machine.fingerprint.describe()}; this one: "
            f"{here.describe()})",
        )
    quiet_now = (load_average() if load_now is None else load_now) < LOADED_MIN
    if measured_loaded(profile) and quiet_now:
        return CachedProfile(path, None, f"{measured_loaded(profile)}, and it is quiet now")
    return CachedProfile(path, profile)


def measured_loaded(profile: Profile) -> str:
    """Why `profile` was measured on a loaded machine ("" if it was not, or is not known)."""
    on = profile.machine
    if on is None or on.load_1min is None:
        return ""
    ranks = int(profile.topology.devices_per_node.value)  # the ranks it measured, on one node
    if not LoadSample(on.load_1min, on.load_1min, on.fingerprint.cores, ranks).loaded:
        return ""
    return (
        f"measured while the machine was loaded (other work ran about {on.load_1min:.1f} "
        f"processes at a time on its {on.fingerprint.cores} cores beside the {ranks} ranks)"
    )


def measure_machine_profile(
    on_progress: ProgressFn | None = None, *, quick: bool = True, nproc: int = MACHINE_NPROC
) -> Profile:
    """Measure this machine (the profiler on `nproc` gloo ranks; quick: a few seconds) and
    cache the profile, replacing the cached one atomically."""
    from costmodel.measure.fitting import build_profile
    from costmodel.measure.items import ProfilerConfig
    from costmodel.measure.profiler import measure

    command = f"autosbp profile --refresh --nproc {nproc}" + (" --quick" if quick else "")
    machine, before = this_machine(), load_average()  # what the numbers are measured under
    config = ProfilerConfig.for_mode(nproc, "gloo", nproc, quick, command)
    measurements = measure(config, on_progress)
    others = LoadSample(before, load_average(), machine.cores, nproc).others
    on = MeasuredOn(machine, measurements.started, command, _host(), round(others, 2))
    profile = replace(build_profile(measurements, MACHINE_PROFILE), machine=on)
    path = machine_profile_path()
    _remove_dead_writers(path)
    save_profile(profile, path)
    return profile


def _host() -> str:
    """The host name, for people reading the profile (a name, never a path)."""
    with contextlib.suppress(OSError):
        return socket.gethostname()
    return ""


def _remove_dead_writers(path: Path) -> None:
    """Delete the temporary files of writers that were killed before their rename (the name
    holds the writer's process id: a live writer's file is kept)."""
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid = tmp.name.removeprefix(f".{path.name}.").removesuffix(".tmp")
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        return True
    return True

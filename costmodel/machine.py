"""Facts about the machine this process runs on: what it is (`Fingerprint`) and how busy it is
(`LoadSample`).

Lives here: `this_machine()` (CPU model, usable cores, physical memory, torch version: what a
measured CPU profile depends on), `LoadSample` (os.getloadavg before and after a job) and
`load_note`, the one
sentence saying that timings taken on a loaded machine are not comparable. Lives elsewhere: the
cached profile of this machine that the fingerprint keys (`machine_profile`), where the load is
recorded (a training trace's metadata, `autosbp.commands.train`) and shown (`autosbp show`).

Invariants: a fingerprint holds no path and no host name (a container gets a new host name on
every start, and the same CPU, cores, memory and torch price the same); reading one is cheap (no
torch import: the version comes from the installed package's metadata).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from importlib import metadata
from typing import Any

MIB = 2**20
# The other work's load (runnable processes, 1-minute average) from which a machine counts as
# loaded when it also leaves a rank without a core: a judgement; an idle Linux box reads
# 0.0-0.3 (daemons, the shell), one other busy process reads about 1.
LOADED_MIN = 0.5


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What a CPU profile's numbers depend on; a profile measured under another is stale."""

    cpu: str  # the model name (/proc/cpuinfo), else platform.processor() or the architecture
    cores: int  # the cores this process may run on (its CPU affinity)
    memory_bytes: int  # physical memory, rounded down to whole MiB (it jitters by pages)
    torch: str  # the installed torch's version

    def describe(self) -> str:
        """For people: `Intel(R) Xeon(R), 2 cores, 23.4 GiB, torch 2.13.0+cpu`."""
        return (
            f"{self.cpu}, {self.cores} cores, {self.memory_bytes / 2**30:.1f} GiB, "
            f"torch {self.torch}"
        )


def this_machine() -> Fingerprint:
    """The fingerprint of the machine this process runs on."""
    return Fingerprint(cpu_model(), usable_cores(), _memory_bytes() // MIB * MIB, _torch())


def usable_cores() -> int:
    """Cores this process may run on (a container's or taskset's share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name, as the OS states it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf names on this OS
        return 0


def _torch() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


@dataclass(frozen=True, slots=True)
class LoadSample:
    """The machine's 1-minute load average before and after a job that ran `ranks` processes
    here, on `cores` cores."""

    before: float
    after: float
    cores: int
    ranks: int

    @property
    def others(self) -> float:
        """The load of other work: what ran before the job, or what the job's own ranks do not
        explain after it (a 1-minute average lags: a short job barely moves it)."""
        return max(self.before, self.after - self.ranks, 0.0)

    @property
    def loaded(self) -> bool:
        """Other work took cores the job's ranks needed."""
        return self.others >= LOADED_MIN and self.others + self.ranks > self.cores

    def to_json(self) -> dict[str, Any]:
        return {
            "load_1min_before": round(self.before, 2),
            "load_1min_after": round(self.after, 2),
            "cores": self.cores,
            "ranks_here": self.ranks,
        }

    @classmethod
    def from_json(cls, data: Any) -> LoadSample | None:
        """The sample a trace's metadata holds; None where it holds none (an older trace) or
        not one of these."""
        try:
            return cls(
                float(data["load_1min_before"]), float(data["load_1min_after"]),
                int(data["cores"]), int(data["ranks_here"]),
            )  # fmt: skip
        except (TypeError, KeyError, ValueError):
            return None


def load_average() -> float:
    """The 1-minute load average (0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows
        return 0.0


def load_note(sample: LoadSample | None) -> str | None:
    """The warning that timings of a loaded machine are not comparable; None if it was not."""
    if sample is None or not sample.loaded:
        return None
    return (
        f"the machine was loaded: beside the job's {sample.ranks} ranks, other work ran about "
        f"{sample.others:.1f} processes at a time on its {sample.cores} cores (1-minute load "
        f"average {sample.before:.2f} before, {sample.after:.2f} after), so these times are not "
        "comparable with the prediction or with a run on a quiet machine"
    )

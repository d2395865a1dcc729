"""The `autosbp profile` and `autosbp profiles` commands.

Lives here: their arguments and the tables they print (nccl-tests' columns: size, count, time,
algbw, busbw) and the compute/communication overlap line. Lives elsewhere: measuring
(`profiler`), fitting (`fitting`), the plot (`plot`), files (`profile_io`), the progress display
(`progress`). `autosbp.cli` calls `configure(parser, name)` once per
command name and `run(args, console)`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from costmodel.errors import ProfileError
from costmodel.machine_profile import (
    DEFAULT_PROFILE_ENV,
    MACHINE_NPROC,
    cached_machine_profile,
    default_profile_name,
    measured_loaded,
)
from costmodel.prices import CollectivePrice, bus_factor
from costmodel.profile import CollectiveKind, DType, Profile
from costmodel.profile_io import (
    CACHE_DIR_ENV,
    MACHINE_PROFILE,
    PROFILE_PATH_ENV,
    load_profile,
    machine_profile_path,
    profile_dirs,
    save_profile,
    shipped_profiles,
)
from terminal.progress import activity

FALLBACK_PROFILE = "cpu-gloo"  # shipped: the default where this machine's cannot be measured
# measured on 2 cores: 4.4 s (8 s with start-up) quiet; 8-9 s at load 5-10, 19 s at load 12
MACHINE_MEASURE_S = "5-10 s on a quiet machine"

if TYPE_CHECKING:  # the profiler pulls in torch: imported only when `profile` runs
    from costmodel.measure.items import ProfilerConfig
    from costmodel.measure.profiler import Measurements


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    if name == "profiles":
        return
    parser.add_argument(
        "--nproc", type=int, default=2, help="processes (devices) to measure (default: 2)"
    )
    parser.add_argument(
        "--backend", choices=("gloo", "nccl"), default="gloo",
        help="gloo: CPU processes; nccl: one GPU per process (default: gloo)",
    )  # fmt: skip
    parser.add_argument(
        "--devices-per-node",
        type=int,
        default=None,
        help="ranks per node; groups crossing nodes are inter_node (default: nproc, one node)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and repeats (default: the full run)"
    )
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--out", type=Path,
        help="profile JSON to write (+ .png) (default: none; --out or --refresh is required)",
    )  # fmt: skip
    where.add_argument(
        "--refresh", action="store_true",
        help="re-measure this machine's profile, the default of local CPU work, in its cache "
        f"(${CACHE_DIR_ENV}, else $XDG_CACHE_HOME/autosbp/profiles or ~/.cache/autosbp/profiles)",
    )  # fmt: skip


def run(args: argparse.Namespace, console: Console) -> int:
    if args.command == "profiles":
        table, skipped = _profiles_table()
        console.print(table)
        for path, reason in skipped:
            console.print(f"skipped {path}: {reason}", markup=False, soft_wrap=True)
        console.print(_machine_line(), markup=False, soft_wrap=True)
        return 0
    if args.refresh:
        if args.backend != "gloo" or args.devices_per_node not in (None, args.nproc):
            raise ProfileError(
                "--refresh measures this machine's CPU profile on gloo ranks of one node; drop "
                "--backend and --devices-per-node (or write another profile with --out PATH)."
            )
        _config(args)  # the same refusals as --out (an odd --nproc)
        start = time.monotonic()
        _measure_machine(console, "re-measuring this machine's profile", args.quick, args.nproc)
        console.print(
            f"measured in {time.monotonic() - start:.1f} s: {machine_profile_path()}",
            markup=False, soft_wrap=True,
        )  # fmt: skip
        return 0
    return _run_profile(args, console)


def default_profile(
    console: Console, requested: str | None = None, *, may_measure: bool = True
) -> str:
    """The profile local CPU work uses: `requested` (--profile), else `default_profile_name()`;
    where that is this machine's ("machine"), it is measured now (with a progress line) if it
    is not cached or the machine changed. Without `may_measure` (under torchrun, whose ranks
    all run already) a missing one is not measured: the shipped cpu-gloo is used, with a note
    saying how to measure."""
    name = requested or default_profile_name()
    if name != MACHINE_PROFILE:
        return name
    cached = cached_machine_profile()
    if cached.profile is not None:
        return name
    if not may_measure:
        console.print(
            f"note: this machine's profile is {cached.why_not}, so this plan is priced with the "
            f"shipped {FALLBACK_PROFILE} (another machine's); run `autosbp profile --refresh` "
            "once before torchrun to price this one.",
            markup=False, soft_wrap=True,
        )  # fmt: skip
        return FALLBACK_PROFILE
    console.print(
        f"this machine's profile, the default for local CPU work, is {cached.why_not}: "
        f"measuring it once (quick profiler on {MACHINE_NPROC} gloo ranks, about "
        f"{MACHINE_MEASURE_S}) into {cached.path}; `--profile {FALLBACK_PROFILE}` or "
        f"{DEFAULT_PROFILE_ENV}={FALLBACK_PROFILE} skips it.",
        markup=False, soft_wrap=True,
    )  # fmt: skip
    start = time.monotonic()
    _measure_machine(console, "measuring this machine's profile", quick=True, nproc=MACHINE_NPROC)
    console.print(f"this machine's profile measured in {time.monotonic() - start:.1f} s")
    return name


def _measure_machine(console: Console, what: str, quick: bool, nproc: int) -> None:
    from costmodel.machine_profile import measure_machine_profile

    with activity(console, what) as act:
        profile = measure_machine_profile(
            lambda done, total, label: act.update(label, completed=done, total=total),
            quick=quick, nproc=nproc,
        )  # fmt: skip
    loaded = measured_loaded(profile)
    if loaded:
        console.print(
            f"note: {loaded}: its prices are slower than this machine's when quiet; it is "
            "re-measured the first time it is needed on a quiet machine (or `autosbp profile "
            "--refresh`).",
            markup=False, soft_wrap=True,
        )  # fmt: skip


def _machine_line() -> str:
    """What `autosbp profiles` says of this machine's cached profile."""
    cached = cached_machine_profile()
    if cached.profile is None or cached.profile.machine is None:
        return (
            f"{MACHINE_PROFILE}: this machine's profile is {cached.why_not}; it is measured the "
            "first time local CPU work needs it (or `autosbp profile --refresh`)."
        )
    on = cached.profile.machine
    host = f" on {on.host}" if on.host else ""
    load = "" if on.load_1min is None else f", other work's load {on.load_1min:.2f}"
    return (
        f"{MACHINE_PROFILE}: this machine's profile (the default for local CPU work), measured "
        f"{on.date}{host} by `{on.command}`: {on.fingerprint.describe()}{load}; cached in "
        f"{cached.path}"
    )


def _run_profile(args: argparse.Namespace, console: Console) -> int:
    from costmodel.measure.fitting import build_profile
    from costmodel.measure.plot import plot_profile
    from costmodel.measure.profiler import measure

    config = _config(args)
    start = time.monotonic()
    with activity(console, f"profiling {config.nproc} {config.backend} ranks") as act:
        m = measure(
            config, lambda done, total, label: act.update(label, completed=done, total=total)
        )
    profile = build_profile(m, args.out.stem)
    path = save_profile(profile, args.out)
    png = plot_profile(m, profile, args.out.with_suffix(".png"))
    for kind in CollectiveKind:
        console.print(_measured_table(m, kind))
    console.print(_fit_table(profile, m))
    console.print(_compute_table(m))
    o = m.overlap
    console.print(
        f"overlap: matmuls {o.compute_s * 1e3:.2f} ms, all-reduce of {o.nbytes} B "
        f"{o.collective_s * 1e3:.2f} ms, both at once {o.both_s * 1e3:.2f} ms: "
        f"{o.ratio:.2f} of the shorter hidden"
    )
    memory_overlap = profile.efficiency.memory_overlap
    if memory_overlap is not None:
        console.print(
            f"memory overlap: {memory_overlap.value:.2f} of the shorter of a streamed matmul's "
            "compute and memory time hidden by the other"
        )
    if m.unsupported:
        console.print(
            f"not supported by {config.backend}: {', '.join(k.value for k in m.unsupported)}"
        )
    console.print(f"wrote {path} and {png} in {time.monotonic() - start:.1f} s")
    return 0


def _config(args: argparse.Namespace) -> ProfilerConfig:
    from costmodel.measure.items import ProfilerConfig

    nproc, per_node = args.nproc, args.devices_per_node or args.nproc
    if nproc < 2 or nproc % 2:
        raise ProfileError(
            f"--nproc {nproc}: the profiler needs an even number of ranks (>= 2) so that every "
            "rank has a send/recv partner. Use --nproc 2 (or 4, 8 ...)."
        )
    if per_node < 1 or nproc % per_node:
        raise ProfileError(
            f"--devices-per-node {per_node} does not divide --nproc {nproc}: nodes must be "
            "equal. Pick a divisor of nproc."
        )
    if args.backend == "nccl":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < nproc:
            raise ProfileError(
                f"--backend nccl needs CUDA GPUs, one per rank: --nproc {nproc} but this machine "
                f"has {gpus}. Use --nproc {gpus} (if > 1) or --backend gloo."
            )
    command = (
        f"autosbp profile --nproc {nproc} --backend {args.backend} --devices-per-node {per_node}"
        f"{' --quick' if args.quick else ''} --out {args.out}"
    )
    return ProfilerConfig.for_mode(nproc, args.backend, per_node, args.quick, command)


def _measured_table(m: Measurements, kind: CollectiveKind) -> Table:
    table = Table(title=f"{kind.value} (fp32; size as in nccl-tests)", title_justify="left")
    for col in ("link", "ranks", "size (B)", "count", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
        table.add_column(col, justify="left" if col == "link" else "right")
    for s in m.collectives:
        if s.kind is kind:
            algbw = s.nbytes / s.time_s / 1e9
            table.add_row(
                s.link_class.value,
                str(s.group_size),
                str(s.nbytes),
                str(s.nbytes // 4),
                f"{s.time_s * 1e6:.1f}",
                f"{algbw:.3f}",
                f"{algbw * bus_factor(kind, s.group_size):.3f}",
            )
    return table


def _fit_table(profile: Profile, m: Measurements) -> Table:
    table = Table(title="alpha-beta fit per link class", title_justify="left")
    for col in ("link", "kind", "latency (us)", "busbw (GB/s)", "median |error|", "points"):
        table.add_column(col, justify="left" if col in ("link", "kind") else "right")
    for link in profile.links:
        for cost in link.collectives:
            price = CollectivePrice.of(cost)
            errors = [
                abs(price.alpha_beta_s(s.nbytes, s.group_size) / s.time_s - 1)
                for s in m.collectives
                if s.kind is cost.kind and s.link_class is link.link_class
            ]
            table.add_row(
                link.link_class.value, cost.kind.value, f"{cost.latency.base * 1e6:.1f}",
                f"{cost.bus_bandwidth.base / 1e9:.3f}",
                f"{statistics.median(errors):.0%}" if errors else "copied", str(len(errors)),
            )  # fmt: skip
    return table


def _compute_table(m: Measurements) -> Table:
    table = Table(title="compute (per rank, all ranks busy)", title_justify="left")
    for col in ("op", "dtype", "shape", "time (us)", "GFLOP/s", "GB/s"):
        table.add_column(col, justify="left" if col in ("op", "dtype", "shape") else "right")
    for s in m.compute:
        table.add_row(
            s.op,
            s.dtype.value,
            s.shape,
            f"{s.time_s * 1e6:.1f}",
            f"{s.flops / s.time_s / 1e9:.2f}",
            f"{s.nbytes / s.time_s / 1e9:.2f}",
        )
    return table


def _profiles_table() -> tuple[Table, list[tuple[Path, str]]]:
    """The table of every loadable profile found, and the JSON files skipped (with why)."""
    found = shipped_profiles()
    if not found:
        where = ", ".join(str(d) for d in profile_dirs()) or "none"
        raise ProfileError(
            f"no profiles found (searched {where}): the package's costmodel/profiles/ is missing. "
            "Fix: reinstall autosbp (`pip install .` ships them), or add a folder of profile "
            f"JSON files to {PROFILE_PATH_ENV}."
        )
    table = Table(title="shipped hardware profiles", title_justify="left")
    for col in (
        "name",
        "device",
        "devices/node",
        "nodes",
        "memory (GB)",
        "bf16 peak (TFLOP/s)",
        "sources",
    ):
        table.add_column(col)
    skipped: list[tuple[Path, str]] = []
    for name, path in sorted(found.items()):
        try:
            p = load_profile(path)
        except ProfileError as exc:  # another JSON file in an AUTOSBP_PROFILE_PATH folder
            cause = str(exc).removeprefix(f"profile {path}: ").split(". ", 1)[0].rstrip(".")
            skipped.append((path, cause))
            continue
        nodes = "scalable" if p.topology.nodes is None else str(p.topology.max_nodes)
        table.add_row(
            name,
            p.device.name,
            str(int(p.topology.devices_per_node.value)),
            nodes,
            f"{p.device.memory.base / 1e9:.1f}",
            f"{p.device.peak_flops.for_dtype(DType.BF16).base / 1e12:.3g}",
            ", ".join(kind.value for kind in p.source_kinds()),
        )
    return table, skipped

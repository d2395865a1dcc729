"""Profiles: shipped files load, save -> load is the identity, and bad files say what to fix."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel import (
    Cluster,
    ProfileError,
    Quantity,
    Source,
    SourceKind,
    load_profile,
    save_profile,
    shipped_profiles,
)
from costmodel.measure.items import ProfilerConfig
from costmodel.measure.profiler import (
    CollectiveSample,
    ComputeSample,
    Measurements,
    OverlapSample,
)
from costmodel.profile import CollectiveKind, DType, LinkClass
from costmodel.profile_io import profile_schema
from costmodel.units import UNITS, Dimension

SHIPPED = ("cpu-gloo", "dgx-a100", "dgx-h100", "dgx1-v100")


def test_the_four_profiles_are_shipped() -> None:
    assert set(SHIPPED) <= set(shipped_profiles())


@pytest.mark.parametrize("name", SHIPPED)
def test_save_then_load_is_identity(name: str, tmp_path: Path) -> None:
    profile = load_profile(name)
    path = save_profile(profile, tmp_path / f"{name}.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text()) == json.loads(shipped_profiles()[name].read_text())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_number_cites_a_source(name: str) -> None:
    for source in load_profile(name).sources():
        assert source.describe().split(": ", 1)[1].strip()


def test_spec_profiles_cite_specs_and_measured_cites_measurements() -> None:
    assert SourceKind.SPEC in load_profile("dgx-a100").source_kinds()
    assert SourceKind.MEASURED in load_profile("cpu-gloo").source_kinds()
    cpu = load_profile("cpu-gloo")
    assert cpu.link("intra_node").collective(cpu.link("intra_node").collectives[0].kind).table


def test_schema_units_match_the_unit_tables() -> None:
    defs = profile_schema()["$defs"]
    by_def = {
        "time": Dimension.TIME,
        "bytes": Dimension.BYTES,
        "bandwidth": Dimension.BANDWIDTH,
        "flop_rate": Dimension.FLOP_RATE,
        "ratio": Dimension.RATIO,
        "fraction": Dimension.RATIO,
        "devices": Dimension.DEVICES,
        "nodes": Dimension.NODES,
    }
    for name, dim in by_def.items():
        assert defs[name]["properties"]["unit"]["enum"] == list(UNITS[dim]), name


def test_unknown_name_lists_the_shipped_ones() -> None:
    with pytest.raises(ProfileError, match=r"no shipped profile named 'dgx-b200'.*dgx-a100"):
        load_profile("dgx-b200")


def test_profile_path_env_adds_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    profile = load_profile("dgx-a100")
    save_profile(profile, tmp_path / "my-cluster.json")
    monkeypatch.setenv("AUTOSBP_PROFILE_PATH", str(tmp_path))
    assert load_profile("my-cluster") == profile


def _a100() -> dict:
    return json.loads(shipped_profiles()["dgx-a100"].read_text())


def _without_unit(d: dict) -> dict:
    del d["device"]["memory"]["unit"]
    return d


def _with(path: str, value: object) -> Callable[[dict], dict]:
    def edit(d: dict) -> dict:
        *parents, leaf = path.split(".")
        node = d
        for key in parents:
            node = node[key]
        node[leaf] = value
        return d

    return edit


def _table_not_sorted(d: dict) -> dict:
    cost = d["links"]["intra_node"]["collectives"]["all_reduce"]
    cost["table"] = {
        "size_unit": "B",
        "time_unit": "us",
        "source": "a100-datasheet",
        "points": {"8": [[4096, 10.0], [1024, 12.0]]},
    }
    return d


def _drop_inter_node(d: dict) -> dict:
    del d["links"]["inter_node"]
    return d


# (id, edit of a valid dict, JSON path in the message, words the message must contain)
BAD_DICTS = [
    ("missing-unit", _without_unit, "$.device.memory", ["missing unit", "GB", "GiB", "Fix"]),
    ("wrong-version", _with("version", 2), "$.version", ["version 2", "version 1"]),
    (
        "wrong-type",
        _with("device.peak_flops.bf16.value", "312"),
        "$.device.peak_flops.bf16.value",
        ["'312' is a str", "JSON number", "without quotes"],
    ),
    (
        "unknown-link-class",
        _with("links.nvlink", {"medium": "x", "collectives": {}}),
        "$.links",
        ["unknown link class 'nvlink'", "intra_node, inter_node"],
    ),
    (
        "unknown-unit",
        _with("device.memory_bandwidth.unit", "GHz"),
        "$.device.memory_bandwidth.unit",
        ["'GHz' is not allowed", "GB/s", "convert the value"],
    ),
    (
        "unknown-source",
        _with("device.memory.source", "a100-brochure"),
        "$.device.memory.source",
        ["unknown source 'a100-brochure'", "a100-datasheet"],
    ),
    (
        "no-inter-node",
        _drop_inter_node,
        "$.links",
        ["no `inter_node` link", "scalable"],
    ),
    (
        "ratio-above-one",
        _with("efficiency.matmul.value", 1.5),
        "$.efficiency.matmul.value",
        ["1.5 is out of range", "<= 1"],
    ),
    (
        "overlap-above-one",
        _with("efficiency.overlap.value", 1.2),
        "$.efficiency.overlap.value",
        ["1.2 is out of range", "<= 1", "0 = none, 1 = all", "write a number in [0, 1]"],
    ),
    (
        "overlap-negative",
        _with("efficiency.overlap.value", -0.1),
        "$.efficiency.overlap.value",
        ["-0.1 is out of range", ">= 0", "write a number in [0, 1]"],
    ),
    (
        "overlap-in-percent",
        _with("efficiency.overlap.unit", "%"),
        "$.efficiency.overlap.unit",
        ["'%' is not allowed", "ratio"],
    ),
    (
        "memory-overlap-above-one",
        _with(
            "efficiency.memory_overlap",
            {"value": 1.5, "unit": "ratio", "source": "compute-comm-overlap"},
        ),
        "$.efficiency.memory_overlap.value",
        ["1.5 is out of range", "<= 1"],
    ),
    (
        "spec-without-ref",
        _with("sources.a100-datasheet", {"kind": "spec"}),
        "$.sources['a100-datasheet']",
        ["missing field 'ref'"],
    ),
    ("table-not-sorted", _table_not_sorted, "points.8", ["[4096, 1024] do not increase"]),
    ("not-a-profile", _with("format", "galvatron"), "$.format", ["not an autosbp profile"]),
]


@pytest.mark.parametrize(
    ("edit", "json_path", "words"),
    [pytest.param(e, p, w, id=i) for i, e, p, w in BAD_DICTS],
)
def test_bad_profile_names_file_path_and_fix(
    edit: Callable[[dict], dict], json_path: str, words: list[str], tmp_path: Path
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(edit(_a100())))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert str(path) in message
    assert f"at {json_path}" in message or json_path in message
    assert "Fix:" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param(
            '{"format": "autosbp.profile",, }', ["invalid JSON", "line 1"], id="malformed"
        ),
        pytest.param(None, ["ends early", "truncated"], id="truncated"),
        pytest.param("[1, 2]", ["not an autosbp profile"], id="not-an-object"),
    ],
)
def test_unreadable_json_is_explained(text: str | None, words: list[str], tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    full = shipped_profiles()["dgx-a100"].read_text()
    path.write_text(full[: len(full) // 2] if text is None else text)
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    for word in words:
        assert word in str(info.value)


# (shipped profile, overlap it states or None = measured, any value in [0, 1]; its source kind)
SHIPPED_OVERLAP = [
    ("dgx-a100", 0.8, SourceKind.ASSUMPTION),
    ("dgx-h100", 0.8, SourceKind.ASSUMPTION),
    ("dgx1-v100", 0.8, SourceKind.ASSUMPTION),
    ("cpu-gloo", None, SourceKind.MEASURED),
]


@pytest.mark.parametrize(
    ("name", "value", "kind"), [pytest.param(*row, id=row[0]) for row in SHIPPED_OVERLAP]
)
def test_shipped_profiles_state_the_overlap(
    name: str, value: float | None, kind: SourceKind
) -> None:
    profile = load_profile(name)
    overlap = profile.efficiency.overlap
    assert overlap is not None and overlap.unit == "ratio"
    assert overlap.source.kind is kind
    assert overlap.source in list(profile.sources())
    assert 0.0 <= Cluster(profile).overlap_efficiency <= 1.0
    if value is not None:
        assert Cluster(profile).overlap_efficiency == value
    if kind is SourceKind.ASSUMPTION:
        assert "Galvatron" in overlap.source.why and "1.1-1.3" in overlap.source.why


@pytest.mark.parametrize(
    "value", [pytest.param(v, id=f"overlap={v}") for v in (0.0, 0.35, 1.0, None)]
)
def test_overlap_round_trips(value: float | None, tmp_path: Path) -> None:
    profile = load_profile("dgx-a100")
    source = Source.measured("2026-01-01T00:00:00+00:00", "autosbp profile --out x.json")
    overlap = None if value is None else Quantity(value, "ratio", source)
    profile = replace(profile, efficiency=replace(profile.efficiency, overlap=overlap))
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path) == profile
    written = json.loads(path.read_text())["efficiency"]
    assert ("overlap" in written) is (value is not None)
    assert Cluster(profile).overlap_efficiency == (0.0 if value is None else value)


@pytest.mark.parametrize("value", [pytest.param(v, id=f"memory_overlap={v}") for v in (0.0, 1.0)])
def test_memory_overlap_round_trips(value: float, tmp_path: Path) -> None:
    profile = load_profile("dgx-a100")
    assert profile.efficiency.memory_overlap is None  # spec sheets: the roofline's max
    source = Source.measured("2026-01-01T00:00:00+00:00", "autosbp profile --out x.json")
    stated = Quantity(value, "ratio", source)
    profile = replace(profile, efficiency=replace(profile.efficiency, memory_overlap=stated))
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["efficiency"]["memory_overlap"]["value"] == value


def test_transcendental_rate_round_trips_and_prices_exps(tmp_path: Path) -> None:
    profile = load_profile("dgx-a100")
    assert profile.device.transcendental_rate is None  # spec sheets: free beside flops, bytes
    free = Cluster(profile).op_time_s(0, 4e6, "fp32", transcendentals=1e6)
    assert free == Cluster(profile).op_time_s(0, 4e6, "fp32")
    source = Source.measured("2026-01-01T00:00:00+00:00", "autosbp profile --out x.json")
    rate = Quantity(0.5, "GFLOP/s", source)
    profile = replace(profile, device=replace(profile.device, transcendental_rate=rate))
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["device"]["transcendental_rate"]["value"] == 0.5
    priced = Cluster(profile).op_time_s(0, 0, "fp32", transcendentals=1e6)
    assert priced == pytest.approx(1e6 / 0.5e9)  # 2 ms: far above the op floor


def test_out_of_range_overlap_is_refused_when_saved(tmp_path: Path) -> None:
    profile = load_profile("dgx-a100")
    source = Source.assumption("a typo")
    bad = replace(profile.efficiency, overlap=Quantity(80, "ratio", source))
    with pytest.raises(ProfileError, match=r"being saved.*efficiency\.overlap\.value.*\[0, 1\]"):
        save_profile(replace(profile, efficiency=bad), tmp_path / "bad.json")


def test_profile_without_overlap_loads_and_hides_nothing(tmp_path: Path) -> None:
    old = _a100()
    del old["efficiency"]["overlap"]
    del old["sources"]["compute-comm-overlap"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    profile = load_profile(path)
    assert profile.efficiency.overlap is None
    assert Cluster(profile).overlap_efficiency == 0.0
    again = json.loads(save_profile(profile, tmp_path / "again.json").read_text())
    assert "overlap" not in again["efficiency"]


def _measurements(streamed_us: float) -> Measurements:
    """A run on 2 ranks of one host: round numbers chosen by hand (rates in the comments)."""
    config = ProfilerConfig.for_mode(2, "gloo", 2, True, "autosbp profile --quick --out t.json")
    rows, n, _ = config.streamed_matmul
    compute = (
        ComputeSample("overhead", DType.FP32, "numel=1", 1.0, 12.0, 5e-6),
        ComputeSample("matmul", DType.FP32, "512x512x512", 2.0 * 512**3, 3.0 * 512**2 * 4, 2.68e-3),
        ComputeSample("matmul", DType.BF16, "64x64x64", 2.0 * 64**3, 3.0 * 64**2 * 2, 2.62e-4),
        # 12 MB in 0.3 ms (40 GB/s, in cache), then 48 MB in 4 ms (12 GB/s, from memory)
        ComputeSample("elementwise", DType.FP32, "numel=2**20", 2.0**20, 12e6, 0.3e-3),
        ComputeSample("elementwise", DType.FP32, "numel=2**22", 2.0**22, 48e6, 4e-3),
        ComputeSample("exp", DType.FP32, "numel=65536", 65536.0, 65536 * 8.0, 65536 / 0.5e9),
        ComputeSample(
            "streamed", DType.FP32, f"{rows}x{n}x{n}", 2.0 * rows * n * n,
            (n * n + 2 * rows * n) * 4.0, streamed_us * 1e-6,
        ),
    )  # fmt: skip
    collectives = tuple(
        CollectiveSample(kind, LinkClass.INTRA_NODE, 2, nbytes, 1e-4 + nbytes / 1e9)
        for kind in CollectiveKind
        for nbytes in (4096, 2**20, 2**24)
    )
    overlap = OverlapSample(256, 2**22, 5e-3, 5e-3, 1e-2, 0.0, 5)
    return Measurements(
        config, collectives, compute, (), overlap, "CPU", 2**34, "test", "2.13", 1,
        "2026-12-01T00:00:00+00:00", 1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "hidden",
    [
        pytest.param(0.0, id="weights-read-after-the-arithmetic"),
        pytest.param(1.0, id="read-while-computing"),
    ],
)
def test_fitting_prices_memory_at_its_largest_size_and_measures_what_compute_hides(
    hidden: float,
) -> None:
    """The elementwise rate of the largest size (many times the cache) over the best; the
    streamed matmul against the profile's own rates: c at the fp32 peak (512^3 in 2.68 ms), m at
    12 GB/s; measured c + m (none hidden) or max(c, m) (all hidden)."""
    from costmodel.measure.fitting import build_profile

    rows, n, _ = ProfilerConfig.for_mode(2, "gloo", 2, True, "x").streamed_matmul
    compute_us = 2.0 * rows * n * n / (2.0 * 512**3 / 2.68e-3) * 1e6
    memory_us = (n * n + 2 * rows * n) * 4.0 / 12e9 * 1e6
    measured = max(compute_us, memory_us) + (1 - hidden) * min(compute_us, memory_us)
    profile = build_profile(_measurements(measured), "synthetic")
    eff = profile.efficiency
    assert profile.device.memory_bandwidth.base == pytest.approx(40e9)
    assert profile.device.transcendental_rate is not None
    assert profile.device.transcendental_rate.base == pytest.approx(0.5e9)  # exps per second
    assert eff.memory_bound.base == pytest.approx(12 / 40, rel=1e-3)
    assert eff.memory_overlap is not None
    assert eff.memory_overlap.base == pytest.approx(hidden, abs=2e-3)
    cluster = Cluster(profile)
    priced = cluster.op_time_s(2.0 * rows * n * n, (n * n + 2 * rows * n) * 4.0, "fp32")
    assert priced == pytest.approx(measured * 1e-6, rel=2e-3)  # the fit prices its own point

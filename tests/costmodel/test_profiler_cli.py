"""`autosbp profile` and `autosbp profiles` through the CLI entry point."""

from __future__ import annotations

from pathlib import Path

import pytest

from autosbp.cli import main
from costmodel import Cluster, CollectiveKind, LinkClass, SourceKind, load_profile


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(240)
def test_quick_profile_loads_and_prices_every_collective(tmp_path: Path) -> None:
    out = tmp_path / "here.json"
    assert main(["profile", "--nproc", "2", "--quick", "--out", str(out)]) == 0
    profile = load_profile(out)
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert profile.name == "here"
    assert SourceKind.MEASURED in profile.source_kinds()
    cluster = Cluster(profile, nodes=2)  # one host measured: inter_node is the stated copy
    for link in LinkClass:
        for kind in CollectiveKind:
            small = cluster.collective_time_s(kind, 4096, 2, link)
            large = cluster.collective_time_s(kind, 16 * 2**20, 2, link)
            assert 0 < small <= large < 10.0, (link, kind)
    assert cluster.op_time_s(2 * 512**3, 3 * 512 * 512 * 4, "fp32") > 0
    overlap = profile.efficiency.overlap
    assert overlap is not None and overlap.source.kind is SourceKind.MEASURED
    assert "async_op=True" in overlap.source.note
    assert 0.0 <= cluster.overlap_efficiency <= 1.0
    rate = profile.device.transcendental_rate
    assert rate is not None and rate.base > 0 and "torch.exp" in rate.source.note
    memory_overlap = profile.efficiency.memory_overlap
    assert memory_overlap is not None and 0.0 <= memory_overlap.base <= 1.0
    assert "32 x 1024 fp32 matrix times one of 16 1024 x 1024 weights" in memory_overlap.source.note
    assert memory_overlap.source in list(profile.sources())


@pytest.mark.parametrize(
    ("compute_s", "collective_s", "both_s", "hidden"),
    [
        pytest.param(1.0, 1.0, 2.0, 0.0, id="serial"),
        pytest.param(1.0, 1.0, 1.0, 1.0, id="fully-hidden"),
        pytest.param(1.0, 1.0, 1.2, 0.8, id="galvatron-coefficient-1.2"),
        pytest.param(2.0, 1.0, 2.5, 0.5, id="half-of-the-shorter"),
        pytest.param(1.0, 1.0, 2.6, 0.0, id="slower-than-serial-clamped"),
        pytest.param(1.0, 1.0, 0.8, 1.0, id="faster-than-either-clamped"),
    ],
)
def test_hidden_fraction(
    compute_s: float, collective_s: float, both_s: float, hidden: float
) -> None:
    from costmodel.measure.profiler import hidden_fraction

    assert hidden_fraction(compute_s, collective_s, both_s) == pytest.approx(hidden)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        pytest.param(["--nproc", "3"], ["--nproc 3", "even number"], id="odd-nproc"),
        pytest.param(
            ["--nproc", "4", "--devices-per-node", "3"], ["does not divide"], id="per-node"
        ),
        pytest.param(["--backend", "nccl"], ["needs CUDA"], id="nccl-without-gpu"),
    ],
)
def test_profile_rejects_bad_arguments(
    argv: list[str], words: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    import torch

    if "nccl" in argv and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["profile", *argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    for word in words:
        assert word in err


def test_profiles_lists_the_shipped_profiles(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "240")
    assert main(["profiles"]) == 0
    out = capsys.readouterr().out
    for name in ("cpu-gloo", "dgx-a100", "dgx-h100", "dgx1-v100"):
        assert name in out
    assert "A100-SXM4-80GB" in out and "312" in out and "scalable" in out

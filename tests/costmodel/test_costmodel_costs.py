"""Primitive costs: nccl-tests conventions, monotonicity, link classes, clusters of any size."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest

from costmodel import Cluster, CollectiveKind, LinkClass, ProfileError, Source, load_profile
from costmodel.measure.fitting import fit_alpha_beta
from costmodel.prices import _despike, bus_factor
from costmodel.profile import MeasuredTable, Quantity, Topology

SHIPPED = ("cpu-gloo", "dgx-a100", "dgx-h100", "dgx1-v100")
SPEC = ("dgx-a100", "dgx-h100", "dgx1-v100")
SIZES_BYTES = sorted([2**i for i in range(0, 34, 3)] + [3 * 2**i for i in range(10, 28, 5)])
GB = 1e9


@pytest.mark.parametrize(
    ("kind", "n", "factor"),
    [
        (CollectiveKind.ALL_REDUCE, 8, 2 * 7 / 8),
        (CollectiveKind.ALL_GATHER, 8, 7 / 8),
        (CollectiveKind.REDUCE_SCATTER, 4, 3 / 4),
        (CollectiveKind.ALL_TO_ALL, 2, 1 / 2),
        (CollectiveKind.SEND_RECV, 2, 1.0),
    ],
    ids=lambda v: getattr(v, "value", str(v)),
)
def test_bus_factors_are_nccl_tests(kind: CollectiveKind, n: int, factor: float) -> None:
    assert bus_factor(kind, n) == pytest.approx(factor)


def test_alpha_beta_by_hand() -> None:
    cluster = Cluster(load_profile("dgx-a100"), nodes=2)
    # 1 GiB all-reduce on 8 GPUs of a node: 5 us + 2 * 7/8 * 2^30 B / 240 GB/s
    want_s = 5e-6 + 2 * 7 / 8 * 2**30 / (240 * GB)
    assert cluster.collective_time_s("all_reduce", 2**30, 8, "intra_node") == pytest.approx(want_s)
    assert cluster.p2p_time_s(2**20, LinkClass.INTER_NODE) == pytest.approx(
        15e-6 + 2**20 / (20 * GB)
    )
    assert cluster.collective_time_s(CollectiveKind.ALL_GATHER, 2**20, 1, "intra_node") == 0.0


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("kind", list(CollectiveKind), ids=lambda k: k.value)
def test_monotone_in_bytes_and_group_size(name: str, kind: CollectiveKind) -> None:
    cluster = Cluster(load_profile(name), nodes=128)
    groups = [2] if kind is CollectiveKind.SEND_RECV else [1, 2, 3, 4, 5, 8, 16, 64, 128]
    for link in LinkClass:
        grid = [[cluster.collective_time_s(kind, s, n, link) for s in SIZES_BYTES] for n in groups]
        for row in grid:
            assert all(a <= b for a, b in itertools.pairwise(row)), (link, row)
        for col in zip(*grid, strict=True):
            assert all(a <= b for a, b in itertools.pairwise(col)), (link, col)


@pytest.mark.parametrize("name", SPEC)
@pytest.mark.parametrize("kind", list(CollectiveKind), ids=lambda k: k.value)
def test_inter_node_costs_more_than_intra_node(name: str, kind: CollectiveKind) -> None:
    cluster = Cluster(load_profile(name), nodes=4)
    for nbytes, n in itertools.product(SIZES_BYTES, (2, 4, 8)):
        intra = cluster.collective_time_s(kind, nbytes, n, LinkClass.INTRA_NODE)
        assert cluster.collective_time_s(kind, nbytes, n, LinkClass.INTER_NODE) > intra


def test_one_node_and_128_nodes_of_dgx_a100() -> None:
    profile = load_profile("dgx-a100")
    one, many = Cluster(profile, nodes=1), Cluster(profile, nodes=128)
    assert (one.devices, many.devices) == (8, 1024)
    assert one.memory_bytes == many.memory_bytes == 81920 * 2**20  # 80 GiB, as it reports
    assert one.link_class_for_mesh_dim((1, 8), 1) is LinkClass.INTRA_NODE
    assert many.link_class_for_mesh_dim((128, 8), 1) is LinkClass.INTRA_NODE
    assert many.link_class_for_mesh_dim((128, 8), 0) is LinkClass.INTER_NODE
    # data-parallel gradient all-reduce of 1 GB over the 128 nodes: inter-node busbw per GPU
    want_s = 15e-6 + 2 * 127 / 128 * GB / (20 * GB)
    assert many.collective_time_s("all_reduce", GB, 128, "inter_node") == pytest.approx(want_s)
    with pytest.raises(ValueError, match="group of 16 devices in a cluster of 8"):
        one.collective_time_s("all_reduce", GB, 16, "inter_node")
    with pytest.raises(ValueError, match="needs 16 devices"):
        one.link_class_for_mesh_dim((2, 8), 0)


@pytest.mark.parametrize(
    ("mesh", "mesh_dim", "first", "per_node", "want"),
    [
        ((2, 4), 1, 0, 8, "intra_node"),  # 4 consecutive devices inside a node
        ((2, 4), 0, 0, 8, "intra_node"),  # stride 4, two members: still one node
        ((4, 4), 0, 0, 8, "inter_node"),  # stride 4 over 16 devices: crosses
        ((4, 4), 1, 0, 8, "intra_node"),
        ((16, 8), 0, 0, 8, "inter_node"),
        ((3, 3), 1, 0, 4, "inter_node"),  # group {3, 4, 5} straddles the node boundary at 4
        ((2,), 0, 4, 8, "intra_node"),  # a stage submesh starting at device 4
        ((2,), 0, 7, 8, "inter_node"),  # ... or at device 7: {7, 8}
        ((64,), 0, 0, 8, "inter_node"),
    ],
)
def test_link_class_for_mesh_dim(
    mesh: tuple[int, ...], mesh_dim: int, first: int, per_node: int, want: str
) -> None:
    profile = load_profile("dgx-a100")
    profile = replace(
        profile,
        topology=replace(
            profile.topology,
            devices_per_node=replace(profile.topology.devices_per_node, value=per_node),
        ),
    )
    cluster = Cluster(profile, nodes=16)
    assert cluster.link_class_for_mesh_dim(mesh, mesh_dim, first).value == want


def test_link_class_for_group() -> None:
    cluster = Cluster(load_profile("dgx-a100"), nodes=2)
    assert cluster.link_class_for_group(8) is LinkClass.INTRA_NODE
    assert cluster.link_class_for_group(2, stride=8) is LinkClass.INTER_NODE
    assert cluster.link_class_for_group(4, stride=2, first_device=1) is LinkClass.INTRA_NODE


def test_op_time_is_a_roofline_with_a_floor() -> None:
    cluster = Cluster(load_profile("dgx-a100"))
    n = 8192
    matmul_s = cluster.op_time_s(2 * n**3, 3 * n * n * 2, "bf16")
    assert matmul_s == pytest.approx(2 * n**3 / (312e12 * 0.6))
    assert cluster.op_time_s(2 * n**3, 3 * n * n * 2, "torch.bfloat16") == matmul_s
    assert cluster.op_time_s(2 * n**3, 0, "fp32") == pytest.approx(2 * n**3 / (19.5e12 * 0.6))
    add_s = cluster.op_time_s(2**28, 3 * 2**28 * 4, "fp32")  # memory bound
    assert add_s == pytest.approx(3 * 2**28 * 4 / (2039e9 * 0.8))
    assert cluster.op_time_s(1, 12, "fp16") == pytest.approx(5e-6)
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        cluster.op_time_s(1, 1, "int8")


@pytest.mark.parametrize(
    ("overlap", "want_us"),
    [
        pytest.param(None, 300.0, id="unstated-roofline-max"),
        pytest.param(1.0, 300.0, id="all-hidden"),
        pytest.param(0.0, 400.0, id="none-hidden-sum"),
        pytest.param(0.25, 375.0, id="a-quarter-of-the-shorter-hidden"),
    ],
)
def test_op_time_hides_the_stated_share_of_the_shorter_part(
    overlap: float | None, want_us: float
) -> None:
    """300 us of arithmetic beside 100 us of memory traffic (and the other way round)."""
    profile = load_profile("dgx-a100")
    stated = None if overlap is None else Quantity(overlap, "ratio", Source.assumption("test"))
    cluster = Cluster(
        replace(profile, efficiency=replace(profile.efficiency, memory_overlap=stated))
    )
    flops_per_us = 19.5e12 * 0.6 / 1e6  # fp32 peak x matmul efficiency
    bytes_per_us = 2039e9 * 0.8 / 1e6  # bandwidth x memory-bound efficiency
    for compute_us, memory_us in ((300, 100), (100, 300)):
        got = cluster.op_time_s(compute_us * flops_per_us, memory_us * bytes_per_us, "fp32")
        assert got * 1e6 == pytest.approx(want_us)
    assert cluster.op_time_s(1, 1, "fp32") == pytest.approx(5e-6)  # the floor still holds


def _with_table(points: dict[int, list[tuple[float, float]]]) -> Cluster:
    """dgx-a100 whose intra-node all-gather has a measured table (us) beside its fit."""
    profile = load_profile("dgx-a100")
    src = Source.measured("2025-01-01", "test")
    table = MeasuredTable("B", "us", src, tuple((n, tuple(p)) for n, p in sorted(points.items())))
    intra = profile.link("intra_node")
    costs = tuple(
        replace(c, table=table) if c.kind is CollectiveKind.ALL_GATHER else c
        for c in intra.collectives
    )
    links = (replace(intra, collectives=costs), profile.link("inter_node"))
    return Cluster(replace(profile, links=links), nodes=1)


def test_measured_table_is_despiked_monotone_and_interpolated_log_log() -> None:
    table_us = [(1e3, 10.0), (1e4, 40.0), (1e5, 20.0), (1e6, 30.0), (1e7, 100.0)]
    # de-spiked (running median, radius 0/1/2/1/0): 10, 20, 30, 30, 100; non-decreasing
    cluster = _with_table({2: table_us})

    def price(nbytes: float, n: int = 2) -> float:
        return cluster.collective_time_s("all_gather", nbytes, n, "intra_node")

    assert price(1e3) == pytest.approx(10e-6)
    assert price(10) == pytest.approx(10e-6)  # flat below the first point
    assert price(1e4) == pytest.approx(20e-6)  # the spike (40 us) is gone
    assert price(10**3.5) == pytest.approx(math.sqrt(10 * 20) * 1e-6)  # log-log midpoint
    assert price(10**5.5) == pytest.approx(30e-6)
    tail_s = (1e8 - 1e7) * (1 / 2) / (240 * GB)
    assert price(1e8) == pytest.approx(100e-6 + tail_s)  # beyond the table: fitted busbw
    # a group of 4 is not in the table: the largest of the group-of-2 table and the fit for 4
    fit_s = 5e-6 + 3 / 4 * 1e4 / (240 * GB)
    assert price(1e4, 4) == pytest.approx(max(20e-6, fit_s))


@pytest.mark.parametrize(
    ("times", "want"),
    [
        ([30.0, 3.0, 4.0, 5.0, 6.0, 7.0], [4.0, 4.0, 5.0, 5.0, 6.0, 7.0]),  # spike at the start
        ([1.0, 2.0, 9.0, 9.5, 3.0, 4.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0, 4.0, 5.0]),  # 2 wide
        ([1.0, 1.0, 1.0, 5.0, 5.0, 5.0], [1.0, 1.0, 1.0, 5.0, 5.0, 5.0]),  # a step stays
    ],
    ids=["first-point", "two-point-spike", "step"],
)
def test_despike_removes_spikes_and_keeps_steps(times: list[float], want: list[float]) -> None:
    assert _despike(times) == want


def test_fit_alpha_beta_recovers_a_line() -> None:
    alpha_s, beta = 30e-6, 1 / 1.5e9
    points = [(x, alpha_s + beta * x) for x in (4e3, 6.4e4, 1e6, 1.6e7)]
    got_alpha, got_beta = fit_alpha_beta(points)
    assert got_alpha == pytest.approx(alpha_s)
    assert got_beta == pytest.approx(beta)


def test_cluster_refuses_what_the_profile_cannot_price() -> None:
    profile = load_profile("dgx-a100")
    fixed = replace(
        profile,
        topology=Topology(
            profile.topology.devices_per_node, Quantity(1, "nodes", Source.spec("x"))
        ),
    )
    with pytest.raises(ProfileError, match="at most 1 node"):
        Cluster(fixed, nodes=2)
    with pytest.raises(ProfileError, match="no 'inter_node' link"):
        Cluster(replace(profile, links=profile.links[:1]), nodes=2)
    with pytest.raises(ValueError, match="at least one node"):
        Cluster(profile, nodes=0)

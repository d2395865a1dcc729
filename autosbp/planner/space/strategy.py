"""Hand plans as restrictions of the search: `dp`, `fsdp`, `megatron:tp=..,pp=..,dp=..[,cp=..]` (and
`auto`: every rule's own kernel, no other restriction) become a `Space`: the stage counts, meshes,
micro-batch counts, recomputation modes and candidate signatures the search may choose from.

Lives here: `strategy_space` (parse a strategy), `hand_strategies` (the usual hand plans for a
device count, priced beside auto). Lives elsewhere: the search (`search`), the candidates
themselves (`rules`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from autosbp.boxing.params import gathers_run_beside
from autosbp.capturing.graph import OpGraph, Role
from autosbp.errors import PlanError
from autosbp.planner.space.recomputation import RECOMPUTE_MODES, partial_blocks
from autosbp.rules import NdSignature
from autosbp.rules.context import seq_mesh_dims
from autosbp.sbp import Broadcast, Mesh, NdSbp, Split
from autosbp.schedule import SCHEDULES
from autosbp.tp_overlap import TP_OVERLAP_CHUNKS


@dataclass(frozen=True)
class Space:
    """What the search may choose: stage counts, micro-batch counts (None: every count that
    divides the batch), recomputation modes, and the hand-plan restrictions: candidates, meshes,
    and a data-parallel degree that must divide every micro-batch (counts whose micro-batch it
    does not divide are not in the space: their data could not be split)."""

    stage_counts: tuple[int, ...]
    recompute: tuple[str, ...]
    micro_batches: tuple[int, ...] | None = None
    allow: Allow | None = None
    mesh_ok: Callable[[Mesh], bool] = lambda mesh: True
    data_parallel: int = 1
    meshes: tuple[tuple[int, ...], ...] = ()  # shapes beyond the search's 1D and 2D ones
    # optimizer states split over the mesh dims a weight is replicated on (1: ZeRO-1; 2: ZeRO-2,
    # the gradients too), never (0: every hand plan unless it says zero=1|2), or the search's
    # choice per parameter (None)
    zero: int | None = 0
    # model chunks per pipeline stage (interleaved 1F1B, `vp=V`): `stage_counts` then count
    # the v x P virtual stages, and the search counts each device v times (`search`)
    virtual_stages: int = 1
    schedule: str = "1f1b"  # the pipeline schedule (`schedule=zb1`: `autosbp.zero_bubble`)
    # may a parameter reach a consumer through a collective (FSDP's gather)? Not in a Megatron
    # layout, whose tensor parallelism computes on the stored pieces
    gathers: bool = True
    # Megatron's sequence parallelism (`sp=1`) on the last mesh dim (tp): no activation is
    # all-reduced there (partial sums are reduce-scattered into a split), and every kept copy a
    # contraction reads gathered is re-gathered in backward (`timing.regather`)
    sequence_parallel: bool = False
    # tensor-parallel reductions overlapped with their matmul (`overlap=K`, `timing.tp_overlap`):
    # None the search's choice per op; K >= 2 every op that can runs in K chunks (its in-line
    # copy not offered); 0 none
    tp_overlap: int | None = None

    @property
    def may_gather(self) -> bool:
        """Gathers allowed here and run by the runtime beside this schedule
        (`boxing.params.gathers_run_beside`): the search forbids the others' pairs
        (`problem.priced.Priced.gathers`), so no plan it returns is one the runtime refuses."""
        return self.gathers and gathers_run_beside(self.virtual_stages, self.schedule == "zb1")


def strategy_space(strategy: str, recompute: str = "auto", max_stages: int | None = None) -> Space:
    """What `strategy` lets the search choose (`auto` restricts nothing; stage counts up to
    `max_stages` then). `recompute`: a mode, or `auto` for every mode."""
    modes: tuple[str, ...]
    if recompute == "auto":
        modes = RECOMPUTE_MODES
    else:
        partial_blocks(recompute)  # a known mode, or `full:K`; else PlanError
        modes = (recompute,)
    if strategy == "auto" or strategy.startswith("auto:"):
        auto_options(
            strategy
        )  # checked here; the v's and schedules it searches: `search.schedules`
        return Space(tuple(range(1, (max_stages or 1) + 1)), modes, allow=_own_kernels, zero=None)
    if strategy == "dp":
        return Space(
            (1,), modes, allow=_allow(param=lambda nd, shape: _replicated(nd)),
            mesh_ok=lambda m: m.ndim == 1,
        )  # fmt: skip
    if strategy == "fsdp":
        return Space((1,), modes, allow=_fully_sharded(), mesh_ok=lambda m: m.ndim == 1)
    if strategy.startswith("megatron:"):
        given, (strategy, named) = strategy, _recompute(strategy)
        if named is not None:  # `recompute=MODE` in the hand plan: its mode
            if recompute not in ("auto", named):
                raise PlanError(
                    f"{given!r} names recompute={named}, but recompute {recompute!r} is asked "
                    "too (--recompute); give one of them."
                )
            modes = (named,)
        strategy, schedule = _schedule(strategy)
        strategy, vp = _virtual_stages(strategy)
        strategy, overlap = _overlap(strategy)
        tp, pp, dp, mb, ep, cp, zero, sp = _megatron_degrees(strategy)
        if overlap and tp == 1:
            raise PlanError(
                f"{strategy!r}: overlap hides tensor-parallel reductions behind their matmul; "
                "with tp=1 there are none. Drop overlap, or use tp=T with T > 1."
            )
        if sp and (tp == 1 or schedule == "zb1"):
            raise PlanError(
                f"{strategy!r}: sp=1 (sequence parallelism) splits the activations between "
                "tensor-parallel regions on the tp mesh dim and re-gathers them in backward: it "
                "needs tp=T with T > 1 and schedule 1f1b (zb1's backward, split in two, would "
                "gather them twice)."
            )
        if cp > 1:
            if ep > 1:
                raise PlanError(f"{strategy!r}: cp and ep together are not supported; drop one.")
            counts = (mb,) if mb is not None else None
            ring = "ring=1" in strategy.removeprefix("megatron:").split(",")
            space = _context_parallel_space(tp, pp, dp, cp, modes, counts, ring)
        else:
            space = _megatron_space(tp, pp, dp, mb, ep, modes)
        if vp > 1:
            space = replace(space, stage_counts=(pp * vp,), virtual_stages=vp)
        if schedule == "zb1":
            space = replace(space, recompute=_without_recompute(strategy, modes))
        return replace(
            space, zero=zero, schedule=schedule, gathers=False, sequence_parallel=bool(sp),
            tp_overlap=overlap,
        )  # fmt: skip
    raise PlanError(
        f"unknown strategy {strategy!r}; use auto, dp, fsdp or megatron:tp=T,pp=P,dp=D[,mb=M]"
        "[,ep=E][,cp=C[,ring=1]][,zero=1|2][,sp=1][,overlap=0|1|K][,vp=V][,schedule=zb1]"
        "[,recompute=MODE]."
    )


def auto_options(strategy: str) -> tuple[int, bool]:
    """(V, zb1) of `auto[:OPTION[,OPTION]]`: `max_vp=V` (V >= 1: interleave up to V chunks per
    device; 1 where absent) and `zb1` (search the zero-bubble schedule too; off where absent)."""
    options = strategy.removeprefix("auto").removeprefix(":")
    items = options.split(",") if options else []
    most = [item.removeprefix("max_vp=") for item in items if item.startswith("max_vp=")]
    others = [item for item in items if not item.startswith("max_vp=") and item != "zb1"]
    if (
        (strategy != "auto" and not items) or others or len(most) > 1 or items.count("zb1") > 1
        or any(not v.isdigit() or int(v) < 1 for v in most)
    ):  # fmt: skip
        raise PlanError(
            f"{strategy!r}: auto takes the options max_vp=V, a positive integer (the most "
            "model chunks per pipeline device the search interleaves, e.g. auto:max_vp=2; "
            "auto:max_vp=1 for plain 1F1B), and zb1 (the zero-bubble schedule searched too), "
            "comma-separated, each once: e.g. auto:max_vp=2,zb1."
        )
    return (int(most[0]) if most else 1), "zb1" in items


def _megatron_space(
    tp: int, pp: int, dp: int, mb: int | None, ep: int, modes: tuple[str, ...]
) -> Space:
    """`megatron:tp=T,pp=P,dp=D[,mb=M][,ep=E]`: Megatron-LM's layout (its optimizer states as
    the strategy's `zero` says, set by the caller)."""
    counts = (mb,) if mb is not None else None
    if ep > 1:
        return _expert_parallel_space(tp, pp, dp, ep, modes, counts)
    if tp == 1:  # no tensor parallelism: plain data parallelism in each stage
        allow = _allow(param=lambda nd, shape: _replicated(nd))
        return Space((pp,), modes, counts, allow, lambda m: m.shape == (dp,), dp)
    # Megatron: every weight matrix (and embedding table) split on the tp mesh dim, the ILP
    # picking which dim (column or row parallel); vectors (biases, norms) free; data split
    # on the dp mesh dim, where weights are replicated.
    if dp == 1:  # tensor parallelism alone: every device sees the whole batch
        allow = _allow(param=_tensor_parallel(0), data=lambda nd: nd == (Broadcast(),))
        return Space((pp,), modes, counts, allow, lambda m: m.shape == (tp,))
    allow = _allow(
        param=lambda nd, shape: isinstance(nd[0], Broadcast) and _tensor_parallel(1)(nd, shape),
        data=lambda nd: nd == (Split(0), Broadcast()),
    )
    return Space((pp,), modes, counts, allow, lambda m: m.shape == (dp, tp), dp)


def hand_strategies(devices: int, devices_per_node: int, blocks: int) -> list[str]:
    """The hand plans worth comparing with: dp, fsdp, and Megatron-style plans with tensor
    parallel 2 or a whole node, 2 to 16 stages (at most one per block), data parallel for the
    rest (micro-batch counts searched)."""
    tps = sorted({t for t in (1, 2, devices_per_node) if t <= devices})
    stage_counts = [p for p in (1, 2, 4, 8, 16) if p <= max(blocks, 1)]
    megatron = [
        f"megatron:tp={tp},pp={pp},dp={devices // (tp * pp)}"
        for tp in tps
        for pp in stage_counts
        if tp * pp > 1 and devices % (tp * pp) == 0
    ]
    return ["dp", "fsdp", *megatron]


def _take(strategy: str, key: str) -> tuple[str, list[str]]:
    """`strategy` (megatron:...) without its `key=VALUE` items, and their values in order."""
    items = strategy.removeprefix("megatron:").split(",")
    given = [item.removeprefix(f"{key}=") for item in items if item.startswith(f"{key}=")]
    kept = [item for item in items if not item.startswith(f"{key}=")]
    return "megatron:" + ",".join(kept), given


def _virtual_stages(strategy: str) -> tuple[str, int]:
    """`strategy` without its `vp=V` (model chunks per stage, Megatron's
    virtual_pipeline_model_parallel_size; 1 where absent), and V."""
    rest, given = _take(strategy, "vp")
    if not given:
        return strategy, 1
    if len(given) > 1 or not given[0].isdigit() or int(given[0]) < 1:
        raise PlanError(
            f"{strategy!r}: vp must be given once, a positive integer (the model chunks each "
            "pipeline stage holds, e.g. megatron:tp=1,pp=2,dp=1,vp=2)."
        )
    return rest, int(given[0])


def _overlap(strategy: str) -> tuple[str, int | None]:
    """`strategy` without its `overlap=K`, and the chunks it forces (`Space.tp_overlap`): None
    where absent (the search's choice), 0 for overlap=0 (none), TP_OVERLAP_CHUNKS for
    overlap=1, K for K >= 2."""
    rest, given = _take(strategy, "overlap")
    if not given:
        return strategy, None
    if len(given) > 1 or not given[0].isdigit():
        raise PlanError(
            f"{strategy!r}: overlap must be given once, a whole number: overlap=1 runs every "
            "row-parallel matmul that can in chunks beside its all-reduce or reduce-scatter "
            f"({TP_OVERLAP_CHUNKS} chunks), overlap=K in K chunks (K >= 2), overlap=0 never; "
            "e.g. megatron:tp=2,pp=1,dp=1,overlap=1."
        )
    chunks = int(given[0])
    return rest, TP_OVERLAP_CHUNKS if chunks == 1 else chunks


def _recompute(strategy: str) -> tuple[str, str | None]:
    """`strategy` without its `recompute=MODE` (a mode of `RECOMPUTE_MODES`, or full:K: the
    first K blocks of each stage), and MODE (None where absent)."""
    rest, given = _take(strategy, "recompute")
    if not given:
        return strategy, None
    if len(given) > 1:
        raise PlanError(
            f"{strategy!r}: recompute must be given once (e.g. megatron:tp=1,pp=2,dp=1,"
            "recompute=full:2)."
        )
    partial_blocks(given[0])  # a known mode, or full:K; else PlanError
    return rest, given[0]


def _schedule(strategy: str) -> tuple[str, str]:
    """`strategy` without its `schedule=S` (1f1b where absent), and S, one the runtime runs
    on plain stages or chunks as asked (`zero_bubble.check_schedule`)."""
    rest, given = _take(strategy, "schedule")
    if not given:
        return strategy, "1f1b"
    if len(given) > 1 or given[0] not in SCHEDULES:
        raise PlanError(
            f"{strategy!r}: schedule must be given once, one of {', '.join(SCHEDULES)} (zb1: "
            "the zero-bubble ZB-H1, e.g. megatron:tp=1,pp=2,dp=1,schedule=zb1)."
        )
    if given[0] == "zb1" and any(v != "1" for v in _take(strategy, "vp")[1]):
        raise PlanError(
            f"{strategy!r}: schedule=zb1 runs plain stages (ZB-H1), not interleaved chunks; "
            "drop vp=V or schedule=zb1."
        )
    return rest, given[0]


def _without_recompute(strategy: str, modes: tuple[str, ...]) -> tuple[str, ...]:
    """zb1's recomputation: none (W runs backward once per weight group, and each run would
    recompute the checkpointed blocks again: `runtime.parallel.split_backward`)."""
    if "none" not in modes:
        raise PlanError(
            f"{strategy},schedule=zb1 with recompute {modes[0]}: the zero-bubble schedule runs "
            "without recomputation (its weight-gradient passes would recompute each block once "
            "per weight); use --recompute none (or auto), or drop schedule=zb1."
        )
    return ("none",)


def _megatron_degrees(strategy: str) -> tuple[int, int, int, int | None, int, int, int, int]:
    """(tp, pp, dp, mb, ep, cp, zero, sp) of `megatron:tp=T,pp=P,dp=D,mb=M,ep=E,cp=C,zero=Z,sp=S`
    (each optional: 1, mb searched, zero 0, sp 0)."""
    example = "write it like megatron:tp=2,pp=2,dp=1 (mb=4, ep=E, cp=C, zero=1|2 and sp=1 optional)"
    try:
        fields = {
            k: int(v)
            for k, v in (item.split("=") for item in strategy.removeprefix("megatron:").split(","))
        }
    except ValueError:
        raise PlanError(f"cannot read {strategy!r}; {example}.") from None
    unknown = sorted(set(fields) - {"tp", "dp", "pp", "mb", "ep", "cp", "zero", "ring", "sp"})
    if unknown:
        raise PlanError(f"{strategy!r} has unknown degree(s) {unknown}; {example}.")
    zero = fields.pop("zero", 0)
    ring = fields.pop("ring", 0)
    sp = fields.pop("sp", 0)
    if sp not in (0, 1):
        raise PlanError(
            f"{strategy!r}: sp={sp} is not known; sp=1 is Megatron's sequence parallelism, sp=0 "
            "(the default) keeps the activations between tensor-parallel regions whole."
        )
    if ring not in (0, 1) or (ring and fields.get("cp", 1) == 1):
        raise PlanError(f"{strategy!r}: ring=1 (ring attention) needs cp=C with C > 1; {example}.")
    if zero not in (0, 1, 2):
        raise PlanError(
            f"{strategy!r}: zero={zero} is not known; zero=1 splits the optimizer states over "
            "data parallelism (the distributed optimizer), zero=2 the gradients too, zero=0 (the "
            "default) replicates them."
        )
    if any(v < 1 for v in fields.values()):
        raise PlanError(f"{strategy!r}: degrees must be positive; {example}.")
    degrees = fields.get("tp", 1), fields.get("pp", 1), fields.get("dp", 1)
    return *degrees, fields.get("mb"), fields.get("ep", 1), fields.get("cp", 1), zero, sp


def _expert_parallel_space(
    tp: int, pp: int, dp: int, ep: int, modes: tuple[str, ...], counts: tuple[int, ...] | None
) -> Space:
    """`megatron:...,ep=E`: expert parallelism carved out of data parallelism, as Megatron-Core
    and DeepSpeed-MoE do: the expert weights (parameters of 3 dims or more: a stack of
    per-expert matrices, the expert on dim 0) split on their expert dim over E of the D
    data-parallel devices and replicated over the other D / E (a D/E x E mesh when E < D), the
    rest as without ep; the ILP decides where tokens cross between splits (all-to-all). With
    tensor parallelism, E = D: experts split on the dp mesh dim and, like every matrix, on the
    tp mesh dim (E < D would need a third mesh dim, which the search does not form)."""
    if dp % ep:
        raise PlanError(
            f"ep={ep} must divide dp={dp}: experts are split among the data-parallel devices; "
            "choose ep among the divisors of dp."
        )
    if tp > 1 and ep != dp:
        raise PlanError(
            f"with tp={tp}, ep must equal dp={dp} (not {ep}): experts split on the dp mesh dim of "
            f"a dp x tp mesh; ep < dp would need a third mesh dim. Use ep={dp} or tp=1."
        )

    def is_expert(shape: tuple[int, ...]) -> bool:
        return len(shape) >= 3

    if tp == 1:
        mesh = (dp,) if ep == dp else (dp // ep, ep)

        def param(nd: NdSbp, shape: tuple[int, ...]) -> bool:
            split = nd[-1] == Split(0) if is_expert(shape) else isinstance(nd[-1], Broadcast)
            return split and _replicated(nd[:-1])

        return Space((pp,), modes, counts, _allow(param=param), lambda m: m.shape == mesh, dp)

    def param_tp(nd: NdSbp, shape: tuple[int, ...]) -> bool:
        first = nd[0] == Split(0) if is_expert(shape) else isinstance(nd[0], Broadcast)
        return first and _tensor_parallel(1)(nd, shape)

    allow = _allow(param=param_tp, data=lambda nd: nd == (Split(0), Broadcast()))
    return Space((pp,), modes, counts, allow, lambda m: m.shape == (dp, tp), dp)


def _context_parallel_space(
    tp: int,
    pp: int,
    dp: int,
    cp: int,
    modes: tuple[str, ...],
    counts: tuple[int, ...] | None,
    ring: bool = False,
) -> Space:
    """`megatron:...,cp=C`: Llama 3's and Megatron-Core's context parallelism. A dp x cp x tp
    mesh (the dims of size 1 left out); the data split on its batch dim over dp and on its
    sequence dim (dim 1) over cp; weights replicated over dp and cp and, with tp, every matrix
    split on the tp dim; every attention splits its sequence on the cp dim with keys and values
    all-gathered inside it (`rules.context`), or with ring=1 passed around a ring (`rules.ring`);
    the ILP places the rest."""
    dims = [("dp", dp), ("cp", cp), ("tp", tp)]
    kept = [(name, size) for name, size in dims if size > 1]
    shape = tuple(size for _, size in kept)
    at = {name: i for i, (name, _) in enumerate(kept)}

    def param(nd: NdSbp, shape_: tuple[int, ...]) -> bool:
        free = [i for name, i in at.items() if name != "tp"]
        if any(not isinstance(nd[i], Broadcast) for i in free):
            return False
        return "tp" not in at or _tensor_parallel(at["tp"])(nd, shape_)

    def data(nd: NdSbp) -> bool:
        want = {"dp": Split(0), "cp": Split(1), "tp": Broadcast()}
        return all(nd[i] == want[name] for name, i in at.items())

    inner = _allow(param=param, data=data)

    def allow(graph: OpGraph, name: str, sig: NdSignature) -> bool:
        attrs = graph.node(name)
        if attrs.op == "aten.scaled_dot_product_attention.default":
            kernel = "ring" if ring else ""
            return at["cp"] in seq_mesh_dims(attrs, sig, shape) and sig.kernel == kernel
        return inner(graph, name, sig)

    mesh_ok: Callable[[Mesh], bool] = lambda m: m.shape == shape  # noqa: E731
    extra = (shape,) if len(shape) > 2 else ()
    return Space((pp,), modes, counts, allow, mesh_ok, dp, meshes=extra)


def _tensor_parallel(mesh_dim: int) -> Callable[[NdSbp, tuple[int, ...]], bool]:
    """Matrices split on `mesh_dim`; vectors anything."""
    return lambda nd, shape: len(shape) < 2 or isinstance(nd[mesh_dim], Split)


def _fully_sharded() -> Allow:
    """FSDP's algorithm (ZeRO-3): every weight stored split on dim 0 (as FSDP2 shards it: its
    gather and reduce-scatter then need no transposing copy), gathered whole where it is used,
    the batch split, so each device computes its share of the batch with whole weights as
    data parallelism does; the gradients come back reduce-scattered (the gather's dual). Every
    input of an op that a weight alone feeds (the weight, its transpose, its cast) is
    therefore replicated: without that rule the ILP may compute a matmul on split weights
    (tensor parallelism), which is not this plan."""
    stored = _allow(param=lambda nd, shape: nd[0] == Split(0))

    def allow(graph: OpGraph, name: str, sig: NdSignature) -> bool:
        if graph.node(name).role is not Role.COMPUTE:
            return stored(graph, name, sig)
        weights = graph.weight_only
        return not sig.kernel and all(
            producer is None or producer[0] not in weights or _replicated(nd)
            for producer, nd in zip(graph.producers(name), sig.inputs, strict=True)
        )

    return allow


def _replicated(nd: NdSbp) -> bool:
    return all(isinstance(s, Broadcast) for s in nd)


def _allow(param: Callable | None = None, data: Callable | None = None) -> Allow:
    """`param(nd_sbp, shape) -> bool` filters parameter layouts, `data(nd_sbp)` input layouts
    (default: the batch split on every mesh dim)."""

    def allow(graph: OpGraph, name: str, sig: NdSignature) -> bool:
        attrs = graph.node(name)
        if attrs.role is Role.PARAMETER and param is not None:
            return bool(param(sig.outputs[0], attrs.outputs[0].shape))
        if attrs.role is Role.INPUT:
            nd = sig.outputs[0]
            if data is not None:
                return bool(data(nd))
            return all(isinstance(s, Split) and s.dim == 0 for s in nd)
        return not sig.kernel

    return allow


def _own_kernels(graph: OpGraph, name: str, sig: NdSignature) -> bool:
    """Auto's restriction: every rule's own kernel, none of the variants (`NdSignature.kernel`:
    ring attention's plain-math blocks ran 2.5x slower than the all-gather kernel's SDPA on
    this CPU, bench/runtime.py, which the flop-based price does not see); a hand plan asks for
    a variant (`megatron:...,cp=C,ring=1`)."""
    return not sig.kernel


Allow = Callable[[OpGraph, str, NdSignature], bool]  # may node `name` take this candidate?

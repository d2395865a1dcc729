"""The Plan as frozen values and their JSON (docs/architecture.md, "The plan"): data, with free functions elsewhere.

Lives here: the plan's dataclasses, `Plan.to_json` / `Plan.from_json` (schema-validated; loading
never executes anything), the check that a plan belongs to a model and world, `Plan.digest`.
Lives elsewhere, as free functions of a plan: its files (`plan.files`: `load_plan`, `save_plan`),
what a plan file must be to be read (`plan.schema`), whether a plan is consistent as a whole
(`plan.checks`), its tables for people (`plan.tables`), its DTensor view (`plan.dtensor`); how a
plan is found (`planner`), how it runs (runtime).

Invariants: every SBP is stored as text (`"S(0)B"`) next to its DTensor names; a plan refuses a
model whose graph fingerprint differs; a loaded plan equals the saved one.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from autosbp.errors import PlanError
from autosbp.plan.schema import FORMAT, VERSION, validate_plan_json
from autosbp.sbp import dtensor_names, parse_nd_sbp

# The gradient-sync bucket cap priced by plans written before they stated theirs: DDP's default
# bucket_cap_mb (25 MB, torch docs), what `autosbp.schedule.GRAD_BUCKET_BYTES` held then. Frozen
# here: a later change of the planner's cap cannot change what an old plan runs.
PRICED_GRAD_BUCKET_BYTES = 25 * 2**20

# The dtypes a plan trains in, by the names plans and the command line use.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter trained in `dtype` is held and updated in (its master: fp32 below
    fp32, the mixed recipe of `Precision`), and its gradient accumulated in."""
    return torch.float32 if dtype.itemsize < 4 else dtype


@dataclass(frozen=True)
class NodePlan:
    """The signature chosen for one op: the nd-SBP of each tensor input and output, its stage,
    and whether backward recomputes it."""

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    stage: int = 0
    tied_to: str = ""  # the node of the first repeated block whose choice this one shares
    # Recomputed in backward (its output dropped after forward, computed again from the saved
    # inputs of its run of recomputed nodes); plans of format 1 do not say (`plan.recompute`).
    recomputed: bool = False
    # The collectives the op runs inside itself ("all_gather on d0", "send_recv on d1 backward":
    # `rules.exchanges` when planned); empty for almost every op, and in plans written before.
    exchanges: tuple[str, ...] = ()
    # Where the user wrote it: the nn.Module path of an op ("blocks.0.attn.qkv"), the qualified
    # name of a parameter or buffer ("blocks.0.attn.qkv.weight"); "" at the model's top level,
    # for an input, and in plans written before paths were recorded.
    path: str = ""
    # The inputs (by position) the op keeps for backward as it read them through a conversion
    # that exchanges data (an all-gather) and that backward converts again from the producer's
    # piece instead of keeping the converted copy (`runtime.parallel.regather`: sequence
    # parallelism's re-gather); empty where every kept copy is kept, and in plans written before.
    regathered: tuple[int, ...] = ()
    # Run in this many chunks, each chunk's share of the output's one reduction (an all-reduce
    # or reduce-scatter of a row-parallel matmul's partial sums) started while the next chunk
    # computes (`runtime.parallel.tp_overlap`: tensor-parallel communication hidden behind
    # compute); 0: the op runs whole and its output is boxed in line, as in plans written before.
    overlap_chunks: int = 0


@dataclass(frozen=True)
class Alternative:
    """One signature a node could have taken, priced with every other choice kept.

    `step_time_s` is None where the signature cannot be combined with its neighbours' choices.
    """

    signature: str
    step_time_s: float | None
    memory_delta_bytes: int


@dataclass(frozen=True)
class ParamPlan:
    """A parameter's stored layout (`sbp`), its optimizer states' (`optimizer_state_sbp`: the
    same, or split where `sbp` is B: the distributed optimizer, ZeRO-1, run by
    `runtime.parallel.sharded_update`; plans before it always said the same) and, where a consumer
    converts it to a layout that copies it (an all-gather of a sharded weight: FSDP / ZeRO-3),
    what happens to the converted copy between forward and backward:
    `reshard_after_forward` False keeps it (autograd saves it for the consumer's backward: its
    bytes count per micro-batch in flight); True frees it after the consumer's forward and
    converts the parameter again before that consumer's backward (FSDP's name; the conversion
    is priced once more per micro-batch). False in plans written before it was recorded, and
    wherever no conversion copies the parameter. `gradient_sbp`: the layout the gradient is
    accumulated and held in over the micro-batches of a step: the parameter's (`sbp`, summed
    to it by the gradient sync), or its optimizer states' (ZeRO-2: each micro-batch's gradient
    reduce-scattered into the shard's as backward makes it, the parameter's own freed); ""
    (plans before it was recorded) reads as `sbp`."""

    sbp: str
    stage: int
    optimizer_state_sbp: str
    shape: tuple[int, ...] = ()
    reshard_after_forward: bool = False
    gradient_sbp: str = ""

    def __post_init__(self) -> None:
        if not self.gradient_sbp:
            object.__setattr__(self, "gradient_sbp", self.sbp)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its devices (row-major over `mesh_shape`), the repeated blocks it runs,
    and the predicted per-micro-batch times the actor simulation replays (`forward_s`,
    `backward_s` incl. boxing and recomputation, `send_s` to the next stage, one way) and the
    per-step `update_s` (gradient sync + optimizer), of which the last micro-batch's backward
    hides `sync_hidden_s`. `step_time_s`: the stage's busy time. `grad_sync_s`: of `update_s`,
    the gradient sync (what the runtime's "grad_sync" span runs, before backward hides any of
    it); the rest is the optimizer's (its "optimizer" span: the non-finite check, the step, and
    with ZeRO-1 the scatter and gather of its shards). None in plans written before the split:
    the update is one figure.

    `prefetch_blocks` (k): the runtime converts the parameters of the next k repeated blocks
    asynchronously while it computes one (forward: their gathers; backward: the re-gathers of
    the blocks before it, and the gradient reduce-scatters of the block after it run beside
    its backward); `gather_hidden_s` is what the plan prices as hidden that way per
    micro-batch (forward + backward; `forward_s` and `backward_s` hold only what stays
    exposed). 0 (plans written before they were recorded, and stages without identical
    blocks): every conversion runs in line, nothing hidden."""

    devices: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    blocks: tuple[int, ...] = ()
    step_time_s: float = 0.0
    peak_memory_bytes: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0
    send_s: float = 0.0
    update_s: float = 0.0
    sync_hidden_s: float = 0.0
    prefetch_blocks: int = 0
    gather_hidden_s: float = 0.0
    grad_sync_s: float | None = None
    weight_s: float | None = None  # zb1: of `backward_s`, the weight gradients' (W) part


@dataclass(frozen=True, slots=True)
class Precision:
    """How a plan trains in its dtype, the recipe the planner priced and the runtime runs
    (Micikevicius et al. 2018, "Mixed Precision Training"; FSDP2's `MixedPrecisionPolicy`;
    Megatron-Core's fp32 main parameters and gradients).

    `compute`: the dtype of the weights the ops read, of the activations and of their
    gradients (the plan's `dtype`). Below fp32 the recipe is mixed: each parameter also has an
    fp32 master copy, which the optimizer steps, with fp32 optimizer states, and each
    micro-batch's gradient is accumulated into an fp32 gradient; the weights are cast down
    after every update. `reduce`: the dtype gradients are summed in across devices (fp32 by
    default; bf16 halves the sync). fp16 adds dynamic loss scaling (`loss_scaling`)."""

    compute: str = "fp32"
    reduce: str = "fp32"

    @property
    def mixed(self) -> bool:
        """fp32 masters beside weights computed in a lower precision."""
        return self.compute != "fp32"

    @property
    def master(self) -> str:
        return "fp32"

    @property
    def loss_scaling(self) -> str:
        """ "dynamic" for fp16 (whose range underflows small gradients), else "none"."""
        return "dynamic" if self.compute == "fp16" else "none"

    def to_json(self) -> dict[str, str]:
        return {
            "compute": self.compute,
            "master": self.master,
            "reduce": self.reduce,
            "loss_scaling": self.loss_scaling,
        }

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.compute]

    @property
    def reduce_dtype(self) -> torch.dtype:
        return DTYPES[self.reduce]

    def text(self) -> str:
        """For people: "bf16 compute, fp32 masters and optimizer states, fp32 gradient sync"."""
        if not self.mixed:
            return f"fp32 throughout, {self.reduce} gradient sync"
        scaled = ", dynamic loss scaling" if self.loss_scaling == "dynamic" else ""
        return (
            f"{self.compute} compute, fp32 masters and optimizer states, fp32 gradient "
            f"accumulation, {self.reduce} gradient sync{scaled}"
        )


@dataclass(frozen=True)
class Predicted:
    step_time_s: float
    peak_memory_bytes: int
    throughput_samples_per_s: float
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Replicated:
    """The share of the step's compute FLOPs that every device of a stage runs whole (every
    input and output B on each mesh dim of more than one device), and of it, the share of ops
    with no SBP rule (`no_rule_ops`: replicated for want of a rule, not by choice). Plans
    written before it was stated: unknown (None)."""

    flops_share: float
    no_rule_flops_share: float
    no_rule_ops: tuple[str, ...] = ()

    def text(self) -> str:
        """For people: "12% of FLOPs replicated (9% for want of a rule: aten.x)"."""
        ops = ", ".join(self.no_rule_ops)
        why = f" ({self.no_rule_flops_share:.0%} for want of a rule: {ops})" if ops else ""
        return f"{self.flops_share:.0%} of FLOPs replicated{why}"


@dataclass(frozen=True)
class SolverReport:
    """The search behind the plan: the status and proven gap of the chosen configuration's
    ILP, the whole search's wall time, the configurations it reached, how many of them an LP
    bounded and how many it solved (0 in plans written before these were recorded)."""

    status: str
    gap: float
    seconds: float
    configurations: int = 0
    bounded: int = 0
    solved: int = 0

    def effort(self) -> str:
        """The search effort as the summary says it (", 35 configurations (22 bounded by
        their LP, 2 solved)"), or "" for a plan written before it was recorded."""
        if not self.configurations:
            return ""
        return (
            f", {self.configurations} configurations ({self.bounded} bounded by their LP, "
            f"{self.solved} solved)"
        )


@dataclass(frozen=True)
class HandPlan:
    """A hand plan (`dp`, `fsdp`, `megatron:...`) priced by the same search, for comparison:
    its predicted step time and peak memory, or None and why it does not fit."""

    strategy: str
    step_time_s: float | None
    peak_memory_bytes: int | None
    note: str = ""


@dataclass(frozen=True)
class Plan:
    model_name: str
    fingerprint: str
    profile: str
    device_count: int
    memory_limit_bytes: int
    strategy: str
    mesh_shape: tuple[int, ...]
    mesh_dims: tuple[str, ...]
    link_classes: tuple[str, ...]
    stages: tuple[StagePlan, ...]
    micro_batches: int
    recompute: str
    global_batch: int
    dtype: str
    optimizer: str
    nodes: dict[str, NodePlan]
    params: dict[str, ParamPlan]
    predicted: Predicted
    solver: SolverReport
    alternatives: dict[str, tuple[Alternative, ...]] = field(default_factory=dict)
    hand_plans: tuple[HandPlan, ...] = ()
    # The most gradient bytes one sync collective fuses (DDP's bucket_cap_mb), as priced; the
    # runtime buckets with it. Plans written before it was recorded: PRICED_GRAD_BUCKET_BYTES.
    grad_bucket_bytes: int = PRICED_GRAD_BUCKET_BYTES
    replicated: Replicated | None = None  # what runs whole on every device, and why
    # The pipeline schedule (`schedule.SCHEDULES`) and the model chunks per stage (v): with
    # v > 1, `stages` are the v x P virtual stages, c x P + d on stage d's devices. Plans
    # written before it was recorded: 1F1B, v = 1.
    schedule: str = "1f1b"
    virtual_stages: int = 1
    # The gradients' sync dtype (`Precision.reduce`); the compute dtype is `dtype`. Plans
    # written before it was recorded: fp32.
    reduce_dtype: str = "fp32"
    # Whether the update clips the gradients by their global norm (priced: one more pass over
    # the gradients); False in plans written before it was recorded.
    clips_gradients: bool = False
    # The format this plan was written in: VERSION for new plans; a loaded plan keeps its own,
    # so that saving it again keeps what it meant (`plan.recompute.recomputed_nodes`).
    version: int = VERSION

    # ---- JSON -------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        """Plain JSON data (lists, not tuples): what `plan.files.save_plan` writes and
        `from_json` reads."""
        return json.loads(json.dumps(self._json_fields()))

    def _json_fields(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint},
            "cluster": {
                "profile": self.profile,
                "devices": self.device_count,
                "memory_limit_bytes": self.memory_limit_bytes,
            },
            "strategy": self.strategy,
            "mesh": {
                "shape": list(self.mesh_shape),
                "dims": list(self.mesh_dims),
                "link_classes": list(self.link_classes),
            },
            "stages": [_stage_fields(stage) for stage in self.stages],
            "micro_batches": self.micro_batches,
            "grad_bucket_bytes": self.grad_bucket_bytes,
            "recompute": self.recompute,
            "global_batch": self.global_batch,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
            "nodes": {name: _node_json(node) for name, node in self.nodes.items()},
            "params": {name: asdict(p) for name, p in self.params.items()},
            "predicted": asdict(self.predicted),
            "solver": asdict(self.solver),
            "alternatives": {
                name: [asdict(a) for a in alts] for name, alts in self.alternatives.items()
            },
            "hand_plans": [asdict(h) for h in self.hand_plans],
            **({"replicated": asdict(self.replicated)} if self.replicated else {}),
            **self._schedule_json(),
            **self._recipe_json(),
        }

    def _recipe_json(self) -> dict[str, Any]:
        """Written where not fp32 throughout without clipping: older plans' digests stay."""
        out: dict[str, Any] = {}
        if self.precision.mixed or self.reduce_dtype != "fp32":
            out["precision"] = self.precision.to_json()
        if self.clips_gradients:
            out["clip_grad_norm"] = True
        return out

    @property
    def precision(self) -> Precision:
        """The precision recipe the plan was priced for (its dtype and sync dtype)."""
        return Precision(self.dtype, self.reduce_dtype)

    def _schedule_json(self) -> dict[str, Any]:
        """Written where not the default (1F1B, v = 1): older plans' digests stay as they were."""
        if self.virtual_stages == 1 and self.schedule == "1f1b":
            return {}
        return {"schedule": {"name": self.schedule, "virtual_stages": self.virtual_stages}}

    @property
    def pipeline_stages(self) -> int:
        """P: the stages that hold devices (`stages` holds v x P virtual stages)."""
        return len(self.stages) // max(self.virtual_stages, 1)

    @classmethod
    def from_json(cls, data: Any, source: str = "plan") -> Plan:
        validate_plan_json(data, source)
        return cls(
            model_name=data["model"]["name"],
            fingerprint=data["model"]["fingerprint"],
            profile=data["cluster"]["profile"],
            device_count=data["cluster"]["devices"],
            memory_limit_bytes=data["cluster"]["memory_limit_bytes"],
            strategy=data["strategy"],
            mesh_shape=tuple(data["mesh"]["shape"]),
            mesh_dims=tuple(data["mesh"]["dims"]),
            link_classes=tuple(data["mesh"]["link_classes"]),
            stages=tuple(
                StagePlan(**{**s, **{k: tuple(s[k]) for k in ("devices", "mesh_shape", "blocks")}})
                for s in data["stages"]
            ),
            micro_batches=data["micro_batches"],
            schedule=data.get("schedule", {}).get("name", "1f1b"),
            virtual_stages=data.get("schedule", {}).get("virtual_stages", 1),
            grad_bucket_bytes=data.get("grad_bucket_bytes", PRICED_GRAD_BUCKET_BYTES),
            recompute=data["recompute"],
            global_batch=data["global_batch"],
            dtype=data["dtype"],
            reduce_dtype=_reduce_dtype(data, source),
            clips_gradients=data.get("clip_grad_norm", False),
            optimizer=data["optimizer"],
            nodes={
                name: NodePlan(
                    n["op"],
                    tuple(n["inputs"]),
                    tuple(n["outputs"]),
                    n["stage"],
                    n.get("tied_to", ""),
                    n.get("recomputed", False),
                    tuple(n.get("exchanges", ())),
                    n.get("path", ""),
                    tuple(n.get("regathered", ())),
                    n.get("overlap_chunks", 0),
                )
                for name, n in data["nodes"].items()
            },
            params={
                name: ParamPlan(
                    p["sbp"],
                    p["stage"],
                    p["optimizer_state_sbp"],
                    tuple(p["shape"]),
                    p.get("reshard_after_forward", False),
                    p.get("gradient_sbp", p["sbp"]),
                )
                for name, p in data["params"].items()
            },
            predicted=Predicted(**data["predicted"]),
            solver=SolverReport(**data["solver"]),
            alternatives={
                name: tuple(Alternative(**a) for a in alts)
                for name, alts in data.get("alternatives", {}).items()
            },
            hand_plans=tuple(HandPlan(**h) for h in data.get("hand_plans", [])),
            replicated=_replicated(data.get("replicated")),
            version=data["version"],
        )

    # ---- for people ---------------------------------------------------------------------------

    def best_hand_plan(self) -> HandPlan | None:
        """The fastest of the hand plans priced beside this one (None if none fits or none was
        priced)."""
        fitting = [h for h in self.hand_plans if h.step_time_s is not None]
        return min(fitting, key=lambda h: h.step_time_s or 0.0, default=None)

    def digest(self) -> str:
        """sha256 of the plan's JSON (keys sorted): equal on every rank that runs the same plan."""
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    # ---- use with a model --------------------------------------------------------------------

    def check_model(self, fingerprint: str, model_name: str = "the model") -> None:
        if fingerprint != self.fingerprint:
            raise PlanError(
                f"this plan was made for a model with graph fingerprint {self.fingerprint} "
                f"({self.model_name}), but {model_name} has fingerprint {fingerprint}: the model or "
                "its example input shapes changed. Make a new plan for this model."
            )

    def check_world(self, world_size: int) -> None:
        if world_size != self.device_count:
            raise PlanError(
                f"this plan is for {self.device_count} devices but the job has {world_size} "
                f"processes; launch with --nproc {self.device_count} or make a plan for {world_size}."
            )


def _node_json(node: NodePlan) -> dict[str, Any]:
    return {
        "op": node.op,
        "inputs": list(node.inputs),
        "outputs": list(node.outputs),
        "inputs_dtensor": [dtensor_names(parse_nd_sbp(s)) for s in node.inputs],
        "outputs_dtensor": [dtensor_names(parse_nd_sbp(s)) for s in node.outputs],
        "stage": node.stage,
        **({"tied_to": node.tied_to} if node.tied_to else {}),
        **({"recomputed": True} if node.recomputed else {}),
        **({"exchanges": list(node.exchanges)} if node.exchanges else {}),
        **({"path": node.path} if node.path else {}),
        **({"regathered": list(node.regathered)} if node.regathered else {}),
        **({"overlap_chunks": node.overlap_chunks} if node.overlap_chunks else {}),
    }


def _reduce_dtype(data: Any, source: str) -> str:
    """The plan's gradient-sync dtype, its precision checked against its dtype."""
    precision = data.get("precision")
    if precision is None:
        return "fp32"
    if precision["compute"] != data["dtype"]:
        raise PlanError(
            f"{source}: its precision computes in {precision['compute']} but its dtype is "
            f"{data['dtype']}; the plan is inconsistent (edited by hand?): make it again."
        )
    return str(precision["reduce"])


def _replicated(data: Any) -> Replicated | None:
    if data is None:
        return None
    return Replicated(
        data["flops_share"], data["no_rule_flops_share"], tuple(data.get("no_rule_ops", ()))
    )


def _stage_fields(stage: StagePlan) -> dict[str, Any]:
    """A stage's JSON fields; an unknown `grad_sync_s` (a plan written before the update's
    split) or `weight_s` (not zb1) left out: such a plan reads and writes back as it was."""
    left_out = ("grad_sync_s", "weight_s")
    return {k: v for k, v in asdict(stage).items() if v is not None or k not in left_out}

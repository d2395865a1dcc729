"""What one rank needs of each global batch: the model's inputs and this rank's box of each.

Lives here: `InputSpec` (one model input: a sample's shape, the dtype the plan's graph takes;
`input_specs` reads them off example inputs),
`BatchLayout` (the global batch, its micro-batches, and this rank's box of each input, which the
engine derives from the plan), `RankBatch` (what a rank gets per step), the rows a layout reads
(`BatchLayout.rows`) and the cut of one input to its box (`cut_piece`). Lives elsewhere: which
samples make a global batch (`runtime.data.sampler`), reading and validating them
(`runtime.data.sources`, `runtime.data.loader`), how the plan's input layouts become boxes (the
engine).

Invariants:
- Row k of micro-batch j is row j * (global_batch // micro_batches) + k of the global batch:
  `autosbp.capturing.batches.split_micro_batches`'s rule, which the plan's graph was made with.
- A box is one slice per leading dim of a micro-batch's input (dim 0: rows within the
  micro-batch; dims it leaves out are whole), each with step 1: an SBP's piece of a tensor is
  such a box (`autosbp.layout.shard_tensor`).
- A rank reads exactly the union over its inputs of the rows their boxes need, and nothing when
  every box is None (a middle pipeline stage).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autosbp.errors import DataError

__all__ = ["BatchLayout", "Box", "InputSpec", "RankBatch", "cut_piece", "input_specs"]

Box = tuple[slice, ...]
# [micro-batch][input] -> this rank's piece of that input (None: the rank does not read it).
RankBatch = tuple[tuple[torch.Tensor | None, ...], ...]


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One of the model's user inputs, in forward's order."""

    sample_shape: tuple[int, ...]  # one sample's shape: the example input's without dim 0
    dtype: torch.dtype  # what the plan's graph takes; floating data is cast to it
    name: str = ""  # forward's parameter name, for errors ("input #1 `labels`")

    def describe(self, position: int) -> str:
        return f"input #{position} `{self.name}`" if self.name else f"input #{position}"


def input_specs(
    example_inputs: Sequence[torch.Tensor],
    names: Sequence[str] = (),
    compute_dtype: torch.dtype | None = None,
) -> tuple[InputSpec, ...]:
    """The specs of a model's example inputs (dim 0 the batch), named by `names` (forward's
    parameters) where given; floating inputs in `compute_dtype` where given (the plan's)."""
    return tuple(
        InputSpec(
            tuple(x.shape[1:]),
            compute_dtype if compute_dtype is not None and x.is_floating_point() else x.dtype,
            names[i] if i < len(names) else "",
        )
        for i, x in enumerate(example_inputs)
    )


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """What one rank needs of each global batch (the engine builds it from the plan).

    `boxes[i]` is this rank's piece of ONE micro-batch of input i (box[0]: rows within the
    micro-batch; the rest: other dims), or None where no program of this rank reads input i.
    Tensor-, context- and expert-parallel replicas hold the same rows, data-parallel ranks their
    share: that follows from the boxes alone.
    """

    global_batch: int  # samples per step
    micro_batches: int  # the batch is cut along dim 0 into this many equal consecutive pieces
    inputs: tuple[InputSpec, ...]
    boxes: tuple[Box | None, ...]

    def __post_init__(self) -> None:
        if (
            self.global_batch < 1
            or self.micro_batches < 1
            or self.global_batch % self.micro_batches
        ):
            raise DataError(
                f"A global batch of {self.global_batch} samples cannot be cut into "
                f"{self.micro_batches} equal micro-batches; give a global batch that is a "
                "positive multiple of the micro-batch count."
            )
        if len(self.boxes) != len(self.inputs):
            raise DataError(
                f"The batch layout has {len(self.boxes)} boxes for {len(self.inputs)} inputs; "
                "give one box (or None) per model input."
            )
        for position, (spec, box) in enumerate(zip(self.inputs, self.boxes, strict=True)):
            if box is not None:
                _check_box(box, (self.micro_rows, *spec.sample_shape), spec.describe(position))

    @classmethod
    def whole(
        cls, global_batch: int, inputs: tuple[InputSpec, ...], micro_batches: int = 1
    ) -> BatchLayout:
        """The layout of a process that reads every input whole (one device, or a user's loop)."""
        return cls(global_batch, micro_batches, inputs, tuple((slice(None),) for _ in inputs))

    @property
    def micro_rows(self) -> int:
        """Samples per micro-batch."""
        return self.global_batch // self.micro_batches

    def rows(self) -> tuple[int, ...]:
        """The rows of the global batch this rank reads, ascending: the union over micro-batches
        and inputs of the rows their boxes need (none when every box is None)."""
        needed: set[int] = set()
        for box in self.boxes:
            if box is not None:
                start, stop, _ = box[0].indices(self.micro_rows)
                for j in range(self.micro_batches):
                    needed.update(range(j * self.micro_rows + start, j * self.micro_rows + stop))
        return tuple(sorted(needed))

    def box_rows(self, micro_batch: int, box: Box) -> range:
        """The rows of the global batch that `box` takes from micro-batch `micro_batch`."""
        start, stop, _ = box[0].indices(self.micro_rows)
        offset = micro_batch * self.micro_rows
        return range(offset + start, offset + stop)


def cut_piece(rows: torch.Tensor, box: Box, spec: InputSpec, device: torch.device) -> torch.Tensor:
    """A box's piece from `rows` (the box's rows of one input, whole in every other dim): cut to
    the box's other dims, floating data cast to the plan's dtype, contiguous, on `device`."""
    piece = rows[(slice(None), *box[1:])]
    if piece.is_floating_point():
        piece = piece.to(spec.dtype)
    return piece.to(device).contiguous()


def _check_box(box: Box, shape: tuple[int, ...], what: str) -> None:
    if not 1 <= len(box) <= len(shape):
        raise DataError(
            f"The box of {what} has {len(box)} slices for a micro-batch of shape {list(shape)}; "
            "give one slice per leading dim (at least the rows)."
        )
    for dim, (cut, size) in enumerate(zip(box, shape, strict=False)):
        start, stop, _ = cut.indices(size)
        bounded = all(end is None or 0 <= end <= size for end in (cut.start, cut.stop))
        if cut.step not in (None, 1) or not bounded or stop < start:
            raise DataError(
                f"The box of {what} cuts dim {dim} (size {size}) with {cut}; give a slice of "
                f"step 1 within 0..{size}."
            )

"""Training curves: a job's loss and evaluation loss per step beside another run's.

Lives here: `Curve` (a run's losses per step and its evaluations) and `draw_curves` (both
runs in one picture, a PNG). Lives elsewhere: the runs (`runtime.jobs`, the plain loop of
`runtime.verify.plain_loop`), the demo that draws them (`autosbp.commands.demo`).
matplotlib is imported only to draw.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from autosbp.plan.files import write_atomically

__all__ = ["Curve", "draw_curves"]

WIDTH_IN, HEIGHT_IN, DPI = 9.0, 4.5, 110


@dataclass(frozen=True)
class Curve:
    """A run's name, its loss per step (step 1 first) and its evaluations (step, loss)."""

    name: str
    losses: Sequence[float]
    evals: Sequence[tuple[int, float]] = ()


def draw_curves(path_png: str | os.PathLike[str], curves: Sequence[Curve], *, title: str) -> Path:
    """Every curve's training loss (thin) and evaluation loss (markers joined) against the
    step, one colour, line style and marker per run (runs that coincide stay visible), on one
    axis; written atomically."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(WIDTH_IN, HEIGHT_IN))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    styles = (("tab:blue", "-", "o"), ("tab:orange", "--", "s"), ("tab:green", ":", "^"))
    for (colour, line, marker), curve in zip(styles, curves, strict=False):
        steps = range(1, len(curve.losses) + 1)
        ax.plot(steps, curve.losses, color=colour, ls=line, lw=0.9, alpha=0.7,
                label=f"{curve.name}: training loss")  # fmt: skip
        if curve.evals:  # the runs often coincide: hollow markers of their own shape
            at, losses = zip(*curve.evals, strict=True)
            ax.plot(at, losses, color=colour, ls=line, lw=2, marker=marker, mfc="none", ms=8,
                    label=f"{curve.name}: held-out loss")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title, loc="left", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return write_atomically(
        Path(path_png), lambda tmp: fig.savefig(tmp, format="png", dpi=DPI), "training curves"
    )

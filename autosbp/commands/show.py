"""`autosbp show plan.json [--trace measured.json] [--timeline out.png]`: a plan, its predicted
step beside a measured one, and both as a timeline chart.

Lives here: the command's arguments and output. Lives elsewhere: the timelines, trace files and
the chart, and the sizes they refuse (`timeline`), the plan format and its checks (`plan`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from autosbp.errors import PlanError
from autosbp.plan import Plan
from costmodel.text import printable


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file written by `autosbp plan`")
    parser.add_argument(
        "--trace", help="a Chrome trace of measured steps, written by the runtime (last step shown)"
    )
    parser.add_argument("--timeline", help="write the predicted (and measured) timeline as PNG")


def run(args: argparse.Namespace, console: Console) -> int:
    # Imported here: timeline loads torch (via schedule), which `autosbp --help` must not wait for.
    from autosbp.timeline import (
        check_chart,
        draw_timelines,
        last_step,
        predicted_events,
        read_chrome_trace,
        span_s,
    )

    plan = Plan.load(Path(args.plan))  # consistent in itself, or refused
    if args.timeline is not None:  # refused before the simulation builds every rank's events
        check_chart(plan.device_count, 0)
    predicted = predicted_events(plan, every_rank=args.timeline is not None)
    predicted_s = span_s(predicted)
    measured = None if args.trace is None else read_chrome_trace(Path(args.trace))
    measured_s = None if measured is None else span_s(last_step(measured))
    if measured_s == 0:
        raise PlanError(
            f"trace {args.trace} holds no spans with a duration; pass a trace recorded by the "
            "runtime during at least one training step."
        )
    console.print(plan.summary())
    console.print(
        f"predicted step {predicted_s * 1e3:.3f} ms ({len(plan.stages)} stage(s) x "
        f"{plan.micro_batches} micro-batch(es), simulated)",
        soft_wrap=True,
    )
    if measured_s is not None:
        console.print(
            f"measured step {measured_s * 1e3:.3f} ms (last step of {args.trace}): "
            f"{measured_s / predicted_s:.2f}x the prediction",
            soft_wrap=True,
        )
    if args.timeline is not None:
        title = printable(
            f"{plan.model_name}: {plan.strategy} plan on {plan.device_count} x {plan.profile}"
        )
        path = draw_timelines(args.timeline, predicted, measured, title=title)
        console.print(f"timeline written to {path}", soft_wrap=True)
    return 0

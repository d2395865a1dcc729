"""`autosbp show plan.json [--trace measured.json] [--timeline out.png]`: a plan, its predicted
step beside a measured one, and both as a timeline chart.

Lives here: the command's arguments and output. Lives elsewhere: the timelines, trace files and
the chart, the sizes they refuse, the one definition of a measured step and the refusal of a
trace of another plan (`timeline`), the plan format and its checks (`plan`), whether the machine
was loaded while the trace was recorded (`costmodel.machine`: train writes it in the trace).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from autosbp.errors import PlanError
from autosbp.plan import format_seconds, load_plan, summary_table
from costmodel.machine import LoadSample, load_note
from terminal.text import printable


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file written by `autosbp plan`")
    parser.add_argument(
        "--trace",
        help="a Chrome trace recorded under this plan by `autosbp train --plan PLAN --trace "
        "FILE`; its last step is set beside the prediction (default: the prediction alone)",
    )
    parser.add_argument(
        "--timeline",
        help="write the predicted (and measured) timeline as a PNG here (default: no chart)",
    )


def run(args: argparse.Namespace, console: Console) -> int:
    # Imported here: timeline loads torch (via schedule), which `autosbp --help` must not wait for.
    from autosbp.timeline import (
        check_chart,
        check_trace_plan,
        draw_timelines,
        last_step,
        measured_step_s,
        predicted_events,
        read_trace,
        span_s,
    )

    plan = load_plan(Path(args.plan))  # consistent in itself, or refused
    measured, loaded = None, None
    if args.trace is not None:
        trace = read_trace(Path(args.trace))
        check_trace_plan(trace, plan, args.trace, args.plan)
        measured = trace.events
        loaded = load_note(LoadSample.from_json(trace.metadata.get("load")))
    if args.timeline is not None:  # refused before the simulation builds every rank's events
        # The plan's own ranks: no trace of this plan has fewer, so the fix is the summary.
        both = "" if measured is None else " and measured"
        check_chart(
            plan.device_count, 0,
            fix=f"the predicted{both} step is in the summary (`autosbp show PLAN"
            f"{'' if measured is None else ' --trace TRACE'}` without --timeline)",
        )  # fmt: skip
    predicted = predicted_events(plan, every_rank=args.timeline is not None)
    predicted_s = span_s(predicted)
    measured_s = None if measured is None else measured_step_s(last_step(measured))
    if measured_s == 0:
        raise PlanError(
            f"trace {args.trace} holds no spans with a duration; pass a trace recorded by the "
            "runtime during at least one training step."
        )
    console.print(summary_table(plan))
    console.print(
        f"predicted step {format_seconds(predicted_s)} ({plan.pipeline_stages} stage(s)"
        f"{f' of {plan.virtual_stages} chunks' if plan.virtual_stages > 1 else ''} x "
        f"{plan.micro_batches} micro-batch(es), simulated)",
        soft_wrap=True,
    )
    if measured_s is not None:
        console.print(
            f"measured step {format_seconds(measured_s)} (last step of {args.trace}, its slowest "
            f"rank): {measured_s / predicted_s:.2f}x the prediction",
            soft_wrap=True,
        )
        if loaded is not None:
            console.print(f"note: while it trained, {loaded}.", soft_wrap=True, markup=False)
    if args.timeline is not None:
        title = printable(
            f"{plan.model_name}: {plan.strategy} plan on {plan.device_count} x {plan.profile}"
        )
        path = draw_timelines(args.timeline, predicted, measured, title=title)
        console.print(f"timeline written to {path}", soft_wrap=True)
    return 0

"""A time limit reached is said: the API warns (`TimeLimitWarning`), `autosbp plan` and `autosbp
demo` print it in words, each with the proven gap, the plan so far and how to raise the limit;
and the limit never costs the plan (the search goes on to its first one).

A limit of 1e-9 s stops every search right after its first plan, before it can prove it: on
these spaces (dozens of configurations) the first plan is never already proven optimal, which
each test checks through the status it reports.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from rich.console import Console

from autosbp.capturing.rebatch import micro_batch_graphs
from autosbp.cli import main
from autosbp.commands import demo
from autosbp.planner.api import plan_graphs
from autosbp.planner.search.entry import TimeLimitWarning
from autosbp.zoo import build_model

TINY_S = 1e-9
GPT = "layers=4,hidden=64,heads=4,vocab=128,seq=16,batch=16"


def _graphs() -> dict:
    model, inputs = build_model("gpt", layers=4, hidden=64, heads=4, vocab=128, seq=16, batch=16)
    return micro_batch_graphs(model, inputs, (1, 2, 4, 8, 16), name="gpt")


def _says_the_limit(text: str) -> None:
    text = " ".join(text.split())  # the console wraps lines
    assert re.search(r"time limit of 1e-09 s stopped the search", text), text
    assert re.search(r"at most \d+\.\d% slower than the best plan", text), text
    assert "proven gap" in text and "best found so far" in text, text
    assert "--time-limit-s" in text, text


@pytest.mark.slow
def test_the_api_warns_when_the_limit_stops_the_search() -> None:
    common = {
        "profile": "dgx-a100", "devices": 8, "memory_limit": None, "global_batch": None,
        "optimizer": "adam", "dtype": "fp32", "strategy": "auto", "jobs": 1,
    }  # fmt: skip
    with pytest.warns(TimeLimitWarning) as caught:
        plan = plan_graphs(_graphs(), **common, time_limit_s=TINY_S)
    assert plan.solver.status == "feasible", plan.solver  # a plan, not proven
    _says_the_limit(str(caught[0].message))
    assert f"{plan.predicted.step_time_s:.2f} s per step" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimeLimitWarning)  # with time enough: no warning
        assert plan_graphs(_graphs(), **common, time_limit_s=600).solver.status == "optimal"


def test_plan_says_the_limit_in_words(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "gpt", "--model-args", GPT, "--profile", "dgx-a100", "--devices", "8"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimeLimitWarning)  # said in words, not as a warning
        code = main([*args, "--time-limit-s", str(TINY_S), "--out", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "time limit reached:" in out, out
    _says_the_limit(out)


def test_demo_takes_a_time_limit_and_says_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = __import__("argparse").ArgumentParser()
    demo.configure(parser, "demo")
    assert parser.parse_args(["--time-limit-s", "5"]).time_limit_s == 5.0
    console = Console(width=200, force_terminal=False)
    demo._gpt3(2, tmp_path, console, TINY_S)  # GPT-3's width at 2 layers on 1024 A100s
    out = capsys.readouterr().out
    assert "time limit reached:" in out, out
    _says_the_limit(out)

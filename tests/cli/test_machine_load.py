"""A loaded machine is said to be loaded: `LoadSample` (when it counts as loaded), `train`
recording the load average in its trace, and `show` saying so beside "Nx the prediction"."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autosbp.cli import main
from autosbp.plan import save_plan
from autosbp.timeline import predicted_events, write_chrome_trace
from costmodel.machine import LoadSample, load_note, usable_cores
from tests.plan.test_timeline import as_steps, pipeline_plan


@pytest.mark.parametrize(
    ("sample", "loaded"),
    [
        pytest.param(LoadSample(0.1, 1.9, 2, 2), False, id="quiet-2-ranks-on-2-cores"),
        pytest.param(LoadSample(0.2, 0.3, 16, 2), False, id="quiet-big-machine"),
        pytest.param(LoadSample(6.2, 6.4, 2, 2), True, id="busy-before"),
        pytest.param(LoadSample(0.0, 4.5, 2, 2), True, id="busy-while-it-ran"),
        pytest.param(LoadSample(3.0, 3.5, 16, 2), False, id="busy-but-cores-to-spare"),
        pytest.param(LoadSample(0.4, 0.4, 2, 2), False, id="background-noise"),
        pytest.param(LoadSample(0.0, 3.9, 2, 4), False, id="oversubscribed-by-itself"),
    ],
)
def test_loaded_is_other_work_taking_the_ranks_cores(sample: LoadSample, loaded: bool) -> None:
    assert sample.loaded is loaded
    note = load_note(sample)
    assert (note is not None) is loaded
    if note is not None:
        assert f"on its {sample.cores} cores" in note and "not comparable" in note
    assert LoadSample.from_json(sample.to_json()) == sample


@pytest.mark.parametrize(
    ("load", "said"),
    [
        pytest.param(LoadSample(6.22, 6.41, 2, 2).to_json(), True, id="loaded"),
        pytest.param(LoadSample(0.05, 0.9, 2, 2).to_json(), False, id="quiet"),
        pytest.param(None, False, id="a-trace-without-load"),
        pytest.param({"cores": "two"}, False, id="a-trace-with-something-else"),
    ],
)
def test_show_says_when_the_trace_was_recorded_on_a_loaded_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], load: object, said: bool
) -> None:
    plan = pipeline_plan()
    plan_path = save_plan(plan, tmp_path / "plan.json")
    measured = [
        dataclasses.replace(e, start_s=5.73 * e.start_s, end_s=5.73 * e.end_s)
        for e in predicted_events(plan)
    ]
    metadata = {} if load is None else {"load": load}
    trace = write_chrome_trace(
        tmp_path / "trace.json", as_steps(measured, 2), plan_digest=plan.digest(), metadata=metadata
    )
    assert main(["show", str(plan_path), "--trace", str(trace)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "5.73x the prediction" in out
    assert ("the machine was loaded" in out) is said
    if said:
        assert "other work ran about 6.2 processes at a time on its 2 cores" in out


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(300)
def test_train_records_the_load_in_its_trace(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    args = ["train", "mlp", "--nproc", "2", "--steps", "2", "--plan", "dp", "--trace", str(trace)]
    assert main(args) == 0
    load = LoadSample.from_json(json.loads(trace.read_text())["otherData"]["load"])
    assert load is not None
    assert load.cores == usable_cores() and load.ranks == 2
    assert load.before >= 0 and load.after >= 0

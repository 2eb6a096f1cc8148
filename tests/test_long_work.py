"""Progress of long work (meshshard/long_work.py): silent when short, phases and the
duration once past the threshold, and a first step call that plans long says so."""

import io
import time

import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.long_work import LongWork, phase


def test_short_work_prints_nothing():
    out = io.StringIO()
    with LongWork("compiling", after_s=30.0, stream=out):
        phase("tracing")
    assert out.getvalue() == ""


def test_work_past_the_threshold_names_its_phase_each_later_one_and_its_duration():
    out = io.StringIO()
    with LongWork("compiling step", after_s=0.05, stream=out):
        phase("planning: sharding")
        time.sleep(0.3)  # the notice comes from the timer, naming the current phase
        phase("compiling 4 programs on 2 workers")
        with LongWork("nested", stream=out):  # reports through the outer work
            phase("inner phase")
    lines = out.getvalue().splitlines()
    assert lines[0] == "meshshard: compiling step: planning: sharding ... (running for 0s)"
    assert lines[1:3] == [
        "meshshard: compiling step: compiling 4 programs on 2 workers ...",
        "meshshard: compiling step: inner phase ...",
    ]
    assert lines[3].startswith("meshshard: compiling step: done in ") and len(lines) == 4


def test_failed_work_says_it_stopped_and_quiet_silences_it(monkeypatch):
    out = io.StringIO()
    with pytest.raises(ValueError), LongWork("compiling", after_s=0.0, stream=out):
        raise ValueError("bad step")
    assert "stopped (error) in" in out.getvalue()
    monkeypatch.setenv("MESHSHARD_QUIET", "1")
    quiet = io.StringIO()
    with LongWork("compiling", after_s=0.0, stream=quiet):
        phase("tracing")
    assert quiet.getvalue() == ""


def test_a_first_call_shows_its_phases(threads_cluster, monkeypatch, capsys):
    monkeypatch.setenv("MESHSHARD_PROGRESS_AFTER", "0")
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    step = meshshard.parallelize(mlp.train_step, method=PipeshardParallel(2, stages=[(1, 2)] * 2))
    step(state, batch)
    err = capsys.readouterr().err
    head = "meshshard: compiling train_step for threads-4x2: "
    for line in ("tracing the step ...", "planning: sharding ...", "planning: emit ..."):
        assert head + line in err
    plan = step.plan
    assert f"compiling {len(plan.programs)} programs on {len(plan.workers)} workers ..." in err
    assert head + "done in " in err
    step(state, batch)  # compiled: nothing more
    assert capsys.readouterr().err == ""

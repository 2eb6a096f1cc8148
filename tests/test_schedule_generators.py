"""New schedule generators (eager 1F1B, interleaved 1F1B, ZB-H1, 2BW) and the verifier.

Tick counts are the closed forms of the unit-time clock model; activation peaks are
counted off the grid and compared with each schedule's own formula.
"""

import re
from dataclasses import replace

import pytest

from meshshard.passes.schedule_verify import (
    ScheduleError,
    activation_peaks,
    check_schedule,
    schedule_problems,
)
from meshshard.passes.schedules import (
    eager_one_f_one_b,
    interleaved_one_f_one_b,
    make_schedule,
    two_bw,
    zb_h1,
)
from meshshard.plan import Task
from meshshard.refs import TaskKind
from tests.golden import check_golden

SIZES = [(s, m) for s in (2, 3, 4, 8) for m in (1, 2, 4, 8, 16)]


@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_eager_1f1b_same_ticks_as_1f1b_and_2s_minus_1_in_flight(stages, micro_batches):
    sched = eager_one_f_one_b(stages, micro_batches)
    check_schedule(sched)
    assert len(sched.ticks) == 2 * (micro_batches + stages - 1)
    assert activation_peaks(sched) == [
        min(2 * (stages - i) - 1, micro_batches) for i in range(stages)
    ]


@pytest.mark.parametrize("stages,micro_batches", [(s, m) for s, m in SIZES if m % s == 0])
@pytest.mark.parametrize("v", [2, 3])
def test_interleaved_bubble_is_s_minus_1_over_v(stages, micro_batches, v):
    sched = interleaved_one_f_one_b(stages, micro_batches, v)
    check_schedule(sched)
    # chunk ticks: 2 v M of work per mesh plus 2 (S-1) of bubble, i.e. (S-1)/(v M)
    assert len(sched.ticks) == 2 * v * micro_batches + 2 * (stages - 1)
    assert max(activation_peaks(sched)) <= v * micro_batches


@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_zb_h1_a_third_of_the_1f1b_bubble_at_1f1b_peak_memory(stages, micro_batches):
    sched = zb_h1(stages, micro_batches)
    check_schedule(sched)
    if micro_batches >= stages:
        # F = B = W = 1 tick: 1F1B takes 3 (M + S - 1), ZB-H1 3 M + (S - 1)
        assert len(sched.ticks) == 3 * micro_batches + stages - 1
    assert max(activation_peaks(sched)) == min(stages, micro_batches)


@pytest.mark.parametrize("stages,micro_batches", [(2, 2), (2, 4), (4, 4), (4, 8), (8, 8)])
def test_2bw_no_flush_between_steps(stages, micro_batches):
    steps = 3
    sched = two_bw(stages, micro_batches, steps=steps)
    check_schedule(sched)
    # one warm-up and one drain for all steps: 2 (steps M + S - 1) ticks
    assert len(sched.ticks) == 2 * (steps * micro_batches + stages - 1)
    assert activation_peaks(sched) == [stages - i for i in range(stages)]
    versions = {c.mb: c.version for row in sched.ticks for c in row if c is not None}
    assert [versions[g] for g in range(0, steps * micro_batches, micro_batches)] == [0, 0, 1]


def test_2bw_needs_m_at_least_s():
    with pytest.raises(ValueError, match=r"2bw needs num_micro_batches \(2\) >= .* \(4\)"):
        two_bw(4, 2)


def test_interleaved_needs_m_divisible_by_s():
    with pytest.raises(ValueError, match=r"num_micro_batches \(6\) divisible .* \(4\)"):
        interleaved_one_f_one_b(4, 6, 2)


def test_make_schedule_names_the_choices():
    with pytest.raises(ValueError, match=r"schedule must be one of .*'zb_h1'.*got 'zb'"):
        make_schedule("zb", 2, 2)


def test_golden_new_grids():
    text = "\n\n".join(
        str(s)
        for s in (
            eager_one_f_one_b(3, 4),
            interleaved_one_f_one_b(2, 4, 2),
            zb_h1(3, 4),
            two_bw(2, 2),
        )
    )
    check_golden("schedules_new_grids.txt", text + "\n")


def _swap_cells(sched, t1, t2, s):
    ticks = [list(r) for r in sched.ticks]
    ticks[t1][s], ticks[t2][s] = ticks[t2][s], ticks[t1][s]
    return replace(sched, ticks=tuple(tuple(r) for r in ticks))


def test_verifier_marks_the_cell_of_a_broken_dependency():
    sched = zb_h1(2, 2)
    # stage 1 runs W0 before B0
    t_b = next(t for t, r in enumerate(sched.ticks) if r[1] == Task(1, 0, TaskKind.B))
    t_w = next(t for t, r in enumerate(sched.ticks) if r[1] == Task(1, 0, TaskKind.W))
    with pytest.raises(ScheduleError) as err:
        check_schedule(_swap_cells(sched, t_b, t_w, 1))
    text = str(err.value)
    assert re.search(r"task s1\.W0 at tick \d+ runs before its dependency s1\.B0", text)
    assert re.search(rf"\n\s+{t_b}\s+\S+\s+>W0<", text)


def test_verifier_catches_activations_over_the_bound():
    sched = eager_one_f_one_b(4, 8)
    tight = replace(sched, activation_bound=(4, 3, 2, 1))  # 1F1B's bound
    problems = [str(p) for p in schedule_problems(tight)]
    assert any(
        re.match(r"stage 0 holds 5 micro-batches .* over the schedule's bound 4", p)
        for p in problems
    )


def test_verifier_catches_a_wrong_and_a_retired_weight_version():
    sched = two_bw(2, 2, steps=4)
    ticks = [list(r) for r in sched.ticks]
    t, c = next((t, r[0]) for t, r in enumerate(ticks) if r[0] and r[0].mb == 6)
    ticks[t][0] = replace(c, version=1)  # step 3 must read version 2
    bad = replace(sched, ticks=tuple(tuple(r) for r in ticks))
    assert any("reads version 1, want 2" in str(p) for p in schedule_problems(bad))
    # a 2BW grid whose flush-free order runs step 2's forward before step 0's update
    late = two_bw(2, 2, steps=3)
    assert schedule_problems(late) == []
    ticks = [list(r) for r in late.ticks]
    f4 = next(t for t, r in enumerate(ticks) if r[0] == Task(0, 4, TaskKind.F, None, 1))
    b1 = next(t for t, r in enumerate(ticks) if r[0] == Task(0, 1, TaskKind.B, None, 0))
    ticks[f4][0], ticks[b1][0] = ticks[b1][0], ticks[f4][0]
    problems = [str(p) for p in schedule_problems(replace(late, ticks=tuple(map(tuple, ticks))))]
    assert any(
        re.search(r"F4~1 on stage 0 at tick \d+ reads version 1, not live then", p)
        for p in problems
    )


def test_virtual_stages_is_checked_against_the_schedule():
    from meshshard import PipeshardParallel
    from meshshard.errors import MeshshardInputError

    with pytest.raises(
        MeshshardInputError, match=r"virtual_stages=2 needs schedule='interleaved_1f1b'"
    ):
        PipeshardParallel(num_micro_batches=4, virtual_stages=2)
    with pytest.raises(MeshshardInputError, match=r"virtual_stages must be a positive int, got 0"):
        PipeshardParallel(num_micro_batches=4, schedule="interleaved_1f1b", virtual_stages=0)
    m = PipeshardParallel(num_micro_batches=4, schedule="interleaved_1f1b", virtual_stages=2)
    assert m.virtual_stages == 2

"""Pure schedule generators: tick counts, memory bound, dependency order, golden grids."""

import pytest

from meshshard.passes.schedules import gpipe, make_schedule, one_f_one_b
from meshshard.verify import peak_in_flight, verify_schedule
from tests.golden import check_golden

SIZES = [(s, m) for s in (1, 2, 3, 4, 6) for m in (1, 2, 3, 4, 8, 13)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_tick_count_and_dependencies(name, stages, micro_batches):
    sched = make_schedule(name, stages, micro_batches)
    assert verify_schedule(sched) == []
    assert len(sched.ticks) == 2 * (micro_batches + stages - 1)


@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_1f1b_holds_at_most_s_minus_i_micro_batches(stages, micro_batches):
    peaks = peak_in_flight(one_f_one_b(stages, micro_batches))
    assert peaks == [min(stages - i, micro_batches) for i in range(stages)]


@pytest.mark.parametrize("stages,micro_batches", SIZES)
def test_gpipe_holds_every_micro_batch(stages, micro_batches):
    assert peak_in_flight(gpipe(stages, micro_batches)) == [micro_batches] * stages


def test_golden_1f1b_grid():
    check_golden("schedule_1f1b_3x4.txt", str(one_f_one_b(3, 4)) + "\n")


def test_golden_gpipe_grid():
    check_golden("schedule_gpipe_2x3.txt", str(gpipe(2, 3)) + "\n")


def test_verify_schedule_catches_a_broken_grid():
    sched = one_f_one_b(2, 2)
    broken = type(sched)(sched.name, 2, 2, (sched.ticks[1],) + (sched.ticks[0],) + sched.ticks[2:])
    assert any("before its dependency" in p for p in verify_schedule(broken))

"""Pure schedule generators: tick counts, memory bound, dependency order, golden grids."""

import pytest

from meshshard.passes.schedules import gpipe, make_schedule, one_f_one_b
from meshshard.verify import peak_in_flight, verify_schedule

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
    assert str(one_f_one_b(3, 4)) == (
        "1f1b: 3 stages x 4 micro-batches, 12 ticks\n"
        "  tick   s0   s1   s2\n"
        "     0   F0    .    .\n"
        "     1   F1   F0    .\n"
        "     2   F2   F1   F0\n"
        "     3    .    .   B0\n"
        "     4    .   B0   F1\n"
        "     5   B0   F2   B1\n"
        "     6   F3   B1   F2\n"
        "     7   B1   F3   B2\n"
        "     8    .   B2   F3\n"
        "     9   B2    .   B3\n"
        "    10    .   B3    .\n"
        "    11   B3    .    ."
    )


def test_golden_gpipe_grid():
    assert str(gpipe(2, 3)) == (
        "gpipe: 2 stages x 3 micro-batches, 8 ticks\n"
        "  tick   s0   s1\n"
        "     0   F0    .\n"
        "     1   F1   F0\n"
        "     2   F2   F1\n"
        "     3    .   F2\n"
        "     4    .   B0\n"
        "     5   B0   B1\n"
        "     6   B1   B2\n"
        "     7   B2    ."
    )


def test_verify_schedule_catches_a_broken_grid():
    sched = one_f_one_b(2, 2)
    broken = type(sched)(sched.name, 2, 2, (sched.ticks[1],) + (sched.ticks[0],) + sched.ticks[2:])
    assert any("before its dependency" in p for p in verify_schedule(broken))

"""Shared assertion of the resharding bound tests that enumerate every runnable schedule."""

import pytest


def assert_bound_met(times, bound_s: float, within: float, plan_s: float | None = None) -> None:
    """No enumerated schedule (``times``, seconds) takes less than the lower bound, the
    best takes at most ``within`` times it, and the planner's plan (``plan_s``, when
    given) is that best schedule."""
    best = min(times)
    assert best >= bound_s * (1 - 1e-9), f"a schedule beats the bound: {best} < {bound_s}"
    assert best <= bound_s * within, f"the best schedule is {best / bound_s:.4f}x the bound"
    if plan_s is not None:
        assert plan_s == pytest.approx(best, rel=1e-3)

"""What a re-plan of the same step reuses: program FLOPs and bytes (passes/costs.py) and
resharding plans (passes/transfers.py), each made once per process."""

from dataclasses import replace

import jax
import pytest

from examples import mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.passes import costs, transfers
from meshshard.passes.pipeline import plan_traced
from meshshard.passes.trace import trace_step

CLUSTER = ClusterSpec("costs-4x2", 4, 2)


@pytest.fixture(scope="module")
def traced():
    batch = mlp.make_batch(batch_size=16)
    state = mlp.make_state(mlp.MLP(num_layers=4), batch["x"])
    return trace_step(mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=2)


def _counts(traced, method, monkeypatch):
    """Each program's (flops, bytes) in ``method``'s plan, and how many programs were
    lowered to count them."""
    lowered = []
    real_jit = jax.jit

    def counting_jit(fn, *args, **kwargs):
        lowered.append(fn)
        return real_jit(fn, *args, **kwargs)

    monkeypatch.setattr(costs.jax, "jit", counting_jit)
    plan = plan_traced(traced, method=method, cluster=CLUSTER, costs=True)
    monkeypatch.undo()
    return {str(p.name): (p.flops, p.bytes_accessed) for p in plan.programs}, len(lowered)


def test_a_replan_counts_only_programs_it_has_not_seen(traced, monkeypatch):
    costs._COSTS.clear()
    two = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="1f1b")
    first, n_first = _counts(traced, two, monkeypatch)
    assert n_first == len(first) and all(f and b for f, b in first.values())
    # another schedule of the same stages: the same programs (GPipe runs no forward
    # and backward back to back, so no fused s1.FB), none lowered again
    again, n_again = _counts(traced, replace(two, schedule="gpipe"), monkeypatch)
    assert "s1.FB" in first and "s1.FB" not in again
    assert (again, n_again) == ({k: v for k, v in first.items() if k != "s1.FB"}, 0)
    # four stages: new programs are counted; the counts equal a cold count's
    four = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    warm, n_warm = _counts(traced, four, monkeypatch)
    costs._COSTS.clear()
    cold, n_cold = _counts(traced, four, monkeypatch)
    assert warm == cold and 0 < n_warm <= n_cold == len(cold)


def test_a_replan_reuses_the_resharding_plans(traced, monkeypatch):
    transfers._planned.cache_clear()
    planned = []
    real = transfers.plan_resharding

    def counting(problem, *args, **kwargs):
        planned.append(problem)
        return real(problem, *args, **kwargs)

    monkeypatch.setattr(transfers, "plan_resharding", counting)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    first = plan_traced(traced, method=method, cluster=CLUSTER)
    n = len(planned)
    assert 0 < n <= len(first.transfers)
    again = plan_traced(traced, method=replace(method, schedule="gpipe"), cluster=CLUSTER)
    assert len(planned) == n  # nothing planned again
    assert [t.messages for t in again.transfers] == [t.messages for t in first.transfers]

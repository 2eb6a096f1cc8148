"""``PipeshardParallel(remat=...)``: each layer's forward keeps less for its backward,
and the step still equals single-device ``jax.jit``."""

import pytest

from meshshard import MeshshardInputError, PipeshardParallel
from meshshard.refs import BufferKind
from tests.parity import MODELS, check_parity


def residual_bytes(plan) -> int:
    """Bytes one micro-batch's residuals take, over every stage."""
    return sum(b.nbytes for b in plan.buffers if b.name.kind is BufferKind.RESIDUALS)


@pytest.mark.fast
def test_remat_setting_is_checked_and_printed():
    with pytest.raises(MeshshardInputError, match=r"PipeshardParallel.remat='dot'.*'dots'"):
        PipeshardParallel(num_micro_batches=2, remat="dot")
    assert "remat" not in repr(PipeshardParallel(num_micro_batches=2))
    assert "remat='dots'" in repr(PipeshardParallel(num_micro_batches=2, remat="dots"))


@pytest.mark.fast
def test_remat_keeps_fewer_residuals(threads_cluster):
    """On the GPT, ``dots`` keeps the matmul outputs only (under a third of the bytes),
    ``full`` only what enters each layer."""
    import meshshard

    module, model, batch = MODELS["gpt_small"]()
    state = module.make_state(model, batch["inputs"])
    sizes = {}
    for remat in (None, "dots", "full"):
        method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, remat=remat)
        step = meshshard.parallelize(module.train_step, method=method)
        sizes[remat] = residual_bytes(step.lower(state, batch))
    assert sizes["full"] < sizes["dots"] < sizes[None] / 3, sizes


@pytest.mark.parametrize("schedule,remat", [("1f1b", "dots"), ("zb_h1", "dots"), ("gpipe", "full")])
def test_remat_matches_single_device(threads_cluster, schedule, remat):
    method = PipeshardParallel(
        num_micro_batches=2, stages=[(1, 2)] * 2, schedule=schedule, remat=remat
    )
    step = check_parity("gpt_small", method, steps=2)
    if schedule == "zb_h1":  # the backward still splits into B and W
        assert {"s0.W", "s1.W"} <= {str(p.name) for p in step.plan.programs}


def test_remat_with_dropout_draws_what_jit_draws(threads_cluster):
    """A layer's dropout mask drawn again in its backward is the one its forward drew."""
    from tests.random_parity import check_step_parity, dropout_case

    step, state, batches = dropout_case("mlp")
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], remat="dots")
    check_step_parity(step, method, state, batches)


def test_remat_under_2bw_follows_the_2bw_rule(threads_cluster):
    """2BW's steady step (weights stashed, no flush) traces with the setting too."""
    from dataclasses import replace

    from tests.two_bw_reference import check_2bw

    method = PipeshardParallel(
        num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw", remat="dots"
    )
    steady = check_2bw(method, steps=3)._two_bw.steady.plan
    plain = check_2bw(replace(method, remat=None), steps=2)._two_bw.steady.plan
    assert residual_bytes(steady) < residual_bytes(plain)

"""Random keys and summed losses on real Ray host-actors (processes, gloo transfers)."""

import pytest

from meshshard import PipeshardParallel
from tests.random_parity import check_step_parity, dropout_case

pytestmark = pytest.mark.ray


def test_gpt_dropout_with_key_in_state_on_ray(ray_cluster):
    """Typed key in the state, split each step; the workers trace the keyed step themselves."""
    step, state, batches = dropout_case("gpt")
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)], schedule="1f1b")
    par = check_step_parity(step, method, state, batches)
    assert [m.hosts for m in par.plan.meshes] == [(0,), (1,)]


def test_a_float64_step_under_jax_enable_x64_runs_on_the_actors(ray_cluster):
    """The driver's ``jax_enable_x64`` reaches the host-actors with the compile: before,
    they traced float32 parameters and refused the plan as "a different program"."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import meshshard
    from meshshard import DataParallel

    jax.config.update("jax_enable_x64", True)
    try:
        tx = optax.adam(1e-3)

        def step(state, batch):
            params, opt_state = state

            def loss_fn(p):
                pred = jnp.tanh(batch["x"] @ p["w1"]) @ p["w2"]
                return jnp.mean((pred - batch["y"]) ** 2)

            loss, grads = meshshard.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), loss

        rng = np.random.default_rng(0)
        params = {"w1": rng.normal(size=(4, 16)), "w2": rng.normal(size=(16, 1))}
        batches = [{"x": rng.normal(size=(8, 4)), "y": rng.normal(size=(8, 1))} for _ in range(2)]
        state = (params, tx.init(params))
        par = check_step_parity(
            step, DataParallel(mesh_shape=(1, 2), num_micro_batches=2), state, batches, rtol=1e-12
        )
        got_state, loss = par(state, batches[0])
        assert loss.dtype == np.float64
        floats = {np.asarray(x).dtype for x in jax.tree.leaves(got_state)} - {np.dtype("int32")}
        assert floats == {np.dtype("float64")}  # (Adam's count is int32 under x64 too)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_a_python_float_hyperparameter_keeps_bfloat16_weights_bfloat16_on_ray(ray_cluster):
    """The weakly typed Python float reaches the host-actors' traces: bfloat16 weights
    stay bfloat16 through a two-stage pipeline, as under ``jax.jit``."""
    from tests.test_compile_reuse import check_bf16_sgd

    check_bf16_sgd(PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]))

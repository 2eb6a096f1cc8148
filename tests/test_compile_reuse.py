"""A step is traced and compiled once: workers reuse the driver's trace (or, in their own
process, a trace of the same planned fingerprint), and a Python-scalar leaf and the
array the step returns for it are one signature."""

import jax
import numpy as np

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.passes import trace as trace_mod
from tests.conftest import assert_trees_close


def counting_traces(monkeypatch) -> list:
    from collections import OrderedDict

    monkeypatch.setattr(trace_mod, "_TRACES", OrderedDict())  # nothing from earlier tests
    calls = []
    real = trace_mod._trace_step

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_mod, "_trace_step", counted)
    return calls


def test_workers_reuse_the_drivers_trace_and_a_scalar_step_counter_compiles_once(
    threads_cluster, monkeypatch
):
    calls = counting_traces(monkeypatch)
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=8)
    state = mlp.make_state(model, batch["x"], learning_rate=0.05)
    state = state.replace(step=0)  # a Python int, as TrainState.create gives
    assert type(state.step) is int
    step = meshshard.parallelize(
        mlp.train_step, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    ref, got = state, state
    for i in range(3):  # later calls pass the int32 array the step returned
        b = mlp.make_batch(batch_size=8, seed=i)
        ref, _ = jax.jit(mlp.train_step)(ref, b)
        got, _ = step(got, b)
    assert_trees_close(ref.params, got.params)
    assert len({id(e) for e in step._executables.values()}) == 1
    assert len(calls) == 1  # the driver's trace; both workers were served from it


def test_a_repeat_by_fingerprint_returns_the_same_trace_and_other_shapes_retrace(
    monkeypatch,
):
    calls = counting_traces(monkeypatch)
    model = mlp.MLP(num_layers=2)
    batch = mlp.make_batch(batch_size=8)
    state = mlp.make_state(model, batch["x"], learning_rate=0.05)

    def fresh_copy(*args):  # another function object: what a worker unpickles
        return mlp.train_step(*args)

    first = trace_mod.trace_step(
        mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=2
    )
    again = trace_mod.trace_step(
        fresh_copy,
        (state, batch),
        batch_argnums=(1,),
        num_micro_batches=2,
        fingerprint=first.fingerprint,
    )
    assert again is first and len(calls) == 1
    other = trace_mod.trace_step(
        mlp.train_step, (state, batch), batch_argnums=(1,), num_micro_batches=4
    )
    assert other.num_micro_batches == 4 and len(calls) == 2
    unknown = trace_mod.trace_step(
        fresh_copy, (state, batch), batch_argnums=(1,), num_micro_batches=2, fingerprint="0" * 16
    )
    assert unknown.fingerprint == first.fingerprint and len(calls) == 3


def test_a_second_parallelize_of_one_step_is_served_from_the_trace_and_keys_stay_typed(
    threads_cluster, monkeypatch
):
    """``lower`` then a call, and a second ``parallelize`` of the same function under
    another method with the same micro-batches, trace the step once; the step's typed
    key output comes back typed from every one of them."""
    from tests.random_parity import dropout_case

    calls = counting_traces(monkeypatch)
    step_fn, state, batches = dropout_case("mlp")
    want = jax.random.split(state.key)[0]
    first = meshshard.parallelize(
        step_fn, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    )
    first.lower(state, batches[0], costs=False)
    outs = [first(state, batches[0])[0]]
    second = meshshard.parallelize(
        step_fn,
        method=PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="gpipe"),
    )
    outs.append(second(state, batches[0])[0])
    assert len(calls) == 1
    for got in outs:
        assert got.key.dtype == state.key.dtype
        np.testing.assert_array_equal(jax.random.key_data(got.key), jax.random.key_data(want))
        assert_trees_close(outs[0].params, got.params)


def _weighted_step(weights):
    """A step closing over an array (held as a constant of its jaxpr, not in its text)."""
    import jax.numpy as jnp

    weights = jnp.asarray(weights, jnp.float32)

    def step(w, batch):
        def loss(w):
            h = jnp.tanh(batch["x"] * w)
            meshshard.mark_pipeline_boundary()
            return jnp.mean((h @ weights - batch["y"]) ** 2)

        value, grad = meshshard.value_and_grad(loss)(w)
        return w - 0.1 * grad, value

    return step


def test_steps_differing_only_in_a_closed_over_array_are_different_programs(threads_cluster):
    """Two steps from one factory (the same jaxpr text, other constant values) have
    different fingerprints; so a worker never serves one's trace for the other.  Before,
    after ``a``, ``b``, ``a`` the third call's workers ran ``b``'s constants (and on Ray
    every actor that had traced ``a`` ran ``a``'s for ``b``): silently wrong numbers."""
    w = np.ones(3, np.float32)
    batch = {"x": np.arange(24.0, dtype=np.float32).reshape(8, 3) / 10, "y": np.ones(8, np.float32)}
    a, b = _weighted_step([1.0, 2.0, 3.0]), _weighted_step([1.0, 2.0, 4.0])
    fps = {
        trace_mod.trace_step(f, (w, batch), batch_argnums=(1,), num_micro_batches=2).fingerprint
        for f in (a, b)
    }
    assert len(fps) == 2
    for method in (meshshard.DataParallel((1, 2)), PipeshardParallel(2, stages=[(1, 2)] * 2)):
        for f in (a, b, a):
            got = meshshard.parallelize(f, method=method)(w, batch)
            assert_trees_close(jax.jit(f)(w, batch), got)


BF16 = np.dtype(jax.numpy.bfloat16)


def bf16_sgd_step(state, batch):
    """Plain SGD on two bfloat16 layers, the learning rate a Python float in the state."""
    w, lr = state

    def loss_fn(w):
        h = jax.numpy.tanh(batch @ w["a"].astype(np.float32))
        meshshard.mark_pipeline_boundary()
        return jax.numpy.mean((h @ w["b"].astype(np.float32)) ** 2)

    loss, g = meshshard.value_and_grad(loss_fn)(w)
    return (jax.tree.map(lambda p, d: p - lr * d, w, g), lr), loss


def bf16_case():
    """bfloat16 weights, a Python-float learning rate, and two batches."""
    rng = np.random.default_rng(0)
    w = {
        k: jax.numpy.asarray(rng.normal(size=shape), jax.numpy.bfloat16)
        for k, shape in [("a", (8, 8)), ("b", (8, 4))]
    }
    return (w, 0.01), [rng.normal(size=(8, 8)).astype(np.float32) for _ in range(2)]


def check_bf16_sgd(method) -> None:
    """``lr * g`` with a Python float keeps bfloat16 weights bfloat16, as ``jax.jit``
    traces the float weakly; the weak learning rate the step returns is the same
    signature on the next call."""
    state, batches = bf16_case()
    step = meshshard.parallelize(bf16_sgd_step, method=method)
    ref, got = state, state
    for b in batches:
        ref, _ = jax.jit(bf16_sgd_step)(ref, b)
        got, _ = step(got, b)
        assert {x.dtype for x in jax.tree.leaves((got[0], ref[0]))} == {BF16}
        assert (got[1].dtype, got[1].weak_type) == (ref[1].dtype, ref[1].weak_type)
    assert_trees_close(
        jax.tree.map(lambda x: np.asarray(x, np.float32), ref[0]),
        jax.tree.map(lambda x: np.asarray(x, np.float32), got[0]),
        rtol=1e-2,  # bfloat16 gradients summed per micro-batch round otherwise
    )
    assert len({id(e) for e in step._executables.values()}) == 1


def test_a_python_float_hyperparameter_keeps_bfloat16_weights_bfloat16(threads_cluster):
    """Before, a Python float in the state was traced as a strong float32: the weights
    came back float32, doubling their memory and differing from ``jax.jit``."""
    check_bf16_sgd(meshshard.DataParallel(mesh_shape=(1, 2), num_micro_batches=2))

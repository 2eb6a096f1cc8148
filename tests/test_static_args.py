"""Static arguments (``parallelize(..., static_argnums=...)``, default ``"auto"``): the step
sees the Python value, each value compiles once, and the results equal ``jax.jit`` with
the same static arguments."""

import jax
import jax.numpy as jnp
import pytest

import meshshard
from examples import mlp
from meshshard import DataParallel, PipeshardParallel
from meshshard.errors import MeshshardInputError
from tests.conftest import assert_trees_close

PIPE = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def moded_step(state, batch, mode, scale):
    """A step that branches in Python on ``mode`` (a string) and ``scale`` (an int)."""

    def loss_fn(params):
        pred = state.apply_fn({"params": params}, batch["x"])
        err = pred - batch["y"]
        loss = jnp.mean(jnp.abs(err)) if mode == "l1" else jnp.mean(err**2)
        for _ in range(scale):  # Python control flow on a static int
            loss = loss * 2.0
        return loss

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def mode_first_step(mode, state, batch):
    return moded_step(state, batch, mode, 1)


def setup():
    model = mlp.MLP(num_layers=2)
    batch = mlp.make_batch(batch_size=8)
    return mlp.make_state(model, batch["x"]), batch


def reference(fn, *args, static=()):
    """The step under ``jax.jit`` (``meshshard.value_and_grad`` is ``jax.value_and_grad``
    outside a parallelized step)."""
    return jax.jit(fn, static_argnums=static)(*args)


@pytest.mark.parametrize("method", [DataParallel(mesh_shape=(1, 2)), PIPE], ids=["dp", "pipeshard"])
def test_static_values_compile_once_each_and_equal_jit(threads_cluster, method):
    state, batch = setup()
    step = meshshard.parallelize(moded_step, method=method, static_argnums=(2, 3))
    for mode, scale in [("l1", 1), ("l2", 2), ("l1", 1)]:
        got = step(state, batch, mode, scale)
        assert_trees_close(reference(moded_step, state, batch, mode, scale, static=(2, 3)), got)
    # ("l1", 1) was seen twice: two compiled steps
    assert len(step._variants) == 2
    assert all(len(v._executables) >= 1 for v in step._variants.values())


def test_static_argument_before_the_state_shifts_batch_and_donated_positions(threads_cluster):
    state, batch = setup()
    step = meshshard.parallelize(
        mode_first_step, method=PIPE, batch_argnums=(2,), donate_argnums=(1,)
    )
    ref = reference(mode_first_step, "l1", state, batch, static=(0,))
    got = step("l1", state, batch)
    assert_trees_close(ref, got)
    variant = step._variants[((0, "l1"),)]
    assert (variant.batch_argnums, variant.donate_argnums) == ((1,), (0,))
    plan = step.lower("l1", state, batch)
    assert plan.num_micro_batches == 2
    placement = step.placement("l1", state, batch, argnum=1)  # the state's layout
    assert jax.tree.structure(placement) == jax.tree.structure(state)


def test_negative_positions_count_from_the_end_of_the_whole_call(threads_cluster):
    """With static arguments after them, -3 and -4 name the batch and the state of
    ``moded_step(state, batch, mode, scale)``: counted among the arguments left once the
    statics were taken out, -3 was refused and -4 named no argument."""
    state, batch = setup()
    step = meshshard.parallelize(
        moded_step,
        method=PIPE,
        static_argnums=(2, 3),
        batch_argnums=(-3,),
        donate_argnums=(-4,),
    )
    got = step(state, batch, "l1", 2)
    assert_trees_close(reference(moded_step, state, batch, "l1", 2, static=(2, 3)), got)
    variant = step._variants[((2, "l1"), (3, 2))]
    assert (variant.batch_argnums, variant.donate_argnums) == ((1,), (0,))


def test_no_static_arguments_keeps_the_plain_path(threads_cluster):
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=DataParallel(mesh_shape=(1, 2)))
    assert_trees_close(reference(mlp.train_step, state, batch), step(state, batch))
    assert step._variants == {}


@pytest.mark.fast
def test_bad_static_arguments_are_refused_with_the_fix(threads_cluster):
    state, batch = setup()
    with pytest.raises(MeshshardInputError, match="static_argnums"):  # listed: not "auto"
        meshshard.parallelize(moded_step, static_argnums=(3,))(state, batch, "l1", 1)
    with pytest.raises(MeshshardInputError, match="not hashable"):
        meshshard.parallelize(moded_step, static_argnums=(2, 3))(state, batch, "l1", [1])
    with pytest.raises(MeshshardInputError, match="static_argnums names argument 7"):
        meshshard.parallelize(moded_step, static_argnums=(7,))(state, batch, "l1", 1)
    with pytest.raises(MeshshardInputError, match="batch_argnums"):
        meshshard.parallelize(moded_step, static_argnums=(1,))(state, batch, "l1", 1)
    with pytest.raises(MeshshardInputError, match="static_argnums must be"):
        meshshard.parallelize(moded_step, static_argnums="all")


def test_keyword_arguments_take_their_positions(threads_cluster):
    state, batch = setup()
    method = DataParallel(mesh_shape=(1, 2))
    step = meshshard.parallelize(moded_step, method=method, static_argnums=(2, 3))
    ref = reference(moded_step, state, batch, "l2", 1, static=(2, 3))
    assert_trees_close(ref, step(state, batch=batch, scale=1, mode="l2"))
    assert list(step._variants) == [((2, "l2"), (3, 1))]  # the keywords' positions

    def kw_only(state, batch, *, mode):
        return moded_step(state, batch, mode, 1)

    with pytest.raises(MeshshardInputError, match=r"\['mode'\].*keyword-only"):
        meshshard.parallelize(kw_only)(state, batch, mode="l1")
    with pytest.raises(MeshshardInputError, match="cannot call moded_step"):
        step(state, batch, "l1", 1, colour="red")


def test_a_jitted_step_keeps_its_own_static_arguments(threads_cluster):
    """A step already wrapped in ``jax.jit(..., static_argnames=...)`` (or
    ``static_argnums``) gets those arguments as Python values: before, ``scale`` was
    traced (an int is not "auto"-static) and jax.jit failed hashing the tracer
    ("Non-hashable static arguments are not supported")."""
    jitted = jax.jit(moded_step, static_argnames=("mode", "scale"))
    state, batch = setup()
    step = meshshard.parallelize(jitted, method=PIPE)
    for mode, scale in [("l1", 1), ("l2", 2)]:
        assert_trees_close(jitted(state, batch, mode, scale), step(state, batch, mode, scale))
    assert len(step._variants) == 2
    # a static first argument: the step with it bound takes (state, batch) and must not
    # read the jitted function's position 0 again (the state is not static)
    first = jax.jit(mode_first_step, static_argnums=(0,))
    step = meshshard.parallelize(first, method=PIPE, batch_argnums=(2,))
    assert_trees_close(first("l1", state, batch), step("l1", state, batch))
    assert list(step._variants) == [((0, "l1"),)]


def test_a_negative_batch_position_counts_from_the_end_as_in_jit(threads_cluster):
    """``batch_argnums=(-1,)`` ran the batch as state: no micro-batches, every device
    computing the whole batch. Now it names the last argument; one outside is refused."""
    batch = mlp.make_batch(8)
    state = mlp.make_state(mlp.MLP(num_layers=2), batch["x"])
    method = DataParallel(mesh_shape=(1, 2), num_micro_batches=2)
    step = meshshard.parallelize(mlp.train_step, method=method, batch_argnums=(-1,))
    got, _ = step(state, batch)
    assert {i.kind.value for i in step.plan.inputs if i.path.startswith("args[1]")} == {"batch"}
    assert_trees_close(jax.jit(mlp.train_step)(state, batch)[0].params, got.params)
    beyond = meshshard.parallelize(mlp.train_step, method=method, batch_argnums=(-3,))
    with pytest.raises(MeshshardInputError, match=r"batch_argnums=\(-3,\) names argument -3"):
        beyond(state, batch)

"""Bad input gives a clear error naming the problem and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import ClusterSpec, DataParallel, MeshshardInputError, PipeshardParallel

CLUSTER = ClusterSpec("errors-4x2", 4, 2)


@pytest.fixture(scope="module")
def setup():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    return model, batch, mlp.make_state(model, batch["x"])


def lower(step, method, *args):
    return meshshard.parallelize(step, method=method).lower(*args, cluster=CLUSTER)


def test_batch_not_divisible_by_micro_batches(setup):
    _, batch, state = setup
    with pytest.raises(
        MeshshardInputError,
        match=r"args\[1\]\['x'\] has 16 rows, not divisible by num_micro_batches=3.*"
        r"leading axis of every batch leaf, here of shape \(16, \d+\)",
    ):
        lower(
            mlp.train_step,
            PipeshardParallel(num_micro_batches=3, stages=[(1, 2), (1, 2)]),
            state,
            batch,
        )


def _class_weighted_step(state, batch):
    """The loss weights each example by a class weight carried in the batch dict."""

    def loss_fn(p):
        pred = state.apply_fn({"params": p}, batch["x"])
        w = batch["w"][jnp.arange(pred.shape[0]) % batch["w"].shape[0]]
        return jnp.mean(w[:, None] * (pred - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_batch_leaves_of_other_lengths(setup):
    """A 4-vector of class weights in the batch dict was cut into two 2-vectors like the
    examples, and the step returned another loss than jax.jit (2.77 for 2.62), silently;
    leaves that disagree with each other fail the trace, and were reported as JAX's
    broadcasting error.  Both are now named, with the fix."""
    _, batch, state = setup
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    weights = dict(batch, w=jnp.arange(1.0, 5.0))
    with pytest.raises(
        MeshshardInputError,
        match=r"different numbers of rows: args\[1\]\['w'\] \(4 rows\), while "
        r"args\[1\]\['x'\] has 16.*through a non-batch argument or a\s+closure, or run with num_micro_batches=1",
    ):
        lower(_class_weighted_step, method, state, weights)
    with pytest.raises(MeshshardInputError, match=r"args\[1\]\['y'\] \(8 rows\)") as err:
        lower(mlp.train_step, method, state, dict(batch, y=batch["y"][:8]))
    assert "incompatible shapes" in str(err.value.__cause__)  # JAX's error, kept as the cause
    lower(_class_weighted_step, DataParallel(mesh_shape=(1, 2)), state, weights)  # M=1: whole


def test_a_step_taking_the_batch_first_is_told_batch_argnums(setup):
    """``step(batch, state)`` under the default batch_argnums=(1,): the state was cut
    into micro-batches and the error named its leaves' row counts only."""
    _, batch, state = setup
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])

    def batch_first(batch, state):
        return mlp.train_step(state, batch)

    with pytest.raises(
        MeshshardInputError, match=r"if args\[1\] is not the batch, pass the batch's"
    ):
        lower(batch_first, method, batch, state)  # its step counter is a Python int
    with pytest.raises(
        MeshshardInputError, match=r"if args\[1\] is not the batch, pass the batch's"
    ):
        lower(batch_first, method, batch, state.replace(step=jnp.asarray(state.step)))  # a scalar

    def sgd_batch_first(batch, params):  # every state leaf an array, of several lengths
        def loss_fn(p):
            return jnp.mean((jnp.tanh(batch["x"] @ p["w"]) @ p["v"] - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    for hidden in (batch["x"].shape[1], 3):  # cut alike (the trace fails), or not (rows differ)
        params = {
            "w": jnp.zeros((batch["x"].shape[1], hidden)),
            "v": jnp.zeros((hidden, batch["y"].shape[1])),
        }
        with pytest.raises(
            MeshshardInputError,
            match=r"args\[0\]'s leaves all have 16 rows: if it is the batch, "
            r"pass batch_argnums=\(0,\)",
        ):
            lower(sgd_batch_first, method, batch, params)


def test_a_batch_in_two_arguments_names_both_argnums(setup):
    """``step(params, x, y)``: the default batch is the second argument only, so the
    labels were not cut; the hint said ``batch_argnums=(2,)``, which leaves the inputs
    whole instead of cutting both."""
    _, batch, _ = setup

    def step(params, x, y):
        def loss_fn(p):
            return jnp.mean((jnp.tanh(x @ p["w"]) @ p["v"] - y) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(params)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    params = {"w": jnp.zeros((batch["x"].shape[1], 3)), "v": jnp.zeros((3, batch["y"].shape[1]))}
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)])
    with pytest.raises(
        MeshshardInputError,
        match=r"args\[2\] has 16 rows, as the batch has: if the batch comes in several "
        r"arguments, pass batch_argnums=\(1, 2\)",
    ):
        lower(step, method, params, batch["x"], batch["y"])
    plan = meshshard.parallelize(step, method=method, batch_argnums=(1, 2)).lower(
        params, batch["x"], batch["y"], cluster=CLUSTER
    )
    assert plan.num_micro_batches == 2


def test_scalar_batch_leaf(setup):
    """Named before the model fails on it (Flax's Dense raised an IndexError)."""
    _, batch, state = setup
    with pytest.raises(MeshshardInputError, match=r"batch leaf args\[1\]\['x'\] is a scalar"):
        lower(mlp.train_step, DataParallel(mesh_shape=(1, 2)), state, dict(batch, x=jnp.float32(1)))


def test_more_stages_than_boundaries(setup):
    _, batch, state = setup
    with pytest.raises(
        MeshshardInputError,
        match=r"5 pipeline stages .* 3 pipeline boundaries allow at most 4 stages",
    ):
        lower(
            mlp.train_step,
            PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 5),
            state,
            batch,
        )


def test_several_stages_without_any_boundary():
    model = mlp.MLP(num_layers=1)
    batch = mlp.make_batch(batch_size=8)
    state = mlp.make_state(model, batch["x"])
    with pytest.raises(
        MeshshardInputError,
        match=r"no pipeline boundary: call meshshard.mark_pipeline_boundary\(\)",
    ):
        lower(
            mlp.train_step,
            PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
            state,
            batch,
        )


def test_meshshard_grad_inside_a_scan_is_named(setup):
    # gradients accumulated by hand over chunks: was "this step differentiates with
    # jax.grad or jax.value_and_grad ... instead of meshshard.grad", though it does not
    _, batch, state = setup

    def step(state, batch):
        chunks = jax.tree.map(lambda a: a.reshape(4, -1, *a.shape[1:]), batch)

        def add_chunk(acc, chunk):
            def loss_fn(p):
                pred = state.apply_fn({"params": p}, chunk["x"])
                return jnp.mean((pred - chunk["y"]) ** 2)

            return jax.tree.map(jnp.add, acc, meshshard.grad(loss_fn)(state.params)), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, _ = jax.lax.scan(add_chunk, zeros, chunks)
        return state.apply_gradients(grads=jax.tree.map(lambda g: g / 4, grads))

    with pytest.raises(
        MeshshardInputError,
        match=r"meshshard.grad is called inside the body of a jax.lax.scan, fori_loop or "
        r"nn.scan \(gradients accumulated by hand.*set num_micro_batches to the number of "
        r"chunks",
    ):
        lower(step, PipeshardParallel(num_micro_batches=1, stages=[(1, 2), (1, 2)]), state, batch)


def test_boundaries_only_inside_a_decode_loop_are_named():
    # was "the model has no pipeline boundary: call meshshard.mark_pipeline_boundary()",
    # though the model calls it: fori_loop's body (a scan) runs whole inside one stage
    model = mlp.MLP(num_layers=2)
    batch = mlp.make_batch(batch_size=8)
    params = mlp.make_state(model, batch["x"]).params

    def decode(params, x):
        def body(carry):  # a decode step, until a condition on the outputs holds
            i, h = carry
            return i + 1, h * jnp.mean(model.apply({"params": params}, h))

        return jax.lax.while_loop(lambda c: (c[0] < 3) & (jnp.max(c[1]) < 1e3), body, (0, x))[1]

    step = meshshard.parallelize(
        decode, method=PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 1)])
    )
    with pytest.raises(
        MeshshardInputError,
        match=r"boundaries are all inside the body of a jax.lax.fori_loop or while_loop "
        r".*loop in Python instead",
    ):
        step.lower(params, batch["x"], cluster=CLUSTER)


def test_more_devices_than_the_cluster_has(setup):
    _, batch, state = setup
    method = PipeshardParallel(num_micro_batches=2, stages=[(2, 2), (2, 2), (1, 2)])
    with pytest.raises(
        MeshshardInputError,
        match=r"the stages ask for meshes .* \(10 devices on 5 hosts\), but the cluster .* "
        "has 8 devices",
    ):
        lower(mlp.train_step, method, state, batch)


def test_a_mesh_wider_than_a_host_is_named_with_the_shape_that_fits(setup):
    """(1, 4) on hosts of 2 devices: the message says a shape is (hosts, devices per host)
    and offers (2, 2), not that 4 devices are more than the cluster's 8."""
    _, batch, state = setup
    with pytest.raises(
        MeshshardInputError,
        match=r"mesh shape\(s\) \[\(1, 4\)\] ask for more devices per host than the cluster "
        r".* has \(2\): a mesh shape is \(hosts, devices per host\); the same devices span "
        r"hosts as \(2, 2\) for \(1, 4\)",
    ):
        lower(mlp.train_step, DataParallel(mesh_shape=(1, 4)), state, batch)


def test_non_scalar_loss(setup):
    _, batch, state = setup

    def step(state, batch):
        grads = meshshard.grad(lambda p: state.apply_fn({"params": p}, batch["x"]))(state.params)
        return state.apply_gradients(grads=grads)

    with pytest.raises(
        MeshshardInputError, match=r"loss must be a scalar float, got float32\[16, 4\].*jnp.mean"
    ):
        lower(step, PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]), state, batch)


@pytest.mark.parametrize(
    "bad", ["a string", [1, 2], object()], ids=["str", "list-of-int", "object"]
)
def test_non_array_leaf_in_batch(setup, bad):
    _, batch, state = setup
    with pytest.raises(
        MeshshardInputError, match=r"batch leaf args\[1\]\['note'\].* is a \w+, not an array"
    ):
        lower(mlp.train_step, DataParallel(), state, {**batch, "note": bad})


@pytest.mark.parametrize("stages", [1, 2])
def test_a_result_that_is_not_an_array_is_named(setup, stages):
    # was JAX's TypeError: "function <unknown> traced for jit returned a value of type
    # <class 'str'> at output component [1], which is not a valid JAX type"
    _, batch, state = setup

    def tagged_step(state, batch):
        state, loss = mlp.train_step(state, batch)
        return state, {"loss": loss, "phase": "warmup", "ok": None}

    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * stages)
    with pytest.raises(
        MeshshardInputError,
        match=r"tagged_step returns values that are not arrays: out\[1\]\['phase'\] "
        r"\(type str\); .*outside the step",
    ):
        lower(tagged_step, method, state, batch)


def test_parallelize_of_something_not_callable():
    with pytest.raises(MeshshardInputError, match=r"got 3 \(type int\); pass a function"):
        meshshard.parallelize(3)
    with pytest.raises(MeshshardInputError, match=r"got 'train' \(type str\)"):
        meshshard.parallelize(method=DataParallel())("train")


def test_jax_grad_instead_of_meshshard_grad(setup):
    _, batch, state = setup

    def step(state, batch):
        import jax

        g = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, batch["x"]) ** 2))(
            state.params
        )
        return state.apply_gradients(grads=g)

    # without meshshard.grad the step holds a backward meshshard cannot pipeline:
    # micro-batches are refused with the fix; one micro-batch runs it (as jax.jit would)
    with pytest.raises(
        MeshshardInputError,
        match=r"differentiates with jax.grad or jax.value_and_grad .* compute the gradients "
        r"with meshshard.grad or meshshard.value_and_grad",
    ):
        lower(step, DataParallel(num_micro_batches=2), state, batch)
    plan = lower(step, DataParallel(), state, batch)
    assert any("jax.grad inside it is not pipelined" in n for n in plan.notes)


@pytest.mark.parametrize(
    "make,pattern",
    [
        (
            lambda: PipeshardParallel(num_micro_batches=0),
            r"num_micro_batches must be a positive int, got 0",
        ),
        (
            lambda: PipeshardParallel(num_micro_batches=2, stages=[(1, 2, 3)]),
            r"stages\[0\] must be a mesh shape",
        ),
        (
            lambda: PipeshardParallel(num_micro_batches=2, stages="best"),
            r"stages='best' is not understood; pass 'uniform', 'auto' or a list",
        ),
        (
            lambda: PipeshardParallel(num_micro_batches=2, schedule="zb"),
            r"schedule='zb' is not one of",
        ),
        (lambda: DataParallel(mesh_shape=(0, 2)), r"mesh_shape must be a mesh shape"),
    ],
)
def test_bad_methods(make, pattern):
    with pytest.raises(MeshshardInputError, match=pattern):
        make()


def test_numpy_integers_are_taken_as_ints(setup):
    # were refused: "num_micro_batches must be a positive int, got np.int64(2)"
    _, batch, state = setup
    n = np.int64(2)
    method = PipeshardParallel(
        num_micro_batches=n, stages=[(np.int32(1), n)] * 2, data_parallel=np.int64(1)
    )
    assert method == PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2)
    assert repr(method) == repr(PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2))
    assert type(method.num_micro_batches) is int and type(method.stages[0][1]) is int
    assert DataParallel((1, n), num_micro_batches=n) == DataParallel((1, 2), num_micro_batches=2)
    lower(mlp.train_step, method, state, batch)
    with pytest.raises(MeshshardInputError, match=r"num_micro_batches must be a positive int"):
        PipeshardParallel(num_micro_batches=2.0)


def test_calling_without_a_cluster(setup):
    from meshshard.runtime.cluster import use_cluster

    _, batch, state = setup
    with use_cluster(None):
        with pytest.raises(meshshard.MeshshardRuntimeError, match=r"call meshshard.init\(\) first"):
            meshshard.parallelize(mlp.train_step, method=DataParallel())(state, batch)


def test_cross_stage_update_is_planned_as_an_allreduce(setup):
    """Global-norm clipping across stages is no longer refused: the squared norm is a
    partial sum per mesh plus one cross-mesh all-reduce (tests/test_cross_stage.py)."""
    import optax
    from flax.training import train_state

    model, batch, _ = setup
    params = model.init(__import__("jax").random.PRNGKey(0), batch["x"])["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    plan = lower(
        mlp.train_step,
        PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        state,
        batch,
    )
    assert [r.op for r in plan.reductions] == ["sum"]


def test_multi_host_mesh_on_the_threads_backend_names_a_one_host_mesh(setup, threads_cluster):
    """ShardParallel() takes the whole 4 x 2 cluster as one mesh; the in-process backend
    cannot run a mesh over several hosts, and says which one-host mesh it could run."""
    _, batch, state = setup
    step = meshshard.parallelize(mlp.train_step, method=meshshard.ShardParallel())
    with pytest.raises(
        MeshshardInputError,
        match=r"mesh0 spans 4 hosts \(shape \(4, 2\)\).*mesh_shape=\(1, 2\)",
    ):
        step(state, batch)


def test_code_that_assumes_the_full_batch_size_is_named(setup):
    """The step traces at the full batch and fails at the micro-batch's size."""
    _, batch, state = setup

    def step(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((pred - batch["y"].reshape(16, -1)) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    with pytest.raises(
        MeshshardInputError,
        match=r"traces with the full batch but not with micro-batches .*"
        r"args\[1\]\['x'\] 16 -> 8(?s:.*)must read it from the arrays' shapes",
    ):
        lower(step, DataParallel(num_micro_batches=2), state, batch)


def test_a_batch_leaf_that_is_not_per_example_is_named(setup):
    """A per-feature vector in the batch dict traces at the full batch and fails at the
    micro-batch: that was a bare JAX broadcasting error from inside the trace, then an
    error after the micro-batch trace; its row count now names it before that trace."""
    _, batch, state = setup

    def step(state, batch):
        def loss_fn(params):
            pred = state.apply_fn({"params": params}, batch["x"] * batch["feature_w"])
            return jnp.mean((pred - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    feature_w = jnp.linspace(0.5, 1.5, batch["x"].shape[1])  # 8 features, 16 rows
    with pytest.raises(
        MeshshardInputError,
        match=r"different numbers of rows: args\[1\]\['feature_w'\] \(8 rows\)",
    ):
        lower(step, DataParallel(num_micro_batches=2), state, {**batch, "feature_w": feature_w})

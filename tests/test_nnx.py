"""A Flax NNX model: split into its graph and its parameters (``nnx.split``), merged
back inside the loss, differentiated with ``meshshard.value_and_grad``.  Its parameters
are an ``nnx.State`` pytree, and a ``mark_pipeline_boundary()`` in its ``__call__``
cuts it into stages as in a Linen model."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshshard
from meshshard.nnx_modules import LOST_NOTE
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from tests.random_parity import assert_results_close, check_step_parity

TX = optax.adamw(1e-2)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(8, 32, rngs=rngs)
        self.second = nnx.Linear(32, 32, rngs=rngs)
        self.norm = nnx.LayerNorm(32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.first(x))
        meshshard.mark_pipeline_boundary()
        return self.head(self.norm(nnx.relu(self.second(x))))


GRAPH, PARAMS, REST = nnx.split(MLP(nnx.Rngs(0)), nnx.Param, ...)


def nnx_step(state, batch):
    params, opt_state = state

    def loss_fn(params):
        model = nnx.merge(GRAPH, params, REST)
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


@pytest.mark.parametrize(
    "method, stages",
    [
        (meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]), 2),
        (meshshard.ShardParallel((1, 2)), 1),
    ],
    ids=["pipeline", "shard"],
)
def test_an_nnx_model_trains_equal_to_jit(method, stages):
    rng = np.random.default_rng(0)
    batch = {
        "x": rng.standard_normal((16, 8)).astype(np.float32),
        "y": rng.standard_normal((16, 4)).astype(np.float32),
    }
    state = (PARAMS, TX.init(PARAMS))
    with use_cluster(ThreadsCluster(4, 2)):
        step = check_step_parity(nnx_step, method, state, [batch, batch], rtol=1e-4)
    assert len(step.plan.stages) == stages


class DropoutNet(nnx.Module):
    """Dropout drawing from the module's own ``nnx.Rngs`` (a key and a counter it
    advances), and optionally a batch norm (running statistics it writes)."""

    def __init__(self, rngs: nnx.Rngs, norm: bool = False):
        self.first = nnx.Linear(8, 32, use_bias=not norm, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs) if norm else None
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.second = nnx.Linear(32, 32, rngs=rngs)
        self.head = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        x = self.first(x)
        x = nnx.relu(self.norm(x) if self.norm is not None else x)
        meshshard.mark_pipeline_boundary()
        return self.head(self.drop(nnx.relu(self.second(x))))


def idiomatic_step(value_and_grad):
    """The train step of Flax's NNX guide: modules and optimizer as pytree arguments,
    the optimizer updating the model in place; only ``value_and_grad`` differs."""

    def step(state, batch):
        model, optimizer = state

        def loss_fn(model):
            err = model(batch["x"]) - batch["y"]
            return jnp.mean(err**2), {"max_err": jnp.max(jnp.abs(err))}

        (loss, aux), grads = value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return (model, optimizer), (loss, aux)

    return step


def _nnx_batches():
    rng = np.random.default_rng(1)
    return [
        {
            "x": rng.standard_normal((16, 8)).astype(np.float32),
            "y": rng.standard_normal((16, 4)).astype(np.float32),
        }
        for _ in range(2)
    ]


def _fresh(norm: bool):
    model = DropoutNet(nnx.Rngs(0), norm=norm)
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def _run_beside(ref_step, par, fresh, batches):
    """Run ``ref_step`` and ``par`` on fresh states over ``batches``, checking each
    step's states and results equal; returns ``par``'s last state."""
    ref, got = fresh(), fresh()
    with use_cluster(ThreadsCluster(4, 2)):
        for batch in batches:
            ref, ref_out = ref_step(ref, batch)
            got, got_out = par(got, batch)
            assert_results_close((ref, ref_out), (got, got_out), rtol=1e-4)
    return got


PIPELINE_AND_DATA = pytest.mark.parametrize(
    "method",
    [
        meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
        meshshard.DataParallel(num_micro_batches=2, mesh_shape=(1, 2)),
    ],
    ids=["pipeline", "data"],
)


@pytest.mark.parametrize(
    "method, norm",
    [
        (meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]), False),
        (meshshard.DataParallel(num_micro_batches=2, mesh_shape=(1, 2)), False),
        (meshshard.PipeshardParallel(num_micro_batches=1, stages=[(1, 2), (1, 2)]), True),
    ],
    ids=["pipeline-dropout", "data-dropout", "pipeline-batchnorm"],
)
def test_an_nnx_step_with_meshshard_value_and_grad_equals_nnx_value_and_grad(method, norm):
    """``meshshard.value_and_grad`` takes the module as ``nnx.value_and_grad`` does: its
    ``nnx.Param`` variables are differentiated, and the variables the loss writes (the
    dropout stream's counter, the batch norm's running statistics) reach the module.
    Before, the random counter (uint32) was differentiated: "grad requires real- or
    complex-valued inputs"."""
    ref_step = jax.jit(idiomatic_step(nnx.value_and_grad))
    par = meshshard.parallelize(idiomatic_step(meshshard.value_and_grad), method=method)
    got = _run_beside(ref_step, par, lambda: _fresh(norm), _nnx_batches())
    counts = [v for p, v in nnx.to_flat_state(nnx.state(got[0])) if p[-1] == "count"]
    assert counts and all(int(c.get_value()) == 2 for c in counts)  # two steps' draws
    if norm:
        mean = np.asarray(got[0].norm.mean.get_value())
        assert np.abs(mean).max() > 0  # the running mean moved from its zeros


def test_nnx_value_and_grad_under_a_pipeline_names_meshshard_value_and_grad():
    par = meshshard.parallelize(
        idiomatic_step(nnx.value_and_grad),
        method=meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)]),
    )
    with use_cluster(ThreadsCluster(4, 2)):
        with pytest.raises(meshshard.MeshshardInputError, match="nnx.value_and_grad") as e:
            par(_fresh(False), _nnx_batches()[0])
    assert "meshshard.value_and_grad takes an NNX module the same way" in str(e.value)


class Classifier(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(8, 32, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(32, 5, rngs=rngs)

    def __call__(self, x):
        x = self.drop(nnx.relu(self.first(x)))
        meshshard.mark_pipeline_boundary()
        return self.head(x)


def guide_step(value_and_grad):
    """The Flax NNX guide's ``nnx.jit`` train step: model, optimizer and metrics updated
    in place, nothing returned."""

    def loss_fn(model, batch):
        logits = model(batch["x"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, logits

    def train_step(model, optimizer, metrics, batch):
        (loss, logits), grads = value_and_grad(loss_fn, has_aux=True)(model, batch)
        metrics.update(loss=loss, logits=logits, labels=batch["label"])
        optimizer.update(model, grads)

    return train_step


def _guide_objects():
    model = Classifier(nnx.Rngs(0))
    metrics = nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss"))
    return model, nnx.Optimizer(model, TX, wrt=nnx.Param), metrics


@PIPELINE_AND_DATA
def test_the_nnx_guide_step_updating_in_place_equals_nnx_jit(method):
    """Its changes reach the caller's objects as under ``nnx.jit``; the metrics count the
    whole batch.  Before, the changes were lost (the model never trained), and with
    micro-batches the accuracy's count took the micro-batch's size and its total 1/M of
    the correct answers."""
    rng = np.random.default_rng(2)
    batches = [
        {
            "x": rng.standard_normal((16, 8)).astype(np.float32),
            "label": rng.integers(0, 5, 16).astype(np.int32),
        }
        for _ in range(2)
    ]
    ref_step = nnx.jit(guide_step(nnx.value_and_grad))
    par = meshshard.parallelize(
        guide_step(meshshard.value_and_grad), method=method, batch_argnums=(3,)
    )
    ref, got = _guide_objects(), _guide_objects()
    with use_cluster(ThreadsCluster(4, 2)):
        for batch in batches:
            assert ref_step(*ref, batch) is None and par(*got, batch) is None
    for a, b in zip(ref, got, strict=True):
        assert_results_close(nnx.state(a), nnx.state(b), rtol=1e-4)
    counts = [
        int(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(got[2])) if p[-1] == "count"
    ]
    assert counts == [32, 2]  # examples seen by the accuracy, updates of the mean loss


def test_under_2bw_a_step_updating_modules_in_place_is_warned(caplog):
    """2BW's steps return the weight stash beside the results, so nothing is written
    back there: the warning names the modules whose changes are lost."""

    def train_step(model, optimizer, batch):
        def loss_fn(model):
            return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshshard.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    method = meshshard.PipeshardParallel(
        num_micro_batches=2, stages=[(1, 2), (1, 2)], schedule="2bw"
    )
    par = meshshard.parallelize(train_step, method=method, batch_argnums=(2,))
    with use_cluster(ThreadsCluster(4, 2)), caplog.at_level(logging.WARNING, "meshshard"):
        par(*_fresh(False), _nnx_batches()[0])
    warned = [r.getMessage() for r in caplog.records if LOST_NOTE in r.getMessage()]
    assert warned and "args[1] (Optimizer, " in warned[0] and "schedule='2bw'" in warned[0]


class Half(nnx.Module):
    def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
        self.linear = nnx.Linear(din, dout, rngs=rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.drop(nnx.relu(self.linear(x)))


def pair_step(value_and_grad):
    """An encoder and a decoder differentiated together, passed as one tuple argument."""

    def step(state, batch):
        (encoder, decoder), optimizers = state

        def loss_fn(pair):
            encoder, decoder = pair
            code = encoder(batch["x"])
            meshshard.mark_pipeline_boundary()
            return jnp.mean((decoder(code) - batch["y"]) ** 2)

        loss, (g_enc, g_dec) = value_and_grad(loss_fn)((encoder, decoder))
        optimizers[0].update(encoder, g_enc)
        optimizers[1].update(decoder, g_dec)
        return ((encoder, decoder), optimizers), loss

    return step


def test_modules_inside_a_tuple_argument_are_taken_as_nnx_value_and_grad_does():
    def fresh():
        rngs = nnx.Rngs(0)
        pair = (Half(8, 32, rngs), Half(32, 4, rngs))
        return pair, tuple(nnx.Optimizer(m, TX, wrt=nnx.Param) for m in pair)

    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    ref_step = jax.jit(pair_step(nnx.value_and_grad))
    par = meshshard.parallelize(pair_step(meshshard.value_and_grad), method=method)
    _run_beside(ref_step, par, fresh, _nnx_batches())
    assert len(par.plan.stages) == 2


def teacher_step(value_and_grad):
    """Distillation: the student differentiated, a teacher with live dropout only read;
    the teacher's random counter advances in both."""

    def step(state, batch):
        student, teacher, optimizer = state

        def loss_fn(student, teacher):
            target = jax.lax.stop_gradient(teacher(batch["x"]))
            return jnp.mean((student(batch["x"]) - target) ** 2)

        loss, grads = value_and_grad(loss_fn)(student, teacher)
        optimizer.update(student, grads)
        return (student, teacher, optimizer), loss

    return step


@PIPELINE_AND_DATA
def test_a_module_the_loss_only_reads_keeps_its_written_variables(method):
    """Before, the teacher's dropout counter was not written back: from the second step
    on, its masks differed from nnx.value_and_grad's."""

    def fresh():
        student, teacher = DropoutNet(nnx.Rngs(0)), DropoutNet(nnx.Rngs(5))
        return student, teacher, nnx.Optimizer(student, TX, wrt=nnx.Param)

    ref_step = jax.jit(teacher_step(nnx.value_and_grad))
    par = meshshard.parallelize(teacher_step(meshshard.value_and_grad), method=method)
    _run_beside(ref_step, par, fresh, _nnx_batches())


def test_placement_and_restore_of_an_nnx_state(tmp_path):
    """``step.placement`` of NNX arguments names the layout the write-back variant runs
    them in, and a checkpoint restores into it (the model's ``nnx.Rngs`` key included);
    training then continues as without the checkpoint.  Before, placement raised
    "'WritesBack' object has no attribute 'statics'"."""
    method = meshshard.PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
    par = meshshard.parallelize(idiomatic_step(meshshard.value_and_grad), method=method)
    batches = _nnx_batches()
    with use_cluster(ThreadsCluster(4, 2)):
        whole = _fresh(False)
        for batch in batches:
            whole, _ = par(whole, batch)
        half, _ = par(_fresh(False), batches[0])
        meshshard.save(tmp_path / "c", half)
        back = meshshard.restore(tmp_path / "c", like=par.placement(_fresh(False), batches[0]))
        back, _ = par(back, batches[1])
    assert_results_close(nnx.state(whole[0]), nnx.state(back[0]), rtol=1e-6)

"""Steps whose loss runs layers it is not differentiated through: a distillation teacher
under ``jax.lax.stop_gradient`` inside the loss function, an input-gradient penalty
(``jax.grad`` with respect to the inputs, inside the loss), an adversarial example made
before the grad.  The teacher's boundaries had no backward mirror and every such step
was refused ("pipeline boundaries [0, 1] have no backward mirror"), under every method.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshshard
from meshshard import DataParallel, PipeshardParallel
from tests.random_parity import check_step_parity


class Net(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.relu(nn.Dense(self.width)(x))
            meshshard.mark_pipeline_boundary()
        return nn.Dense(10)(x)


STUDENT, TEACHER = Net(32), Net(64)
TX = optax.adam(1e-2)


def _ce(params, x, y):
    logits = STUDENT.apply({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _update(state, loss, grads):
    params, opt, teacher = state
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt, teacher), loss


def distill_step(state, batch):
    """The teacher runs inside the loss function, its logits under stop_gradient."""
    params, _, teacher = state

    def loss_fn(p):
        t = TEACHER.apply({"params": teacher}, batch["x"])
        t = jax.lax.stop_gradient(t)
        s = STUDENT.apply({"params": p}, batch["x"])
        kd = optax.kl_divergence(jax.nn.log_softmax(s / 2.0), jax.nn.softmax(t / 2.0)).mean()
        return 0.5 * kd + 0.5 * _ce(p, batch["x"], batch["y"])

    return _update(state, *meshshard.value_and_grad(loss_fn)(params))


def gradient_penalty_step(state, batch):
    """WGAN-GP's penalty: the norm of each example's output gradient with respect to its
    input, taken with jax.grad inside the loss function."""
    params = state[0]

    def loss_fn(p):
        def out(x):
            return STUDENT.apply({"params": p}, x[None]).sum()

        gx = jax.vmap(jax.grad(out))(batch["x"])
        penalty = jnp.mean((jnp.sqrt(jnp.sum(gx**2, -1) + 1e-12) - 1.0) ** 2)
        return _ce(p, batch["x"], batch["y"]) + 0.1 * penalty

    return _update(state, *meshshard.value_and_grad(loss_fn)(params))


def adversarial_step(state, batch):
    """FGSM adversarial training: the inputs moved along the sign of their gradient
    (jax.grad before the grad), then trained on."""
    params = state[0]
    gx = jax.grad(_ce, argnums=1)(params, batch["x"], batch["y"])
    x_adv = batch["x"] + 0.1 * jnp.sign(gx)
    loss, grads = meshshard.value_and_grad(lambda p: _ce(p, x_adv, batch["y"]))(params)
    return _update(state, loss, grads)


def _case():
    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.standard_normal((16, 32)).astype(np.float32),
            "y": rng.integers(0, 10, 16).astype(np.int32),
        }
        for _ in range(2)
    ]
    student = STUDENT.init(jax.random.key(0), batches[0]["x"])["params"]
    teacher = TEACHER.init(jax.random.key(1), batches[0]["x"])["params"]
    return (student, TX.init(student), teacher), batches


THREE_STAGES = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 3)


@pytest.mark.parametrize(
    "method",
    [
        THREE_STAGES,
        PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 3, schedule="zb_h1"),
        DataParallel(mesh_shape=(1, 2), num_micro_batches=2),
    ],
    ids=["1f1b", "zb_h1", "dp"],
)
def test_a_teacher_under_stop_gradient_equals_jit(threads_cluster, method):
    """The teacher's two boundaries carry nothing the loss is differentiated through:
    they mark no stage (the plan says so), and the student's two cut the stages."""
    state, batches = _case()
    par = check_step_parity(distill_step, method, state, batches)
    plan = par.plan
    note = [n for n in plan.notes if "carry no value the loss is differentiated" in n]
    assert note and note[0].startswith("2 pipeline boundaries inside meshshard.grad")
    if isinstance(method, PipeshardParallel):
        assert len(plan.stages) == 3


@pytest.mark.parametrize("step", [gradient_penalty_step, adversarial_step])
def test_input_gradients_in_the_step_equal_jit(threads_cluster, step):
    state, batches = _case()
    check_step_parity(step, THREE_STAGES, state, batches)


def test_a_step_without_detached_layers_has_no_such_note():
    state, batches = _case()
    par = meshshard.parallelize(adversarial_step, method=THREE_STAGES)
    plan = par.lower(state, batches[0], cluster=meshshard.ClusterSpec("d-4x2", 4, 2))
    assert not [n for n in plan.notes if "differentiated through" in n]


class InputFirst(nn.Module):
    """A first layer without weights: the input one-hot encoded and scaled (or a frozen
    feature extractor), marked as a layer of its own."""

    @nn.compact
    def __call__(self, tokens):
        x = jax.nn.one_hot(tokens, 12) / jnp.sqrt(12.0)
        meshshard.mark_pipeline_boundary()
        for _ in range(2):
            x = jnp.tanh(nn.Dense(16)(x))
            meshshard.mark_pipeline_boundary()
        return nn.Dense(12)(x)


def _input_first_case():
    rng = np.random.default_rng(1)
    batches = [
        {
            "x": rng.integers(0, 12, (8, 5)).astype(np.int32),
            "y": rng.integers(0, 12, (8, 5)).astype(np.int32),
        }
        for _ in range(2)
    ]
    params = InputFirst().init(jax.random.key(0), batches[0]["x"])["params"]
    return (params, TX.init(params)), batches


def input_first_step(state, batch):
    params, opt = state

    def loss_fn(p):
        logits = InputFirst().apply({"params": p}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = meshshard.value_and_grad(loss_fn)(params)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), loss


def test_a_first_layer_without_weights_equals_jit(threads_cluster):
    """Its boundary carries a value the loss needs but no weight reaches, so it had no
    backward mirror and the step was refused ("pipeline boundaries [0] have no backward
    mirror: the values crossing them do not influence the loss")."""
    state, batches = _input_first_case()
    par = check_step_parity(input_first_step, THREE_STAGES, state, batches)
    note = [n for n in par.plan.notes if "carries no value the loss is differentiated" in n]
    assert note and note[0].startswith("1 pipeline boundary inside meshshard.grad")


def test_too_few_stages_for_detached_boundaries_says_which_cut_nothing():
    state, batches = _input_first_case()
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    par = meshshard.parallelize(input_first_step, method=method)
    with pytest.raises(
        meshshard.MeshshardInputError,
        match=r"at most 3 stages.*\(the step's 1 pipeline boundary inside meshshard.grad "
        r"carries no value the loss is differentiated through",
    ):
        par.lower(state, batches[0], cluster=meshshard.ClusterSpec("d-4x2", 4, 2))

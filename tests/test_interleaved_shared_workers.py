"""Interleaved 1F1B runs several chunks (logical meshes) on one worker: what joins them.

A value one chunk hands to a later chunk on the same mesh is read in place (a local
transfer), and an all-reduce of the update (``optax.clip_by_global_norm``'s norm, a tied
weight's gradient sum) takes each worker's chunks' partials combined, once per worker.
Both were broken: the first refused by the resharding planner, the second emitted two
``COLL``/``WAIT``/``FREE`` per worker for one buffer (IR check failures).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import meshshard
from examples import gpt, mlp
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.instructions import Collective
from meshshard.sim import simulate
from meshshard.verify import verify
from tests.random_parity import check_step_parity

INTERLEAVED = PipeshardParallel(
    num_micro_batches=4, stages=[(1, 2)] * 2, schedule="interleaved_1f1b", virtual_stages=2
)
CLIPPED = optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(0.1))


def _mlp_case():
    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=8, seed=i) for i in range(2)]
    params = model.init(jax.random.key(0), batches[0]["x"])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=CLIPPED)
    return state, batches


def test_global_norm_clipping_equals_jit(threads_cluster):
    state, batches = _mlp_case()
    par = check_step_parity(mlp.train_step, INTERLEAVED, state, batches)
    (r,) = par.plan.reductions
    assert r.group == (0, 1) and r.leaders == (0, 1)  # each worker once, chunks 0+2, 1+3
    for stream in par.plan.streams:
        colls = [i for i in stream.instructions if isinstance(i, Collective)]
        assert len(colls) == 1  # one contribution per worker: its chunks' partials combined


def test_the_clipped_interleaved_plan_verifies_and_simulates():
    state, batches = _mlp_case()
    step = meshshard.parallelize(mlp.train_step, method=INTERLEAVED)
    plan = step.lower(state, batches[0], cluster=ClusterSpec("interleaved-4x2", 4, 2), costs=True)
    assert verify(plan) == []
    result = simulate(plan)
    assert result.iteration_time > 0


class TiedLM(nn.Module):
    """Token embedding, four tanh layers (a boundary after each but the last), and the
    embedding again as the output head."""

    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(32, 16)
        x = embed(tokens)
        for i in range(4):
            x = jnp.tanh(nn.Dense(16, name=f"dense{i}")(x))
            if i < 3:
                meshshard.mark_pipeline_boundary()
        return embed.attend(x)


def tied_step(state, batch):
    def loss_fn(p):
        logits = state.apply_fn({"params": p}, batch["inputs"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]))

    loss, grads = meshshard.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_a_tied_embedding_equals_jit(threads_cluster):
    """The embedding's gradient is summed over chunk 0 and chunk 3 in the update: an
    all-reduce over every chunk's mesh, two of them on each worker."""
    batches = [gpt.make_batch(batch_size=8, seq_len=8, vocab=32, seed=i) for i in range(2)]
    params = TiedLM().init(jax.random.key(0), batches[0]["inputs"])["params"]
    tx = optax.sgd(0.1)
    state = train_state.TrainState.create(apply_fn=TiedLM().apply, params=params, tx=tx)
    par = check_step_parity(tied_step, INTERLEAVED, state, batches)
    assert any("shared parameter" in n for n in par.plan.notes)

"""Shared (tied) parameters: the copy reaches the other stages once per step, and each
stage's gradient contribution is accumulated locally and sent once per step."""

import jax
import optax
import pytest

import meshshard
from meshshard import ClusterSpec, PipeshardParallel
from meshshard.instructions import Collective, Send
from meshshard.refs import CollectiveKind, Phase
from meshshard.verify import verify
from tests.test_cross_stage import check, gpt_setup

pytestmark = pytest.mark.slow  # each test compiles and runs a pipelined model

CLUSTER = ClusterSpec("golden-4x2", 4, 2)
WTE = "args[0].params['wte']['embedding']"
WTE_BYTES = 64 * 32 * 4  # vocab x d_model, f32


def wire_bytes(plan, transfer_names) -> int:
    """Bytes the plan's streams put on the wire for the given transfers in one step."""
    total = 0
    for stream in plan.streams:
        for ins in stream.instructions:
            if getattr(ins, "transfer", None) not in transfer_names:
                continue
            sent = isinstance(ins, Send) or (
                isinstance(ins, Collective)
                and ins.kind is CollectiveKind.BROADCAST
                and ins.root == stream.worker
            )
            if sent:
                total += plan.transfer(ins.transfer).messages[ins.message].nbytes
    return total


def tied_plan(m: int, stages: int = 4):
    state, batches, train_step = gpt_setup(optax.adam(1e-2), tied=True)
    method = PipeshardParallel(num_micro_batches=m, stages=[(1, 2)] * stages)
    return meshshard.parallelize(train_step, method=method).lower(
        state, batches(0), cluster=CLUSTER
    )


def test_tied_copy_and_gradient_cross_stages_once_per_step():
    m = 4  # per micro-batch, each would cross 4 times
    plan = tied_plan(m)
    assert verify(plan) == []
    wte_sized = [t for t in plan.transfers if t.tensor.shape == (64, 32)]
    copy = [t for t in wte_sized if t.tensor.name == WTE]
    grad = [t for t in wte_sized if t.tensor.name != WTE]
    # the copy: stage 0's forward -> stage 3's forward; the gradient: stage 3's
    # accumulated contribution moves in the update to the owner's mesh, before its update
    assert [(str(t.producer), str(t.consumer)) for t in copy] == [("s0.F", "s3.F")]
    assert len(grad) == 1 and grad[0].src_mesh == 3 and grad[0].dst_mesh == 0
    assert grad[0].producer.phase is Phase.APPLY and grad[0].consumer.phase is Phase.APPLY
    # nothing wte-sized crosses stages per micro-batch: one copy + one gradient per step
    assert wire_bytes(plan, {copy[0].name}) == WTE_BYTES
    assert wire_bytes(plan, {grad[0].name}) == WTE_BYTES
    text = str(plan)
    # read in place (the last stage runs its forward and backward as one program)
    assert f"RUN s3.FB mb{m - 1} (P3 X3@{m - 1} {copy[0].name}@0" in text
    note = next(n for n in plan.notes if n.startswith(f"shared parameter {WTE}"))
    assert "(once per step)" in note and "summed on stage 0 once per step" in note


def test_tied_gradient_sums_match_jit(threads_cluster):
    """The per-stage gradient contributions summed once per step equal jax.grad's."""
    state, batches, _ = gpt_setup(optax.sgd(0.1), tied=True)

    def grads_step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["inputs"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

        return meshshard.value_and_grad(loss_fn)(state.params)

    jax_step = jax.jit(lambda s, b: jax.value_and_grad(_loss(s, b))(s.params))
    method = PipeshardParallel(num_micro_batches=4, stages=[(1, 2)] * 4)
    got = meshshard.parallelize(grads_step, method=method)(state, batches(0))
    from tests.conftest import assert_trees_close

    assert_trees_close(jax_step(state, batches(0)), got)


def _loss(state, batch):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return loss_fn


@pytest.mark.parametrize("stages", [4])  # the two-stage tied GPT: test_cross_stage
def test_tied_gpt_clip_adamw_matches_jit(threads_cluster, stages):
    """chain(clip_by_global_norm, adamw) on the tied GPT, 3 steps, within 1e-5 of jax.jit.

    Adam's eps is 1e-6 here.  With the default 1e-8 a few entries (of ``wpe`` and the MLP
    biases) have gradients of ~1e-9, at the rounding noise of any summation order, and
    Adam's first steps turn them into updates of up to ``lr``: there jax.jit of the
    full batch and jax.jit of the same step with a plain 2-micro-batch gradient
    accumulation already differ by 5.2e-5 (and jax.jit differs from a float64 Adam step
    on float64 gradients by 3.8e-5 on ``wpe``); the gradients themselves agree within
    1e-6 (the test above).  With eps=1e-6 both differences fall to 2-4e-6.
    """
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2, eps=1e-6))
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * stages)
    step = check(gpt_setup(tx, tied=True), method)
    assert step.plan.reductions  # the clip's global norm: a cross-mesh all-reduce


def test_the_owner_hands_over_the_parameter_itself_not_a_copy_per_micro_batch():
    """The owner's forward returned the shared parameter as an output on every
    micro-batch (an XLA copy each time, though it crosses once per step); the program now
    hands back the input array itself, and computes the same outputs otherwise."""
    import numpy as np

    from meshshard.passes.trace import trace_step
    from meshshard.runtime.programs import build_programs, group_contents, make_mesh

    state, batches, train_step = gpt_setup(optax.adam(1e-2), tied=True)
    plan = tied_plan(4)
    traced = trace_step(train_step, (state, batches(0)), batch_argnums=(1,), num_micro_batches=4)
    mesh = make_mesh(jax.devices()[:2], plan.meshes[0].axis_shape)
    progs = build_programs(traced, plan, 0, mesh)
    forward = progs[next(p.name for p in plan.programs if str(p.name) == "s0.F")]
    copy = next(t for t in plan.transfers if t.tensor.name == WTE)
    out_vars = [v for g in forward.output_groups for v in group_contents(plan, g).vars]
    in_vars = [v for g in forward.input_groups for v in group_contents(plan, g).vars]
    assert [(out_vars[j], in_vars[i]) for j, i in forward.passed] == [(copy.tensor.var,) * 2]
    # run it on stand-in inputs: the copy is the input array; the rest equals jax.jit's
    rng = np.random.default_rng(0)
    by_id = {i: v for v, i in jax_var_ids(traced).items()}
    groups = [
        tuple(
            jax.device_put(rng.standard_normal(by_id[v].aval.shape).astype(by_id[v].aval.dtype))
            if np.issubdtype(by_id[v].aval.dtype, np.floating)
            else jax.numpy.zeros(by_id[v].aval.shape, by_id[v].aval.dtype)
            for v in group_contents(plan, g).vars
        )
        for g in forward.input_groups
    ]
    got = [a for g in forward(groups) for a in g]
    flat_in = [a for g in groups for a in g]
    j, i = forward.passed[0]
    assert got[j] is flat_in[i]
    whole = jax.jit(forward.fn.__wrapped__.__wrapped__)(*flat_in)  # jit(drop(program))
    assert len(whole) == len(got)
    for a, b in zip(whole, got, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def jax_var_ids(traced):
    from meshshard.jaxpr_util import var_ids

    return var_ids(traced.jaxpr)

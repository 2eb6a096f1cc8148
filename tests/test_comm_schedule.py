"""Communication scheduling (TriRace): the pass, the admission rule, the replicated
synthetic plans it schedules, sparse embedding gradients, and bit-identical training."""

from collections import Counter
from itertools import combinations

import jax
import numpy as np
import pytest

import meshshard
from examples import gpt
from meshshard import PipeshardParallel
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.instructions import Collective, Recv, Run, Send, Wait
from meshshard.passes.comm_schedule import (
    COMM_SWITCHES,
    PRIORITY,
    SparseGrad,
    admit,
    schedule_comm,
    sparse_is_cheaper,
)
from meshshard.passes.schedules import make_schedule
from meshshard.refs import BufferKind, BufferRef, Phase
from meshshard.sim.dp_plans import replicate, sparse_grads
from meshshard.sim.engine import SimOptions
from meshshard.sim.schedule_plans import StageCosts, schedule_plan
from meshshard.sim.simulator import simulate
from meshshard.sparse_grads import densify, to_rows
from meshshard.verify import verify

ALL_SETS = [frozenset(c) for n in range(5) for c in combinations(COMM_SWITCHES, n)]


def dp_plan(schedule="2bw", S=2, M=4, d=2):
    base = schedule_plan(make_schedule(schedule, S, M), StageCosts(3e12, 3e12, 0, 32 << 20))
    cluster = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=S * d)
    return replicate(
        base, d, bucket_bytes=[64 << 20] * 4, embed={0: (200 << 20, 8 << 20)}, cluster=cluster
    )


@pytest.fixture(scope="module")
def plan2bw():
    return dp_plan()


@pytest.mark.fast
def test_bad_switches_are_named():
    with pytest.raises(MeshshardInputError, match=r"unknown switches \['fast'\]"):
        PipeshardParallel(num_micro_batches=2, comm_schedule={"p2p", "fast"})
    with pytest.raises(MeshshardInputError, match=r"pass a set of switches"):
        PipeshardParallel(num_micro_batches=2, comm_schedule="p2p")


@pytest.mark.fast
def test_admission_rule():
    assert admit(5, [1, 2], {})
    assert not admit(5, [1, 2], {2: [6]})
    assert admit(6, [1, 2], {2: [6, 1]})  # equal priority shares the link
    assert admit(5, [1], {2: [9]})  # a busy link it does not use


@pytest.mark.fast
def test_sparse_cost_model():
    g = SparseGrad(BufferRef(BufferKind.REDUCTION, 0), BufferRef(BufferKind.REDUCTION, 1), 100, 30)
    assert sparse_is_cheaper(g, 2)  # 30 < 100
    assert not sparse_is_cheaper(g, 8)  # 7 * 30 > 2 * 7/8 * 100


@pytest.mark.fast
def test_replicas_all_reduce_each_stage_once_per_step(plan2bw):
    assert verify(plan2bw) == []
    steps = plan2bw.schedule.steps
    for st in plan2bw.streams:
        colls = [x for x in st.instructions if isinstance(x, Collective)]
        r = st.worker % 2
        assert {x.group for x in colls} == {(r, r + 2)}
        assert len(colls) == steps * (5 if r == 0 else 4)  # 4 buckets (+ embedding)
        peers = {x.peer for x in st.instructions if isinstance(x, Send | Recv)}
        assert peers == {st.worker ^ 1}  # replica j talks to replica j only


def _comm_multiset(plan):
    return [
        Counter(str(x.__class__.__name__) + str(x.buffer) for x in s.instructions if x.is_comm)
        for s in plan.streams
    ]


@pytest.mark.fast
@pytest.mark.parametrize("switches", [s for s in ALL_SETS if "sparse" not in s])
def test_only_order_and_priority_change(plan2bw, switches):
    got = schedule_comm(plan2bw, switches)
    assert verify(got) == []
    for a, b in zip(plan2bw.streams, got.streams, strict=True):
        assert Counter(str(x).split(" !")[0] for x in a.instructions) == Counter(
            str(x).split(" !")[0] for x in b.instructions
        )
    prios = {type(x).__name__: x.priority for s in got.streams for x in s.instructions if x.is_comm}
    assert (prios["Send"] == PRIORITY["p2p"]) == ("p2p" in switches)
    assert (prios["Collective"] > 0) == ("allreduce" in switches)


@pytest.mark.fast
def test_allreduce_hoisted_update_sunk(plan2bw):
    got = schedule_comm(plan2bw, {"allreduce"}).streams[0].instructions
    i = next(i for i, x in enumerate(got) if isinstance(x, Collective))
    assert isinstance(got[i - 1], Run) and got[i - 1].program.phase is Phase.BACKWARD
    ranks = [x.priority for x in got[i : i + 5]]
    assert ranks == sorted(ranks, reverse=True)  # first layers first
    apply = next(
        j for j, x in enumerate(got) if isinstance(x, Run) and x.program.phase is Phase.APPLY
    )
    between = [x for x in got[i + 5 : apply] if isinstance(x, Run)]
    assert between and between[0].program.phase is Phase.FORWARD  # overlapped with a forward
    assert all(isinstance(x, Wait) for x in got[apply - 5 : apply])


@pytest.mark.fast
def test_sparse_moves_rows_and_plan_shows_it(plan2bw):
    got = schedule_comm(plan2bw, {"sparse", "p2p"}, sparse=sparse_grads(plan2bw))
    assert verify(got) == []
    colls = [x for x in got.streams[0].instructions if isinstance(x, Collective)]
    assert {x.kind.value for x in colls if x.priority > PRIORITY["sparse"]} == {"allgather"}
    assert {x.priority for x in colls if x.kind.value == "allreduce"} == {0}  # switch off
    text = str(got)
    assert "comm_schedule: p2p, sparse" in text
    assert "sparse COLL allgather r9~0 #0 [w0,w2] !20" in text and "bound by RUN m0.apply" in text
    assert "p2p t0 !30000" in text


@pytest.mark.slow
def test_scheduling_is_faster_in_simulation(plan2bw):
    sg = sparse_grads(plan2bw)

    def t(sw):
        p = schedule_comm(plan2bw, sw, sparse=sg)
        return simulate(p, p.cluster, options=SimOptions(admission="topology" in sw)).iteration_time

    none, allr, sparse, three, topo = (
        t(()),
        t({"allreduce"}),
        t({"sparse"}),
        t({"allreduce", "sparse", "p2p"}),
        t(set(COMM_SWITCHES)),
    )
    assert allr < none and sparse < none and three < min(allr, sparse) and topo < three


@pytest.mark.slow
def test_sparse_rows_sum_to_dense_gpt_embedding_gradient():
    model = gpt.GPT(vocab=512, num_layers=1)
    batches = [gpt.make_batch(batch_size=2, vocab=512, seed=s) for s in (0, 1)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["inputs"])["params"]

    def grad(batch):
        def loss(p):
            logits = model.apply({"params": p}, batch["inputs"])
            return jax.numpy.mean(logits**2)

        return np.asarray(jax.jit(jax.grad(loss))(params)["wte"]["embedding"])

    dense = [grad(b) for b in batches]
    parts = [to_rows(g, b["inputs"]) for g, b in zip(dense, batches, strict=True)]
    assert all(len(i) < 512 for i, _ in parts)  # genuinely sparse
    np.testing.assert_array_equal(densify(parts, 512), dense[0] + dense[1])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_training_is_bit_identical_with_every_switch(threads_cluster, schedule):
    """Tied GPT with a large vocabulary (a cross-mesh all-reduce of the embedding
    gradient, point-to-point activations): the same bits with all switches as without."""
    model = gpt.GPT(vocab=1024, num_layers=2, tie_embeddings=True)
    batches = [gpt.make_batch(batch_size=4, vocab=1024, seed=s) for s in range(2)]
    outs = []
    for sw in (frozenset(), frozenset(COMM_SWITCHES)):
        state = gpt.make_state(model, batches[0]["inputs"])
        method = PipeshardParallel(
            num_micro_batches=2, stages=[(1, 2)] * 2, schedule=schedule, comm_schedule=sw
        )
        step = meshshard.parallelize(gpt.train_step, method=method)
        losses = []
        for b in batches:
            state, loss = step(state, b)
            losses.append(np.asarray(loss))
        outs.append((jax.tree.map(np.asarray, state.params), losses))
        prios = {x.priority for s in step.plan.streams for x in s.instructions if x.is_comm}
        assert (prios == {0}) == (not sw)
    jax.tree.map(np.testing.assert_array_equal, outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])


@pytest.mark.fast
def test_trace_colours_the_three_kinds(plan2bw):
    from meshshard.sim.trace import TRAFFIC_COLOURS, chrome_trace

    p = schedule_comm(plan2bw, {"sparse"}, sparse=sparse_grads(plan2bw))
    events = chrome_trace(simulate(p, p.cluster))["traceEvents"]
    kinds = {e["args"]["traffic"]: e["cname"] for e in events if "cname" in e}
    assert kinds == TRAFFIC_COLOURS


@pytest.mark.fast
def test_allreduce_chunks_are_queued_before_the_last_gradient_send():
    """Under 1F1B a stage's accumulators are complete after its last backward, whose
    input gradient is sent after it: the hoisted chunks now come before that ``SEND`` (so
    the send, of higher priority, overtakes them at run time), the send still follows
    the backward it carries, and the plan simulates without deadlock."""
    plan = dp_plan("1f1b")
    got = schedule_comm(plan, {"allreduce", "p2p"})
    assert verify(got) == []
    passed = 0
    for before, after in zip(plan.streams, got.streams, strict=True):
        ins = list(after.instructions)
        colls = [i for i, x in enumerate(ins) if isinstance(x, Collective)]
        sends = [i for i, x in enumerate(ins) if isinstance(x, Send)]
        old = list(before.instructions)
        old_first_coll = next(i for i, x in enumerate(old) if isinstance(x, Collective))
        late_sends = [(x.buffer, x.peer) for x in old[:old_first_coll] if isinstance(x, Send)]
        if sends and colls and sends[-1] > colls[0]:
            passed += 1
            last_send = ins[sends[-1]]
            # it was before the all-reduce, now after
            assert (last_send.buffer, last_send.peer) in late_sends
            writer = max(i for i, x in enumerate(ins[: sends[-1]]) if last_send.buffer in x.writes)
            assert writer < colls[0]  # the backward it carries still runs first
    assert passed  # some stage's last gradient send now follows its chunks
    assert simulate(got).iteration_time > 0

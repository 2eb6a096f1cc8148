"""2BW without flushes at run time: step k+1's forwards run while step k drains.

Stage 1's sends are slowed (each by 0.15 s on its comm thread), so on stage 0 step k's
backwards wait for their gradients; with the pipelined runtime step k+1's forwards are
dispatched during that wait, with ``MESHSHARD_2BW_PIPELINE=0`` only after step k ended.
The numbers are checked against the plain-JAX 2BW rule in tests/test_schedule_parity.py
(and on Ray in tests/test_schedules_ray.py), both through the pipelined runtime.
"""

import time

import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.instructions import Run
from meshshard.runtime.transport import QueueTransport
from tests.conftest import assert_trees_close
from tests.two_bw_reference import reference_2bw

pytestmark = pytest.mark.slow


def stage0_steps(monkeypatch, pipelined: bool, steps: int = 4):
    """Run 2BW S=2 M=2 with slow stage-1 sends; per step on stage 0's worker: (first
    forward dispatch, last backward dispatch) in ns, and the losses."""
    monkeypatch.setenv("MESHSHARD_2BW_PIPELINE", "1" if pipelined else "0")
    model = mlp.MLP(num_layers=4)
    batches = [mlp.make_batch(batch_size=8, seed=i) for i in range(steps)]
    state = mlp.make_state(model, batches[0]["x"], learning_rate=0.05)
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 2, schedule="2bw")
    step = meshshard.parallelize(mlp.train_step, method=method)
    state, _ = step(state, batches[0])  # the first call: the plan without the stash
    state, _ = step(state, batches[1])  # compiles the steady plan
    exe = step.executable
    exe.settle()
    exe.backend.runtime_options(timeline=True)
    slow = exe.plan.meshes[1].workers[0]
    isend = QueueTransport.isend

    def slow_isend(self, data, peer, tag):
        if self.rank == slow:
            time.sleep(0.15)
        return isend(self, data, peer, tag)

    monkeypatch.setattr(QueueTransport, "isend", slow_isend)
    losses = []
    for batch in batches[2:]:
        state, loss = step(state, batch)
        losses.append(loss)
    exe.settle()
    w0 = exe.backend.workers[exe.plan.meshes[0].workers[0]]
    code = w0.interp.stream.instructions
    spans = []
    for _, tl in list(w0.interp.timelines)[-(steps - 2) :]:
        runs = {str(code[i].program): t0 for i, t0, _ in tl.runs if type(code[i]) is Run}
        fwd = min(t for p, t in runs.items() if p.endswith(".F"))
        bwd = max(t for p, t in runs.items() if p.endswith(".B"))
        spans.append((fwd, bwd))
    return spans, [float(x) for x in losses], (state, batches)


@pytest.mark.parametrize("pipelined", [True, False])
def test_2bw_next_step_forwards_run_while_the_last_backwards_drain(
    threads_cluster, monkeypatch, pipelined
):
    spans, losses, (state, batches) = stage0_steps(monkeypatch, pipelined)
    (_, k_last_b), (k1_first_f, _) = spans
    if pipelined:
        assert k1_first_f < k_last_b  # no flush: step k+1 started before step k drained
    else:
        assert k1_first_f > k_last_b  # flushed: one step after the other
    # and the numbers are the 2BW rule's, step for step, either way
    model = mlp.MLP(num_layers=4)
    want = reference_2bw(mlp.make_state(model, batches[0]["x"], learning_rate=0.05), batches, 2)
    np.testing.assert_allclose(losses, [float(w[1]) for w in want[2:]], rtol=1e-5)
    assert_trees_close(want[-1][0].params, state.params)

"""No leaks: dropped steps and arrays are freed on the workers promptly; long runs stay flat."""

import gc
import time

import jax
import pytest

import meshshard
from examples import mlp
from meshshard import PipeshardParallel
from meshshard.runtime.executable import RemoteArray, _twin_of
from meshshard.runtime.release import RELEASER

pytestmark = pytest.mark.slow  # each test compiles and runs a pipelined step

METHOD = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])


def setup():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    return mlp.make_state(model, batch["x"]), batch


def settle(cluster) -> dict:
    """Host stats once every dropped object has been freed on the workers: the workers'
    helper threads (prefetch, comm) drop their last references a moment after a step
    returns, so read until two reads 0.1 s apart agree."""
    last = None
    for _ in range(30):
        gc.collect()
        RELEASER.flush()
        stats = cluster.host_stats()
        if stats == last:
            return stats
        last = stats
        time.sleep(0.1)
    return last


def held(state) -> dict[int, int]:
    """Stored arrays per host that ``state`` references (a small result the last step
    returned by value is kept stored too, for the next step to read in place)."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(state):
        leaf = _twin_of(leaf)
        if isinstance(leaf, RemoteArray):
            for w in leaf.keys:
                out[w] = out.get(w, 0) + 1
    return out


def test_dropped_steps_and_arrays_free_everything(threads_cluster):
    state0, batch = setup()
    base = settle(threads_cluster)
    for _ in range(2):  # a re-run notebook cell: a new step, a new state, the old ones dropped
        step = meshshard.parallelize(mlp.train_step, method=METHOD)
        state, _ = step(state0, batch)
        state, loss = step(state, batch)
        during = settle(threads_cluster)
        assert {h: s["store"] for h, s in during.items() if s["store"]} == held((state, loss))
        exe = step.executable
        # the loss is a jax.Array in this process, on device 0 (worker 0's, on threads)
        del step, state, _, loss
        assert settle(threads_cluster) == base
        assert exe.released and not exe.backend.workers  # compiled programs dropped
        del exe


def test_release_drops_programs_and_keeps_arrays(threads_cluster):
    state0, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=METHOD)
    state, _ = step(state0, batch)
    exe = step.executable
    before = jax.tree.map(lambda x: x.fetch() if isinstance(x, RemoteArray) else x, state)
    step.release()
    assert exe.released and not exe.backend.workers and step.executable is None
    with pytest.raises(meshshard.MeshshardRuntimeError, match=r"was released .* call the"):
        exe(state, batch)
    kernel = state.params["dense0"]["kernel"]
    assert (kernel.fetch() == before.params["dense0"]["kernel"]).all()
    state, _ = step(state, batch)  # compiles again and takes the old arrays
    assert step.executable is not exe


def test_three_hundred_steps_stay_flat(threads_cluster):
    """Every count (stored arrays, live buffers, compiled programs) is the same after 300
    steps as after 10: a per-step leak of any entry shows at once."""
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=METHOD)
    for _ in range(10):
        state, _ = step(state, batch)
    at10 = settle(threads_cluster)
    for _ in range(290):
        state, loss = step(state, batch)
    at300 = settle(threads_cluster)
    assert at300 == at10
    assert {h: s["store"] for h, s in at300.items() if s["store"]} == held((state, loss))


def test_a_step_frees_the_state_it_replaced_before_it_runs(threads_cluster, monkeypatch):
    """The state the driver dropped goes before the step runs, not after: a worker holds
    two states at a step's peak (its inputs and outputs), not three."""
    from meshshard.runtime.worker import Worker

    held_at_start, run_step = [], Worker.run_step

    def recorded(self, batch, state, base, free=(), seq=None, after=None):
        run = self.interp.run

        def checked(*args, **kwargs):
            held_at_start.append((len(free), sum(key in self.store for key in free)))
            return run(*args, **kwargs)

        self.interp.run = checked
        try:
            return run_step(self, batch, state, base, free, seq, after)
        finally:
            del self.interp.run

    monkeypatch.setattr(Worker, "run_step", recorded)
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=METHOD)
    for _ in range(3):  # the third call carries the frees of the first call's result
        state, _ = step(state, batch)
    freeing = [still for count, still in held_at_start if count]
    assert freeing and not any(freeing), held_at_start


def test_arrays_dropped_on_another_thread_while_steps_run_are_all_freed(threads_cluster):
    """Finalizers append dropped keys without a lock while a step drains them: none is
    lost, whichever thread drops the arrays and whenever."""
    import queue
    import threading

    state0, batch = setup()
    base = settle(threads_cluster)
    step = meshshard.parallelize(mlp.train_step, method=METHOD)
    handed: queue.SimpleQueue = queue.SimpleQueue()

    def dropper():  # holds each state a moment, then drops it on this thread
        while (item := handed.get()) is not None:
            time.sleep(0.001)
            del item

    thread = threading.Thread(target=dropper)
    thread.start()
    state = state0
    for _ in range(40):
        state, _ = step(state, batch)
        handed.put(state)  # the main thread's reference goes with the next step
    handed.put(None)
    thread.join(30)
    during = settle(threads_cluster)
    assert {h: s["store"] for h, s in during.items() if s["store"]} == held((state, _))
    del step, state, _
    assert settle(threads_cluster) == base


@pytest.mark.ray
def test_ray_actors_free_dropped_steps_and_stay_flat(ray_cluster):
    state0, batch = setup()
    base = settle(ray_cluster)
    step = meshshard.parallelize(mlp.train_step, method=METHOD)
    state, _ = step(state0, batch)
    compiled = [s["compiled"] - base[h]["compiled"] for h, s in settle(ray_cluster).items()]
    assert compiled == [int(h in step.plan.workers) for h in base]
    for _ in range(10):
        state, _ = step(state, batch)
    at10 = settle(ray_cluster)
    # the counts are exact, so a per-step leak of any entry shows within these 30 steps
    # (the threads cluster's test runs 300)
    for _ in range(30):
        state, _ = step(state, batch)
    at40 = settle(ray_cluster)
    flat = [(s["store"], s["live_buffers"], s["compiled"]) for s in at10.values()] == [
        (s["store"], s["live_buffers"], s["compiled"]) for s in at40.values()
    ]
    assert flat, (at10, at40)
    del step, state
    after = settle(ray_cluster)
    for h in base:
        for k in ("store", "live_buffers", "compiled"):
            assert after[h][k] == base[h][k], (h, k, base, after)

"""Sharded checkpoints: bit-exact round trips, restore onto another layout, a training loop."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import meshshard
from examples import mlp
from meshshard import CheckpointManager, DataParallel, PipeshardParallel
from meshshard.runtime.cluster import ThreadsCluster, use_cluster
from meshshard.runtime.executable import RemoteArray
from tests.conftest import assert_trees_close

pytestmark = pytest.mark.slow  # each test compiles and runs a pipelined step

TWO_STAGES = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 2)])
FOUR_STAGES = PipeshardParallel(num_micro_batches=4, stages=[(1, 1)] * 4, schedule="gpipe")


def setup():
    model = mlp.MLP(num_layers=4)
    batch = mlp.make_batch(batch_size=16)
    return mlp.make_state(model, batch["x"]), batch


def batches(n, start=0):
    return [mlp.make_batch(batch_size=16, seed=i) for i in range(start, start + n)]


def host_copy(state):
    return jax.tree.map(np.asarray, state)


def assert_bit_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


def train(step, state, bs):
    for b in bs:
        state, _ = step(state, b)
    return state


def test_save_and_restore_bit_exact_on_the_same_plan(threads_cluster, tmp_path):
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=TWO_STAGES)
    state = train(step, state, batches(2))
    assert isinstance(state.params["dense0"]["kernel"], RemoteArray)
    meshshard.save(tmp_path / "c", state)
    parts = sorted(os.listdir(tmp_path / "c"))
    assert parts == ["driver", "meshshard_checkpoint.json", "w0", "w1"]  # one part per host
    back = meshshard.restore(tmp_path / "c", like=state)
    assert_bit_equal(host_copy(state), host_copy(back))
    assert back.params["dense0"]["kernel"].keys != state.params["dense0"]["kernel"].keys
    # the restored arrays feed the step like the ones it returned
    ref, _ = step(state, batches(1, 5)[0])
    got, _ = step(back, batches(1, 5)[0])
    assert_bit_equal(host_copy(ref), host_copy(got))


def test_restore_onto_another_layout_is_bit_exact(threads_cluster, tmp_path):
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=TWO_STAGES)
    state = train(step, state, batches(1))
    meshshard.save(tmp_path / "c", state)
    for method in (FOUR_STAGES, DataParallel(mesh_shape=(1, 2))):
        other = meshshard.parallelize(mlp.train_step, method=method)
        placed = other.placement(setup()[0], batch)
        back = meshshard.restore(tmp_path / "c", like=placed)
        assert_bit_equal(host_copy(state), host_copy(back))
    as_host = meshshard.restore(tmp_path / "c", like=setup()[0])
    assert isinstance(as_host.params["dense3"]["bias"], np.ndarray)
    assert_bit_equal(host_copy(state), as_host)


def test_three_steps_save_new_cluster_other_layout_three_more_equal_six(tmp_path):
    state0, batch = setup()
    ref = train(jax.jit(mlp.train_step), state0, batches(6))
    with use_cluster(ThreadsCluster(4, 2)):
        step = meshshard.parallelize(mlp.train_step, method=TWO_STAGES)
        meshshard.save(tmp_path / "c", train(step, state0, batches(3)))
    del step  # the old cluster and its stores are gone
    with use_cluster(ThreadsCluster(4, 2)):
        step = meshshard.parallelize(mlp.train_step, method=FOUR_STAGES)
        state = meshshard.restore(tmp_path / "c", like=step.placement(state0, batch))
        got = host_copy(train(step, state, batches(3, 3)))
    assert_trees_close(ref.params, got.params)
    assert_trees_close(ref.opt_state, got.opt_state)
    assert int(got.step) == 6


def test_manager_async_keep_last_and_resume_after_a_crash(threads_cluster, tmp_path):
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=TWO_STAGES)
    mgr = CheckpointManager(tmp_path / "m", max_to_keep=2)
    saved = {}
    for i, b in enumerate(batches(4)):
        state, _ = step(state, b)
        handle = mgr.save(i + 1, state)  # the next step runs while this one is written
        saved[i + 1] = host_copy(state)
    handle.wait()
    assert mgr.all_steps() == [3, 4]
    # a crash in the middle of saving step 5: shards written, no manifest
    os.makedirs(tmp_path / "m" / "5" / "w0")
    assert mgr.latest_step() == 4
    resumed = CheckpointManager(tmp_path / "m", max_to_keep=2)
    back = resumed.restore(like=step.placement(setup()[0], batch))
    assert_bit_equal(saved[4], host_copy(back))
    resumed.save(5, back, wait=True)  # replaces the unfinished directory
    assert resumed.all_steps() == [4, 5]
    assert_bit_equal(saved[4], host_copy(resumed.restore(like=back, step=5)))


def test_async_save_snapshots_the_state_it_was_given(threads_cluster, tmp_path):
    state, batch = setup()
    step = meshshard.parallelize(mlp.train_step, method=TWO_STAGES, donate_argnums=(0,))
    state, _ = step(state, batch)
    expect = host_copy(state)
    handle = meshshard.save(tmp_path / "c", state, wait=False)
    for b in batches(3, 1):  # donates and frees the saved arrays while they are written
        state, _ = step(state, b)
    handle.wait()
    assert_bit_equal(expect, host_copy(meshshard.restore(tmp_path / "c", like=setup()[0])))


def test_errors_name_the_fix(threads_cluster, tmp_path):
    state, batch = setup()
    meshshard.save(tmp_path / "c", state)
    with pytest.raises(meshshard.MeshshardInputError, match=r"the path exists; pass a new"):
        meshshard.save(tmp_path / "c", state)
    with pytest.raises(meshshard.MeshshardInputError, match=r"no finished meshshard checkpoint"):
        meshshard.restore(tmp_path / "nothing", like=state)
    with pytest.raises(meshshard.MeshshardInputError, match=r"another structure .* saved "):
        meshshard.restore(tmp_path / "c", like=state.params)
    step = meshshard.parallelize(mlp.train_step, method=TWO_STAGES)
    with pytest.raises(meshshard.MeshshardInputError, match=r"is a batch argument"):
        step.placement(state, batch, argnum=1)


@pytest.mark.ray
@pytest.mark.own_cluster
def test_ray_save_shutdown_restore_on_another_layout_equals_six_steps(tmp_path):
    """Multi-host meshes on both sides; its own process, so its own Ray cluster."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # the session's fast-compile flags, without its 8 emulated devices (the actors set theirs)
    flags = os.environ.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "device_count" not in f)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.checkpoint_scenario", str(tmp_path / "c")],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["bit_exact"] and result["step"] == 6
    assert result["max_rel_error"] <= 1e-5
    assert sorted(os.listdir(tmp_path / "c")) == [
        "driver",
        "meshshard_checkpoint.json",
        "w0-1",
        "w2",
    ]


def test_a_state_holding_a_typed_key_saves_restores_and_trains_on(threads_cluster, tmp_path):
    """A typed key in the state (``jax.random.key``, as Flax NNX's ``nnx.Rngs`` keeps)
    is saved as its data and restored as the same typed key, into the same layout or a
    step's placement.  Before, save failed: "JAX array with PRNGKey dtype cannot be
    converted to a NumPy array"."""

    def keyed_step(state, batch):
        inner, key = state
        key, sub = jax.random.split(key)
        noise = 0.01 * jax.random.normal(sub, batch["x"].shape)
        inner, metrics = mlp.train_step(inner, {**batch, "x": batch["x"] + noise})
        return (inner, key), metrics

    start = (setup()[0], jax.random.key(7))
    step = meshshard.parallelize(keyed_step, method=TWO_STAGES)
    whole = train(step, start, batches(3))
    state = train(step, start, batches(1))
    meshshard.save(tmp_path / "c", state)
    manifest = json.loads((tmp_path / "c" / "meshshard_checkpoint.json").read_text())
    (key_entry,) = [e for e in manifest["leaves"] if "key_impl" in e]
    assert key_entry["key_shape"] == [] and key_entry["shape"] == [2]
    for like in (state, step.placement(start, batches(1)[0])):
        back = meshshard.restore(tmp_path / "c", like=like)
        assert jax.dtypes.issubdtype(back[1].dtype, jax.dtypes.prng_key)
        assert np.array_equal(jax.random.key_data(back[1]), jax.random.key_data(state[1]))
        resumed = train(step, back, batches(2, 1))
        assert_bit_equal(host_copy(whole[0]), host_copy(resumed[0]))
        assert np.array_equal(jax.random.key_data(whole[1]), jax.random.key_data(resumed[1]))


def test_a_weak_learning_rate_restores_weak_and_bfloat16_weights_stay_bfloat16(
    threads_cluster, tmp_path
):
    """A Python-float learning rate is traced weakly (``lr * g`` keeps bfloat16 weights
    bfloat16); saved and restored, it was a strong float32 and the next step made the
    weights float32 and compiled anew. Now it comes back weak, onto the meshes or the
    host, and training on equals training without the checkpoint."""
    from tests.test_compile_reuse import BF16, bf16_case, bf16_sgd_step

    state, (b1, b2) = bf16_case()
    step = meshshard.parallelize(bf16_sgd_step, method=TWO_STAGES)
    once, _ = step(state, b1)
    for where, like in [("meshes", step.placement(once, b2)), ("host", state)]:
        meshshard.save(tmp_path / where, once)
        restored = meshshard.restore(tmp_path / where, like=like)
        assert restored[1].weak_type, where
        twice, _ = step(restored, b2)
        assert [x.dtype for x in jax.tree.leaves(twice[0])] == [BF16, BF16], where
    want, _ = jax.jit(bf16_sgd_step)(*jax.jit(bf16_sgd_step)(state, b1)[:1], b2)
    as_f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)  # noqa: E731
    assert_trees_close(as_f32(want), as_f32(twice), rtol=1e-2)  # bfloat16 micro-batch sums
    assert len({id(e) for e in step._executables.values()}) == 1

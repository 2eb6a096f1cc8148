"""Meshes that share hosts (issue 11 item 3): the hosts split into workers, one
host-actor per block of devices; placement, plan checks and parity on threads and Ray."""

import os

import jax
import pytest

import meshshard
from examples import mlp
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.methods import PipeshardParallel
from meshshard.passes.meshes import allocate_meshes, place_meshes
from meshshard.runtime import cpu_shares
from meshshard.verify import verify
from tests.conftest import assert_trees_close
from tests.test_cpu_shares import thread_affinities

TWO_BY_FOUR = ClusterSpec(num_hosts=2, devices_per_host=4)


def test_whole_hosts_are_placed_as_before():
    shapes = [(1, 4), (1, 2)]
    meshes, view = place_meshes(shapes, TWO_BY_FOUR)
    assert view is TWO_BY_FOUR
    assert meshes == allocate_meshes(shapes, TWO_BY_FOUR)


def test_equal_submeshes_take_one_worker_each():
    meshes, view = place_meshes([(1, 2)] * 4, TWO_BY_FOUR)
    assert view.worker_blocks == ((0, 0, 2), (0, 2, 2), (1, 0, 2), (1, 2, 2))
    assert (view.num_hosts, view.devices_per_host) == (4, 2)
    assert [(m.shape, m.hosts) for m in meshes] == [((1, 2), (w,)) for w in range(4)]
    assert [view.physical_host(w) for w in range(4)] == [0, 0, 1, 1]
    assert view.physical_hosts == 2


def test_mixed_widths_keep_their_shapes_one_worker_each():
    """Largest first: (1, 4) fills host 0, the rest pack host 1; workers in mesh order."""
    meshes, view = place_meshes([(1, 1), (1, 4), (1, 2), (1, 1)], TWO_BY_FOUR)
    assert view.worker_blocks == ((1, 2, 1), (0, 0, 4), (1, 0, 2), (1, 3, 1))
    got = [(m.shape, m.hosts) for m in meshes]
    assert got == [((1, 1), (0,)), ((1, 4), (1,)), ((1, 2), (2,)), ((1, 1), (3,))]
    assert [view.worker_devices(w) for w in range(4)] == [1, 4, 2, 1]
    assert str(view) == "local (4 workers on 2 hosts: h0 4, h1 2+1+1 devices)"


def test_whole_host_meshes_take_whole_host_workers():
    cluster = ClusterSpec(num_hosts=3, devices_per_host=4)
    meshes, view = place_meshes([(2, 4), (1, 2), (1, 2)], cluster)
    assert view.worker_blocks == ((0, 0, 4), (1, 0, 4), (2, 0, 2), (2, 2, 2))  # mesh order
    assert [(m.shape, m.hosts) for m in meshes] == [
        ((2, 4), (0, 1)),
        ((1, 2), (2,)),
        ((1, 2), (3,)),
    ]


@pytest.mark.parametrize(
    "shapes, cluster, match",
    [
        ([(2, 2), (1, 2), (1, 2)], TWO_BY_FOUR, r"share a host only as \(1, d\).*\[\(2, 2\)\]"),
        ([(1, 3), (1, 3), (1, 2)], TWO_BY_FOUR, r"do not tile .* no room for \(1, 2\)"),
        ([(1, 4)] * 3, TWO_BY_FOUR, r"ask for meshes .* has 8 devices"),
    ],
    ids=["two-host-part", "no-room", "too-many-devices"],
)
def test_sharing_errors_name_the_meshes_and_the_fix(shapes, cluster, match):
    with pytest.raises(MeshshardInputError, match=match):
        place_meshes(shapes, cluster)


def test_split_spec_round_trips_and_checks_its_blocks():
    view = TWO_BY_FOUR.split(2)
    assert ClusterSpec.from_dict(view.to_dict()) == view
    assert ClusterSpec.from_json(view.to_json()) == view
    assert str(view) == "local (4 workers on 2 hosts: h0 2+2, h1 2+2 devices)"
    with pytest.raises(ValueError, match=r"split\(3\).*divide devices_per_host=4"):
        TWO_BY_FOUR.split(3)
    with pytest.raises(ValueError, match=r"block \(host 0, devices 1..2\) .* overlaps"):
        TWO_BY_FOUR.split([(0, 0, 2), (0, 1, 2)])
    with pytest.raises(ValueError, match=r"block \(host 2, devices 0..0\) is outside"):
        TWO_BY_FOUR.split([(2, 0, 1)])
    with pytest.raises(ValueError, match="already a worker view"):
        view.split(2)
    with pytest.raises(ValueError, match=r"worker_blocks must give .* 2 workers"):
        ClusterSpec(num_hosts=2, devices_per_host=2, worker_blocks=((0, 0, 2),))


def _state_and_batches(layers=4, steps=3):
    model = mlp.MLP(num_layers=layers)
    batches = [mlp.make_batch(batch_size=16, seed=i) for i in range(steps)]
    return mlp.make_state(model, batches[0]["x"]), batches


def test_plan_for_shared_hosts_verifies_against_the_physical_cluster():
    state, batches = _state_and_batches()
    method = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    step = meshshard.parallelize(mlp.train_step, method=method)
    plan = step.lower(state, batches[0], cluster=TWO_BY_FOUR, costs=False)
    assert plan.cluster == TWO_BY_FOUR.split(2)  # one 2-device block per mesh
    assert [m.hosts for m in plan.meshes] == [(0,), (1,), (2,), (3,)]
    assert any(
        n.startswith("meshes share hosts: one host-actor per mesh block") for n in plan.notes
    )
    assert verify(plan, TWO_BY_FOUR) == []  # the worker view of the physical cluster
    problems = verify(plan, ClusterSpec(num_hosts=1, devices_per_host=4))
    assert any("do not fit" in p and "host 1" in p for p in problems), problems


def _run_alternating(methods, layers=4, after_each=lambda step: None):
    """Steps alternate between ``methods`` on the same state: equal to jax.jit's
    (``after_each(step)`` runs after each)."""
    state, batches = _state_and_batches(layers, steps=len(methods))
    ref_step = jax.jit(mlp.train_step)
    steps = [meshshard.parallelize(mlp.train_step, method=m) for m in methods]
    ref = got = state
    for step, batch in zip(steps, batches, strict=True):
        ref, ref_loss = ref_step(ref, batch)
        got, got_loss = step(got, batch)
        assert_trees_close(ref.params, got.params)
        assert_trees_close(ref.opt_state, got.opt_state)
        assert_trees_close(ref_loss, got_loss)
        after_each(step)
    return steps


SHARED = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
WHOLE = PipeshardParallel(num_micro_batches=2, stages=[(1, 4)] * 2)


def test_threads_shared_hosts_keep_parity_across_layouts():
    """Two 4-device hosts as four 2-device workers, then whole hosts, then shared again:
    arrays kept by one view are sent by value to the other (their worker ids differ)."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    with use_cluster(ThreadsCluster(2, 4)):
        shared, whole, _ = _run_alternating([SHARED, WHOLE, SHARED])
    assert shared.plan.cluster.worker_blocks and not whole.plan.cluster.worker_blocks
    assert len(shared.plan.workers) == 4 and len(whole.plan.workers) == 2


MIXED = PipeshardParallel(num_micro_batches=2, stages=[(1, 1), (1, 2), (1, 1), (1, 4)])


@pytest.mark.parametrize(
    "kw",
    [
        dict(stages=[(1, 1)] * 4, schedule="zb_h1"),
        dict(stages=[(1, 1)] * 2, schedule="interleaved_1f1b", virtual_stages=2),
        dict(stages=[(1, 1)] * 2, data_parallel=2),
    ],
    ids=["zb_h1", "interleaved", "data-parallel-replicas"],
)
def test_threads_schedules_and_replicas_on_one_shared_host(kw):
    """One 4-device host: stages, virtual stages and data-parallel replicas each take
    one-device host-actors of it (replica j's after the stages')."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster
    from tests.parity import check_parity

    with use_cluster(ThreadsCluster(1, 4)):
        step = check_parity("mlp", PipeshardParallel(num_micro_batches=4, **kw), steps=2)
    blocks = step.plan.cluster.worker_blocks
    assert blocks and all(h == 0 and n == 1 for h, _, n in blocks)
    if kw.get("data_parallel"):
        assert [m.hosts for m in step.plan.meshes] == [(0,), (1,), (2,), (3,)]


def test_threads_mixed_widths_keep_parity():
    """One host-actor (thread) per mesh block, blocks of 1, 2, 1 and 4 devices."""
    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    with use_cluster(ThreadsCluster(2, 4)):
        (step,) = _run_alternating([MIXED])
    assert [m.shape for m in step.plan.meshes] == [(1, 1), (1, 2), (1, 1), (1, 4)]


@pytest.mark.ray
def test_ray_meshes_share_hosts_and_the_actors_follow_the_plan(ray_cluster):
    """On the 4 x 2 Ray cluster, five stages of 2, 1, 1, 2 and 1 devices need 5 hosts:
    the hosts run as one actor per mesh block (2, 2, 1, 1 and 1 devices); a whole-host
    plan after it restarts the actors back to one per host, its state moved to the
    driver."""
    import ray

    shared = PipeshardParallel(num_micro_batches=2, stages=[(1, 2), (1, 1), (1, 1), (1, 2), (1, 1)])
    whole = PipeshardParallel(num_micro_batches=2, stages=[(1, 2)] * 4)
    xla_cores = {}  # per block actor, after the shared step: the cores XLA's pool is on

    def look(step):
        if not xla_cores and ray_cluster.blocks:
            calls = [a.__ray_call__.remote(thread_affinities) for a in ray_cluster._actors]
            xla_cores.update(enumerate(t["tf_XLAEigen"] for t in ray.get(calls)))

    steps = _run_alternating([shared, whole], layers=5, after_each=look)
    plan = steps[0].plan
    # each block actor's XLA threads run on its share of this machine's cores
    shares = cpu_shares.core_shares([2, 1, 1, 2, 1], os.sched_getaffinity(0))
    assert xla_cores == {w: {share} for w, share in enumerate(shares)}
    assert plan.cluster.worker_blocks == ((0, 0, 2), (2, 0, 1), (2, 1, 1), (1, 0, 2), (3, 0, 1))
    assert [(m.shape, m.hosts) for m in plan.meshes] == [
        ((1, 2), (0,)),
        ((1, 1), (1,)),
        ((1, 1), (2,)),
        ((1, 2), (3,)),
        ((1, 1), (4,)),
    ]
    # the last (whole-host) step put the actors back: four of two devices
    assert ray_cluster.blocks == ()
    assert sorted(ray_cluster.host_stats()) == [0, 1, 2, 3]


def test_simulator_maps_workers_back_to_their_host():
    """On a GPU cluster two workers of one host talk over NVLink and share its NIC; on
    the emulated CPU cluster every worker is a process, priced as a host of its own."""
    from meshshard.sim.topology import Topology

    gpu = ClusterSpec.preset("aws-p3.8xlarge", num_hosts=2).split(2)
    topo = Topology(gpu)
    names = lambda a, b: [topo.links[i].name for i in topo.path(a, b)]  # noqa: E731
    assert names((0, 0), (1, 0)) == ["h0.d0.out", "h0.d2.in"]
    assert topo.latency((0, 0), (1, 0)) == gpu.intra_latency
    assert names((1, 1), (3, 1)) == ["h0.d3.out", "h0.nic0.out", "h1.nic0.in", "h1.d3.in"]
    assert topo.latency((1, 1), (3, 1)) == gpu.nic_latency
    local = Topology(TWO_BY_FOUR.split(2))
    assert [local.links[i].name for i in local.path((0, 0), (1, 0))] == [
        "h0.d0.out",
        "h0.nic0.out",
        "h1.nic0.in",
        "h1.d0.in",
    ]


def test_checkpoint_from_shared_hosts_restores_onto_whole_hosts_and_back(tmp_path):
    """Save the state of a step whose meshes share hosts, restore it into the placement
    of a whole-host plan and back into the shared one: bit-exact, and training goes on
    equal to jax.jit."""
    import numpy as np

    from meshshard.runtime.cluster import ThreadsCluster, use_cluster

    state, batches = _state_and_batches(steps=4)
    ref = state
    for b in batches:
        ref, _ = jax.jit(mlp.train_step)(ref, b)
    with use_cluster(ThreadsCluster(2, 4)):
        shared = meshshard.parallelize(mlp.train_step, method=SHARED)
        whole = meshshard.parallelize(mlp.train_step, method=WHOLE)
        got, _ = shared(state, batches[0])
        got, _ = shared(got, batches[1])
        meshshard.save(tmp_path / "c", got)
        saved = jax.tree.map(np.asarray, got)
        placed = meshshard.restore(tmp_path / "c", like=whole.placement(state, batches[0]))
        for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(placed), strict=True):
            assert np.array_equal(a, np.asarray(b))
        got, _ = whole(placed, batches[2])
        meshshard.save(tmp_path / "d", got)
        back = meshshard.restore(tmp_path / "d", like=shared.placement(state, batches[0]))
        got, _ = shared(back, batches[3])
        assert_trees_close(ref.params, got.params)
        assert_trees_close(ref.opt_state, got.opt_state)
        assert int(got.step) == 4


_KILL_A_BLOCK = """
import os, signal, time
import jax, numpy as np
import meshshard
from examples import mlp
from meshshard import PipeshardParallel

cluster = meshshard.init(num_hosts=2, devices_per_host=2)
batches = [mlp.make_batch(batch_size=16, seed=i) for i in range(4)]
state = mlp.make_state(mlp.MLP(num_layers=4), batches[0]["x"])
ref = state
for b in batches:
    ref, _ = jax.jit(mlp.train_step)(ref, b)
method = PipeshardParallel(num_micro_batches=2, stages=[(1, 1)] * 4)
step = meshshard.parallelize(mlp.train_step, method=method)
s, _ = step(state, batches[0])
s, _ = step(s, batches[1])
host = jax.tree.map(np.asarray, s)
assert len(cluster.blocks) == 4, cluster.blocks
os.kill(cluster.pids[2], signal.SIGKILL)
time.sleep(2)
try:
    step(s, batches[2])
    raise SystemExit("a step with a dead block actor ran")
except meshshard.errors.MeshshardRuntimeError as exc:
    assert "w2" in str(exc), exc
meshshard.recover()
assert len(cluster.blocks) == 4 and None not in cluster.pids, cluster.pids
s, _ = step(host, batches[2])
s, _ = step(s, batches[3])
for a, b in zip(jax.tree.leaves(ref.params), jax.tree.leaves(s.params)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)
print("RECOVERED ON BLOCKS OK")
meshshard.shutdown()
"""


@pytest.mark.ray
@pytest.mark.own_cluster
def test_a_dead_block_actor_is_named_and_recovered(tmp_path):
    """Its own Ray cluster (2 hosts x 2 devices, four one-device block actors): killing
    one fails the next step naming it; recover() restarts the blocks and training goes
    on equal to jax.jit from the state fetched before the kill."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", _KILL_A_BLOCK],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert "RECOVERED ON BLOCKS OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_a_transfer_between_views_of_one_mesh_is_local_and_other_sharing_is_refused():
    """Interleaved chunks on one mesh read each other's values in place; meshes that
    merely overlap (other workers or another layout) are refused with the value named."""
    from meshshard.passes.stage_graph import Edge
    from meshshard.passes.transfers import _check_local
    from meshshard.plan import MeshSpec, TensorSpec
    from meshshard.refs import ProgramRef

    edge = Edge(7, ProgramRef.of("s0.F"), ProgramRef.of("s2.F"))
    x = TensorSpec(7, "%7", (4, 8), "float32", ())
    a, view = MeshSpec(0, (1, 2), (0,)), MeshSpec(2, (1, 2), (0,))
    _check_local(x, a, view, (), edge)  # the same workers, the same layout: read in place
    with pytest.raises(MeshshardInputError, match=r"value %7 \(float32\[4, 8\]\) goes from s0\.F"):
        _check_local(x, a, view, ("device",), edge)  # another layout: nothing could move it
    with pytest.raises(MeshshardInputError, match=r"share hosts but are not the same workers"):
        _check_local(x, a, MeshSpec(2, (2, 2), (0, 1)), (), edge)

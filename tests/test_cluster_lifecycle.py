"""Starting, joining and stopping clusters: no processes left behind."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from meshshard import MeshshardInputError
from meshshard.runtime.cluster import discover_hosts


def node(i, gpus=0, alive=True):
    res = {"CPU": 8.0, **({"GPU": float(gpus)} if gpus else {})}
    return {"NodeID": f"n{i}", "Alive": alive, "Resources": res}


def test_discover_gpu_nodes():
    hosts, dph, platform, ids = discover_hosts(
        [node(0, 8), node(1, 8), node(2, 4, alive=False)], None, None
    )
    assert (hosts, dph, platform, ids) == (2, 8, "gpu", ["n0", "n1"])


def test_discover_cpu_nodes_and_limits():
    assert discover_hosts([node(0), node(1), node(2)], 2, 4) == (2, 4, "cpu", ["n0", "n1"])
    with pytest.raises(
        MeshshardInputError, match=r"init\(num_hosts=5\) but the Ray cluster has 3 alive nodes"
    ):
        discover_hosts([node(0), node(1), node(2)], 5, None)


SCRIPT = textwrap.dedent(
    """
    import os, sys, numpy as np, jax
    sys.path.insert(0, {root!r})
    import ray
    from ray.cluster_utils import Cluster
    import meshshard
    from examples import mlp

    import psutil, time
    from meshshard import MeshshardRuntimeError

    # a module only the driver's sys.path finds: Ray's workers must import it too
    probe_dir = {probe!r}
    os.makedirs(probe_dir, exist_ok=True)
    with open(os.path.join(probe_dir, "lifecycle_probe.py"), "w") as f:
        f.write("VALUE = 42\\n")
    sys.path.insert(0, probe_dir)
    probe = ray.remote(lambda: __import__("lifecycle_probe").VALUE)
    env_before = os.environ.get("PYTHONPATH")

    # 1) the embedded local cluster: actors are real processes, gone after shutdown;
    #    init() while running reuses it; old steps and arrays fail clearly afterwards.
    #    Its workers get the driver's sys.path from the environment its daemons
    #    inherit, not from a runtime_env (which starts each worker through a second
    #    Python); the driver's own environment is as it was
    cluster = meshshard.init(num_hosts=2, devices_per_host=1)
    assert meshshard.init() is cluster
    assert os.environ.get("PYTHONPATH") == env_before
    assert not ray.get_runtime_context().runtime_env, ray.get_runtime_context().runtime_env
    assert ray.get(probe.remote()) == 42
    pids = ray.get([a.ping.remote() for a in cluster._actors])
    assert len(set(pids)) == 2 and os.getpid() not in pids
    m = mlp.MLP(num_layers=2); b = mlp.make_batch(8); st = mlp.make_state(m, b["x"])
    step = meshshard.parallelize(mlp.train_step, method=meshshard.PipeshardParallel(
        num_micro_batches=2, stages=[(1, 1), (1, 1)]))
    s, loss = step(st, b)
    exe = step.executable
    helpers = psutil.Process().children(recursive=True)  # gcs, raylet, agents, actors
    assert set(pids) <= {{p.pid for p in helpers}}
    t0 = time.perf_counter()
    meshshard.shutdown()
    assert not ray.is_initialized()
    gone, alive = psutil.wait_procs(helpers, timeout=5)
    assert not alive, ("helper processes outlived shutdown() by 5 s", alive)
    print("helpers gone %.1f s after shutdown() began" % (time.perf_counter() - t0))
    for use in (lambda: np.asarray(s.params["dense0"]["kernel"]), lambda: exe(st, b)):
        try:
            use()
            raise AssertionError("no error after shutdown")
        except MeshshardRuntimeError as e:
            assert "cluster that was shut down" in str(e), e

    # 2) joining an existing multi-node Ray cluster: one host-actor per node
    c = Cluster(initialize_head=True, head_node_args={{"num_cpus": 1}})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ms = meshshard.init(address=c.address, devices_per_host=2)
    assert ms.spec.num_hosts == 2 and ms.spec.devices_per_host == 2
    assert ray.get(probe.remote()) == 42  # a joined cluster's workers: by runtime_env
    nodes = ray.get([a.ping.remote() for a in ms._actors])
    m = mlp.MLP(num_layers=2); b = mlp.make_batch(8); st = mlp.make_state(m, b["x"])
    step = meshshard.parallelize(mlp.train_step, method=meshshard.PipeshardParallel(
        num_micro_batches=2, stages=[(1, 2), (1, 2)]))
    s, loss = step(st, b)
    ref_s, ref_loss = jax.jit(mlp.train_step)(st, b)
    np.testing.assert_allclose(np.asarray(loss), np.asarray(ref_loss), rtol=1e-6)
    meshshard.shutdown()
    ray.shutdown()
    c.shutdown()
    print("LIFECYCLE OK")
    """
)


@pytest.mark.ray
@pytest.mark.own_cluster  # a subprocess with its own Ray: runs beside the shared one
def test_shutdown_leaves_no_processes_and_join_existing_cluster(tmp_path):
    import pathlib

    root = str(pathlib.Path(__file__).resolve().parent.parent)
    script = tmp_path / "lifecycle.py"
    script.write_text(SCRIPT.format(root=root, probe=str(tmp_path / "probe")))
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=480
    )
    assert "LIFECYCLE OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_shutdown_stops_ray_processes_that_outlive_it_and_no_other_child():
    """A Ray helper slow to exit after ``ray.shutdown()`` (a runtime-env agent on a
    loaded machine outlived it by 5 s in CI) is stopped, even one that ignores SIGTERM;
    a child process of the user's is neither listed nor touched."""
    import psutil

    from meshshard.runtime.cluster import _ray_helpers, _reap

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    ray_like = subprocess.Popen([sys.executable, "-c", stubborn, f"{os.sep}ray{os.sep}agent.py"])
    users = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.5)
        found = {p.pid for p in _ray_helpers()}
        assert ray_like.pid in found and users.pid not in found
        _reap([psutil.Process(ray_like.pid)], timeout_s=0.2)
        assert ray_like.poll() is not None  # stopped (killed: it ignores SIGTERM)
        assert users.poll() is None
    finally:
        for p in (ray_like, users):
            p.kill()
            p.wait()

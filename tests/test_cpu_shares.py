"""Local host-actors keep XLA:CPU's threads on their share of the machine's cores
(``runtime/cpu_shares.py``); their Python threads may still run anywhere."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from meshshard.runtime import cpu_shares
from meshshard.runtime.cluster import RayCluster


def test_shares_split_the_cores_or_go_round_robin():
    assert cpu_shares.core_shares([1], [0, 1]) == [(0, 1)]
    assert cpu_shares.core_shares([1, 1, 1], [0, 1]) == [(0,), (1,), (0,)]
    assert cpu_shares.core_shares([1, 1], [5, 3, 4, 2]) == [(2, 3), (4, 5)]
    # cores left over after equal blocks stay off the actors' shares
    assert cpu_shares.core_shares([1, 1, 1], range(7)) == [(0, 1), (2, 3), (4, 5)]
    # an actor's devices may each run a program at once: at least one core each
    assert cpu_shares.core_shares([2, 1, 1], range(4)) == [(0, 1), (2,), (3,)]
    assert cpu_shares.core_shares([4, 4], range(2)) == [(0, 1), (0, 1)]
    with pytest.raises(ValueError, match="actors of >= 1 device"):
        cpu_shares.core_shares([], [0])
    with pytest.raises(ValueError, match="some cores"):
        cpu_shares.core_shares([1, 1], [])


def test_a_share_this_thread_cannot_use_changes_nothing():
    before = os.sched_getaffinity(0)
    assert not cpu_shares.start_backend_on([max(before) + 1000])
    assert os.sched_getaffinity(0) == before


def test_only_local_cpu_clusters_get_shares(monkeypatch):
    spec = SimpleNamespace(devices_per_host=1)
    local = SimpleNamespace(_nodes=None, platform="cpu", _actors=[None] * 4, blocks=(), spec=spec)
    want = cpu_shares.core_shares([1] * 4, os.sched_getaffinity(0))
    assert RayCluster._core_shares(local) == want
    # a layout of one actor per mesh block: each block's own device count
    split = SimpleNamespace(**{**vars(local), "blocks": ((0, 0, 2), (0, 2, 2), (1, 0, 4))})
    assert RayCluster._core_shares(split) == cpu_shares.core_shares(
        [2, 2, 4], os.sched_getaffinity(0)
    )
    joined = SimpleNamespace(_nodes=["node-a"], platform="cpu", _actors=[None] * 4)
    assert RayCluster._core_shares(joined) is None
    gpus = SimpleNamespace(_nodes=None, platform="gpu", _actors=[None] * 4)
    assert RayCluster._core_shares(gpus) is None
    monkeypatch.setenv("MESHSHARD_CPU_SHARES", "0")
    assert RayCluster._core_shares(local) is None


_CHILD = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
from meshshard.runtime.cpu_shares import start_backend_on
from tests.test_cpu_shares import thread_affinities
before = os.sched_getaffinity(0)
assert start_backend_on([int(sys.argv[1])])
assert os.sched_getaffinity(0) == before, "the calling thread was not widened again"
print(sorted(thread_affinities()["tf_XLAEigen"]))
"""


def thread_affinities(actor_self=None) -> dict:
    """This process's threads: name -> the set of core tuples they may run on (also
    run inside host-actors, as ``actor.__ray_call__.remote(thread_affinities)``)."""
    out: dict = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            cores = tuple(sorted(os.sched_getaffinity(int(tid))))
        except OSError:  # the thread ended meanwhile
            continue
        out.setdefault(name, set()).add(cores)
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to narrow to one")
def test_xla_threads_keep_the_share_and_the_caller_is_widened_again():
    """In a fresh process: XLA's compute pool is made on the one core asked for."""
    core = max(os.sched_getaffinity(0))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(core)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == f"[({core},)]", out.stdout

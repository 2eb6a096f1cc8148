"""Shared fixtures: 8 emulated CPU devices in the test process, one Ray cluster per session."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
os.environ.setdefault("MESHSHARD_CHECKS", "1")  # IR invariants after every compiler pass

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import meshshard  # noqa: E402
from meshshard.runtime.cluster import ThreadsCluster, use_cluster  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """The embedded local Ray cluster (4 host-actors x 2 CPU devices), shared by all tests."""
    cluster = meshshard.init()
    yield cluster
    meshshard.shutdown()


@pytest.fixture
def threads_cluster(request):
    """Workers as threads of this process (same streams and programs as on Ray)."""
    with use_cluster(ThreadsCluster(4, 2)) as cluster:
        yield cluster


def with_fabric_costs(cluster):
    """``cluster`` planning with the NIC and fabric figures for in-program collectives
    instead of this machine's measured ones: on those the solver keeps these tests' small
    models whole (correctly: a collective here costs more than the work it would split),
    and the tests are about running sharded plans."""
    from dataclasses import replace

    cluster.spec = replace(cluster.spec, mesh_collective_latency=(), mesh_collective_bandwidth=())
    return cluster


@pytest.fixture
def sharded_threads_cluster():
    """The threads cluster (4 hosts x 2), planning with the fabric's collective costs."""
    with use_cluster(ThreadsCluster(4, 2)) as cluster:
        yield with_fabric_costs(cluster)


def assert_trees_close(ref, got, rtol=1e-5):
    """Each leaf of ``got`` equals ``ref`` within ``rtol`` (norm of the difference over the
    norm of the reference, per leaf: elementwise ratios of near-zero Adam updates are
    rounding noise)."""
    ref_leaves, tree = jax.tree_util.tree_flatten_with_path(ref)
    got_leaves = jax.tree.leaves(got)
    assert len(ref_leaves) == len(got_leaves)
    for (path, a), b in zip(ref_leaves, got_leaves, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (
            jax.tree_util.keystr(path),
            a.shape,
            b.shape,
        )
        denom = max(float(np.linalg.norm(a.astype(np.float64))), 1e-30)
        rel = float(np.linalg.norm(a.astype(np.float64) - b.astype(np.float64))) / denom
        assert rel <= rtol, f"{jax.tree_util.keystr(path)}: relative error {rel:.2e} > {rtol}"

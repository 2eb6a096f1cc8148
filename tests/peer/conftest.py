"""Fixtures of the ported peer tests."""

import pytest

from meshshard.runtime.cluster import ThreadsCluster, use_cluster


@pytest.fixture
def one_host_cluster():
    """One host of 4 devices as threads (Alpa's shard and local-mesh runtime tests use 4
    local devices)."""
    with use_cluster(ThreadsCluster(1, 4)) as cluster:
        yield cluster

"""Every strategy reshards exactly, on random meshes, shapes and specs (hypothesis).

A NumPy executor written here, independent of the planners' own checker, runs the
messages on a random array: every source device starts with its tile, each message
copies its block from the sender device into every listed destination device, and
(for ``local_allgather`` and ``broadcast``, which may end in local all-gathers) a
host's devices holding the same tile then share what they received.  Every destination device must end up with exactly the NumPy slice of
its tile, every element delivered once.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshshard.cluster import ClusterSpec
from meshshard.plan import MeshSpec
from meshshard.resharding import STRATEGIES, check_messages, plan_resharding
from meshshard.resharding.search import broadcast_search
from meshshard.tiles import device_blocks, resharding_problem

CLUSTER = ClusterSpec(name="test-6x4", num_hosts=6, devices_per_host=4)
AXES = ("host", "device")


@st.composite
def spec_for(draw, ndim: int):
    """A spec over ``ndim`` dims: each mesh axis on at most one dim (or none), dims may
    take both axes in either order."""
    entries: list[list[str]] = [[] for _ in range(ndim)]
    for ax in draw(st.permutations(AXES)):
        dim = draw(st.integers(-1, ndim - 1))
        if dim >= 0:
            entries[dim].append(ax)
    spec = []
    for e in entries:
        spec.append(None if not e else e[0] if len(e) == 1 else tuple(e))
    while spec and spec[-1] is None and draw(st.booleans()):
        spec.pop()  # trailing dims may be omitted
    return tuple(spec)


def parts(spec, mesh_shape, ndim):
    size = dict(zip(AXES, mesh_shape, strict=True))
    out = [1] * ndim
    for d, e in enumerate(spec):
        for ax in () if e is None else (e,) if isinstance(e, str) else e:
            out[d] *= size[ax]
    return out


@st.composite
def problems(draw):
    src_shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    dst_shape = (draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    ndim = draw(st.integers(1, 3))
    src_spec, dst_spec = draw(spec_for(ndim)), draw(spec_for(ndim))
    ps, pd = parts(src_spec, src_shape, ndim), parts(dst_spec, dst_shape, ndim)
    shape = tuple(int(np.lcm(a, b)) * draw(st.integers(1, 2)) for a, b in zip(ps, pd, strict=True))
    first = draw(st.integers(0, 6 - src_shape[0] - dst_shape[0]))
    src_hosts = tuple(range(first, first + src_shape[0]))
    dst_hosts = tuple(range(first + src_shape[0], first + src_shape[0] + dst_shape[0]))
    if draw(st.booleans()):  # destination hosts before the source's
        src_hosts, dst_hosts = (
            tuple(h + dst_shape[0] for h in src_hosts),
            tuple(h - src_shape[0] for h in dst_hosts),
        )
    return resharding_problem(
        shape,
        draw(st.sampled_from(["int32", "float32", "int8"])),
        MeshSpec(0, src_shape, src_hosts),
        src_spec,
        MeshSpec(1, dst_shape, dst_hosts),
        dst_spec,
    )


def scaled(problem, scale: int):
    """A drawn ``problem`` with its first dimension grown to about ``scale`` elements (the
    bounds' property tests run each case at a latency- and a bandwidth-bound size)."""
    f = max(1, scale // int(np.prod(problem.shape)))
    return resharding_problem(
        (problem.shape[0] * f,) + problem.shape[1:],
        problem.dtype,
        problem.src,
        problem.src_spec,
        problem.dst,
        problem.dst_spec,
    )


def strategy_times(p, cluster):
    """``(strategy, simulated seconds)`` of every strategy's plan for ``p`` (the bounded
    search with a small node budget): what no lower bound may exceed."""
    from meshshard.resharding import simulate_resharding

    for strategy in STRATEGIES:
        if strategy == "broadcast_search":
            msgs, _ = broadcast_search(p, cluster, max_nodes=2000)
        else:
            msgs = plan_resharding(p, strategy, cluster, simulate=False).messages
        yield strategy, simulate_resharding(p, msgs, cluster)


def tiles(mesh, spec, shape):
    blocks = device_blocks(mesh.shape, spec, shape)
    return {
        (h, d): blocks[i * mesh.shape[1] + d]
        for i, h in enumerate(mesh.hosts)
        for d in range(mesh.shape[1])
    }


def rel(index, tile):
    assert all(t0 <= a and b <= t1 for (a, b), (t0, t1) in zip(index, tile, strict=True)), (
        f"block {index} outside tile {tile}"
    )
    return tuple(slice(a - t0, b - t0) for (a, b), (t0, _) in zip(index, tile, strict=True))


def execute(problem, messages, array, gather: bool):
    """Run ``messages`` on ``array``; return each destination device's buffer and how many
    times each of its elements arrived (directly, or shared by its host for ``gather``)."""
    src = tiles(problem.src, problem.src_spec, problem.shape)
    dst = tiles(problem.dst, problem.dst_spec, problem.shape)
    have = {dev: array[tuple(slice(a, b) for a, b in t)].copy() for dev, t in src.items()}
    shapes = {dev: tuple(b - a for a, b in t) for dev, t in dst.items()}
    out = {dev: np.zeros(s, array.dtype) for dev, s in shapes.items()}
    count = {dev: np.zeros(s, np.int64) for dev, s in shapes.items()}
    for m in messages:
        assert m.nbytes == sum(
            have[(m.src, b.src_device)][rel(b.index, src[(m.src, b.src_device)])].nbytes
            for b in m.parts
        )
        receivers = m.group[1:] if m.group else (m.dst,)
        assert len(m.dst_devices) == len(receivers)
        for b in m.parts:  # a host-level message carries several blocks
            block = have[(m.src, b.src_device)][rel(b.index, src[(m.src, b.src_device)])]
            for h, devs in zip(receivers, b.dst_devices, strict=True):
                for d in devs:
                    where = rel(b.index, dst[(h, d)])
                    out[(h, d)][where] = block
                    count[(h, d)][where] += 1
    if gather:  # a device takes what it lacks from its host's devices with the same tile
        direct = {dev: c.copy() for dev, c in count.items()}
        for (h, d), tile in dst.items():
            lacking = direct[(h, d)] == 0
            for (h2, d2), tile2 in dst.items():
                if h2 == h and d2 != d and tile2 == tile:
                    take = lacking & (direct[(h2, d2)] > 0)
                    out[(h, d)][take] = out[(h2, d2)][take]
                    count[(h, d)][lacking] += direct[(h2, d2)][lacking]
    return out, count


def plan_messages(problem, strategy):
    if strategy == "broadcast_search":  # a small node budget keeps tests fast
        msgs, _ = broadcast_search(problem, CLUSTER, max_nodes=2000)
        return msgs
    return plan_resharding(problem, strategy, CLUSTER, simulate=False).messages


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problem=problems(), seed=st.integers(0, 2**16))
def test_every_destination_tile_is_exact(strategy, problem, seed):
    array = np.random.default_rng(seed).integers(-100, 100, problem.shape).astype(problem.dtype)
    messages = plan_messages(problem, strategy)
    gather = strategy in ("local_allgather", "broadcast")  # broadcast + local gather
    out, count = execute(problem, messages, array, gather)
    dst = tiles(problem.dst, problem.dst_spec, problem.shape)
    for dev, tile in dst.items():
        want = array[tuple(slice(a, b) for a, b in tile)]
        np.testing.assert_array_equal(out[dev], want, err_msg=f"device w{dev[0]}.{dev[1]}")
        assert (count[dev] == 1).all(), (
            f"w{dev[0]}.{dev[1]}: elements arrive {np.unique(count[dev])} times"
        )
    check_messages(problem, messages, allow_gather=gather)  # the planners' own checker agrees


@settings(max_examples=25, deadline=None)
@given(problem=problems())
def test_message_kinds_follow_each_strategy(problem):
    """send_recv and local_allgather send point to point to one device; the broadcast
    strategies send a slice once per receiving host set, to every device needing it."""
    for strategy in STRATEGIES:
        for m in plan_messages(problem, strategy):
            one_device = len(m.dst_devices) == 1 and len(m.dst_devices[0]) == 1
            if strategy in ("send_recv", "local_allgather"):
                assert not m.group and one_device
            else:
                assert bool(m.group) == (not one_device)
                if m.group:
                    assert m.group[0] == m.src and m.dst == m.group[1]
                    assert len(set(m.group)) == len(m.group)
    n_needs = sum(len(n.receivers) for n in problem.needs)
    assert len(plan_messages(problem, "send_recv")) == n_needs
    for strategy in ("broadcast_nolb", "broadcast_greedy", "broadcast_search"):
        assert len(plan_messages(problem, strategy)) == len(problem.needs)

"""Pass: choose each stage's layers and mesh, and place meshes on the cluster's hosts.

Each mesh gets whole host-actors of its own (a host-actor runs one instruction stream),
allocated in stage order, so stage ``i`` runs on mesh ``i``.  When the meshes need more
hosts than there are but fit the devices (``[(1, 2)] * 4`` on two 4-device hosts), each
mesh gets host-actors of its own block of a host's devices (:meth:`ClusterSpec.split`),
several meshes per host, and the plan is made for that worker view.
"""

from __future__ import annotations

from dataclasses import replace

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.methods import (
    DataParallel,
    FollowParallel,
    Method,
    PipeshardParallel,
    check_view,
)
from meshshard.passes.stage_graph import checked_stage_layers, group_layers
from meshshard.plan import MeshSpec


def stage_layout(
    method: Method, cluster: ClusterSpec, num_layers: int
) -> tuple[tuple[tuple[int, ...], ...], tuple[MeshSpec, ...], ClusterSpec]:
    """Layer groups per stage, the mesh of each stage and the cluster (or its worker
    view, when meshes share hosts) they are placed on, validated against the cluster."""
    if isinstance(method, FollowParallel):
        return (*follow_layout(method, num_layers), method.plan.cluster)
    if isinstance(method, DataParallel):
        shape = method.mesh_shape or (cluster.num_hosts, cluster.devices_per_host)
        return ((tuple(range(num_layers)),), *place_meshes([shape], cluster))
    assert isinstance(method, PipeshardParallel)
    if method.stages == "auto":
        raise MeshshardInputError(
            "stages='auto' needs the traced step's layer costs: use auto_layout(...)"
        )
    s = requested_stages(method, cluster, num_layers)
    _check_stage_count(s, num_layers)
    if method.stages == "uniform":
        if cluster.num_hosts % s:
            raise MeshshardInputError(
                f"stages='uniform' with {s} stages cannot split the {cluster.num_hosts} hosts "
                f"evenly; choose num_stages dividing {cluster.num_hosts} or list mesh shapes"
            )
        shapes = [(cluster.num_hosts // s, cluster.devices_per_host)] * s
    else:
        shapes = list(method.stages)
    if method.stage_layers is None or method.virtual_stages > 1:  # chunks: virtual_layout
        groups = group_layers(num_layers, len(shapes))
    else:
        groups = checked_stage_layers(method.stage_layers, num_layers)
    return (groups, *place_meshes(shapes, cluster))


def requested_stages(method: Method, cluster: ClusterSpec, num_layers: int) -> int | None:
    """How many stages ``method`` asks for on ``cluster`` for a model of ``num_layers``
    layers: listed meshes, or ``stages="uniform"`` (``num_stages``, else one per host,
    at most one per layer).  None where no count is asked for: one mesh, another step's
    layout, or ``stages="auto"`` (chosen from the layer costs)."""
    if not isinstance(method, PipeshardParallel) or method.stages == "auto":
        return None
    if method.stages == "uniform":
        if method.num_stages is None and method.stage_layers is not None:
            return len(method.stage_layers) // method.virtual_stages
        return method.num_stages or min(cluster.num_hosts, num_layers)
    return len(method.stages)


def auto_layout(method: PipeshardParallel, cluster: ClusterSpec, stats) -> tuple:
    """``stages="auto"``: the stage DP's layer groups, meshes, the cluster view they run
    on (split into workers when meshes share hosts) and the DP's plan.

    The DP chooses among Alpa's submeshes ``(1, 1), (1, 2), ..., (1, D), (h, D)`` (or the
    method's ``submeshes``); meshes that share a host run as host-actors of their own
    (:func:`place_meshes`).  With ``sharding="auto"`` it also chooses each submesh's
    logical ``(dp, tp)`` view, which the stage's mesh takes (the sharding ILP then solves
    on that view); otherwise every mesh is data parallel.
    """
    from meshshard.passes.stage_cost import AnalyticCost
    from meshshard.passes.stage_dp import stage_dp
    from meshshard.passes.stage_measured import measured_stats

    stats, measured = measured_stats(stats, cluster, method.stage_times)
    cost = AnalyticCost(stats, cluster)
    views = "all" if method.sharding == "auto" else "data_parallel"
    plan = stage_dp(
        cost,
        method.num_micro_batches,
        choices=method.submeshes or submesh_choices(cluster),
        views=views,
    )
    groups = tuple(tuple(range(st.lo, st.hi)) for st in plan.stages)
    meshes, workers = place_meshes([st.submesh for st in plan.stages], cluster)
    if views == "all":
        chosen = [tuple(st.logical[:2]) for st in plan.stages]
        meshes = with_views(meshes, chosen, "the stage DP's logical views")
    return groups, meshes, workers, plan, measured


def method_views(method: Method) -> tuple | None:
    """The logical view the method asks for on each stage mesh (None: none asked)."""
    if isinstance(method, PipeshardParallel):
        return method.logical_shapes
    view = getattr(method, "logical_shape", None)
    return None if view is None else (view,)


def with_views(meshes: tuple[MeshSpec, ...], views, what: str) -> tuple[MeshSpec, ...]:
    """``meshes`` with logical view ``views[i]`` on the ``i``-th (None: keep the physical
    shape), checked against each mesh's real shape; ``what`` names the argument."""
    if views is None:
        return meshes
    if len(views) != len(meshes):
        raise MeshshardInputError(
            f"{what} lists {len(views)} views for the plan's {len(meshes)} meshes; pass one "
            "(or None) per mesh"
        )
    return tuple(
        replace(m, view=check_view(v, m.shape, f"{what}[{i}]" if len(meshes) > 1 else what))
        for i, (m, v) in enumerate(zip(meshes, views, strict=True))
    )


def follow_layout(method: FollowParallel, num_layers: int):
    """The followed plan's layer groups and meshes (its first replica's, when its stages
    have data-parallel replicas); its stages must cover these layers."""
    plan = method.plan
    groups = tuple(st.layers for st in plan.stages)
    have = sum(len(g) for g in groups)
    if have != num_layers:
        auto = method.followed_layers
        why = (
            f"; the followed step was cut into layers automatically (layers={auto!r}) and "
            f"this step was clustered into {num_layers} layers to follow it, which its "
            "model cannot give: put mark_pipeline_boundary() calls in the model and drop "
            "layers= from the followed step's method"
            if auto is not None
            else ""
        )
        raise MeshshardInputError(
            f"{method!r}: this step has {num_layers} layers (pipeline boundaries + 1) but "
            f"the followed step's {len(groups)} stages hold {have}; both steps must call "
            f"the same model (the same mark_pipeline_boundary() calls){why}"
        )
    return groups, plan.meshes[: len(plan.meshes) // method.followed_replicas]


def _check_stage_count(num_stages: int, num_layers: int) -> None:
    if num_stages <= num_layers:
        return
    if num_layers == 1:
        raise MeshshardInputError(
            f"{num_stages} pipeline stages were asked for, but the model has no pipeline "
            "boundary: call meshshard.mark_pipeline_boundary() between layers in the "
            "forward pass, or use one stage (DataParallel)"
        )
    raise MeshshardInputError(
        f"{num_stages} pipeline stages were asked for, but the model's "
        f"{num_layers - 1} pipeline boundaries allow at most {num_layers} stages; add "
        "mark_pipeline_boundary() calls or ask for fewer stages"
    )


def place_meshes(
    shapes: list[tuple[int, int]], cluster: ClusterSpec
) -> tuple[tuple[MeshSpec, ...], ClusterSpec]:
    """Meshes of ``shapes`` in stage order and the cluster view they run on.

    Whole host-actors per mesh when the hosts suffice (:func:`allocate_meshes`);
    otherwise each mesh gets host-actors of its own block of devices, several per host
    (:meth:`ClusterSpec.split`): a ``(1, d)`` mesh one worker of ``d`` devices, an
    ``(h, D)`` mesh ``h`` whole-host workers.

    >>> c = ClusterSpec(num_hosts=2, devices_per_host=4)
    >>> meshes, workers = place_meshes([(1, 2), (1, 4), (1, 1), (1, 1)], c)
    >>> [(m.shape, m.hosts) for m in meshes]
    [((1, 2), (0,)), ((1, 4), (1,)), ((1, 1), (2,)), ((1, 1), (3,))]
    >>> workers.worker_blocks
    ((1, 0, 2), (0, 0, 4), (1, 2, 1), (1, 3, 1))
    """
    fits = sum(h * d for h, d in shapes) <= cluster.num_devices
    fits = fits and all(d <= cluster.devices_per_host for _, d in shapes)
    if sum(h for h, _ in shapes) <= cluster.num_hosts or not fits:
        return allocate_meshes(shapes, cluster), cluster  # (its error says what is too big)
    return share_hosts(shapes, cluster)


def share_hosts(
    shapes: list[tuple[int, int]], cluster: ClusterSpec
) -> tuple[tuple[MeshSpec, ...], ClusterSpec]:
    """Place ``shapes`` with several meshes per host; see :func:`place_meshes`."""
    D = cluster.devices_per_host
    bad = [s for s in shapes if not ((s[0] == 1 and 0 < s[1] <= D) or s[1] == D)]
    if bad:
        raise MeshshardInputError(
            f"the stages ask for meshes {shapes}, more hosts than {cluster} has; meshes can "
            f"share a host only as (1, d) inside one host or as whole hosts (h, {D}), and "
            f"{bad} is neither. Ask for fewer or smaller meshes"
        )
    spots = place_submeshes(list(shapes), cluster, exact=False)
    # one worker per (host, first device) block, numbered in mesh order (so the meshes
    # of data-parallel replicas, listed after the stages', are the stages' workers + H)
    blocks, meshes = [], []
    for i, ((_, d), (hosts, first)) in enumerate(zip(shapes, spots, strict=True)):
        workers = tuple(range(len(blocks), len(blocks) + len(hosts)))
        blocks += [(host, first, d) for host in hosts]
        meshes.append(MeshSpec(i, shapes[i], workers))
    return tuple(meshes), cluster.split(blocks)


def allocate_meshes(shapes: list[tuple[int, int]], cluster: ClusterSpec) -> tuple[MeshSpec, ...]:
    """Give each mesh shape its own consecutive hosts; error if the cluster is too small."""
    need_hosts = sum(h for h, _ in shapes)
    need_devices = sum(h * d for h, d in shapes)
    too_wide = [d for _, d in shapes if d > cluster.devices_per_host]
    if too_wide:
        d = cluster.devices_per_host
        wide = sorted({(h, w) for h, w in shapes if w > d})
        fixes = ", ".join(f"({h * w // d}, {d}) for {(h, w)}" for h, w in wide if h * w % d == 0)
        raise MeshshardInputError(
            f"mesh shape(s) {wide} ask for more devices per host than the cluster "
            f"{cluster} has ({d}): a mesh shape is (hosts, devices per host)"
            + (f"; the same devices span hosts as {fixes}" if fixes else "")
            + ", or start a cluster with more devices per host "
            "(meshshard.init(devices_per_host=...))"
        )
    if need_hosts > cluster.num_hosts:
        raise MeshshardInputError(
            f"the stages ask for meshes {shapes} ({need_devices} devices on {need_hosts} "
            f"host{'s' if need_hosts > 1 else ''}), but the cluster {cluster} has "
            f"{cluster.num_devices} devices; a mesh takes whole hosts, or a (1, d) block of "
            f"one host's {cluster.devices_per_host} devices. Ask for fewer or smaller "
            "meshes, or start a bigger cluster (meshshard.init(num_hosts=..., "
            "devices_per_host=...))"
        )
    meshes, next_host = [], 0
    for i, (h, d) in enumerate(shapes):
        meshes.append(MeshSpec(i, (h, d), tuple(range(next_host, next_host + h))))
        next_host += h
    return tuple(meshes)


def submesh_choices(cluster: ClusterSpec, whole_hosts: bool = False) -> tuple[tuple[int, int], ...]:
    """Alpa's submesh shapes: ``(1, 2^k)`` inside one host, then ``(h, D)`` for whole hosts.

    Stage meshes of these shapes tile the cluster whenever their device counts add up to
    it (powers of two pack into hosts).  ``whole_hosts`` keeps only ``(h, D)``.

    >>> submesh_choices(ClusterSpec(num_hosts=2, devices_per_host=4))
    ((1, 1), (1, 2), (1, 4), (2, 4))
    """
    d = cluster.devices_per_host
    small = [] if whole_hosts else [(1, 1 << k) for k in range(d.bit_length()) if (1 << k) < d]
    hosts = min(cluster.num_hosts, cluster.max_mesh_hosts or cluster.num_hosts)
    return tuple(small + [(h, d) for h in range(1, hosts + 1)])


def logical_shapes(submesh: tuple[int, int], devices_per_host: int) -> tuple[tuple[int, int], ...]:
    """Logical ``(dp, tp)`` views of a physical submesh, tensor parallelism inside a host.

    A ``(1, 4)`` submesh can run as 4-way data parallel, 2 x 2, or 4-way tensor parallel;
    ``tp`` divides the submesh's devices per host (and so never crosses a host).

    >>> logical_shapes((1, 4), 8)
    ((4, 1), (2, 2), (1, 4))
    >>> logical_shapes((2, 8), 8)
    ((16, 1), (8, 2), (4, 4), (2, 8))
    """
    h, d = submesh
    del devices_per_host  # tp <= d <= devices_per_host by construction
    return tuple((h * d // tp, tp) for tp in range(1, d + 1) if d % tp == 0)


def place_submeshes(
    shapes: list[tuple[int, int]], cluster: ClusterSpec, exact: bool = True
) -> tuple[tuple[tuple[int, ...], int], ...]:
    """Where each stage's submesh sits: ``(hosts, first device)`` per shape, in order.

    Whole-host shapes ``(h, D)`` take consecutive free hosts; a ``(1, d)`` shape takes the
    first host with ``d`` free devices at an offset that is a multiple of ``d`` (power-of-
    two sizes, placed largest first, always pack).  This is the tiling the stage DP
    assumes; an error says when shapes cannot tile the cluster (or, with ``exact``,
    leave devices unused).

    >>> c = ClusterSpec(num_hosts=2, devices_per_host=8)
    >>> place_submeshes([(1, 4), (1, 2), (1, 2), (1, 8)], c)
    (((1,), 0), ((1,), 4), ((1,), 6), ((0,), 0))
    """
    d_host = cluster.devices_per_host
    free = [d_host] * cluster.num_hosts  # devices left per host (filled from offset 0 up)
    order = sorted(range(len(shapes)), key=lambda i: -shapes[i][0] * shapes[i][1])
    placed: dict[int, tuple[tuple[int, ...], int]] = {}
    for i in order:
        h, d = shapes[i]
        if d == d_host:
            hosts = [k for k in range(cluster.num_hosts) if free[k] == d_host][:h]
            if len(hosts) == h:
                for k in hosts:
                    free[k] = 0
                placed[i] = (tuple(hosts), 0)
                continue
        elif h == 1 and d < d_host:
            k = next((k for k in range(cluster.num_hosts) if free[k] >= d), None)
            if k is not None:
                placed[i] = ((k,), d_host - free[k])
                free[k] -= d
                continue
        raise MeshshardInputError(
            f"the submeshes {list(shapes)} do not tile {cluster}: no room for {shapes[i]} "
            "(a submesh is (1, d) inside one host or (h, devices_per_host) of whole hosts, "
            + (
                "and all of them together must use every device once)"
                if exact
                else "and all of them together must fit the cluster's devices)"
            )
        )
    if exact and any(free):
        raise MeshshardInputError(
            f"the submeshes {list(shapes)} leave devices of {cluster} unused "
            f"({sum(free)} free); their device counts must add up to {cluster.num_devices}"
        )
    return tuple(placed[i] for i in range(len(shapes)))

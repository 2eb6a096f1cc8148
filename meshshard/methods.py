"""Parallelization methods: frozen, validated descriptions of how to split a step.

>>> PipeshardParallel(num_micro_batches=4, stages=[(1, 2), (1, 2)])
PipeshardParallel(num_micro_batches=4, stages=((1, 2), (1, 2)), schedule='1f1b', num_stages=None, resharding='broadcast')
"""

from __future__ import annotations

import numbers
import operator
from dataclasses import dataclass, field, fields

from meshshard.errors import MeshshardInputError
from meshshard.plan import is_view

SCHEDULES = ("1f1b", "gpipe", "eager_1f1b", "interleaved_1f1b", "zb_h1", "2bw")
#: How values are sharded inside each mesh (``passes/shard_plan.py``).
SHARDING_MODES = ("data_parallel", "auto", "zero2", "zero3")
#: Cross-mesh resharding strategies (see ``meshshard.resharding``).  ``broadcast`` is ours;
#: the ``broadcast_*`` variants are the paper's baselines, kept for comparison.
RESHARDING_STRATEGIES = (
    "broadcast",
    "send_recv",
    "local_allgather",
    "broadcast_nolb",
    "broadcast_greedy",
    "broadcast_search",
)
#: Communication-scheduling switches (TriRace; see ``meshshard.passes.comm_schedule``).
COMM_SWITCHES = ("allreduce", "sparse", "p2p", "topology")


def _check_stage_times(times) -> tuple:
    """``((lo, hi, (h, d), seconds), ...)`` normalised, or a clear error."""
    out = []
    for i, t in enumerate(times):
        try:
            lo, hi, (h, d), sec = t
            ok = 0 <= int(lo) < int(hi) and int(h) > 0 and int(d) > 0 and float(sec) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise MeshshardInputError(
                f"PipeshardParallel.stage_times[{i}]={t!r}: pass (lo, hi, (hosts, devices), "
                "seconds) with layers lo..hi-1 and seconds > 0 per micro-batch"
            )
        out.append((int(lo), int(hi), (int(h), int(d)), float(sec)))
    return tuple(out)


def _as_int(x):
    """``x`` as a Python int when it is an integer of any kind (``np.int64(2)`` from
    arithmetic on array shapes), else unchanged: plans print and hash Python ints."""
    if isinstance(x, numbers.Integral) and not isinstance(x, bool):
        return int(x)
    return x


def _plain_ints(obj, names: tuple[str, ...]) -> None:
    """Replace integer fields ``names`` of frozen ``obj`` by Python ints (see :func:`_as_int`)."""
    for name in names:
        object.__setattr__(obj, name, _as_int(getattr(obj, name)))


def _check_shape(shape, what: str) -> tuple[int, int]:
    if isinstance(shape, tuple | list):
        shape = tuple(_as_int(x) for x in shape)
    if (
        not isinstance(shape, tuple | list)
        or len(shape) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in shape)
    ):
        raise MeshshardInputError(
            f"{what} must be a mesh shape (hosts, devices_per_host) of two positive ints, "
            f"got {shape!r}; e.g. (1, 2) for two devices of one host"
        )
    return (int(shape[0]), int(shape[1]))


def check_view(view, shape: tuple[int, int] | None, what: str) -> tuple[int, int] | None:
    """``view`` as a logical ``(a, b)`` shape of the physical ``shape`` (None: the shape
    itself), or an error naming ``what`` and the views that would fit."""
    if view is None:
        return None
    view = _check_shape(view, what)
    if shape is None:
        return view
    h, d = shape
    if not is_view(view, shape):
        fits = [(h * d // b, b) for b in range(1, d + 1) if d % b == 0]
        raise MeshshardInputError(
            f"{what}={view} is not a logical view of the {h}x{d} mesh: its device axis must "
            f"divide the {d} devices per host and the sizes must multiply to {h * d}; "
            f"views that fit: {fits}"
        )
    return None if view == shape else view


@dataclass(frozen=True)
class DataParallel:
    """One mesh runs the whole step, the batch sharded over all its devices.

    Args:
        mesh_shape: (hosts, devices per host); None takes the whole cluster.
        num_micro_batches: gradient-accumulation micro-batches per step (default 1).
    """

    mesh_shape: tuple[int, int] | None = None
    num_micro_batches: int = 1

    def __post_init__(self) -> None:
        _plain_ints(self, ("num_micro_batches",))
        if self.mesh_shape is not None:
            object.__setattr__(
                self, "mesh_shape", _check_shape(self.mesh_shape, "DataParallel.mesh_shape")
            )
        _check_micro_batches(self.num_micro_batches, "DataParallel")


@dataclass(frozen=True)
class ShardParallel(DataParallel):
    """One mesh runs the whole step, every value sharded as the sharding ILP infers
    (Alpa's ShardParallel): data, tensor or ZeRO-like parallelism, or a mix, per value.

    Args:
        mesh_shape: (hosts, devices per host); None takes the whole cluster.
        num_micro_batches: gradient-accumulation micro-batches per step (default 1).
        sharding: ``"auto"`` (default), or a fixed mode as in ``PipeshardParallel``.
        logical_shape: the ``(a, b)`` axis sizes the shardings see on the mesh's devices
            (Alpa's logical mesh): ``mesh_shape=(1, 4), logical_shape=(2, 2)`` runs one
            host's 4 devices as a 2 x 2 mesh, so a value can be split 2 ways over each
            axis (data parallel on one, tensor parallel on the other).  ``b`` divides the
            devices per host (the ``device`` axis stays inside a host).  None: the mesh's
            own shape.

    >>> ShardParallel((2, 2))
    ShardParallel(mesh_shape=(2, 2), num_micro_batches=1, sharding='auto')
    >>> ShardParallel((1, 4), logical_shape=(2, 2))
    ShardParallel(mesh_shape=(1, 4), num_micro_batches=1, sharding='auto', logical_shape=(2, 2))
    """

    sharding: str = "auto"
    logical_shape: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_sharding(self.sharding, "ShardParallel")
        view = check_view(self.logical_shape, self.mesh_shape, "ShardParallel.logical_shape")
        object.__setattr__(self, "logical_shape", view)

    def __repr__(self) -> str:
        view = "" if self.logical_shape is None else f", logical_shape={self.logical_shape!r}"
        return (
            f"ShardParallel(mesh_shape={self.mesh_shape!r}, num_micro_batches="
            f"{self.num_micro_batches!r}, sharding={self.sharding!r}{view})"
        )


def _check_sharding(mode, owner: str) -> None:
    if mode not in SHARDING_MODES:
        raise MeshshardInputError(
            f"{owner}.sharding={mode!r} is not one of {SHARDING_MODES}; 'auto' infers a "
            "spec for every value, the others fix a rule"
        )


@dataclass(frozen=True)
class PipeshardParallel:
    """Pipeline stages on separate meshes, data parallel inside each mesh.

    Args:
        num_micro_batches: micro-batches per step; the batch must divide by it.
        stages: ``"uniform"`` (``num_stages`` equal meshes, default one per host), ``"auto"``
            (layers -> stages -> meshes chosen by the stage DP on the cost model,
            :mod:`meshshard.passes.stage_dp`) or a list of mesh shapes
            ``(hosts, devices_per_host)``, one per stage, in order.
        schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"eager_1f1b"`` (warm-up
            ``2(S-i)-1`` forwards so sends overlap compute), ``"interleaved_1f1b"`` (with
            ``virtual_stages``), ``"zb_h1"`` (backward split into B and W) or ``"2bw"``
            (PipeDream-2BW; see :func:`meshshard.passes.schedules.two_bw`).
        num_stages: with ``stages="uniform"``, how many stages (default: one per host).
        resharding: how tensors cross between meshes: ``"broadcast"`` (default; one
            broadcast per slice and destination host set, load balanced), ``"send_recv"``
            or ``"local_allgather"`` (baselines), or a ``broadcast_*`` baseline variant.
        sharding: inside each mesh, ``"data_parallel"`` (default: the batch split, the
            rest whole), ``"auto"`` (the sharding ILP chooses every value's spec),
            ``"zero2"`` (optimizer state split) or ``"zero3"`` (parameters split too).
        layers: for a loss without ``mark_pipeline_boundary()`` calls, cut it into this
            many layers automatically (``"auto"``: one per matmul, at most 16), balancing
            FLOPs and minimising the bytes crossing each cut
            (:mod:`meshshard.passes.layer_cluster`); None (default) uses the markers.
        submeshes: with ``stages="auto"``, the mesh shapes the stage DP may give a stage
            (Alpa's manually specified submeshes); default: Alpa's ``(1, 1), (1, 2), ...,
            (1, D), (h, D)``.  Meshes that share a host run as host-actors of their own
            (``ClusterSpec.split``).
        stage_times: with ``stages="auto"``, measured seconds per micro-batch (forward +
            backward programs) of layer ranges on submeshes, ``((lo, hi, (h, d), s),
            ...)``: the stage DP scales its cost model's compute for those layers to
            match.  ``step.lower(..., profile=True)`` fills it from a profiled run.
        virtual_stages: model chunks per mesh with ``schedule="interleaved_1f1b"``
            (default 1; the plan's schedule grid shows the chunks, the repr does not).
        comm_schedule: communication-scheduling switches, any of ``"allreduce"``,
            ``"sparse"``, ``"p2p"``, ``"topology"`` (default none; only the order and
            priority of communication change, results are bit-identical).
        data_parallel: replicas of every stage (default 1).  Replica ``j`` of stage ``s``
            runs on its own mesh (the stage meshes repeated on the next hosts), takes the
            ``j``-th ``1/d`` of the micro-batches, and the replicas all-reduce their
            gradient accumulators once per step before the update
            (:mod:`meshshard.passes.replicas`).
        comm_chunk_bytes: with ``comm_schedule`` ``"allreduce"``, the size of the chunks a
            replicas' gradient all-reduce is cut into (default 4 MiB).
        remat: what each layer's forward keeps for its backward: None (default)
            everything differentiation saves; ``"dots"`` only matmul outputs, the
            backward computes the elementwise rest again
            (``jax.checkpoint_policies.dots_saveable``); ``"full"`` nothing, the backward
            redoes the layer's forward.  Split into per-stage programs, every saved value
            is written out by the forward and read back by the backward once per
            micro-batch; on XLA:CPU that traffic is much of what the split costs
            (benchmarks/RESULTS.md, "Residuals").
        fuse_forward_backward: where a worker runs a stage's forward and backward of
            one micro-batch back to back (the last stage under 1F1B, eager 1F1B,
            zero-bubble H1 and interleaved 1F1B; a single stage with micro-batches),
            run them as one program ``s{i}.FB`` (default True): the
            residuals the backward alone reads never leave it, and one dispatch is
            saved (:mod:`meshshard.passes.fuse_forward_backward`).  False keeps every
            forward and backward a program of its own (per-phase profiles).
        stage_layers: the layers each stage runs, one list of consecutive layer indices
            per stage, in order and covering every layer once (Alpa's
            ``ManualStageOption.forward_stage_layer_ids``): ``[[0], [1, 2, 3]]`` gives
            stage 0 the first layer and stage 1 the other three.  With
            ``virtual_stages=v`` one list per model chunk (``S * v``).  None (default):
            equal numbers of layers per stage.
        logical_shapes: one logical ``(a, b)`` view (or None) per stage mesh, as
            ``ShardParallel.logical_shape``: e.g. ``stages=[(1, 4), (1, 4)],
            logical_shapes=[(2, 2), None]`` shards stage 0 over a 2 x 2 view of its host's
            4 devices (useful with ``sharding="auto"``).  With ``stages="auto"`` and
            ``sharding="auto"`` the stage DP chooses each stage's view itself.
    """

    num_micro_batches: int
    stages: str | tuple[tuple[int, int], ...] = "uniform"
    schedule: str = "1f1b"
    num_stages: int | None = None
    resharding: str = "broadcast"
    sharding: str = field(default="data_parallel", repr=False)
    layers: str | int | None = None
    submeshes: tuple[tuple[int, int], ...] | None = None
    stage_times: tuple[tuple[int, int, tuple[int, int], float], ...] = field(default=(), repr=False)
    virtual_stages: int = field(default=1, repr=False)
    comm_schedule: frozenset[str] = field(default=frozenset(), repr=False)
    data_parallel: int = field(default=1, repr=False)
    comm_chunk_bytes: int = field(default=4 << 20, repr=False)
    logical_shapes: tuple[tuple[int, int] | None, ...] | None = field(default=None, repr=False)
    remat: str | None = field(default=None, repr=False)
    fuse_forward_backward: bool = field(default=True, repr=False)
    stage_layers: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _plain_ints(
            self,
            (
                "num_micro_batches",
                "data_parallel",
                "virtual_stages",
                "num_stages",
                "layers",
                "comm_chunk_bytes",
            ),
        )
        _check_micro_batches(self.num_micro_batches, "PipeshardParallel")
        if not isinstance(self.fuse_forward_backward, bool):
            raise MeshshardInputError(
                "PipeshardParallel.fuse_forward_backward must be True (run a stage's "
                "back-to-back forward and backward as one program) or False, got "
                f"{self.fuse_forward_backward!r}"
            )
        if self.remat not in (None, "dots", "full"):
            raise MeshshardInputError(
                f"PipeshardParallel.remat={self.remat!r}: pass None (keep every saved "
                "value), 'dots' (keep matmul outputs) or 'full' (recompute each layer)"
            )
        _check_data_parallel(self.data_parallel, self.num_micro_batches, self.stages)
        c = self.comm_chunk_bytes
        if not isinstance(c, int) or isinstance(c, bool) or c < 1:
            raise MeshshardInputError(
                f"PipeshardParallel.comm_chunk_bytes must be a positive int (bytes), got {c!r}"
            )
        _check_sharding(self.sharding, "PipeshardParallel")
        if self.submeshes is not None:
            if self.stages != "auto" or not self.submeshes:
                raise MeshshardInputError(
                    f"PipeshardParallel.submeshes={self.submeshes!r} lists the shapes "
                    "stages='auto' may choose from: pass a non-empty list with stages='auto'"
                )
            subs = tuple(
                _check_shape(s, f"PipeshardParallel.submeshes[{i}]")
                for i, s in enumerate(self.submeshes)
            )
            object.__setattr__(self, "submeshes", subs)
        if self.stage_times:
            object.__setattr__(self, "stage_times", _check_stage_times(self.stage_times))
            if self.stages != "auto":
                raise MeshshardInputError(
                    "PipeshardParallel.stage_times are measurements for the stage DP: pass "
                    "them with stages='auto'"
                )
        if self.layers is not None and self.layers != "auto":
            if not isinstance(self.layers, int) or isinstance(self.layers, bool) or self.layers < 1:
                raise MeshshardInputError(
                    f"PipeshardParallel.layers={self.layers!r}: pass 'auto', a positive int "
                    "number of layers, or None to use mark_pipeline_boundary() markers"
                )
        object.__setattr__(self, "comm_schedule", check_comm_switches(self.comm_schedule))
        if isinstance(self.stages, str):
            if self.stages not in ("uniform", "auto"):
                raise MeshshardInputError(
                    f"PipeshardParallel.stages={self.stages!r} is not understood; pass "
                    "'uniform', 'auto' or a list of mesh shapes such as [(1, 2), (1, 2)]"
                )
            if self.stages == "auto" and self.num_stages is not None:
                raise MeshshardInputError(
                    f"PipeshardParallel(stages='auto', num_stages={self.num_stages}): the stage "
                    "DP chooses the number of stages; drop num_stages or use stages='uniform'"
                )
        else:
            if not isinstance(self.stages, tuple | list) or not self.stages:
                raise MeshshardInputError(
                    f"PipeshardParallel.stages must be 'uniform' or a non-empty list of mesh "
                    f"shapes, got {self.stages!r}"
                )
            shapes = tuple(
                _check_shape(s, f"PipeshardParallel.stages[{i}]") for i, s in enumerate(self.stages)
            )
            object.__setattr__(self, "stages", shapes)
            if self.num_stages is not None and self.num_stages != len(shapes):
                raise MeshshardInputError(
                    f"PipeshardParallel.num_stages={self.num_stages} disagrees with the "
                    f"{len(shapes)} mesh shapes in stages; drop num_stages"
                )
        if self.schedule not in SCHEDULES:
            raise MeshshardInputError(
                f"PipeshardParallel.schedule={self.schedule!r} is not one of {SCHEDULES}"
            )
        if self.resharding not in RESHARDING_STRATEGIES:
            raise MeshshardInputError(
                f"PipeshardParallel.resharding={self.resharding!r} is not one of {RESHARDING_STRATEGIES}"
            )
        _check_virtual_stages(self.virtual_stages, self.schedule)
        object.__setattr__(self, "logical_shapes", self._checked_views())
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", self._checked_stage_layers())
        if self.num_stages is not None and (
            not isinstance(self.num_stages, int) or self.num_stages < 1
        ):
            raise MeshshardInputError(
                f"PipeshardParallel.num_stages must be a positive int, got {self.num_stages!r}"
            )

    def _checked_views(self) -> tuple | None:
        """``logical_shapes`` normalised (an entry equal to its mesh's shape -> None), or
        a clear error when it is not one view per stage mesh."""
        views = self.logical_shapes
        if views is None:
            return None
        if self.stages == "auto":
            raise MeshshardInputError(
                "PipeshardParallel(stages='auto', logical_shapes=...): the stage DP chooses "
                "each stage's mesh; with sharding='auto' it chooses their logical views "
                "too. Drop logical_shapes or list the stages' mesh shapes"
            )
        if not isinstance(views, tuple | list) or not views:
            raise MeshshardInputError(
                f"PipeshardParallel.logical_shapes={views!r}: pass one (a, b) view or None "
                "per stage mesh"
            )
        shapes = self.stages if isinstance(self.stages, tuple) else (None,) * len(views)
        if len(shapes) != len(views) or (
            self.stages == "uniform" and self.num_stages not in (None, len(views))
        ):
            raise MeshshardInputError(
                f"PipeshardParallel.logical_shapes has {len(views)} entries for "
                f"{len(shapes) if isinstance(self.stages, tuple) else self.num_stages} stage "
                "meshes; pass one view (or None) per stage"
            )
        return tuple(
            check_view(v, s, f"PipeshardParallel.logical_shapes[{i}]")
            for i, (v, s) in enumerate(zip(views, shapes, strict=True))
        )

    def _checked_stage_layers(self) -> tuple[tuple[int, ...], ...]:
        """``stage_layers`` as tuples, or a clear error when they are not consecutive
        runs of layers from 0, one per stage (or per chunk with ``virtual_stages``)."""
        given = self.stage_layers
        if self.stages == "auto":
            raise MeshshardInputError(
                "PipeshardParallel(stages='auto', stage_layers=...): the stage DP chooses "
                "which layers each stage runs; drop stage_layers or list the stages' mesh "
                "shapes"
            )
        usage = (
            "pass one list of consecutive layer indices per stage, in order, covering "
            "every layer once, e.g. stage_layers=[[0, 1], [2, 3, 4]]"
        )
        try:
            groups = tuple(tuple(operator.index(i) for i in g) for g in given)
        except TypeError:
            raise MeshshardInputError(
                f"PipeshardParallel.stage_layers={given!r}: {usage}"
            ) from None
        flat = [i for g in groups for i in g]
        if not groups or not all(groups) or flat != list(range(len(flat))):
            raise MeshshardInputError(f"PipeshardParallel.stage_layers={given!r}: {usage}")
        v = self.virtual_stages
        count = len(self.stages) if isinstance(self.stages, tuple) else self.num_stages
        if count is not None and len(groups) != count * v:
            per = f"{count} stages x {v} chunks" if v > 1 else f"{count} stages"
            raise MeshshardInputError(
                f"PipeshardParallel.stage_layers has {len(groups)} lists for {per}; pass "
                f"one list of layers per {'chunk' if v > 1 else 'stage'}"
            )
        if len(groups) % v:
            raise MeshshardInputError(
                f"PipeshardParallel.stage_layers has {len(groups)} lists, not a multiple of "
                f"virtual_stages={v}; pass one list of layers per model chunk"
            )
        return groups

    def __repr__(self) -> str:
        # fields added later show only when set, so existing plans print as before
        quiet = {
            "layers": None,
            "submeshes": None,
            "stage_times": (),
            "sharding": "data_parallel",
            "virtual_stages": 1,
            "comm_schedule": frozenset(),
            "data_parallel": 1,
            "comm_chunk_bytes": 4 << 20,
            "logical_shapes": None,
            "remat": None,
            "fuse_forward_backward": True,
            "stage_layers": None,
        }
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if not (f.name in quiet and getattr(self, f.name) == quiet[f.name])
        ]
        return f"PipeshardParallel({', '.join(parts)})"


def check_comm_switches(switches) -> frozenset[str]:
    """``switches`` as a frozenset of :data:`COMM_SWITCHES`, or an error naming the bad ones."""
    if isinstance(switches, str) or not isinstance(switches, tuple | list | set | frozenset):
        raise MeshshardInputError(
            f"comm_schedule={switches!r}: pass a set of switches from {COMM_SWITCHES}, "
            "e.g. comm_schedule={'p2p', 'allreduce'}"
        )
    bad = sorted(set(switches) - set(COMM_SWITCHES))
    if bad:
        raise MeshshardInputError(
            f"comm_schedule has unknown switches {bad}; pick from {COMM_SWITCHES}"
        )
    return frozenset(switches)


def _check_data_parallel(d, m: int, stages) -> None:
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise MeshshardInputError(
            f"PipeshardParallel.data_parallel must be a positive int, got {d!r}"
        )
    if m % d:
        raise MeshshardInputError(
            f"PipeshardParallel.data_parallel={d} must divide num_micro_batches={m}: each "
            "replica runs an equal share of the micro-batches"
        )
    if d > 1 and stages == "auto":
        raise MeshshardInputError(
            f"PipeshardParallel(data_parallel={d}, stages='auto'): the stage DP does not "
            "plan replicas; list the mesh shapes of one replica, e.g. stages=[(1, 2), (1, 2)]"
        )


def _check_virtual_stages(v, schedule: str) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise MeshshardInputError(
            f"PipeshardParallel.virtual_stages must be a positive int, got {v!r}"
        )
    if v > 1 and schedule != "interleaved_1f1b":
        raise MeshshardInputError(
            f"PipeshardParallel.virtual_stages={v} needs schedule='interleaved_1f1b' "
            f"(got schedule={schedule!r}); drop virtual_stages or change the schedule"
        )


def _check_micro_batches(m, owner: str) -> None:
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise MeshshardInputError(f"{owner}.num_micro_batches must be a positive int, got {m!r}")


class FollowParallel:
    """Run a step with the placement of another parallelized step (an eval step with
    its train step's): the same meshes and layers per stage, so every parameter is read
    where the other step left it, with no movement and no new actors.

    Args:
        step: the ``parallelize``d step to follow; it must have run (or been lowered)
            once, so its plan exists.
        num_micro_batches: micro-batches of this step (an eval step combines its results
            over them as the full-batch step would).

    >>> def train_step(state, batch): ...
    >>> FollowParallel(train_step)
    FollowParallel(train_step)
    """

    def __init__(self, step, num_micro_batches: int = 1):
        num_micro_batches = _as_int(num_micro_batches)
        _check_micro_batches(num_micro_batches, "FollowParallel")
        self.step = step
        self.num_micro_batches = num_micro_batches

    @property
    def plan(self):
        """The followed step's plan; a clear error when it has none yet."""
        plan = getattr(self.step, "plan", None)
        if plan is None:
            name = getattr(self.step, "__name__", repr(self.step))
            raise MeshshardInputError(
                f"FollowParallel({name}): that step has no plan yet; call it (or its "
                ".lower(...)) once before planning a step that follows it"
            )
        return plan

    @property
    def schedule(self) -> str:
        """The followed plan's pipeline schedule (``1f1b`` when it had none)."""
        name = self.plan.schedule.name
        return name if name in SCHEDULES else "1f1b"

    @property
    def resharding(self) -> str:
        return "broadcast"

    @property
    def followed_layers(self) -> str | int | None:
        """The followed step's ``layers=`` setting (None: cut by markers)."""
        return getattr(getattr(self.step, "method", None), "layers", None)

    @property
    def layers(self) -> int | None:
        """The followed step's layer count when its method cut the step into layers
        automatically (``layers=``): this step is cut into as many, by the same
        clustering, so its stage ``i`` runs the layers the followed stage ``i`` ran; None
        when the followed step was cut by ``mark_pipeline_boundary()`` markers."""
        if self.followed_layers is None:
            return None
        return sum(len(st.layers) for st in self.plan.stages)

    @property
    def followed_replicas(self) -> int:
        """The followed step's data-parallel replicas (``PipeshardParallel.data_parallel``)."""
        return getattr(getattr(self.step, "method", None), "data_parallel", 1)

    @property
    def data_parallel(self) -> int:
        """The followed step's replicas when this step's micro-batches divide among them
        (each replica runs its share on its own copy of the parameters), else 1: the
        followed plan's first replica alone, whose copies equal every other's."""
        d = self.followed_replicas
        return d if self.num_micro_batches % d == 0 else 1

    def __repr__(self) -> str:
        name = getattr(self.step, "__name__", type(self.step).__name__)
        return f"FollowParallel({name})"


Method = DataParallel | PipeshardParallel | FollowParallel


def sharding_mode(method) -> str:
    """The method's sharding mode (``data_parallel`` for methods without one)."""
    return getattr(method, "sharding", "data_parallel")

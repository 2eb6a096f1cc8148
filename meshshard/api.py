"""``meshshard.parallelize``: turn a train step into a planned, distributed step."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Sequence

import jax
import numpy as np

from meshshard._compat import jit_static_positions
from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.keys import leaf_signatures, physical_call, physical_leaves
from meshshard.long_work import LongWork, phase
from meshshard.methods import (
    DataParallel,
    FollowParallel,
    Method,
    PipeshardParallel,
    sharding_mode,
)
from meshshard.nnx_modules import WritesBack, holds_modules, write_in_place
from meshshard.plan import Plan
from meshshard.replay import check_replay, load_plan
from meshshard.static_args import (
    WithStatic,
    argnum_positions,
    dynamic_positions,
    static_key,
    static_positions,
)

log = logging.getLogger(__name__)

#: ``parallelize``'s default ``batch_argnums``: the second argument, where there is one
DEFAULT_BATCH_ARGNUMS = (1,)


class ParallelizedFunction:
    """A train step compiled for a cluster on first call; ``lower`` shows the plan without running.

    Calls with new argument shapes recompile.  See :func:`parallelize`.
    """

    def __init__(
        self,
        fn: Callable,
        method: Method | None,
        donate_argnums: Sequence[int],
        batch_argnums: Sequence[int],
        trace: str | None = None,
        _one_2bw_variant: bool = False,
        static_argnums: Sequence[int] | str = "auto",
        plan: Plan | str | os.PathLike | None = None,
        _statics_bound: bool = False,
    ):
        if trace is not None and not isinstance(trace, str | os.PathLike):
            raise MeshshardInputError(
                f"trace must be a file path for the Chrome-trace JSON, got {trace!r}; "
                "pass e.g. trace='step_trace.json'"
            )
        if method is None:
            method = DataParallel()  # the whole cluster as one data-parallel mesh
        if not isinstance(method, DataParallel | PipeshardParallel | FollowParallel):
            raise MeshshardInputError(
                "method must be DataParallel(), PipeshardParallel(...) or "
                f"FollowParallel(step), got {method!r}"
            )
        self.fn = fn
        self.method = method
        self.given_plan = load_plan(plan)
        self.donate_argnums = tuple(donate_argnums)
        self.batch_argnums = tuple(batch_argnums)
        # parallelize's default names the second argument; a step of one argument
        # (``add_one(x)``) then has no batch, as in Alpa, instead of an error
        self._default_batch = batch_argnums is DEFAULT_BATCH_ARGNUMS
        if static_argnums != "auto" and isinstance(static_argnums, str):
            raise MeshshardInputError(
                f"static_argnums must be 'auto' or argument positions, got {static_argnums!r}"
            )
        self.static_argnums = static_argnums if static_argnums == "auto" else tuple(static_argnums)
        self._variants: dict = {}  # static values -> the step compiled with them bound
        # a jax.jit-wrapped step's own static positions, per number of arguments; None
        # in a variant, whose function has them bound already (though functools'
        # update_wrapper copied the jitted function's options onto it)
        self._jit_static: dict[int, tuple[int, ...]] | None = None if _statics_bound else {}
        self._last_variant: ParallelizedFunction | None = None
        self._executables: dict = {}
        self._lowered: Plan | None = None
        self.last_compile_seconds: float | None = None
        self.trace_log = None
        self.program_times: dict[str, float] | None = None  # set by lower(profile=True)
        self._at_exit = False
        if trace is not None:
            self.record(trace)
        functools.update_wrapper(self, fn)
        self.pipelined = False  # run calls pipelined: 2BW's steady step (meshshard.two_bw)
        self._two_bw = None
        stale = isinstance(method, PipeshardParallel) and method.schedule == "2bw"
        if stale and self.given_plan is not None:
            raise MeshshardInputError(
                "plan= cannot run schedule='2bw': a 2BW step runs several programs (its "
                "first and steady steps), each planned on its own; drop plan="
            )
        if stale and not _one_2bw_variant:
            from meshshard.two_bw import TwoBWStep

            self._two_bw = TwoBWStep(
                lambda f, b: ParallelizedFunction(f, method, (), b, _one_2bw_variant=True),
                fn,
                batch_argnums,
                donate_argnums,
            )

    def record(self, trace: str | os.PathLike | None) -> None:
        """Record every later call's measured timeline for ``trace`` (a path; None stops
        recording).  What ``parallelize(..., trace=path)`` does; the bench CLI and the
        overhead benchmark switch it on and off."""
        from meshshard.runtime.trace_record import TraceLog

        if trace is None:
            self.trace_log = None
        elif self.trace_log is None or self.trace_log.path != os.fspath(trace):
            self.trace_log = TraceLog(os.fspath(trace))
        for exe in self._executables.values():
            exe.record(self.trace_log)
        for variant in self._variants.values():
            variant.trace_log = self.trace_log
            for exe in variant._executables.values():
                exe.record(self.trace_log)
        if self.trace_log is not None and not self._at_exit:
            self._at_exit = True
            atexit.register(_write_at_exit, weakref.ref(self))

    def write_trace(self, path: str | None = None) -> str:
        """Write the measured timeline of the recorded calls (the last 20) as Chrome-trace
        JSON to ``path`` (default: the ``trace=`` path); returns the path.  Also done at
        :meth:`release` and at interpreter exit."""
        if self.trace_log is None:
            raise MeshshardInputError(
                "this step records no trace; parallelize it with trace='out.json'"
            )
        return self.trace_log.write(path)

    def lower(
        self,
        *args,
        cluster: ClusterSpec | None = None,
        costs: bool = True,
        profile: bool = False,
    ) -> Plan:
        """The plan for these arguments on ``cluster`` (default: the running cluster, else
        ``ClusterSpec()``).  Needs no running cluster: planning never touches Ray.
        ``costs`` fills each program's FLOPs and bytes from JAX's cost analysis, which
        the simulator needs.  ``profile`` also runs the step on the running cluster to
        time every program on its mesh (see :meth:`profile`) into ``self.program_times``;
        with ``stages="auto"`` the stage DP then plans again with its first plan's
        measured stage times (``PipeshardParallel.stage_times``, now in ``self.method``),
        and the returned plan, later calls and ``program_times`` are the new plan's."""
        target, args = self._route(args)
        if target is not self:
            plan = target.lower(*args, cluster=cluster, costs=costs, profile=profile)
            self.program_times = target.program_times
            return plan
        if profile:
            self.program_times = self.profile(*args)
            if self._stage_dp_measurable():
                self._plan_from_measured_stages(args)

        if cluster is None:
            from meshshard.runtime.cluster import current_cluster

            running = current_cluster()
            cluster = running.spec if running is not None else ClusterSpec()
        fn, args = physical_call(_layered(self.fn, self.method), args)
        batch_argnums = self._batch_for(args)
        plan, _ = self._plan_for(fn, _abstract(args, batch_argnums), batch_argnums, cluster, costs)
        if self.given_plan is None:
            self._lowered = plan
        return plan

    def _plan_for(self, fn, abstract, batch_argnums, cluster: ClusterSpec, costs: bool = False):
        """(plan, trace) of ``fn`` on ``abstract``: the plan given with ``plan=`` once it
        is this step's (only traced, never planned again), else a new plan."""
        from meshshard.passes.pipeline import plan_step
        from meshshard.passes.trace import trace_step

        if self.given_plan is None:
            return plan_step(
                fn,
                abstract,
                method=self.method,
                cluster=cluster,
                batch_argnums=batch_argnums,
                costs=costs,
            )
        traced = trace_step(
            fn,
            abstract,
            batch_argnums=tuple(batch_argnums),
            num_micro_batches=self.method.num_micro_batches,
        )
        check_replay(self.given_plan, traced.fingerprint, self.method, cluster)
        return self.given_plan, traced

    def _stage_dp_measurable(self) -> bool:
        """True for ``stages="auto"`` not yet planned from measured stage times (a plan
        given with ``plan=`` is run as given, never planned again)."""
        m = self.method
        auto = isinstance(m, PipeshardParallel) and m.stages == "auto"
        return auto and not m.stage_times and self._two_bw is None and self.given_plan is None

    def _plan_from_measured_stages(self, args) -> None:
        """``stages="auto"`` with ``profile=True``: the stage DP's first plan (analytic
        costs) was just timed on the cluster; plan again with its stages' measured times
        (``PipeshardParallel.stage_times``), then time the new plan's programs."""
        from meshshard.profiling import stage_times_of

        timed = self.lower(*args, costs=False)  # the plan profile() timed (cache hit or not)
        measured = stage_times_of(timed, self.program_times)
        if not measured:
            return
        log.info("stages='auto': planning again from %d measured stages", len(measured))
        self.method = dataclasses.replace(self.method, stage_times=measured)
        self.release()  # the next call compiles the new plan
        self.program_times = self.profile(*args)

    def profile(
        self, *args, steps: int = 5, cache_dir: str | None = None, cores: int | None = None
    ) -> dict[str, float]:
        """Seconds of each program (``{"s0.F": ...}``) run on its real mesh of the running
        cluster: the median over ``steps`` calls on ``args`` in which every program waits
        for its outputs.  Cached on disk (``cache_dir``, default ``$MESHSHARD_PROFILE_CACHE``
        or ``~/.cache/meshshard/profiles``) by program, mesh and versions.  Pass the
        result to ``meshshard.sim.simulate(plan, program_times=...)``.  The calls use
        ``args`` each time: donated arguments must be host arrays.

        ``cores``: on a cluster whose workers share one machine's cores (the local one;
        its ``ClusterSpec.host_cores``, the default), each time with that sharing
        removed, so that a simulation with ``host_cores`` set puts back the sharing of
        whichever plan it runs; 0: the times as measured, sharing included.
        """
        from meshshard.profiling import ProfileCache, profile_step

        target, args = self._route(args)
        return profile_step(target, args, steps, ProfileCache(cache_dir), cores)

    def profile_demands(
        self, *args, steps: int = 5, cores: int | None = None
    ) -> tuple[dict[str, float], dict[str, float]]:
        """``(times, demands)``: like :meth:`profile` (``cores`` shared, not cached), with
        the cores each program really keeps busy measured from its CPU time instead of
        one per device of its mesh, and the times isolated under those demands.  A
        simulation that shares the cores then predicts this machine's runs closer
        (benchmarks/RESULTS.md, "Cores kept busy"): ``simulate(plan, program_times=times,
        options=SimOptions(core_demands=tuple(demands.items())))``.  Ray backend only."""
        from meshshard.profiling import profile_demands

        target, args = self._route(args)
        return profile_demands(target, args, steps, cores)

    def __call__(self, *args, **kwargs):
        if kwargs:
            args = _positional(self.fn, args, kwargs)
        target, args = self._route(args)
        if target is not self:
            out = target(*args)
            if isinstance(target.fn, WritesBack):  # NNX modules changed in place
                out, written = out
                write_in_place(args, written)
            return out
        if self._two_bw is not None:  # PipeDream-2BW: see meshshard.two_bw
            return self._two_bw(*args)
        # typed keys travel as raw data; the arguments are flattened once per call
        leaves, tree = jax.tree.flatten(args)
        signature, typed = leaf_signatures(leaves)
        if typed:
            _, raw_args, leaves, tree = physical_leaves(self.fn, args)
            signature = None  # of the raw data
        else:
            raw_args = args
        exe = self._executable_for(args, raw_args, (leaves, tree), signature)
        extra = exe.statistics(leaves) if exe.statistics is not None else []
        if plan_needs_index(exe.plan):  # the micro-batch index, for batch-carrying draws
            extra.append(np.arange(exe.plan.num_micro_batches, dtype=np.int32))
        if extra:  # inputs the step was compiled to read after the user's leaves
            raw_args, leaves, tree = (*raw_args, *extra), [*leaves, *extra], None
        return exe.keyed_step.restore(exe.call_flat(raw_args, leaves, tree))

    def placement(self, *args, argnum: int = 0):
        """Where each leaf of ``args[argnum]`` lives when the step runs on ``args``: a tree
        like it whose leaves say the meshes and shardings (compiles the step if needed).
        ``meshshard.restore(path, like=step.placement(state, batch))`` reads a checkpoint
        straight into that layout."""
        from meshshard.checkpoint import placement_of

        target, dynamic = self._route(args)
        if target is not self:
            # a variant with static values bound drops their positions; one writing NNX
            # modules back keeps every position
            static = tuple(i for i, _ in getattr(target.fn, "statics", ()))
            return target.placement(
                *dynamic, argnum=dynamic_positions([argnum], static, "argnum")[0]
            )
        return placement_of(self._executable_for(args), args, argnum)

    def _route(self, args: tuple) -> tuple[ParallelizedFunction, tuple]:
        """The step to run ``args`` and its arguments: this step and ``args`` when none is
        static, else the step compiled with these static values bound (made on first use)
        and the other arguments."""
        static = static_positions(args, self.static_argnums) if self.static_argnums else ()
        jit_static = self._jit_static_positions(len(args))
        if jit_static:  # a jax.jit-wrapped step's own statics must reach it as Python values
            static = tuple(sorted({*static, *jit_static}))
        if not static:
            if _writes_nnx_back(self.fn, self.method, args):
                return self._variant(("nnx",), WritesBack(self.fn)), args
            self._last_variant = None
            return self, args
        # positions in the full call (negative ones from its end), then among the rest
        n = len(args)
        donate = argnum_positions(self.donate_argnums, n, "donate_argnums")
        donate = dynamic_positions(donate, static, "donate_argnums")
        batch = dynamic_positions(self._batch_for(args), static, "batch_argnums")
        key = static_key(args, static)
        variant = self._variant(key, WithStatic(self.fn, key), donate, batch)
        return variant, tuple(a for i, a in enumerate(args) if i not in static)

    def _jit_static_positions(self, num_args: int) -> tuple[int, ...]:
        """The positions a ``jax.jit``-wrapped step takes as static in a call with
        ``num_args`` arguments (looked up once per count); none in a variant."""
        if self._jit_static is None:
            return ()
        found = self._jit_static.get(num_args)
        if found is None:
            found = self._jit_static[num_args] = jit_static_positions(self.fn, num_args)
        return found

    def _variant(self, key, fn, donate=None, batch=None) -> ParallelizedFunction:
        """The step ``fn`` (this one's with static values bound, or writing NNX modules
        back) under ``key``, made on first use and remembered as the last one run."""
        variant = self._variants.get(key)
        if variant is None:
            variant = ParallelizedFunction(
                fn,
                self.method,
                self.donate_argnums if donate is None else donate,
                self.batch_argnums if batch is None else batch,
                static_argnums=(),
                plan=self.given_plan,
                _statics_bound=True,
            )
            variant._default_batch = self._default_batch if batch is None else False
            variant.trace_log = self.trace_log
            self._variants[key] = variant
        self._last_variant = variant
        return variant

    def _batch_for(self, args) -> tuple[int, ...]:
        """The batch positions for a call with ``args``: ``batch_argnums`` (negative ones
        counting from the end), less the default's second argument when the step was
        called with one."""
        n = len(args)
        if self._default_batch:
            return tuple(i for i in self.batch_argnums if i < n)
        return tuple(i % n if -n <= i < 0 else i for i in self.batch_argnums)

    def _executable_for(self, args, raw_args=None, flat=None, signature=None):
        """The compiled step for ``args`` (``raw_args``: the same with typed keys as raw
        data, ``flat``: their leaves and tree structure, and ``signature``: the leaves'
        :func:`leaf_signatures`, when the caller has them), compiling it on first use."""
        from meshshard.runtime.cluster import require_cluster
        from meshshard.runtime.executable import Executable

        cluster = require_cluster()
        typed_args = args
        if raw_args is None:
            _, raw_args = physical_call(self.fn, args)  # keys as raw data
        args = raw_args
        # the cache key from the leaves themselves: building ShapeDtypeStructs for every
        # leaf on every call was the driver's largest own cost (runtime_overhead.py)
        leaves, tree = jax.tree.flatten(args) if flat is None else flat
        key = (tree, signature if signature is not None else leaf_signatures(leaves)[0])
        exe = self._compiled_for(key, cluster)
        if exe is None:
            batch_argnums = self._batch_for(args)
            abstract = _abstract(args, batch_argnums)
            # a Python scalar leaf (TrainState.step = 0) and the int32 array the step
            # returns for it are one signature: the same plan, not a second compile
            exe = self._compiled_for(_signature(abstract), cluster)
            if exe is not None:
                self._executables[key] = exe
                return exe
            t0 = time.perf_counter()
            what = f"compiling {getattr(self.fn, '__name__', 'the step')} for {cluster.spec.name}"
            with LongWork(what):
                phase("tracing the step")
                fn, _ = physical_call(_layered(self.fn, self.method), typed_args)
                plan, traced = self._plan_for(fn, abstract, batch_argnums, cluster.spec)
                phase(f"compiling {len(plan.programs)} programs on {len(plan.workers)} workers")
                donate = argnum_positions(self.donate_argnums, len(args), "donate_argnums")
                exe = Executable(plan, cluster.backend(), fn, abstract, batch_argnums, donate)
            exe.set_out_tree(traced.out_tree)
            exe.traced = traced  # for compiled_collectives()
            exe.statistics = traced.statistics  # the full batch's, each call (see __call__)
            self.last_compile_seconds = time.perf_counter() - t0
            _warn_guessed_reductions(traced)
            _warn_unmet_requests(plan)
            log.info(
                "compiled %s for %s in %.1fs (%d stages, %d workers)",
                getattr(self.fn, "__name__", "step"),
                cluster.spec.name,
                self.last_compile_seconds,
                len(plan.stages),
                len(plan.workers),
            )
            self._executables[key] = self._executables[_signature(abstract)] = exe
            exe.keyed_step = fn  # restores typed keys in the results
            exe.pipelined = self.pipelined
            if self.trace_log is not None:
                exe.record(self.trace_log)
        return exe

    def _compiled_for(self, key, cluster):
        """The executable cached under ``key``, unless it was compiled for a cluster that
        was shut down since (then the caller compiles on this one)."""
        exe = self._executables.get(key)
        if exe is not None and getattr(exe.backend, "cluster", None) is not cluster:
            return None
        return exe

    def release(self) -> None:
        """Drop every compiled version of this step on the workers now (also done when
        this object is garbage-collected).  Arrays it returned stay valid; the next call
        compiles again."""
        variants, self._variants = self._variants, {}
        for variant in variants.values():
            variant.release()
        executables, self._executables = self._executables, {}
        for exe in executables.values():
            exe.release()
        if self.trace_log is not None and self.trace_log.steps:
            self.trace_log.write()

    def __del__(self):
        try:
            for exe in self._executables.values():
                exe.release_soon()
        except Exception:  # interpreter shutdown
            pass

    @property
    def plan(self) -> Plan | None:
        """The plan of the most recent compilation, else of the last ``lower`` (None
        before either)."""
        if self._last_variant is not None:
            return self._last_variant.plan
        if self._two_bw is not None:
            return self._two_bw.last.plan
        if not self._executables:
            return self._lowered
        return list(self._executables.values())[-1].plan

    def compiled_collectives(self) -> dict[str, tuple]:
        """The collectives XLA compiled into each program of the plan the last call ran:
        program name (``"s0.F"``) -> :class:`meshshard.hlo_collectives.Collective` tuple
        (kind, dtype, shape, bytes, replica groups), as the runtime compiles it.  Checks
        what XLA does against the plan's predicted comm (Alpa's ``get_hlo_text`` read
        with ``count_communication_primitives``).  Compiles, never runs, on this
        process's devices: a mesh of N devices needs N of them here."""
        from meshshard.profiling import program_collectives

        exe = self.executable
        if exe is None or exe.traced is None:
            raise MeshshardInputError(
                "compiled_collectives(): this step has not run yet; call it once, then ask "
                "for the collectives of the plan that call compiled"
            )
        return program_collectives(exe.plan, exe.traced)

    @property
    def executable(self):
        """The most recent compiled executable (None before the first call)."""
        if self._last_variant is not None:
            return self._last_variant.executable
        if self._two_bw is not None:
            return self._two_bw.last.executable
        return list(self._executables.values())[-1] if self._executables else None


def parallelize(
    fn: Callable | None = None,
    *,
    method: Method | None = None,
    donate_argnums: Sequence[int] = (),
    batch_argnums: Sequence[int] = DEFAULT_BATCH_ARGNUMS,
    trace: str | None = None,
    static_argnums: Sequence[int] | str = "auto",
    plan: Plan | str | os.PathLike | None = None,
):
    """Parallelize a train step ``fn(state, batch, ...)`` with ``method``.

    Use as ``parallelize(step, method=...)`` or as a decorator
    ``@parallelize(method=PipeshardParallel(num_micro_batches=4))``.  Arguments in
    ``batch_argnums`` (default: the second, where the step has one) are split into
    micro-batches along their first dimension; the others (parameters, optimizer
    state) live on the meshes between steps.  Inside
    ``fn`` compute gradients with ``meshshard.grad``/``meshshard.value_and_grad``; a
    step without them (evaluation, inference) runs as a forward-only pipeline.
    ``method`` defaults to ``DataParallel()`` (the whole cluster as one mesh);
    ``FollowParallel(train_step)`` runs with another step's placement.
    ``trace="out.json"`` records every call's measured timeline (each worker's
    instructions, its communications from issue to completion, the driver's dispatch)
    and writes the last 20 calls as Chrome-trace JSON (open in ui.perfetto.dev) at
    ``release()``, at exit, or on ``write_trace()``.  Arguments in ``static_argnums``
    reach ``fn`` as the Python values themselves (a mode string, a flag), each distinct
    value compiled once, as with ``jax.jit``; the default ``"auto"`` makes static the
    arguments that cannot be arrays (strings, booleans, enums, plain objects).
    ``plan`` (a :class:`Plan`, its JSON text or a JSON file's path, from an earlier
    ``step.plan.to_json()``) runs that plan instead of planning again, after checking it
    was made for this step, ``method`` and a cluster of this size.
    """

    def make(f):
        if not callable(f):
            raise MeshshardInputError(
                f"parallelize takes the train step function to parallelize, got {f!r} (type "
                f"{type(f).__name__}); pass a function, or use @parallelize(method=...) as a "
                "decorator"
            )
        return ParallelizedFunction(
            f,
            method,
            donate_argnums,
            batch_argnums,
            trace,
            static_argnums=static_argnums,
            plan=plan,
        )

    return make if fn is None else make(fn)


def _warn_guessed_reductions(traced) -> None:
    """Say so when an aux value's combination over micro-batches was not inferred: the
    value returned is a default (mean or sum), not what one full-batch step computes."""
    from meshshard.passes.reductions import fix_for, reduction_notes

    for note in reduction_notes(traced.jaxpr, traced.num_micro_batches, guessed_only=True):
        fix = fix_for(
            note,
            "Declare it (meshshard.aux_mean/aux_sum/aux_max/aux_min(x), or "
            "value_and_grad(..., aux_reduce=...)), return its batch sums instead",
        )
        log.warning("%s. %s, or use num_micro_batches=1", note, fix[0].upper() + fix[1:])


def _warn_unmet_requests(plan) -> None:
    """Say so when a mesh's devices do not divide the micro-batch (its batch values run
    whole on every device there: no data parallelism), or when ``sharding="zero2"``
    found no optimizer state to split: what the user asked for did not happen; and when
    a micro-batch's activation statistics stand in for the full batch's; when the
    step's own sharding constraints were dropped; when it changes NNX modules in
    place without returning them; and when automatic stages leave devices idle."""
    from meshshard.nnx_modules import LOST_NOTE
    from meshshard.passes.batch_coupling import NOTE as COUPLED
    from meshshard.passes.shard_plan import ZERO_UNSPLIT
    from meshshard.passes.sharding import UNSPLIT_BATCH
    from meshshard.passes.stage_dp import IDLE_DEVICES
    from meshshard.passes.user_shardings import NOTE as PLACEMENTS

    for note in plan.notes:
        dp_note = note.strip().removeprefix("note: ")  # the stage DP's notes are indented
        if note.startswith((UNSPLIT_BATCH, ZERO_UNSPLIT, COUPLED, PLACEMENTS, LOST_NOTE)):
            log.warning("%s", note)
        elif dp_note.startswith(IDLE_DEVICES):
            log.warning("%s", dp_note)


def _write_at_exit(ref) -> None:
    step = ref()
    if step is not None and step.trace_log is not None and step.trace_log.steps:
        step.trace_log.write()


def _abstract(args, batch_argnums=()):
    """Arguments with every array leaf (and Python scalars outside the batch) replaced by a
    ShapeDtypeStruct; anything else is left for the tracer to reject with a clear error."""

    from meshshard.passes.trace import abstract_leaf

    def one(x, scalars_ok=True):
        found = abstract_leaf(x, (bool, int, float, complex) if scalars_ok else ())
        return x if found is None else found

    return tuple(
        jax.tree.map(lambda x, ok=(i not in batch_argnums): one(x, ok), a)
        for i, a in enumerate(args)
    )


def _signature(abstract) -> tuple:
    """The executables' cache key of abstract arguments (:func:`_abstract`): their tree and
    each leaf's shape, dtype and weak type (``jax.jit`` traces a weak leaf anew too)."""
    leaves, tree = jax.tree.flatten(abstract)
    return (
        "abstract",
        tree,
        tuple(
            (
                getattr(a, "shape", None),
                str(getattr(a, "dtype", type(a))),
                getattr(a, "weak_type", False),
            )
            for a in leaves
        ),
    )


def plan_needs_index(plan: Plan) -> bool:
    """True if the plan's last input is the micro-batch index the caller appends."""
    from meshshard.passes.random_draws import INDEX_PATH

    return bool(plan.inputs) and plan.inputs[-1].path == INDEX_PATH


def _positional(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """``args`` with the keyword arguments of a call put in their positions (the step's
    arguments are numbered: batch_argnums, donate_argnums); refused, naming the argument,
    where the step's signature has no position for it."""
    import inspect

    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except (TypeError, ValueError) as exc:
        raise MeshshardInputError(
            f"cannot call {getattr(fn, '__name__', 'the step')} with {sorted(kwargs)} as "
            f"keywords: {exc}"
        ) from None
    if bound.kwargs:
        raise MeshshardInputError(
            f"argument(s) {sorted(bound.kwargs)} of {getattr(fn, '__name__', 'the step')} "
            "are keyword-only; a parallelized step numbers its arguments (batch_argnums, "
            "donate_argnums, static_argnums), so give them positions in the step's signature"
        )
    return bound.args


def _writes_nnx_back(fn: Callable, method: Method, args: tuple) -> bool:
    """True for a step taking NNX modules that is not yet wrapped to write them back.
    Not under 2BW, whose steps return the stash beside the results (such a step that
    changes modules in place is warned, :func:`meshshard.nnx_modules.lost_in_place_note`)."""
    two_bw = getattr(method, "schedule", None) == "2bw"
    return not two_bw and not isinstance(fn, WritesBack) and holds_modules(args)


def _layered(fn: Callable, method: Method) -> Callable:
    """``fn`` with automatic layer clustering (``layers=``) and per-layer
    rematerialization (``remat=``) when the method asks for them, and its scans over
    stacked layers unrolled where the sharding ILP shards the programs."""
    from meshshard.autodiff import AutoLayers, Rematerialized, UnrolledStacks

    if sharding_mode(method) != "data_parallel":  # the sharding ILP plans each program
        fn = UnrolledStacks(fn, True)
    remat = getattr(method, "remat", None)
    if remat is not None:
        fn = Rematerialized(fn, remat)
    layers = getattr(method, "layers", None)
    return fn if layers is None else AutoLayers(fn, layers)

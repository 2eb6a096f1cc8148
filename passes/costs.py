"""Pass: FLOPs and bytes of every program, from JAX's cost analysis.

Each program is lowered once at its global (unsharded) shapes on the planning machine
and XLA's HLO cost analysis is read; nothing is compiled or run.  The simulator turns
these counts into times on a described device (whole-program totals; it divides by the
mesh's device count).

Counts are kept per process by the program's identity (the traced step's fingerprint
and the program's equations and values): re-planning one step under another schedule,
stage list or method lowers only the programs it has not seen.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import jax

from meshshard.jaxpr_util import var_ids
from meshshard.passes.apply_programs import program_partials
from meshshard.passes.stage_graph import ProgramIO, StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.program_fn import program_function
from meshshard.refs import Phase, ProgramRef


def program_costs(
    traced: TracedStep, graph: StageGraph, extra: Sequence[ProgramIO] = ()
) -> dict[ProgramRef, tuple[float | None, float | None]]:
    """``{program name: (flops, bytes accessed)}`` for every program of ``graph`` and of
    ``extra`` (programs later passes made, such as a fused ``s{i}.FB``)."""
    by_id = None
    out = {}
    for p in (*graph.programs, *extra):
        apply = p.name.phase is Phase.APPLY
        partials = program_partials(graph.reductions, p.outputs, p.stage)
        key = (
            traced.fingerprint,
            traced.num_micro_batches,
            apply,
            p.eqns,
            tuple(g.vars for g in p.inputs),
            tuple(g.vars for g in p.outputs),
            repr(sorted(partials.items())),
        )
        with _LOCK:
            known = _COSTS.get(key)
        if known is not None:
            out[p.name] = known
            continue
        if by_id is None:
            by_id = {i: v for v, i in var_ids(traced.jaxpr).items()}
        fn = program_function(
            traced,
            p.eqns,
            p.inputs,
            p.outputs,
            traced.num_micro_batches,
            apply,
            partials=partials,
        )
        args = [
            jax.ShapeDtypeStruct(by_id[i].aval.shape, by_id[i].aval.dtype)
            for g in p.inputs
            for i in g.vars
        ]
        analysis = jax.jit(fn).lower(*args).cost_analysis()
        if isinstance(analysis, list):
            analysis = analysis[0] if analysis else {}
        analysis = analysis or {}
        flops = analysis.get("flops")
        nbytes = analysis.get("bytes accessed")
        out[p.name] = (
            float(flops) if flops is not None else None,
            float(nbytes) if nbytes is not None else None,
        )
        with _LOCK:
            _COSTS[key] = out[p.name]
            while len(_COSTS) > COST_CACHE_SIZE:
                _COSTS.popitem(last=False)
    return out


#: Programs whose counts are kept (oldest dropped first).
COST_CACHE_SIZE = 1024
_COSTS: OrderedDict = OrderedDict()
_LOCK = threading.Lock()

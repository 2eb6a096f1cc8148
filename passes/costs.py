"""Pass: FLOPs and bytes of every program, from JAX's cost analysis.

Each program is lowered once at its global (unsharded) shapes on the planning machine
and XLA's HLO cost analysis is read; nothing is compiled or run.  The simulator turns
these counts into times on a described device (whole-program totals; it divides by the
mesh's device count).
"""

from __future__ import annotations

import jax

from meshshard.jaxpr_util import var_ids
from meshshard.passes.stage_graph import StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.program_fn import program_function
from meshshard.refs import Phase, ProgramRef


def program_costs(
    traced: TracedStep, graph: StageGraph
) -> dict[ProgramRef, tuple[float | None, float | None]]:
    """``{program name: (flops, bytes accessed)}`` for every program of ``graph``."""
    by_id = {i: v for v, i in var_ids(traced.jaxpr).items()}
    out = {}
    for p in graph.programs:
        fn = program_function(
            traced,
            p.eqns,
            p.inputs,
            p.outputs,
            traced.num_micro_batches,
            p.name.phase is Phase.APPLY,
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
    return out

"""Pass 0d: recompute in the update the batch-independent values it reads from before the grad.

A train step often derives values from the state before calling ``meshshard.grad`` and
uses them after it: ``new_key, dropout_key = jax.random.split(state.key)`` returns
``new_key`` in the new state; a learning rate read from the step counter feeds the
update.  Everything before the grad runs per micro-batch inside a stage program, so the
update could not read such a value.  When it does not depend on the batch it is the
same on every micro-batch, and this pass re-emits the equations that compute it right
after the grad (the update part), where they run once per step on the meshes that need
them.  The forward keeps its own copy.  Values that do depend on the batch are left
alone (the stage graph rejects them with an explanation).
"""

from __future__ import annotations

from meshshard._compat import ClosedJaxpr
from meshshard.jaxpr_util import bind_eqn, is_dropvar, is_literal, is_marker, read_var, retrace


def batch_dependent(jaxpr, is_batch, stop: int, blocked: frozenset = frozenset()) -> set:
    """Vars of equations ``[0, stop)`` computed (transitively) from batch inputs (the
    inputs ``is_batch`` flags); the outputs of ``blocked`` primitives (e.g.
    ``stop_gradient``) depend on nothing."""
    dep = {v for v, b in zip(jaxpr.invars, is_batch, strict=True) if b}
    for e in jaxpr.eqns[:stop]:
        if e.primitive.name not in blocked and any(
            not is_literal(v) and v in dep for v in e.invars
        ):
            dep.update(v for v in e.outvars if not is_dropvar(v))
    return dep


def values_to_hoist(jaxpr, is_batch) -> tuple[int, ...]:
    """Indices of the pre-grad equations to recompute after the grad (in order)."""
    g = next((i for i, e in enumerate(jaxpr.eqns) if is_marker(e, "grad_end")), None)
    if g is None:
        return ()
    producer = {v: i for i, e in enumerate(jaxpr.eqns[:g]) for v in e.outvars}
    dep = batch_dependent(jaxpr, is_batch, g)
    late_reads = [v for e in jaxpr.eqns[g + 1 :] for v in e.invars] + list(jaxpr.outvars)
    stack = [v for v in late_reads if not is_literal(v) and v in producer and v not in dep]
    chain: set[int] = set()
    while stack:
        i = producer[stack.pop()]
        if i in chain:
            continue
        chain.add(i)
        stack += [v for v in jaxpr.eqns[i].invars if not is_literal(v) and v in producer]
    return tuple(sorted(chain))


def hoist_to_update(closed: ClosedJaxpr, is_batch) -> ClosedJaxpr:
    """``closed`` with batch-independent pre-grad values recomputed after the grad."""
    chain = values_to_hoist(closed.jaxpr, is_batch)
    if not chain:
        return closed
    eqns = closed.jaxpr.eqns

    def hook(i, eqn, env, extra) -> bool:
        if not is_marker(eqn, "grad_end"):
            return False
        for v, o in zip(
            eqn.outvars, bind_eqn(eqn, [read_var(env, a) for a in eqn.invars]), strict=True
        ):
            if not is_dropvar(v):
                env[v] = o
        for j in chain:  # recompute; later reads of these vars see the copies
            e = eqns[j]
            ins = [read_var(env, a) for a in e.invars]
            outs = ins if is_marker(e) else bind_eqn(e, ins)
            for v, o in zip(e.outvars, outs, strict=True):
                if not is_dropvar(v):
                    env[v] = o
        return True

    return retrace(closed, hook)

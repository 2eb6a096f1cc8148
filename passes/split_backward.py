"""Pass: split each stage's backward into B (input gradient) and W (weight gradient).

Zero-bubble schedules run the part of a backward that the previous stage waits for
(B: the gradient sent upstream, and what that needs) as soon as they can, and the rest
(W: the accumulator contributions, i.e. the weight gradients) later, in bubbles.  Over
the backward program's equations of the traced jaxpr:

* B = every equation the program's non-accumulator outputs (outgoing gradient
  transfers) need, transitively;
* W = every other equation; it reads the program's input groups it needs plus a new
  per-micro-batch group ``D{s}``: values B computed that W reads (and accumulator
  contributions B happened to compute);
* B writes the non-accumulator outputs and ``D{s}``; W reads and writes the
  accumulators ``A{s}``.

Together they evaluate exactly the equations of the original program, once each, so
the step's results are unchanged (the parity tests compare with ``jax.jit``).  A stage
with no outgoing gradient (stage 0) gets an empty B.  Pure: a new StageGraph.
"""

from __future__ import annotations

from dataclasses import replace

from meshshard.jaxpr_util import is_dropvar, is_literal, var_ids
from meshshard.passes.stage_graph import ProgramIO, StageGraph
from meshshard.passes.trace import TracedStep
from meshshard.refs import BufferGroup, BufferKind, BufferRef, Phase, ProgramRef

__all__ = ["split_backward"]

ACC = BufferKind.ACCUMULATORS


def split_backward(traced: TracedStep, graph: StageGraph) -> StageGraph:
    """``graph`` with every ``s{i}.B`` replaced by a B program and a ``s{i}.W`` program."""
    ids = var_ids(traced.jaxpr)
    operand_of = {p.result: p.operand for p in graph.grad_pairs}
    programs: list[ProgramIO] = []
    groups = list(graph.groups)
    for prog in graph.programs:
        if prog.name.phase is not Phase.BACKWARD:
            programs.append(prog)
            continue
        b, w, carry = _split(traced.jaxpr, ids, prog, operand_of)
        programs += [b, w]
        if carry.vars:
            groups.append(carry)
    return replace(graph, programs=tuple(programs), groups=tuple(groups))


def _io(jaxpr, ids: dict, eqns: tuple[int, ...]) -> tuple[dict, dict]:
    """Per equation: the var ids it reads and the var ids it defines."""
    reads, defs = {}, {}
    for i in eqns:
        e = jaxpr.eqns[i]
        reads[i] = {ids[v] for v in e.invars if not is_literal(v) and v in ids}
        defs[i] = {ids[v] for v in e.outvars if not is_dropvar(v)}
    return reads, defs


def _closure(targets: set, reads: dict, defs: dict) -> set:
    """The equations that (transitively) compute ``targets``."""
    def_eqn = {v: i for i, vs in defs.items() for v in vs}
    todo = [v for v in targets if v in def_eqn]
    needed: set = set()
    while todo:
        i = def_eqn[todo.pop()]
        if i not in needed:
            needed.add(i)
            todo += [v for v in reads[i] if v in def_eqn]
    return needed


def _split(jaxpr, ids: dict, prog: ProgramIO, operand_of: dict):
    s = prog.stage
    reads, defs = _io(jaxpr, ids, prog.eqns)
    b_targets = {v for g in prog.outputs if g.ref.kind is not ACC for v in g.vars}
    b_set = _closure(b_targets, reads, defs)
    b_eqns = tuple(i for i in prog.eqns if i in b_set)
    w_eqns = tuple(i for i in prog.eqns if i not in b_set)
    b_defs = set().union(*(defs[i] for i in b_eqns)) if b_eqns else set()
    w_reads = set().union(*(reads[i] for i in w_eqns)) if w_eqns else set()
    b_reads = set().union(*(reads[i] for i in b_eqns)) if b_eqns else set()
    acc_operands = {
        operand_of[v] for g in prog.outputs if g.ref.kind is ACC for v in g.vars if v in operand_of
    }
    carried = (w_reads | acc_operands) & b_defs
    order = [v for i in b_eqns for v in sorted(defs[i]) if v in carried]
    carry = BufferGroup(BufferRef(BufferKind.BACKWARD_CARRY, s), tuple(order))
    plain = [g for g in prog.inputs if g.ref.kind is not ACC]
    b_ins = tuple(g for g in plain if set(g.vars) & (b_reads | b_targets))
    b_outs = tuple(g for g in prog.outputs if g.ref.kind is not ACC)
    accs = tuple(g for g in prog.inputs if g.ref.kind is ACC)
    w_ins = tuple(g for g in plain if set(g.vars) & w_reads) + accs
    if carry.vars:
        b_outs += (carry,)
        w_ins += (carry,)
    w_outs = tuple(g for g in prog.outputs if g.ref.kind is ACC)
    b = ProgramIO(prog.name, s, b_eqns, b_ins, b_outs)
    w = ProgramIO(ProgramRef(Phase.WEIGHT_GRAD, s), s, w_eqns, w_ins, w_outs)
    return b, w, carry

"""Pure pipeline-schedule generators: (stages, micro-batches) -> a tick x mesh grid.

Each mesh runs its tasks in a fixed order; a task takes one tick and starts once its
inputs are ready (a forward after the previous logical stage's forward of that
micro-batch, a backward after the next stage's backward and its own forward, a
weight-gradient task after its own backward).  With equal task times both GPipe and
1F1B take ``2 (M + S - 1)`` ticks; 1F1B keeps at most ``S - i`` micro-batches of
activations alive on stage ``i`` instead of GPipe's ``M``.

>>> print(one_f_one_b(2, 2))
1f1b: 2 stages x 2 micro-batches, 6 ticks
  tick   s0   s1
     0   F0    .
     1   F1   F0
     2    .   B0
     3   B0   F1
     4    .   B1
     5   B1    .

The other generators:

* ``eager_1f1b`` (Alpa's overlap-friendly 1F1B): ``min(M, 2(S-i)-1)`` warm-up forwards
  on stage ``i``, so each activation is made one compute slot before it is needed and
  its send overlaps the receiver's backward; same ``2 (M + S - 1)`` ticks.
* ``interleaved_1f1b`` (Megatron): ``v`` model chunks per mesh, chunk ``j`` of mesh
  ``r`` is logical stage ``j S + r``; ``2 v M + 2 (S - 1)`` chunk ticks, so the bubble
  is ``(S-1)/(v M)`` of the work.
* ``zb_h1`` (zero bubble H1): the backward split into B (input gradient) and W (weight
  gradient); W fills bubbles, ``3 M + S - 1`` ticks (``M >= S``) against 1F1B's ``3 (M + S - 1)``
  at equal F/B/W times, with 1F1B's activation memory.
* ``2bw`` (PipeDream-2BW): 1F1B without flushes over ``steps`` steps; tasks carry the
  weight version they read (see :func:`two_bw`).
"""

from __future__ import annotations

from collections.abc import Callable

from meshshard.plan import Schedule, Task
from meshshard.refs import TaskKind

FWD, BWD, WGT = TaskKind.F, TaskKind.B, TaskKind.W
Key = tuple[int, TaskKind, int]  # (logical stage, kind, micro-batch)


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """All forwards, then all backwards (GPipe)."""
    orders = [
        [(FWD, m) for m in range(num_micro_batches)] + [(BWD, m) for m in range(num_micro_batches)]
        for _ in range(num_stages)
    ]
    bound = tuple(num_micro_batches for _ in range(num_stages))
    return _place("gpipe", num_stages, num_micro_batches, _tasks(orders), bound)


def _alternating(num_micro_batches: int, warm: int, backward_first: bool) -> list:
    """``warm`` forwards, then F/B pairs (B/F when ``backward_first``), then the rest."""
    M = num_micro_batches
    order = [(FWD, m) for m in range(warm)]
    for i in range(M - warm):
        pair = [(BWD, i), (FWD, warm + i)] if backward_first else [(FWD, warm + i), (BWD, i)]
        order += pair
    return order + [(BWD, m) for m in range(M - warm, M)]


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``S-i-1`` warm-up forwards, then alternate, then drain."""
    S, M = num_stages, num_micro_batches
    orders = [_alternating(M, min(S - s - 1, M), False) for s in range(S)]
    bound = tuple(min(S - s, M) for s in range(S))
    return _place("1f1b", S, M, _tasks(orders), bound)


def eager_one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """Eager 1F1B (Alpa's ``1f1b_overlap_friendly``): ``min(M, 2(S-i)-1)`` warm-up
    forwards on stage ``i``, then alternate B and F, then drain.

    Each forward output is ready a compute slot before the next stage needs it, so
    its SEND (issued right after the RUN that made it) overlaps that stage's backward;
    the price is up to ``2(S-i)-1`` micro-batches of activations instead of ``S-i``.
    """
    S, M = num_stages, num_micro_batches
    orders = [_alternating(M, min(2 * (S - s) - 1, M), True) for s in range(S)]
    bound = tuple(min(2 * (S - s) - 1, M) for s in range(S))
    return _place("eager_1f1b", S, M, _tasks(orders), bound)


def interleaved_one_f_one_b(
    num_stages: int, num_micro_batches: int, virtual_stages: int = 2
) -> Schedule:
    """Interleaved 1F1B (Megatron): ``v`` chunks per mesh in rounds of ``S`` micro-batches.

    Mesh ``r`` runs forwards in the order (round, chunk, micro-batch of the round) and
    backwards with chunks reversed; ``(S-r-1)*2 + (v-1)*S`` warm-up chunk forwards,
    then 1F1B.  Needs ``M`` divisible by ``S`` (Megatron's rule).
    """
    S, M, v = num_stages, num_micro_batches, virtual_stages
    if M % S:
        raise ValueError(
            f"interleaved_1f1b needs num_micro_batches ({M}) divisible by the number of "
            f"stages ({S}); use a multiple of {S}"
        )

    def nth(k: int, backward: bool) -> tuple[TaskKind, int, int]:
        chunk = (k // S) % v
        mb = (k // (S * v)) * S + k % S
        return (BWD if backward else FWD, mb, v - 1 - chunk if backward else chunk)

    orders = []
    bound = []
    for r in range(S):
        total = M * v
        warm = min((S - r - 1) * 2 + (v - 1) * S, total)
        order = [nth(k, False) for k in range(warm)]
        for i in range(total - warm):
            order += [nth(warm + i, False), nth(i, True)]
        order += [nth(k, True) for k in range(total - warm, total)]
        orders.append([Task(r, mb, kind, chunk) for kind, mb, chunk in order])
        bound.append(min(warm + 1, total))
    return _place("interleaved_1f1b", S, M, orders, tuple(bound), v)


def zb_h1(num_stages: int, num_micro_batches: int) -> Schedule:
    """Zero-bubble H1: B (input gradient) and W (weight gradient) as separate tasks.

    Stage ``i`` runs 1F1B's order with the backward split into B then W, and defers its
    W's by ``i`` micro-batches (they run once ``i`` more B's are done, the rest at the
    end): later stages spend the headroom up to 1F1B's peak of ``S`` micro-batches (F
    done, W not yet) on deferred W's, so their B's go back to back and the drain's
    bubbles fill with W.  ``3 M + S - 1`` ticks for ``M >= S``.
    """
    S, M = num_stages, num_micro_batches
    orders = []
    for s in range(S):
        warm = min(S - s - 1, M)
        order = [(FWD, m) for m in range(warm)]
        pending: list[int] = []
        for i in range(M):
            order += [(FWD, warm + i), (BWD, i)] if warm + i < M else [(BWD, i)]
            pending.append(i)
            if len(pending) > s:
                order.append((WGT, pending.pop(0)))
        orders.append(order + [(WGT, m) for m in pending])
    bound = tuple(min(S, M) for _ in range(S))
    return _place("zb_h1", S, M, _tasks(orders), bound)


def two_bw(num_stages: int, num_micro_batches: int, steps: int = 3) -> Schedule:
    """PipeDream-2BW over ``steps`` steps: 1F1B with no flush between steps.

    Micro-batch ``g`` of the grid is micro-batch ``g % M`` of step ``g // M``; the warm-up
    runs only at the start and the drain only at the end.  Step ``k`` computes its
    gradient on weight version ``max(k - 1, 0)`` (both its forwards and its backwards,
    which the task's ``version`` records), and its update, applied on each stage right
    after that stage's last backward of step ``k``, makes version ``k + 1``:
    ``W(k+1) = W(k) - lr * grad f(W(k-1))``, staleness exactly 1.  A stage holds at most
    two versions; that needs ``M >= S``.
    """
    S, M = num_stages, num_micro_batches
    if M < S:
        raise ValueError(
            f"2bw needs num_micro_batches ({M}) >= the number of stages ({S}) so that "
            "two weight versions suffice; raise num_micro_batches"
        )
    total = M * steps
    orders = [_alternating(total, min(S - s - 1, total), False) for s in range(S)]
    tasks = [
        [Task(s, g, kind, None, max(g // M - 1, 0)) for kind, g in order]
        for s, order in enumerate(orders)
    ]
    bound = tuple(min(S - s, total) for s in range(S))
    return _place("2bw", S, M, tasks, bound, steps=steps)


SCHEDULE_GENERATORS: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "eager_1f1b": eager_one_f_one_b,
    "interleaved_1f1b": interleaved_one_f_one_b,
    "zb_h1": zb_h1,
    "2bw": two_bw,
    "inference": lambda S, M: inference(S, M),
}


def inference(num_stages: int, num_micro_batches: int) -> Schedule:
    """Forward tasks only (a step without gradients): each stage runs F0, F1, ..."""
    orders = [[(FWD, m) for m in range(num_micro_batches)] for _ in range(num_stages)]
    return _place("inference", num_stages, num_micro_batches, _tasks(orders), ())


def make_schedule(name: str, num_stages: int, num_micro_batches: int, **options) -> Schedule:
    """The schedule called ``name`` (a key of :data:`SCHEDULE_GENERATORS`); ``options``
    go to its generator (``virtual_stages`` for ``interleaved_1f1b``, ``steps`` for
    ``2bw``; a 2BW step on its own is ``steps=1``)."""
    if name not in SCHEDULE_GENERATORS:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULE_GENERATORS)}, got {name!r}")
    return SCHEDULE_GENERATORS[name](num_stages, num_micro_batches, **options)


#: Schedules the compiler can emit and run end to end today (the rest are generated,
#: verified and simulated on synthetic plans).
RUNNABLE = ("gpipe", "1f1b", "eager_1f1b", "zb_h1", "2bw", "interleaved_1f1b", "inference")


def check_runnable(name: str, num_stages: int, num_micro_batches: int) -> None:
    """Refuse, naming the choice, a schedule the emitter cannot run for these sizes."""
    from meshshard.errors import MeshshardInputError

    if name not in RUNNABLE:
        raise MeshshardInputError(
            f"PipeshardParallel.schedule={name!r} is generated and simulated but not yet "
            f"emitted for real steps; use one of {RUNNABLE[:6]}"
        )
    if name == "interleaved_1f1b" and num_micro_batches % num_stages:
        raise MeshshardInputError(
            f"PipeshardParallel(schedule='interleaved_1f1b') needs num_micro_batches "
            f"divisible by the number of meshes ({num_micro_batches} % {num_stages} != 0)"
        )
    if name == "2bw" and num_micro_batches < num_stages:
        raise MeshshardInputError(
            f"PipeshardParallel(schedule='2bw') needs num_micro_batches >= the number of "
            f"stages ({num_micro_batches} < {num_stages}); raise num_micro_batches"
        )


def dependencies(task: Task, num_logical: int, num_stages: int, split: bool) -> list[Key]:
    """The tasks ``task`` waits for, as (logical stage, kind, micro-batch) keys.

    ``split``: the backward is split into B and W (B then needs only the next stage's B).
    """
    L, m = task.logical(num_stages), task.mb
    if task.kind is FWD:
        return [(L - 1, FWD, m)] if L > 0 else []
    if task.kind is WGT:
        return [(L, BWD, m)]
    deps = [(L, FWD, m)]
    if L < num_logical - 1:
        deps.append((L + 1, BWD, m))
    return deps


def _tasks(orders: list[list[tuple[TaskKind, int]]]) -> list[list[Task]]:
    return [[Task(s, m, kind) for kind, m in order] for s, order in enumerate(orders)]


def _place(
    name: str,
    S: int,
    M: int,
    orders: list[list[Task]],
    bound: tuple[int, ...],
    virtual: int = 1,
    steps: int = 1,
) -> Schedule:
    """Place each mesh's ordered tasks on unit ticks, each as soon as its inputs are ready."""
    done: dict[Key, int] = {}
    ptr = [0] * S
    ticks: list[tuple[Task | None, ...]] = []
    t = 0
    never = 1 << 30
    num_logical = S * virtual

    def ready(task: Task) -> bool:
        return all(done.get(d, never) < t for d in dependencies(task, num_logical, S, False))

    while any(ptr[s] < len(orders[s]) for s in range(S)):
        row: list[Task | None] = [None] * S
        for s in range(S):
            if ptr[s] < len(orders[s]) and ready(orders[s][ptr[s]]):
                row[s] = orders[s][ptr[s]]
        if not any(row):
            raise AssertionError(f"schedule {name} deadlocked at tick {t}")
        for s, task in enumerate(row):
            if task is not None:
                done[(task.logical(S), task.kind, task.mb)] = t
                ptr[s] += 1
        ticks.append(tuple(row))
        t += 1
    return Schedule(name, S, M, tuple(ticks), virtual, bound, steps)

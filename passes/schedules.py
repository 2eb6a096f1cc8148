"""Pure pipeline-schedule generators: (stages, micro-batches) -> a tick x stage grid.

Each stage runs its tasks in a fixed order; a task takes one tick and starts once its
inputs are ready (a forward after the previous stage's forward of that micro-batch, a
backward after the next stage's backward and its own forward).  With equal task times
both GPipe and 1F1B take ``2 (M + S - 1)`` ticks; 1F1B keeps at most ``S - i``
micro-batches of activations alive on stage ``i`` instead of GPipe's ``M``.

>>> print(one_f_one_b(2, 2))
1f1b: 2 stages x 2 micro-batches, 6 ticks
  tick   s0   s1
     0   F0    .
     1   F1   F0
     2    .   B0
     3   B0   F1
     4    .   B1
     5   B1    .
"""

from __future__ import annotations

from meshshard.plan import Schedule, Task
from meshshard.refs import TaskKind

FWD, BWD = TaskKind.F, TaskKind.B


def gpipe(num_stages: int, num_micro_batches: int) -> Schedule:
    """All forwards, then all backwards (GPipe)."""
    orders = [
        [(FWD, m) for m in range(num_micro_batches)] + [(BWD, m) for m in range(num_micro_batches)]
        for _ in range(num_stages)
    ]
    return _place("gpipe", num_stages, num_micro_batches, orders)


def one_f_one_b(num_stages: int, num_micro_batches: int) -> Schedule:
    """1F1B (PipeDream-Flush): ``S-i-1`` warm-up forwards, then alternate, then drain."""
    orders = []
    for s in range(num_stages):
        warm = min(num_stages - s - 1, num_micro_batches)
        order = [(FWD, m) for m in range(warm)]
        for i in range(num_micro_batches - warm):
            order += [(FWD, warm + i), (BWD, i)]
        order += [(BWD, m) for m in range(num_micro_batches - warm, num_micro_batches)]
        orders.append(order)
    return _place("1f1b", num_stages, num_micro_batches, orders)


SCHEDULE_GENERATORS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def make_schedule(name: str, num_stages: int, num_micro_batches: int) -> Schedule:
    """The schedule called ``name`` (``gpipe`` or ``1f1b``)."""
    return SCHEDULE_GENERATORS[name](num_stages, num_micro_batches)


def _place(name: str, S: int, M: int, orders: list[list[tuple[str, int]]]) -> Schedule:
    done: dict[tuple[int, str, int], int] = {}
    ptr = [0] * S
    ticks: list[tuple[Task | None, ...]] = []
    t = 0
    never = 1 << 30

    def ready(s: int, kind: str, mb: int) -> bool:
        if kind == FWD:
            return s == 0 or done.get((s - 1, FWD, mb), never) < t
        own = done.get((s, FWD, mb), never) < t
        return own and (s == S - 1 or done.get((s + 1, BWD, mb), never) < t)

    while any(ptr[s] < len(orders[s]) for s in range(S)):
        row: list[Task | None] = [None] * S
        for s in range(S):
            if ptr[s] < len(orders[s]):
                kind, mb = orders[s][ptr[s]]
                if ready(s, kind, mb):
                    row[s] = Task(s, mb, kind)
        if not any(row):
            raise AssertionError(f"schedule {name} deadlocked at tick {t}")
        for s, task in enumerate(row):
            if task is not None:
                done[(s, task.kind, task.mb)] = t
                ptr[s] += 1
        ticks.append(tuple(row))
        t += 1
    return Schedule(name, S, M, tuple(ticks))

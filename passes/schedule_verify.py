"""Schedule verifier: a generated tick grid (and the streams emitted from it) is sound.

Checks, per schedule:

* every task (logical stage, F/B[/W], micro-batch) runs exactly once, in its mesh's
  column, after its dependencies (the previous stage's F; its own F and the next
  stage's B; its own B for a split W);
* activations held: per mesh, the micro-batches (per chunk) whose F ran and whose last
  backward task (W when split, else B) has not stay <= the schedule's stated
  ``activation_bound``;
* weight versions (schedules over several steps, 2BW): a micro-batch's F and B read
  the same version, step ``k`` reads ``max(k - 1, 0)`` (staleness exactly 1), and each
  task's version exists on its mesh (made by the update after the mesh's last
  backward of the step before) and is not yet retired (two versions at most).

On emitted streams (:func:`stream_problems`): the residuals ``R`` a worker holds stay
within the bound too; matching sends and single frees are :func:`meshshard.verify.verify`'s.
:func:`check_schedule` raises with the ticks x meshes grid, the failing cell marked.

>>> from meshshard.passes.schedules import one_f_one_b
>>> check_schedule(one_f_one_b(2, 2)) is None
True
"""

from __future__ import annotations

from dataclasses import dataclass

from meshshard.instructions import Free
from meshshard.plan import Plan, Schedule, Task
from meshshard.refs import BufferKind, TaskKind

__all__ = [
    "Problem",
    "ScheduleError",
    "schedule_problems",
    "activation_peaks",
    "check_schedule",
    "format_grid",
    "problems_with_grid",
    "stream_problems",
]

Key = tuple[int, TaskKind, int]


@dataclass(frozen=True)
class Problem:
    """One violation, at ``(tick, mesh)`` of the grid when it has a cell."""

    message: str
    tick: int | None = None
    mesh: int | None = None

    def __str__(self) -> str:
        return self.message


class ScheduleError(ValueError):
    """A schedule broke an invariant; the message holds the grid with the cell marked."""


def _key(task: Task, S: int) -> Key:
    return task.logical(S), task.kind, task.mb


def _name(key: Key) -> str:
    L, kind, m = key
    return f"s{L}.{kind.value}{m}"


def _split(schedule: Schedule) -> bool:
    return any(c is not None and c.kind is TaskKind.W for row in schedule.ticks for c in row)


def _placed(schedule: Schedule, problems: list[Problem]) -> dict[Key, tuple[int, int]]:
    """(tick, mesh) of every task; duplicates and misplaced cells go to ``problems``."""
    S = schedule.num_stages
    when: dict[Key, tuple[int, int]] = {}
    for t, row in enumerate(schedule.ticks):
        if len(row) != S:
            problems.append(Problem(f"tick {t} has {len(row)} cells for {S} stages", t))
        for s, task in enumerate(row):
            if task is None:
                continue
            if task.stage != s:
                problems.append(Problem(f"tick {t}: task {task} sits in stage {s}'s column", t, s))
            key = _key(task, S)
            if key in when:
                problems.append(Problem(f"task {_name(key)} scheduled twice", t, s))
            when[key] = (t, s)
    return when


def _expected(schedule: Schedule) -> list[Key]:
    kinds = [TaskKind.F]
    if schedule.name != "inference":
        kinds += [TaskKind.B] + ([TaskKind.W] if _split(schedule) else [])
    logical = schedule.num_stages * schedule.virtual_stages
    total = schedule.num_micro_batches * schedule.steps
    return [(L, k, m) for L in range(logical) for m in range(total) for k in kinds]


def _deps(key: Key, num_logical: int) -> list[Key]:
    L, kind, m = key
    if kind is TaskKind.F:
        return [(L - 1, kind, m)] if L > 0 else []
    if kind is TaskKind.W:
        return [(L, TaskKind.B, m)]
    return [(L, TaskKind.F, m)] + ([(L + 1, TaskKind.B, m)] if L < num_logical - 1 else [])


def schedule_problems(schedule: Schedule) -> list[Problem]:
    """Every violation in ``schedule`` (empty when sound); see the module docstring."""
    problems: list[Problem] = []
    when = _placed(schedule, problems)
    for key in _expected(schedule):
        if key not in when:
            problems.append(Problem(f"task {_name(key)} never scheduled"))
    num_logical = schedule.num_stages * schedule.virtual_stages
    for key, (t, s) in when.items():
        for d in _deps(key, num_logical):
            if d in when and when[d][0] >= t:
                problems.append(
                    Problem(
                        f"task {_name(key)} at tick {t} runs before its dependency {_name(d)}", t, s
                    )
                )
    problems += _memory_problems(schedule)
    problems += _version_problems(schedule)
    return problems


def activation_peaks(schedule: Schedule) -> list[int]:
    """Per mesh, the most micro-batch activations (per chunk) held at once: from a
    task's F until its last backward task (W when the backward is split, else B)."""
    last = TaskKind.W if _split(schedule) else TaskKind.B
    return [max(live) if live else 0 for live in _live_counts(schedule, last)]


def _live_counts(schedule: Schedule, last: TaskKind) -> list[list[int]]:
    live = [0] * schedule.num_stages
    series: list[list[int]] = [[] for _ in range(schedule.num_stages)]
    for row in schedule.ticks:
        for s, task in enumerate(row):
            if task is not None and task.kind in (TaskKind.F, last):
                live[s] += 1 if task.kind is TaskKind.F else -1
            series[s].append(live[s])
    return series


def _memory_problems(schedule: Schedule) -> list[Problem]:
    if not schedule.activation_bound or schedule.name == "inference":
        return []
    last = TaskKind.W if _split(schedule) else TaskKind.B
    out = []
    for s, series in enumerate(_live_counts(schedule, last)):
        bound = schedule.activation_bound[s]
        t = next((t for t, n in enumerate(series) if n > bound), None)
        if t is not None:
            out.append(
                Problem(
                    f"stage {s} holds {series[t]} micro-batches of activations at tick {t}, "
                    f"over the schedule's bound {bound}",
                    t,
                    s,
                )
            )
    return out


def _version_problems(schedule: Schedule) -> list[Problem]:
    """2BW: one version per micro-batch, staleness 1, each version live when read."""
    tasks = [
        (t, s, c)
        for t, row in enumerate(schedule.ticks)
        for s, c in enumerate(row)
        if c is not None
    ]
    if not any(c.version is not None for _, _, c in tasks):
        return []
    M = schedule.num_micro_batches
    made: dict[tuple[int, int], int] = {}  # (mesh, version) -> tick of the update that made it
    last = TaskKind.W if _split(schedule) else TaskKind.B
    for t, s, c in tasks:
        if c.kind is last:
            step = c.mb // M
            made[(s, step + 1)] = max(made.get((s, step + 1), -1), t)
    out = []
    for t, s, c in tasks:
        want = max(c.mb // M - 1, 0)
        if c.version != want:
            out.append(
                Problem(f"task {c} on stage {s} reads version {c.version}, want {want}", t, s)
            )
            continue
        born = made.get((s, want), -1) if want else -1
        retired = made.get((s, want + 2))
        if born >= t or (retired is not None and retired < t):
            out.append(
                Problem(
                    f"task {c} on stage {s} at tick {t} reads version {want}, not live then", t, s
                )
            )
    return out


def format_grid(schedule: Schedule, mark: tuple[int, int] | None = None, around: int = 8) -> str:
    """The ticks x meshes grid; ``mark=(tick, mesh)`` puts ``>...<`` round that cell and
    shows only ``around`` ticks either side of it."""
    cells = [[str(c) if c else "." for c in row] for row in schedule.ticks]
    if mark is not None and mark[0] < len(cells) and mark[1] is not None:
        t, s = mark
        cells[t][s] = f">{cells[t][s]}<"
    width = max([4] + [len(c) for row in cells for c in row])
    lo, hi = 0, len(cells)
    if mark is not None:
        lo, hi = max(0, mark[0] - around), min(len(cells), mark[0] + around + 1)
    lines = ["  tick " + " ".join(f"{'s' + str(s):>{width}}" for s in range(schedule.num_stages))]
    lines += [f"  {t:>4} " + " ".join(f"{c:>{width}}" for c in cells[t]) for t in range(lo, hi)]
    return "\n".join(lines)


def problems_with_grid(schedule: Schedule) -> list[str]:
    """:func:`schedule_problems` as text, the first followed by the grid around its cell
    (what the ``MESHSHARD_CHECKS=1`` pass checks report)."""
    problems = schedule_problems(schedule)
    out = [str(p) for p in problems]
    if problems and problems[0].tick is not None:
        out[0] += "\n" + format_grid(schedule, (problems[0].tick, problems[0].mesh))
    return out


def check_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` on the first problem, with the grid around it marked."""
    problems = schedule_problems(schedule)
    if not problems:
        return None
    first = problems[0]
    mark = (first.tick, first.mesh) if first.tick is not None else None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ScheduleError(
        f"schedule {schedule.name} ({schedule.num_stages} stages x "
        f"{schedule.num_micro_batches} micro-batches): {first}{more}\n"
        + format_grid(schedule, mark)
    )


def stream_problems(plan: Plan) -> list[str]:
    """Emitted streams: each worker holds at most the bound's residuals ``R`` at once."""
    bound = plan.schedule.activation_bound
    if not bound or plan.schedule.name == "inference":
        return []
    out = []
    for stream in plan.streams:
        live: dict[int, set] = {}
        peak: dict[int, int] = {}
        for ins in stream.instructions:
            for b in ins.writes:
                if b.kind is BufferKind.RESIDUALS and b.mb is not None:
                    live.setdefault(b.owner, set()).add(b)
                    peak[b.owner] = max(peak.get(b.owner, 0), len(live[b.owner]))
            if isinstance(ins, Free) and ins.buffer.kind is BufferKind.RESIDUALS:
                live.get(ins.buffer.owner, set()).discard(ins.buffer)
        for stage, n in sorted(peak.items()):
            mesh = stage % plan.schedule.num_stages
            if mesh < len(bound) and n > bound[mesh]:
                out.append(
                    f"w{stream.worker}: holds {n} residuals of stage {stage} at once, over the "
                    f"schedule's bound {bound[mesh]}"
                )
    return out

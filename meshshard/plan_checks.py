"""Checks of a plan as a file: the JSON document's shape, and the plan against its header.

A plan is a file people can edit, so two kinds of damage need catching before a plan
runs or is simulated:

* a document that is not a plan at all (a list, ``{}``, a field of the wrong type):
  :func:`check_plan_document` names every missing top-level field at once, and the
  typed decoder (:mod:`meshshard.plan_json`) names anything else by its path; both
  raise :class:`PlanFormatError`;
* a plan whose header no longer matches its body (an edited ``num_micro_batches``,
  fingerprint or mesh shape): :func:`header_problems` lists every mismatch, and
  :func:`meshshard.verify.verify` includes them.

    >>> check_plan_document({"method": "edited"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    meshshard.plan_json.PlanFormatError: plan JSON lacks field(s) cluster, num_micro_batches, ...
"""

from __future__ import annotations

import re

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.instructions import Load, Run
from meshshard.plan_json import PlanFormatError

#: Top-level fields every plan document has (``notes`` may be left out).
PLAN_FIELDS = (
    "method",
    "cluster",
    "num_micro_batches",
    "fingerprint",
    "meshes",
    "stages",
    "programs",
    "buffers",
    "transfers",
    "schedule",
    "streams",
    "inputs",
    "outputs",
)

#: A traced step's hash (16 hex digits), a labelled synthetic plan (``synthetic-`` and 12
#: hex digits), or empty for a plan that runs no programs (a transfer-only plan).
FINGERPRINT = re.compile(r"^(?:[0-9a-f]{16}|[a-z]+-[0-9a-f]{12})$")


def check_plan_document(doc) -> None:
    """Reject a plan JSON object that lacks top-level plan fields, naming all of them at
    once (the typed decoder, ``plan_json.decode``, rejects a document that is not an
    object, and names a field of the wrong type by its path)."""
    if not isinstance(doc, dict):
        return  # plan_json.decode: "<document>: expected a Plan object, got ..."
    missing = [k for k in PLAN_FIELDS if k not in doc]
    if missing:
        raise PlanFormatError(
            f"plan JSON lacks field(s) {', '.join(missing)}; write plans with "
            "Plan.to_json() (or `meshshard.parallelize(...).lower(...)`) and edit only values"
        )


def header_problems(plan, cluster: ClusterSpec | None = None) -> list[str]:
    """Every way ``plan``'s body disagrees with its header (micro-batch count, mesh shapes
    against ``cluster`` — default the plan's own — and the fingerprint's format)."""
    problems = _micro_batch_problems(plan)
    problems += mesh_problems(plan, plan.cluster, "its header's cluster")
    if cluster is not None and cluster != plan.cluster:
        blocks = plan.cluster.worker_blocks
        if blocks and not cluster.worker_blocks:  # meshes share hosts: the worker view
            try:
                cluster = cluster.split(blocks)
            except ValueError as exc:
                return problems + [f"the plan's host-actor blocks do not fit: {exc}"]
        problems += mesh_problems(plan, cluster, f"cluster {cluster.name!r}")
    if plan.programs and not FINGERPRINT.match(plan.fingerprint):
        problems.append(
            f"fingerprint {plan.fingerprint!r} is not a traced step's hash (16 hex digits); "
            "re-lower the step instead of editing the plan's fingerprint"
        )
    return problems


def _micro_batch_problems(plan) -> list[str]:
    m = plan.num_micro_batches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        return [f"num_micro_batches is {m!r}; it must be a positive integer"]
    problems = []
    sched = plan.schedule
    per = sched.num_stages * sched.virtual_stages
    replicas = len(plan.meshes) // per if per else 1  # data-parallel replicas of the grid
    if sched.num_micro_batches != m and sched.num_micro_batches * replicas != m:
        problems.append(
            f"num_micro_batches is {m} but the schedule {plan.schedule.name!r} runs "
            f"{plan.schedule.num_micro_batches}"
        )
    steps = plan.schedule.steps  # a flush-free schedule numbers micro-batches across steps
    for stream in plan.streams:
        top = _highest_micro_batch(stream.instructions)
        if top >= m * steps:
            per = f" x {steps} steps" if steps > 1 else ""
            problems.append(
                f"w{stream.worker}: the stream uses micro-batch {top} but "
                f"num_micro_batches is {m}{per}"
            )
    return problems


def _highest_micro_batch(instructions) -> int:
    """The highest micro-batch a stream's instructions or their buffers name (-1: none).
    Simulating a large plan runs this over every instruction, so it stays one plain loop."""
    top = -1
    for ins in instructions:
        if isinstance(ins, Run | Load) and ins.mb is not None and ins.mb > top:
            top = ins.mb
        for refs in (ins.reads, ins.writes):
            for b in refs:
                k = getattr(b, "mb", None)
                if k is not None and k > top:
                    top = k
    return top


def mesh_problems(plan, cluster: ClusterSpec, what: str) -> list[str]:
    """Meshes that do not fit ``cluster`` (host indices, devices per host, shape vs hosts)."""
    problems = []
    for mesh in plan.meshes:
        shape = tuple(mesh.shape)
        if len(shape) != 2 or any(isinstance(n, bool) or not isinstance(n, int) for n in shape):
            problems.append(f"mesh{mesh.id}: shape {shape} is not (hosts, devices)")
            continue
        if shape[0] < 1 or shape[1] < 1:
            problems.append(f"mesh{mesh.id}: shape {shape} has an empty axis")
        if shape[0] != len(mesh.hosts) or len(set(mesh.hosts)) != len(mesh.hosts):
            problems.append(
                f"mesh{mesh.id}: shape {shape} needs {shape[0]} distinct hosts, "
                f"lists {list(mesh.hosts)}"
            )
        bad = [h for h in mesh.hosts if not 0 <= h < cluster.num_hosts]
        have = min((cluster.worker_devices(h) for h in mesh.hosts if h not in bad), default=0)
        if shape[1] > (have or cluster.devices_per_host):
            problems.append(
                f"mesh{mesh.id}: shape {shape} uses {shape[1]} devices per host but "
                f"{what} has devices_per_host={have or cluster.devices_per_host}"
            )
        if bad:
            problems.append(
                f"mesh{mesh.id}: hosts {bad} are outside {what} "
                f"(num_hosts={cluster.num_hosts}: h0..h{cluster.num_hosts - 1})"
            )
    return problems


class PlanVerifyError(MeshshardInputError):
    """A plan fails :func:`meshshard.verify.verify`; the message lists every problem."""


def require_valid_plan(
    plan, cluster: ClusterSpec | None = None, *, what: str = "run", streams: bool = True
) -> None:
    """Raise :class:`PlanVerifyError` if ``verify(plan, cluster)`` finds problems, so an
    edited or broken plan is refused before it is compiled or simulated.  With
    ``streams=False`` only the header checks run (the simulator also takes hand-built
    plans whose streams keep buffers the runtime would free)."""
    from meshshard.verify import verify

    problems = verify(plan, cluster) if streams else header_problems(plan, cluster)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise PlanVerifyError(
            f"cannot {what} plan {plan.method!r}: it fails verify(): "
            + "; ".join(problems[:3])
            + more
            + ". Re-lower the step (step.lower(...)) rather than editing the plan"
        )

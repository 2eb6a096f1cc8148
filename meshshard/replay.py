"""Running a step from a plan made earlier (``parallelize(step, method=..., plan=...)``).

Planning a large step (automatic stages, profiling, the sharding ILP) takes long; a plan
saved with ``plan.to_json()`` runs again without planning, as Alpa's ``plan_to_method``
does.  The step is still traced (cheap), and the plan is used only when it was made for
this program, this method and a cluster of this size: anything else is refused with
what differs, never run on the wrong layout.
"""

from __future__ import annotations

import os

from meshshard.cluster import ClusterSpec
from meshshard.errors import MeshshardInputError
from meshshard.plan import Plan


def load_plan(plan: Plan | str | os.PathLike | None) -> Plan | None:
    """``plan`` as a :class:`Plan`: a plan, its JSON text, or the path of a JSON file."""
    if plan is None or isinstance(plan, Plan):
        return plan
    if isinstance(plan, os.PathLike) or (
        isinstance(plan, str) and not plan.lstrip().startswith("{")
    ):
        path = os.fspath(plan)
        if not os.path.isfile(path):
            raise MeshshardInputError(
                f"plan={path!r} is not a file; pass a Plan, its JSON text (plan.to_json()) "
                "or the path of a file holding it"
            )
        with open(path) as f:
            return Plan.from_json(f.read())
    if isinstance(plan, str):
        return Plan.from_json(plan)
    raise MeshshardInputError(
        f"plan must be a Plan, its JSON text or a file path, got {type(plan).__name__}"
    )


def check_replay(plan: Plan, fingerprint: str, method, cluster: ClusterSpec) -> None:
    """Refuse ``plan`` unless it was made for the traced program (``fingerprint``), with
    ``method`` and on a cluster with as many devices as ``cluster``."""
    if plan.method != repr(method):
        raise MeshshardInputError(
            f"plan= was made with method {plan.method}, but the step is parallelized with "
            f"{method!r}; pass the method the plan was made with"
        )
    if plan.fingerprint != fingerprint:
        raise MeshshardInputError(
            f"plan= was made for another program (fingerprint {plan.fingerprint}; this step "
            f"traces to {fingerprint}): the step's code, its arguments' shapes or dtypes, or "
            "the values it closes over changed since; plan it again (drop plan=)"
        )
    have = cluster.num_hosts * cluster.devices_per_host
    want = plan.cluster.num_hosts * plan.cluster.devices_per_host
    if have != want:
        raise MeshshardInputError(
            f"plan= was made for cluster {plan.cluster.name} ({plan.cluster.num_hosts} hosts "
            f"x {plan.cluster.devices_per_host} devices), but this cluster "
            f"{cluster.name} has {cluster.num_hosts} x {cluster.devices_per_host}; plan it "
            "again on this cluster (drop plan=)"
        )

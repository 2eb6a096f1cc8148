"""meshshard: pipeline + data + tensor parallel JAX train steps on Ray.

This module only re-exports; the code lives in submodules.
"""

from meshshard._layout import extend_package_path as _extend_package_path

_extend_package_path(__path__)

from meshshard.api import ParallelizedFunction, parallelize  # noqa: E402
from meshshard.autodiff import grad, value_and_grad  # noqa: E402
from meshshard.checkpoint import CheckpointManager, restore, save  # noqa: E402
from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.dynamic_scale import DynamicScale  # noqa: E402
from meshshard.errors import MeshshardInputError, MeshshardRuntimeError  # noqa: E402
from meshshard.methods import (  # noqa: E402
    DataParallel,
    FollowParallel,
    PipeshardParallel,
    ShardParallel,
)
from meshshard.metrics import aux_max, aux_mean, aux_min, aux_sum  # noqa: E402
from meshshard.plan import Plan  # noqa: E402
from meshshard.primitives import mark_pipeline_boundary  # noqa: E402
from meshshard.runtime.cluster import init, recover, shutdown  # noqa: E402
from meshshard.runtime.executable import RemoteArray, fetch  # noqa: E402
from meshshard.shard_pin import shard  # noqa: E402
from meshshard.sim import SimResult, simulate  # noqa: E402

__all__ = [
    "CheckpointManager",
    "ClusterSpec",
    "DataParallel",
    "DynamicScale",
    "FollowParallel",
    "MeshshardInputError",
    "MeshshardRuntimeError",
    "ParallelizedFunction",
    "RemoteArray",
    "SimResult",
    "aux_max",
    "aux_mean",
    "aux_min",
    "aux_sum",
    "PipeshardParallel",
    "Plan",
    "fetch",
    "grad",
    "init",
    "mark_pipeline_boundary",
    "parallelize",
    "recover",
    "restore",
    "save",
    "shard",
    "ShardParallel",
    "shutdown",
    "simulate",
    "value_and_grad",
]

"""meshshard: pipeline + data + tensor parallel JAX train steps on Ray.

This module only re-exports; the code lives in submodules.
"""

from meshshard._layout import extend_package_path as _extend_package_path

_extend_package_path(__path__)

from meshshard.cluster import ClusterSpec  # noqa: E402
from meshshard.plan import Plan  # noqa: E402

__all__ = ["ClusterSpec", "Plan"]

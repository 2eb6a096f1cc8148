"""Make ``meshshard.passes`` and ``meshshard.runtime`` importable from a source checkout.

The repository keeps the compiler passes in ``passes/`` and the runtime in ``runtime/``
at its root (a layout our users rely on); a wheel installs them as
``meshshard/passes`` and ``meshshard/runtime``.  When the package is imported straight
from a checkout, the repository root is added to the package's search path so the
same import names work without installing.
"""

from __future__ import annotations

import os


def extend_package_path(path: list[str]) -> None:
    """Append the checkout root to ``meshshard.__path__`` when ``passes/`` lives beside us."""
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.isdir(os.path.join(here, "passes")):
        return  # installed layout: subpackages are inside the package
    root = os.path.dirname(here)
    if os.path.isfile(os.path.join(root, "passes", "__init__.py")) and root not in path:
        path.append(root)

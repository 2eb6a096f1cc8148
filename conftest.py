"""Repository-wide pytest setup: emulated devices, doctests of ``passes/`` and
``runtime/``, the ``--update-golden`` option and the test tiers.

Tiers (markers, ``pyproject.toml``): ``ray`` tests start Ray actors, ``slow`` tests
take more than a few seconds each without Ray, and every other test (doctests
included) is ``fast``; ``make test`` runs all, ``make test-fast`` only ``-m fast``.

``passes/`` and ``runtime/`` are the packages ``meshshard.passes`` and
``meshshard.runtime`` (BUILD_NOTES.md, "Install modes").  When ``--doctest-modules``
collects a file there, pytest imports it by its path as ``passes.emit`` or
``runtime.transport``; loaded under that second name a module would be a copy, with its
own classes and registries.  The finder below makes the bare names aliases of the
package's modules instead, so every doctest runs against the one ``meshshard.*``
module, under the editable install and from a plain checkout alike.
"""

import importlib
import importlib.abc
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

# Eight emulated CPU devices; and the test run compiles with the LLVM backend's
# optimizations off (HLO passes, sharding and fusion decisions are unchanged, only the
# machine code is plainer): the tiny test models spend far longer compiling than
# running, and this cuts a GPT test's time by a quarter to a third.  XLA:CPU's older
# elemental emitters (``--xla_cpu_use_fusion_emitters=false``) compile the same fusions
# in less time than its MLIR fusion emitters: a script that builds the GPT example's
# state, runs jax.jit of its step and a first two-stage pipelined step used 18 s of CPU
# instead of 25-27 s (BUILD_NOTES.md, "Tests").  Every process of the run inherits
# these: xdist workers, Ray host-actors, subprocess tests.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8"
    + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    + " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Ray's log monitor re-globs its session's log directory every 0.1 s until it watches
# 1000 files; from this threshold on it does so every 0.5 s.  Over a run that keeps one
# Ray instance up for many minutes that polling was about a twelfth of the suite's
# sampled CPU time (py-spy); worker output still reaches the driver, at most 0.5 s later.
os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")


def _share_compiled_programs() -> None:
    """One persistent XLA compilation cache for the whole run, in a fresh temporary
    directory: many tests compile the same stage programs (the same GPT split under
    another schedule or optimizer), and the xdist workers and the Ray host-actors
    inherit the directory from this environment.  The cache is keyed by the program's
    HLO and compile options, so a hit is the same executable; it starts empty every run
    and is removed at the end.  ``MESHSHARD_TEST_COMPILE_CACHE=0`` turns it off."""
    if os.environ.get("MESHSHARD_TEST_COMPILE_CACHE", "1") == "0":
        return
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the xdist master (or a plain run)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="meshshard-xla-")
        os.environ["MESHSHARD_TEST_CACHE_OWNER"] = str(os.getpid())
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


_share_compiled_programs()

ALIASED = ("passes", "runtime")


class _Alias(importlib.abc.Loader):
    """Loads ``passes.x`` as the already imported ``meshshard.passes.x``."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Resolves ``passes[.x]`` / ``runtime[.x]`` to ``meshshard.passes[.x]`` / ``meshshard.runtime[.x]``."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ALIASED:
            return None
        module = importlib.import_module(f"meshshard.{name}")
        return importlib.util.spec_from_loader(name, _Alias(module))


sys.meta_path.insert(0, _AliasFinder())


def pytest_addoption(parser):
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/* with the current output instead of comparing (tests/golden.py)",
    )


def pytest_configure(config):
    if config.getoption("--update-golden"):
        os.environ["MESHSHARD_UPDATE_GOLDEN"] = "1"


def pytest_unconfigure(config):
    if os.environ.get("MESHSHARD_TEST_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test not marked ``slow`` or ``ray`` is ``fast`` (``make test-fast`` runs those).

    ``ray`` tests also join one ``xdist_group``: under ``pytest -n 2 --dist loadgroup``
    (``make test``) one worker runs them all, in order, on one shared Ray instance, while
    the other worker takes the rest.  Ray tests marked ``own_cluster`` (a subprocess with
    its own Ray cluster) form a second group, so they can run beside the shared one.
    """
    _group_hosts_first(items)
    for item in items:
        if item.get_closest_marker("ray") is not None:
            # a test that starts its own Ray cluster in a subprocess needs no shared one
            own = item.get_closest_marker("own_cluster") is not None
            item.add_marker(pytest.mark.xdist_group("ray-own" if own else "ray"))
        elif item.get_closest_marker("slow") is None:
            item.add_marker("fast")


def _jax_groups(item) -> int:
    marker = item.get_closest_marker("jax_groups")
    return marker.args[0] if marker is not None else 0


def _group_hosts_first(items) -> None:
    """Run the shared cluster's tests whose meshes span hosts first, those with the most
    such meshes first (marker ``jax_groups(n)``), the others after, each kind in collection order.

    A host-actor joins at most one multi-host JAX group, before its first JAX use: an
    actor that ran a one-host mesh restarts to join one, and one in a group restarts to
    run one-host meshes (``RayCluster.prepare``).  In file order the shared cluster's
    tests restarted actors ten times (each restart costs the new actors' imports and a
    new transfer group, 8-18 s); this order needs two.  The same tests, the same checks:
    only the order of the shared cluster's tests changes, and the sort is stable (each
    xdist worker collects the same order)."""
    shared = [
        i
        for i, item in enumerate(items)
        if item.get_closest_marker("ray") is not None
        and item.get_closest_marker("own_cluster") is None
    ]
    ordered = sorted((items[i] for i in shared), key=lambda item: -_jax_groups(item))
    for i, item in zip(shared, ordered, strict=True):
        items[i] = item

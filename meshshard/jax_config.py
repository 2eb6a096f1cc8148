"""The driver's JAX configuration that a host-actor must share to trace and lower the
same step.

Host-actors are separate processes: they trace the user's function again (checked
against the plan's fingerprint) and lower its programs with their own ``jax.config``.
A driver with ``jax_enable_x64`` on traced float64 parameters that an actor would
truncate to float32; a default matmul precision or a PRNG setting would change the
numbers an actor's programs compute without changing the trace.  So the driver sends
these settings with every compile and each actor takes them first.
"""

from __future__ import annotations

import jax

#: settings that change a traced program or how it lowers (read with ``jax.config``)
TRACE_SETTINGS = (
    "jax_enable_x64",
    "jax_default_matmul_precision",
    "jax_default_prng_impl",
    "jax_threefry_partitionable",
    "jax_numpy_dtype_promotion",
    "jax_numpy_rank_promotion",
    "jax_softmax_custom_jvp",
)


def trace_settings() -> dict[str, object]:
    """This process's values of :data:`TRACE_SETTINGS` (those its JAX has), as in force
    here now: a ``with jax.default_matmul_precision(...)`` block around the call counts."""
    out = {}
    for name in TRACE_SETTINGS:
        try:
            out[name] = getattr(jax.config, name)
        except AttributeError:  # a JAX without this setting
            continue
    return out


def take_trace_settings(settings: dict[str, object]) -> None:
    """Make this process's JAX configuration agree with the driver's ``settings`` (from
    :func:`trace_settings`); a setting this JAX lacks is skipped.

    >>> before = trace_settings()
    >>> take_trace_settings({**before, "jax_numpy_rank_promotion": "warn"})
    >>> jax.config.jax_numpy_rank_promotion
    'warn'
    >>> take_trace_settings(before)
    >>> trace_settings() == before
    True
    """
    for name, value in settings.items():
        try:
            if getattr(jax.config, name) != value:
                jax.config.update(name, value)
        except AttributeError:
            continue

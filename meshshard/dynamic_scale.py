"""Dynamic loss scaling for mixed-precision steps, pipelined like any other step.

Flax's ``DynamicScale.value_and_grad`` differentiates with ``jax.value_and_grad``, which
meshshard can run only as one program (one stage, one micro-batch).  ``DynamicScale``
here is the same pytree with the same fields, so a step changes only its import, and its
``value_and_grad`` differentiates with ``meshshard.value_and_grad``: the scaled loss is
pipelined and accumulated over micro-batches, and the finiteness check and the scale's
update run once, on the accumulated gradients, as in the single-device step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax.training import dynamic_scale as flax_dynamic_scale

from meshshard.autodiff import value_and_grad as _value_and_grad
from meshshard.errors import MeshshardInputError

__all__ = ["DynamicScale", "DynamicScaleResult"]

DynamicScaleResult = flax_dynamic_scale.DynamicScaleResult


class DynamicScale(flax_dynamic_scale.DynamicScale):
    """Flax's ``DynamicScale`` (same fields, defaults and update rule) for meshshard steps.

    >>> import jax.numpy as jnp
    >>> ds, finite, loss, g = DynamicScale(scale=4.0).value_and_grad(lambda w: w**2)(3.0)
    >>> float(loss), float(g), bool(finite), int(ds.fin_steps)
    (9.0, 6.0, True, 1)
    """

    def value_and_grad(
        self,
        fun: Callable,
        argnums: int | Sequence[int] = 0,
        has_aux: bool = False,
        axis_name: str | None = None,
        *,
        aux_reduce: str | Mapping[str, str] | None = None,
        loss_reduce: str | None = None,
    ) -> Callable[..., DynamicScaleResult]:
        """``meshshard.value_and_grad`` of ``fun`` with the loss scaled by ``self.scale``.

        Returns a function giving ``(new DynamicScale, finite, value, gradients)`` as
        Flax's does: the value and the float32 gradients unscaled, ``finite`` true when
        every gradient is finite, the scale grown after ``growth_interval`` finite steps in
        a row and backed off after a non-finite one.  ``aux_reduce`` and ``loss_reduce``
        are ``meshshard.value_and_grad``'s.
        """
        if axis_name is not None:
            raise MeshshardInputError(
                f"meshshard.DynamicScale.value_and_grad(axis_name={axis_name!r}): meshshard "
                "steps are SPMD programs with no named axis to average over; the gradients "
                "are already the full batch's. Leave axis_name out"
            )
        scale = self.scale

        def scaled(*args):
            out = fun(*args)
            return (scale * out[0], out[1]) if has_aux else scale * out

        grad_fn = _value_and_grad(
            scaled, argnums, has_aux, aux_reduce=aux_reduce, loss_reduce=loss_reduce
        )

        @functools.wraps(fun)
        def wrapped(*args) -> DynamicScaleResult:
            value, grads = grad_fn(*args)
            value = (value[0] / scale, value[1]) if has_aux else value / scale
            grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / scale, grads)
            finite = jnp.array(True)
            for g in jax.tree.leaves(grads):
                finite = finite & jnp.all(jnp.isfinite(g))
            return DynamicScaleResult(self._updated(finite), finite, value, grads)

        return wrapped

    def _updated(self, finite) -> DynamicScale:
        """The scale and finite-step count after a step whose gradients were ``finite``."""
        due = self.fin_steps == self.growth_interval
        grown = jnp.minimum(self.scale * self.growth_factor, jnp.finfo(jnp.float32).max)
        kept = jnp.where(due & finite, grown, self.scale)
        backed_off = self.scale * self.backoff_factor
        if self.minimum_scale is not None:
            backed_off = jnp.maximum(backed_off, self.minimum_scale)
        return self.replace(
            scale=jnp.where(finite, kept, backed_off),
            fin_steps=jnp.where(due | ~finite, 0, self.fin_steps + 1),
        )

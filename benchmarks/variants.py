"""The precision variants compared, and the training step each one runs.

A variant is one row of `VARIANTS`; adding one (a new autocast policy, say) is one
line there. Every variant trains float32 parameters with the same optimizer; they
differ in how the forward pass is cast and whether the loss is scaled.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

import mpjax
from benchmarks.models import ModelSpec, cross_entropy

F16, BF16 = jnp.float16, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Variant:
    """How a model is run in (mixed) precision.

    Attributes:
      module_dtype: the Flax modules' ``dtype``: None for the float32 model,
        a 16-bit dtype for the model cast by hand.
      autocast: the dtype for ``mpjax.autocast(model.apply, dtype=...)``; None
        runs ``model.apply`` as it is.
      autocast_kwargs: further keyword arguments of `mpjax.autocast` (a policy).
      scaler: wrap the optimizer in `mpjax.grad_scaler` and differentiate with
        `mpjax.scaled_value_and_grad`.
      baseline: the variant this one is compared against (same 16-bit dtype,
        cast by hand), or None.
    """

    module_dtype: Any = None
    autocast: Any = None
    autocast_kwargs: dict = dataclasses.field(default_factory=dict)
    scaler: bool = False
    baseline: str | None = None

    @property
    def low_dtype(self):
        return self.autocast if self.autocast is not None else self.module_dtype


VARIANTS: dict[str, Variant] = {
    "float32": Variant(),
    "autocast-f16": Variant(autocast=F16, scaler=True, baseline="handcast-f16"),
    "autocast-bf16": Variant(autocast=BF16, baseline="handcast-bf16"),
    "handcast-f16": Variant(module_dtype=F16, scaler=True),
    "handcast-bf16": Variant(module_dtype=BF16),
}
"""Every variant benchmarked, by name. bfloat16 has float32's range, so its
variants need no loss scaling; float16's do (the hand-cast one too)."""

# A memory-lean autocast policy, measured as soon as mpjax offers one.
if "policy" in inspect.signature(mpjax.autocast).parameters:
    VARIANTS["autocast-f16-lean"] = Variant(
        autocast=F16, autocast_kwargs=dict(policy="lean"), scaler=True, baseline="handcast-f16"
    )
    VARIANTS["autocast-bf16-lean"] = Variant(
        autocast=BF16, autocast_kwargs=dict(policy="lean"), baseline="handcast-bf16"
    )


def forward(spec: ModelSpec, variant: Variant) -> Callable:
    """``apply(params, state, inputs) -> (logits, state)`` of the model in this variant.

    `state` is the collections the model updates as it trains (`ModelSpec.mutable`:
    BatchNorm's running statistics), passed in and returned updated; ``{}`` for a
    model without any.
    """
    apply = spec.module(variant.module_dtype).apply
    if variant.autocast is not None:
        apply = mpjax.autocast(apply, dtype=variant.autocast, **variant.autocast_kwargs)
    mutable = list(spec.mutable)

    def run(params, state, inputs):
        if not mutable:
            return apply(params, inputs), state
        return apply({**params, **state}, inputs, mutable=mutable)

    return run


def loss_fn(spec: ModelSpec, variant: Variant) -> Callable:
    """``loss(params, state, batch) -> (scalar float32, state)``: the updated state is
    the auxiliary output (``has_aux=True``)."""
    apply = forward(spec, variant)

    def loss(params, state, batch):
        logits, state = apply(params, state, batch["inputs"])
        return cross_entropy(logits, batch["targets"]), state

    return loss


def value_fn(spec: ModelSpec, variant: Variant) -> Callable:
    """``loss(params, state, batch) -> scalar float32``: the loss alone, as `jax.vjp`
    and `jax.grad` without ``has_aux`` take it (the state update is left out)."""
    loss = loss_fn(spec, variant)
    return lambda params, state, batch: loss(params, state, batch)[0]


def optimizer(variant: Variant, scaler: bool | None = None) -> optax.GradientTransformation:
    """AdamW, wrapped in the grad scaler if the variant (or `scaler`) says so."""
    tx = optax.adamw(3e-4, weight_decay=0.1)
    return mpjax.grad_scaler(tx) if (variant.scaler if scaler is None else scaler) else tx


def train_step(
    spec: ModelSpec, variant: Variant, scaler: bool | None = None, scaled_loss: bool | None = None
) -> tuple[Callable, Any]:
    """``(step, tx)``: one full training step (forward, backward, optimizer), unjitted.

    ``step(params, state, opt_state, batch) -> (params, state, opt_state, loss)``. A
    new function each call, so that jit's caches never hand a compiled step to a timing.
    `scaled_loss`: the gradients from `mpjax.scaled_value_and_grad` (by default where
    the optimizer is the grad scaler) or from ``jax.value_and_grad``.
    """
    loss = loss_fn(spec, variant)
    scaled = variant.scaler if scaler is None else scaler
    tx = optimizer(variant, scaled)
    scaled_loss = scaled if scaled_loss is None else scaled_loss

    def step(params, state, opt_state, batch):
        if scaled_loss:
            grad_fn = mpjax.scaled_value_and_grad(loss, opt_state, has_aux=True)
        else:
            grad_fn = jax.value_and_grad(loss, has_aux=True)
        (value, state), grads = grad_fn(params, state, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), state, opt_state, value

    return step, tx


def step_specs(spec: ModelSpec, tx) -> tuple:
    """Abstract (params, state, opt_state, batch): enough to trace, lower and compile."""
    params, state = spec.param_spec()
    return params, state, jax.eval_shape(tx.init, params), spec.batch_spec()

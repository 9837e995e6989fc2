"""A max-pool of a ReLU, evaluated as the ReLU of the max-pool.

A CNN's stem (convolution, norm, ReLU, max-pool) is its largest activation, and
its backward pass holds, at that size, the ReLU's output (where the pool's
backward finds each window's maximum), the pool's input cotangent and the ReLU's.
Under the default policy the norm returns float32, as torch's does, so all three
are float32: on a GPU, this is where a ResNet's training step peaks. A ReLU is
non-decreasing, so it commutes with a max: ``max_pool(relu(x))`` and
``relu(max_pool(x))`` are the same values, and autodiff routes each window's
cotangent to the same element (the window's maximum where it is positive; nowhere
where it is not, the ReLU's derivative being zero there). The
ReLU after the pool runs on a quarter of the elements (a 3x3, stride-2 pool), and
the pool's cotangent is the ReLU's input cotangent: one full-size float32 tensor
fewer, forward and backward.

Only ``jax.nn.relu`` (Flax's ``nn.relu``) is moved: its custom derivative is
zero at 0, which the argument above needs (``lax.max(x, 0.)`` splits ties at 0
in halves). And only where nothing else reads the ReLU's output, and no window
lies wholly in the padding (whose maximum is the pool's -inf, not the ReLU's 0).
Gradients differ only in a window that holds a NaN, where the loss is NaN.
The default policy moves it; ``policy="lean"``, whose stem is 16-bit already,
does not: compiled for a GPU, its ResNet peaked 0.1 GiB higher reordered.
"""

from __future__ import annotations

import collections
import functools

import jax
import numpy as np

from mpjax import _compat


def relu_pools(jaxpr, observing=frozenset()) -> dict[int, int]:
    """``{index of a max-pool: index of the jax.nn.relu it alone reads}`` in `jaxpr`,
    the equations that only observe (`observing`) not counted as readers."""
    eqns = jaxpr.eqns
    relus = {
        eqn.outvars[0]: i
        for i, eqn in enumerate(eqns)
        if eqn.primitive.name == "custom_jvp_call" and _is_relu(eqn)
    }
    if not relus:
        return {}
    pools = {
        k: relus[eqn.invars[0]]
        for k, eqn in enumerate(eqns)
        if eqn.primitive.name == "reduce_window_max"
        and not isinstance(eqn.invars[0], _compat.Literal)
        and eqn.invars[0] in relus
        and _commutes(eqn.params, eqn.invars[0].aval.shape)
    }
    if not pools:
        return {}
    reads = collections.Counter(
        v
        for vs in [jaxpr.outvars, *(e.invars for i, e in enumerate(eqns) if i not in observing)]
        for v in vs
        if not isinstance(v, _compat.Literal)
    )
    return {k: i for k, i in pools.items() if reads[eqns[i].outvars[0]] == 1}


def relu_of(evaluate, env, out, relu_eqn) -> None:
    """``env[out]``, a max-pool's value, replaced by its ReLU: ``jax.nn.relu`` traced
    at the pooled type and run by `evaluate` (``(closed jaxpr, args, weak)`` to
    outputs), as the interpreter runs the ReLU it replaces (its derivative's
    zeros made again in the backward pass, not kept)."""
    pooled, weak = env[out]
    with _compat.equation_context(relu_eqn):
        (value,), _ = evaluate(jax.make_jaxpr(jax.nn.relu)(pooled), [pooled], [weak])
    env[out] = (value, weak)


def _is_relu(eqn) -> bool:
    return (
        len(eqn.invars) == 1
        and eqn.params.get("num_consts", 0) == 0
        and _compat.called_source(eqn) == _relu_source()
    )


@functools.cache
def _relu_source() -> str:
    """Where ``jax.nn.relu`` is defined, as the debug info of its equations says."""
    closed = jax.make_jaxpr(jax.nn.relu)(np.zeros((1,), np.float32))
    (eqn,) = _compat.jaxpr_and_consts(closed)[0].eqns
    return _compat.called_source(eqn) or "jax.nn.relu"  # no debug info: never matched


def _commutes(params, shape) -> bool:
    """Whether every window holds an element of the operand (elsewhere the pool
    gives -inf, and its ReLU 0): no base dilation, and along each axis, each
    window a tap inside (a dilated window's taps can straddle the operand)."""
    if any(b != 1 for b in params["base_dilation"]):
        return False
    return all(
        _each_window_reads(*args)
        for args in zip(
            shape, params["window_dimensions"], params["window_strides"],
            params["window_dilation"], params["padding"],
        )
    )


def _each_window_reads(n, window, stride, dilation, padding) -> bool:
    """Along one axis of `n` elements, whether each window has a tap in the operand."""
    lo, hi = padding
    span = (window - 1) * dilation
    if not isinstance(n, int):  # a symbolic size: padded no more than a window spans
        return lo <= span and hi <= span and (dilation == 1 or window == 1)
    count = max(0, (n + lo + hi - span - 1) // stride + 1)
    # Only a window reaching into the padding can miss: those before the first
    # that starts inside, and from the first that ends past the operand.
    inside, past = -(-lo // stride), -(-(n - span + lo) // stride)
    edges = {*range(min(count, inside)), *range(max(0, past), count)}
    starts = [-lo + i * stride for i in edges]
    return all(any(0 <= s + k * dilation < n for k in range(window)) for s in starts)

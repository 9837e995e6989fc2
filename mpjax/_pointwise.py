"""An activation function between two products, evaluated as torch's fused
activation kernels do (`mpjax.fusions` finds it): at float32 on a 16-bit
activation, its result rounded once, and rematerialized for the backward pass.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

from mpjax import _compat
from mpjax._casting import F32, convert, dtype_of


def pointwise(chain, eqns, source_value):
    """The chain evaluated at float32 on a 16-bit `source_value`, its result
    rounded to that dtype; rematerialized for the backward pass. The checkpoint
    bars common-subexpression elimination: in a jitted step XLA would otherwise
    merge the recomputation with the forward chain and keep its float32
    intermediates (a GELU's tanh) after all. The same function of each layer is
    one cached jit, so JAX traces and differentiates it once."""
    program, literals = [], []
    index = {chain.source: 0}
    for i in chain.eqns:
        eqn = eqns[i]
        refs = []
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                refs.append(index[v])
            else:
                refs.append(-1 - len(literals))
                literals.append(np.asarray(v.val, dtype=v.aval.dtype))
        program.append((eqn.primitive, tuple(sorted(eqn.params.items())), tuple(refs)))
        index.update((o, len(index)) for o in eqn.outvars)
    constants = tuple((x.dtype, x.shape, x.tobytes()) for x in literals)
    key = (tuple(program), constants, index[chain.out])
    try:
        hash(key)
    except TypeError:  # an unhashable param: no cache
        return jax.checkpoint(_evaluator(*key, dtype_of(source_value)))(source_value)
    return _remat(key, np.dtype(dtype_of(source_value)))(source_value)


@functools.lru_cache(maxsize=1024)
def _remat(key, low):
    return _compat.inline_jit(jax.checkpoint(_evaluator(*key, low)))


def _evaluator(program, literals, out, low):
    """``function(x)``: `program` run at float32 on `x`, its value `out` rounded to `low`."""
    consts = [np.frombuffer(data, dtype).reshape(shape) for dtype, shape, data in literals]

    def function(x):
        values = [_widen(x)]
        for primitive, params, refs in program:
            args = [values[r] if r >= 0 else consts[-1 - r] for r in refs]
            outs = primitive.bind(*args, **primitive.get_bind_params(dict(params)))
            values.extend(outs if primitive.multiple_results else [outs])
        return convert(values[out], low, False)

    return function


@jax.custom_jvp
def _widen(x):
    """`x` in float32, its cotangent rounded back and kept apart from the chain's
    backward pass: on a GPU, XLA otherwise sums a bias's gradient from the
    float32 cotangent before the rounding, and so writes it to memory in float32
    between two kernels, where torch (and a hand-cast model) writes the 16-bit one."""
    return convert(x, F32, False)


@_widen.defjvp
def _widen_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return convert(x, F32, False), convert(_gpu_barrier(t), F32, False)


def _gpu_barrier(x):
    """`x` behind ``lax.optimization_barrier`` in a program lowered for a GPU, where
    it stops XLA from reading through the 16-bit rounding before it (its excess
    precision); as it is elsewhere, where the barrier would only bar fusions (a
    TPU fuses elementwise producers into its matrix products)."""
    barrier = jax.lax.optimization_barrier
    return jax.lax.platform_dependent(x, cuda=barrier, rocm=barrier, default=lambda v: v)

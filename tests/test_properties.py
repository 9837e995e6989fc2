"""Property tests: autocast on randomly composed programs.

Each example is a random straight-line program over a pool of float32 arrays,
drawn from elementwise ops, reductions, dot products, broadcasting, scan, cond,
custom_jvp activations and weak constants. Under autocast:

* every equation obeys the policy tables;
* the result is finite wherever the float32 program's is, and within a
  tolerance derived from the dtype's machine epsilon and the program's length;
* gradients of the float32 inputs are float32, finite, and close in norm.

Each run draws its programs from a seed, `conftest.PROPERTY_SEED` (pytest's header
shows it): the day's date, so that each day's runs try other programs while any run
can be repeated with MPJAX_PROPERTY_SEED. Three fixed programs use every op, in both
dtypes, on every run.
"""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from jax import lax

import mpjax
from conftest import F32, PROPERTY_SEED, assert_obeys_policy

N = 4  # every array is [N, N] or [N]


def _scan_tanh(a, b):
    return lax.scan(lambda c, row: (jnp.tanh(c + row @ b / N), None), a[0], a)[0] + 0 * a


def _cond(a, b):
    return lax.cond(jnp.sum(a) > 0, lambda: a @ b / N, lambda: jnp.sin(a) * b)


OPS = {
    # name: (arity, function); every op keeps values of moderate size
    "add": (2, lambda a, b: a + b),
    "sub": (2, lambda a, b: a - b),
    "mul": (2, lambda a, b: a * b),
    "div": (2, lambda a, b: a / (1.5 + jnp.tanh(b))),
    "matmul": (2, lambda a, b: a @ b / N),
    "einsum": (2, lambda a, b: jnp.einsum("ij,kj->ik", a, b) / N),
    "tanh": (1, jnp.tanh),
    "exp": (1, lambda a: jnp.exp(jnp.tanh(a))),
    "log": (1, lambda a: jnp.log1p(a * a)),
    "rsqrt": (1, lambda a: lax.rsqrt(1.0 + a * a)),
    "square": (1, jnp.square),
    "softmax": (1, lambda a: jax.nn.softmax(a, axis=-1)),
    "logsumexp": (1, lambda a: jax.nn.logsumexp(a, axis=-1, keepdims=True) + 0 * a),
    "mean_center": (1, lambda a: a - jnp.mean(a, axis=0)),  # broadcasting
    "normalize": (1, lambda a: jax.nn.standardize(a, axis=-1, epsilon=1e-3)),
    "relu": (1, jax.nn.relu),
    "softplus": (1, jax.nn.softplus),
    "gelu": (1, jax.nn.gelu),
    "scale_weak": (1, lambda a: 0.5 * a + 0.25),
    "mask_weak": (1, lambda a: jnp.where(a > 0, a, -1e4) * 0 + jnp.where(a > 0, a, 0.0)),
    "cumsum": (1, lambda a: jnp.cumsum(a, axis=0) / N),
    "max": (2, jnp.maximum),
    "scan": (2, _scan_tanh),
    "cond": (2, _cond),
}

program = st.lists(
    st.tuples(st.sampled_from(sorted(OPS)), st.integers(0, 63), st.integers(0, 63)),
    min_size=1,
    max_size=8,
)


def _run(prog, *inputs):
    pool = list(inputs)
    for name, i, j in prog:
        arity, fn = OPS[name]
        a, b = pool[i % len(pool)], pool[j % len(pool)]
        pool.append(fn(a, b) if arity == 2 else fn(a))
    return jnp.mean(jnp.tanh(pool[-1])) + jnp.mean(pool[-1] ** 2) / 8


def _inputs(seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return [jax.random.uniform(k, (N, N), minval=-1, maxval=1) for k in keys]


def _tolerance(low, n_ops):
    return 3 * (n_ops + 2) * float(jnp.finfo(low).eps)


# Every op once, in three chains of eight: each op takes the last value and an
# earlier one.
EVERY_OP = [
    [(name, 2 + k, k) for k, name in enumerate(sorted(OPS)[group::3])] for group in range(3)
]

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _every_op(test):
    for prog in EVERY_OP:
        for low in (jnp.float16, jnp.bfloat16):
            test = example(prog=prog, seed=0, low=low)(test)
    return test


@SETTINGS
@hypothesis_seed(PROPERTY_SEED)
@_every_op
@given(prog=program, seed=st.integers(0, 2**16), low=st.sampled_from([jnp.float16, jnp.bfloat16]))
def test_random_programs(prog, seed, low):
    def f(*inputs):
        return _run(prog, *inputs)

    inputs = _inputs(seed)
    g = mpjax.autocast(f, dtype=low)
    assert_obeys_policy(jax.make_jaxpr(g)(*inputs), low)

    # The value and the gradients in one compiled program each, as a training step.
    want, grads_want = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(*inputs)
    got, grads_got = jax.jit(jax.value_and_grad(g, argnums=(0, 1, 2)))(*inputs)
    assert got.dtype == F32
    if np.isfinite(want):
        assert np.isfinite(got)
        tol = _tolerance(low, len(prog))
        assert abs(float(got) - float(want)) <= tol * (1 + abs(float(want))), (prog, got, want)

    for gw, gg in zip(grads_want, grads_got):
        assert gg.dtype == F32
        if np.all(np.isfinite(gw)):
            assert np.all(np.isfinite(gg))
            err = float(jnp.linalg.norm(gg - gw))
            assert err <= 4 * _tolerance(low, len(prog)) * (1 + float(jnp.linalg.norm(gw))), prog

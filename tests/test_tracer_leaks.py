"""autocast keeps no value of a trace once the trace has ended.

Users turn on JAX's leak checker (``jax.checking_leaks()``, the flag
``jax_check_tracer_leaks``) to find tracers their own code leaks; under autocast it
must find none of ours. A rebuilt custom_jvp's rule, a checkpoint's body or a
linear function's transpose is kept in the program past the trace that made it,
and a tracer it held would both fail that check and keep the trace's arrays alive.
Each step here is traced afresh inside the checker, which raises at the end of any
trace that left one of its tracers referenced.
"""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name

import mpjax
from conftest import F16, F32
from models import model_case

BF16 = jnp.bfloat16


@pytest.fixture(scope="module", autouse=True)
def _small_heap():
    """The checker looks for referrers of every trace's tracers among all live
    objects: the caches the worker's earlier tests filled made each trace here three
    to four times slower."""
    jax.clear_caches()
    gc.collect()


def _leak_checked(step, *args):
    """``step(*args)`` run with the leak checker on, its result ready."""
    with jax.checking_leaks():
        return jax.block_until_ready(step(*args))


def _w(*shape, seed=0):
    return 0.3 * jax.random.normal(jax.random.key(seed), shape)


# Each policy once, at each dtype once: what a trace keeps depends on the rules
# taken, which the policy and the dtype choose (bfloat16 weight gradients on CPU).
POLICIES = [("torch", F16), ("lean", BF16)]


@pytest.mark.parametrize("policy,low", POLICIES)
@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "rnn", "moe"])
def test_model_training_step(name, policy, low):
    loss, params, inputs = model_case(name)
    step = jax.jit(jax.value_and_grad(mpjax.autocast(loss, dtype=low, policy=policy)))
    value, grads = _leak_checked(step, params, *inputs)
    want, _ = jax.value_and_grad(loss)(params, *inputs)
    assert np.isfinite(value) and abs(value - want) < 0.05 * abs(want) + 1e-2
    assert all(g.dtype == F32 for g in jax.tree.leaves(grads))


def test_eager_call_and_its_gradient():
    loss, params, inputs = model_case("mlp")
    fn = mpjax.autocast(loss)
    _leak_checked(fn, params, *inputs)
    _leak_checked(fn, params, *inputs)  # the trace reused
    _leak_checked(jax.grad(fn), params, *inputs)


def _scan_model(w, x):
    def body(h, w_i):
        h = jnp.tanh(h @ w_i)
        return h, h.sum()

    h, ys = lax.scan(body, x, w)
    return h.sum() + ys.sum()


def _while_model(w, x):
    def body(c):
        i, h = c
        return i + 1, jnp.tanh(h @ w[0])

    return lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1].sum()


def _fori_model(w, x):
    return lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w[i]), x).sum()


def _cond_model(w, x):
    return lax.cond(x.sum() > 0, lambda h: (h @ w[0]).sum(), lambda h: jnp.exp(h).sum(), x)


def _switch_model(w, x):
    branches = [lambda h: jnp.tanh(h @ w[0]), lambda h: h @ w[1] + 1.0, lambda h: h * 2.0]
    return lax.switch(jnp.argmax(x[0]) % 3, branches, x).sum()


def _nested_loops_model(w, x):
    def inner(h, w_i):
        return lax.fori_loop(0, 2, lambda _, g: jnp.tanh(g @ w_i), h), None

    def outer(h, _):
        return lax.scan(inner, h, w)[0], None

    return lax.scan(outer, x, None, length=2)[0].sum()


def _checkpoint_model(w, x):
    layer = jax.checkpoint(lambda h, w_i: jax.nn.gelu(h @ w_i))
    for w_i in w:
        x = layer(x, w_i)
    return x.sum()


def _checkpoint_policy_model(w, x):
    def layer(h, w_i):
        return jnp.tanh(checkpoint_name(h @ w_i, "product"))

    layer = jax.checkpoint(layer, policy=jax.checkpoint_policies.save_only_these_names("product"))
    return lax.scan(lambda h, w_i: (layer(h, w_i), None), x, w)[0].sum()


@jax.custom_jvp
def _scaled_tanh(x, s):
    return jnp.tanh(x) * s


@_scaled_tanh.defjvp
def _scaled_tanh_jvp(primals, tangents):
    x, s = primals
    tx, ts = tangents
    y = jnp.tanh(x)
    return y * s, (1 - y**2) * s * tx + y * ts


@jax.custom_vjp
def _clip_gradient(x):
    return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1.0, 1.0),))


def _custom_jvp_model(w, x):
    return _scaled_tanh(x @ w[0], 0.5).sum()


def _custom_jvp_in_scan_model(w, x):
    return lax.scan(lambda h, w_i: (_scaled_tanh(h @ w_i, 0.5), None), x, w)[0].sum()


def _custom_vjp_model(w, x):
    return _clip_gradient(x @ w[0]).sum()


def _relu_model(w, x):  # jax.nn.relu is a custom_jvp of JAX's own
    return jax.nn.relu(x @ w[0]).sum() + jax.nn.logsumexp(x @ w[1])


def _inner_region_model(w, x):
    h = mpjax.autocast(lambda a, b: jnp.tanh(a @ b), dtype=BF16)(x, w[0])
    return mpjax.autocast(lambda a, b: (a @ b).sum(), enabled=False)(h, w[1])


def _softmax_attention_model(w, x):
    scores = (x @ w[0]) @ x.T
    mask = jnp.tril(jnp.ones(scores.shape, bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    return (probs @ x).var()


MODELS = {
    "scan": _scan_model,
    "while": _while_model,
    "fori_loop": _fori_model,
    "cond": _cond_model,
    "switch": _switch_model,
    "nested_loops": _nested_loops_model,
    "checkpoint": _checkpoint_model,
    "checkpoint_policy_in_scan": _checkpoint_policy_model,
    "custom_jvp": _custom_jvp_model,
    "custom_jvp_in_scan": _custom_jvp_in_scan_model,
    "custom_vjp": _custom_vjp_model,
    "relu_logsumexp": _relu_model,
    "inner_regions": _inner_region_model,
    "masked_softmax": _softmax_attention_model,
}


def _differentiate(fn, name):
    """The gradient in `w`; forward mode through a while loop, which reverse mode
    cannot differentiate."""
    if name == "while":
        return lambda w, x: jax.jvp(lambda w: fn(w, x), (w,), (jnp.ones_like(w),))[1]
    return jax.grad(fn)


@pytest.mark.parametrize("policy,low", POLICIES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_transforms_inside_autocast(name, policy, low):
    f = MODELS[name]
    fn = mpjax.autocast(f, dtype=low, policy=policy)
    w, x = _w(3, 8, 8), _w(4, 8, seed=1)
    got = _leak_checked(jax.jit(_differentiate(fn, name)), w, x)
    want = _differentiate(f, name)(w, x)
    assert got.dtype == F32
    np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05 * np.abs(want).max() + 1e-3)


def test_vmap_and_per_example_gradients():
    f = mpjax.autocast(lambda w, x: _while_model(w, x) + _scan_model(w, x))
    w, xs = _w(3, 8, 8), _w(5, 2, 8, seed=1)
    _leak_checked(jax.jit(jax.vmap(f, in_axes=(None, 0))), w, xs)
    g = mpjax.autocast(_scan_model)
    _leak_checked(jax.jit(jax.vmap(jax.grad(g), in_axes=(None, 0))), w, xs)


def test_autocast_of_a_gradient():
    """``autocast(jax.grad(f))``: the backward pass is the program autocast reads."""
    f = mpjax.autocast(jax.grad(_checkpoint_policy_model))
    _leak_checked(jax.jit(f), _w(3, 8, 8), _w(4, 8, seed=1))


def test_scaled_training_step_with_grad_scaler():
    loss, params, inputs = model_case("transformer")
    optimizer = mpjax.grad_scaler(optax.adamw(1e-3))

    @jax.jit
    def train_step(params, opt_state, tokens):
        value, grads = mpjax.scaled_value_and_grad(mpjax.autocast(loss), opt_state)(
            params, tokens
        )
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    opt_state = optimizer.init(params)
    for _ in range(2):
        params, opt_state, value = _leak_checked(train_step, params, opt_state, *inputs)
    assert np.isfinite(value)


def test_flax_nnx_and_linen_models():
    from flax import linen, nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(1, 4, (3, 3), rngs=rngs)
            self.norm = nnx.BatchNorm(4, rngs=rngs)
            self.out = nnx.Linear(4, 3, rngs=rngs)

        def __call__(self, x):
            h = jax.nn.relu(self.norm(self.conv(x)))
            return self.out(h.mean((1, 2)))

    model = Net(nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 6, 6, 1)), F32)

    @nnx.jit
    def nnx_step(model, x):
        return nnx.grad(mpjax.autocast(lambda m, x: (m(x) ** 2).mean()))(model, x)

    _leak_checked(nnx_step, model, x)

    class Mlp(linen.Module):
        @linen.compact
        def __call__(self, x):
            x = linen.LayerNorm()(linen.Dense(16)(x))
            return linen.Dense(3)(jax.nn.gelu(x))

    mlp = Mlp()
    variables = mlp.init(jax.random.key(0), x[:, :, 0, 0])
    loss = mpjax.autocast(lambda v, x: (mlp.apply(v, x) ** 2).mean(), dtype=BF16)
    _leak_checked(jax.jit(jax.grad(loss)), variables, x[:, :, 0, 0])


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_audit_and_diagnose(dtype):
    loss, params, inputs = model_case("transformer")
    with jax.checking_leaks():
        mpjax.audit(jax.grad(mpjax.autocast(loss, dtype=dtype)), params, *inputs)
        mpjax.diagnose(loss, params, *inputs, dtype=dtype)


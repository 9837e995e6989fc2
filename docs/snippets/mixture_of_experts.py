import jax
import jax.numpy as jnp
import optax
from jax import lax

import mpjax

EXPERTS, D, HIDDEN, TOP_K = 4, 32, 64, 2


def init(key):
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "router": 0.1 * jax.random.normal(k1, (D, EXPERTS)),
        "w_in": jax.random.normal(k2, (EXPERTS, D, HIDDEN)) / D**0.5,
        "w_out": jax.random.normal(k3, (EXPERTS, HIDDEN, D)) / HIDDEN**0.5,
    }


def moe(params, x):
    """Top-2 routing; tokens sorted by expert, one grouped product per layer."""
    probs = jax.nn.softmax(x @ params["router"], axis=-1)  # float32 (softmax)
    gate, choice = lax.top_k(probs, TOP_K)
    order = jnp.argsort(choice.reshape(-1))
    token = order // TOP_K
    sizes = jnp.bincount(choice.reshape(-1), length=EXPERTS).astype(jnp.int32)
    h = jax.nn.gelu(lax.ragged_dot(x[token], params["w_in"], sizes))
    out = lax.ragged_dot(h, params["w_out"], sizes)
    weighted = out * (gate / gate.sum(-1, keepdims=True)).reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(weighted)


def loss_fn(params, x, y):
    return jnp.mean((x + moe(params, x) - y) ** 2)


kp, kx, ky = jax.random.split(jax.random.key(0), 3)
params = init(kp)
x, y = jax.random.normal(kx, (256, D)), jax.random.normal(ky, (256, D))

loss = mpjax.autocast(loss_fn)
optimizer = mpjax.grad_scaler(optax.adam(1e-3))
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, grads


for i in range(3):
    params, opt_state, value, grads = step(params, opt_state, x, y)
    print(f"step {i}  loss {value:.4f}")
assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))

# The grouped products multiply float16 values, forward and backward. The two
# forward products return float16; the experts' weight gradients return their
# float32 accumulator. The gradient of the activation `h` is float16.
report = mpjax.audit(jax.grad(loss), params, x, y)
for eqn in report.find("ragged_dot_general"):
    print(eqn.in_dtypes, "->", eqn.out_dtypes)
assert all(e.in_dtypes[:2] == ("float16", "float16") for e in report.find("ragged_dot_general"))
print(f"products in 16 bits: {report.low_precision_fraction:.0%} of the FLOPs")

import jax
import jax.numpy as jnp
import optax

import mpjax


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


def make_step(dtype):
    loss = mpjax.autocast(loss_fn, dtype=dtype)
    # float16 needs loss scaling; bfloat16 has float32's range and does not.
    # noop_scaler keeps the same state layout and training step.
    scaler = mpjax.grad_scaler if dtype == jnp.float16 else mpjax.noop_scaler
    optimizer = scaler(optax.adam(1e-2))

    @jax.jit
    def step(params, opt_state, x, y):
        value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return optimizer, step


x = jax.random.normal(jax.random.key(0), (64, 16))
y = jnp.sin(x[:, :1])
for dtype in (jnp.float16, jnp.bfloat16):
    params = {"w1": jax.random.normal(jax.random.key(1), (16, 32)) * 0.25,
              "w2": jax.random.normal(jax.random.key(2), (32, 1)) * 0.18}
    optimizer, step = make_step(dtype)
    opt_state = optimizer.init(params)
    for i in range(30):
        params, opt_state, value = step(params, opt_state, x, y)
    print(f"{jnp.dtype(dtype).name:>8}: loss {value:.4f}, scale {mpjax.get_scale(opt_state)}")

# Why float16 needs scaling: small gradients underflow to zero.
print(jnp.float16(1e-8), jnp.bfloat16(1e-8))      # 0.0 and about 1e-08
assert jnp.float16(1e-8) == 0 and jnp.bfloat16(1e-8) != 0

import jax
import jax.numpy as jnp
import optax

import mpjax


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"])
    return jnp.mean((h @ params["w2"] - y) ** 2)


params = {"w1": jax.random.normal(jax.random.key(0), (16, 32)) * 0.25,
          "w2": jax.random.normal(jax.random.key(1), (32, 1)) * 0.18}
x = jax.random.normal(jax.random.key(2), (64, 16))
y = jnp.sin(x[:, :1])

# Clip inside the scaler. The gradients are already unscaled, as after torch's
# scaler.unscale_(optimizer), and a skipped step leaves the whole chain as it was.
optimizer = mpjax.grad_scaler(optax.chain(
    optax.clip_by_global_norm(1.0),
    optax.adamw(1e-2),
))
opt_state = optimizer.init(params)
loss = mpjax.autocast(loss_fn)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    # The gradients are the loss's own (unscaled): their norm, for logging.
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value, grad_norm


for i in range(30):
    params, opt_state, value, grad_norm = step(params, opt_state, x, y)
print(f"loss {value:.4f}, gradient norm {grad_norm:.4f}")

import jax
import jax.numpy as jnp
import optax

import mpjax


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


x = jax.random.normal(jax.random.key(0), (64, 16))
y = jnp.sin(x[:, :1])
params = {"w1": jax.random.normal(jax.random.key(1), (16, 32)) * 0.25,
          "w2": jax.random.normal(jax.random.key(2), (32, 1)) * 0.18}
# A scale far too large, so that the first steps overflow and are skipped.
optimizer = mpjax.grad_scaler(optax.adam(1e-2), init_scale=2.0**20, growth_interval=10)
opt_state = optimizer.init(params)
loss = mpjax.autocast(loss_fn)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    metrics = {"loss": value, **mpjax.scaler_stats(opt_state)}
    return optax.apply_updates(params, updates), opt_state, metrics


history = []
for i in range(30):
    params, opt_state, metrics = step(params, opt_state, x, y)
    history.append(metrics)          # device arrays: no host sync yet
    if i % 5 == 4:
        m = jax.device_get(metrics)  # one sync per logging interval
        print(f"step {i + 1:3d}  loss {m['loss']:.4f}  scale {m['scale']:.0f}  "
              f"skipped so far {m['skipped_steps']}")

skipped = [int(i) for i, m in enumerate(history) if m["last_step_skipped"]]
print("skipped steps:", skipped)
assert skipped == list(range(len(skipped))) and len(skipped) > 0

import jax
import jax.numpy as jnp
import optax

import mpjax


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


params = {"w1": jax.random.normal(jax.random.key(0), (16, 32)) * 0.25,
          "w2": jax.random.normal(jax.random.key(1), (32, 1)) * 0.18}
x = jax.random.normal(jax.random.key(2), (4, 8, 16))   # 4 micro-batches of 8
y = jnp.sin(x[..., :1])

# One effective step per 4 micro-batches: their mean gradient is accumulated in
# float32, checked and given to adam once, and the scale is updated once. Each
# micro-batch's loss is a mean over its own examples: accumulation="mean". (A loop
# ported from PyTorch, whose loss is divided by 4, says accumulation="sum".)
optimizer = mpjax.grad_scaler(optax.adam(1e-2), accumulation_steps=4, accumulation="mean")
opt_state = optimizer.init(params)
loss = mpjax.autocast(loss_fn)


@jax.jit
def micro_step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for epoch in range(10):
    for i in range(4):
        new_params, opt_state, value = micro_step(params, opt_state, x[i], y[i])
        # Parameters change only on the last micro-batch of each effective batch.
        changed = not all(jax.tree.leaves(jax.tree.map(jnp.array_equal, new_params, params)))
        assert changed == (i == 3)
        params = new_params
print(f"loss {value:.4f}")

# Why not optax.MultiSteps(grad_scaler(...))? MultiSteps resets its accumulator by
# multiplying it by 0. One overflowing
# micro-batch (normal with dynamic scaling) leaves an inf there, 0 * inf is NaN,
# and every later effective step is skipped: training silently stops. mpjax's
# helpers refuse a scaler inside MultiSteps.
grad = {"w": jnp.ones(3)}
overflow = {"w": jnp.array([1.0, jnp.inf, 1.0])}
stream = [grad, overflow] + [grad] * 8              # one bad micro-batch, then good ones

trap = optax.MultiSteps(mpjax.grad_scaler(optax.sgd(0.1)), every_k_schedule=2)
right = mpjax.grad_scaler(optax.sgd(0.1), accumulation_steps=2, accumulation="mean")
trap_state, right_state = trap.init(grad), right.init(grad)
trap_update, right_update = jax.jit(trap.update), jax.jit(right.update)
for g in stream:
    _, trap_state = trap_update(g, trap_state)
    _, right_state = right_update(g, right_state)
print("skipped effective steps, MultiSteps around the scaler:",
      int(trap_state.inner_opt_state.skipped_steps))            # 5 of 5
print("skipped effective steps, accumulation_steps=2:        ",
      int(mpjax.scaler_stats(right_state)["skipped_steps"]))      # 1 of 5
assert trap_state.inner_opt_state.skipped_steps == 5
assert mpjax.scaler_stats(right_state)["skipped_steps"] == 1
try:
    mpjax.scaler_stats(trap_state)
except ValueError as e:
    print(e)  # scaler_stats: the grad_scaler is wrapped in optax.MultiSteps, ...

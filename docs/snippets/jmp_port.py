import jax
import jax.numpy as jnp
import optax

import mpjax


# No casts in the model: autocast decides, operation by operation.
def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


params = {"w1": jax.random.normal(jax.random.key(0), (32, 64)) * 0.18,
          "w2": jax.random.normal(jax.random.key(1), (64, 10)) * 0.125}
x = jax.random.normal(jax.random.key(2), (16, 32))
y = jnp.arange(16) % 10

# policy = jmp.get_policy("params=float32,compute=float16,output=float32")
# and the policy.cast_to_compute / cast_to_output calls in the model
loss = mpjax.autocast(loss_fn, dtype=jnp.float16)

# loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**15)): period 2000, factor 2,
# min_loss_scale 1.0. The same rule, its state in opt_state:
optimizer = mpjax.grad_scaler(optax.adamw(1e-3), init_scale=2.0**15, growth_interval=2000,
                              growth_factor=2.0, backoff_factor=0.5, min_scale=1.0)
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x, y):
    # loss_scale.scale(loss), jax.value_and_grad, loss_scale.unscale((value, grads))
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    # jmp.all_finite(grads), loss_scale.adjust(grads_finite), optimizer.update and
    # jmp.select_tree(grads_finite, new, old): one call
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(10):
    params, opt_state, value = step(params, opt_state, x, y)
# loss_scale.loss_scale
print(f"loss {value:.4f}, scale {mpjax.get_scale(opt_state)}")
# grads_finite of the latest step, and a count jmp leaves to you
stats = mpjax.scaler_stats(opt_state)
assert not stats["last_step_skipped"] and stats["skipped_steps"] == 0

# jmp.StaticLossScale(1024.0), jmp.NoOpLossScale()
static = mpjax.static_scaler(optax.adamw(1e-3), 1024.0)  # still skips non-finite steps
noop = mpjax.noop_scaler(optax.adamw(1e-3))              # for bfloat16: nothing to scale

import jax
import jax.numpy as jnp
import optax

import mpjax


def loss_fn(params, x, y):
    h = jax.nn.relu(x @ params["w1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


params = {"w1": jax.random.normal(jax.random.key(0), (32, 64)) * 0.18,
          "w2": jax.random.normal(jax.random.key(1), (64, 10)) * 0.125}
x = jax.random.normal(jax.random.key(2), (16, 32))
y = jnp.arange(16) % 10

# with torch.autocast("cuda", dtype=torch.float16): ...
loss = mpjax.autocast(loss_fn, dtype=jnp.float16)

# scaler = torch.amp.GradScaler(init_scale=2.**16, growth_factor=2., backoff_factor=.5,
#                               growth_interval=2000)
# and, in the step, scaler.unscale_(optimizer); clip_grad_norm_(params, 1.0)
optimizer = mpjax.grad_scaler(
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000)
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x, y):
    # scaler.scale(loss).backward()
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    # scaler.step(optimizer); scaler.update()
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(10):
    params, opt_state, value = step(params, opt_state, x, y)

# scaler.get_scale()
scale = mpjax.get_scale(opt_state)
# scaler.update(new_scale=1024.)
opt_state = mpjax.set_scale(opt_state, 1024.0)
assert mpjax.get_scale(opt_state) == 1024.0
# was the last step skipped? how many were?
stats = mpjax.scaler_stats(opt_state)
print(f"loss {value:.4f}, scale was {scale}, skipped {stats['skipped_steps']}")

# scaler.scale(loss).backward(); scaler.unscale_(optimizer): both are inside
# scaled_value_and_grad, whose gradients are the loss's own, ready to clip or log.
value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)

# scaler.state_dict() / load_state_dict(): nothing to do. The scaler's state is a
# GradScalerState inside opt_state; checkpoint opt_state and it is saved.
assert isinstance(opt_state, mpjax.GradScalerState)


# with torch.autocast("cuda", enabled=False): y = f(x.float())
def model(params, x):
    h = x @ params["w1"]                                        # float16
    h = mpjax.autocast(jax.nn.standardize, enabled=False)(h)    # float32, as written
    return h @ params["w2"]                                     # float16


assert jax.jit(mpjax.autocast(model))(params, x).dtype == jnp.float32    # original dtypes

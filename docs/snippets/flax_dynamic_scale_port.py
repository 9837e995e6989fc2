import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

import mpjax


class MLP(nn.Module):  # no dtype: the layers keep their float32 defaults
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


model = MLP()
x = jax.random.normal(jax.random.key(0), (16, 32))
y = jnp.arange(16) % 10
# dtype=jnp.float16 on the layers: autocast the apply function instead.
# DynamicScale() in the TrainState: the scaler wraps tx, its state is in opt_state.
# growth_interval=2001 and min_scale=2**-126 are DynamicScale()'s rule; without
# them, mpjax's defaults (2000 and 2**-14).
state = train_state.TrainState.create(
    apply_fn=mpjax.autocast(model.apply),
    params=model.init(jax.random.key(1), x)["params"],
    tx=mpjax.grad_scaler(optax.adamw(1e-3), growth_interval=2001, min_scale=2.0**-126))


@jax.jit
def train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # dynamic_scale, is_fin, loss, grads = state.dynamic_scale.value_and_grad(loss_fn)(...)
    loss, grads = mpjax.scaled_value_and_grad(loss_fn, state.opt_state)(state.params)
    # apply_gradients, then the jnp.where of params and opt_state: the update skips
    # a non-finite step itself, and backs the scale off.
    return state.apply_gradients(grads=grads), loss


for i in range(10):
    state, loss = train_step(state, x, y)
# state.dynamic_scale.scale; is_fin of the latest step
stats = mpjax.scaler_stats(state.opt_state)
print(f"loss {loss:.4f}, scale {stats['scale']}, skipped {stats['last_step_skipped']}")

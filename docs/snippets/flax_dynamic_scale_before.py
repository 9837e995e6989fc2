import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state
from flax.training.dynamic_scale import DynamicScale


class MLP(nn.Module):
    dtype: Any = jnp.float16  # the compute dtype, set by hand on every layer

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, dtype=self.dtype)(x))
        return nn.Dense(10, dtype=self.dtype)(x)


class TrainState(train_state.TrainState):
    dynamic_scale: DynamicScale


model = MLP()
x = jax.random.normal(jax.random.key(0), (16, 32))
y = jnp.arange(16) % 10
state = TrainState.create(apply_fn=model.apply,
                          params=model.init(jax.random.key(1), x)["params"],
                          tx=optax.adamw(1e-3), dynamic_scale=DynamicScale())


@jax.jit
def train_step(state, x, y):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    dynamic_scale, is_fin, loss, grads = state.dynamic_scale.value_and_grad(loss_fn)(
        state.params)
    new_state = state.apply_gradients(grads=grads)
    # Skip a non-finite step by hand: keep the old params and optimizer state.
    select = functools.partial(jnp.where, is_fin)
    new_state = new_state.replace(
        params=jax.tree.map(select, new_state.params, state.params),
        opt_state=jax.tree.map(select, new_state.opt_state, state.opt_state),
        dynamic_scale=dynamic_scale)
    return new_state, loss


for i in range(10):
    state, loss = train_step(state, x, y)
print(f"loss {loss:.4f}, scale {state.dynamic_scale.scale}")

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import mpjax


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = jnp.mean(nn.relu(x), axis=(1, 2))
        return nn.Dense(10)(x)


model = CNN()
x = jax.random.normal(jax.random.key(0), (16, 8, 8, 1))
y = jnp.arange(16) % 10
variables = jax.jit(model.init, static_argnames="train")(jax.random.key(1), x, train=False)
params, batch_stats = variables["params"], variables["batch_stats"]

# model.apply is a pure function: autocast it. `train` and `mutable` are not
# arrays, so they reach apply unchanged.
apply = mpjax.autocast(model.apply)


def loss_fn(params, batch_stats, x, y):
    logits, updates = apply({"params": params, "batch_stats": batch_stats}, x,
                            train=True, mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return loss, updates["batch_stats"]


optimizer = mpjax.grad_scaler(optax.adam(1e-3))
opt_state = optimizer.init(params)


@jax.jit
def step(params, batch_stats, opt_state, x, y):
    (value, new_stats), grads = mpjax.scaled_value_and_grad(
        loss_fn, opt_state, has_aux=True)(params, batch_stats, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    # A skipped step (an overflow) changes nothing: keep the statistics it computed
    # from inf activations out as well.
    skipped = mpjax.scaler_stats(opt_state)["last_step_skipped"]
    batch_stats = jax.tree.map(lambda old, new: jnp.where(skipped, old, new),
                               batch_stats, new_stats)
    return optax.apply_updates(params, updates), batch_stats, opt_state, value


for i in range(20):
    params, batch_stats, opt_state, value = step(params, batch_stats, opt_state, x, y)
print(f"loss {value:.4f}")
assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(batch_stats))

@jax.jit
def predict(params, batch_stats, x):
    return apply({"params": params, "batch_stats": batch_stats}, x, train=False)


logits = predict(params, batch_stats, x)

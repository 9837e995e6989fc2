import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mpjax


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.norm(self.linear1(x)))
        return self.linear2(self.dropout(x))


def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


model = Model(nnx.Rngs(0))
optimizer = nnx.Optimizer(model, mpjax.grad_scaler(optax.adamw(1e-3)), wrt=nnx.Param)
loss = mpjax.autocast(loss_fn)     # modules pass straight through; their updates are kept


@nnx.jit
def step(model, optimizer, x, y):
    stats = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))  # a copy, not a view
    # NNX modules are differentiated with nnx.value_and_grad, by themselves.
    value, grads = mpjax.scaled_value_and_grad(loss, optimizer.opt_state)(model, x, y)
    optimizer.update(model, grads)
    # A skipped step (an overflow) changes nothing: undo what its forward pass wrote.
    skipped = mpjax.scaler_stats(optimizer.opt_state)["last_step_skipped"]
    new = nnx.state(model, nnx.BatchStat)
    nnx.update(model, jax.tree.map(lambda old, new: jnp.where(skipped, old, new), stats, new))
    return value


x = jax.random.normal(jax.random.key(1), (32, 16))
y = jnp.arange(32) % 4
for i in range(20):
    value = step(model, optimizer, x, y)
stats = mpjax.scaler_stats(optimizer.opt_state)
print(f"loss {value:.4f}, scale {stats['scale']}, skipped {stats['skipped_steps']}")

# BatchNorm's running statistics were updated, and stay float32.
assert model.norm.mean[...].dtype == jnp.float32
assert jnp.any(model.norm.mean[...] != 0)

model.eval()
logits = nnx.jit(mpjax.autocast(lambda model, x: model(x)))(model, x)   # inference

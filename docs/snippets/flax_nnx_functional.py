import jax
import jax.numpy as jnp
import optax
from flax import nnx

import mpjax


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(16, 64, rngs=rngs)
        self.norm = nnx.BatchNorm(64, rngs=rngs)
        self.linear2 = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.norm(self.linear1(x))))


graphdef, params, rest = nnx.split(Model(nnx.Rngs(0)), nnx.Param, ...)


def loss_fn(params, rest, x, y):
    model = nnx.merge(graphdef, params, rest, copy=True)
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    return loss, nnx.state(model, nnx.BatchStat)


step = jax.jit(jax.value_and_grad(mpjax.autocast(loss_fn), has_aux=True))
x = jax.random.normal(jax.random.key(1), (32, 16))
y = jnp.arange(32) % 4
(loss, stats), grads = step(params, rest, x, y)
rest = nnx.merge_state(rest, stats)  # the new running statistics, float32

assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(rest))
print(f"loss {loss:.4f}")

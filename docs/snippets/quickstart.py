import jax
import jax.numpy as jnp
import optax
from flax import linen as nn

import mpjax


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


model = MLP()
x = jax.random.normal(jax.random.key(0), (64, 32))
y = jax.random.randint(jax.random.key(1), (64,), 0, 10)
params = model.init(jax.random.key(2), x)


def loss_fn(params, x, y):
    logits = model.apply(params, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


loss = mpjax.autocast(loss_fn)
optimizer = mpjax.grad_scaler(optax.adamw(1e-3))
opt_state = optimizer.init(params)


@jax.jit
def step(params, opt_state, x, y):
    value, grads = mpjax.scaled_value_and_grad(loss, opt_state)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


for i in range(50):
    params, opt_state, value = step(params, opt_state, x, y)
print(f"loss {value:.4f}, scale {mpjax.get_scale(opt_state)}")

# Matmuls ran in float16; parameters, gradients and the loss are float32.
report = mpjax.audit(loss, params, x, y)
assert report.low_precision_fraction == 1.0
assert value.dtype == jnp.float32
assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))

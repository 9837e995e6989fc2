import jax
import jax.numpy as jnp

import mpjax


def loss_fn(w, x):
    return jnp.mean(jax.nn.logsumexp(x @ w, axis=-1))


w, x = jnp.ones((64, 10)), jnp.ones((32, 64))
report = mpjax.audit(jax.grad(mpjax.autocast(loss_fn)), w, x)
print(report)       # one row per (primitive, input dtypes, output dtypes)
print(report.find("dot_general"))
assert report.low_precision_fraction == 1.0   # every matmul FLOP in float16

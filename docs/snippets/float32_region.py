import jax
import jax.numpy as jnp

import mpjax


def attention(q, k, v):
    # Keep the attention logits and softmax in float32: a region with autocast off.
    def probabilities(q, k):
        return jax.nn.softmax(q @ k.T / jnp.sqrt(q.shape[-1]), axis=-1)

    p = mpjax.autocast(probabilities, enabled=False)(q, k)
    return p @ v     # back in the outer region: float16


q, k, v = (jax.random.normal(key, (16, 32)) for key in jax.random.split(jax.random.key(0), 3))
out = mpjax.autocast(attention)(q, k, v)
assert out.dtype == jnp.float32            # results keep their original dtypes

report = mpjax.audit(mpjax.autocast(attention), q, k, v)
for eqn in report.find("dot_general"):
    print(eqn.in_dtypes, "->", eqn.out_dtypes, "at", eqn.source)
assert [e.in_dtypes for e in report.find("dot_general")] == [("float32",) * 2, ("float16",) * 2]


# An identity cast does nothing. Traced, `q.astype(jnp.float32)` on a float32 `q`
# leaves no trace, so autocast cannot see it: this product still runs in float16.
def not_a_float32_region(q, k):
    return q.astype(jnp.float32) @ k.astype(jnp.float32).T


report = mpjax.audit(mpjax.autocast(not_a_float32_region), q, k)
assert report.find("dot_general")[0].in_dtypes == ("float16", "float16")

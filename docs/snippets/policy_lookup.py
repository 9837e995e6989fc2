import jax
import jax.numpy as jnp

import mpjax
from mpjax import Rule

# The rule for one primitive, by name.
assert mpjax.rule_for("dot_general") is Rule.LOW
assert mpjax.rule_for("exp") is Rule.FLOAT32
assert mpjax.rule_for("add") is Rule.WIDEST
assert mpjax.rule_for("reshape") is Rule.AS_RECEIVED
assert mpjax.rule_for("some_new_primitive") is Rule.ORIGINAL


# Which primitives does a function use, and what precision did each get?
def layer(w, x):
    return jax.nn.softmax(x @ w, axis=-1)


print(jax.make_jaxpr(layer)(jnp.ones((8, 4)), jnp.ones((2, 8))))
report = mpjax.audit(mpjax.autocast(layer), jnp.ones((8, 4)), jnp.ones((2, 8)))
print(report)
for eqn in report.equations:
    print(f"{eqn.primitive:<22} {mpjax.rule_for(eqn.primitive).name:<12} "
          f"{', '.join(eqn.in_dtypes):<18} -> {', '.join(eqn.out_dtypes)}")

import jax
import jax.numpy as jnp

import mpjax


def loss_fn(params, x):
    h = jax.nn.relu(x @ params["w"])        # values near 1e5: beyond float16's 65504
    return jnp.mean((h * 1e-5 - 1.0) ** 2)


params = {"w": jnp.full((64, 8), 40.0)}
x = jnp.full((4, 64), 50.0)
loss = mpjax.autocast(loss_fn)

# 1. Is it precision at all? Finite in float32, not under autocast.
print("float32:", loss_fn(params, x), " autocast:", loss(params, x))

# 2. Which operations run in 16 bits, and from which line? Nothing is executed.
report = mpjax.audit(loss, params, x)
for eqn in report.equations:
    if "float16" in eqn.out_dtypes:
        print(f"{eqn.primitive:<20} {eqn.in_dtypes} -> {eqn.out_dtypes}  {eqn.source}")

# 3. Which one produced the first inf? With jax_debug_infs, a jitted function
#    whose output is not finite is run again op by op, and the first operation
#    that produced an inf raises, with the user's line in the traceback.
try:
    with jax.debug_infs(True):
        jax.jit(loss)(params, x)
except FloatingPointError as error:
    print("FloatingPointError:", str(error).splitlines()[0])


# 4. Or print values from inside: jax.debug.print works in autocast and under jit.
def loss_fn_printing(params, x):
    h = jax.nn.relu(x @ params["w"])
    jax.debug.print("largest |h|: {}", jnp.max(jnp.abs(h)))      # inf
    return jnp.mean((h * 1e-5 - 1.0) ** 2)


jax.jit(mpjax.autocast(loss_fn_printing))(params, x)


# 5. The fix: keep that product in float32, or use bfloat16 (float32's range).
def fixed_loss_fn(params, x):
    h = jax.nn.relu(mpjax.autocast(jnp.matmul, enabled=False)(x, params["w"]))
    return jnp.mean((h * 1e-5 - 1.0) ** 2)


assert not jnp.isfinite(loss(params, x))
assert jnp.isfinite(mpjax.autocast(fixed_loss_fn)(params, x))
assert jnp.isfinite(mpjax.autocast(loss_fn, dtype=jnp.bfloat16)(params, x))

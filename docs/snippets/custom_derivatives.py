import jax
import jax.numpy as jnp

import mpjax


# custom_jvp: autocast applies inside, to the function and to its JVP rule.
@jax.custom_jvp
def projected_softplus(x, w):
    return jnp.logaddexp(x @ w, 0.0)


@projected_softplus.defjvp
def projected_softplus_jvp(primals, tangents):
    x, w = primals
    dx, dw = tangents
    z = x @ w
    dz = dx @ w + x @ dw
    return jnp.logaddexp(z, 0.0), jax.nn.sigmoid(z) * dz


# custom_vjp: runs as written, at its original dtypes, forward and backward.
# Your backward rule sees exactly the dtypes you wrote it for.
@jax.custom_vjp
def clipped_matmul(x, w):
    return x @ w


def clipped_matmul_fwd(x, w):
    return x @ w, (x, w)


def clipped_matmul_bwd(residuals, g):
    x, w = residuals
    g = jnp.clip(g, -1.0, 1.0)          # clip the incoming gradient
    return g @ w.T, x.T @ g


clipped_matmul.defvjp(clipped_matmul_fwd, clipped_matmul_bwd)


def loss_fn(params, x):
    h = projected_softplus(x, params["w1"])
    return jnp.mean(clipped_matmul(h, params["w2"]) ** 2)


params = {"w1": jnp.full((8, 16), 0.1), "w2": jnp.full((16, 4), 0.1)}
x = jnp.ones((32, 8))
grads = jax.grad(mpjax.autocast(loss_fn))(params, x)
assert grads["w1"].dtype == grads["w2"].dtype == jnp.float32

# What ran where: the custom_jvp matmul in float16, the custom_vjp one in float32.
report = mpjax.audit(mpjax.autocast(loss_fn), params, x)
for eqn in report.find("dot_general"):
    print(f"{eqn.path or '(top level)':<28} {eqn.in_dtypes} -> {eqn.out_dtypes}")
assert [e.in_dtypes for e in report.find("dot_general")] == [("float16",) * 2, ("float32",) * 2]


# torch's @custom_fwd(cast_inputs=torch.float32): run a function in float32
# whatever region it is called from. Its inputs arrive in their original dtypes.
@mpjax.autocast(enabled=False)
def exact_norm(v):
    return jnp.sqrt(jnp.sum(v * v, axis=-1))


print(mpjax.audit(mpjax.autocast(lambda x, w: exact_norm(x @ w)), x, params["w1"]))

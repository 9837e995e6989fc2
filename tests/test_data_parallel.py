"""Data-parallel training on 8 simulated CPU devices (see conftest.py).

Two ways to spread a batch over devices, each with autocast and the scaler:

* sharded ``jax.jit``: the batch is a NamedSharding over the ``data`` axis and
  XLA inserts the gradient all-reduce;
* ``jax.shard_map``: each device computes the loss of its shard and
  ``lax.pmean`` averages it; differentiating that makes the gradient all-reduce
  (the transpose of replicating the float32 parameters, before autocast casts
  them), so it runs in float32. The scaler gets ``axis_name`` so every device
  takes the same skip decision.
"""

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import run_fresh_python
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import mpjax

N_DEV = 8
pytestmark = pytest.mark.skipif(jax.device_count() < N_DEV, reason="needs 8 devices (conftest)")


def _mesh():
    return jax.sharding.Mesh(np.array(jax.devices()[:N_DEV]), ("data",))


def _init():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    params = dict(
        w1=0.3 * jax.random.normal(k1, (12, 32)),
        b1=jnp.zeros(32),
        w2=0.3 * jax.random.normal(k2, (32, 4)),
    )
    x = jax.random.normal(k3, (64, 12))
    y = jax.random.randint(k4, (64,), 0, 4)
    return params, x, y


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return optax.softmax_cross_entropy_with_integer_labels(h @ params["w2"], y).mean()


def _tx(**kw):
    # SGD, so that parameters differ exactly as much as the gradients do (Adam
    # would magnify the rounding differences of near-zero gradients).
    return mpjax.grad_scaler(optax.sgd(0.5), init_scale=2.0**10, **kw)


def _train_single(params, x, y, steps=5, poison=None):
    tx = _tx()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        _, grads = mpjax.scaled_value_and_grad(mpjax.autocast(loss_fn), opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(steps):
        xi = x if poison != i else x.at[3, 0].set(jnp.inf)
        params, opt_state = step(params, opt_state, xi, y)
    return params, opt_state


def _train_sharded_jit(params, x, y, steps=5, poison=None):
    mesh = _mesh()
    replicated, batch = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    tx = _tx()
    params = jax.device_put(params, replicated)
    opt_state = jax.device_put(tx.init(params), replicated)

    @jax.jit
    def step(params, opt_state, x, y):
        _, grads = mpjax.scaled_value_and_grad(mpjax.autocast(loss_fn), opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for i in range(steps):
        xi = x if poison != i else x.at[3, 0].set(jnp.inf)
        params, opt_state = step(
            params, opt_state, jax.device_put(xi, batch), jax.device_put(y, batch)
        )
    return (
        params,
        opt_state,
        step.lower(params, opt_state, jax.device_put(x, batch), jax.device_put(y, batch)),
    )


def _shard_map_step(tx, mesh):
    def global_loss(params, x, y):
        return lax.pmean(loss_fn(params, x, y), "data")

    def local(params, opt_state, x, y):
        _, grads = mpjax.scaled_value_and_grad(mpjax.autocast(global_loss), opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(
        jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())
        )
    )


def _train_shard_map(params, x, y, steps=5, poison_device=None, poison_step=None):
    mesh = _mesh()
    tx = _tx(axis_name="data")
    opt_state = tx.init(params)
    step = _shard_map_step(tx, mesh)
    per_device = x.shape[0] // N_DEV
    for i in range(steps):
        xi = x
        if i == poison_step:
            xi = x.at[poison_device * per_device, 0].set(jnp.nan)
        params, opt_state = step(params, opt_state, xi, y)
    return params, opt_state, step


def test_sharded_jit_matches_single_device():
    params, x, y = _init()
    want, want_state = _train_single(params, x, y)
    got, got_state, lowered = _train_sharded_jit(params, x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-3, atol=1e-4)
    assert float(mpjax.get_scale(got_state)) == float(mpjax.get_scale(want_state))
    # The parameters stay replicated, and their gradients float32.
    assert all(p.sharding.is_fully_replicated for p in jax.tree.leaves(got))
    assert "all-reduce" in lowered.compile().as_text()


def test_shard_map_matches_single_device():
    params, x, y = _init()
    want, _ = _train_single(params, x, y)
    got, _, _ = _train_shard_map(params, x, y)
    chex.assert_trees_all_close(got, want, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("device", [0, 5])
def test_an_inf_on_one_device_skips_the_step_on_every_device(device):
    params, x, y = _init()
    got, state, _ = _train_shard_map(params, x, y, steps=3, poison_device=device, poison_step=1)
    stats = mpjax.scaler_stats(state)
    assert int(stats["skipped_steps"]) == 1
    assert float(stats["scale"]) == 2.0**9  # backed off once, the same everywhere
    # The skipped step changed nothing on any device: three steps with one skipped
    # are two clean steps (power-of-two scales unscale exactly).
    clean, _, _ = _train_shard_map(params, x, y, steps=2)
    chex.assert_trees_all_close(got, clean, rtol=1e-6, atol=1e-7)


def test_sharded_jit_skip_is_global():
    params, x, y = _init()
    got, state, _ = _train_sharded_jit(params, x, y, steps=2, poison=1)
    assert bool(mpjax.scaler_stats(state)["last_step_skipped"])
    after_one, _ = _train_single(params, x, y, steps=1)
    chex.assert_trees_all_close(got, after_one, rtol=1e-3, atol=1e-4)


def _all_reduce_types(stablehlo: str) -> list[str]:
    """The operand type of every all_reduce in a lowered module."""
    types = []
    for m in re.finditer(r'"stablehlo\.all_reduce"', stablehlo):
        signature = re.search(r"\}\) : \((tensor<[^>]*>)", stablehlo[m.end() :])
        types.append(signature.group(1))
    return types


def test_shard_map_gradient_all_reduce_is_float32():
    params, x, y = _init()
    tx = _tx(axis_name="data")
    text = _shard_map_step(tx, _mesh()).lower(params, tx.init(params), x, y).as_text()
    types = _all_reduce_types(text)
    # The bias gradient is reduced as [32] or [1, 32], depending on the jax version.
    gradient_reduces = [
        t
        for t in types
        if t in ("tensor<12x32xf32>", "tensor<1x32xf32>", "tensor<32xf32>", "tensor<32x4xf32>")
    ]
    assert len(gradient_reduces) == 3, types
    assert not [t for t in types if "f16" in t], types


def _sharded_batch(n=1024):
    k = jax.random.key(5)
    x, y = jax.random.normal(k, (n, 12)), jax.random.randint(k, (n,), 0, 4)
    batch = NamedSharding(_mesh(), P("data"))
    return (x, y), (jax.device_put(x, batch), jax.device_put(y, batch))


def _compiled_all_reduce_dtypes(fun, *args) -> list[str]:
    """Element types of the all-reduces XLA compiled (tuple all-reduces flattened)."""
    text = jax.jit(fun).lower(*args).compile().as_text()
    out = []
    for line in text.splitlines():
        if re.search(r"\ball-reduce(-start)?\(", line):
            result = line.split("=", 1)[1].split("all-reduce")[0]
            out += re.findall(r"\b(f16|bf16|f32)\[", result)
    return out


def test_sharded_jit_gradient_all_reduce_is_float32_by_default():
    # float16 only: XLA's CPU backend all-reduces bfloat16 in float32 whatever it
    # is given, so it cannot show the difference for bfloat16 (the same code path).
    params, _, _ = _init()
    _, (xs, ys) = _sharded_batch()
    default = jax.grad(mpjax.autocast(loss_fn))
    assert set(_compiled_all_reduce_dtypes(default, params, xs, ys)) == {"f32"}
    # The choice for bandwidth: weight gradients all-reduced in 16 bits.
    lean = jax.grad(mpjax.autocast(loss_fn, reduce_dtype=jnp.float16))
    assert "f16" in _compiled_all_reduce_dtypes(lean, params, xs, ys)


def test_float32_all_reduce_gives_the_single_device_gradients():
    """With the float32 all-reduce the 8-device weight gradients are the one-device
    ones up to the order of float32 additions: the per-device sums, their
    all-reduce and the gradients are float32, never rounded to 16 bits. A float16
    all-reduce rounds each device's sum, hundreds of times further off."""
    params, _, _ = _init()
    (x, y), (xs, ys) = _sharded_batch()

    def distance(**kw):
        grad = jax.jit(jax.grad(mpjax.autocast(loss_fn, **kw)))
        one, eight = grad(params, x, y), grad(params, xs, ys)
        return max(
            float(np.max(np.abs(one[k] - eight[k])) / np.max(np.abs(one[k]))) for k in ("w1", "w2")
        )

    float32_order = distance()
    # a few float32 ulps: the tanh computes in float32 (its input is a bias sum), so
    # the summed terms carry float32 mantissas, whose order of addition shows
    assert float32_order <= 8 * np.finfo(np.float32).eps
    assert distance(reduce_dtype=jnp.float16) > 100 * max(float32_order, np.finfo(np.float32).eps)


def _exported_dot_types(dtype, platform):
    """(lhs, rhs, result) element types of each product of the training step's
    gradient, as exported for `platform` from this CPU-only machine."""
    params, x, y = _init()
    grad = jax.jit(jax.grad(mpjax.autocast(loss_fn, dtype=dtype)))
    exported = jax.export.export(grad, platforms=[platform])(params, x, y)
    dots = re.findall(r"stablehlo.dot_general .*", exported.mlir_module())
    types = []
    for dot in dots:
        operands = re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)", dot)
        types.append(tuple(t.split("x")[-1].rstrip(">") for t in operands.groups()))
    return types


@pytest.mark.parametrize("dtype, low", [(jnp.float16, "f16"), (jnp.bfloat16, "bf16")])
def test_gpu_program_keeps_backward_products_in_16_bits(dtype, low):
    """The program a GPU receives, exported here without one: every product of the
    backward pass multiplies 16-bit operands, the weight gradients into float32
    results, rather than upcasting a float32 cotangent into a float32 product.
    (bfloat16 too: the CPU backend's float32 carrier for its weight gradients is
    chosen for the platform lowered for, not for the one this process runs on.)"""
    types = _exported_dot_types(dtype, "cuda")
    assert len(types) == 5  # two forward; backward: two weight gradients, one for h
    assert all(t[:2] == (low, low) for t in types), types
    # float32 results: the two weight gradients (never rounded to 16 bits) and the
    # first product's accumulator, which its bias and tanh read (a gate's sum);
    # 16-bit: the logits' product and the cotangent of the activation h
    assert sorted(t[2] for t in types) == sorted([low, low, "f32", "f32", "f32"]), types


def test_cpu_program_multiplies_bfloat16_weight_gradients_as_its_backend_can():
    """For the CPU, whose dot kernel has no bfloat16 x bfloat16 -> float32 weight
    gradient, the product takes float32 operands holding bfloat16 values exactly."""
    types = _exported_dot_types(jnp.bfloat16, "cpu")
    assert len(types) == 5
    weight_gradients = [t for t in types if t[:2] != ("bf16", "bf16")]
    assert weight_gradients == [("f32", "f32", "f32")] * 2, types


def test_autocast_keeps_input_shardings():
    params, x, _ = _init()
    mesh = _mesh()
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    out = jax.jit(mpjax.autocast(lambda p, x: jnp.tanh(x @ p["w1"])))(params, xs)
    assert out.dtype == jnp.float32
    assert out.sharding.spec == P("data") or out.sharding.spec[0] == "data"


# --- tensor parallelism: leaves sharded along any axis ------------------------------

_TP_SPECS = {
    "w1": ((16, 32), P(None, "model")),  # column-parallel
    "w2": ((32, 16), P("model", None)),  # row-parallel, of w1's size
    "b1": ((32,), P("model")),
    "scale": ((32,), P()),  # replicated, of b1's size
    "big": ((256, 512), P("data", "model")),  # checked by a reduction of its own
}


def _tp_tree(mesh):
    shardings = {k: NamedSharding(mesh, spec) for k, (_, spec) in _TP_SPECS.items()}
    params = {k: jnp.full(shape, 0.5) for k, (shape, _) in _TP_SPECS.items()}
    return jax.device_put(params, shardings), shardings


def _collectives(hlo: str) -> list[str]:
    return re.findall(r"= (\([^)]*\)|\S+) (all-gather|all-to-all|all-reduce)(?:-start)?\(", hlo)


def _moved(found: list) -> list:
    """Each collective's kind and the elements of each array it moves."""
    arrays = lambda shape: [np.prod([int(d) for d in dims.split(",") if d]) for dims in shape]
    return [(kind, arrays(re.findall(r"\[([\d,]*)\]", shape))) for shape, kind in found]


def test_the_finite_check_of_tensor_parallel_gradients_reads_them_where_they_lie():
    # Each device checks its own shards: the flags meet in small all-reduces, and no
    # gradient (nor its isfinite mask) is gathered or moved between devices.
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    params, shardings = _tp_tree(mesh)
    tx = mpjax.grad_scaler(optax.adam(1e-3), init_scale=4.0)
    state = tx.init(params)
    step = jax.jit(tx.update, in_shardings=(shardings, None, shardings))
    found = _collectives(step.lower(params, state, params).compile().as_text())
    assert found and all(kind == "all-reduce" for _, kind in found), found
    sizes = [n for _, arrays in _moved(found) for n in arrays]
    assert max(sizes) <= 8, found  # flags, not gradients
    grads = jax.tree.map(lambda p: p * 0.1, params)
    updates, new = step(grads, state, params)
    chex.assert_trees_all_equal(updates, optax.adam(1e-3).update(grads, state.inner_state)[0])
    bad = {**grads, "w2": grads["w2"].at[3, 5].set(jnp.inf)}
    updates, skipped = step(bad, state, params)
    assert int(skipped.skipped_steps) == 1 and float(skipped.scale) == 2.0
    chex.assert_trees_all_equal(skipped.inner_state, state.inner_state)


def test_the_scaler_updates_tensor_parallel_parameters_under_explicit_sharding():
    mesh = jax.make_mesh(
        (2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    with jax.set_mesh(mesh):
        params, _ = _tp_tree(mesh)
        grads = jax.tree.map(lambda p: p * 0.1, params)
        tx = mpjax.grad_scaler(optax.adam(1e-3))
        updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
        want, _ = jax.jit(optax.adam(1e-3).update)(grads, optax.adam(1e-3).init(params))
        chex.assert_trees_all_equal(updates, want)
        assert {k: u.sharding.spec for k, u in updates.items()} == {
            k: w.sharding.spec for k, w in want.items()
        }
        assert int(state.skipped_steps) == 0


_ONE_DEVICE_EXPLICIT = """
import chex, jax, jax.numpy as jnp, optax, mpjax
from jax.sharding import NamedSharding, PartitionSpec as P
assert jax.device_count() == 1
mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
shardings = {"w": NamedSharding(mesh, P(None, "data")), "b": NamedSharding(mesh, P()),
             "v": NamedSharding(mesh, P("data"))}
params = jax.device_put({"w": jnp.ones((4, 8)), "b": jnp.ones(4), "v": jnp.ones(300)}, shardings)
grads = jax.tree.map(lambda p: 0.1 * p, params)
bad = {**grads, "w": jax.device_put(jnp.ones((4, 8)).at[1, 2].set(jnp.nan), shardings["w"])}
tx, adam = mpjax.grad_scaler(optax.adamw(1e-3)), optax.adamw(1e-3)
want, _ = adam.update(grads, adam.init(params), params)
for update in (tx.update, jax.jit(tx.update)):
    updates, state = update(grads, tx.init(params), params)
    chex.assert_trees_all_equal(updates, want)
    assert int(state.skipped_steps) == 0
    updates, state = update(bad, tx.init(params), params)
    assert int(state.skipped_steps) == 1 and bool(state.nonfinite_subtrees["['w']"])
    chex.assert_trees_all_equal(state.inner_state, tx.init(params).inner_state)
print("OK")
"""


def test_the_scaler_updates_parameters_sharded_on_one_device_with_explicit_axes():
    # jax.make_mesh on a laptop: one device, and axes explicit by default on later
    # jax releases. The check cannot concatenate leaves whose types carry a sharding.
    run_fresh_python(_ONE_DEVICE_EXPLICIT)


@pytest.mark.parametrize("policy", ["torch", "lean"])
def test_explicit_sharding_makes_the_collectives_plain_jax_makes(policy):
    # A bias broadcast by autocast (rounded while small under lean) is sharded as the
    # result: its cotangent is summed where it lies, not gathered from every device.
    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))

    def loss(p, x):
        return jnp.mean(jnp.tanh(x @ p["w"] + p["b"]) ** 2)

    with jax.set_mesh(mesh):
        params = {"w": jnp.full((16, 64), 0.01), "b": jnp.full(64, 0.1)}
        x = jax.device_put(jnp.ones((64, 16)), P("data", None))
        plain, cast = (
            _collectives(jax.jit(jax.grad(f)).lower(params, x).compile().as_text())
            for f in (loss, mpjax.autocast(loss, policy=policy))
        )
        # The same collectives, moving as many elements: autocast's weight gradient
        # comes out laid out as the weight, where plain JAX's is transposed after.
        assert _moved(cast) == _moved(plain) and [kind for _, kind in plain] == ["all-reduce"]
        grads = jax.jit(jax.grad(mpjax.autocast(loss, policy=policy)))(params, x)
        chex.assert_trees_all_close(grads, jax.grad(loss)(params, x), rtol=2e-2, atol=1e-6)


def _weight_gradient_products(text: str) -> set:
    return set(re.findall(r"stablehlo.dot_general.*-> (tensor<4x4x\w+>)", text))


@pytest.mark.parametrize("reach", ["shard_map", "device_put"])
def test_a_weight_reached_through_sharding_keeps_a_float32_gradient(reach):
    # shard_map inserts a pvary before the replicated weight's product; FSDP code
    # moves the weight with device_put (or reshard). It is still a parameter: its
    # gradient is a float32 sum, never rounded to 16 bits on a device.
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    w, x = jnp.full((4, 4), 0.01), jnp.full((8 * N_DEV, 4), 64.0)

    def loss(w, x):
        return jnp.mean(x @ w)

    if reach == "shard_map":
        specs = dict(mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
        f = jax.shard_map(lambda w, x: lax.pmean(loss(w, x), "d"), **specs)
    else:
        f = lambda w, x: loss(jax.device_put(w, NamedSharding(mesh, P())), x)  # noqa: E731
    text = jax.jit(jax.grad(mpjax.autocast(f))).lower(w, x).as_text()
    assert _weight_gradient_products(text) == {"tensor<4x4xf32>"}
    # 16 per entry, times 2**15 and split over the devices: 65536 on each before
    # the all-reduce, beyond float16.
    tx = mpjax.grad_scaler(optax.sgd(0.1), init_scale=2.0**15)
    grad_fn = lambda s, *a: mpjax.scaled_value_and_grad(mpjax.autocast(f), s)(*a)  # noqa: E731
    _, g = jax.jit(grad_fn)(tx.init(w), w, x)
    np.testing.assert_allclose(g, jnp.full((4, 4), 16.0), rtol=1e-6)


@pytest.mark.parametrize("to", ["varying", "invarying"])
def test_a_weight_gathered_from_its_shards_keeps_a_float32_gradient(to):
    # FSDP under shard_map: lax.all_gather(..., to="invarying") binds
    # all_gather_invariant. Not known as carrying a parameter, its product's weight
    # gradient was a 16-bit result on each device: inf past 65504 (1.3e5 here).
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    x, w = jnp.full((8 * N_DEV, 8), 2.0), jnp.full((8, 8), 0.25)

    def loss(w, x):
        def inner(x, w):
            h = x @ lax.all_gather(w, "d", tiled=True, to=to)
            return lax.pmean(jnp.mean(h * h), "d")

        specs = dict(mesh=mesh, in_specs=(P("d"), P("d")), out_specs=P())
        return jax.shard_map(inner, **specs)(x, w)

    scaled = lambda f: lambda w, x: f(w, x) * 2.0**19  # noqa: E731
    got = jax.jit(jax.grad(scaled(mpjax.autocast(loss))))(w, x)
    np.testing.assert_allclose(got, jax.jit(jax.grad(scaled(loss)))(w, x), rtol=1e-3)


def test_a_weight_resharded_under_explicit_sharding_keeps_a_float32_all_reduce():
    from jax.sharding import AxisType, reshard

    mesh = jax.make_mesh((N_DEV,), ("data",), axis_types=(AxisType.Explicit,))
    x, w = jnp.ones((8 * N_DEV, 32)), jnp.full((32, 16), 0.01)

    def loss(w, x):  # FSDP: gather the weight, then multiply
        return jnp.mean(jnp.tanh(x @ reshard(w, P())) ** 2)

    with jax.set_mesh(mesh):
        xs, ws = jax.device_put(x, P("data", None)), jax.device_put(w, P("data", None))
        text = jax.jit(jax.grad(mpjax.autocast(loss))).lower(ws, xs).compile().as_text()
    reduced = re.findall(r"= (\w+)\[[\d,]*\]\S* all-reduce(?:-start)?\(", text)
    assert reduced and set(reduced) == {"f32"}


def test_psum_inside_shard_map_follows_reduce_dtype():
    # With check_vma (the default), lax.psum binds psum_invariant.
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    w, x = jnp.full((4, 4), 0.1), jnp.ones((2 * N_DEV, 4))
    body = lambda w, x: lax.psum(x @ w, "d")  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    for reduce_dtype, want in ((jnp.float16, "f16"), (jnp.float32, "f32")):
        g = mpjax.autocast(f, reduce_dtype=reduce_dtype)
        text = jax.jit(g).lower(w, x).as_text()
        assert re.findall(r"\}\) : \(tensor<2x4x(\w+)>\)", text) == [want]


@pytest.mark.parametrize("policy", ["torch", "lean"])
def test_pmean_of_16_bit_values_divides_the_float32_sum(policy):
    # lax.pmean is a psum, then a division: 8 devices' 20000 sum to 160000, which
    # float16 cannot hold; their mean it can.
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    body = lambda x, w: lax.pmean(x @ w, "d")  # noqa: E731
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P())
    x, w = jnp.full((N_DEV, 4), 100.0), jnp.full((4, 4), 50.0)
    g = mpjax.autocast(f, policy=policy)
    for got in (g(x, w), jax.jit(g)(x, w)):
        chex.assert_trees_all_equal(got, f(x, w))
    grads = jax.grad(lambda w: jnp.sum(g(x, w)))(w)
    chex.assert_trees_all_close(grads, jax.grad(lambda w: jnp.sum(f(x, w)))(w), rtol=1e-3)


def test_constants_a_shard_map_body_computes_keep_their_values_outside_jit():
    # Called eagerly, the body runs under shard_map's own trace: the values of
    # `ones * 1e-8` and `ones * 8e4` must still be known, to run those products
    # as written rather than flush to 0 or saturate at 65504.
    mesh = jax.make_mesh((N_DEV,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(x, w):
        return (x @ w) * (jnp.ones(4) * 1e-8), (x @ w) * (jnp.ones(4) * 8e4)

    specs = {"mesh": mesh, "in_specs": (P("d"), P()), "out_specs": (P("d"), P("d"))}
    f = jax.shard_map(body, **specs)
    x, w = jnp.full((2 * N_DEV, 4), 0.5), jnp.full((4, 4), 0.5)
    g = mpjax.autocast(f)
    for got in (g(x, w), jax.jit(g)(x, w)):
        chex.assert_trees_all_close(got, f(x, w), rtol=1e-3)
    loss = lambda f: lambda w: jnp.sum(f(x, w)[0]) * 1e8  # noqa: E731
    chex.assert_trees_all_close(jax.grad(loss(g))(w), jax.grad(loss(f))(w), rtol=1e-3)


def test_a_jitted_shard_map_holding_another_runs_outside_jit():
    # autocast inlines the user's jit; JAX cannot run the outer shard_map eagerly
    # with one nested in it, so autocast runs it compiled.
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def outer(x, w):
        inner = lambda x, w: lax.psum(x @ w, "b")  # noqa: E731
        specs = {"in_specs": (P(None, "b"), P("b")), "out_specs": P(), "axis_names": {"b"}}
        return jax.shard_map(inner, **specs)(x, w)

    with jax.set_mesh(mesh):
        specs = {"in_specs": (P("a"), P()), "out_specs": P("a"), "axis_names": {"a"}}
        f = jax.jit(jax.shard_map(outer, mesh=mesh, **specs))
        x = jax.device_put(jnp.arange(64.0).reshape(8, 8) / 64, P("a", "b"))
        w = jnp.full((8, 8), 0.5)
        got = mpjax.autocast(f)(x, w)
        chex.assert_trees_all_close(got, f(x, w), rtol=1e-2)
        chex.assert_trees_all_equal(got, jax.jit(mpjax.autocast(f))(x, w))


def test_a_partial_axis_name_is_refused_with_the_missing_axes():
    mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    tx = mpjax.grad_scaler(optax.adam(1e-3), axis_name="a")
    params = {"w": jnp.ones(16)}
    state = tx.init(params)
    specs = {"w": P(("a", "b"))}
    state_specs = jax.tree.map(lambda _: P(), state)
    state_specs = state_specs._replace(
        inner_state=jax.tree.map(lambda _: P(("a", "b")), state.inner_state)
    )
    state_specs = jax.tree.map(
        lambda s, x: P() if jnp.ndim(x) == 0 else s,
        state_specs,
        state,
        is_leaf=lambda s: isinstance(s, P),
    )
    step = jax.shard_map(
        lambda p, s, g: tx.update(g, s, p),
        mesh=mesh,
        in_specs=(specs, state_specs, specs),
        out_specs=(specs, state_specs),
    )
    with pytest.raises(ValueError, match=r"mesh axes \('b',\).*axis_name='a' combines"):
        jax.jit(step)(params, state, params)


def test_an_axis_name_no_mesh_binds_is_refused_naming_the_argument():
    tx = mpjax.grad_scaler(optax.adam(1e-3), axis_name="data")
    params = {"w": jnp.ones((8, 4))}
    state = tx.init(params)
    mesh = jax.make_mesh((N_DEV,), ("batch",), axis_types=(jax.sharding.AxisType.Auto,))
    in_shard_map = jax.shard_map(tx.update, mesh=mesh, in_specs=P(), out_specs=P())
    for update in (jax.jit(in_shard_map), jax.jit(tx.update), tx.update):
        with pytest.raises(ValueError, match=r"grad_scaler\(\.\.\., axis_name='data'\).*shard_map"):
            update(params, state, params)


@pytest.mark.parametrize("low", [jnp.float16, jnp.bfloat16])
def test_a_product_left_unreduced_adds_float32_partial_sums_across_devices(low):
    from jax.sharding import AxisType, reshard

    # A row-parallel layer: contracting the sharded features leaves each device a
    # partial sum, which the reshard adds across devices.
    mesh = jax.make_mesh((N_DEV,), ("model",), axis_types=(AxisType.Explicit,))

    def loss(p, x):
        h = jnp.einsum("bf,fo->bo", x, p["w"], out_sharding=P(None, None, unreduced={"model"}))
        return jnp.mean(jnp.tanh(reshard(h, P(None, None))) ** 2)

    kw, kx = jax.random.split(jax.random.key(0))
    w, x = jax.random.normal(kw, (64, 16)) * 0.1, jax.random.normal(kx, (8, 64))
    with jax.set_mesh(mesh):
        params = {"w": jax.device_put(w, P("model", None))}
        xs = jax.device_put(x, P(None, "model"))
        cast = mpjax.autocast(loss, dtype=low)
        summed = [
            e.invars[0].aval
            for e in jax.make_jaxpr(cast)(params, xs).jaxpr.eqns
            if e.primitive.name == "reshard" and "{U:" in str(e.invars[0].aval)
        ]
        assert summed and {a.dtype for a in summed} == {np.dtype(np.float32)}, summed
        got = jax.jit(jax.grad(cast))(params, xs)["w"]
        # The float32 program on the 16-bit operands' values: the gradient is a
        # float32 sum of 16-bit products, never rounded to 16 bits itself.
        rounded = jax.tree.map(lambda a: a.astype(low).astype(jnp.float32), (params, xs))
        want = jax.jit(jax.grad(loss))(*rounded)["w"]
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-9)

"""mpjax.diagnose: where a 16-bit training step overflows or underflows.

The transformer tests inject a fault at a known layer and check that the report
names it: the primitive, the module path (Flax Linen's name stack) and the line of
this file. One small model shape throughout, so that the operations compiled for
one test are reused by the next.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax._diagnose_advice import HEADROOM


def _line(marker: str) -> int:
    with open(__file__) as f:
        for n, text in enumerate(f, 1):
            if f"# {marker}" in text and "_line(" not in text:
                return n
    raise AssertionError(marker)


@jax.custom_jvp
def amplify_gradient(x):
    """The identity, whose gradient is 1000 times larger than it should be."""
    return x


@amplify_gradient.defjvp
def _amplify_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return x, t * 1000.0


class MLP(nn.Module):
    boost: float = 1.0
    amplify: bool = False

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(2 * x.shape[-1], use_bias=False, name="up")(x)  # float16 out
        h = h * self.boost  # BOOST
        if self.amplify:
            h = amplify_gradient(h)  # AMPLIFY
        return nn.Dense(x.shape[-1], name="down")(nn.relu(h))


class Block(nn.Module):
    boost: float = 1.0
    amplify: bool = False

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(2, name="attn")(nn.LayerNorm(name="ln1")(x))
        return x + MLP(self.boost, self.amplify, name="mlp")(nn.LayerNorm(name="ln2")(x))


class Transformer(nn.Module):
    faulty: int = -1  # the block with the fault
    boost: float = 1.0
    amplify: bool = False

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(11, 8, name="embed")(tokens)
        for i in range(3):
            fault = i == self.faulty
            x = Block(self.boost if fault else 1.0, fault and self.amplify, name=f"block_{i}")(x)
        return nn.Dense(11, name="head")(x)


def _transformer(**fault):
    model = Transformer(**fault)
    tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, 11)
    params = model.init(jax.random.key(0), tokens)

    def loss_fn(params, tokens):
        logits = model.apply(params, tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    return loss_fn, params, tokens


@pytest.fixture(scope="module")
def forward_report():
    # block_1's activations times 30000, in float16: beyond 65504 at |h| > 2.2.
    return mpjax.diagnose(*_transformer(faulty=1, boost=3e4))


def test_forward_overflow_names_the_primitive_module_and_line(forward_report):
    run = forward_report.runs[0]
    origin = run.forward
    assert origin.phase == "forward" and origin.primitive == "mul"
    assert origin.module == "Transformer/block_1/mlp"
    assert (origin.file, origin.line) == (__file__, _line("BOOST"))
    assert origin.function == "MLP.__call__" and origin.produced == "inf"
    assert origin.in_dtypes == ("float16", "float16") and origin.in_max_abs < 65504
    # float32 is finite: a precision problem, and the recommendation says where.
    assert forward_report.reference_forward is None
    assert math.isfinite(forward_report.reference_loss) and not math.isfinite(run.loss)
    # No scale reaches the forward pass: no workable scale, as the reference says.
    assert run.recommended_scale is None and run.max_gradient == math.inf
    (text,) = forward_report.recommendations
    assert "`Transformer/block_1/mlp`" in text and "test_diagnose.py" in text
    assert "enabled=False" in text and "bfloat16" in text
    # Only the layers from the fault on are inf in float16.
    layers = {layer.module: layer for layer in forward_report.layers}
    assert math.isinf(layers["Transformer/block_1/mlp"].low_max_abs["float16"])
    assert math.isfinite(layers["Transformer/block_0/mlp"].low_max_abs["float16"])
    assert layers["Transformer/block_1/mlp"].max_abs > 65504  # float32's value


def _gaussian_process_nll(p, y):
    x = p["x"]
    gram = x @ x.T + 1e-2 * jnp.eye(x.shape[0])
    chol = jnp.linalg.cholesky(gram)  # CHOLESKY
    fit = 0.5 * y @ jax.scipy.linalg.cho_solve((chol, True), y) + jnp.sum(jnp.log(jnp.diag(chol)))
    return fit + 1e-3 * jnp.trace(gram)  # read by more than the factorization: 16 bits


def test_a_float32_operation_made_nan_by_16_bit_inputs_is_found_at_the_users_line():
    # bfloat16 rounds the Gram matrix indefinite (its trace reads it too, so its
    # product runs in 16 bits); the Cholesky factor, in float32, is NaN. The factorization runs inside jnp.linalg's own jit, whose equations
    # carry no line of the user's: they take the call's. And the advice is to keep
    # the products before it in float32 too, not only what already ran there.
    k1, k2 = jax.random.split(jax.random.key(1))
    x, y = jax.random.normal(k1, (64, 4)), jax.random.normal(k2, (64,))
    report = mpjax.diagnose(_gaussian_process_nll, {"x": x}, y, dtype=jnp.bfloat16)
    origin = report.runs[0].forward
    assert origin.primitive == "cholesky" and origin.produced == "nan"
    assert (origin.file, origin.line) == (__file__, _line("CHOLESKY"))
    assert origin.in_dtypes == ("float32",)
    (text,) = report.recommendations
    assert "ran in float32" in text and "computing its inputs" in text
    assert f"test_diagnose.py:{_line('CHOLESKY')}" in text


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (conftest)")
def test_an_overflow_inside_a_shard_map_is_found_inside():
    # The product overflows on every device, but the tanh after it hides the inf:
    # the shard_map's outputs are finite, only its body shows where.
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Auto,))

    def body(w, x):
        return lax.pmean(jnp.mean(jnp.tanh((x @ w) * 1e-6)), "i")  # SHARDED PRODUCT

    def loss(p, x):
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())
        return mapped(p["w"], x)

    report = mpjax.diagnose(loss, {"w": jnp.full((4, 4), 400.0)}, jnp.full((8, 4), 100.0))
    origin = report.runs[0].forward
    assert origin.primitive == "dot_general" and origin.inside == "inside shard_map"
    assert (origin.file, origin.line) == (__file__, _line("SHARDED PRODUCT"))
    assert "enabled=False" in report.recommendations[0]


def test_backward_only_overflow_is_reported_apart():
    # The forward pass is the identity; its gradient is 1000 times too large. JAX
    # traces a custom_jvp rule apart: its equations point at the call.
    report = mpjax.diagnose(*_transformer(faulty=2, amplify=True))
    run = report.runs[0]
    assert run.forward is None and math.isfinite(run.loss)
    origin = run.backward
    assert origin.phase == "backward" and origin.primitive == "mul"
    assert origin.module == "Transformer/block_2/mlp"
    assert (origin.file, origin.line) == (__file__, _line("AMPLIFY"))
    assert any(leaf.overflow > 0 for leaf in run.leaves)
    # The scale that would have fitted: computed from the step measured at scale 1.
    assert run.recommended_scale < run.scale
    assert any("backward pass at scale 65536" in r for r in report.recommendations)


def _tiny_gradient_mlp():
    """w2's gradient is spread over 1e-12 .. 1e-3: float16 flushes part of it."""
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, 16)) / 3, "w2": jax.random.normal(k2, (16, 12)) / 4}
    x = jax.random.normal(k3, (5, 8))
    weights = jnp.logspace(-12, -3, 12)  # per output column

    def loss_fn(params, x):
        h = jnp.tanh(x @ params["w1"])
        return jnp.sum(jnp.mean(h @ params["w2"], 0) * weights) + jnp.mean(h**2)

    return loss_fn, params, x


def test_underflow_share_matches_float32_directly():
    loss_fn, params, x = _tiny_gradient_mlp()
    report = mpjax.diagnose(loss_fn, params, x, scale=1.0)
    # Independently: the float16 gradient at scale 1 against the float32 one.
    g16 = jax.grad(mpjax.autocast(loss_fn))(params, x)
    g32 = jax.grad(loss_fn)(params, x)
    expected = {
        f"['{k}']": float(np.mean((np.asarray(g16[k]) == 0) & (np.asarray(g32[k]) != 0)))
        for k in params
    }
    leaves = {leaf.path: leaf for leaf in report.runs[0].leaves}
    assert {p: leaf.underflow for p, leaf in leaves.items()} == expected
    assert 0.2 < expected["['w2']"] < 0.9 and expected["['w1']"] == 0.0
    assert leaves["['w2']"].overflow == 0.0
    assert leaves["['w2']"].reference_max_abs == pytest.approx(float(jnp.abs(g32["w2"]).max()))
    # It is underflow: the recommended scale is larger, and it is measured again there.
    run = report.runs[0]
    assert run.recommended_scale > 1.0 and run.leaves_at_recommended
    again = {leaf.path: leaf.underflow for leaf in run.leaves_at_recommended}
    assert again["['w2']"] < expected["['w2']"]
    assert report.recommendations[0].startswith("Raise init_scale to 2**")


def test_recommended_scale_follows_the_formula():
    # loss = c * sum(x @ w): the backward pass's 16-bit values are the cotangents
    # of x @ w, c each; w's gradient, c * batch, is a float32 sum.
    c, batch = 3.0, 5
    w, x = jnp.full((4, 2), 0.1), jnp.ones((batch, 4))

    def loss_fn(w, x):
        return c * jnp.sum(x @ w)

    largest = float(jnp.abs(jax.grad(loss_fn)(w, x)).max())  # 15, in float32
    k = math.floor(math.log2(65504 / (HEADROOM * c)))
    report = mpjax.diagnose(loss_fn, w, x)  # at 2**16: 3 * 65536 overflows float16
    run = report.runs[0]
    assert run.max_gradient == c and run.recommended_scale == 2.0**k == 2.0**11
    assert run.backward is not None and run.forward is None
    assert any(f"init_scale=2**{k}" in r for r in report.recommendations)
    # The scale read from an optimizer state: at 2**9 the step fits.
    opt_state = mpjax.grad_scaler(optax.sgd(0.1), init_scale=2.0**k).init(w)
    run = mpjax.diagnose(loss_fn, w, x, scale=opt_state).runs[0]
    assert run.scale == 2.0**k and run.backward is None
    assert run.leaves[0].max_abs == largest and run.leaves[0].overflow == 0.0


class _DenseBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(8)(x))
        return nn.Dense(1)(x)


def test_a_backward_pass_zero_in_16_bits_gets_no_scale():
    """A constant batch through BatchNorm: exact zeros in float16, rounding noise
    in float32. Every 16-bit backward value is zero, at any scale: no scale is
    derived from that (it once advised 2**64), the advice says where to look."""
    model, x = _DenseBatchNorm(), jnp.ones((16, 4))
    variables = model.init(jax.random.key(0), x)

    def loss_fn(params, x):
        stats = {"batch_stats": variables["batch_stats"]}
        y, _ = model.apply({"params": params, **stats}, x, mutable=["batch_stats"])
        return jnp.mean(y**2)

    report = mpjax.diagnose(loss_fn, variables["params"], x)
    (run,) = report.runs
    assert run.max_gradient == 0.0 and run.recommended_scale is None
    assert max(leaf.reference_max_abs for leaf in run.leaves) > 0
    (advice,) = report.recommendations
    assert "no loss scale brings the gradients back" in advice and "2**" not in advice
    assert report.as_dict()["runs"][0]["recommended_scale"] is None


def test_a_loss_without_gradient_gets_no_scale():
    def loss_fn(w, x):
        return jnp.sum(x) + 0.0 * jnp.sum(lax.stop_gradient(w))

    w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
    (run,) = mpjax.diagnose(loss_fn, w, x).runs
    assert run.recommended_scale is None and run.max_gradient == 0.0
    (advice,) = mpjax.diagnose(loss_fn, w, x).recommendations
    assert advice.startswith("The float32 gradients are zero too")


def test_a_scan_is_searched_step_by_step():
    def loss_fn(w, c0):
        c, _ = lax.scan(lambda c, _: (c @ w, None), c0, None, length=6)  # SCAN
        return jnp.sum(c) * 1e-6

    # 10**(step + 1): step 4's product makes 100000, beyond float16: the product
    # returns inf before the float32 carry widens it. In float32 all is finite.
    report = mpjax.diagnose(loss_fn, 10 * jnp.eye(4), jnp.ones((2, 4)))
    origin = report.runs[0].forward
    assert (origin.primitive, origin.inside) == ("dot_general", "scan step 4")
    assert (origin.file, origin.line) == (__file__, _line("SCAN"))
    assert origin.in_max_abs == 1e4 and report.reference_forward is None


def test_text_plot_and_dict(forward_report, tmp_path):
    text = str(forward_report)
    for section in ["First inf/NaN", "Gradients", "Values by module", "Recommendations"]:
        assert section in text
    assert "Transformer/block_1/mlp" in text and "test_diagnose.py" in text
    raw = forward_report.as_dict()
    assert raw["runs"][0]["forward"]["primitive"] == "mul"
    assert isinstance(raw["layers"][0]["max_abs"], float)
    pytest.importorskip("matplotlib")
    path = tmp_path / "ranges.png"
    forward_report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(TypeError, match=r"plot\(path\): path must be a file name .* got int 3"):
        forward_report.plot(3)


def test_nnx_module_both_dtypes_and_sharded_batch():
    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(4, 3, rngs=rngs)
            self.bn = nnx.BatchNorm(3, rngs=rngs)

        def __call__(self, x):
            return self.bn(self.lin(x))

    model = Net(nnx.Rngs(0))
    before = jax.tree.map(np.asarray, nnx.state(model))
    mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    x = jax.device_put(jnp.arange(32.0).reshape(8, 4) / 32, jax.NamedSharding(mesh, jax.P("data")))
    report = mpjax.diagnose(lambda m, x: jnp.mean(m(x) ** 2), model, x, dtype="both")
    assert [r.dtype for r in report.runs] == ["float16", "bfloat16"]
    assert [r.scale for r in report.runs] == [2.0**16, 1.0]
    paths = {leaf.path for leaf in report.runs[0].leaves}
    assert paths == {"['lin']['kernel']", "['lin']['bias']", "['bn']['scale']", "['bn']['bias']"}
    assert all(r.forward is None and r.backward is None for r in report.runs)
    # The model is left as it was: BatchNorm's statistics included.
    after = jax.tree.map(np.asarray, nnx.state(model))
    jax.tree.map(np.testing.assert_array_equal, before, after)


@pytest.mark.parametrize("case", ["unused parameter", "constant branch", "constant loss"])
def test_a_step_with_a_constant_result_is_reported(case):
    w, x = jnp.full((4, 3), 0.1), jnp.ones((2, 4))
    params, loss_fn = {"w": w}, lambda p, x: jnp.mean(x @ p["w"])
    if case == "unused parameter":  # its gradient is the constant 0
        params = {"w": w, "t": jnp.float32(1.0)}
    elif case == "constant branch":
        loss_fn = lambda p, x: lax.cond(x[0, 0] < 0, lambda: jnp.mean(x @ p["w"]), lambda: 0.0)
    else:
        loss_fn = lambda p, x: 1.0
    report = mpjax.diagnose(loss_fn, params, x)
    assert report.runs and "float16" in str(report)


def test_bad_input():
    def loss_fn(w, x):
        return jnp.sum(x @ w)

    w, x = jnp.ones((4, 2)), jnp.ones((3, 4))
    with pytest.raises(TypeError, match="loss_fn must be callable"):
        mpjax.diagnose(w, loss_fn, x)
    with pytest.raises(ValueError, match="dtype must be"):
        mpjax.diagnose(loss_fn, w, x, dtype=jnp.float32)
    with pytest.raises(ValueError, match="scale"):
        mpjax.diagnose(loss_fn, w, x, scale=-1.0)
    with pytest.raises(ValueError, match="grad_scaler"):
        mpjax.diagnose(loss_fn, w, x, scale={"lr": 0.1})
    with pytest.raises(ValueError, match=r"scale must be a scalar, got an array of shape \(1,\)"):
        mpjax.diagnose(loss_fn, w, x, scale=jnp.array([8.0]))
    with pytest.raises(ValueError, match=r"diagnose\(scale=1e\+40\).*finite float32"):
        mpjax.diagnose(loss_fn, w, x, scale=1e40)
    with pytest.raises(TypeError, match="concrete values.*ShapeDtypeStruct"):
        mpjax.diagnose(loss_fn, jax.ShapeDtypeStruct((4, 2), jnp.float32), x)
    with pytest.raises(ValueError, match="no floating-point arrays"):
        mpjax.diagnose(loss_fn, {"n": jnp.arange(3)}, x)
    with pytest.raises(TypeError, match="has_aux=True"):
        mpjax.diagnose(lambda w, x: (loss_fn(w, x), 0.0), w, x)
    with pytest.raises(TypeError, match=r"pair \(loss, aux\), got an array\. Pass has_aux=False"):
        mpjax.diagnose(loss_fn, w, x, has_aux=True)
    # A [loss, aux] list is a pair, as for jax.value_and_grad(has_aux=True).
    listed = mpjax.diagnose(lambda w, x: [loss_fn(w, x), 0.0], w, x, has_aux=True, scale=1.0)
    assert (
        listed.runs[0].max_gradient == mpjax.diagnose(loss_fn, w, x, scale=1.0).runs[0].max_gradient
    )
    with pytest.raises(TypeError, match="scalar loss"):
        mpjax.diagnose(lambda w, x: x @ w, w, x)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda w: mpjax.diagnose(loss_fn, w, x))(w)
    state = mpjax.grad_scaler(optax.sgd(0.1)).init(w)  # the scale, traced: no float() error
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda s: mpjax.diagnose(loss_fn, w, x, scale=s))(state)
    with pytest.raises(TypeError, match="outside jax.jit"):
        jax.jit(lambda s: mpjax.diagnose(loss_fn, w, x, scale=s))(jnp.float32(8.0))
    with pytest.raises(ValueError, match="policy"):
        mpjax.diagnose(loss_fn, w, x, policy="fast")


def test_an_autocast_function_is_diagnosed_at_its_own_dtype_and_labelled_so():
    """Unwrapped (also from a functools.partial), an autocast function runs at its own
    dtype unless another is asked for, which is an error, not a silent float16 run."""
    import functools

    def loss_fn(w, x):
        return jnp.mean((x @ w * 1e-5 - 1.0) ** 2)  # the product, 1e5, overflows float16

    w, x = jnp.full((64, 8), 40.0), jnp.full((4, 64), 50.0)
    assert mpjax.diagnose(loss_fn, w, x).runs[0].forward.primitive == "dot_general"
    in_bfloat16 = mpjax.autocast(loss_fn, dtype=jnp.bfloat16)
    for fn in [in_bfloat16, functools.partial(in_bfloat16)]:
        (run,) = mpjax.diagnose(fn, w, x).runs
        assert run.dtype == "bfloat16" and run.forward is None
    assert [r.dtype for r in mpjax.diagnose(in_bfloat16, w, x, dtype="both").runs] == [
        "float16",
        "bfloat16",
    ]
    with pytest.raises(ValueError, match=r"diagnose\(dtype=jnp.float16\).*dtype bfloat16.*Leave"):
        mpjax.diagnose(in_bfloat16, w, x, dtype=jnp.float16)
    with pytest.raises(ValueError, match=r"diagnose\(policy='torch'\).*policy lean"):
        mpjax.diagnose(mpjax.autocast(loss_fn, policy="lean"), w, x, policy="torch")


def test_checkpointed_forward_values_are_not_counted_as_gradients():
    """Values a `jax.checkpoint` recomputes in the backward pass are forward
    values (the loss scale does not reach them): same figures either way."""

    def make(checkpoint):
        def block(w, x):
            return jnp.tanh((x @ w) * 1e-4)  # a float16 product of 3.2e4

        block = jax.checkpoint(block) if checkpoint else block
        return lambda p, x: jnp.mean(block(p["w"], x) @ p["v"]) * 2.0**-20

    p = {"w": jnp.full((16, 8), 40.0), "v": jnp.full((8, 2), 0.01)}
    x = jnp.full((4, 16), 50.0)
    plain, remat = (mpjax.diagnose(make(c), p, x, scale=1.0) for c in (False, True))
    assert remat.runs[0].max_gradient == plain.runs[0].max_gradient < 1e-6
    assert remat.runs[0].recommended_scale == plain.runs[0].recommended_scale
    assert remat.recommendations == plain.recommendations


def test_an_inf_the_float32_run_makes_too_does_not_hide_the_16_bit_advice():
    """A log(mask)'s -inf is the model's, harmless when the float32 loss and
    gradients are finite: the float16 run's own overflow is what is reported."""

    def loss_fn(p, x, y, mask):
        s = x @ p["w"] + jnp.log(mask)  # -inf where masked; the softmax gives 0
        return jnp.sum(jax.nn.softmax(s, axis=-1) * y) * 100.0

    p = {"w": jnp.linspace(-1, 1, 12).reshape(4, 3)}
    x, y = jnp.linspace(-2, 2, 32).reshape(8, 4), jnp.linspace(0, 5, 24).reshape(8, 3)
    report = mpjax.diagnose(loss_fn, p, x, y, jnp.array([1.0, 1.0, 0.0]))
    assert math.isfinite(report.reference_loss)
    assert report.runs[0].forward is None and report.runs[0].backward is not None
    assert "not finite either" not in " ".join(report.recommendations)
    assert "Start from init_scale=2**" in " ".join(report.recommendations)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_minus_inf_the_float32_run_has_too_is_no_16_bit_overflow(dtype):
    """segment_max gives -inf for a segment without elements, in float32 as well:
    the module table agrees with "forward: none", and its float32 column holds the
    values the loss reads (at most 1), not the count of ties JAX's derivative of
    segment_max computes beside them (20 per segment)."""
    receivers = jnp.arange(200) % 10  # segments 10..49 receive nothing: -inf
    x = jax.random.normal(jax.random.key(0), (200, 8))

    def loss_fn(p, x):
        m = jax.ops.segment_max(x @ p["w"], receivers, 50)  # -inf for empty segments
        return jnp.mean(jnp.where(jnp.isfinite(m), m, 0.0) ** 2)

    report = mpjax.diagnose(loss_fn, {"w": jnp.full((8, 4), 0.1)}, x, dtype=dtype)
    assert report.runs[0].forward is None and report.runs[0].backward is None
    (row,) = [r for r in report.layers if r.module.endswith(f":{_line('-inf for empty')})")]
    assert all(math.isfinite(v) for r in report.layers for v in r.low_max_abs.values())
    assert "inf/NaN in" not in str(report)
    assert row.max_abs < 1.0


def test_a_nan_in_the_batch_is_blamed_on_the_data():
    x = jnp.ones((8, 4)).at[0, 0].set(jnp.nan)
    report = mpjax.diagnose(lambda p, x: jnp.mean(x @ p["w"]), {"w": jnp.ones((4, 3))}, x)
    (advice,) = report.recommendations
    assert advice.startswith("The float32 run is not finite either") and "an input" in advice


def test_an_empty_parameter_is_reported():
    p = {"w": jnp.ones((4, 3)), "empty": jnp.zeros((0,))}
    loss_fn = lambda p, x: jnp.mean(x @ p["w"]) + jnp.sum(p["empty"])  # noqa: E731
    report = mpjax.diagnose(loss_fn, p, jnp.ones((8, 4)))
    empty = [leaf for leaf in report.runs[0].leaves if "empty" in leaf.path]
    assert empty and empty[0].max_abs == 0.0 and empty[0].underflow == 0.0


def _finite_at(loss_fn, params, batch, scale) -> bool:
    grads = jax.grad(lambda p: mpjax.autocast(loss_fn)(p, *batch) * scale)(params)
    return all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def test_the_recommended_scale_is_finite_where_a_loop_hides_the_largest_values():
    # The backward pass of a scan grows its 16-bit carry fourfold per step; those values
    # are not measured one by one, so the recommended scale is checked by running it.
    def loss_fn(p, x):
        h, _ = jax.lax.scan(lambda h, w: (h @ w, None), x, p["ws"])
        return 1e-12 * jnp.sum(h @ p["head"])

    p = {"ws": jnp.full((8, 8, 8), 0.5), "head": jnp.ones((8, 1))}
    x = jnp.full((2, 8), 1e-3)
    for scale in (1.0, 2.0**52):  # raised from a finite run, or lowered from an overflow
        run = mpjax.diagnose(loss_fn, p, x, scale=scale).runs[0]
        assert _finite_at(loss_fn, p, (x,), run.recommended_scale)
        assert not _finite_at(loss_fn, p, (x,), 2 * run.recommended_scale * 2.0**8)
        assert all(leaf.overflow == 0 for leaf in run.leaves_at_recommended)


def test_an_overflow_no_scale_avoids_is_not_called_an_underflow():
    def loss_fn(w, x):
        return jnp.sum(x @ w) * 1e10  # a float16 cotangent of 1e10 times the scale

    w, x = jnp.ones((8, 4)), jnp.ones((4, 8))
    report = mpjax.diagnose(loss_fn, w, x, scale=1.0)
    run = report.runs[0]
    assert run.recommended_scale is None and run.max_gradient == float("inf")
    assert "no loss scale avoids it" in report.recommendations[-1]
    assert not _finite_at(loss_fn, w, (x,), 2.0**-14)


class _Inner(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = jnp.linalg.norm(x) / jnp.linalg.norm(x)  # a jitted call named `norm`
        return nn.Dense(4, use_bias=False)(x * scale) * 3e4  # NAMED


class _Outer(nn.Module):
    name_inner: str

    @nn.compact
    def __call__(self, x):
        return _Inner(name=self.name_inner)(x)


@pytest.mark.parametrize(
    "names, path",
    [
        (("norm", "inner"), "Net/norm/inner"),  # a module named like a jitted function
        (("attention", "attention"), "Net/attention/attention"),  # transformers' ViT
        (("attn(q)", "inner"), "Net/attn(q)/inner"),  # parentheses, as a transform has
    ],
)
def test_a_module_path_is_named_as_flax_names_it(names, path):
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return _Outer(names[1], name=names[0])(x)

    x = jnp.full((2, 4), 20.0)  # times 3e4: beyond float16
    params = Net().init(jax.random.key(0), x)
    report = mpjax.diagnose(lambda p, x: jnp.mean(Net().apply(p, x)) * 1e-6, params, x)
    origin = report.runs[0].forward
    assert origin.module == path and origin.line == _line("NAMED")
    assert {layer.module for layer in report.layers} >= {path}


def test_each_scan_is_searched_until_one_overflows_in_16_bits_only():
    def loss_fn(w, c0, mask):
        def masked(c, _):
            return c, jnp.log(mask)  # -inf where masked, in float32 too

        def masked_again(c, _):
            return c, jnp.log(mask)  # a second loop float32 sees -inf in

        logs = [lax.scan(body, c0, None, length=2)[1] for body in (masked, masked_again)]
        c, _ = lax.scan(lambda c, _: (c @ w, None), c0, None, length=6)  # THIRD_SCAN
        total = sum(jnp.sum(jnp.where(jnp.isfinite(s), s, 0.0)) for s in logs)
        return total + jnp.sum(c) * 1e-6

    mask = jnp.array([1.0, 0.0, 1.0, 1.0])
    report = mpjax.diagnose(loss_fn, 10 * jnp.eye(4), jnp.ones((2, 4)), mask)
    assert report.reference_forward.primitive == "log"
    origin = report.runs[0].forward
    assert (origin.primitive, origin.inside) == ("dot_general", "scan step 4")
    assert origin.line == _line("THIRD_SCAN")


class _Boosted(nn.Module):
    boost: float

    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, use_bias=False)(x) * self.boost  # BOOSTED


def test_a_line_float32_overflows_in_one_layer_is_searched_in_the_others():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            wild = _Boosted(3e38, name="wild")(x)  # inf in float32 too
            tame = _Boosted(3e4, name="tame")(x)  # inf in float16 only
            return jnp.where(jnp.isfinite(wild), wild, 0.0) + tame

    x = jnp.full((2, 4), 20.0)
    params = Net().init(jax.random.key(0), x)
    report = mpjax.diagnose(lambda p, x: jnp.mean(Net().apply(p, x)) * 1e-6, params, x)
    assert report.reference_forward.module == "Net/wild"
    origin = report.runs[0].forward
    assert (origin.module, origin.line) == ("Net/tame", _line("BOOSTED"))


def test_a_lowered_scale_is_checked_for_gradients_it_loses():
    # The cotangent of x @ p["big"] is 1e3 times the scale (beyond float16 at 2**16),
    # that of x @ p["small"] 1e-9 times it: below float16's subnormals at any scale
    # the first allows.
    def loss_fn(p, x):
        return jnp.sum(x @ p["big"]) * 1e3 + jnp.sum(x @ p["small"]) * 1e-9

    p = {"big": jnp.ones((4, 2)), "small": jnp.ones((4, 2))}
    report = mpjax.diagnose(loss_fn, p, jnp.ones((3, 4)))
    run = report.runs[0]
    assert run.backward is not None and run.recommended_scale == 2.0**3
    lost = {leaf.path: leaf.underflow for leaf in run.leaves_at_recommended}
    assert lost == {"['big']": 0.0, "['small']": 1.0}
    assert "Start from init_scale=2**3" in report.recommendations[-2]
    assert "1 parameter(s) underflow at 2**3" in report.recommendations[-1]
    assert "worst `['small']`, 100.0%" in report.recommendations[-1]


class M(nn.Module):  # Dense, then BatchNorm
    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(nn.Dense(16)(x))
        return nn.Dense(3)(nn.relu(x))


def test_the_bias_before_a_normalization_is_not_called_an_underflow():
    # Its gradient is zero in exact arithmetic: rounding noise in float32, which
    # float16 makes zero in some elements, by the seed.
    model, noisy = M(), 0
    for seed in range(6):
        x, y = jax.random.normal(jax.random.key(2 + seed), (8, 8)), jnp.arange(8) % 3
        v = model.init(jax.random.key(3 + seed), x)

        def loss_fn(params, x, y, v=v):
            variables = {"params": params, "batch_stats": v["batch_stats"]}
            logits, _ = model.apply(variables, x, mutable=["batch_stats"])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        report = mpjax.diagnose(loss_fn, v["params"], x, y)
        bias = next(leaf for leaf in report.runs[0].leaves if "Dense_0']['bias" in leaf.path)
        assert bias.reference_max_abs < 1e-6
        noisy += bias.underflow > 0.01
        assert not any("Dense_0" in r for r in report.recommendations)
    assert noisy  # the case arose


@pytest.mark.parametrize(
    "loss_fn, message",
    [
        (jax.grad(lambda p, x: jnp.sum(x @ p["w"])), "not its gradient function"),
        (lambda p, x: {"loss": jnp.sum(x @ p["w"])}, "got a dict"),
        (lambda p, x: jnp.sum(x @ p["w"]).astype(jnp.float16), "returns a float16 loss"),
        (lambda p, x: x @ p["w"], r"float32\[3, 2\]\. Reduce it"),
        (lambda p, x: jnp.sum(x @ p["w"] > 0), r"int32\[\]\. Return a floating-point loss"),
    ],
    ids=["gradient function", "dict of metrics", "float16 loss", "not reduced", "a count"],
)
def test_a_loss_that_is_no_float32_scalar_is_refused_with_the_fix(loss_fn, message):
    with pytest.raises(TypeError, match=message):
        mpjax.diagnose(loss_fn, {"w": jnp.ones((4, 2))}, jnp.ones((3, 4)))


def test_a_linen_layer_passed_as_params_is_refused_with_the_fix():
    # Its `dtype` field is None: not a floating array.
    with pytest.raises(ValueError, match="holds no floating-point arrays"):
        mpjax.diagnose(lambda m, x: jnp.sum(x), nn.Dense(3), jnp.ones((2, 3)))


def test_the_16_bit_values_inside_a_scan_are_measured():
    """Layers in a scan (nn.scan, nnx.scan, lax.scan) get the advice of the same
    layers unrolled: the largest 16-bit backward value was read from the scan's
    outputs alone (0 here), and the report said no scale brings the gradients back."""
    ws = jax.random.normal(jax.random.key(0), (3, 16, 16)) * 0.3
    x = jax.random.normal(jax.random.key(1), (4, 16))

    def scanned(ws, x):
        h, _ = jax.lax.scan(lambda h, w: (jax.nn.relu(h @ w), None), x, ws)
        return jnp.mean(h**2)

    def unrolled(ws, x):
        h = x
        for i in range(3):
            h = jax.nn.relu(h @ ws[i])
        return jnp.mean(h**2)

    got, want = mpjax.diagnose(scanned, ws, x).runs[0], mpjax.diagnose(unrolled, ws, x).runs[0]
    assert got.max_gradient == want.max_gradient > 0
    assert got.recommended_scale == want.recommended_scale is not None


def test_equations_compile_with_options_that_keep_their_values_within_a_few_ulps():
    """A first call is mostly XLA compiling the step's equations one by one: on the CPU
    they compile with `fast_compile_options`, which this jaxlib accepts and which give
    the values of XLA's optimizing build within a few units in the last place."""
    from mpjax import _compat

    options = _compat.fast_compile_options()
    assert options["xla_backend_optimization_level"] == 0  # the suite runs on the CPU
    optimizing = {"xla_backend_optimization_level": 2, "xla_llvm_disable_expensive_passes": False}
    if "xla_cpu_use_fusion_emitters" in options:  # jaxlib 0.10: its default emitters
        optimizing["xla_cpu_use_fusion_emitters"] = True
    x = 3 * jax.random.normal(jax.random.key(0), (64, 256))
    w = jax.random.normal(jax.random.key(1), (256, 32))
    # one primitive each, as the walk compiles them (abs is exact)
    unary = [jnp.tanh, jnp.exp, jnp.log1p, lax.rsqrt, lax.logistic, lax.erf]
    unary += [lambda a: jnp.abs(a) ** 1.7]
    cases = [(f, jnp.float32) for f in unary] + [(lax.dot, jnp.float16), (lax.dot, jnp.bfloat16)]
    for fun, dtype in cases:  # 16-bit elementwise values are float32 ones, rounded
        args = [x.astype(dtype), w.astype(dtype)][: 2 if fun is lax.dot else 1]
        fast = jax.jit(fun, compiler_options=options)(*args)
        full = jax.jit(fun, compiler_options=optimizing)(*args)
        assert fast.dtype == full.dtype == dtype
        tol = 4 * jnp.finfo(dtype).eps
        np.testing.assert_allclose(fast.astype(float), full.astype(float), rtol=tol, atol=1e-30)

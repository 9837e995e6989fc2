"""autocast through loops, branches, remat, custom derivatives and shard_map."""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import mpjax
from mpjax import _compat
from conftest import F16, F32, all_eqns, assert_obeys_policy, rel_tol


def _w(*shape, seed=0):
    return 0.3 * jax.random.normal(jax.random.key(seed), shape)


def _eqns(fun, *args, name=None):
    eqns = list(all_eqns(jax.make_jaxpr(fun)(*args)))
    return eqns if name is None else [e for e in eqns if e.primitive.name == name]


def _check(f, *args, low=F16, reverse=True):
    """Policy on every equation; value and derivative close to float32."""
    g = mpjax.autocast(f, dtype=low)
    assert_obeys_policy(jax.make_jaxpr(g)(*args), low)
    np.testing.assert_allclose(jax.jit(g)(*args), f(*args), rtol=rel_tol(low), atol=1e-3)
    if reverse:
        got, want = jax.jit(jax.grad(g))(*args), jax.grad(f)(*args)
    else:  # while loops: forward mode only
        tangents = tuple(jnp.ones_like(a) for a in args)
        got, want = (
            jax.jit(lambda *a: jax.jvp(g, a, tangents)[1])(*args),
            jax.jvp(f, args, tangents)[1],
        )
    assert got.dtype == want.dtype == F32
    np.testing.assert_allclose(got, want, rtol=4 * rel_tol(low), atol=1e-2)


def test_while_loop(low):
    def f(w, x):
        def body(c):
            i, h = c
            return i + 1, jnp.tanh(h @ w)

        return lax.while_loop(lambda c: c[0] < 4, body, (0, x))[1].sum()

    _check(f, _w(5, 5), _w(3, 5, seed=1), low=low, reverse=False)
    (loop,) = _eqns(mpjax.autocast(f, dtype=low), _w(5, 5), _w(3, 5), name="while")
    body_dots = [
        e for e in all_eqns(loop.params["body_jaxpr"]) if e.primitive.name == "dot_general"
    ]
    assert [_operand_dtypes(e) for e in body_dots] == [{low}]


def _operand_dtypes(eqn):
    return {v.aval.dtype for v in eqn.invars}


def test_fori_loop_with_dynamic_bounds():
    def f(w, x, n):
        return lax.fori_loop(0, n, lambda i, h: jnp.sin(h @ w), x).sum()

    g = mpjax.autocast(f)
    np.testing.assert_allclose(
        jax.jit(g)(_w(4, 4), _w(2, 4), 3), f(_w(4, 4), _w(2, 4), 3), rtol=2e-2
    )


def test_cond_branches_agree_on_dtypes(low):
    def f(w, x, flag):
        return lax.cond(flag, lambda: (x @ w).sum(), lambda: jnp.exp(x).sum() + w.sum())

    w, x = _w(4, 3), _w(2, 4, seed=1)
    for flag in (True, False):
        _check(lambda w: f(w, x, flag), w, low=low)
    (cond,) = _eqns(mpjax.autocast(f, dtype=low), w, x, True, name="cond")
    assert cond.outvars[0].aval.dtype == F32


def test_switch_with_low_precision_outputs_is_joined():
    def f(x, i):
        return lax.switch(i, [lambda x: x @ x, lambda x: jnp.exp(x), lambda x: x], x)

    x = _w(3, 3)
    for i in range(3):
        np.testing.assert_allclose(jax.jit(mpjax.autocast(f))(x, i), f(x, i), rtol=2e-2, atol=1e-3)
    (cond,) = _eqns(mpjax.autocast(f), x, 0, name="cond")
    assert cond.outvars[0].aval.dtype == F32  # f16 @ vs f32 exp vs f32 identity


def test_rnn_carry_started_from_zeros_stays_low_precision():
    def f(wx, wh, xs):
        def step(h, x):
            h = jnp.tanh(x @ wx + h @ wh)
            return h, None

        return lax.scan(step, jnp.zeros(wh.shape[0]), xs)[0].sum()

    args = _w(3, 6), _w(6, 6, seed=1), _w(5, 3, seed=2)
    _check(f, *args)
    (scan,) = _eqns(mpjax.autocast(f), *args, name="scan")
    carry = scan.outvars[0].aval
    assert carry.dtype == F16


def test_float32_carry_keeps_its_precision():
    # A strong float32 accumulator is never narrowed: the sum stays exact.
    def f(w, xs):
        return lax.scan(lambda acc, x: (acc + (x @ w).sum(), None), jnp.float32(0) + w[0, 0], xs)[0]

    (scan,) = _eqns(mpjax.autocast(f), _w(3, 3), _w(4, 3), name="scan")
    assert scan.outvars[0].aval.dtype == F32


def test_a_constant_initial_carry_the_low_dtype_cannot_hold_keeps_its_value():
    # A carry started from a constant takes the body's 16-bit dtype where that holds
    # the constant (zeros); 1e5 in float16 would saturate to 65504, every step after
    # it off by a third.
    w = jnp.array([[0.5, 0.0], [0.0, 0.25]])

    def f(w):
        return lax.scan(lambda c, _: ((c * 1e-3) @ w, c), jnp.full((2,), 1e5), None, length=2)

    (last, seen), (want_last, want_seen) = jax.jit(mpjax.autocast(f, dtype=F16))(w), f(w)
    np.testing.assert_array_equal(seen[0], want_seen[0])  # the initial carry, as written
    np.testing.assert_allclose(seen[1], want_seen[1], rtol=rel_tol(F16))
    np.testing.assert_allclose(last, want_last, rtol=rel_tol(F16))


@pytest.mark.parametrize("make", ["cond", "scan"])
def test_a_jitted_loop_called_on_two_closed_over_weights_solves_each(make):
    # A jitted function's loop or cond is solved once per kind of input; a weight
    # closed over by the caller is known by its values, which decide whether its
    # product runs in 16 bits (0.5) or as written (1e5, inf in float16).
    h = jnp.array([1.0, 2.0])
    half, big = jnp.full((2, 2), 0.5), jnp.full((2, 2), 1e5)

    @jax.jit
    def g(w, h):
        if make == "cond":
            return lax.cond(h[0] > 0, lambda: h @ w, lambda: (h @ w) * 2.0)
        return lax.scan(lambda c, x: (x @ w, c), jnp.zeros((2,)), h[None])[0]

    both = lambda h: (g(half, h), g(big, h))  # noqa: E731
    got, want = mpjax.autocast(both, dtype=F16)(h), both(h)
    np.testing.assert_allclose(got[0], want[0], rtol=rel_tol(F16))
    np.testing.assert_array_equal(got[1], want[1])


def _braced(text, i):
    """From `i`, the text up to the brace matching the first "{", and chained "do {"."""
    depth, j = 0, text.index("{", i)
    while True:
        closing = text[j] == "}"
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
        if closing and depth == 0 and not text[j:].lstrip().startswith("do"):
            return text[i:j]


def _while_regions(text):
    """The text each stablehlo.while runs per iteration, called functions included."""
    functions = {
        m.group(1): _braced(text, m.start())
        for m in re.finditer(r"func\.func \w+ @([\w.$-]+)\(", text)
    }
    regions = []
    for m in re.finditer(r"stablehlo\.while", text):
        region, seen = _braced(text, m.start()), set()
        todo = re.findall(r"call @([\w.$-]+)", region)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                region += functions[name]
                todo += re.findall(r"call @([\w.$-]+)", functions[name])
        regions.append(region)
    return regions


@pytest.mark.parametrize("kind", ["const", "stacked"])
def test_scanned_weight_is_cast_once_outside_the_loop(kind):
    """The counterpart of torch's cast cache: no per-iteration weight converts."""
    w = _w(7, 7) if kind == "const" else _w(5, 7, 7)

    def f(w, x):
        if kind == "const":
            return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=5)[0].sum()
        return lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    x = _w(2, 7, seed=1)
    text = jax.jit(mpjax.autocast(f)).lower(w, x).as_text()
    weight = r"tensor<(5x)?7x7xf32>\) -> tensor<(5x)?7x7xf16>"
    converts = re.findall(r"stablehlo.convert .*", text)
    assert sum(bool(re.search(weight, c)) for c in converts) == 1, converts
    loops = _while_regions(text)
    assert loops and not any(
        re.search(r"convert .*7x7xf32>\) -> tensor<7x7xf16>", r) for r in loops
    )
    # Under grad as well: the backward loop reuses the cast weight. What it does
    # convert is the float32 result of the weight-gradient product, not the weight.
    text = jax.jit(jax.grad(mpjax.autocast(f))).lower(w, x).as_text()
    for region in _while_regions(text):
        for operand in re.findall(
            r"stablehlo.convert (%[\w#]+) : \(tensor<7x7xf32>\) -> tensor<7x7xf16>", region
        ):
            (definition,) = re.findall(re.escape(operand) + r" = (\S+)", region)
            assert definition in ("stablehlo.dot_general", "stablehlo.transpose"), definition


def test_weight_used_twice_is_cast_once():
    def f(w, x):
        return jnp.sum((x @ w) @ w) + jnp.sum(jax.jit(lambda a: a @ w)(x))

    converts = [
        e
        for e in _eqns(mpjax.autocast(f), _w(4, 4), _w(2, 4), name="convert_element_type")
        if e.invars[0].aval.shape == (4, 4)
    ]
    assert len(converts) == 1


def test_checkpoint_keeps_policy_and_is_autocast(low):
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def f(w, x):
        return jax.checkpoint(lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2), policy=policy)(w, x)

    _check(lambda w: f(w, _w(3, 4, seed=1)), _w(4, 4), low=low)
    (remat,) = _eqns(mpjax.autocast(f, dtype=low), _w(4, 4), _w(3, 4), name="remat2")
    assert remat.params["policy"] is policy
    dots = [e for e in all_eqns(remat.params["jaxpr"]) if e.primitive.name == "dot_general"]
    assert dots and all(_operand_dtypes(e) == {low} for e in dots)


def _blocks(w, x, remat=True):
    h = x
    for i in range(w.shape[0]):
        block = lambda h, w: h + jnp.tanh(jnp.sin(h @ w) * 2.0)  # noqa: E731
        policy = jax.checkpoint_policies.nothing_saveable
        h = (jax.checkpoint(block, policy=policy) if remat else block)(h, w[i])
    return jnp.mean(h**2)


def test_a_checkpoint_in_a_gradient_under_autocast_still_drops_activations(low):
    # autocast(jax.grad(f)) re-binds the backward pass's checkpoints: they stay
    # marked as differentiated, without which XLA merges each recomputation into
    # the forward pass and keeps every activation, as if there were no checkpoint.
    w = 0.04 * jax.random.normal(jax.random.key(1), (6, 256, 256))
    x = jax.random.normal(jax.random.key(0), (256, 256))
    marks = lambda f: {  # noqa: E731
        (e.params["differentiated"], e.params["prevent_cse"])
        for e in jax.make_jaxpr(f)(w, x).eqns if e.primitive.name == "remat2"
    }
    remat = mpjax.autocast(jax.grad(_blocks), dtype=low)
    assert marks(remat) == marks(jax.grad(_blocks)) == {(True, True)}
    temp = lambda f: jax.jit(f).lower(w, x).compile().memory_analysis().temp_size_in_bytes  # noqa: E731
    plain = mpjax.autocast(jax.grad(functools.partial(_blocks, remat=False)), dtype=low)
    assert temp(remat) < 0.9 * temp(plain), (temp(remat), temp(plain))
    np.testing.assert_array_equal(remat(w, x), plain(w, x))


_ACTIVATIONS = {
    "leaky": lambda u: jnp.where(u > 0, u, 0.01 * u),
    "softplus": jax.nn.softplus,
    "gelu": jax.nn.gelu,
    "square": lambda u: u * u,
    "scaled": lambda u: u * jnp.float32(3.0),
}


@pytest.mark.parametrize("policy", ["torch", "lean"])
@pytest.mark.parametrize("act", list(_ACTIVATIONS))
def test_a_named_activation_is_the_one_activation_a_checkpoint_keeps(act, policy, low):
    # save_only_these_names keeps the named product and recomputes the rest: the
    # checkpoints autocast makes of its own (to keep 16-bit values, not float32
    # copies) would make JAX keep their inputs too, inside the user's. The float32
    # values they widen are still recomputed: the user's policy decides for them.
    names = jax.checkpoint_policies.save_only_these_names("up")
    x, w1, w2 = _w(16, 32), 0.2 * _w(32, 64, seed=1), 0.2 * _w(64, 32, seed=2)

    def layer(x, w1, w2, remat=True):
        def body(h, w1, w2):
            u = checkpoint_name(h @ w1, "up")
            return h + _ACTIVATIONS[act](u) @ w2

        body = jax.checkpoint(body, policy=names) if remat else body
        h, _ = lax.scan(lambda h, _: (body(h, w1, w2), None), x, None, length=3)
        return jnp.sum(h**2)

    f = mpjax.autocast(layer, dtype=low, policy=policy)
    kept = jax.tree.leaves(jax.eval_shape(lambda *a: jax.vjp(f, *a)[1], x, w1, w2))
    activations = [(r.dtype, r.shape) for r in kept if r.shape[-2:] == (16, 64)]
    assert activations == [(low, (3, 16, 64))], activations
    for g, ref in zip(jax.grad(f, (1, 2))(x, w1, w2), jax.grad(layer, (1, 2))(x, w1, w2)):
        assert jnp.max(jnp.abs(g - ref)) <= rel_tol(low) * jnp.max(jnp.abs(ref))


@pytest.mark.parametrize(
    "act",
    [jax.nn.relu, jax.nn.softplus, jax.nn.silu, jax.nn.gelu],
    ids=["relu", "softplus", "silu", "gelu"],
)
def test_library_custom_jvp_activations(act, low):
    _check(lambda w, x=_w(3, 4, seed=1): jnp.sum(act(x @ w)), _w(4, 4), low=low)


def test_relu_stays_in_low_precision():
    jaxpr = jax.make_jaxpr(mpjax.autocast(lambda w: jax.nn.relu(w @ w)))(_w(3, 3))
    (cj,) = [
        e
        for e in all_eqns(jaxpr)
        if e.primitive.name == "custom_jvp_call"
        and not _compat.called_name(e).startswith("mpjax_")  # not the product
    ]
    assert cj.outvars[0].aval.dtype == F16


def test_user_custom_jvp_rule_is_kept_and_autocast():
    @jax.custom_jvp
    def clipped_exp(x):
        return jnp.exp(jnp.minimum(x, 5.0))

    @clipped_exp.defjvp
    def clipped_exp_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        y = clipped_exp(x)
        return y, 0.5 * y * t  # deliberately not the true derivative: must be kept

    def f(w, x):
        return jnp.sum(clipped_exp(x @ w))

    w, x = _w(4, 4), _w(2, 4, seed=1)
    got = jax.grad(mpjax.autocast(f))(w, x)
    want = jax.grad(f)(w, x)
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=1e-3)
    assert got.dtype == F32
    # The rule's own equations follow the policy (its exp runs in float32).
    jaxpr = jax.make_jaxpr(jax.grad(mpjax.autocast(f)))(w, x)
    assert all(e.outvars[0].aval.dtype == F32 for e in all_eqns(jaxpr) if e.primitive.name == "exp")


def test_a_custom_jvp_rule_asking_for_symbolic_zeros_gets_them(low):
    # A rule defined with symbolic_zeros=True may refuse a tangent it has no
    # derivative for: it is told which tangents are zero, as JAX tells it.
    @jax.custom_jvp
    def scaled(a, b):
        return a * jnp.sin(b)

    def scaled_jvp(primals, tangents):
        (a, b), (ta, tb) = primals, tangents
        if not isinstance(tb, jax.custom_derivatives.SymbolicZero):
            raise NotImplementedError("no derivative with respect to b")
        return scaled(a, b), ta * jnp.sin(b)

    scaled.defjvp(scaled_jvp, symbolic_zeros=True)
    f = lambda w, x: jnp.sum(scaled(x @ w, jnp.ones(4)) ** 2)  # noqa: E731
    w, x = _w(4, 4), _w(2, 4, seed=1)
    for grad in (jax.grad(mpjax.autocast(f, dtype=low)), jax.jit(jax.grad(mpjax.autocast(f)))):
        np.testing.assert_allclose(grad(w, x), jax.grad(f)(w, x), rtol=rel_tol(low), atol=1e-3)
    tangent = jax.jvp(mpjax.autocast(f, dtype=low), (w, x), (w, jnp.zeros_like(x)))[1]
    np.testing.assert_allclose(tangent, jax.jvp(f, (w, x), (w, jnp.zeros_like(x)))[1], rtol=rel_tol(low))


def test_custom_vjp_runs_as_written():
    @jax.custom_vjp
    def scaled_identity(x):
        return x

    scaled_identity.defvjp(lambda x: (x, None), lambda _, g: (3.0 * g,))

    def f(w, x):
        return jnp.sum(scaled_identity(x @ w) * x[:, :1])

    w, x = _w(4, 4), _w(2, 4, seed=1)
    (call,) = _eqns(mpjax.autocast(f), w, x, name="custom_vjp_call")
    # Its inputs are cast back to the dtype it was traced with, so its rule is exact.
    assert call.invars[0].aval.dtype == F32
    got = jax.grad(mpjax.autocast(f))(w, x)
    np.testing.assert_allclose(got, jax.grad(f)(w, x), rtol=2e-2, atol=1e-3)
    assert got.dtype == F32


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_custom_vjp_rule_gets_a_constant_argument_as_an_array(jit):
    # A small constant is inlined into the trace; the rules see it as the user made
    # it, a JAX array they index with `.at` or with a traced loop index.
    @jax.custom_vjp
    def weighted(x, c):
        return x * c[0]

    def bwd(c, g):
        summed = lax.fori_loop(0, 2, lambda i, a: a + g * c[i], jnp.zeros_like(g))
        return summed * c.at[0].set(5.0)[0], jnp.zeros_like(c)

    weighted.defvjp(lambda x, c: (weighted(x, c), c), bwd)

    def f(x):
        return jnp.sum(weighted(x, jnp.array([2.0, 3.0])))

    grad = jax.jit(jax.grad(mpjax.autocast(f))) if jit else jax.grad(mpjax.autocast(f))
    chex.assert_trees_all_equal(grad(jnp.ones(3)), jax.grad(f)(jnp.ones(3)))


def test_unknown_primitive_runs_at_its_original_dtypes():
    def f(w, x):
        a = x @ w
        chol = jnp.linalg.cholesky(a @ a.T + 4 * jnp.eye(a.shape[0]))
        return jnp.sum(chol)

    w, x = _w(4, 4), _w(3, 4, seed=1)
    (chol,) = _eqns(mpjax.autocast(f), w, x, name="cholesky")
    assert chol.invars[0].aval.dtype == F32
    np.testing.assert_allclose(mpjax.autocast(f)(w, x), f(w, x), rtol=2e-2)


def test_pure_callback_sees_its_traced_dtype():
    seen = []

    def host(x):
        seen.append(x.dtype)
        return np.asarray(x) * 2

    def f(w, x):
        h = x @ w
        return jax.pure_callback(host, jax.ShapeDtypeStruct(h.shape, h.dtype), h).sum()

    jax.jit(mpjax.autocast(f))(_w(3, 3), _w(2, 3))
    assert seen == [F32]


def test_scatter_add_in_low_precision_compiles():
    def f(w, x, idx):
        h = x @ w
        return jnp.zeros_like(h).at[idx].add(h).sum()

    w, x = _w(3, 3), _w(4, 3, seed=1)
    idx = jnp.array([0, 0, 2, 3])
    (scatter,) = _eqns(mpjax.autocast(f), w, x, idx, name="scatter-add")
    # It accumulates float16 values in float32 (see tests/test_float32_sums.py).
    assert [v.aval.dtype for v in scatter.invars if v.aval.dtype != jnp.int32] == [F32, F32]
    assert scatter.outvars[0].aval.dtype == F32
    np.testing.assert_allclose(jax.jit(mpjax.autocast(f))(w, x, idx), f(w, x, idx), rtol=2e-2)


def test_shard_map_inside_autocast():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))

    def f(w, x):
        def local(w, x):
            return lax.psum(jnp.sum(jnp.tanh(x @ w)), "d")

        return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())(w, x)

    w, x = _w(4, 4), _w(2, 4, seed=1)
    (sm,) = _eqns(mpjax.autocast(f), w, x, name="shard_map")
    dots = [e for e in all_eqns(sm.params["jaxpr"]) if e.primitive.name == "dot_general"]
    assert [_operand_dtypes(e) for e in dots] == [{F16}]
    np.testing.assert_allclose(jax.jit(mpjax.autocast(f))(w, x), f(w, x), rtol=2e-2)
    np.testing.assert_allclose(
        jax.grad(mpjax.autocast(f))(w, x), jax.grad(f)(w, x), rtol=5e-2, atol=1e-3
    )


def test_autocast_inside_shard_map():
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("d",))
    body = mpjax.autocast(lambda w, x: lax.psum(jnp.sum(jnp.tanh(x @ w)), "d"))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d")), out_specs=P())
    w, x = _w(4, 4), _w(2, 4, seed=1)
    dots = _eqns(f, w, x, name="dot_general")
    assert [_operand_dtypes(e) for e in dots] == [{F16}]
    np.testing.assert_allclose(jax.jit(f)(w, x), jnp.sum(jnp.tanh(x @ w)), rtol=2e-2)


def test_scan_and_map_over_zero_steps():
    # An empty sequence or batch: plain JAX returns the initial carry and empty ys.
    def f(w, ws, xs):
        carry, ys = lax.scan(lambda c, x: (c + jnp.tanh(x @ w), x @ w), jnp.zeros(3), xs)
        stacked = lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), jnp.ones(3), ws)[0]
        return carry.sum() + stacked.sum() + ys.sum() + lax.map(lambda r: r @ w, xs).sum()

    args = (_w(4, 3), _w(0, 3, 3), _w(0, 4))
    for fun in (f, jax.grad(f, (0, 1, 2))):
        got, want = jax.jit(mpjax.autocast(fun))(*args), fun(*args)
        chex.assert_trees_all_equal(got, want)
        chex.assert_trees_all_equal_shapes_and_dtypes(got, want)


def test_checkpoint_name_keeps_the_named_value_16_bit():
    # A remat policy saving a named activation keeps it as the policy computed it.
    from jax.ad_checkpoint import checkpoint_name

    def f(w, x):
        h = checkpoint_name(jnp.sin(x @ w), "h")
        return jnp.sum((h @ w) ** 2)

    w, x = _w(16, 16), _w(8, 16, seed=1)
    (name,) = _eqns(mpjax.autocast(f), w, x, name="name")
    assert name.invars[0].aval.dtype == name.outvars[0].aval.dtype == F16
    policy = jax.checkpoint_policies.save_only_these_names("h")
    remat = mpjax.autocast(jax.checkpoint(f, policy=policy))
    vjp = jax.make_jaxpr(lambda w, x: jax.vjp(remat, w, x)[1])(w, x).jaxpr
    saved = [v.aval for v in vjp.outvars if v not in vjp.invars and v.aval.shape == (8, 16)]
    assert [a.dtype for a in saved] == [F16]  # `h`, saved as computed
    np.testing.assert_allclose(jax.grad(remat)(w, x), jax.grad(f)(w, x), rtol=5e-2, atol=1e-2)


@pytest.mark.parametrize(
    "outside", [False, True], ids=["autocast(checkpoint)", "checkpoint(autocast)"]
)
def test_a_checkpoint_policy_saves_the_products_it_names(outside, low):
    # dots_saveable keeps the products, x @ w with a parameter included: the
    # backward pass recomputes none of them, as without autocast.
    def layer(w, x):
        h = jnp.tanh(x @ w)
        return jnp.sum(jnp.sin(jnp.tanh(h @ h.T) @ h) ** 2)

    def products(policy, wrap):
        f = jax.checkpoint(layer, policy=policy)
        f = jax.checkpoint(wrap(layer), policy=policy) if outside else wrap(f)
        grad = jax.make_jaxpr(jax.grad(f))(_w(4, 4), _w(3, 4, seed=1))
        return sum(e.primitive.name == "dot_general" for e in all_eqns(grad))

    autocast = functools.partial(mpjax.autocast, dtype=low)
    for wrap in (lambda f: f, autocast):
        saved = products(jax.checkpoint_policies.dots_saveable, wrap)
        recomputed = products(jax.checkpoint_policies.nothing_saveable, wrap)
        assert recomputed - saved == 3, (wrap, saved, recomputed)


def test_a_loop_with_a_trip_count_per_example_under_vmap(low):
    # vmap makes the while's predicate an array: each example stops on its own.
    def f(w, c, n):
        return lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w) * 1.5, c)

    batched = jax.vmap(f, in_axes=(None, None, 0))
    w, c = _w(4, 4), _w(3, 4, seed=1)
    n = jnp.array([0, 1, 3, 5])
    got = mpjax.autocast(batched, dtype=low)(w, c, n)
    assert got.dtype == F32
    np.testing.assert_allclose(got, batched(w, c, n), rtol=rel_tol(low), atol=rel_tol(low))
    np.testing.assert_array_equal(got[0], c)  # no step taken


def test_a_nested_jits_shardings_are_kept():
    from jax.sharding import AxisType, NamedSharding

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
    rows = NamedSharding(mesh, P("x", None))
    layer = jax.jit(lambda a, w: jnp.tanh(a @ w), in_shardings=(rows, None), out_shardings=rows)

    def f(w, x):
        return layer(x, w) * 2

    w, x = _w(4, 4), _w(8, 4, seed=1)
    got = jax.jit(mpjax.autocast(f))(w, x)
    assert got.sharding.is_equivalent_to(rows, 2)
    program = jax.make_jaxpr(mpjax.autocast(f))(w, x)
    constraints = [e for e in all_eqns(program) if e.primitive.name == "sharding_constraint"]
    assert len(constraints) == 2  # the argument and the result


def test_a_nested_jit_with_shardings_on_an_explicit_mesh_runs_as_without_autocast():
    from jax.sharding import AxisType, NamedSharding

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,))
    layer = jax.jit(lambda a, w: jnp.tanh(a @ w), out_shardings=NamedSharding(mesh, P(None, "x")))

    def f(w, a):
        return layer(a, w) * 2

    with jax.set_mesh(mesh):
        a = jax.device_put(_w(8, 4, seed=1), P("x", None))
        want, got = jax.jit(f)(_w(4, 4), a), jax.jit(mpjax.autocast(f))(_w(4, 4), a)
    assert got.sharding.is_equivalent_to(want.sharding, 2)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)


def _dense(w, h):
    return h @ w


@jax.custom_jvp
def _custom_dense(w, h):
    return h @ w


_custom_dense.defjvp(lambda p, t: (_custom_dense(*p), t[1] @ p[0] + p[1] @ t[0]))


def _normalized_dense(w, x, dense):
    return jnp.sum(dense(w, jax.nn.standardize(x, axis=-1)).astype(F32))


@pytest.mark.parametrize(
    "call",
    [
        jax.jit(_dense),
        lambda w, h: lax.cond(h[0, 0] > -1e9, _dense, lambda w, h: 2 * _dense(w, h), w, h),
        _custom_dense,
    ],
    ids=["jit", "cond", "custom_jvp"],
)
def test_an_activation_passed_to_a_nested_call_is_kept_as_its_16_bit_cast(call, low):
    # A normalized activation is float32; the product reads its 16-bit cast, which
    # is what the backward pass keeps, not the float32 activation (a weight, alive
    # anyway, is cast again). Inside the call, the activation is no parameter either.
    w, x = _w(64, 64), _w(32, 64, seed=1)

    def kept(dense):
        f = mpjax.autocast(functools.partial(_normalized_dense, dense=dense), dtype=low)
        _, vjp = jax.vjp(f, w, x)
        return sorted(str(r.dtype) for r in jax.tree.leaves(vjp) if np.shape(r) == x.shape)

    assert kept(call) == kept(_dense) == sorted([str(jnp.dtype(low)), "float32", "float32"])


def test_a_nested_jit_differentiates_as_its_body_inlined(low):
    w, x = _w(64, 64), _w(32, 64, seed=1)
    inlined, nested = (
        jax.grad(mpjax.autocast(functools.partial(_normalized_dense, dense=d), dtype=low), (0, 1))
        for d in (_dense, jax.jit(_dense))
    )
    chex.assert_trees_all_equal(nested(w, x), inlined(w, x))


def test_a_constant_branch_of_cond_widens_nothing_it_fits_in(low):
    # As jnp.where's constant: an RNN state reset to zeros with lax.cond stays 16-bit.
    w, x = _w(4, 4), _w(3, 4, seed=1)

    def reset(fill):
        return lambda w, x, p: lax.cond(p, lambda: jnp.tanh(x @ w), lambda: jnp.full((3, 4), fill))

    def out_dtype(fill):
        program = jax.make_jaxpr(mpjax.autocast(reset(fill), dtype=low))(w, x, True)
        (cond,) = [e for e in program.jaxpr.eqns if e.primitive.name == "cond"]
        return cond.outvars[0].aval.dtype

    assert out_dtype(0.0) == low
    # A fill the low dtype cannot hold widens it, as it does jnp.where.
    assert out_dtype(1e9) == (F32 if low == F16 else low)
    for p in (True, False):
        got = mpjax.autocast(reset(0.0), dtype=low)(w, x, p)
        want = reset(0.0)(w, x, p)
        np.testing.assert_allclose(got, want, rtol=rel_tol(low), atol=rel_tol(low))


def test_a_scan_over_an_axis_of_symbolic_size_exports():
    # jax.export with a polymorphic batch: the scan's length is the symbol, no int.
    (b,) = jax.export.symbolic_shape("b")
    w = 0.2 * jax.random.normal(jax.random.key(0), (32, 32))
    x = jax.random.normal(jax.random.key(1), (6, 32))

    def rnn(w, xs):
        step = lambda c, xi: (jnp.tanh(c @ w + xi), c.sum())  # noqa: E731
        return lax.scan(step, jnp.zeros(32), xs)[1]

    specs = (jax.ShapeDtypeStruct((32, 32), F32), jax.ShapeDtypeStruct((b, 32), F32))
    exported = jax.export.export(jax.jit(mpjax.autocast(rnn)))(*specs)
    got = exported.call(w, x)
    chex.assert_shape(got, (6,))
    np.testing.assert_allclose(got, rnn(w, x), rtol=2e-2, atol=2e-2)

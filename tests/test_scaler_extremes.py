"""The scaler at the edges: thousands of parameter leaves, and scales at both ends
of the float32 range.

* Compile cost must grow linearly with the number of leaves. The global finite
  flag is read by a select on every leaf; combined carelessly (a chain of ``and``s),
  XLA copies it into every fusion that reads it and the compiled program grows
  with the square of the leaf count (minutes to compile a 100-leaf model). The
  test reads the size of the compiled program rather than a time.
* Unscaling (in `scaled_value_and_grad`) must be exact over the whole float32
  range of scales: above 2**126 a single float32 reciprocal of the scale is
  subnormal, which backends flush to zero, and the step would silently apply zero
  updates.
"""

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import all_eqns, compiled_kernels, kernels_of

import mpjax
from mpjax import _finite, _one_kernel, _skip
from mpjax.gradients import unscale


BARE, SCALED = None, ()
"""Bare adam; adam wrapped by the default scaler (its keyword arguments: none)."""
ACCUMULATING = (("accumulation_steps", 4), ("accumulation", "mean"))


@functools.cache
def _compiled(scaler: tuple | None, n_leaves: int, shape=(4, 3)) -> str:
    """The compiled update's text of adam on n leaves of `shape`, bare (`scaler`
    None) or wrapped by ``grad_scaler(adam, **dict(scaler))``. Cached: the tests
    below read the same few programs, each seconds to compile."""
    tx = optax.adam(1e-3)
    tx = tx if scaler is None else mpjax.grad_scaler(tx, **dict(scaler))
    params = {f"p{i:04d}": jnp.ones(shape, jnp.float32) for i in range(n_leaves)}
    return jax.jit(tx.update).lower(params, tx.init(params), params).compile().as_text()


def _compiled_size(scaler: tuple | None, n_leaves: int, shape=(4, 3)) -> int:
    return _compiled(scaler, n_leaves, shape).count("\n")


def test_compiled_update_grows_linearly_with_the_number_of_leaves():
    # At 200 leaves the quadratic program was over 100 times bare adam's size
    # (and took minutes to compile); a linear one stays a small multiple.
    # The selects fold into adam's own passes and no moment is computed twice:
    # the whole update is a quarter larger than bare adam's (2x before inner's
    # state was selected where it is computed).
    bare = _compiled_size(BARE, 200)
    scaled = _compiled_size(SCALED, 200)
    assert scaled <= 1.4 * bare, (scaled, bare)
    # ... and the per-leaf cost does not depend on how many leaves there are.
    small = _compiled_size(SCALED, 50)
    assert scaled <= 4.5 * small, (scaled, small)


@pytest.mark.parametrize(
    "scaler, most",
    [(SCALED, 2.0), (ACCUMULATING, 3.5)],
    ids=["step", "accumulating"],
)
def test_compiled_update_grows_linearly_with_large_leaves_too(scaler, most):
    # Large leaves are checked each by a reduction, whose flags are combined by
    # a float32 max: over booleans or integers XLA would make it a chain of
    # scalar ops copied into every select (the quadratic program, 36x bare adam
    # when accumulating over 200 leaves, so about half that over the 100 here).
    shape = (_finite.LARGE,)
    bare = _compiled_size(BARE, 100, shape)
    scaled = _compiled_size(scaler, 100, shape)
    assert scaled <= most * bare, (scaled, bare)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_check_of_a_large_leaf_is_one_kernel(dtype):
    # The leaves of a model come in many shapes, and XLA compiles a kernel for each
    # shape: a pass writing the leaf's flags and a reduction of them was two per
    # shape, and the pass costs XLA:CPU more compile time than the reduction.
    def kernels(n):
        leaves = [jnp.ones((_finite.LARGE + i,), dtype) for i in range(n)]
        return compiled_kernels(lambda xs: _finite.leaf_flags(xs)[0::2], leaves)

    assert kernels(8) - kernels(4) == 4


def test_the_check_of_an_autocast_weight_gradient_is_one_kernel(low):
    # A weight's gradient under autocast is a product laid out as the weight, of the
    # activation and the cotangent. Written as JAX's own transpose rule writes it,
    # the cotangent's product transposed, XLA:CPU split the check's reduction of it
    # into a tree of reduce-windows: three kernels instead of one.
    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w1"]) @ p["w2"])

    params = {"w1": jnp.full((64, 256), 0.01), "w2": jnp.full((256, 64), 0.01)}
    x = jnp.ones((8, 64))
    grad = jax.grad(mpjax.autocast(loss, dtype=low))
    assert all(jnp.size(w) >= _finite.LARGE for w in params.values())  # checked alone
    eqns = [e.primitive.name for e in all_eqns(jax.make_jaxpr(grad)(params, x))]
    assert "transpose" not in eqns, eqns
    tx = mpjax.grad_scaler(optax.adam(1e-3))
    step = jax.jit(lambda p, s, x: tx.update(grad(p, x), s, p))
    assert "reduce-window(" not in step.lower(params, tx.init(params), x).compile().as_text()


def _kernels(scaler: tuple | None, n_leaves: int) -> int:
    """The instructions of the compiled update's entry computation that run as
    kernels (fusions, copies, unfused ops), for n leaves of 12 parameters."""
    return kernels_of(_compiled(scaler, n_leaves))


@pytest.mark.parametrize(
    "scaler, per_leaf, fixed",
    [
        # nothing per leaf: the gradients are checked by one reduction per leaf
        # size, and inner's state is selected where adam computes it, so XLA
        # folds the selects into adam's own passes; a few scalar kernels (the
        # check, the scale, the tracker, the counts)
        (SCALED, 0, 10),
        # the selects of updates, mu and nu and the update's own pass again, which
        # can only run once the updates (and the moments) are checked
        ((("check_updates", True),), 4, 20),
        # the accumulator's add and its reset
        (ACCUMULATING, 2, 15),
    ],
    ids=["step", "updates checked too", "accumulating"],
)
def test_scaler_adds_a_few_kernels_per_leaf(scaler, per_leaf, fixed):
    # Compile time follows the number of kernels; the scaler's own must be a
    # small constant per leaf, the same at 50 leaves as at 200.
    bare = {n: _kernels(BARE, n) for n in (50, 200)}
    scaled = {n: _kernels(scaler, n) for n in (50, 200)}
    for n in (50, 200):
        assert scaled[n] - bare[n] <= per_leaf * n + fixed, (n, scaled[n], bare[n])
    growth = (scaled[200] - scaled[50]) - (bare[200] - bare[50])
    # + 1: XLA:GPU splits the finite check of 200 leaves into two horizontal fusions;
    # + 2 more: the 400 moments checked with the updates stack in two chunks
    assert growth <= per_leaf * 150 + 3, (growth, scaled, bare)


def _writers_of_scalar_outputs(text: str) -> set:
    """The instructions that write the compiled program's scalar outputs: for an
    output taken from a multi-output kernel, that kernel."""
    entry = text[text.index("\nENTRY") :]
    defined = dict(re.findall(r"\n\s*(?:ROOT )?%(\S+) = (.*)", entry))
    root = re.search(r"\n\s*ROOT %\S+ = .* tuple\((.*)\)", entry).group(1)
    writers = set()
    for name in re.findall(r"%([\w.\-]+)", root):
        rhs = defined[name]
        if re.match(r"[a-z]\w*\[\] ", rhs):  # a scalar output
            source = re.match(r"\S+ get-tuple-element\(%([\w.\-]+)\)", rhs)
            writers.add(source.group(1) if source else name)
    return writers


@pytest.mark.parametrize(
    "scaler", [SCALED, ACCUMULATING, (("check_updates", True),)], ids=["step", "acc", "upd"]
)
def test_the_states_scalars_are_written_by_one_kernel_on_a_cpu(scaler):
    # XLA:CPU compiles a kernel for each scalar output, which costs as much
    # compile time as a pass over a large leaf: the scaler's own scalars (the
    # scale, the tracker, the counts) and adam's count come out of one.
    text = _compiled(scaler, 10)
    assert len(_writers_of_scalar_outputs(text)) == 1, _writers_of_scalar_outputs(text)
    assert len(_writers_of_scalar_outputs(_compiled(BARE, 10))) == 1  # adam's count


def test_scalars_written_together_are_the_values_bit_for_bit(monkeypatch):
    monkeypatch.setattr(_finite, "backend", lambda: "cpu")
    values = [
        *np.array([np.nan, -0.0, -np.inf, np.inf, -3.4e38], np.float32),
        np.float16(-65504.0),
        jnp.bfloat16(-0.0),
        *np.array([np.iinfo(np.int32).min, -1, np.iinfo(np.int32).max], np.int32),
        np.uint8(0),
        np.int8(-128),
        np.bool_(False),
        np.bool_(True),
        jnp.float8_e4m3fn(-448.0),  # no infinity: left as it is
        jnp.float8_e4m3fn(3.0),
    ]

    def bits(xs):
        return [np.asarray(x).tobytes() for x in xs]

    written = jax.jit(lambda *xs: _one_kernel.together(list(xs)))(*values)
    assert bits(written) == bits(values)
    assert [jnp.result_type(x) for x in written] == [jnp.result_type(x) for x in values]
    batched = [jnp.stack([x, x]) for x in values]
    written = jax.vmap(lambda *xs: _one_kernel.together(list(xs)))(*batched)
    assert bits(written) == bits(batched)


def test_accumulating_update_grows_linearly_with_the_number_of_leaves():
    bare = _compiled_size(BARE, 200)
    scaled = _compiled_size(ACCUMULATING, 200)
    assert scaled <= 3 * bare, (scaled, bare)


def _unscaled(scale: float, true_grads: np.ndarray) -> np.ndarray:
    """What `scaled_value_and_grad` returns for gradients scaled by `scale`."""
    scaled = (true_grads.astype(np.float64) * np.float32(scale)).astype(np.float32)
    return np.asarray(jax.jit(unscale)(jnp.asarray(scaled), jnp.float32(scale)))


@pytest.mark.parametrize("scale", [2.0**127, 1.5 * 2.0**126, 2.0**100, 2.0**65, 3.0e38])
def test_unscaling_is_exact_at_the_largest_scales(scale):
    true = np.array([0.5, -0.25, 1.0e-20, 0.0], np.float32)
    got = _unscaled(scale, true)
    scaled = (true.astype(np.float64) * np.float32(scale)).astype(np.float32)
    # the exact quotient of the float32 scaled gradient, rounded once
    expected = (scaled.astype(np.float64) / np.float64(np.float32(scale))).astype(np.float32)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_allclose(got, true, rtol=2**-23)


def test_scaled_value_and_grad_at_the_largest_scale_returns_the_gradients():
    true = jnp.asarray([0.75, -1.5, 2.0**-60], jnp.float32)
    state = mpjax.static_scaler(optax.sgd(1.0), 2.0**127).init(jnp.zeros(3))
    _, grads = jax.jit(mpjax.scaled_value_and_grad(lambda w: jnp.vdot(w, true), state))(
        jnp.zeros(3)
    )
    np.testing.assert_array_equal(np.asarray(grads), np.asarray(true))


@pytest.mark.parametrize("scale", [2.0**64, 2.0**16, 1000.0, 1.1])
def test_unscaling_is_torchs_single_multiply_up_to_2_to_the_64(scale):
    rng = np.random.default_rng(0)
    scaled = rng.standard_normal(64).astype(np.float32) * np.float32(scale)
    got = np.asarray(jax.jit(unscale)(jnp.asarray(scaled), jnp.float32(scale)))
    inv = np.float32(1.0 / np.float64(np.float32(scale)))  # torch: f32(1 / double(scale))
    np.testing.assert_array_equal(got, scaled * inv)


def test_growth_to_the_top_of_float32_keeps_applying_nonzero_updates():
    # From the defaults, a long run of finite steps grows the scale towards
    # float32's maximum; every step there must still move the parameters.
    tx = mpjax.grad_scaler(optax.sgd(1.0), init_scale=2.0**120, growth_interval=1)
    params = jnp.zeros(2)
    state = tx.init(params)
    true = jnp.asarray([0.75, -1.5], jnp.float32)

    @jax.jit
    def step(params, state):
        _, grads = mpjax.scaled_value_and_grad(lambda w: jnp.vdot(w, true), state)(params)
        updates, state = tx.update(grads, state)
        return updates, state

    for _ in range(10):
        updates, state = step(params, state)
        assert not bool(state.last_step_skipped)
        np.testing.assert_array_equal(np.asarray(updates), [-0.75, 1.5])
    assert float(state.scale) == 2.0**127  # growth refused at the top, not overflowed


def test_unscaling_is_exact_at_the_smallest_scale():
    # Scaled gradients that are normal float32 numbers unscale exactly; those
    # below 2**-126 are flushed by the backend (see the loss-scaling docs).
    true = np.array([1.5, -3.0, 3.0e30], np.float32)
    np.testing.assert_array_equal(_unscaled(2.0**-126, true), true)


def test_accumulated_gradients_near_the_float32_maximum_do_not_overflow():
    # Four micro-batches whose gradients are each near float32's maximum: their
    # sum overflows, their mean (what torch's recipe, dividing the loss by k,
    # accumulates) does not.
    k = 4
    tx = mpjax.grad_scaler(optax.sgd(1.0), accumulation_steps=k, accumulation="mean")
    state = tx.init({"w": jnp.zeros(2)})
    update = jax.jit(tx.update)
    micro = {"w": jnp.asarray([2.0**126, -(2.0**125)], jnp.float32)}
    for _ in range(k):
        updates, state = update(micro, state)
    assert not bool(state.last_step_skipped)
    np.testing.assert_array_equal(np.asarray(updates["w"]), [-(2.0**126), 2.0**125])


def _hlo(fn, *args) -> str:
    """The program XLA receives for `fn`, before any of its passes."""
    return jax.jit(fn).lower(*args).as_text(dialect="hlo")


@pytest.mark.parametrize("devices, stacked", [(1, "f32[1200]{0}"), (8, "f32[100,3,4]{2,1,0}")])
def test_small_leaves_are_stacked_as_one_vector_on_a_lone_cpu(monkeypatch, devices, stacked):
    # XLA:CPU's layout assignment takes a time quadratic in the operands of a
    # concatenation into two or more dimensions, which a stack of reshaped leaves
    # is; a concatenation of vectors it assigns in linear time. With several
    # devices a stack: a concatenation along a leaf's axis would gather its shards.
    monkeypatch.setattr(jax, "device_count", lambda *backend: devices)
    leaves = [jnp.ones((3, 4)) for _ in range(100)]
    fresh = lambda xs: _finite.leaf_flags(xs)  # no trace cached with another count
    concatenations = re.findall(r"= (\S+) concatenate\(", _hlo(fresh, leaves))
    assert concatenations == [stacked]


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("shape", [(), (5,), (3, 4), (2, 1, 3)])
def test_each_stacked_leaf_keeps_its_flag_whatever_its_rank(monkeypatch, shape, devices):
    monkeypatch.setattr(jax, "device_count", lambda *backend: devices)
    leaves = [jnp.ones(shape) for _ in range(11)]
    check = jax.jit(lambda xs: _finite.leaf_flags(xs))
    for i in range(11):
        for index in (0, -1):
            bad = leaves[i].ravel().at[index].set(np.nan).reshape(shape)
            flags, order, any_bad = check([bad if j == i else x for j, x in enumerate(leaves)])
            assert bool(any_bad) and [int(order[k]) for k in np.flatnonzero(flags)] == [i]
    flags, _, any_bad = check(leaves)
    assert not bool(any_bad) and not np.any(flags)


def test_the_skip_is_broadcast_once_per_leaf_shape():
    # A select on a scalar predicate lowers to a broadcast of its own: three per
    # leaf of adam (its moments and its update), which XLA's passes work through
    # before they merge them. Once per shape: for the state, and for the updates.
    params = {f"p{i:03d}": jnp.ones(12) for i in range(50)}
    params["w"] = jnp.ones((3, 4))
    tx = mpjax.grad_scaler(optax.adam(1e-3))
    hlo = _hlo(tx.update, params, tx.init(params), params)
    assert len(re.findall(r"pred\[12\]\{0\} broadcast\(", hlo)) == 2
    assert len(re.findall(r"pred\[3,4\]\{1,0\} broadcast\(", hlo)) == 2


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_on_a_cpu_a_looped_leaf_is_selected_on_an_iota(monkeypatch, platform):
    # A select on a predicate its loop does not vary LLVM unswitches: it emits the
    # loop twice, one copy unrolled, and XLA:CPU compiles each kernel about twice
    # over. From _skip.LOOPED elements the skip is compared against an iota that
    # varies along the inner loop; smaller leaves, and other platforms, broadcast it.
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    params = {"small": jnp.ones(_skip.LOOPED - 1), "w": jnp.ones((4, _skip.LOOPED // 4))}
    tx = mpjax.grad_scaler(optax.adam(1e-3))
    hlo = _hlo(tx.update, params, tx.init(params), params)
    # Two selections: of the state, and of the updates.
    compares = re.findall(r"pred\[4,32\]\{1,0\} compare\(iota", hlo)
    broadcasts = re.findall(r"pred\[4,32\]\{1,0\} broadcast\(", hlo)
    assert (len(compares), len(broadcasts)) == ((2, 0) if platform == "cpu" else (0, 2))
    assert len(re.findall(rf"pred\[{_skip.LOOPED - 1}\]\{{0\}} broadcast\(", hlo)) == 2


def _reductions(leaves) -> int:
    fresh = lambda xs: _finite.leaf_flags(xs)  # no trace cached under another platform
    return str(jax.make_jaxpr(fresh)(leaves)).count("reduce_sum")


@pytest.mark.parametrize("platform, stacked", [("cpu", False), ("gpu", True)])
def test_leaves_are_stacked_up_to_the_platforms_size(monkeypatch, platform, stacked):
    # On a GPU each reduction is a kernel launched every step, and XLA reads a stack
    # in the reduction itself: every leaf that fits a stack is checked stacked.
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    mid = [jax.ShapeDtypeStruct((100_000,), jnp.float32)] * 10
    assert _reductions(mid) == (1 if stacked else 10)
    layers = [jax.ShapeDtypeStruct((768, 3072), jnp.float32)] * 12  # a GPT's MLP weights
    assert _reductions(layers) == (2 if stacked else 12)  # 7 + 5 in 2**24 elements
    big = [jax.ShapeDtypeStruct((_finite.LARGE_GPU,), jnp.float32)] * 3
    assert _reductions(big) == 3


def test_a_stack_holds_at_most_its_elements_and_each_leaf_keeps_its_flag(monkeypatch):
    # A stack XLA did not fuse into its reduction is a copy: its size is bounded.
    monkeypatch.setattr(_finite, "_STACK_ELEMENTS", 4 * 100)
    leaves = [jnp.ones((100,)) for _ in range(10)]
    assert _reductions(leaves) == 3  # 4 + 4 + 2
    for i in range(10):
        bad = [x.at[99].set(np.nan) if j == i else x for j, x in enumerate(leaves)]
        flags, order, any_bad = jax.jit(_finite.leaf_flags)(bad)
        assert bool(any_bad) and [int(order[k]) for k in np.flatnonzero(flags)] == [i]


@pytest.mark.parametrize(
    "platform, bad", [("cpu", np.inf), ("cpu", -np.inf), ("cpu", np.nan), ("gpu", np.nan)]
)
def test_one_bad_element_of_any_leaf_size_skips_the_step(monkeypatch, platform, bad):
    # Large leaves are checked each by a reduction of their own, small ones stacked
    # by size: a single bad element, first or last, must skip the step on either
    # side of that size, in a leaf that is a subtree of its own and in a block.
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(_finite, "LARGE_GPU", 4 * _finite.LARGE)  # the same logic, smaller
    large = _finite.large_leaf()
    params = {
        "small": jnp.ones((3,)),
        "below": jnp.ones((large - 1,)),
        "large": jnp.ones((large,)),
        "block": {"w": jnp.ones((2, large), jnp.bfloat16), "b": jnp.ones((3,))},
    }
    tx = mpjax.grad_scaler(optax.adam(1e-3))
    update = jax.jit(tx.update)
    state = tx.init(params)
    _, state = update(jax.tree.map(jnp.ones_like, params), state, params)  # moments != 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        for index in (0, leaf.size - 1):
            grads = jax.tree.map(jnp.ones_like, params)
            bad_leaf = jnp.ravel(leaf).at[index].set(bad).reshape(leaf.shape)
            grads = jax.tree_util.tree_map_with_path(
                lambda p, g, path=path, bad_leaf=bad_leaf: bad_leaf if p == path else g, grads
            )
            updates, new_state = update(grads, state, params)
            assert bool(new_state.last_step_skipped), (path, index)
            chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
            chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, updates))
            flags = {k: bool(v) for k, v in new_state.nonfinite_subtrees.items()}
            assert flags == {k: k == jax.tree_util.keystr(path[:1]) for k in flags}, path


def test_python_and_numpy_leaves_of_any_size_are_checked_eagerly():
    large = _finite.LARGE
    params = {"a": 1.0, "b": np.ones(large, np.float32)}
    tx = mpjax.grad_scaler(optax.sgd(0.5))
    state = tx.init(params)
    updates, state = tx.update({"a": 0.5, "b": np.ones(large, np.float32)}, state, params)
    assert float(updates["a"]) == -0.25 and not bool(state.last_step_skipped)
    bad = np.ones(large, np.float32)
    bad[-1] = np.nan
    for grads, culprit in (
        ({"a": float("inf"), "b": np.ones(large, np.float32)}, "['a']"),
        ({"a": 0.5, "b": bad}, "['b']"),
    ):
        updates, new_state = tx.update(grads, state, params)
        assert bool(new_state.last_step_skipped) and float(updates["a"]) == 0.0
        assert {k for k, v in new_state.nonfinite_subtrees.items() if v} == {culprit}

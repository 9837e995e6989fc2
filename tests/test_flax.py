"""Flax integration: NNX modules and Linen `apply` under `mpjax.autocast`.

NNX: state written in the forward pass (BatchNorm statistics, RNG counters, any
`nnx.Variable`) is kept, at the variables' own dtypes, alone and through
`nnx.jit`, `nnx.value_and_grad` and `nnx.Optimizer` with `grad_scaler`.
Linen: mutable collections come back from `autocast(model.apply)` at their
original dtypes, and the layers' matrix products run in the low dtype.
"""

import runpy
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from benchmarks.cases import Fp8Mlp
from conftest import F32, all_eqns, product_ok, value_dtypes
from flax import nnx

import mpjax

# Tolerances against float32, stated once. Running statistics are means of
# activations whose matrix products ran in 16 bits; after N steps of momentum
# 0.9 they agree with float32's to about the dtype's relative precision
# (float16: 2**-11, bfloat16: 2**-8), times a few for accumulation: the order in
# which the compiled code accumulates a product moves a 16-bit activation by an
# ulp, and a mean near 0 by as much.
STAT_TOL = {
    np.dtype(jnp.float16): {"rtol": 1e-2, "atol": 2e-3},
    np.dtype(jnp.bfloat16): {"rtol": 5e-2, "atol": 1e-2},
}
N_STEPS = 5


# --------------------------------------------------------------------------
# NNX


class Counter(nnx.Variable):
    """A user-defined state variable, written in the forward pass."""


class Net(nnx.Module):
    """Linear-BN-relu-Dropout twice, then a classifier; counts its calls."""

    def __init__(self, rngs: nnx.Rngs, din=12, width=32, dout=5):
        self.l1 = nnx.Linear(din, width, rngs=rngs)
        self.bn1 = nnx.BatchNorm(width, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.l2 = nnx.Linear(width, width, rngs=rngs)
        self.bn2 = nnx.BatchNorm(width, rngs=rngs)  # after dropout: sees its masks
        self.head = nnx.Linear(width, dout, rngs=rngs)
        self.calls = Counter(jnp.zeros((), jnp.int32))
        self.activation_sum = Counter(jnp.zeros((), jnp.float32))

    def __call__(self, x):
        h = self.drop(nnx.relu(self.bn1(self.l1(x))))
        h = nnx.relu(self.bn2(self.l2(h)))
        self.calls[...] += 1
        self.activation_sum[...] += jnp.sum(h)
        return self.head(h)


def make_net(seed=0):
    return Net(nnx.Rngs(params=seed, dropout=seed + 1))


def batches(n, batch=16, din=12, seed=0):
    key = jax.random.key(seed)
    for k in jax.random.split(key, n):
        kx, ky = jax.random.split(k)
        yield (
            2.0 * jax.random.normal(kx, (batch, din)) + 1.0,
            jax.random.randint(ky, (batch,), 0, 5),
        )


def forward(model, x):
    return model(x)


def dtypes(tree):
    return jax.tree.map(lambda a: a.dtype, tree)


def test_nnx_state_updates_kept_under_autocast(low):
    reference, model = make_net(), make_net()
    before = dtypes(nnx.state(model))
    # Under nnx.jit (one compilation instead of op-by-op dispatch); autocast called
    # eagerly is covered by the dropout and eval-mode tests below.
    slow, fast = nnx.jit(forward), nnx.jit(mpjax.autocast(forward, dtype=low))
    for x, _ in batches(N_STEPS):
        expected = slow(reference, x)
        out = fast(model, x)
        assert out.dtype == F32
        chex.assert_trees_all_close(out, expected, rtol=0.1, atol=0.05)

    # Module state keeps its dtypes: parameters and statistics stay float32.
    assert dtypes(nnx.state(model)) == before
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        chex.assert_type(leaf, jnp.float32)
    # BatchNorm running statistics follow float32's.
    stats, expected_stats = nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat)
    assert not np.allclose(model.bn1.mean[...], 0.0)  # they did move
    chex.assert_trees_all_close(stats, expected_stats, **STAT_TOL[np.dtype(low)])
    # RNG counters advanced once per call, as in float32 (the same masks were drawn).
    assert int(model.drop.rngs.count[...]) == N_STEPS
    chex.assert_trees_all_equal(nnx.state(model, nnx.RngState), nnx.state(reference, nnx.RngState))
    # User variables written in the forward pass.
    assert int(model.calls[...]) == N_STEPS
    chex.assert_type(model.activation_sum[...], jnp.float32)
    np.testing.assert_allclose(model.activation_sum[...], reference.activation_sum[...], rtol=2e-2)


@pytest.mark.parametrize("how", ["module", "bound_method"])
def test_nnx_module_itself_autocast_keeps_its_updates(how, low):
    # autocast(model)(x): the module is the function. Called as it stands it would
    # be closed over, and BatchNorm's write raised Flax's TraceContextError.
    model, as_argument, reference = make_net(), make_net(), make_net()
    x, _ = next(batches(1))
    fast = mpjax.autocast(model if how == "module" else model.__call__, dtype=low)
    out = fast(x)
    # The same, bit for bit, as the module passed as an argument (whose equations'
    # dtypes the tests above check), and close to float32.
    chex.assert_trees_all_equal(out, mpjax.autocast(forward, dtype=low)(as_argument, x))
    chex.assert_trees_all_equal(nnx.state(model), nnx.state(as_argument))
    chex.assert_trees_all_close(out, reference(x), rtol=0.1, atol=0.05)
    assert int(model.calls[...]) == 1
    chex.assert_trees_all_equal_dtypes(nnx.state(model), nnx.state(reference))
    chex.assert_trees_all_close(
        nnx.state(model, nnx.BatchStat), nnx.state(reference, nnx.BatchStat), **STAT_TOL[low]
    )
    # audit traces it too, without touching the module.
    state = jax.tree.map(jnp.copy, nnx.state(model))
    report = mpjax.audit(fast, x)
    assert [e.in_dtypes for e in report.find("dot_general")] == [(low.name, low.name)] * 3
    assert report.casts_inserted > 0
    chex.assert_trees_all_equal(nnx.state(model), state)


def test_nnx_dropout_masks_differ_between_steps(low):
    model = make_net()
    x = jnp.ones((8, 32))
    mask = mpjax.autocast(lambda m, x: m.drop(x) != 0, dtype=low)
    first, second = mask(model, x), mask(model, x)
    assert 0.2 < float(first.mean()) < 0.8
    assert bool(jnp.any(first != second))  # the stream advanced
    # The same masks as float32 draws from an identically seeded model.
    reference = make_net()
    chex.assert_trees_all_equal(reference.drop(x) != 0, first)
    chex.assert_trees_all_equal(reference.drop(x) != 0, second)


def test_nnx_eval_mode_under_autocast_is_deterministic(low):
    model = make_net()
    fast = mpjax.autocast(forward, dtype=low)
    for x, _ in batches(2):
        fast(model, x)  # some statistics to use
    model.eval()
    stats = jax.tree.map(jnp.copy, nnx.state(model, nnx.BatchStat))
    x = next(batches(1, seed=1))[0]
    chex.assert_trees_all_equal(fast(model, x), fast(model, x))
    chex.assert_trees_all_equal(nnx.state(model, nnx.BatchStat), stats)  # not updated


class ActNorm(nnx.Module):
    """Data-dependent initialisation on the first batch, guarded by a Python flag."""

    def __init__(self, n):
        self.bias = nnx.Param(jnp.zeros(n))
        self.initialized = False
        self.extra = nnx.data(None)  # a submodule the first call creates

    def __call__(self, x):
        if not self.initialized:
            self.bias[...] = -x.mean(0)
            self.initialized = True
            self.extra = nnx.Linear(x.shape[-1], 2, rngs=nnx.Rngs(0))
        return self.extra(x + self.bias[...])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_graph_changes_are_kept_under_autocast(low, jit):
    """What `fun` does to a module besides its Variables is kept, as by nnx.jit: a
    Python flag flipped, a submodule created, ``model.eval()`` inside the call. A
    lost flag re-initialised ActNorm from each batch, silently undoing training."""
    wrap = nnx.jit if jit else (lambda f: f)
    x = jnp.arange(12.0).reshape(3, 4)
    model = ActNorm(4)
    wrap(mpjax.autocast(lambda m, x: m(x), dtype=low))(model, x)
    assert model.initialized is True and isinstance(model.extra, nnx.Linear)
    chex.assert_trees_all_equal(model.bias[...], -x.mean(0))
    model.bias[...] = jnp.zeros(4)  # as an optimizer step would move it
    wrap(mpjax.autocast(lambda m, x: m(x), dtype=low))(model, x + 1.0)
    chex.assert_trees_all_equal(model.bias[...], jnp.zeros(4))  # not initialised again

    net = make_net()

    def evaluate(model, x):
        model.eval()
        return model(x)

    wrap(mpjax.autocast(evaluate, dtype=low))(net, jnp.ones((2, 12)))
    assert net.drop.deterministic and net.bn1.use_running_average


class _Flags(nnx.Module):
    def __init__(self):
        self.lin = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
        self.flag, self.eps, self.sizes = True, 0.0, (1.0, 2)

    def __call__(self, x):
        self.flag, self.eps, self.sizes = 1, -0.0, (1, 2)  # each == what it was
        return self.lin(x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "nnx.jit"])
def test_nnx_attributes_set_to_equal_values_of_another_type_are_kept(low, jit):
    # A plain call keeps ``flag = 1`` over True, and -0.0 over 0.0: equal, not the same.
    wrap = nnx.jit if jit else (lambda f: f)
    model = _Flags()
    wrap(mpjax.autocast(lambda m, x: m(x), dtype=low))(model, jnp.ones((1, 2)))
    assert type(model.flag) is int and type(model.sizes[0]) is int
    assert np.signbit(model.eps)


def _bn_model():
    return nnx.Sequential(nnx.Linear(8, 8, rngs=nnx.Rngs(0)), nnx.BatchNorm(8, rngs=nnx.Rngs(0)))


def test_nnx_module_closed_over_by_a_jax_transform_is_read_and_left_whole(low):
    # jax.jit(autocast(model)), or jax.grad of a function reading `model`: in eval
    # mode nothing is written back, so the call runs as it does without autocast.
    model, x = _bn_model(), jnp.linspace(-1.0, 1.0, 32).reshape(4, 8)
    model.eval()
    before = jax.tree.map(jnp.copy, nnx.state(model))
    loss = lambda x: jnp.sum(mpjax.autocast(model, dtype=low)(x) ** 2)
    got = [
        jax.jit(mpjax.autocast(model, dtype=low))(x),
        jax.grad(loss)(x),
        jax.vmap(mpjax.autocast(model, dtype=low))(x[:, None]),
    ]
    want = [jax.jit(model)(x), jax.grad(lambda x: jnp.sum(model(x) ** 2))(x), model(x)[:, None]]
    for g, w in zip(got, want):
        chex.assert_trees_all_close(g, w, rtol=0.05, atol=0.05)
    chex.assert_trees_all_equal(nnx.state(model), before)
    # In train mode the call writes BatchNorm's statistics, which cannot leave the
    # transform: a clear error, before anything is written.
    model.train()
    with pytest.raises(TypeError, match="closes over.*nnx.jit"):
        jax.jit(mpjax.autocast(model, dtype=low))(x)
    chex.assert_trees_all_equal(nnx.state(model), before)
    # A function closing over it: Flax's error, with mpjax's note naming the fix.
    with pytest.raises(Exception, match="different trace level") as info:
        mpjax.autocast(lambda x: model(x), dtype=low)(x)
    assert "Pass the module as an argument" in "".join(info.value.__notes__)
    chex.assert_trees_all_equal(nnx.state(model), before)
    nnx.jit(mpjax.autocast(lambda m, x: m(x), dtype=low))(model, x)  # passed through: kept
    moved = jax.tree.leaves(nnx.state(model, nnx.BatchStat))
    assert not any(map(np.array_equal, moved, jax.tree.leaves(nnx.filter_state(before, nnx.BatchStat))))


def test_nnx_module_passed_twice_or_with_its_submodule(low):
    """Self-distillation passes the model as student and teacher; a loss may take a
    model and one of its layers. The module stays shared, as in plain calls."""

    def twice(student, teacher, x):
        return jnp.mean((student(x) - jax.lax.stop_gradient(teacher(x))) ** 2)

    def with_submodule(model, head, x):
        return jnp.mean(model(x)) + jnp.mean(head(jnp.ones((2, 32))))

    x = next(batches(1))[0]
    for fun, args in [(twice, lambda m: (m, m, x)), (with_submodule, lambda m: (m, m.head, x))]:
        reference, model = make_net(), make_net()
        expected = fun(*args(reference))
        out = mpjax.autocast(fun, dtype=low)(*args(model))
        chex.assert_trees_all_close(out, expected, rtol=0.1, atol=0.05)
        # the statistics and counters moved as often as in the plain call
        assert int(model.calls[...]) == int(reference.calls[...])
        chex.assert_trees_all_close(
            nnx.state(model, nnx.BatchStat),
            nnx.state(reference, nnx.BatchStat),
            **STAT_TOL[np.dtype(low)],
        )


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def test_nnx_diff_state_argnums_differentiates_only_the_filtered_state():
    """LoRA fine-tuning differentiates the LoRA parameters alone, with
    ``argnums=nnx.DiffState(0, nnx.LoRAParam)``, as nnx.value_and_grad takes it."""

    class Lora(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.LoRALinear(12, 16, lora_rank=2, rngs=rngs)
            self.head = nnx.Linear(16, 5, rngs=rngs)

        def __call__(self, x):
            return self.head(nnx.relu(self.l1(x)))

    x, y = next(batches(1))
    model = Lora(nnx.Rngs(0))
    lora_only = nnx.DiffState(0, nnx.LoRAParam)
    state = mpjax.grad_scaler(optax.adam(1e-2), init_scale=2.0**10).init(
        nnx.state(model, nnx.LoRAParam)
    )
    value, grads = mpjax.scaled_value_and_grad(loss_fn, state, argnums=lora_only)(model, x, y)
    expected_value, expected = nnx.value_and_grad(loss_fn, argnums=lora_only)(model, x, y)
    assert float(value) == float(expected_value)
    assert jax.tree.structure(grads) == jax.tree.structure(expected)
    chex.assert_trees_all_close(grads, expected, rtol=1e-6, atol=1e-7)


def make_train_step(loss):
    @nnx.jit
    def train_step(model, optimizer, x, y):
        value, grads = mpjax.scaled_value_and_grad(
            loss, optimizer.opt_state, value_and_grad=nnx.value_and_grad
        )(model, x, y)
        optimizer.update(model, grads)
        return value

    return train_step


@pytest.mark.parametrize(
    "low, scaler", [(jnp.float16, "grad_scaler"), (jnp.bfloat16, "noop_scaler")]
)
def test_nnx_optimizer_with_scaler_under_autocast(low, scaler):
    reference, model = make_net(), make_net()
    ref_opt = nnx.Optimizer(reference, mpjax.noop_scaler(optax.adam(1e-2)), wrt=nnx.Param)
    opt = nnx.Optimizer(model, getattr(mpjax, scaler)(optax.adam(1e-2)), wrt=nnx.Param)
    ref_step, step = make_train_step(loss_fn), make_train_step(mpjax.autocast(loss_fn, dtype=low))
    initial = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))

    ref_losses, losses = [], []
    for x, y in batches(N_STEPS):
        ref_losses.append(ref_step(reference, ref_opt, x, y))
        losses.append(step(model, opt, x, y))
    chex.assert_trees_all_close(losses, ref_losses, rtol=5e-2)
    assert losses[-1] < losses[0]

    stats = mpjax.scaler_stats(opt.opt_state)
    assert int(stats["skipped_steps"]) == 0
    assert int(nnx.as_pure(opt.opt_state).inner_state[0].count) == N_STEPS
    # Parameters moved, stay float32, and follow float32's run.
    params = nnx.state(model, nnx.Param)
    for leaf in jax.tree.leaves(params):
        chex.assert_type(leaf, jnp.float32)
    assert not np.allclose(params["head"]["kernel"][...], initial["head"]["kernel"][...])
    # Adam's steps are near +-lr wherever a gradient is near 0, whatever its rounding,
    # so single entries may differ by a few lr: compare distances instead. The
    # biases before each BatchNorm have such gradients (BatchNorm removes them:
    # only rounding noise is left, of the 16-bit cotangents a 16-bit activation
    # gets, as in torch and in a hand-cast model), so the runs end within a
    # quarter of the way they travelled.
    travelled = optax.tree.norm(
        jax.tree.map(jnp.subtract, nnx.state(reference, nnx.Param), initial)
    )
    apart = optax.tree.norm(jax.tree.map(jnp.subtract, params, nnx.state(reference, nnx.Param)))
    assert float(apart) < 0.25 * float(travelled), (float(apart), float(travelled))
    # Forward-pass state through nnx.value_and_grad and nnx.jit: kept, as in float32.
    chex.assert_trees_all_close(
        nnx.state(model, nnx.BatchStat),
        nnx.state(reference, nnx.BatchStat),
        **STAT_TOL[np.dtype(low)],
    )
    assert int(model.drop.rngs.count[...]) == N_STEPS
    assert int(model.calls[...]) == N_STEPS


def test_nnx_whole_train_step_under_autocast():
    """The module and the nnx.Optimizer both pass through autocast: every update kept.
    (With plain gradients: `scaled_value_and_grad` inside autocast is refused.)"""
    reference, model = make_net(), make_net()
    ref_opt = nnx.Optimizer(reference, mpjax.noop_scaler(optax.adam(1e-2)), wrt=nnx.Param)
    opt = nnx.Optimizer(model, mpjax.grad_scaler(optax.adam(1e-2)), wrt=nnx.Param)
    before = dtypes(nnx.state(opt))

    def train_step(model, optimizer, x, y):
        value, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return value

    def scaled_step(model, optimizer, x, y):
        value, grads = mpjax.scaled_value_and_grad(
            loss_fn, optimizer.opt_state, value_and_grad=nnx.value_and_grad
        )(model, x, y)
        optimizer.update(model, grads)
        return value

    with pytest.raises(ValueError, match="Autocast the loss, not the step"):
        nnx.jit(mpjax.autocast(scaled_step))(model, opt, *next(iter(batches(1))))
    assert int(opt.step[...]) == 0 and int(model.calls[...]) == 0  # nothing written
    fast, slow = nnx.jit(mpjax.autocast(train_step)), nnx.jit(train_step)
    for x, y in batches(3):
        np.testing.assert_allclose(
            fast(model, opt, x, y), slow(reference, ref_opt, x, y), rtol=5e-2
        )
    assert dtypes(nnx.state(opt)) == before  # Adam's moments stay float32
    assert int(opt.step[...]) == 3 and int(model.calls[...]) == 3
    assert int(nnx.as_pure(opt.opt_state).inner_state[0].count) == 3
    assert int(mpjax.scaler_stats(opt)["growth_tracker"]) == 3
    chex.assert_trees_all_close(
        nnx.state(model, nnx.BatchStat),
        nnx.state(reference, nnx.BatchStat),
        **STAT_TOL[np.dtype(jnp.float16)],
    )


def test_nnx_optimizer_skips_float16_overflow_exactly():
    """A scale too large for float16's backward pass: steps are skipped, the scale
    backs off, parameters and Adam's moments stay as they were, until it fits."""
    model = make_net()
    opt = nnx.Optimizer(
        model, mpjax.grad_scaler(optax.adam(1e-2), init_scale=2.0**40), wrt=nnx.Param
    )
    step = make_train_step(mpjax.autocast(loss_fn))
    initial = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
    data = list(batches(1)) * 40
    x, y = data[0]
    step(model, opt, x, y)
    stats = mpjax.scaler_stats(opt.opt_state)
    assert bool(stats["last_step_skipped"]) and float(stats["scale"]) == 2.0**39
    chex.assert_trees_all_equal(nnx.state(model, nnx.Param), initial)
    assert int(nnx.as_pure(opt.opt_state).inner_state[0].count) == 0
    # Forward-pass state is not the scaler's to guard: it moved, as in torch.
    assert int(model.calls[...]) == 1

    for x, y in data[1:]:
        value = step(model, opt, x, y)
        assert np.isfinite(float(value))
    stats = mpjax.scaler_stats(opt.opt_state)
    assert not bool(stats["last_step_skipped"])
    skipped = int(stats["skipped_steps"])
    assert 1 < skipped < 40 and float(stats["scale"]) == 2.0 ** (40 - skipped)
    assert int(nnx.as_pure(opt.opt_state).inner_state[0].count) == 40 - skipped
    for leaf in jax.tree.leaves(nnx.state(model)):
        assert (
            bool(jnp.all(jnp.isfinite(leaf))) if jnp.issubdtype(leaf.dtype, jnp.floating) else True
        )


# --------------------------------------------------------------------------
# Linen


class LinenCNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.Dropout(0.25, deterministic=not train)(nn.relu(x))
        x = nn.Conv(8, (3, 3), strides=(2, 2))(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        x = nn.relu(x).mean(axis=(1, 2))
        return nn.Dense(4)(x)


def linen_setup():
    model = LinenCNN()
    x = 3.0 * jax.random.normal(jax.random.key(0), (16, 8, 8, 1)) + 1.0
    variables = model.init(jax.random.key(1), x, train=False)
    return model, variables, x


def test_linen_batch_stats_come_back_at_original_dtypes(low):
    model, variables, x = linen_setup()
    rngs = {"dropout": jax.random.key(2)}
    expected, expected_updates = jax.jit(
        lambda v, x: model.apply(v, x, rngs=rngs, mutable=["batch_stats"])
    )(variables, x)
    fast = mpjax.autocast(model.apply, dtype=low)
    out, updates = jax.jit(lambda v, x: fast(v, x, rngs=rngs, mutable=["batch_stats"]))(
        variables, x
    )
    chex.assert_type(out, jnp.float32)
    chex.assert_trees_all_equal_dtypes(updates, expected_updates)
    chex.assert_trees_all_equal_dtypes(updates["batch_stats"], variables["batch_stats"])
    chex.assert_trees_all_close(updates, expected_updates, **STAT_TOL[np.dtype(low)])
    chex.assert_trees_all_close(out, expected, rtol=0.1, atol=0.05)
    # Inference: running averages, no dropout, nothing mutable.
    out_eval = jax.jit(lambda v, x: fast(v, x, train=False))(variables, x)
    expected_eval = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
    chex.assert_trees_all_close(out_eval, expected_eval, rtol=0.1, atol=0.05)


def test_linen_matmuls_run_in_low_dtype(low):
    model, variables, x = linen_setup()
    fast = mpjax.autocast(model.apply, dtype=low)
    jaxpr = jax.make_jaxpr(
        lambda v, x: fast(v, x, rngs={"dropout": jax.random.key(2)}, mutable=["batch_stats"])
    )(variables, x)
    products = [
        e for e in all_eqns(jaxpr) if e.primitive.name in ("dot_general", "conv_general_dilated")
    ]
    assert sorted(e.primitive.name for e in products) == [
        "conv_general_dilated",
        "conv_general_dilated",
        "dot_general",
    ]
    held = value_dtypes(jaxpr)
    for eqn in products:
        assert {np.dtype(v.aval.dtype) for v in eqn.invars} == {np.dtype(low)}, eqn
        assert product_ok(eqn, held[eqn], np.dtype(low)), eqn
    out_avals = jaxpr.out_avals
    assert all(a.dtype == F32 for a in out_avals)


def test_linen_training_with_batch_stats_and_scaler():
    model, variables, x = linen_setup()
    y = jnp.arange(16) % 4
    params, batch_stats = variables["params"], variables["batch_stats"]
    apply = mpjax.autocast(model.apply)
    tx = mpjax.grad_scaler(optax.adam(1e-2))
    opt_state = tx.init(params)

    def loss_fn(params, batch_stats, x, y, key):
        logits, updates = apply(
            {"params": params, "batch_stats": batch_stats},
            x,
            rngs={"dropout": key},
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, updates["batch_stats"]

    @jax.jit
    def step(params, batch_stats, opt_state, key):
        (loss, batch_stats), grads = mpjax.scaled_value_and_grad(loss_fn, opt_state, has_aux=True)(
            params, batch_stats, x, y, key
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    losses = []
    for key in jax.random.split(jax.random.key(3), N_STEPS):
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state, key)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    chex.assert_trees_all_equal_dtypes(params, variables["params"])
    chex.assert_trees_all_equal_dtypes(batch_stats, variables["batch_stats"])
    chex.assert_tree_all_finite((params, batch_stats))
    assert int(mpjax.scaler_stats(opt_state)["skipped_steps"]) == 0


# --------------------------------------------------------------------------
# The docs' training steps on a step the scaler skips


def _snippet(name):
    return runpy.run_path(str(Path(__file__).parent.parent / "docs" / "snippets" / name))


def test_linen_recipe_keeps_batch_stats_on_a_skipped_step():
    ns = _snippet("flax_linen.py")
    names = ("params", "batch_stats", "opt_state", "x", "y")
    params, stats, opt_state, x, y = (ns[k] for k in names)
    # An input that overflows float16 in the forward pass: the statistics the
    # forward pass computes are not finite, and the gradients neither.
    variables = {"params": params, "batch_stats": stats}
    _, raw = ns["apply"](variables, x.at[0].set(1e6), train=True, mutable=["batch_stats"])
    assert not all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(raw))
    new_params, new_stats, new_state, _ = ns["step"](params, stats, opt_state, x.at[0].set(1e6), y)
    assert bool(mpjax.scaler_stats(new_state)["last_step_skipped"])
    chex.assert_trees_all_equal((new_params, new_stats), (params, stats))
    _, after, _, _ = ns["step"](params, stats, opt_state, x, y)
    moved = [bool(jnp.any(a != b)) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(stats))]
    assert any(moved)


def test_nnx_recipe_keeps_batch_stats_on_a_skipped_step():
    ns = _snippet("flax_nnx.py")
    model, optimizer, x, y = (ns[k] for k in ("model", "optimizer", "x", "y"))
    model.train()
    before = jax.tree.map(jnp.copy, nnx.state(model, (nnx.Param, nnx.BatchStat)))
    ns["step"](model, optimizer, x.at[0].set(1e6), y)
    assert bool(mpjax.scaler_stats(optimizer.opt_state)["last_step_skipped"])
    chex.assert_trees_all_equal(nnx.state(model, (nnx.Param, nnx.BatchStat)), before)
    ns["step"](model, optimizer, x, y)
    assert not bool(jnp.all(model.norm.mean[...] == before["norm"]["mean"][...]))


def test_an_nnx_jit_method_is_autocast_with_its_module():
    """``@nnx.jit`` makes ``model.predict`` a partial of the module, not a bound
    method: closed over, the module was written from autocast's trace, and Flax's
    failed write-back left it without its layers."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 8, rngs=rngs)

        @nnx.jit
        def predict(self, x):
            return self.linear(x)

    model, x = Model(nnx.Rngs(0)), jnp.ones((4, 16))
    want = model.predict(x)
    got = mpjax.autocast(model.predict)(x)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    report = mpjax.audit(mpjax.autocast(model.predict), x)
    assert report.low_precision_flops == report.matmul_flops > 0
    np.testing.assert_array_equal(model.predict(x), want)  # the module is intact


def test_an_nnx_module_returned_by_the_function_is_the_callers_own():
    """As from a plain call or nnx.jit: the module, its submodule and its Variable,
    updated; they were copies made inside autocast's trace, stale after a step."""

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(4, 4, rngs=rngs)
            self.bn = nnx.BatchNorm(4, rngs=rngs)

    def f(m, x):
        return m.bn(m.linear(x)).sum(), m, m.bn, m.bn.mean

    model, x = Model(nnx.Rngs(0)), jnp.arange(8.0).reshape(2, 4)
    _, m, bn, mean = mpjax.autocast(f)(model, x)
    assert m is model and bn is model.bn and mean is model.bn.mean
    assert float(jnp.abs(model.bn.mean[...]).sum()) > 0  # the update was written back


def test_a_layer_of_an_nnx_list_and_plain_values_come_back_as_returned():
    # nnx.Sequential holds its layers in an nnx.List, reached by index; and True or
    # 4 returned beside it are themselves, not the layers' `use_bias` or width.
    def f(m, x):
        return jnp.mean(m(x) ** 2), m.layers[1], m.layers[0].kernel, {"train": True, "n": 4}

    x = jax.random.normal(jax.random.key(1), (16, 4))
    model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.BatchNorm(4, rngs=nnx.Rngs(0)))
    _, bn, kernel, aux = mpjax.autocast(f)(model, x)
    assert bn is model.layers[1] and kernel is model.layers[0].kernel
    assert aux == {"train": True, "n": 4} and aux["train"] is True
    assert float(jnp.abs(model.layers[1].mean[...]).sum()) > 0


def test_an_nnx_module_of_ref_backed_variables_is_refused_not_left_unwritten():
    # NNX's merge inside autocast's trace gives such Variables refs of the trace's
    # own: BatchNorm's statistics would silently keep their old values.
    with nnx.var_defaults(ref=True):
        bn = nnx.BatchNorm(4, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"nnx\.var_defaults\(ref=True\).*without ref=True"):
        mpjax.autocast(lambda m, x: m(x))(bn, jnp.ones((2, 4)))
    assert float(jnp.abs(bn.mean[...]).max()) == 0.0


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")
def test_the_fp8_state_flax_returns_as_gradients_is_not_unscaled():
    # Flax's fp8 products return their new scales and amax histories as the
    # "gradients" of a collection the step writes back. Divided by the loss scale,
    # the input scale became 1.5e-5 and the next forward pass was noise.
    owg = "_overwrite_with_gradient"
    x = 3.0 * jax.random.normal(jax.random.key(0), (8, 16))
    model = nn.Dense(4, dot_general_cls=nn.Fp8DotGeneralOp)
    variables = model.init(jax.random.key(1), x)
    loss = mpjax.autocast(lambda v, x: jnp.sum(model.apply(v, x) ** 2))
    state = mpjax.grad_scaler(optax.sgd(0.1), init_scale=2.0**10).init(variables["params"])
    _, scaled = mpjax.scaled_value_and_grad(loss, state)(variables, x)
    plain = jax.grad(loss)(variables, x)
    forward = ("input_scale", "input_amax_history", "kernel_scale", "kernel_amax_history")
    for name in forward:  # the forward pass's statistics know no loss scale
        chex.assert_trees_all_equal(
            scaled[owg]["Fp8DotGeneralOp_0"][name], plain[owg]["Fp8DotGeneralOp_0"][name]
        )


def _fp8_case(product):
    x = 3.0 * jax.random.normal(jax.random.key(0), (64, 32))
    y = jax.random.normal(jax.random.key(2), (64, 8))
    model = Fp8Mlp(product)
    loss = mpjax.autocast(lambda v, x, y: jnp.sum((model.apply(v, x) - y) ** 2), dtype=jnp.bfloat16)
    return loss, model.init(jax.random.key(1), x), x, y


@pytest.mark.filterwarnings("ignore:The Fp8DotGeneralOp is deprecated")
@pytest.mark.parametrize("product", [nn.Fp8DirectDotGeneralOp, nn.Fp8DotGeneralOp])
def test_fp8_output_gradients_quantize_as_without_a_loss_scale(product):
    # Flax's fp8 products scale the output gradient into e5m2 by a history of its
    # maxima. Kept in the scaled loss's units, that history was stale whenever the
    # loss scale changed: on the first step (scale 1, empty history) the scaled
    # gradient saturated e5m2, a finite step far off float32 that was applied
    # (`python -m benchmarks.cases`: 0.86 at the default scale, 0.05 unscaled).
    owg = "_overwrite_with_gradient"
    loss, variables, x, y = _fp8_case(product)
    state = mpjax.grad_scaler(optax.sgd(0.1), init_scale=2.0**15).init(variables["params"])
    for _ in range(2):  # the first step, then one with the history it wrote
        _, scaled = mpjax.scaled_value_and_grad(loss, state)(variables, x, y)
        plain = jax.grad(loss)(variables, x, y)
        chex.assert_trees_all_close(scaled, plain, rtol=1e-6, atol=0)
        variables = {"params": variables["params"], owg: scaled[owg]}
    state = mpjax.set_scale(state, 2.0**5)  # the loss scale backs off: nothing is stale
    _, scaled = mpjax.scaled_value_and_grad(loss, state)(variables, x, y)
    chex.assert_trees_all_close(scaled, jax.grad(loss)(variables, x, y), rtol=1e-6, atol=0)


def test_a_skipped_step_leaves_the_fp8_state_as_it_was():
    # As the scaler leaves the parameters and the optimizer state: a NaN kept in
    # the history would freeze the layer's gradient scale for a thousand steps.
    # (A NaN, not an inf: the fp8 products clip an inf to e5m2's largest value.)
    owg = "_overwrite_with_gradient"
    loss, variables, x, y = _fp8_case(nn.Fp8DirectDotGeneralOp)
    tx = mpjax.grad_scaler(optax.sgd(0.1))
    state = tx.init(variables["params"])
    _, grads = mpjax.scaled_value_and_grad(loss, state)(variables, x, y.at[0, 0].set(jnp.nan))
    assert not np.isfinite(grads["params"]["Dense_1"]["kernel"]).all()
    chex.assert_trees_all_equal(grads[owg], variables[owg])
    _, new_state = tx.update(grads["params"], state, variables["params"])
    assert float(mpjax.get_scale(new_state)) < float(mpjax.get_scale(state))  # skipped
    _, grads = mpjax.scaled_value_and_grad(loss, state)(variables, x, y)
    history = grads[owg]["Dense_1"]["Fp8DirectDotGeneralOp_0"]["output_grad_amax_history"]
    assert history[0] > 0  # a finite step writes its statistics

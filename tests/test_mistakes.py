"""The first hour of a PyTorch or Flax user: each common mistake either trains
correctly or stops at the first step with an error that names the fix.

| mistake | outcome |
|---|---|
| gradients from ``jax.grad``, ``jax.value_and_grad``, ``nnx.grad``, ``nnx.value_and_grad`` handed to the scaler | trains as with ``scaled_value_and_grad`` (the scaler takes the loss's own gradients) |
| ``autocast(jax.value_and_grad(f))`` handed to the scaler | trains correctly |
| a PyTorch loop ported literally: ``loss / k`` with ``accumulation_steps=k`` | ``accumulation="sum"`` gives the mean gradient; leaving ``accumulation`` out is a ValueError naming both choices |
| float16 parameters given to ``grad_scaler`` that the optimizer updates | ValueError at ``init`` naming the leaves and the fix (frozen ones, ``optax.set_to_zero``, are accepted) |
| ``scaled_value_and_grad(jax.grad(f))`` | ValueError: looks like a gradient function, pass the loss |
| ``scaled_value_and_grad(f, value_and_grad=jax.grad)`` (or ``nnx.grad``) | TypeError: value_and_grad must be a value-and-gradient transform |
| a ``(loss, aux)`` loss without ``has_aux=True`` | ValueError naming ``has_aux=True`` |
| a non-scalar loss | ValueError naming the shape and ``.mean()`` |
| ``scaled_value_and_grad(loss, opt_state)`` built once before the loop, called in a jitted step | ValueError at the first trace: build it inside the step (its scale would be compiled in while the scaler backs off: every step skipped) |
| ``(aux, loss)`` returned with ``has_aux=True`` | ValueError: the loss comes first |
| ``autocast`` around the whole training step, ``scaled_value_and_grad`` inside (torch's ``with autocast():`` block) | ValueError at the first trace: autocast the loss, not the step (autocast would round the backward pass's weight gradients to 16 bits) |
| the scaler's state made by ``init`` on Linen's whole ``variables``, updated with the gradients of ``variables["params"]`` | ValueError naming the gradient outside every subtree and ``variables['params']`` |
| an NNX module with the default ``value_and_grad`` | differentiated with ``nnx.value_and_grad`` |
| Linen ``TrainState.apply_gradients`` on a skipped step | the recipe below keeps ``step`` (and so the schedule) where it was |
| ``@autocast`` on a Linen ``@nn.compact`` method | TypeError naming ``autocast(model.apply)`` (``init`` returned leaked tracers) |
| an autocast closure creating Linen layers inside a module (``autocast(nn.Dense(4), dtype=jnp.bfloat16)(h)``) | ``init`` runs it as written, making the parameters; ``apply`` runs it under its policy |
| a ``jax.custom_vjp`` whose inside should run in 16 bits | ``jax.custom_vjp(autocast(f))`` with ``defvjp(autocast(fwd), autocast(bwd))`` |
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import mpjax
from conftest import all_eqns

X = jax.random.normal(jax.random.key(0), (64, 16))
Y = jnp.arange(64) % 4


def _params():
    k1, k2 = jax.random.split(jax.random.key(1))
    return {
        "w1": jax.random.normal(k1, (16, 32)) * 0.25,
        "w2": jax.random.normal(k2, (32, 4)) * 0.18,
    }


def loss_fn(params, x, y):
    logits = jnp.tanh(x @ params["w1"]) @ params["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


loss = mpjax.autocast(loss_fn)


def _train(grad_fn, steps=30):
    """SGD under the scaler, with the gradients computed by `grad_fn`."""
    tx = mpjax.grad_scaler(optax.sgd(0.5))
    params = _params()
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        value, grads = grad_fn(params, opt_state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    for _ in range(steps):
        params, opt_state, value = step(params, opt_state)
    return params, float(value)


GRAD_FNS = {
    "scaled_value_and_grad": lambda p, s: mpjax.scaled_value_and_grad(loss, s)(p, X, Y),
    "jax.value_and_grad": lambda p, s: jax.value_and_grad(loss)(p, X, Y),
    "jax.grad": lambda p, s: (loss(p, X, Y), jax.grad(loss)(p, X, Y)),
    "autocast(jax.value_and_grad(f))": (
        lambda p, s: mpjax.autocast(jax.value_and_grad(loss_fn))(p, X, Y)
    ),
}


@pytest.mark.parametrize("how", [h for h in GRAD_FNS if h != "scaled_value_and_grad"])
def test_plain_gradients_train_like_scaled_ones(how):
    reference, reference_loss = _train(GRAD_FNS["scaled_value_and_grad"])
    params, final_loss = _train(GRAD_FNS[how])
    # The same training, up to float16 rounding: not 65536 times too small.
    assert final_loss < 0.8 * float(loss_fn(_params(), X, Y))
    assert abs(final_loss - reference_loss) < 0.02
    chex.assert_trees_all_close(params, reference, atol=2e-2)


class _NNXModel(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))


def _nnx_loss(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@pytest.mark.parametrize("how", ["scaled_value_and_grad", "nnx.value_and_grad", "nnx.grad"])
def test_nnx_gradients_of_any_kind_train(how):
    model = _NNXModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, mpjax.grad_scaler(optax.sgd(0.5)), wrt=nnx.Param)
    nnx_loss = mpjax.autocast(_nnx_loss)
    start = float(_nnx_loss(model, X, Y))

    @nnx.jit
    def step(model, optimizer):
        if how == "scaled_value_and_grad":
            # No value_and_grad= argument: the NNX module is detected.
            _, grads = mpjax.scaled_value_and_grad(nnx_loss, optimizer.opt_state)(model, X, Y)
        elif how == "nnx.value_and_grad":
            _, grads = nnx.value_and_grad(nnx_loss)(model, X, Y)
        else:
            grads = nnx.grad(nnx_loss)(model, X, Y)
        optimizer.update(model, grads)

    for _ in range(30):
        step(model, optimizer)
    assert float(_nnx_loss(model, X, Y)) < 0.8 * start


def test_torch_accumulation_recipe_with_sum_gives_the_mean_gradient():
    k = 4
    micro = [(X[i::k], Y[i::k]) for i in range(k)]
    params = _params()

    def run(tx, micro_loss):
        state = tx.init(params)
        update = jax.jit(tx.update)
        for x, y in micro:
            grads = jax.grad(micro_loss)(params, x, y)
            updates, state = update(grads, state, params)
        return updates

    mean_way = run(
        mpjax.grad_scaler(optax.sgd(1.0), accumulation_steps=k, accumulation="mean"), loss_fn
    )
    torch_way = run(
        mpjax.grad_scaler(optax.sgd(1.0), accumulation_steps=k, accumulation="sum"),
        lambda p, x, y: loss_fn(p, x, y) / k,  # PyTorch: loss = loss / accumulation_steps
    )
    full_batch = jax.tree.map(jnp.negative, jax.grad(loss_fn)(params, X, Y))
    chex.assert_trees_all_close(mean_way, full_batch, rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_close(torch_way, full_batch, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("factory", [mpjax.grad_scaler, mpjax.noop_scaler])
def test_accumulation_without_its_semantics_is_an_error(factory):
    with pytest.raises(ValueError, match=r"accumulation='mean'.*accumulation='sum'"):
        factory(optax.sgd(1.0), accumulation_steps=4)
    with pytest.raises(ValueError, match="accumulation='mean'"):
        mpjax.static_scaler(optax.sgd(1.0), 8.0, accumulation_steps=2, accumulation="avg")


@pytest.mark.parametrize("accumulation", ["sum", "mean"])
def test_accumulation_without_accumulation_steps_is_an_error(accumulation):
    """A ported loop that divides its loss by k and passes accumulation= but not
    accumulation_steps would step on every micro-batch."""
    for make in (
        lambda **kw: mpjax.grad_scaler(optax.adam(1e-3), **kw),
        lambda **kw: mpjax.static_scaler(optax.adam(1e-3), 8.0, **kw),
        lambda **kw: mpjax.noop_scaler(optax.adam(1e-3), **kw),
    ):
        with pytest.raises(ValueError, match="without accumulation_steps.*accumulation_steps=k"):
            make(accumulation=accumulation)
        make(accumulation=accumulation, accumulation_steps=1)  # k from a config: fine


def test_float16_parameters_are_refused_at_init():
    params = {"dense": {"kernel": jnp.ones((4, 4), jnp.float16), "bias": jnp.zeros(4)}}
    with pytest.raises(ValueError, match=r"\['dense'\]\['kernel'\] are float16.*float32"):
        mpjax.grad_scaler(optax.adam(1e-3)).init(params)
    # bfloat16 parameters are accepted: adam's constants are representable there.
    mpjax.grad_scaler(optax.adam(1e-3)).init(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))


def test_frozen_float16_parameters_are_accepted_and_stay_frozen():
    # torch refuses float16 gradients only: a frozen float16 backbone trains there.
    params = {"backbone": jnp.ones((4, 4), jnp.float16), "head": jnp.ones((4, 2))}
    frozen = {"backbone": "frozen", "head": "train"}
    inner = optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, frozen
    )
    tx = mpjax.grad_scaler(inner, init_scale=8.0)
    state = jax.jit(tx.init)(params)

    def loss_fn(p, x):
        return jnp.sum((x @ p["backbone"]).astype(jnp.float32) @ p["head"])

    x = jnp.ones((2, 4), jnp.float16)
    history = [params]
    for x in (x, x.at[0, 0].set(jnp.inf)):
        _, grads = mpjax.scaled_value_and_grad(loss_fn, state)(history[-1], x)
        updates, state = jax.jit(tx.update)(grads, state, history[-1])
        history.append(optax.apply_updates(history[-1], updates))
        chex.assert_trees_all_equal(history[-1]["backbone"], params["backbone"])
    # The finite step moved the head; the second, with an inf, was skipped.
    assert not np.array_equal(history[1]["head"], params["head"])
    chex.assert_trees_all_equal(history[2], history[1])
    assert int(state.skipped_steps) == 1 and float(state.scale) == 4.0
    # A float16 parameter whose update passes the gradient through is not frozen.
    masked = optax.masked(optax.adam(1e-3), {"backbone": False, "head": True})
    with pytest.raises(ValueError, match=r"\['backbone'\] are float16.*optax.set_to_zero"):
        mpjax.grad_scaler(masked).init(params)


_AFTER = {
    "schedule": lambda: optax.scale_by_learning_rate(optax.cosine_decay_schedule(1e-2, 100)),
    "clip": lambda: optax.clip_by_global_norm(1.0),
    "schedule and decay": lambda: optax.chain(
        optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 10)),
        optax.add_decayed_weights(1e-2, mask={"backbone": False, "head": True}),
    ),
    "plateau": lambda: optax.contrib.reduce_on_plateau(),
}


@pytest.mark.parametrize("after", sorted(_AFTER))
def test_frozen_float16_parameters_are_accepted_whatever_follows_their_zeros(after):
    # The zeros of set_to_zero, scaled by a schedule or clipped, are still zeros.
    params = {"backbone": jnp.ones((4, 4), jnp.float16), "head": jnp.ones((4, 2))}
    frozen = {"backbone": "frozen", "head": "train"}
    inner = optax.chain(
        optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, frozen),
        _AFTER[after](),
    )
    tx = mpjax.grad_scaler(inner)
    state = tx.init(params)
    grads = {"backbone": jnp.ones((4, 4), jnp.float16), "head": jnp.ones((4, 2))}
    extra = {"value": jnp.float32(1.0)} if after == "plateau" else {}
    updates, _ = jax.jit(tx.update)(grads, state, params, **extra)
    chex.assert_trees_all_equal(updates["backbone"], jnp.zeros((4, 4), jnp.float16))
    # Weight decay after them moves a float16 parameter: refused.
    decayed = optax.chain(inner, optax.add_decayed_weights(1e-2))
    with pytest.raises(ValueError, match=r"\['backbone'\] are float16.*optax.set_to_zero"):
        mpjax.grad_scaler(decayed).init(params)


_WRAPPERS = {
    "MultiSteps": lambda inner: optax.MultiSteps(inner, 2),
    "apply_if_finite": lambda inner: optax.apply_if_finite(inner, 3),
}


@pytest.mark.parametrize("wrapper", sorted(_WRAPPERS))
def test_frozen_float16_parameters_are_accepted_inside_a_wrapper_that_branches(wrapper):
    # Both wrappers run their inner update in a lax.cond: its branches decide.
    params = {"backbone": jnp.ones((4, 4), jnp.float16), "head": jnp.ones((4, 2))}
    frozen = {"backbone": "frozen", "head": "train"}
    inner = optax.multi_transform(
        {"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, frozen
    )
    tx = mpjax.grad_scaler(_WRAPPERS[wrapper](inner))
    grads = {"backbone": jnp.ones((4, 4), jnp.float16), "head": jnp.ones((4, 2))}
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    chex.assert_trees_all_equal(updates["backbone"], jnp.zeros((4, 4), jnp.float16))
    masked = optax.masked(optax.adam(1e-3), {"backbone": False, "head": True})
    with pytest.raises(ValueError, match=r"\['backbone'\] are float16.*optax.set_to_zero"):
        mpjax.grad_scaler(_WRAPPERS[wrapper](masked)).init(params)


def test_inner_non_finite_updates_neither_grow_nor_back_off_the_scale():
    # adam with eps=0 on zero gradients: 0/0 updates from finite gradients, which
    # check_updates=True skips.
    tx = mpjax.grad_scaler(
        optax.adam(1e-3, eps=0.0), init_scale=4.0, growth_interval=2, check_updates=True
    )
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    for _ in range(4):
        _, state = jax.jit(tx.update)({"w": jnp.zeros(3)}, state, params)
        assert bool(state.last_step_skipped)
    assert float(state.scale) == 4.0 and int(state.growth_tracker) == 0
    assert int(state.skipped_steps) == 4


@pytest.mark.parametrize(
    "fun, kwargs, match",
    [
        (jax.grad(loss_fn), {}, r"looks like a gradient function \(jax.grad\(f\)\)"),
        (lambda p, x, y: (loss_fn(p, x, y), {"n": 1}), {}, r"pass has_aux=True"),
        (loss_fn, {"has_aux": True}, r"must return a \(loss, aux\) pair"),
        (lambda p, x, y: jnp.tanh(x @ p["w1"]), {}, r"shape \(64, 32\).*mean\(\)"),
        (lambda p, x, y: jnp.sum(y), {}, r"floating-point loss"),
        (
            lambda p, x, y: (jnp.tanh(x @ p["w1"]), loss_fn(p, x, y)),
            {"has_aux": True},
            r"the loss comes first\. Return \(loss, aux\)",
        ),
    ],
    ids=[
        "gradient function",
        "forgotten has_aux",
        "has_aux without aux",
        "non-scalar",
        "int",
        "(aux, loss)",
    ],
)
def test_scaled_value_and_grad_names_the_fix(fun, kwargs, match):
    state = mpjax.grad_scaler(optax.sgd(0.1)).init(_params())
    with pytest.raises(ValueError, match=match):
        mpjax.scaled_value_and_grad(fun, state, **kwargs)(_params(), X, Y)


def test_a_scaler_state_made_for_other_parameters_is_an_error():
    # Linen's whole variables given to init, the gradients of variables["params"]:
    # with an inner optimizer keeping no per-parameter state (sgd) nothing else
    # notices, and the flags saying where an inf came from name the wrong tree.
    params = {"params": _params(), "batch_stats": {"mean": jnp.zeros(4)}}
    tx = mpjax.grad_scaler(optax.sgd(0.1))
    grads = jax.grad(loss_fn)(params["params"], X, Y)
    with pytest.raises(ValueError, match=r"at \['w1'\] lies in none of the subtrees .*"
                       r"\['batch_stats'\], \['params'\].*variables\['params'\]"):
        jax.jit(tx.update)(grads, tx.init(params), params["params"])
    tx.update(grads, tx.init(params["params"]), params["params"])  # as it should be


@pytest.mark.parametrize("grad", [jax.grad, nnx.grad], ids=["jax.grad", "nnx.grad"])
def test_a_gradient_transform_as_value_and_grad_names_the_fix(grad):
    state = mpjax.grad_scaler(optax.sgd(0.1)).init(_params())
    with pytest.raises(
        TypeError,
        match=r"value_and_grad=grad\): value_and_grad must be a "
        r"value-and-gradient transform, as jax\.value_and_grad",
    ):
        mpjax.scaled_value_and_grad(loss_fn, state, value_and_grad=grad)(_params(), X, Y)


def test_a_step_autocast_as_a_whole_with_the_scaler_inside_names_the_fix():
    # The backward pass jax.value_and_grad writes would run under autocast too:
    # its weight-gradient products rounded to float16, where scaled they overflow.
    params = _params()
    tx = mpjax.grad_scaler(optax.adam(1e-3))

    def step(params, state, x, y):
        _, grads = mpjax.scaled_value_and_grad(loss_fn, state)(params, x, y)
        updates, state = mpjax.autocast(tx.update, enabled=False)(grads, state, params)
        return optax.apply_updates(params, updates), state

    for whole in (mpjax.autocast(step), jax.jit(mpjax.autocast(step, dtype=jnp.bfloat16))):
        with pytest.raises(ValueError, match=r"Autocast the loss, not the step: "
                           r"scaled_value_and_grad\(mpjax\.autocast\(loss_fn\)"):  # fmt: skip
            whole(params, tx.init(params), X, Y)
    # In a region autocast is off for, the step runs as written.
    outer = mpjax.autocast(lambda *a: mpjax.autocast(step, enabled=False)(*a))
    _, state = outer(params, tx.init(params), X, Y)
    assert not bool(state.last_step_skipped)


def test_scaled_value_and_grad_refuses_a_non_callable():
    state = mpjax.grad_scaler(optax.sgd(0.1)).init(_params())
    with pytest.raises(TypeError, match="fun must be the loss function"):
        mpjax.scaled_value_and_grad(_params(), state)


def test_a_gradient_function_built_outside_the_jitted_step_names_the_fix():
    """Built once before the loop, it would compile the scale it read into the step
    while the scaler backs the state's off: every step skipped, nothing learnt."""
    params = _params()
    tx = mpjax.grad_scaler(optax.sgd(0.5))
    state = tx.init(params)
    grad_fn = mpjax.scaled_value_and_grad(loss, state)

    @jax.jit
    def step(params, state, x, y):
        _, grads = grad_fn(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with pytest.raises(ValueError, match=r"built outside.*inside the training step"):
        step(params, state, X, Y)
    with pytest.raises(ValueError, match=r"built outside"):  # a jit around a vmap, a scan
        jax.jit(jax.vmap(lambda x, y: grad_fn(params, x[None], y[None])[0]))(X, Y)
    with pytest.raises(ValueError, match=r"built outside"):
        jax.lax.scan(lambda c, _: (c, grad_fn(params, X, Y)[0]), 0.0, length=2)
    # Eagerly, under vmap or grad of an eager call, the state read is the current one;
    # a static or disabled scaler's scale never changes.
    value, _ = grad_fn(params, X, Y)
    chex.assert_trees_all_close(value, loss(params, X, Y))
    jax.vmap(lambda x, y: grad_fn(params, x[None], y[None])[0])(X, Y)
    jax.grad(lambda p: grad_fn(p, X, Y)[0])(params)
    for fixed in [mpjax.static_scaler(optax.sgd(0.5), 8.0), mpjax.noop_scaler(optax.sgd(0.5))]:
        fixed_fn = mpjax.scaled_value_and_grad(loss, fixed.init(params))
        jax.jit(lambda p: fixed_fn(p, X, Y)[0])(params)


# --------------------------------------------------------------------------
# Linen: a TrainState whose step does not advance on skipped steps.


class ScaledTrainState(train_state.TrainState):
    """``TrainState`` whose ``step`` counts applied steps only.

    ``step`` drives learning-rate schedules written around the state (and
    checkpoint names); a skipped step must not advance it, as torch warns when
    ``lr_scheduler.step()`` runs after a skipped ``optimizer.step()``.
    """

    def apply_gradients(self, *, grads, **kwargs):
        updates, opt_state = self.tx.update(grads, self.opt_state, self.params)
        applied = mpjax.scaler_stats(opt_state)["step_applied"]
        return self.replace(
            step=self.step + applied.astype(self.step.dtype),
            params=optax.apply_updates(self.params, updates),
            opt_state=opt_state,
            **kwargs,
        )


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(jnp.tanh(nn.Dense(32)(x)))


def _linen_training(tx):
    """A `ScaledTrainState` of `_MLP` and its jitted step on autocast's loss."""
    model = _MLP()
    params = model.init(jax.random.key(0), X)["params"]
    state = ScaledTrainState.create(apply_fn=model.apply, params=params, tx=tx)
    apply = mpjax.autocast(model.apply)

    def linen_loss(params, x, y):
        logits = apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def train_step(state, x, y):
        _, grads = mpjax.scaled_value_and_grad(linen_loss, state.opt_state)(state.params, x, y)
        return state.apply_gradients(grads=grads)

    return state, train_step


def test_linen_train_state_step_counts_applied_steps_only():
    state, train_step = _linen_training(mpjax.grad_scaler(optax.adam(1e-3)))
    state = train_step(state, X, Y)
    assert int(state.step) == 1
    bad_x = X.at[0, 0].set(jnp.inf)  # a non-finite batch: the step is skipped
    skipped = train_step(state, bad_x, Y)
    assert bool(mpjax.scaler_stats(skipped.opt_state)["last_step_skipped"])
    assert int(skipped.step) == 1
    chex.assert_trees_all_equal(skipped.params, state.params)
    assert int(train_step(skipped, X, Y).step) == 2


def test_linen_train_state_step_counts_effective_steps_under_accumulation():
    # With accumulation, update is called once per micro-batch and the optimizer
    # steps on every k-th: step must count those, as adam's own count does.
    tx = mpjax.grad_scaler(optax.adam(1e-3), accumulation_steps=3, accumulation="mean")
    state, train_step = _linen_training(tx)
    bad_x = X.at[0, 0].set(jnp.inf)
    batches = [X] * 6 + [X, bad_x, X] + [X] * 2  # the third effective batch is skipped
    applied = []
    for x in batches:
        state = train_step(state, x, Y)
        applied.append(bool(mpjax.scaler_stats(state.opt_state)["step_applied"]))
    assert applied == [False, False, True] * 2 + [False, False, False] + [False, False]
    assert int(state.step) == 2
    assert int(state.opt_state.inner_state[0].count) == 2  # adam's own count agrees
    assert int(mpjax.scaler_stats(state.opt_state)["skipped_steps"]) == 1


def test_linen_train_state_step_counts_the_steps_of_a_wrapped_multi_steps():
    # grad_scaler(optax.MultiSteps(adam, k)): MultiSteps applies adam's step on
    # every k-th micro-batch, and step must count those, not the micro-batches.
    tx = mpjax.grad_scaler(optax.MultiSteps(optax.adam(1e-3), every_k_schedule=3))
    state, train_step = _linen_training(tx)
    applied = []
    for _ in range(7):
        state = train_step(state, X, Y)
        applied.append(bool(mpjax.scaler_stats(state.opt_state)["step_applied"]))
    assert applied == [False, False, True] * 2 + [False]
    assert int(state.step) == int(state.opt_state.inner_state.gradient_step) == 2


# --------------------------------------------------------------------------
# torch's custom_fwd / custom_bwd: a custom_vjp function whose inside runs under
# autocast.


def test_custom_vjp_inside_autocast():
    def f(x, w):
        return jnp.tanh(x @ w)

    def fwd(x, w):
        y = jnp.tanh(x @ w)
        return y, (x, w, y)

    def bwd(res, g):
        x, w, y = res
        gz = g * (1 - y * y)
        return gz @ w.T, x.T @ gz

    as_written = jax.custom_vjp(f)
    as_written.defvjp(fwd, bwd)
    # torch's @custom_fwd / @custom_bwd: primal, forward and backward under autocast.
    in_16_bits = jax.custom_vjp(mpjax.autocast(f))
    in_16_bits.defvjp(mpjax.autocast(fwd), mpjax.autocast(bwd))

    w = jax.random.normal(jax.random.key(2), (16, 8)) * 0.25

    def loss_of(g):
        return mpjax.autocast(lambda w, x: jnp.sum(g(x, w) ** 2))

    report = mpjax.audit(jax.grad(loss_of(in_16_bits)), w, X)
    assert report.low_precision_fraction == 1.0
    assert mpjax.audit(jax.grad(loss_of(as_written)), w, X).low_precision_fraction == 0.0
    reference = jax.grad(lambda w: jnp.sum(f(X, w) ** 2))(w)
    grads = jax.grad(loss_of(in_16_bits))(w, X)
    assert grads.dtype == jnp.float32
    np.testing.assert_allclose(
        grads, reference, rtol=2e-2, atol=2e-2 * float(jnp.abs(reference).max())
    )


class _DecoratedMethod(nn.Module):
    @mpjax.autocast
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


class _ClosureCreatingLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        return mpjax.autocast(lambda x: nn.Dense(3)(x))(x)


class _ClosureOverBoundLayer(nn.Module):
    def setup(self):
        self.dense = nn.Dense(3)

    def __call__(self, x, cast=True):
        return mpjax.autocast(self.dense)(x) if cast else self.dense(x)


def test_autocast_inside_a_linen_method_names_model_apply():
    # Without the check, init returned the parameters as leaked tracers.
    x = jnp.ones((2, 4))
    with pytest.raises(TypeError, match=r"Linen module _DecoratedMethod.*autocast\(model\.apply\)"):
        _DecoratedMethod().init(jax.random.key(0), x)
    # A region creating its layers runs as written at init, which only makes the
    # parameters (float32 either way), and under its policy at apply.
    creating = _ClosureCreatingLayers()
    variables = creating.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, variables) == {"params": {"Dense_0": {"bias": (3,), "kernel": (4, 3)}}}
    dots = [e for e in all_eqns(jax.make_jaxpr(creating.apply)(variables, x).jaxpr)
            if e.primitive.name == "dot_general"]
    assert [v.aval.dtype for e in dots for v in e.invars] == [jnp.float16] * 2
    # Reading existing parameters inside a method traces nothing into the module: it
    # works, in 16 bits, with the gradients of the parameters it closes over.
    model = _ClosureOverBoundLayer()
    variables = model.init(jax.random.key(0), x, cast=False)
    chex.assert_trees_all_equal_dtypes(variables, jax.tree.map(jnp.float32, variables))
    out = model.apply(variables, x)
    chex.assert_trees_all_close(out, model.apply(variables, x, cast=False), atol=1e-2)
    grads = jax.grad(lambda v: jnp.sum(model.apply(v, x)))(variables)
    expected = jax.grad(lambda v: jnp.sum(model.apply(v, x, cast=False)))(variables)
    chex.assert_trees_all_close(grads, expected, atol=1e-2)
    jaxpr = jax.make_jaxpr(lambda v: model.apply(v, x))(variables)
    dots = [e for e in all_eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert [v.aval.dtype for e in dots for v in e.invars] == [jnp.float16] * 2


class _NestedBatchNorm(nn.Module):
    @nn.compact
    def __call__(self, x, cast=True):
        norm = nn.BatchNorm(use_running_average=False)
        h = nn.Dense(4)(x)
        return mpjax.autocast(norm, dtype=jnp.bfloat16)(h) if cast else norm(h)


def test_a_nested_region_updating_a_mutable_collection_names_it():
    x = jnp.ones((2, 4))
    variables = _NestedBatchNorm().init(jax.random.key(0), x, cast=False)
    apply = mpjax.autocast(_NestedBatchNorm().apply)
    with pytest.raises(
        ValueError, match=r"\['batch_stats'\].*mutable collection.*outside the nested"
    ):
        apply(variables, x, mutable=["batch_stats"])

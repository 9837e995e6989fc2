"""Resume: a run saved with orbax at step k and restored continues bit-identically.

Every case trains a small float16-autocast model with a jitted step, injects
non-finite batches both before and after the checkpoint (so the scale, growth
tracker and skip counters all move on each side of it), saves
``{"params", "opt_state"}`` (or the NNX states) with ``ocp.StandardCheckpointer``
at step k, restores into fresh objects from an abstract target built by
``tx.init``, continues, and compares with the uninterrupted run using
``chex.assert_trees_all_equal`` (exact equality, NaNs at the same places count
as equal). The existing round-trip tests in test_scaler_integration.py use a
bare ``update`` on synthetic gradients; these go through ``autocast``,
``scaled_value_and_grad`` and a real model.

| optimizer                                        | checkpoint at           | guaranteed after restore                          |
|--------------------------------------------------|-------------------------|---------------------------------------------------|
| ``grad_scaler(optax.adam)``                      | step 6 of 14, skips at 2 and 9 | params, opt_state (scale, tracker, skipped_steps, last_step_skipped, adam moments and count) bit-identical to the uninterrupted run |
| ``grad_scaler(adam, accumulation_steps=3)``      | micro-step 7 of 15, i.e. *inside* an effective batch (micro_step 1, non-zero float32 accumulator) | the same, the half-filled accumulator and micro_step included; the bad effective batches (1st and 4th) skipped on both sides |
| ``grad_scaler(MultiSteps(adam, 3))`` (the order the docs say does not poison) | step 7 of 15 | the same, MultiSteps' mini_step and accumulator included; a bad micro-batch is skipped alone |
| ``nnx.Optimizer(model, grad_scaler(adam), wrt=nnx.Param)`` | step 6 of 14, skips at 2 and 9 | ``nnx.state(model)`` and ``nnx.state(optimizer)`` restored with ``nnx.update`` into fresh objects built from another seed continue bit-identically |
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import mpjax
from mpjax import GradScalerState, scaled_value_and_grad, scaler_stats

IN, HIDDEN, BATCH = 4, 16, 8


def _params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {
        "w1": jax.random.normal(k1, (IN, HIDDEN)) / 2.0,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / 4.0,
        "b2": jnp.zeros(1),
    }


@mpjax.autocast  # float16 matmuls, float32 reductions
def _loss(params, x, y):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def _data(n, bad):
    """n batches; the batches at the indices in `bad` hold an inf."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(n, BATCH, IN)).astype(np.float32)
    ys = rng.normal(size=(n, BATCH, 1)).astype(np.float32)
    for i in bad:
        xs[i, i % BATCH, 0] = np.inf
    return xs, ys


def _make_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        _, grads = scaled_value_and_grad(_loss, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def _run(step, params, opt_state, xs, ys):
    skipped = []
    for x, y in zip(xs, ys):
        params, opt_state = step(params, opt_state, x, y)
        skipped.append(int(scaler_stats(opt_state)["skipped_steps"]))
    return params, opt_state, skipped


def _save_and_restore(path, tree, abstract_like):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, tree)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_like)
        return checkpointer.restore(path, abstract)


CASES = {
    # name: (optimizer, number of steps, checkpoint step, steps with an inf)
    "plain": (
        lambda: mpjax.grad_scaler(optax.adam(1e-2), init_scale=2.0**10, growth_interval=2),
        14,
        6,
        (2, 9),
    ),
    "accumulation_steps=3": (
        lambda: mpjax.grad_scaler(
            optax.adam(1e-2),
            init_scale=2.0**10,
            growth_interval=2,
            accumulation_steps=3,
            accumulation="mean",
        ),
        15,
        7,
        (1, 10),
    ),
    "scaler_around_multisteps": (
        lambda: mpjax.grad_scaler(
            optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3).gradient_transformation(),
            init_scale=2.0**10,
            growth_interval=2,
        ),
        15,
        7,
        (1, 10),
    ),
}


@functools.lru_cache(maxsize=None)
def _compiled(name):
    tx = CASES[name][0]()
    return tx, _make_step(tx)


@pytest.mark.parametrize("name", list(CASES))
def test_orbax_resume_is_bit_identical(tmp_path, name):
    _, n, k, bad = CASES[name]
    tx, step = _compiled(name)
    xs, ys = _data(n, bad)
    params0 = _params()

    full_params, full_state, full_skipped = _run(step, params0, tx.init(params0), xs, ys)

    params, state, skipped = _run(step, params0, tx.init(params0), xs[:k], ys[:k])
    assert skipped == full_skipped[:k]
    restored = _save_and_restore(
        tmp_path / "ckpt",
        {"params": params, "opt_state": state},
        {"params": _params(seed=1), "opt_state": tx.init(params0)},
    )
    chex.assert_trees_all_equal_structs(restored["opt_state"], state)
    chex.assert_trees_all_equal(restored, {"params": params, "opt_state": state})
    chex.assert_trees_all_equal_dtypes(restored["opt_state"], state)

    params, state, skipped = _run(step, restored["params"], restored["opt_state"], xs[k:], ys[k:])
    chex.assert_trees_all_equal(params, full_params)
    chex.assert_trees_all_equal(state, full_state)
    assert skipped == full_skipped[k:]

    # The counters really moved on both sides of the checkpoint.
    assert full_skipped[k - 1] >= 1
    assert full_skipped[-1] > full_skipped[k - 1]
    # Clean steps after the checkpoint did train.
    assert not np.array_equal(np.asarray(full_params["w1"]), np.asarray(params0["w1"]))
    if name == "accumulation_steps=3":
        # The checkpoint was taken inside an effective batch: a live accumulator.
        assert int(restored["opt_state"].micro_step) == 1
        assert bool(jnp.any(restored["opt_state"].grad_accumulator["w1"] != 0))
    if name in ("plain", "accumulation_steps=3"):
        assert isinstance(restored["opt_state"], GradScalerState)


# --------------------------------------------------------------------------
# Flax NNX: nnx.Optimizer holding the scaler.


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


def _nnx_objects(seed):
    model = _MLP(nnx.Rngs(seed))
    tx = mpjax.grad_scaler(optax.adam(1e-3), init_scale=2.0**10, growth_interval=2)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)


@mpjax.autocast
def _nnx_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def _nnx_step(model, optimizer, x, y):
    _, grads = scaled_value_and_grad(
        _nnx_loss, optimizer.opt_state, value_and_grad=nnx.value_and_grad
    )(model, x, y)
    optimizer.update(model, grads)


def _nnx_run(model, optimizer, xs, ys):
    skipped = []
    for x, y in zip(xs, ys):
        _nnx_step(model, optimizer, x, y)
        skipped.append(int(scaler_stats(optimizer)["skipped_steps"]))
    return skipped


def test_nnx_optimizer_resume_is_bit_identical(tmp_path):
    n, k = 14, 6
    xs, ys = _data(n, bad=(2, 9))
    full_model, full_optimizer = _nnx_objects(seed=0)
    full_skipped = _nnx_run(full_model, full_optimizer, xs, ys)
    assert full_skipped[k - 1] == 1 and full_skipped[-1] == 2

    model, optimizer = _nnx_objects(seed=0)
    assert _nnx_run(model, optimizer, xs[:k], ys[:k]) == full_skipped[:k]
    saved = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}

    fresh_model, fresh_optimizer = _nnx_objects(seed=1)  # other weights, fresh scaler
    restored = _save_and_restore(
        tmp_path / "nnx",
        saved,
        {"model": nnx.state(fresh_model), "optimizer": nnx.state(fresh_optimizer)},
    )
    nnx.update(fresh_model, restored["model"])
    nnx.update(fresh_optimizer, restored["optimizer"])
    chex.assert_trees_all_equal(nnx.state(fresh_model), saved["model"])
    chex.assert_trees_all_equal(nnx.state(fresh_optimizer), saved["optimizer"])
    stats = scaler_stats(fresh_optimizer)
    assert int(stats["skipped_steps"]) == 1 and float(stats["scale"]) != 2.0**10

    assert _nnx_run(fresh_model, fresh_optimizer, xs[k:], ys[k:]) == full_skipped[k:]
    chex.assert_trees_all_equal(nnx.state(fresh_model), nnx.state(full_model))
    chex.assert_trees_all_equal(nnx.state(fresh_optimizer), nnx.state(full_optimizer))
    chex.assert_trees_all_equal(scaler_stats(fresh_optimizer), scaler_stats(full_optimizer))


def test_a_dynamic_checkpoint_resumed_under_a_static_scaler_runs_at_the_static_scale():
    """A static scaler uses the scale it was given, not the one a dynamic (or disabled)
    scaler's checkpoint holds, and hands it on; its own state keeps a `set_scale`."""
    from flax import serialization

    params = {"w": jnp.ones(3)}
    static = mpjax.static_scaler(optax.adam(1e-3), 8.0)
    grads = {"w": jnp.full(3, 0.5)}
    for saved in [mpjax.grad_scaler(optax.adam(1e-3)), mpjax.noop_scaler(optax.adam(1e-3))]:
        blob = serialization.to_bytes(saved.init(params))
        state = serialization.from_bytes(static.init(params), blob)
        for _ in range(2):
            _, state = jax.jit(static.update)(grads, state, params)
            assert float(mpjax.get_scale(state)) == 8.0
    state = mpjax.set_scale(static.init(params), 2.0)
    _, state = jax.jit(static.update)(grads, state, params)
    assert float(mpjax.get_scale(state)) == 2.0
    # The other way round, a dynamic scaler goes on from the static scale, counting.
    dynamic = mpjax.grad_scaler(optax.adam(1e-3), growth_interval=2)
    _, state = jax.jit(dynamic.update)(grads, state, params)
    assert float(mpjax.get_scale(state)) == 2.0 and int(state.growth_tracker) == 1


def test_a_state_restored_for_parameters_with_a_new_subtree_keeps_what_matches():
    """The subtree flags are the last step's verdict: a subtree the checkpoint lacks (a
    new head) restores as False, as the scaler's other fields restore; an inner state
    shaped as the parameters is refused by flax itself, naming the path."""
    from flax import serialization

    old_params = {"a": jnp.ones(3), "b": jnp.ones(2)}
    new_params = {**old_params, "head": jnp.ones(4)}
    tx = mpjax.grad_scaler(optax.sgd(1e-3), init_scale=2.0**4)
    state = tx.init(old_params)
    _, state = tx.update({"a": jnp.ones(3), "b": jnp.full(2, jnp.inf)}, state, old_params)
    restored = serialization.from_state_dict(
        tx.init(new_params), serialization.to_state_dict(state)
    )
    flags = {name: bool(flag) for name, flag in restored.nonfinite_subtrees.items()}
    assert flags == {"['a']": False, "['b']": True, "['head']": False}
    assert float(restored.scale) == 8.0 and int(restored.skipped_steps) == 1
    _, restored = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, new_params), restored, new_params)
    assert not any(map(bool, restored.nonfinite_subtrees.values()))
    adam = mpjax.grad_scaler(optax.adam(1e-3))
    with pytest.raises(ValueError, match=r"head.*inner_state"):
        serialization.from_state_dict(
            adam.init(new_params), serialization.to_state_dict(adam.init(old_params))
        )

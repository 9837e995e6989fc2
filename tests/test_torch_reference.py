"""mpjax.grad_scaler against torch.amp.GradScaler, on recorded trajectories.

`torch_reference/scaler_sequences.json` holds 304 sequences (3890 optimizer
steps) of torch 2.13's GradScaler (CPU) around torch.optim.SGD / Adam, recorded
by `torch_reference/record.py` (torch is needed only to re-record; this test
reads the JSON). Each is replayed through ``grad_scaler(optax.sgd(lr, momentum))``
or ``grad_scaler(optax.adam(lr, b1, b2, eps))`` with the same hyperparameters,
fed torch's scaled gradients unscaled as `mpjax.scaled_value_and_grad` unscales
its own (``mpjax.gradients.unscale`` by the scale in the state; the scaler's
``update`` takes the loss's gradients), and compared step by step:

* skip decision (mpjax ``last_step_skipped`` == torch ``found_inf``): equal;
* scale and growth tracker: bit for bit;
* unscaled gradients (what ``inner`` is given, captured by a pass-through probe
  at the head of the inner chain), on every applied step: bit for bit;
  on a skipped step mpjax hands ``inner`` zeros, so there is nothing to compare;
* parameters: within a tolerance, per element, that accumulates over the steps
  (see `param_bound`): 2 ulp of the parameter per step (torch's ``p.add_`` may
  fuse the multiply-add) plus, per step, a fraction of torch's own update:
  4 ulp for SGD, ``2**-16`` for Adam. Adam's allowance is that large because of
  optax, not of the scaler: optax computes the bias corrections ``1 - b**t`` in
  float32, and ``1 - float32(0.999)`` is 1.3e-5 (about 100 ulp) away from the
  ``1 - 0.999`` torch computes in double, so optax's first Adam updates differ
  from torch's by up to ~6e-6 relative (measured: at most 62 ulp of the update).
  SGD with or without momentum agrees to an ulp per step (optax's trace with
  ``decay=m`` is torch's buffer with dampening 0; torch may fuse ``p - lr*buf``).
  A skipped step that still moved a parameter or an optimizer moment would be
  off by a whole update, far outside either allowance.

Deliberate differences, the only comparisons skipped or loosened:

(a) Floor. mpjax's scale never falls below ``min_scale`` (default ``2**-14``);
    torch's keeps shrinking. All sequences but the "floor" ones pass
    ``min_scale=2**-126``, below any scale they reach, so torch's rule applies
    unchanged. The "floor" sequences (configs c14, c15) use the default: at the
    step where torch's scale goes below ``2**-14`` mpjax's must be exactly
    ``2**-14``; from there on the scales differ (so do the unscaled gradients
    and the parameters, not compared), and mpjax's scale is checked against the
    rule with the floor, from its own previous scale; skips and the tracker
    still equal torch's.
(b) Finite check on the unscaled gradients. A finite scaled gradient that
    overflows once divided by a scale below 1: torch does not skip and applies
    inf; mpjax skips (and backs off). Sequences tagged "unscale_overflow" end
    with such a step: there mpjax must have skipped and backed off, torch not.
(c) Accumulation. mpjax unscales each micro-batch's gradients (of the
    *undivided* loss), multiplies them by float32 ``1/k`` and sums them
    (``accumulation="mean"``); torch's recipe divides the loss by k, sums
    ``float32(g_i / k)`` and unscales the sum. The roundings happen in another
    order, so the unscaled gradients are compared within
    ``(4k + 4) * 2**-24 * sum_i |g_i| / (k * scale)`` (a first-order bound on
    both sides' roundings), not exactly. Near float32's maximum torch's sum of
    the ``g_i / k`` stays finite, and so does mpjax's sum of unscaled gradients
    (`test_accumulation_near_the_float32_maximum`).
(d) Scales above ``2**126``. torch unscales with ``float32(1 / scale)``, a
    subnormal there, keeping only 21-22 bits (measured: within 2**-22 of the
    exact quotient); mpjax may unscale in two exact power-of-two steps instead.
    Unscaled gradients at such steps are compared with a relative tolerance of
    ``2**-20``, not bit for bit, and the parameters after them with that much
    more slack (`test_unscale_above_2_126` checks those steps on their own).
"""

from __future__ import annotations

import collections
import functools
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from mpjax.gradients import unscale
from mpjax.scaler import grad_scaler

DATA = json.loads(
    (pathlib.Path(__file__).parent / "torch_reference" / "scaler_sequences.json").read_text()
)
SEQUENCES = {s["id"]: s for s in DATA["sequences"]}
BY_CONFIG = collections.defaultdict(list)
for _s in DATA["sequences"]:
    BY_CONFIG[_s["config"]].append(_s["id"])
SHAPES = [tuple(s) for s in DATA["shapes"]]
SIZES = [math.prod(s) for s in SHAPES]

EPS = 2.0**-23  # float32 ulp of 1
U = 2.0**-24  # unit roundoff
NO_FLOOR = 2.0**-126
DEFAULT_MIN_SCALE = 2.0**-14
TOP = 2.0**126
UPDATE_SLACK = {"sgd": 4 * EPS, "adam": 2.0**-16}  # per step, of torch's update
ABOVE_TOP_RTOL = 2.0**-20  # (d)


# --------------------------------------------------------------------------
# Decoding.


def decode(words: str) -> np.ndarray:
    """A string of 8-hex-digit float32 bit patterns, as a flat float32 array."""
    raw = bytes.fromhex(words.replace(" ", ""))
    return np.frombuffer(raw, ">u4").view(">f4").astype(np.float32)


def flat(tree: list[str]) -> np.ndarray:
    return np.concatenate([decode(leaf) for leaf in tree])


def unflat(v):
    out, i = [], 0
    for shape, n in zip(SHAPES, SIZES):
        out.append(v[..., i : i + n].reshape(v.shape[:-1] + shape))
        i += n
    return out


def f32(x) -> np.float32:
    return np.float32(x)


# --------------------------------------------------------------------------
# Classification of the steps, from the torch record alone.


def f32_sum_is_finite(micro_grads) -> bool:
    """Whether mpjax's float32 running sum of the micro-batch gradients is finite."""
    with np.errstate(over="ignore", invalid="ignore"):
        total = np.zeros(sum(SIZES), np.float32)
        for g in micro_grads:
            total = total + flat(g)
    return bool(np.isfinite(total).all())


@functools.cache
def classify(seq_id):
    """Per step, the known difference it shows, if any: "b" (unscale overflow),
    "sum_overflow" (accumulation), "d" (an applied step at a scale above 2**126),
    or None. Floor crossings (a) are found while comparing."""
    seq = SEQUENCES[seq_id]
    scale = f32(seq["scaler"]["init_scale"])
    kinds = []
    for step in seq["steps"]:
        kind = None
        unscaled = flat(step["unscaled"])
        if not step["found_inf"] and not np.isfinite(unscaled).all():
            kind = "b"
        elif not step["found_inf"] and not f32_sum_is_finite(step["micro_grads"]):
            kind = "sum_overflow"
        elif not step["found_inf"] and scale > TOP:
            kind = "d"
        kinds.append(kind)
        scale = decode(step["scale"])[0]
    return tuple(kinds)


# --------------------------------------------------------------------------
# Replay: one compiled scan per configuration.


def probe() -> optax.GradientTransformation:
    """Passes the gradients through and keeps the last ones in its state."""
    return optax.GradientTransformation(
        lambda params: jax.tree.map(jnp.zeros_like, params),
        lambda updates, state, params=None: (updates, updates),
    )


def make_scaler(seq, init_scale):
    opt = seq["optimizer"]
    if opt["name"] == "sgd":
        # torch SGD, dampening 0, no nesterov: buf = m * buf + g (buf = g at first,
        # the same as optax's trace from zeros); p -= lr * buf.
        inner = optax.sgd(opt["lr"], momentum=opt["momentum"] or None)
    else:
        b1, b2 = opt["betas"]
        inner = optax.adam(opt["lr"], b1=b1, b2=b2, eps=opt["eps"])
    h = seq["scaler"]
    floor = {} if seq["mpjax_min_scale"] == DEFAULT_MIN_SCALE else {"min_scale": NO_FLOOR}
    return grad_scaler(
        optax.chain(probe(), inner),
        init_scale=init_scale,
        growth_factor=h["growth_factor"],
        backoff_factor=h["backoff_factor"],
        growth_interval=h["growth_interval"],
        accumulation_steps=h["accumulation_steps"],
        accumulation="mean",
        **floor,
    )


@functools.cache
def replay_config(config):
    """mpjax's trajectory of every sequence of `config`, per optimizer step:
    (scale, tracker, skipped, unscaled gradients seen by inner, params)."""
    ids = BY_CONFIG[config]
    seqs = [SEQUENCES[i] for i in ids]
    # One update for the configuration (init_scale only matters to init), run
    # over all micro-batches of a sequence by a scan padded to the longest.
    tx = make_scaler(seqs[0], 1.0)
    length = max(len(s["steps"]) * s["scaler"]["accumulation_steps"] for s in seqs)

    @jax.jit
    def run(params, state, grads, active):
        def body(carry, x):
            params, state = carry
            g, on = x
            updates, new_state = tx.update(unscale(unflat(g), state.scale), state, params)
            new_params = optax.apply_updates(params, updates)
            params, state = jax.tree.map(
                lambda new, old: jnp.where(on, new, old),
                (new_params, new_state),
                (params, state),
            )
            seen = state.inner_state[0]  # the probe's state: inner's last gradients
            out = (
                state.scale,
                state.growth_tracker,
                state.last_step_skipped,
                jnp.concatenate([x.ravel() for x in seen]),
                jnp.concatenate([x.ravel() for x in params]),
            )
            return (params, state), out

        return lax.scan(body, (params, state), (grads, active))[1]

    results = {}
    for seq in seqs:
        k = seq["scaler"]["accumulation_steps"]
        micro = [flat(g) for step in seq["steps"] for g in step["micro_grads"]]
        grads = np.zeros((length, sum(SIZES)), np.float32)
        grads[: len(micro)] = micro
        active = np.arange(length) < len(micro)
        params = unflat(flat(seq["params0"]))
        state = make_scaler(seq, seq["scaler"]["init_scale"]).init(params)
        out = jax.device_get(run(params, state, grads, active))
        last_micro = np.arange(k - 1, len(micro), k)  # the end of each effective batch
        results[seq["id"]] = [np.asarray(o)[last_micro] for o in out]
    return results


def replay(seq_id):
    return replay_config(SEQUENCES[seq_id]["config"])[seq_id]


# --------------------------------------------------------------------------
# Comparisons.


def floor_rule(scale, tracker, found_inf, h, min_scale):
    """torch's _amp_update_scale_ (double multiply, float32 result) with mpjax's floor."""
    if found_inf:
        return max(f32(np.float64(scale) * h["backoff_factor"]), f32(min_scale)), 0
    if tracker + 1 == h["growth_interval"]:
        with np.errstate(over="ignore"):
            grown = f32(np.float64(scale) * h["growth_factor"])
        return (grown if np.isfinite(grown) else scale), 0
    return scale, tracker + 1


def accumulation_bound(step, k, scale):
    """(c): |mpjax - torch| for the unscaled mean of k micro-batches, first order."""
    total = sum(np.abs(flat(g).astype(np.float64)) for g in step["micro_grads"])
    return (4 * k + 4) * U * total / (k * np.float64(scale))


def param_bound(bound, torch_params, torch_prev, slack):
    """The parameter tolerance after one more step (see the module docstring)."""
    p = torch_params.astype(np.float64)
    return bound + 2 * EPS * np.abs(p) + slack * np.abs(p - torch_prev)


def where(seq_id, t, what):
    seq = SEQUENCES[seq_id]
    return f"{seq_id} step {t} ({what}); {seq['scaler']} {seq['optimizer']} tags={seq['tags']}"


def compare(seq_id):
    """Walks a sequence, comparing everything but the known mismatches."""
    seq = SEQUENCES[seq_id]
    h, k = seq["scaler"], seq["scaler"]["accumulation_steps"]
    slack = UPDATE_SLACK[seq["optimizer"]["name"]]
    scales, trackers, skipped, seen, params = replay(seq_id)
    kinds = classify(seq_id)

    torch_scale = f32(h["init_scale"])
    torch_prev = flat(seq["params0"]).astype(np.float64)
    bound = np.zeros_like(torch_prev)
    floored = False  # (a): mpjax's scale is at the floor and torch's below it
    above_top = False  # an applied step above 2**126 was seen: (d) from there on
    for t, step in enumerate(seq["steps"]):
        kind = kinds[t]
        tag = where(seq_id, t, kind or "ordinary")
        found_inf = step["found_inf"]
        new_torch_scale = decode(step["scale"])[0]
        torch_params = flat(step["params"])
        torch_unscaled = flat(step["unscaled"])

        if kind == "b":
            # (b): torch applies an inf; mpjax skips and backs off. The sequence
            # ends here (record.py makes it the last step).
            assert skipped[t] and not found_inf, tag
            backed_off, _ = floor_rule(torch_scale, 0, True, h, seq["mpjax_min_scale"])
            assert scales[t] == backed_off and trackers[t] == 0, tag + ": backoff"
            assert t == len(seq["steps"]) - 1, tag
            return

        # Skip decisions and the tracker.
        assert bool(skipped[t]) == found_inf, tag + ": skip decision"
        assert int(trackers[t]) == step["tracker"], tag + ": growth tracker"
        # The scale.
        if floored:
            expected, _ = floor_rule(
                scales[t - 1], trackers[t - 1], found_inf, h, DEFAULT_MIN_SCALE
            )
            assert scales[t] == expected, tag + ": scale with the floor"
            assert np.isfinite(params[t]).all(), tag
        elif new_torch_scale < f32(seq["mpjax_min_scale"]):
            # (a): torch's scale went below mpjax's floor: mpjax is at the floor.
            assert seq["mpjax_min_scale"] == DEFAULT_MIN_SCALE, tag
            assert scales[t] == f32(DEFAULT_MIN_SCALE), tag + ": scale at the floor"
            floored = True
        else:
            assert scales[t] == new_torch_scale, (
                f"{tag}: scale {scales[t]!r} != torch {new_torch_scale!r}"
            )
        if kind == "d":
            above_top = True  # (d): torch's gradients have 21-22 bits from here on
        if floored:
            continue

        # Unscaled gradients, on applied steps.
        if not found_inf:
            if kind == "d":
                np.testing.assert_allclose(
                    seen[t], torch_unscaled, rtol=ABOVE_TOP_RTOL, atol=0, err_msg=tag
                )
            elif k > 1:  # (c)
                err = np.abs(seen[t].astype(np.float64) - torch_unscaled)
                limit = accumulation_bound(step, k, torch_scale)
                assert (err <= limit).all(), f"{tag}: unscaled {seen[t]} vs {torch_unscaled}"
            else:
                assert np.array_equal(seen[t].view(np.uint32), torch_unscaled.view(np.uint32)), (
                    f"{tag}: unscaled gradients {seen[t]!r} != torch {torch_unscaled!r}"
                )
        # Parameters.
        bound = param_bound(
            bound, torch_params, torch_prev, slack + (ABOVE_TOP_RTOL if above_top else 0.0)
        )
        err = np.abs(params[t].astype(np.float64) - torch_params)
        assert (err <= bound).all(), (
            f"{tag}: params {params[t]!r} vs torch {torch_params!r}, "
            f"error {err!r} > bound {bound!r}"
        )
        torch_scale, torch_prev = new_torch_scale, torch_params.astype(np.float64)


@functools.cache
def one_step(k):
    """One effective step of ``grad_scaler(chain(probe, sgd(1.0)))`` from a given
    scale: (skipped, the unscaled gradients inner saw). For the known mismatches,
    which depend only on the scale and that step's gradients."""
    tx = grad_scaler(
        optax.chain(probe(), optax.sgd(1.0)),
        min_scale=NO_FLOOR,
        accumulation_steps=k,
        accumulation="mean",
    )

    @jax.jit
    def run(state, micro_grads):
        def body(state, g):
            return tx.update(unscale(unflat(g), state.scale), state)[1], None

        state = lax.scan(body, state, micro_grads)[0]
        seen = jnp.concatenate([x.ravel() for x in state.inner_state[0]])
        return state.last_step_skipped, seen

    def step(scale, micro_grads):
        state = grad_scaler(
            optax.chain(probe(), optax.sgd(1.0)),
            init_scale=float(scale),
            min_scale=NO_FLOOR,
            accumulation_steps=k,
            accumulation="mean",
        ).init(unflat(np.zeros(sum(SIZES), np.float32)))
        skipped, seen = run(state, np.stack([flat(g) for g in micro_grads]))
        return bool(skipped), np.asarray(seen)

    return step


def scales_before(seq):
    """torch's scale during each step."""
    return [f32(seq["scaler"]["init_scale"])] + [decode(st["scale"])[0] for st in seq["steps"]]


# --------------------------------------------------------------------------
# Tests.


def test_record_is_what_the_test_expects():
    assert DATA["torch_version"].startswith("2.")
    assert len(SEQUENCES) >= 300 and DATA["n_steps"] == sum(
        len(s["steps"]) for s in SEQUENCES.values()
    )
    tags = collections.Counter(t for s in SEQUENCES.values() for t in s["tags"])
    for tag in ("inject", "f16_leaf", "floor", "unscale_overflow", "above_2**126"):
        assert tags[tag] >= 5, tag
    assert {s["optimizer"]["name"] for s in SEQUENCES.values()} == {"sgd", "adam"}
    assert {s["scaler"]["accumulation_steps"] for s in SEQUENCES.values()} == {1, 2, 3, 4}
    skipped = sum(st["found_inf"] for s in SEQUENCES.values() for st in s["steps"])
    assert 0.1 < skipped / DATA["n_steps"] < 0.5
    # Every sequence tagged with a deliberate difference shows it.
    for seq_id, seq in SEQUENCES.items():
        if "unscale_overflow" in seq["tags"]:
            assert classify(seq_id)[-1] == "b", seq_id
        if "accumulation_sum_overflow" in seq["tags"]:
            assert classify(seq_id)[-1] == "sum_overflow", seq_id


@pytest.mark.parametrize("config", sorted(BY_CONFIG))
def test_matches_torch(config):
    """Every sequence of `config` (one compilation); all failures are reported,
    the first ones in full."""
    failures = []
    for seq_id in BY_CONFIG[config]:
        try:
            compare(seq_id)
        except AssertionError as e:
            failures.append(f"{seq_id}: {e}")
    assert not failures, (
        f"{len(failures)} of {len(BY_CONFIG[config])} sequences differ from torch "
        f"({', '.join(f.split(':')[0] for f in failures)}):\n" + "\n\n".join(failures[:3])
    )


@pytest.mark.parametrize("seq_id", [i for i in SEQUENCES if "d" in classify(i)])
def test_unscale_above_2_126(seq_id):
    """(d): at an applied step above 2**126, mpjax's unscaled gradients, from
    torch's scale, are torch's to a relative 2**-20."""
    seq = SEQUENCES[seq_id]
    before = scales_before(seq)
    for t, kind in enumerate(classify(seq_id)):
        if kind == "d":
            step = seq["steps"][t]
            skipped, seen = one_step(1)(before[t], step["micro_grads"])
            assert not skipped, where(seq_id, t, "d")
            np.testing.assert_allclose(
                seen,
                flat(step["unscaled"]),
                rtol=ABOVE_TOP_RTOL,
                atol=0,
                err_msg=where(seq_id, t, "d"),
            )


@pytest.mark.parametrize("seq_id", [i for i in SEQUENCES if "sum_overflow" in classify(i)])
def test_accumulation_near_the_float32_maximum(seq_id):
    """At the sequence's last step, from torch's scale, mpjax steps as torch does."""
    seq = SEQUENCES[seq_id]
    t = len(seq["steps"]) - 1
    step = seq["steps"][t]
    assert classify(seq_id)[t] == "sum_overflow"
    k = seq["scaler"]["accumulation_steps"]
    scale = scales_before(seq)[t]
    skipped, seen = one_step(k)(scale, step["micro_grads"])
    assert skipped == step["found_inf"], where(seq_id, t, "sum_overflow")
    err = np.abs(seen.astype(np.float64) - flat(step["unscaled"]))
    assert (err <= accumulation_bound(step, k, scale)).all(), where(seq_id, t, "sum_overflow")

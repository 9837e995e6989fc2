"""Records torch.amp.GradScaler trajectories for tests/test_torch_reference.py.

Run with a Python that has torch (a CPU build; the file in the repository was
recorded with torch 2.13.0+cpu) and numpy, in a scratch environment: mpjax and
jax are not needed, and the test suite never imports torch, it only reads the
JSON written here::

    python3 -m venv torch-env
    torch-env/bin/pip install numpy torch-2.13.0+cpu-...-linux_x86_64.whl
    torch-env/bin/python tests/torch_reference/record.py

The output, ``scaler_sequences.json`` next to this file, is reproducible: every
sequence draws its numbers from ``numpy.random.default_rng`` seeded with its
configuration and sequence index, and torch's CPU kernels are deterministic.
(Parameters after an optimizer step may still differ by an ulp between CPUs
with different vector units; the test compares them with a tolerance.)

Gradients do not come from autograd. Each step the scaled gradient of every
parameter is made here, ``float32(u * scale)`` with ``u`` a random "true"
gradient and ``scale`` torch's current scale (so a large scale overflows
naturally, as in training), optionally rounded through float16 for one leaf
(whose values then overflow at 65504, as float16 activations' gradients do),
plus injected inf / -inf / NaN values and a few finite extremes. It is written
into ``p.grad`` and the step is torch's recipe::

    scaler.unscale_(opt)   # recorded: p.grad now holds the unscaled gradients
    scaler.step(opt)       # skipped iff found_inf
    scaler.update()

With accumulation over k micro-batches, torch's recipe divides the loss by k:
``scaler.scale(loss / k).backward()`` per micro-batch adds ``grad / k`` into
``p.grad``. Here micro-batch i's scaled gradient of the *undivided* loss, g_i, is
drawn as above, and ``float32(g_i / k)`` (a torch float32 division) is added
into ``p.grad`` (``p.grad = g_1 / k``, then ``p.grad += g_i / k``), which is
what the backward pass of the divided loss gives when the division is the last
operation. mpjax's ``grad_scaler(..., accumulation_steps=k)`` takes the g_i
themselves and divides their sum by k.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch

OUT = pathlib.Path(__file__).with_name("scaler_sequences.json")
SHAPES = [(3,), (2, 2), (1,)]
TORCH_NO_FLOOR = 2.0**-126  # the min_scale mpjax is given to behave as torch (no floor)

FORMAT = """\
Trajectories of torch.amp.GradScaler (CPU) around torch.optim.SGD / Adam
(foreach=False), recorded by tests/torch_reference/record.py; replayed through
mpjax.grad_scaler by tests/test_torch_reference.py.

Every float32 number is written exactly, as the 8 hex digits of its IEEE bits
(big-endian, e.g. "3f800000" is 1.0, "7f800000" inf, "7fc00000" NaN); a tensor
is one string of such words separated by spaces, in row-major (C) order, and a
parameter tree is a list of such strings, one per leaf, shaped as "shapes".
Hyperparameters are JSON numbers (Python floats: the doubles handed to torch).

Per sequence:
  id, config: names; sequences of one config share every hyperparameter except
    init_scale (mpjax compiles one update per config).
  scaler: GradScaler's init_scale, growth_factor, backoff_factor,
    growth_interval, and accumulation_steps k (micro-batches per optimizer step).
  mpjax_min_scale: the min_scale to give mpjax.grad_scaler: 2**-126 (torch has
    no floor) or, for the sequences that test mpjax's floor, its default 2**-14.
  optimizer: {"name": "sgd", "lr", "momentum"} (dampening 0, no nesterov, no
    weight decay) or {"name": "adam", "lr", "betas", "eps"} (no amsgrad, no
    weight decay).
  params0: the parameters before the first step.
  tags: what the sequence exercises ("inject" inf/NaN, "f16_leaf",
    "unscale_overflow", "accumulation_sum_overflow", "floor", "above_2**126").
  steps: one entry per optimizer step (per effective batch), in order:
    micro_grads: k trees; micro-batch i's scaled gradients of the UNdivided
      loss, g_i. This is what mpjax.grad_scaler(..., accumulation_steps=k).update
      is given, one call per micro-batch. For k == 1, p.grad = g_1.
    torch_grad (only k > 1): p.grad before unscale_: the float32 sum, in micro-
      batch order, of float32(g_i / k) (torch.div by the Python int k), which is
      what torch's recipe scaler.scale(loss / k).backward() accumulates.
    injected: list of [micro, leaf, flat index, value] put into g_i (value one
      of "inf", "-inf", "nan" or a finite float's repr); informational.
    found_inf: torch's found_inf (non-finite p.grad before unscaling):
      the optimizer step was skipped.
    unscaled: p.grad after scaler.unscale_(opt): p.grad * float32(1/double(scale)).
    scale, tracker: GradScaler's _scale (float32) and _growth_tracker after
      scaler.update(); the scale during a step is the previous step's (or
      float32(init_scale) for the first).
    params: the parameters after scaler.step(opt).
"""


# --------------------------------------------------------------------------
# Encoding.


def hex32(a) -> str:
    a = np.ascontiguousarray(np.asarray(a, np.float32)).reshape(-1)
    return " ".join(f"{int(b):08x}" for b in a.view(np.uint32))


def dec32(words: str) -> np.ndarray:
    return (
        np.frombuffer(bytes.fromhex(words.replace(" ", "")), ">u4").view(">f4").astype(np.float32)
    )


def tree_hex(tensors) -> list[str]:
    return [hex32(t.detach().numpy() if isinstance(t, torch.Tensor) else t) for t in tensors]


# --------------------------------------------------------------------------
# Configurations: everything mpjax compiles into its update, so one jit each.


def SGD(lr, momentum):
    return {"name": "sgd", "lr": lr, "momentum": momentum}


def ADAM(lr, b1, b2, eps):
    return {"name": "adam", "lr": lr, "betas": [b1, b2], "eps": eps}


# (growth_factor, backoff_factor, growth_interval, k, optimizer, kind)
CONFIGS = [
    (2.0, 0.5, 2000, 1, SGD(0.1, 0.0), "plain"),
    (2.0, 0.5, 1, 1, SGD(0.05, 0.9), "top"),
    (2.0, 0.5, 2, 1, ADAM(1e-3, 0.9, 0.999, 1e-8), "plain"),
    (1.1, 0.9, 1, 1, SGD(0.01, 0.9), "plain"),
    (1.1, 0.5, 3, 1, ADAM(1e-2, 0.8, 0.99, 1e-6), "plain"),
    (1.5, 0.25, 2, 1, SGD(0.2, 0.0), "plain"),
    (1.5, 0.9, 5, 1, ADAM(3e-4, 0.9, 0.98, 1e-7), "top"),
    (3.0, 0.5, 1, 1, SGD(0.1, 0.9), "top"),
    (3.0, 0.25, 3, 1, ADAM(1e-3, 0.5, 0.9, 1e-8), "plain"),
    (1.1, 0.25, 2000, 2, SGD(0.1, 0.9), "plain"),
    (2.0, 0.9, 5, 2, ADAM(5e-3, 0.9, 0.999, 1e-8), "plain"),
    (2.0, 0.5, 3, 3, SGD(0.05, 0.0), "plain"),
    (1.5, 0.25, 2, 3, ADAM(1e-2, 0.9, 0.99, 1e-8), "plain"),
    (3.0, 0.5, 1, 4, SGD(0.1, 0.9), "plain"),
    (2.0, 0.5, 2, 1, SGD(0.1, 0.9), "floor"),
    (2.0, 0.25, 1, 4, ADAM(2e-3, 0.9, 0.999, 1e-8), "floor"),
]
SEQUENCES_PER_CONFIG = 19

# fmt: off
INIT_SCALES = [
    2.0**16, 2.0**10, 8.0, 1.0, 0.125, 1000.0, 3.7e4, 65504.0, 12345.678, 0.3, 7.0,
    2.0**24, 2.0**-20, 1.3 * 2.0**-20, 2.0**-17,
]
# fmt: on
TOP_SCALES = [2.0**120, 1.7 * 2.0**120, 2.0**125, 1.5 * 2.0**126, 2.0**127, 3.0e38, 1.2e38]
FLOOR_SCALES = [2.0**-10, 2.0**-12, 2.0**-13, 2.0**-14, 0.001]


def make_sequence(cfg_index, seq_index):
    growth, backoff, interval, k, opt_cfg, kind = CONFIGS[cfg_index]
    rng = np.random.default_rng([20250611, cfg_index, seq_index])
    tags = []

    # The flavour of this sequence.
    special = None
    if kind == "floor":
        init_scale = FLOOR_SCALES[seq_index % len(FLOOR_SCALES)]
        tags.append("floor")
    elif kind == "top" and seq_index < 8:
        init_scale = TOP_SCALES[seq_index % len(TOP_SCALES)]
    else:
        init_scale = INIT_SCALES[(seq_index * 7 + cfg_index) % len(INIT_SCALES)]
        if seq_index == 17:
            special = "unscale_overflow"
            # Small enough to stay below 1 / k over 8 steps of growth.
            init_scale = [2.0**-20, 2.0**-17, 1.3 * 2.0**-20, 2.0**-12][cfg_index % 4]
        if seq_index == 18 and k > 1:
            special = "accumulation_sum_overflow"
            init_scale = [2.0**16, 3.7e4, 2.0**12][cfg_index % 3]
    if special:
        tags.append(special)
    # Special sequences are short; the others 5 to 29 steps, 13 on average.
    n_steps = int(rng.integers(5, 9)) if special else 5 + int(25 * rng.random() ** 2)
    f16_leaf = bool(rng.random() < 0.3) and kind != "top" and not special
    if f16_leaf:
        tags.append("f16_leaf")
    # Magnitudes of the true gradients: small near the top of float32's range so
    # that scales around 2**127 are reached and left by natural overflow.
    log_mag = (-3.0, -0.5) if kind == "top" else (-2.0, 1.0)
    inject_steps = set()
    if kind == "floor":
        first = int(rng.integers(1, 4))
        inject_steps = set(range(first, n_steps)) - {int(rng.integers(first, n_steps))}
    elif rng.random() < 0.7 and not special:
        inject_steps = set(rng.choice(n_steps, size=int(rng.integers(1, 5)), replace=True).tolist())

    # torch objects.
    params0 = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in params0]
    if opt_cfg["name"] == "sgd":
        opt = torch.optim.SGD(
            params,
            lr=opt_cfg["lr"],
            momentum=opt_cfg["momentum"],
            dampening=0.0,
            nesterov=False,
            weight_decay=0.0,
            foreach=False,
        )
    else:
        opt = torch.optim.Adam(
            params,
            lr=opt_cfg["lr"],
            betas=tuple(opt_cfg["betas"]),
            eps=opt_cfg["eps"],
            weight_decay=0.0,
            amsgrad=False,
            foreach=False,
        )
    scaler = torch.amp.GradScaler(
        "cpu",
        init_scale=init_scale,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
    )
    # GradScaler creates its scale tensor lazily, in scale(); the loss is not
    # otherwise needed as the gradients are set directly.
    scaler.scale(torch.zeros(()))

    steps = []
    for t in range(n_steps):
        scale = float(scaler._scale.item())
        last = t == n_steps - 1
        micro_grads, injected = [], []
        for i in range(k):
            g = []
            for leaf, shape in enumerate(SHAPES):
                u = rng.standard_normal(shape) * 10.0 ** rng.uniform(*log_mag, size=shape)
                if rng.random() < 0.1:
                    u.reshape(-1)[rng.integers(u.size)] = 0.0
                with np.errstate(over="ignore"):
                    x = u * scale  # double, as the true gradient times the scale
                    if f16_leaf and leaf == 2:
                        x = x.astype(np.float16)
                    g.append(np.asarray(x, np.float32).copy())
            if t in inject_steps and (kind == "floor" or rng.random() < 0.8 or i == k - 1):
                leaf = int(rng.integers(len(SHAPES)))
                idx = int(rng.integers(g[leaf].size))
                value = ["inf", "-inf", "nan"][int(rng.integers(3))]
                g[leaf].reshape(-1)[idx] = float(value)
                injected.append([i, leaf, idx, value])
            if last and special == "unscale_overflow" and i == k - 1:
                # Finite scaled gradient, non-finite once divided by a scale < 1
                # (in the last micro-batch only: not an overflow of the sum).
                g[0].reshape(-1)[1] = np.float32(3.0e38)
                injected.append([i, 0, 1, repr(3.0e38)])
            if last and special == "accumulation_sum_overflow":
                # Each g_i and each g_i / k is finite and so is torch's sum of
                # the g_i / k, but the sum of the g_i overflows float32.
                v = 2.5e38 if k == 2 else 1.5e38
                g[1].reshape(-1)[2] = np.float32(v)
                injected.append([i, 1, 2, repr(v)])
            micro_grads.append(g)

        for i, g in enumerate(micro_grads):
            for p, gl in zip(params, g):
                contribution = torch.from_numpy(gl.copy())
                if k > 1:
                    contribution = torch.div(contribution, k)
                if p.grad is None:
                    p.grad = contribution
                else:
                    p.grad += contribution
        torch_grad = tree_hex([p.grad.clone() for p in params]) if k > 1 else None
        scaler.unscale_(opt)
        unscaled = tree_hex([p.grad.clone() for p in params])
        found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        found_inf = bool(sum(v.item() for v in found.values()))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        new_scale = float(scaler._scale.item())
        if last and special:
            unscaled_finite = all(np.isfinite(dec32(x)).all() for x in unscaled)
            # The special case must have happened as intended (else change the seeds).
            assert not found_inf, (cfg_index, seq_index)
            expected = special == "accumulation_sum_overflow"
            assert unscaled_finite == expected, (cfg_index, seq_index)
        if scale > 2.0**126 and "above_2**126" not in tags:
            tags.append("above_2**126")
        if injected and "inject" not in tags:
            tags.append("inject")
        step = {"micro_grads": [tree_hex(g) for g in micro_grads]}
        if torch_grad is not None:
            step["torch_grad"] = torch_grad
        if injected:
            step["injected"] = injected
        step.update(
            found_inf=found_inf,
            unscaled=unscaled,
            scale=hex32(np.float32(new_scale)),
            tracker=int(scaler._growth_tracker.item()),
            params=tree_hex(params),
        )
        steps.append(step)

    return {
        "id": f"c{cfg_index:02d}s{seq_index:02d}",
        "config": f"c{cfg_index:02d}",
        "scaler": {
            "init_scale": init_scale,
            "growth_factor": growth,
            "backoff_factor": backoff,
            "growth_interval": interval,
            "accumulation_steps": k,
        },
        "mpjax_min_scale": 2.0**-14 if kind == "floor" else TORCH_NO_FLOOR,
        "optimizer": opt_cfg,
        "params0": tree_hex(params0),
        "tags": tags,
        "steps": steps,
    }


def main():
    torch.manual_seed(0)
    torch.set_flush_denormal(False)
    sequences = [
        make_sequence(c, s) for c in range(len(CONFIGS)) for s in range(SEQUENCES_PER_CONFIG)
    ]
    header = {
        "format": FORMAT,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "shapes": [list(s) for s in SHAPES],
        "n_sequences": len(sequences),
        "n_steps": sum(len(s["steps"]) for s in sequences),
        "n_micro_batches": sum(
            len(s["steps"]) * s["scaler"]["accumulation_steps"] for s in sequences
        ),
    }
    # One sequence per line: small diffs when re-recorded.
    text = json.dumps(header, indent=1)[:-2] + ',\n "sequences": [\n'
    text += ",\n".join(json.dumps(s, separators=(",", ":")) for s in sequences)
    text += "\n ]\n}\n"
    OUT.write_text(text)
    print(f"{OUT}: {len(sequences)} sequences, {header['n_steps']} steps, {len(text)} bytes")


if __name__ == "__main__":
    main()

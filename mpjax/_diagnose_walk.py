"""The evaluator behind `mpjax.diagnose`: a training step's jaxpr run equation by
equation on concrete values, with every floating output checked.

`jax.make_jaxpr` of ``value_and_grad`` gives one jaxpr holding the forward and the
backward pass. An equation belongs to the backward pass when its name stack, or
that of an equation enclosing it, carries JAX's ``transpose(...)`` transform
(``transpose(jvp(mpjax_autocast_float16))/Net/block_1``); forward equations carry
``jvp(...)`` only. Within it, an equation the gradient's seed does not reach
recomputes the forward pass (`jax.checkpoint`) and is reported as forward. Calls
(`jit`, custom derivatives, `checkpoint`, the `linear_call` that transposes
autocast's products) and the taken branch of a `cond` are evaluated equation by
equation; `scan` and `while` run as one unit, and a `scan` whose outputs are the
first non-finite values is run again one iteration at a time to find the equation
inside.
"""

from __future__ import annotations

import math
import os
import re
import sysconfig
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mpjax import _compat

# Primitives whose single sub-jaxpr computes the outputs from the same inputs.
_CALLS = frozenset(
    {
        "jit",
        "pjit",
        "closed_call",
        "core_call",
        "custom_jvp_call",
        "custom_vjp_call",
        "custom_vjp_call_jaxpr",
        "linear_call",
        "checkpoint",
        "remat",
        "remat2",
    }
)
# autocast's regions, diagnose's own scope, and the calls autocast inlines
_OWN = re.compile(r"^(mpjax_\w*|jit\(.*\))$")
_JAX_SCOPES = frozenset({"rematted_computation"})  # jax.checkpoint's recomputation
# JAX's transforms (jvp(Net)) and calls; a scope of the user's may hold parentheses too
_WRAPPED = re.compile(r"^(jvp|transpose|vmap|jit)\((.*)\)$")
_MPJAX_DIR = os.path.dirname(os.path.abspath(__file__))
# Where `mpjax.diagnose` calls the loss: frames beyond are the caller's, not the loss's.
_DIAGNOSE_FILES = tuple(os.path.join(_MPJAX_DIR, f) for f in ("diagnose.py", "_diagnose_args.py"))
_JAX_DIR = os.path.dirname(os.path.abspath(jax.__file__))
_LIBRARY_DIRS = tuple(
    {os.path.abspath(p) for k, p in sysconfig.get_paths().items() if k in ("stdlib", "platstdlib")}
)


class Stats(NamedTuple):
    """Finiteness and range of one floating value."""

    finite: bool
    max_abs: float  # of its finite elements; 0.0 if none
    min_abs: float  # smallest non-zero finite magnitude; inf if none
    low: bool  # float16 or bfloat16


def stats(x) -> Stats | None:
    """The `Stats` of a floating array (copied to the host); None otherwise."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        x = np.asarray(x)
        dtype = x.dtype
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    wide = np.float64 if np.dtype(dtype).itemsize > 4 else np.float32
    a = np.abs(np.asarray(x).astype(wide))
    finite = np.isfinite(a)
    all_finite = bool(finite.all())
    vals = a if all_finite else a[finite]
    nonzero = vals[vals > 0]
    return Stats(
        all_finite,
        float(vals.max()) if vals.size else 0.0,
        float(nonzero.min()) if nonzero.size else math.inf,
        np.dtype(dtype).itemsize == 2,
    )


def module_path(stack: str) -> str:
    """A name stack without JAX's transforms, mpjax's own scopes and the calls
    autocast inlines (``jit(norm)``, a jitted function's equations):
    ``transpose(jvp(mpjax_autocast_float16))/Net/block_1/jit(_where)`` -> ``Net/block_1``.

    A stack may hold a second, full one: a custom derivative's rule or a
    `jax.checkpoint`'s recomputation traced under its caller's scope
    (``transpose(jvp(Net))/mlp/jvp(Net)/mlp``). It starts at a scope wrapped in a
    transform and names the caller's modules again: that one is the path."""
    parts = stack.split("/")
    for i in range(len(parts) - 1, 0, -1):
        if _WRAPPED.match(parts[i]) and not parts[i].startswith("jit("):
            outer, inner = _modules(parts[:i]), _modules(parts[i:])
            if inner[: len(outer)] == outer:
                return "/".join(inner)
    return "/".join(_modules(parts))


def _modules(parts: list) -> list:
    return [p for p in map(_unwrapped, parts) if p and p not in _JAX_SCOPES and not _OWN.match(p)]


def _unwrapped(part: str) -> str:
    """A scope without the transforms wrapping it: ``transpose(jvp(Net))`` -> ``Net``;
    an inlined call's ``jit(...)`` is kept."""
    while (m := _WRAPPED.match(part)) and m.group(1) != "jit":
        part = m.group(2)
    return part


def is_backward(stack: str) -> bool:
    return "transpose(" in stack


def _is_library(name: str) -> bool:
    if name.startswith("<frozen") or "site-packages" in name or "dist-packages" in name:
        return True
    if name.startswith("<"):  # <stdin>, <doctest ...>: the user's
        return False
    return os.path.abspath(name).startswith((_MPJAX_DIR, _JAX_DIR, *_LIBRARY_DIRS))


class Where(NamedTuple):
    """The user's line an equation came from, and the library line inside it."""

    file: str
    line: int
    function: str
    library: str  # ``file:line (function)`` of the innermost frame, if in a library


def _library_path(path: str) -> str:
    for marker in ("site-packages", "dist-packages"):
        if marker in path:
            return path.split(marker, 1)[1].lstrip("/\\")
    return short_path(path)


def where(eqn, callers=()) -> Where:
    """Frames innermost first: the first outside JAX and mpjax is the library line
    (if in an installed package), the first outside any package the user's line.
    Frames beyond `mpjax.diagnose`'s own call of the loss are the caller's: not
    the loss's lines. An equation of a library's jitted function
    (``jnp.linalg.cholesky``'s) has no user frame: it takes that of the innermost
    of its `callers` (the equations calling the jaxprs it is in) that has one."""
    found = _where(eqn)
    for call in reversed(callers):
        if found.file:
            break
        outer = _where(call)
        found = outer._replace(library=found.library or outer.library)
    return found


def _where(eqn) -> Where:
    frames = getattr(eqn.source_info.traceback, "frames", None) or ()
    library = ""
    for frame in frames:
        path = os.path.abspath(frame.file_name)
        if path in _DIAGNOSE_FILES:
            break
        if path.startswith((_MPJAX_DIR, _JAX_DIR)):
            continue
        if not _is_library(frame.file_name):
            return Where(frame.file_name, frame.line_num, frame.function_name, library)
        if not library:
            library = f"{_library_path(path)}:{frame.line_num} ({frame.function_name})"
    return Where("", 0, "", library)


def _evaluate(eqn, vals) -> list:
    """`eqn` on concrete `vals`, each distinct equation jitted once (as eager evaluation
    jits each) but with `_compat.fast_compile_options`: a first `diagnose` call is
    mostly compiling its equations."""
    out = _compat.bound(eqn, eqn.params, _fast_jit)(*vals)
    return list(out) if eqn.primitive.multiple_results else [out]


def _fast_jit(fun):
    return jax.jit(fun, compiler_options=_compat.fast_compile_options())


class Event(NamedTuple):
    """One equation's outputs, as the walk reports them to its observer."""

    eqn: object
    stack: str
    backward: bool
    inputs_finite: bool
    in_stats: tuple
    out_stats: tuple
    ins: list
    outs: list
    inside: str  # "" or where in an opaque unit it was found ("scan step 3")
    callers: tuple = ()  # the equations calling the jaxprs it is in, outermost first
    feeds_loss: bool = True  # False: derivative rules' values (tie counts) no loss reads


def _read(env, v):
    return np.asarray(v.val, dtype=v.aval.dtype) if isinstance(v, _compat.Literal) else env[v]


LOSS, GRADIENTS = frozenset({"loss"}), frozenset({"gradients"})  # what a step's output is


def _feeding(jaxpr, feeds) -> dict:
    """Variable -> which of `feeds` (a set per output of `jaxpr`) it reaches."""
    reach: dict = {}
    for v, f in zip(jaxpr.outvars, feeds):
        if not isinstance(v, _compat.Literal):
            reach[v] = reach.get(v, frozenset()) | f
    for eqn in reversed(jaxpr.eqns):
        f = frozenset().union(*(reach.get(v, ()) for v in eqn.outvars))
        for v in eqn.invars if f else ():
            if not isinstance(v, _compat.Literal):
                reach[v] = reach.get(v, frozenset()) | f
    return reach


def _last_uses(jaxpr) -> dict[int, set]:
    """Equation index -> the variables it reads for the last time (not outputs)."""
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, _compat.Literal):
                last[v] = i
    for v in jaxpr.outvars:
        if not isinstance(v, _compat.Literal):  # a constant output (an unused parameter's 0)
            last.pop(v, None)
    out: dict[int, set] = {}
    for v, i in last.items():
        out.setdefault(i, set()).add(v)
    return out


class Walk:
    """Evaluates a jaxpr and reports every first-order equation to `observe`."""

    def __init__(self, observe, zoom=lambda backward: True):
        self.observe = observe
        self.zoom = zoom  # whether a scan that makes the first inf or NaN is run step by step

    def run(self, jaxpr, consts, args, prefix="", backward=False, inside="", seeded=None,
            feeds=None):  # fmt: skip
        """The outputs of `jaxpr` on `args`. `seeded` flags the arguments the gradient's
        seed (the loss scale) reaches: a backward-pass equation that it does not reach
        recomputes the forward pass (`jax.checkpoint`) and is reported as forward (None:
        every argument may carry it). `feeds`: per output, `LOSS` or `GRADIENTS` (None: LOSS)."""
        return self._run(jaxpr, consts, args, prefix, backward, inside, seeded, (), feeds)[0]

    def _run(self, jaxpr, consts, args, prefix, backward, inside, seeded, callers=(), feeds=None):
        env = {}
        seeded = [True] * len(args) if seeded is None else seeded
        reach = _feeding(jaxpr, feeds or [LOSS] * len(jaxpr.outvars))

        def read(v):
            if isinstance(v, _compat.Literal):
                val = np.asarray(v.val, dtype=v.aval.dtype)
                return val, stats(val), False
            return env[v]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = (c, stats(c), False)
        for v, a, s in zip(jaxpr.invars, args, seeded, strict=True):
            env[v] = (a, stats(a), s)
        dead_after = _last_uses(jaxpr)  # values are let go once read for the last time
        for i, eqn in enumerate(jaxpr.eqns):
            ins = [read(v) for v in eqn.invars]
            for v in dead_after.get(i, ()):
                del env[v]
            own = _compat.name_stack(eqn)
            stack = f"{prefix}/{own}" if prefix and own else prefix or own
            in_seeded = [s for _, _, s in ins]
            back = (backward or is_backward(own)) and any(in_seeded)
            vals = [x for x, _, _ in ins]
            in_stats = tuple(s for _, s, _ in ins if s is not None)
            out_feeds = [reach.get(v, frozenset()) for v in eqn.outvars]
            done = self._eval(eqn, vals, stack, back, inside, in_seeded, callers, out_feeds)
            if done is None:  # not recursed into: a unit of its own
                with _compat.equation_context(eqn):
                    outs = _evaluate(eqn, vals)
                out_seeded = [any(in_seeded)] * len(outs)
                out_stats = tuple(stats(o) for o in outs)
                floats = tuple(s for s in out_stats if s is not None)
                inputs_finite = all(s.finite for s in in_stats)
                if inputs_finite and not all(s.finite for s in floats):
                    self._zoom(eqn, vals, stack, back)  # first, so the inner equation is seen first
                elif inputs_finite:  # its 16-bit values are measured too (the loss scale's)
                    self._zoom(eqn, vals, stack, back, measure=True)
                if inputs_finite:  # a shard_map's inside, measured and searched alike
                    self._shard_map(eqn, vals, stack, back, callers)
                self.observe(
                    Event(
                        eqn, stack, back, inputs_finite, in_stats, floats, vals, outs, inside,
                        callers, LOSS <= frozenset().union(*out_feeds),
                    )
                )
            else:
                outs, out_seeded = done
                out_stats = tuple(stats(o) for o in outs)
            for v, o, s, d in zip(eqn.outvars, outs, out_stats, out_seeded, strict=True):
                env[v] = (o, s, d)
        outs = [read(v) for v in jaxpr.outvars]
        return [o for o, _, _ in outs], [d for _, _, d in outs]

    def _eval(self, eqn, vals, stack, back, inside, seeded, callers, feeds):
        """(outputs, their seed flags) of a call or `cond` evaluated equation by
        equation, else None."""
        name, callers = eqn.primitive.name, (*callers, eqn)
        if name == "cond":
            branches = eqn.params["branches"]
            index = int(np.clip(np.asarray(vals[0]), 0, len(branches) - 1))
            jaxpr, consts = _compat.jaxpr_and_consts(branches[index])
            vals, seeded = vals[1:], seeded[1:]  # the index is no operand
            return self._run(jaxpr, consts, vals, stack, back, inside, seeded, callers, feeds)
        if name not in _CALLS:
            return None
        subs = _compat.sub_jaxprs(eqn.params)
        if len(subs) != 1:
            return None
        jaxpr, consts = _compat.jaxpr_and_consts(subs[0])
        if len(jaxpr.invars) != len(vals) or len(jaxpr.outvars) != len(eqn.outvars):
            return None
        return self._run(jaxpr, consts, vals, stack, back, inside, seeded, callers, feeds)

    def _shard_map(self, eqn, vals, stack, back, callers):
        """The equations of a `shard_map` body, each reported on the values it had on
        every device (stacked along a new first axis): an inf inside that its outputs
        hide (a tanh after it) is found there."""
        if eqn.primitive.name != "shard_map":
            return
        jaxpr, consts = _compat.jaxpr_and_consts(eqn.params["jaxpr"])
        kwargs = _compat.shard_map_kwargs(eqn.params)
        axes = tuple(a for a in kwargs["mesh"].axis_names if a in kwargs["axis_names"])
        held = [*jaxpr.invars, *(v for e in jaxpr.eqns for v in e.outvars)]

        def body(*args):
            env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, args))
            for e in jaxpr.eqns:
                with _compat.equation_context(e):
                    env.update(zip(e.outvars, _compat.bind(e, *(_read(env, v) for v in e.invars))))
            return tuple(env[v][None] for v in held)

        kwargs.update(out_specs=(jax.sharding.PartitionSpec(axes),) * len(held))
        values = dict(zip(held, jax.jit(jax.shard_map(body, **kwargs))(*vals)))
        for e in jaxpr.eqns:
            ins = [_read(values, v) for v in e.invars]
            outs = [values[v] for v in e.outvars]
            in_stats = tuple(s for s in map(stats, ins) if s is not None)
            floats = tuple(s for s in map(stats, outs) if s is not None)
            finite = all(s.finite for s in in_stats)
            inner = f"{stack}/{_compat.name_stack(e)}".strip("/")
            self.observe(
                Event(e, inner, back, finite, in_stats, floats, ins, outs, "inside shard_map",
                      (*callers, eqn))
            )

    def _zoom(self, eqn, vals, stack, back, measure=False):
        """A scan run again, one iteration at a time: to report the equation inside
        that made the first non-finite values, or to `measure` the values inside."""
        if eqn.primitive.name != "scan" or not (measure or self.zoom(back)):
            return
        num_consts, num_carry = _compat.scan_counts(eqn.params)
        jaxpr, consts = _compat.jaxpr_and_consts(eqn.params["jaxpr"])
        length, reverse = eqn.params["length"], eqn.params["reverse"]
        fixed = vals[:num_consts]
        carry = vals[num_consts : num_consts + num_carry]
        xs = vals[num_consts + num_carry :]
        for i in range(length):
            t = length - 1 - i if reverse else i
            outs = self.run(
                jaxpr, consts, [*fixed, *carry, *(x[t] for x in xs)], stack, back, f"scan step {t}"
            )
            carry = outs[:num_carry]
            if not all(s is None or s.finite for s in map(stats, carry)):
                return


def short_path(path: str) -> str:
    """A source file as a reader finds it: relative to the working directory if
    inside it, else its last two components."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    if not rel.startswith(".."):
        return rel
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])

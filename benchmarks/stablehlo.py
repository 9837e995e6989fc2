"""Precision coverage read off the lowered StableHLO of a jitted function.

The StableHLO that ``jax.jit(step).lower(...)`` produces is what XLA receives:
every ``stablehlo.dot_general`` and ``stablehlo.convolution`` names its operand
types, so the share of matrix FLOPs on 16-bit values can be counted there, after
every JAX transformation (autodiff, the optimizer) has run. An operand that is a
``stablehlo.convert`` up from 16 bits holds 16-bit values: that is how the backward
products of a product kept at a float32 result appear (autocast's default
``reduce_dtype``), and on GPUs they carry a 16-bit dot algorithm. (The compiled
HLO is the wrong place on a CPU: XLA CPU rewrites 16-bit dots as
convert -> float32 dot -> convert.)

Converts between floating types are counted with the elements they convert. Among
them, a convert back down of a value converted up from the same 16-bit type gives
back the very values it started from: XLA's algebraic simplifier replaces such an
exact round trip by its source, so it moves nothing in the compiled program. They
are counted apart (`Coverage.round_trips`).

Nested jitted functions lower to private ``func.func``s reached by ``call``; each
op is weighted by how many times its function is called from ``main``. Loop
bodies (``stablehlo.while``) count once; the training steps here have no loops
around matrix products.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Container

_FUNC = re.compile(r"func\.func\s+(?:public|private)?\s*@([\w.$-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
_TENSOR = re.compile(r"tensor<([^>]*)>")
_CONTRACT = re.compile(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]")
_CONV_DIMS = re.compile(r"dim_numbers = \[([^\]]*)\]x\[([^\]]*)\]->\[([^\]]*)\]")
_FLOATS = {"f16", "bf16", "f32", "f64"}
LOW = {"f16", "bf16"}


def _tensor(text: str) -> tuple[tuple[int, ...], str]:
    """``'2x16x8xbf16'`` -> ``((2, 16, 8), 'bf16')``; ``'f32'`` -> ``((), 'f32')``."""
    *dims, dtype = text.split("x")
    return tuple(int(d) for d in dims), dtype


def _signature(line: str) -> tuple[list, list]:
    """(operand types, result types) from an op's trailing ``: (...) -> ...``."""
    sig = line.rsplit(" : ", 1)[-1]
    ins, _, outs = sig.partition("->")
    return (
        [_tensor(t) for t in _TENSOR.findall(ins)],
        [_tensor(t) for t in _TENSOR.findall(outs or ins)],
    )


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


_OPERANDS = re.compile(r"=\s*stablehlo\.\w+\s*\(?(%[\w#.]+),\s*(%[\w#.]+)")
_RESULT = re.compile(r"^(%[\w#.]+)(?::\d+)?\s*=")
_CONVERT_OPERAND = re.compile(r"stablehlo\.convert\s+(%[\w#.]+)")


def _held(line: str, types: list[str], upcast: Container[str]) -> list[str]:
    """The operand types of a product, with upcasts from 16 bits read as 16 bits."""
    m = _OPERANDS.search(line)
    if not m:
        return types
    return ["bf16" if name in upcast else t for name, t in zip(m.groups(), types)]


def dot_flops(line: str, upcast: Container[str] = frozenset()) -> tuple[int, bool]:
    """(FLOPs, whether both operands hold 16-bit values) of a ``stablehlo.dot_general``."""
    (lhs, lhs_t), (_, rhs_t) = _signature(line)[0][:2]
    out_shape = _signature(line)[1][0][0]
    m = _CONTRACT.search(line)
    contracted = math.prod(lhs[d] for d in _ints(m.group(1))) if m else 1
    lhs_t, rhs_t = _held(line, [lhs_t, rhs_t], upcast)
    return 2 * math.prod(out_shape) * contracted, lhs_t in LOW and rhs_t in LOW


def conv_flops(line: str, upcast: Container[str] = frozenset()) -> tuple[int, bool]:
    """(FLOPs, whether both operands hold 16-bit values) of a ``stablehlo.convolution``.

    Each output element sums over the kernel's window and input features: the
    kernel's size over its output-feature dimension ``o``.
    """
    (_, lhs_t), (rhs, rhs_t) = _signature(line)[0][:2]
    out_shape = _signature(line)[1][0][0]
    rhs_spec = [s.strip() for s in _CONV_DIMS.search(line).group(2).split(",")]
    per_output = math.prod(rhs) // rhs[rhs_spec.index("o")]
    lhs_t, rhs_t = _held(line, [lhs_t, rhs_t], upcast)
    return 2 * math.prod(out_shape) * per_output, lhs_t in LOW and rhs_t in LOW


@dataclasses.dataclass
class Coverage:
    matmul_flops: int = 0
    low_precision_flops: int = 0
    n_matmuls: int = 0
    n_low_matmuls: int = 0
    converts: int = 0
    float_converts: int = 0
    """converts between floating types (f32 <-> bf16/f16), the casts mixed precision adds."""
    float_convert_elements: int = 0
    """elements those converts move: their memory traffic, in elements."""
    float_converts_by_shape: dict = dataclasses.field(default_factory=dict)
    """those converts by ``"<shape> <from>-><to>"``: [converts, elements]."""
    round_trips: int = 0
    """of those, converts back down of a value converted up from the same 16-bit
    type: exact round trips, which XLA's simplifier removes (the operand is used)."""
    round_trip_elements: int = 0
    """elements those round trips convert."""

    @property
    def low_precision_fraction(self) -> float:
        return self.low_precision_flops / self.matmul_flops if self.matmul_flops else 1.0

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "low_precision_fraction": self.low_precision_fraction}


def _split_functions(text: str) -> dict[str, list[str]]:
    funcs: dict[str, list[str]] = collections.defaultdict(list)
    current = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            current = m.group(1)
        elif current is not None:
            funcs[current].append(line.strip())
    return funcs


def _multiplicities(funcs: dict[str, list[str]], entry: str = "main") -> dict[str, int]:
    """How many times each function runs per call of `entry` (call graphs are DAGs)."""
    calls = {
        f: collections.Counter(c for line in body for c in _CALL.findall(line))
        for f, body in funcs.items()
    }
    callers = collections.defaultdict(list)
    for f, counter in calls.items():
        for g, n in counter.items():
            callers[g].append((f, n))
    memo: dict[str, int] = {}

    def count(f: str) -> int:
        if f not in memo:
            memo[f] = 1 if f == entry else sum(count(c) * n for c, n in callers[f])
        return memo[f]

    return {f: count(f) for f in funcs}


def coverage(stablehlo_text: str) -> Coverage:
    """Matrix FLOPs by precision and convert counts of a lowered module's text."""
    funcs = _split_functions(stablehlo_text)
    times = _multiplicities(funcs)
    cov = Coverage()
    for f, body in funcs.items():
        k = times[f]
        # results of converts from 16 bits up to float32: the 16-bit type, by result
        upcast: dict[str, str] = {}
        for line in body:
            if "stablehlo.dot_general" in line or "stablehlo.convolution" in line:
                flops, low = (dot_flops if "dot_general" in line else conv_flops)(line, upcast)
                cov.matmul_flops += k * flops
                cov.n_matmuls += k
                if low:
                    cov.low_precision_flops += k * flops
                    cov.n_low_matmuls += k
            elif "stablehlo.convert" in line:
                cov.converts += k
                ((shape, src),) = _signature(line)[0][:1]
                dst = _signature(line)[1][0][1]
                result, operand = _RESULT.search(line), _CONVERT_OPERAND.search(line)
                if (
                    result
                    and operand
                    and (
                        (src in LOW and dst == "f32") or (src == dst and operand.group(1) in upcast)
                    )
                ):
                    upcast[result.group(1)] = upcast.get(operand.group(1), src)
                if src in _FLOATS and dst in _FLOATS and src != dst:
                    elements = k * math.prod(shape)
                    cov.float_converts += k
                    cov.float_convert_elements += elements
                    key = f"{'x'.join(map(str, shape))} {src}->{dst}"
                    entry = cov.float_converts_by_shape.setdefault(key, [0, 0])
                    entry[0] += k
                    entry[1] += elements
                    if dst in LOW and operand and upcast.get(operand.group(1)) == dst:
                        cov.round_trips += k
                        cov.round_trip_elements += elements
    return cov

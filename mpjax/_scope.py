"""The casts made in one trace (`Scope`): each value is cast to a dtype once.

A value moved out of a 16-bit activation (a gather, a slice) and then widened is
moved again from the activation's float32 copy, where another reader made one: its
cotangent and that reader's then add in float32 and round once, as when the user
widened the activation once by hand (``logsumexp(x) - take_along_axis(x, y)``, the
integer-label cross-entropy, whose two cotangents nearly cancel).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mpjax import _compat, policy
from mpjax._casting import F32, convert, dtype_of


class Scope:
    """The casts made in one trace, so each value is cast to a dtype once.

    A loop body gets a child scope. Its `invariant` values are the loop's
    constants, which the body sees by closure: a cast of one is recorded in
    `requests`, so the loop rule can make it once outside the loop instead.
    """

    def __init__(self, parent: Scope | None = None, invariant=()):
        self.parent = parent
        self._casts: dict[tuple[int, np.dtype], tuple[Any, Any]] = {}
        self._invariant = {id(v) for v in invariant}
        self.requests: list[tuple[Any, np.dtype, bool]] = []
        self._accumulators: dict[int, tuple[Any, Any]] = {}
        self._remakes: dict[int, tuple[Any, Callable]] = {}
        self._constants: dict[int, tuple[Any, np.ndarray]] = {}
        self._moves: dict[int, tuple[Any, tuple]] = {}  # `record_move`
        self.magnitudes: dict[tuple, tuple[np.ndarray, float]] = {}  # `_constants.largest`

    def record_constant(self, x, values) -> None:
        """Records the values a weak tracer `x` can take (`mpjax._constants`)."""
        self._constants[id(x)] = (x, values)

    def constant_values(self, x):
        return self._recorded("_constants", id(x))

    def remake_with(self, x, make: Callable) -> None:
        """Records how to make `x` at another dtype: ``make(dtype)`` (a constant's
        broadcast, from its source cast while small)."""
        self._remakes[id(x)] = (x, make)

    def keep_accumulator(self, rounded, accumulator) -> None:
        """Records the float32 accumulator a 16-bit product (or product plus
        bias) was rounded from: a bias added next is added to it, as a cuBLAS
        epilogue adds one, and a residual sum reads it (`mpjax.fusions`). Any
        other float32 reader reads the 16-bit rounding widened, as torch's do: on
        a GPU the product writes its result to memory, and a float32 one is twice
        the bytes (docs/policy.md). `accumulator` may be a function making it (a
        16-bit product's rounding widened, made only if a float32 sum asks; a bias
        add that rounds widens the 16-bit product itself)."""
        self._accumulators[id(rounded)] = (rounded, accumulator)

    def kept_no_accumulator(self, rounded) -> bool:
        """Whether `rounded` is a 16-bit product's result whose float32 value is
        its own widening (`keep_accumulator` was given a function)."""
        entry = self._accumulators.get(id(rounded))
        return entry is not None and callable(entry[1])

    def accumulator(self, rounded):
        """The float32 accumulator `rounded` came from in this scope, or None."""
        entry = self._accumulators.get(id(rounded))
        if entry is None:
            return None
        return entry[1]() if callable(entry[1]) else entry[1]

    def release(self) -> None:
        """Lets go of what the trace recorded: its closures refer back to this
        scope, and the cycle would hold the arrays (weights) until Python's
        cycle collector runs; a closure kept past the trace (a custom_jvp's rule)
        would hold its tracers."""
        for table in (self._casts, self._accumulators, self._remakes, self._constants,
                      self._moves):
            table.clear()
        self.requests.clear()

    def seed(self, x, dtype, cast_x) -> None:
        self._casts[(id(x), np.dtype(dtype))] = (x, cast_x)

    def _recorded(self, table: str, key):
        """The value recorded under `key` in this scope's `table` or an enclosing one's."""
        scope = self
        while scope is not None:
            if key in getattr(scope, table):
                return getattr(scope, table)[key][1]
            scope = scope.parent
        return None

    def cast(self, x, dtype, weak: bool = False, clamp: bool = False):
        """`x` cast to `dtype`, once. Weak values are constants the user wrote for
        float32 (a -1e9 mask): saturated rather than overflow to inf in float16.
        So are a float32 value's mask fills with `clamp` (`convert`'s sentinels):
        the lean policy's operand outvoted by a 16-bit activation (a
        ``finfo(float32).min`` mask is then -65504, as a model cast by hand writes
        it, not -inf, which makes a masked row NaN)."""
        if dtype_of(x) == dtype:
            return x
        dtype = np.dtype(dtype)
        clamp = clamp and dtype_of(x) == np.float32
        key = (id(x), dtype, True) if clamp and not weak else (id(x), dtype)
        made = self._recorded("_casts", key)
        if made is None and key == (id(x), F32):
            made = self._moved_widened(x)
        if made is not None:
            return made
        make = self._recorded("_remakes", key[0])
        if make is not None:
            y = make(dtype)
        else:
            if key[0] in self._invariant and len(key) == 2:
                self.requests.append((x, dtype, weak))
            y = convert(x, dtype, saturate=weak, sentinels=clamp)
        self._casts[key] = (x, y)  # the key's object is kept alive with its id
        return y

    def record_move(self, eqn, vals, outs) -> None:
        """Records that `eqn` moved values of a 16-bit activation without computing
        (`policy.MOVES_ELEMENTS`), so that its result, widened, is moved again from
        the activation's float32 copy where one is made (`cast`)."""
        if eqn.primitive.name not in policy.MOVES_ELEMENTS or len(outs) != 1:
            return
        source = vals[0]
        if dtype_of(source) in policy.LOW_DTYPES and dtype_of(outs[0]) == dtype_of(source):
            self._moves[id(outs[0])] = (outs[0], (eqn, source, vals[1:]))

    def _moved_widened(self, x):
        """`x` at float32, moved again from the float32 copy made of the activation it
        was moved out of (through moves of moves), or None where none was made."""
        chain = []
        while (widened := self._recorded("_casts", (id(x), F32))) is None:
            move = self._recorded("_moves", id(x))
            if move is None:
                return None
            chain.append((x, move))
            x = move[1]
        for x, (eqn, _, rest) in reversed(chain):
            (widened,) = _compat.bind(eqn, widened, *rest)
            self._casts[(id(x), F32)] = (x, widened)
        return widened

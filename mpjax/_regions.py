"""Autocast regions, as the name scopes that `autocast` calls leave on the
equations traced inside them (``mpjax_autocast_float16``, ``mpjax_autocast_off``):
which equation runs under which setting is read back from its name stack."""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np

from mpjax import _compat

_MARKER = "mpjax_autocast_"
SCALED = "mpjax_scaled_value_and_grad"
"""The scope `scaled_value_and_grad` differentiates in: under an enabled region,
autocast would run the backward pass it writes (`region_of` refuses it)."""
_MARKER_RE = re.compile(_MARKER + r"(off|float16|bfloat16)(_lean)?(_reduce_low)?|" + SCALED)


class Region(NamedTuple):
    """The autocast setting in force: the low dtype (None when disabled), whether
    the memory-lean policy is on, and whether products of float32 values round
    their accumulator to the low dtype (``reduce_dtype=dtype``)."""

    dtype: np.dtype | None
    lean: bool = False
    reduce_low: bool = False

    @property
    def scope_name(self) -> str:
        if self.dtype is None:
            return _MARKER + "off"
        suffix = ("_lean" if self.lean else "") + ("_reduce_low" if self.reduce_low else "")
        return _MARKER + self.dtype.name + suffix


def region_of(eqn, outer: Region) -> Region:
    """The region an equation was traced in: the innermost autocast scope, or
    `outer` outside every one. A ValueError for `scaled_value_and_grad` inside an
    enabled region."""
    region = outer
    for found in _MARKER_RE.finditer(_compat.name_stack(eqn)):
        dtype, lean, reduce_low = found.groups()
        if dtype is None and region.dtype is not None:
            raise ValueError(
                "scaled_value_and_grad was called inside an autocast function (a training "
                "step autocast as a whole?): autocast would also run the backward pass it "
                "writes, rounding the weight gradients to 16 bits (scaled, they overflow past "
                "65504). Autocast the loss, not the step: "
                "scaled_value_and_grad(mpjax.autocast(loss_fn), opt_state)."
            )
        if dtype is not None:
            region = Region(None if dtype == "off" else np.dtype(dtype), bool(lean), bool(reduce_low))
    return region

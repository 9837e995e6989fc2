"""How autocast reads a value's dtype and casts it: the helpers every rule shares.

They sit below the interpreter and the rules, which all import them.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = np.dtype(jnp.float32)


def dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def convert(x, dtype: np.dtype, saturate: bool):
    """Casts `x`; a saturating cast maps finite values out of range to +-max."""
    numpy_value = isinstance(x, (np.ndarray, np.generic))
    if saturate and jnp.finfo(dtype).max < jnp.finfo(dtype_of(x)).max:
        hi = jnp.finfo(dtype).max.astype(dtype_of(x))
        if numpy_value:  # a literal: keep its infinities
            x = np.where(np.isinf(x), x, np.clip(x, -hi, hi))
        else:  # computed from literals: one clamp, which XLA folds
            x = lax.clamp(-hi, x, hi)
    if numpy_value:
        return np.asarray(x).astype(dtype)
    return lax.convert_element_type(x, dtype)

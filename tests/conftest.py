"""Shared helpers: a checker that every equation of a program obeys the policy."""

import os

# Eight simulated CPU devices for the data-parallel tests; set before jax starts.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mpjax import _compat, policy  # noqa: E402
from mpjax.policy import Rule  # noqa: E402

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
LOW_DTYPES = [jnp.float16, jnp.bfloat16]


def all_eqns(jaxpr):
    """Every equation of a jaxpr, sub-jaxprs included, in program order."""
    jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in _compat.sub_jaxprs(eqn.params):
            yield from all_eqns(sub)


def float_dtypes(atoms):
    return [
        np.dtype(a.aval.dtype)
        for a in atoms
        if hasattr(a.aval, "dtype") and policy.is_castable(a.aval.dtype)
    ]


def assert_obeys_policy(jaxpr, low):
    """Checks the dtype of every equation against the policy tables.

    Returns the equations by primitive name, for further assertions.
    """
    low = np.dtype(low)
    by_name = {}
    for eqn in all_eqns(jaxpr):
        name = eqn.primitive.name
        by_name.setdefault(name, []).append(eqn)
        ins, outs = float_dtypes(eqn.invars), float_dtypes(eqn.outvars)
        rule = policy.rule_for(name)
        where = f"{name} {ins} -> {outs} at {_compat.user_frame(eqn)}"
        if rule is Rule.LOW:
            assert set(ins) == {low} and set(outs) <= {low}, where
        elif rule is Rule.FLOAT32:
            assert set(ins) <= {F32} and set(outs) <= {F32}, where
        elif rule is Rule.WIDEST and name not in ("select_and_gather_add",):
            assert len(set(ins)) <= 1, where
    return by_name


def dtypes_of(eqns):
    return [tuple(str(v.aval.dtype) for v in e.outvars) for e in eqns]


@pytest.fixture(params=LOW_DTYPES, ids=["float16", "bfloat16"])
def low(request):
    return np.dtype(request.param)


def rel_tol(low):
    """Tolerance for a 16-bit program against float32: a few units of the last place."""
    return 2e-2 if np.dtype(low) == F16 else 6e-2

"""Shared helpers: a checker that every equation of a program obeys the policy."""

import datetime
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading

# Eight simulated CPU devices for the data-parallel tests; set before jax starts.
# The suite tests what programs compute, not how fast they run: it compiles its
# thousands of programs with LLVM's cheapest code generation (HLO optimization,
# fusion included, runs as usual), and on jaxlib 0.10 with XLA's older kernel
# emitters, which compile a small program in half the time (later jaxlibs have only
# the newer). A run that sets the optimization level itself keeps it.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in _FLAGS:
    _FLAGS += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if importlib.metadata.version("jaxlib").startswith("0.10."):
        _FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402

from mpjax import _compat, policy  # noqa: E402
from mpjax.policy import Rule  # noqa: E402


def _reuse_mlir_contexts():
    """jax 0.10 creates an MLIR context, loading its dialects, for every program it
    lowers; later releases reuse a thread's context for ten lowerings. The suite
    lowers thousands of programs: on 0.10 it reuses contexts as later releases do,
    which takes a fifth off the time of a module such as test_autocast_hardening."""
    if hasattr(mlir, "_thread_local_context"):  # the release reuses them itself
        return
    make, local = mlir.make_ir_context, threading.local()

    def make_ir_context():
        context, uses = getattr(local, "last", (None, 10))
        if uses >= 10:
            context, uses = make(), 0
        local.last = (context, uses + 1)
        return context

    mlir.make_ir_context = make_ir_context


_reuse_mlir_contexts()

# JAX's guard against 16-bit sums, for the whole suite: a reduce_sum of float16 or
# bfloat16 values is an error while tracing. Programs autocast makes, and their
# derivatives, have none (tests/test_float32_sums.py); a test that builds one
# outside autocast on purpose lifts the guard with `jax.allow_f16_reductions(True)`.
jax.config.update("jax_allow_f16_reductions", False)

# Many tests compile the same program again (a model per parametrization, the same
# eager primitives): a compilation cache shared by this run's xdist workers turns
# those into reads. The process that starts the run makes it, its workers inherit
# it, and it is removed when the run ends.
_OWN_CACHE = "MPJAX_TESTS_XLA_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["MPJAX_TESTS_XLA_CACHE"] = tempfile.mkdtemp(prefix="mpjax-tests-xla-cache-")
jax.config.update("jax_compilation_cache_dir", os.environ["MPJAX_TESTS_XLA_CACHE"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def pytest_sessionfinish(session):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["MPJAX_TESTS_XLA_CACHE"], ignore_errors=True)


PROPERTY_SEED = int(
    os.environ.get("MPJAX_PROPERTY_SEED", datetime.datetime.now(datetime.UTC).date().toordinal())
)
"""The seed of the property tests' random programs (tests/test_properties.py): the
day's date, or MPJAX_PROPERTY_SEED to repeat another day's run."""


def pytest_report_header(config):
    return f"property tests: MPJAX_PROPERTY_SEED={PROPERTY_SEED}"


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


def value_dtypes(jaxpr) -> dict:
    """For each equation of `jaxpr` (sub-jaxprs included), the dtypes its float
    operands hold values of: an upcast of a float16 value holds float16 values.

    The backward pass of a product with a float32 result multiplies such an
    upcast cotangent by a float16 operand: that is a float16 product. An equation
    with no 16-bit operand at all (a region autocast leaves in float32) computes
    in float32 whatever its operands once were.
    """
    out = {}

    def walk(jaxpr):
        jaxpr, _ = _compat.jaxpr_and_consts(jaxpr)
        origin = {}
        held = lambda a: (
            origin.get(a, np.dtype(a.aval.dtype))
            if not hasattr(a, "val")
            else (np.dtype(a.aval.dtype))
        )
        for eqn in jaxpr.eqns:
            floats = [a for a in eqn.invars if policy.is_castable(a.aval.dtype)]
            if any(np.dtype(a.aval.dtype) in policy.LOW_DTYPES for a in floats):
                out[eqn] = [held(a) for a in floats]
            else:
                out[eqn] = [np.dtype(a.aval.dtype) for a in floats]
            if eqn.primitive.name == "convert_element_type":
                (src,), (dst,) = eqn.invars, eqn.outvars
                if (
                    policy.is_castable(dst.aval.dtype)
                    and held(src).itemsize < dst.aval.dtype.itemsize
                ):
                    origin[dst] = held(src)
            for sub in _compat.sub_jaxprs(eqn.params):
                walk(sub)

    walk(jaxpr)
    return out


def product_ok(eqn, held, low) -> bool:
    """A matrix product multiplies `low` values and returns `low`, or float32 for
    the products that keep a float32 accumulator (see `policy.FLOAT32_ACCUMULATOR`)."""
    outs = set(float_dtypes(eqn.outvars))
    allowed = {low, F32} if eqn.primitive.name in policy.FLOAT32_ACCUMULATOR else {low}
    return set(held) == {low} and outs <= allowed


def assert_obeys_policy(jaxpr, low):
    """Checks the dtype of every equation against the policy tables.

    Returns the equations by primitive name, for further assertions.
    """
    low = np.dtype(low)
    by_name = {}
    held = value_dtypes(jaxpr)
    for eqn in all_eqns(jaxpr):
        name = eqn.primitive.name
        by_name.setdefault(name, []).append(eqn)
        ins, outs = float_dtypes(eqn.invars), float_dtypes(eqn.outvars)
        rule = policy.rule_for(name)
        where = f"{name} {ins} -> {outs} at {_compat.user_frame(eqn)}"
        if rule is Rule.LOW:
            assert product_ok(eqn, held[eqn], low), where
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


def compiled_kernels(fn, *args) -> int:
    """The instructions of ``jax.jit(fn)``'s compiled entry computation, for `args`,
    that run as kernels (fusions, copies, unfused ops)."""
    return kernels_of(jax.jit(fn).lower(*args).compile().as_text())


def kernels_of(text: str) -> int:
    """`compiled_kernels` of a compiled program's text."""
    entry = text[text.index("\nENTRY") :].splitlines()[1:]
    ops = (re.search(r" = \S+ ([\w-]+)\(", line) for line in entry)
    free = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    return sum(1 for m in ops if m and m.group(1) not in free)


def run_fresh_python(script: str, devices: int | None = None, timeout: int = 300):
    """Runs `script` in a fresh CPU-only Python, with this checkout importable, on
    `devices` simulated devices (None: one, XLA's default); asserts it printed OK."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([root, env.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-3000:]

"""MkDocs hook: writes the autocast policy reference from mpjax's own tables.

`docs/policy.md` holds the prose and a marker, ``<!-- mpjax:policy-tables -->``.
At build time the marker is replaced by tables generated from `mpjax.policy`
(which primitive runs in which precision) and `mpjax.interpreter.HIGHER_ORDER`
(the primitives the interpreter recurses into, their rules registered by
`mpjax/control_flow.py`), so the page cannot drift from the code. The group
headings inside each table ("exponentials and logarithms") are the comments
written in `mpjax/policy.py`, read with `tokenize`.

Anything unexpected (a marker missing, a table the page does not describe, a
name in the source that is not in the table) raises, which fails the build.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # building from a checkout without `pip install -e .`
    sys.path.insert(0, str(_ROOT))

MARKER = "<!-- mpjax:policy-tables -->"

# The tables in the order the page shows them, with what each rule means for the
# reader. Every `Rule` must appear here or in `_ORIGINAL_TEXT` (checked below).
_TABLES = [
    (
        "LOW_PRECISION",
        "Low precision",
        "Floating inputs are cast to the region's dtype (`float16` by default, or "
        "`bfloat16`), and the result is in that dtype too. A product in "
        "`FLOAT32_ACCUMULATOR` with a float32 parameter (an argument of the traced "
        "function) returns that dtype too, unless a float32 sum reads its float32 "
        "accumulator (a residual connection, a recurrent cell's gates), and its "
        "backward products multiply "
        "16-bit operands into the parameter's float32 gradient, never rounded, "
        "which data-parallel `jit` all-reduces in float32 "
        "(`autocast(..., reduce_dtype=dtype)` turns this off). This is the work "
        "that tensor cores and TPU matrix units accelerate.",
    ),
    (
        "FLOAT32",
        "Float32",
        "Floating inputs are cast to `float32`, and the result is `float32`. These "
        "lose range or accuracy in 16 bits: exponentials and logarithms, powers, "
        "special functions, and every reduction or scan that accumulates. "
        "`softmax`, `log_softmax`, `logsumexp`, layer and RMS norm, `mean` and "
        "`var`, and the optax losses are built from these, so they run in float32 "
        "by composition.",
    ),
    (
        "WIDEST",
        "Widest input",
        "Operations with several floating inputs that must agree. They are cast to "
        "the widest *non-weak* input: a Python scalar, or a value computed from "
        "literals alone (`jnp.arange`, the `-1e9` of a mask) never widens an "
        "operation, as in JAX's own promotion. float16 with bfloat16 gives float32. "
        "A bias added to a product is the exception: it joins the product "
        "(see *Operations torch runs as one*).",
    ),
    (
        "AS_RECEIVED",
        "As received",
        "Run in whatever dtype the inputs arrive in: layout and indexing, sign and "
        "rounding, bounded elementwise functions, selections and orderings, "
        "collectives. They are exact, or as accurate as their input, in any "
        "precision.",
    ),
]

_ORIGINAL_TEXT = (
    "Every primitive in none of the tables runs exactly as it was traced: its "
    "floating inputs are cast back to the dtypes they had when the function was "
    "traced (`Rule.ORIGINAL`). This is always type-correct, so a primitive "
    "mpjax does not know, including one from a newer JAX, is never an error; it "
    "just gets no speed-up."
)


def _source_groups(source: str, table: str) -> list[tuple[str, list[str]]]:
    """The names of `table` in `policy.py`, grouped under the comments above them."""
    tree = ast.parse(source)
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id == table
        ):
            call = node.value
            break
    else:
        raise RuntimeError(f"docs/hooks.py: no `{table} = _table(...)` in mpjax/policy.py")
    if not (
        isinstance(call, ast.Call) and len(call.args) == 2 and isinstance(call.args[1], ast.List)
    ):
        raise RuntimeError(f"docs/hooks.py: `{table}` is not `_table(rule, [names])`")
    items = call.args[1]
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and items.lineno <= tok.start[0] <= items.end_lineno:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    groups: list[tuple[str, list[str]]] = []
    last_line = items.lineno
    for element in items.elts:
        if not (isinstance(element, ast.Constant) and isinstance(element.value, str)):
            raise RuntimeError(f"docs/hooks.py: `{table}` holds a non-string entry")
        heading = [comments[n] for n in range(last_line, element.lineno + 1) if n in comments]
        if heading or not groups:
            groups.append((heading[-1] if heading else "", []))
        groups[-1][1].append(element.value)
        last_line = element.lineno + 1
    return groups


def _names(names: list[str]) -> str:
    return ", ".join(f"`{n}`" for n in names)


# For handlers without a docstring of their own.
_HANDLER_TEXT = {
    "_remat": "The body is autocast inside a new `jax.checkpoint` with the same "
    "rematerialization policy.",
    "_shard_map": "The body is autocast inside a new `jax.shard_map` over the same mesh and specs.",
    "_scan": "The body is autocast. Each carry keeps a dtype the body maps to itself; "
    "casts of loop-invariant values and of whole `xs` are made once, outside "
    "the loop.",
    "_while": "The condition and the body are autocast; carries and hoisted casts as for `scan`.",
}


def _describe(fn) -> str:
    doc = inspect.getdoc(fn) or _HANDLER_TEXT.get(fn.__name__, "")
    return doc.split("\n\n")[0].replace("\n", " ").strip() or "Recursed into."


def policy_markdown() -> str:
    """The generated part of the policy page."""
    import numpy as np
    from mpjax import interpreter, policy
    from mpjax.policy import Rule

    source = Path(inspect.getsourcefile(policy)).read_text()
    described = {rule for name, _, _ in _TABLES for rule in getattr(policy, name).values()}
    missing = set(Rule) - described - {Rule.ORIGINAL}
    if missing:
        raise RuntimeError(f"docs/hooks.py: rules without a table on the page: {missing}")

    out = []
    total = len(policy.POLICY)
    out.append(
        f"{total} primitives have a rule. The dtypes autocast moves between are "
        f"{_names(sorted(np.dtype(d).name for d in policy.CASTABLE))}; every other "
        "dtype (float64, integers, booleans, PRNG keys, fp8) is never touched.\n"
    )
    out.append("| table | rule | primitives |\n|---|---|---:|")
    for name, title, _ in _TABLES:
        table = getattr(policy, name)
        rule = next(iter(table.values()))
        anchor = title.lower().replace(" ", "-")
        out.append(f"| [{title}](#{anchor}) | `Rule.{rule.name}` | {len(table)} |")
    out.append("| [Anything else](#anything-else) | `Rule.ORIGINAL` | |\n")

    for name, title, text in _TABLES:
        table = getattr(policy, name)
        rules = set(table.values())
        if len(rules) != 1:
            raise RuntimeError(f"docs/hooks.py: `{name}` mixes rules {rules}")
        (rule,) = rules
        groups = _source_groups(source, name)
        listed = [n for _, names in groups for n in names]
        if listed != list(table):
            raise RuntimeError(
                f"docs/hooks.py: could not read `{name}` from policy.py "
                f"(read {listed}, imported {list(table)})"
            )
        out.append(f"## {title}\n")
        out.append(f"`mpjax.policy.{name}`, `Rule.{rule.name}`: {text}\n")
        if len(groups) == 1:
            out.append(_names(groups[0][1]) + "\n")
        else:
            out.append("| group | primitives |\n|---|---|")
            for heading, names in groups:
                out.append(f"| {heading or '&nbsp;'} | {_names(names)} |")
            out.append("")

    out.append("## Anything else\n")
    out.append(_ORIGINAL_TEXT + "\n")
    out.append(
        "`convert_element_type` (`x.astype(...)`) has a rule of its own: a cast "
        "to a dtype other than the traced input's is kept as written; a cast that "
        "did nothing when traced (to the dtype the value already had) is dropped, "
        "since in the traced program it only stripped a weak type. See "
        "[Keeping a region in float32](recipes/float32_region.md).\n"
    )

    overrides = getattr(policy, "LEAN_OVERRIDES", None)
    if overrides is not None:
        out.append("## Lean overrides\n")
        out.append(
            'With `policy="lean"`, these rules replace the ones above '
            "(`mpjax.policy.LEAN_OVERRIDES`):\n"
        )
        out.append("| primitive | default rule | lean rule |\n|---|---|---|")
        for prim, rule in overrides.items():
            out.append(f"| `{prim}` | `Rule.{policy.rule_for(prim).name}` | `Rule.{rule.name}` |")
        out.append(
            "\nA gather is rounded only where it reads a float32 array the function "
            "(or a jitted function it calls, such as `jnp.take`) receives, as an "
            "embedding lookup reads its table. A quantile, `jnp.median` or "
            "`jnp.percentile` along an axis gathers rows of values it sorted itself: "
            "it keeps the default rule, as rounding would move the values it returns "
            "(past 65504, to inf in float16). So does a gather of single elements "
            "(`x[i]` of a vector, `jnp.searchsorted`, `jnp.interp`, "
            "`take_along_axis`), whose values, rounded, would fall in other bins.\n"
        )

    out.append("## Higher-order primitives\n")
    out.append(
        "These are not policy. The interpreter recurses into their bodies and "
        "applies the tables inside (`mpjax.interpreter.HIGHER_ORDER`; the rules are in "
        "`mpjax/control_flow.py`):\n"
    )
    out.append("| primitives | handled by | what it does |\n|---|---|---|")
    by_handler: dict = {}
    for prim, handler in interpreter.HIGHER_ORDER.items():
        by_handler.setdefault(handler, []).append(prim)
    for handler, prims in by_handler.items():
        out.append(f"| {_names(prims)} | `{handler.__name__}` | {_describe(handler)} |")
    out.append("")
    if "custom_vjp_call" not in interpreter.HIGHER_ORDER:
        rule = policy.rule_for("custom_vjp_call")
        out.append(
            f"`custom_vjp_call` is deliberately not among them: a `jax.custom_vjp` "
            f"function runs as written, at its original input dtypes "
            f"(`Rule.{rule.name}`), so its forward and backward rules stay exact. "
            "See [Custom derivatives](recipes/custom_derivatives.md).\n"
        )
    out.append(
        "Every other higher-order primitive (`pallas_call`, `custom_linear_solve`, "
        "`xla_pmap`, ...) is an unknown primitive: it runs as traced, body included.\n"
    )
    return "\n".join(out)


def on_page_markdown(markdown, page, config, files, **kwargs):
    if page.file.src_uri != "policy.md":
        return markdown
    if MARKER not in markdown:
        raise RuntimeError(f"docs/hooks.py: {MARKER} missing from docs/policy.md")
    return markdown.replace(MARKER, policy_markdown())

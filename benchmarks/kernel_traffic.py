"""The bytes a compiled program's kernels read and write, from XLA's optimized HLO.

A training step of a 16-bit model is mostly memory-bound outside its matrix
products, so the bytes its kernels move through device memory say much of what its
elementwise work costs. Each kernel of the entry computation (a fusion, a library
call, a copy) reads its operands and writes its result; this sums their sizes over
the kernels, from ``compiled.as_text()``. It needs no device: `benchmarks.gpu_memory`
applies it to a step compiled for a GPU on a CPU.

It is an estimate, not a measurement. An operand that a fusion only slices counts as
the slices; every other operand counts whole, once per kernel that reads it, as if
no cache held it between kernels; the bodies of loops and conditionals count once.
What it cannot see is how fast each kernel runs: compare variants of one model with
it, never absolute times. To see where two programs differ:

    PYTHONPATH=. python -m benchmarks.kernel_traffic BASE.hlo OTHER.hlo [--top N]

prints the bytes each reads and writes by array type (``write f32[8,1024,3072]``),
largest differences first; `benchmarks.gpu_memory --hlo-dir D` writes the programs.
"""

from __future__ import annotations

import argparse
import collections
import math
import re

_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]\w*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][\w-]*)\((.*)$")
_NOT_KERNELS = frozenset(
    {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all"}
)
_SLICES = frozenset({"slice", "dynamic-slice"})


def nbytes(shape: str) -> int:
    """Bytes of an HLO shape, a tuple's elements summed (``(f32[2,3]{1,0}, s32[])``)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        size = _BYTES.get(dtype, 1 if dtype.startswith("f8") else 0)
        total += size * math.prod(int(d) for d in dims.split(",") if d)
    return total


class _Instruction:
    def __init__(self, name: str, shape: str, opcode: str, rest: str):
        self.name, self.shape, self.opcode = name, shape, opcode
        depth, end = 1, len(rest)
        for i, ch in enumerate(rest):  # the operand list ends at its closing parenthesis
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                end = i
                break
        self.args = rest[:end]  # a parameter's is its index
        self.operands = re.findall(r"%([\w.\-]+)", self.args)
        attrs = rest[end:]
        called = re.search(r"\bcalls=%([\w.\-]+)", attrs)
        self.calls = called.group(1) if called else None
        self.bodies = re.findall(
            r"\b(?:body|true_computation|false_computation)=%([\w.\-]+)", attrs
        )
        branches = re.search(r"branch_computations=\{([^}]*)\}", attrs)
        if branches:
            self.bodies += re.findall(r"%([\w.\-]+)", branches.group(1))
        if opcode == "call":  # a command buffer, or a call XLA kept: its kernels
            self.bodies += re.findall(r"\bto_apply=%([\w.\-]+)", attrs)


def _computations(hlo: str) -> tuple[dict[str, list[_Instruction]], str]:
    comps: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            m = _COMPUTATION.match(line)
            current = m.group(1) if m else None
            if current is not None:
                comps[current] = []
                if line.startswith("ENTRY"):
                    entry = current
            continue
        m = _INSTRUCTION.match(line) if current is not None else None
        if m:
            comps[current].append(_Instruction(*m.groups()))
    return comps, entry


def _sliced_reads(fused: list[_Instruction]) -> dict[int, int]:
    """Parameter index -> bytes read, for the parameters of a fused computation that
    it only slices (through bitcasts); the others are read whole."""
    users: dict[str, list[_Instruction]] = {}
    for ins in fused:
        for op in ins.operands:
            users.setdefault(op, []).append(ins)

    def sliced(name: str) -> int | None:
        if not users.get(name):
            return None
        total = 0
        for user in users[name]:
            if user.opcode in _SLICES and user.operands[0] == name:
                total += nbytes(user.shape)
            elif user.opcode == "bitcast" and (part := sliced(user.name)) is not None:
                total += part
            else:
                return None
        return total

    out = {}
    for ins in fused:
        if ins.opcode == "parameter" and (read := sliced(ins.name)) is not None:
            out[int(ins.args)] = read
    return out


def _kernels(hlo: str):
    """Each kernel of an optimized HLO module's text, loop bodies once: its result's
    shape, and the shape and bytes read of each operand."""
    comps, entry = _computations(hlo)
    shapes = {ins.name: ins.shape for body in comps.values() for ins in body}

    def visit(name: str, seen: frozenset):
        for ins in comps.get(name, ()):
            for body in ins.bodies:  # a loop, conditional or call: its bodies' kernels
                if body not in seen:
                    yield from visit(body, seen | {body})
            if ins.bodies or ins.opcode in _NOT_KERNELS:
                continue
            sliced = _sliced_reads(comps.get(ins.calls, [])) if ins.calls else {}
            reads = [
                (shapes.get(op, ""), sliced.get(i, nbytes(shapes.get(op, ""))))
                for i, op in enumerate(ins.operands)
            ]
            yield ins.shape, reads

    yield from visit(entry, frozenset({entry}))


def kernel_bytes(hlo: str) -> dict:
    """``{"bytes": ..., "kernels": ...}`` of an optimized HLO module's text: the bytes
    its kernels read and write, and how many kernels run (loop bodies once).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.ones(1024, jnp.float32)
      >>> kernel_bytes(jax.jit(lambda a: a * 2 + 1).lower(x).compile().as_text())
      {'bytes': 8192, 'kernels': 1}
    """
    total = kernels = 0
    for shape, reads in _kernels(hlo):
        total += nbytes(shape) + sum(read for _, read in reads)
        kernels += 1
    return {"bytes": total, "kernels": kernels}


_LAYOUT = re.compile(r"\{[^}]*\}")


def by_array(hlo: str) -> collections.Counter:
    """The bytes of `kernel_bytes`, by what moves them: ``"read bf16[8,1024,768]"``,
    ``"write (f32[64,768], bf16[8,1024,768])"`` (layouts left out)."""
    out: collections.Counter = collections.Counter()
    for shape, reads in _kernels(hlo):
        for operand, read in reads:
            out[f"read {_LAYOUT.sub('', operand)}"] += read
        out[f"write {_LAYOUT.sub('', shape)}"] += nbytes(shape)
    return out


def compare(base: str, other: str, top: int = 15) -> str:
    """A table of where `other`'s kernels move more or fewer bytes than `base`'s."""
    a, b = by_array(base), by_array(other)
    lines = [
        f"total GB: {sum(a.values()) / 1e9:.2f} -> {sum(b.values()) / 1e9:.2f}",
        "| difference GB | base GB | other GB | what |",
        "|---:|---:|---:|---|",
    ]
    for key in sorted(set(a) | set(b), key=lambda k: (-abs(b[k] - a[k]), k))[:top]:
        lines.append(
            f"| {(b[key] - a[key]) / 1e9:+.2f} | {a[key] / 1e9:.2f} | {b[key] / 1e9:.2f} | {key} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="an optimized HLO module's text (compiled.as_text())")
    parser.add_argument("other")
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    with open(args.base) as f, open(args.other) as g:
        print(compare(f.read(), g.read(), args.top))


if __name__ == "__main__":
    main()

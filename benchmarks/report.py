"""Markdown tables and the checks of the benchmark targets."""

from __future__ import annotations

MiB = 2**20


def _table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _baseline(name: str) -> str | None:
    from benchmarks.variants import VARIANTS

    return VARIANTS[name].baseline


def memory_table(mem: dict) -> str:
    f32 = mem["float32"]["activation_bytes"]
    unit, size = ("MiB", MiB) if f32 > 10 * MiB else ("KiB", 1024)
    rows = []
    for name, m in mem.items():
        base = _baseline(name)
        act = m["activation_bytes"]
        f32_share = m["by_dtype"].get("float32", 0) / act if act else 0.0
        rows.append(
            [
                name,
                f"{act / size:,.0f}",
                f"{act / f32:.3f}",
                f"{act / mem[base]['activation_bytes']:.3f}" if base else "",
                f"{f32_share:.0%}",
                m["forward_float_casts"],
                *_recomputed_cells(m, size),
            ]
        )
    return _table(
        [
            "variant",
            f"activation {unit}",
            "x float32",
            "x hand-cast",
            "float32 share",
            "float casts (fwd)",
            f"recomputed {unit} (bwd reads+writes)",
            "x activation",
            f"recomputed {unit} as one kernel",
            "products recomputed",
        ],
        rows,
    )


def _recomputed_cells(m: dict, size: int) -> list:
    """What the backward pass computes again (benchmarks/recompute.py): the bytes
    its recomputed equations read and write, one by one and as one fused kernel,
    and the matrix products among them.
    Blank for results measured before these were."""
    if "recomputed_bytes" not in m:
        return ["", "", "", ""]
    moved = m["recomputed_bytes"]
    share = moved / m["activation_bytes"] if m["activation_bytes"] else 0.0
    fused = m["recomputed_boundary_bytes"]
    return [
        f"{moved / size:,.0f}",
        f"{share:.3f}",
        f"{fused / size:,.0f}",
        m["recomputed_products"],
    ]


def coverage_table(cov: dict) -> str:
    rows = []
    for name, c in cov.items():
        base = _baseline(name)
        rows.append(
            [
                name,
                f"{c['matmul_flops'] / 1e9:,.1f}",
                f"{c['low_precision_fraction']:.1%}",
                c["float_converts"],
                cov[base]["float_converts"] if base else "",
                f"{c['float_convert_elements'] / 1e6:,.1f}",
                f"{c['float_convert_elements'] / cov[base]['float_convert_elements']:.2f}"
                if base and cov[base]["float_convert_elements"]
                else "",
                # blank for results measured before round trips were counted
                f"{c['round_trip_elements'] / 1e6:,.1f}" if "round_trip_elements" in c else "",
            ]
        )
    return _table(
        [
            "variant",
            "dot/conv GFLOP",
            "in 16 bit",
            "float converts",
            "hand-cast's",
            "converted M elements",
            "x hand-cast",
            "of which exact round trips, M",
        ],
        rows,
    )


def compile_table(comp: dict) -> str:
    rows = []
    for n, m in comp.items():
        base = comp.get(_baseline(n) or "")
        rows.append(
            [
                n,
                f"{m['trace']:.2f}",
                f"{m['lower']:.2f}",
                f"{m['compile']:.2f}",
                f"{m['total']:.2f}",
                f"{m['ratio_trace']:.2f}",
                f"{m['ratio_total']:.3f}",
                f"{m['total'] / base['total']:.3f}" if base else "",
            ]
        )
    return _table(
        [
            "variant",
            "trace s",
            "lower s",
            "compile s",
            "total s",
            "trace x float32",
            "total x float32",
            "total x hand-cast",
        ],
        rows,
    )


def cpu_tables(out: dict) -> str:
    meta = out["meta"]
    parts = [
        f"## mpjax benchmarks ({meta['mode']}): jax {meta['jax']}, {meta['device']}, "
        f"{meta['cpu_count']} cores, {meta['date']}",
        f"`{meta['command']}`",
    ]
    for family in out["memory"]:
        sizes = out["sizes"][family]
        parts.append(f"### {family}: activation memory (vjp residuals), {sizes['static']}")
        parts.append(memory_table(out["memory"][family]))
        parts.append(
            f"### {family}: precision coverage of the lowered training step, {sizes['static']}"
        )
        parts.append(coverage_table(out["coverage"][family]))
        if family in out["compile"]:
            parts.append(
                f"### {family}: trace + lower + compile of the training step "
                f"(medians), {sizes['compile']}"
            )
            parts.append(compile_table(out["compile"][family]))
    rows = []
    for family in out["scaler"]:
        s, e = out["scaler"][family], out["eager"][family]
        rows.append(
            [
                family,
                f"{s['plain_s'] * 1e3:.2f}",
                f"{s['scaler_s'] * 1e3:.2f}",
                f"{s['ratio']:.3f}",
                f"{e['plain_s'] * 1e3:.1f}",
                f"{e['autocast_s'] * 1e3:.1f}",
                f"{e['ratio']:.2f}",
            ]
        )
    parts.append(
        "### run-time overheads (medians of interleaved repeats), "
        + "; ".join(f"{f}: {out['sizes'][f]['run']}" for f in out["scaler"])
    )
    parts.append(
        _table(
            [
                "model",
                "step ms adamw",
                "step ms grad_scaler(adamw)",
                "scaler ratio",
                "eager ms plain",
                "eager ms autocast",
                "eager ratio",
            ],
            rows,
        )
    )
    rows = [
        [family, n, f"{v['loss']:.5f}", f"{v['loss_rel_err']:.1e}", f"{v['grad_rel_err']:.1e}"]
        for family, fid in out["fidelity"].items()
        for n, v in fid.items()
    ]
    parts.append("### fidelity against float32 (same parameters and batch)")
    parts.append(_table(["model", "variant", "loss", "loss rel. err", "grad rel. err"], rows))
    parts.append("### targets")
    parts.append(
        _table(
            ["target", "measured", "limit", "met"],
            [
                [t["what"], f"{t['value']:.3f}", t["limit"], "yes" if t["met"] else "NO"]
                for t in out["targets"]
            ],
        )
    )
    return "\n\n".join(parts)


def targets(out: dict) -> list[dict]:
    """Each benchmark target that the CPU run measures, with its verdict."""
    found = []

    def check(what, value, limit, op="<="):
        met = value <= limit if op == "<=" else value >= limit
        found.append(dict(what=what, value=value, limit=f"{op} {limit}", met=bool(met)))

    for family, mem in out["memory"].items():
        f32 = mem["float32"]["activation_bytes"]
        for name, m in mem.items():
            base = _baseline(name)
            if not name.startswith("autocast"):
                continue
            check(f"{family} {name} activation bytes / float32", m["activation_bytes"] / f32, 0.6)
            check(
                f"{family} {name} activation bytes / {base}",
                m["activation_bytes"] / mem[base]["activation_bytes"],
                1.05,
            )
            if "recomputed_products" in m:
                check(f"{family} {name} products recomputed (bwd)", m["recomputed_products"], 0)
    for family, cov in out["coverage"].items():
        for name, c in cov.items():
            if name.startswith("autocast"):
                check(
                    f"{family} {name} dot/conv FLOPs in 16 bit",
                    c["low_precision_fraction"],
                    1.0,
                    ">=",
                )
                base = cov[_baseline(name)]["float_converts"]
                check(
                    f"{family} {name} float converts / hand-cast's", c["float_converts"] / base, 1.0
                )
    for family, comp in out["compile"].items():
        for name, m in comp.items():
            if name.startswith("autocast"):
                check(f"{family} {name} trace+lower+compile / float32", m["ratio_total"], 1.3)
    for family, s in out["scaler"].items():
        check(f"{family} step time grad_scaler(adamw) / adamw", s["ratio"], 1.03)
    return found


def gpu_tables(results: list[dict]) -> str:
    """Step time, throughput and peak memory per variant; speed-ups against float32
    (default precision, i.e. TF32 matmuls) and against the matching hand-cast model."""
    ok = {
        (r["family"], r["variant"], r.get("matmul_precision", "default")): r
        for r in results
        if "error" not in r
    }
    rows = []
    for r in results:
        if "error" in r:
            rows.append(
                [
                    r["family"],
                    r["variant"],
                    "",
                    "ERROR",
                    r["error"].splitlines()[-1][:80],
                    "",
                    "",
                    "",
                    "",
                ]
            )
            continue
        fam, prec = r["family"], r["matmul_precision"]
        f32 = ok.get((fam, "float32", "default"))
        base = _baseline(r["variant"])
        hand = ok.get((fam, base, "default")) if base else None
        rows.append(
            [
                fam,
                r["variant"],
                prec,
                f"{r['step_s'] * 1e3:.1f}",
                f"{r['items_per_s']:,.0f} {r['unit']}/s",
                f"{r['peak_bytes'] / 2**30:.2f}" if r["peak_bytes"] else "n/a",
                f"{f32['step_s'] / r['step_s']:.2f}" if f32 else "",
                f"{hand['step_s'] / r['step_s']:.3f}" if hand else "",
                f"{r['compile_s']:.1f}",
            ]
        )
    return _table(
        [
            "model",
            "variant",
            "matmul precision",
            "step ms",
            "throughput",
            "peak GiB",
            "speed-up vs float32",
            "speed vs hand-cast",
            "compile s",
        ],
        rows,
    )

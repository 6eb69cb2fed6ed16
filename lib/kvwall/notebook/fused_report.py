"""Chapter 5's analysis: what the fused FP8 kernel should cost, how its launch shape was tuned, and
whether it passed validation.

Every byte and FLOP count comes from :mod:`kvwall.model.roofline` (one byte count: each token's FP8
latent plus its page-table index, 580 B per token for GLM-5 at page size 1). The benchmark and profile
analysis is in :mod:`kvwall.notebook.fused_bench_report`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import plotly.graph_objects as go
import torch

from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import (decode_flops, full_pool_cast_bytes, gather_cast_bytes, kv_read_bytes,
                                   roofline_us)
from kvwall.notebook import plots
from kvwall.notebook.tables import CHECK_COLUMNS, Table, number, percent, scientific, times
from kvwall.results import Result

__all__ = ["spill_rule_table", "cost_prediction", "bytes_by_path", "fp8_to_float16_is_exact", "query_scaling_is_exact",
           "exactness_text",
           "launch_shape", "screen_table", "split_sweep_figure", "winners_table", "tuning_lessons",
           "validation_table", "validation_passed", "validation_ratio_text"]

# --------------------------------------------------------------------------------------------------
# What it should cost
# --------------------------------------------------------------------------------------------------


def cost_prediction(ceilings: Mapping[str, float] | None, *, heads: Iterable[int] = (16, 64, 128),
                    tokens: int = 131072, geometry: MLAGeometry = GLM5) -> str:
    """Bytes and FLOPs per token, and, given the measured ceilings (``copy_gbps``, ``bf16_tflops``), which one
    binds at each head count and the roofline of one ``tokens``-token request per layer."""
    per_token = kv_read_bytes(1, geometry)
    flops = decode_flops(1, 1, geometry)
    lines = [f"- bytes per token: **{per_token} B** ({geometry.kv_dim} B of FP8 latent + "
             f"{per_token - geometry.kv_dim} B of index; a BF16 cache would read "
             f"{kv_read_bytes(1, geometry, kv_dtype=torch.bfloat16)} B); FLOPs per token and head: "
             f"2 × {geometry.kv_dim} + 2 × {geometry.kv_lora_rank} = **{flops:,}**"]
    if not ceilings:
        return "\n".join(lines)
    copy_gbps, tflops = ceilings["copy_gbps"], ceilings["bf16_tflops"]
    ridge = tflops * 1e12 / (copy_gbps * 1e9)
    lines.append(f"- the H200's ceilings, measured in the tuning run: copy **{copy_gbps:,.0f} GB/s**, BF16 matmul "
                 f"**{tflops:,.0f} TFLOP/s**: the ridge is at **{ridge:,.0f} FLOP/B**")
    for h in heads:
        intensity = decode_flops(h, tokens, geometry) / kv_read_bytes(tokens, geometry)
        bound = "memory" if intensity < ridge else "compute"
        lines.append(f"- {h} heads: {intensity:,.0f} FLOP/B, **{bound}-bound**; one {tokens // 1024}K-token "
                     f"request's roofline: **{roofline_us(h, tokens, copy_gbps, tflops, geometry):.1f} µs** per layer")
    return "\n".join(lines)


def bytes_by_path(context: int = 131072, *, pool_tokens: int = ORIGINAL.pool_tokens,
                  geometry: MLAGeometry = GLM5) -> Table:
    """HBM bytes per layer each path moves for one request of ``context`` tokens; every attention also reads
    the request's page-table indices."""
    bf16_attention = kv_read_bytes(context, geometry, kv_dtype=torch.bfloat16)
    paths = [
        ("whole-pool cast + BF16 attention (the original)",
         full_pool_cast_bytes(geometry, pool_tokens)["total"] + bf16_attention,
         "the cast reads the whole pool in FP8 and writes it in BF16; attention reads the request's BF16 rows"),
        ("gather-then-cast + BF16 attention (chapter 4)", gather_cast_bytes(context, geometry) + bf16_attention,
         "the gather reads the request's FP8 rows and writes them in BF16; attention reads them"),
        ("BF16 cache (twice the memory)", bf16_attention, "attention reads BF16 rows"),
        ("fused FP8 attention (this chapter)", kv_read_bytes(context, geometry),
         "attention reads the FP8 rows once"),
    ]
    fused = paths[-1][1]
    rows = [{"path": p, "mb": b / 1e6, "x": b / fused, "what": w} for p, b, w in paths]
    return Table(rows, {f"path per layer, one {context // 1024}K-token request": "path", "MB moved": ("mb", number(1)),
                        "× fused": ("x", times(1)), "what moves": "what"},
                 f"Computed (kvwall.model.roofline): {pool_tokens:,}-slot pool, {geometry.kv_dim} values per token, "
                 "1 B (FP8) / 2 B (BF16) each, 4 B of index per token.")


# --------------------------------------------------------------------------------------------------
# The exactness claims, checked on this machine
# --------------------------------------------------------------------------------------------------


def fp8_to_float16_is_exact() -> tuple[int, bool]:
    """How many finite e4m3 values there are, and whether float16 holds every one of them exactly."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    finite = codes[torch.isfinite(codes.float())]
    return finite.numel(), bool((finite.to(torch.float16).double() == finite.double()).all())


def query_scaling_is_exact(rows: int = 64, decades: float = 6.0, seed: int = 5) -> tuple[bool, float]:
    """Whether BF16 query rows with magnitudes over ±``decades`` decades survive the kernel's rule — scale each row
    by 2^(13 − ⌊log₂ max|q|⌋), convert to float16, scale back — unchanged; and the largest scaled |q|."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.empty(rows, 1, dtype=torch.float64).uniform_(-decades, decades, generator=g)
    q = (torch.randn(rows, GLM5.kv_dim, generator=g, dtype=torch.float64) * magnitudes).to(torch.bfloat16)
    exponent = 13 - torch.floor(torch.log2(q.double().abs().amax(1, keepdim=True)))
    q16 = (q.double() * 2.0 ** exponent).to(torch.float16)
    return bool(((q16.double() * 2.0 ** -exponent) == q.double()).all()), float(q16.abs().max())


def exactness_text() -> str:
    """The two exactness claims of the kernel's design, checked on this machine, as Markdown."""
    n_fp8, fp8_exact = fp8_to_float16_is_exact()
    q_exact, largest = query_scaling_is_exact()
    verdict = {True: "all exact", False: "NOT exact"}
    return (f"- {n_fp8} finite e4m3 values → float16: **{verdict[fp8_exact]}**\n"
            f"- 64 BF16 query rows with magnitudes from 10⁻⁶ to 10⁶, scaled by 2^(13 − ⌊log₂ max|q|⌋) → float16 → "
            f"back: **{verdict[q_exact]}** (largest scaled |q|: {largest:,.0f}, float16's limit 65,504)")


# --------------------------------------------------------------------------------------------------
# Tuning
# --------------------------------------------------------------------------------------------------


def launch_shape(row: Mapping[str, Any]) -> str:
    """A tuning row's launch shape in words, from its ``cfg_*`` fields."""
    path = ("FP8 scores (4-term q)" if row.get("cfg_s_fp8") else "tokens as M" if row.get("cfg_tokens_m")
            else "16-bit pairs" if row.get("cfg_pairs") else "fp16 scores")
    loads = "one load" if row.get("cfg_cache_v") == row.get("cfg_cache_k") else "two loads"
    return (f"{row['cfg_block_h']}×{row['cfg_block_n']}, {row['cfg_num_warps']} warps, {row['cfg_num_stages']} stages, "
            f"{row['cfg_convert']}, {path}, {loads}")


def spill_rule_table(tuning: Result) -> Table:
    """Per head count: the fastest candidate of the screen against the fastest that does not spill registers (the
    one the launcher ships), at the screening point."""
    fastest = {r["heads"]: r for r in tuning.table("fastest_any")}
    rows = []
    for heads, f in sorted(fastest.items()):
        clean = min((r for r in tuning.table("screen") if r["heads"] == heads and r.get("us") and r.get("spills") == 0),
                    key=lambda r: r["us"], default=None)
        rows.append({"heads": heads, "fastest": launch_shape(f), "f_us": f["us"], "f_spills": f.get("spills"),
                     "clean": launch_shape(clean) if clean else "none", "c_us": clean["us"] if clean else None,
                     "x": clean["us"] / f["us"] if clean else None})
    return Table(rows, {"heads": "heads", "fastest candidate": "fastest", "µs": ("f_us", number(1)),
                        "its spills (Triton's n_spills)": "f_spills", "fastest without spills (shipped)": "clean",
                        "µs ": ("c_us", number(1)), "cost of the rule": ("x", times(2))},
                 tuning.caption() + " Batch 1, 128K random slots.")


def _share(row: Mapping[str, Any]) -> float | None:
    """The row's share of its roofline (the experiment's ``roofline_us``, from :func:`roofline_us`)."""
    return row["roofline_us"] / row["us"] if row.get("us") else None


def screen_table(tuning: Result) -> Table:
    """Every candidate launch shape of the tuning screen: resources, error, µs and share of the roofline."""
    screen = sorted(tuning.table("screen"), key=lambda r: (r["heads"], r.get("us") or float("inf")))
    rows = [{**r, "shape": launch_shape(r), "smem_kb": (r.get("shared_bytes") or 0) / 1024, "share": _share(r),
             "us_or_error": f"{r['us']:.1f}" if r.get("us") else (r.get("error") or "")[:60]} for r in screen]
    return Table(rows, {"heads": "heads", "heads × tokens per step, …": "shape", "registers": "regs", "spills": "spills",
                        "smem KB": ("smem_kb", number(0)), "rel. err vs fp32": ("rel_err", scientific),
                        "µs at 128K": "us_or_error", "of roofline": ("share", percent)},
                 tuning.caption() + " Batch 1, 128K random slots, the launcher's default plan, CUDA graph, L2 flushed.")


def _same_config(row: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return all(row[k] == other[k] for k in other if k.startswith("cfg_"))


def split_sweep_figure(tuning: Result, heads: int = 16) -> go.Figure:
    """Time against splits per request, for the winning shape at each context."""
    sweep = tuning.table("sweep")
    series = {}
    for w in sorted(tuning.table("winner"), key=lambda r: r["tokens"]):
        if w["heads"] != heads:
            continue
        points = sorted((r["splits"], r["us"]) for r in sweep if r["heads"] == heads and r["tokens"] == w["tokens"]
                        and r["splits"] and _same_config(r, w))
        series[f"{w['tokens'] // 1024}K tokens"] = ([p[0] for p in points], [p[1] for p in points])
    return plots.lines(series, title=f"{heads} heads, batch 1: time against chunks per request (the winning shape)",
                       xaxis="chunks per request (the plan's items at batch 1)", yaxis="µs (CUDA graph, L2 flushed)",
                       caption=[tuning.caption()])


def winners_table(tuning: Result) -> Table:
    """The shape and splits the launcher uses at each (heads, context), with its two kernels' times."""
    rows = [{"point": f"{w['heads']} heads, {w['tokens'] // 1024}K", "shape": launch_shape(w),
             "splits": w["splits"] or "default", "us": w["us"], "split_us": w.get("split_kernel_us"),
             "combine_us": w.get("combine_kernel_us"), "share": _share(w)}
            for w in sorted(tuning.table("winner"), key=lambda r: (r["heads"], r["tokens"]))]
    return Table(rows, {"point": "point", "winning shape": "shape", "chunks per request": "splits", "µs": ("us", number(1)),
                        "split kernel µs": ("split_us", number(1)), "combine µs": ("combine_us", number(1)),
                        "of roofline": ("share", percent)},
                 tuning.caption() + " Kernel times from torch.profiler (L2 warm, without graph gaps).")


def _twin(rows: list[dict[str, Any]], base: Mapping[str, Any], **diff: Any) -> dict[str, Any] | None:
    """The timed screen row that differs from ``base`` only in the given config fields (combine fields aside)."""
    same = [k for k in base if k.startswith("cfg_") and k[4:] not in diff and not k.startswith("cfg_combine")]
    return next((r for r in rows if r.get("us") and all(r[k] == base[k] for k in same)
                 and all(r[f"cfg_{k}"] == v for k, v in diff.items())), None)


def tuning_lessons(tuning: Result, heads: int = 16) -> tuple[str, dict[str, float]]:
    """What each road not taken cost against the winner at ``heads``: Markdown, and the FP8-scores numbers."""
    timed = [r for r in tuning.table("screen") if r["heads"] == heads and r.get("us")]
    best = min(timed, key=lambda r: r["us"])
    lines = [f"Against the winner at {heads} heads ({launch_shape(best)}: **{best['us']:.1f} µs**, {best['regs']} "
             f"registers, {best['shared_bytes'] / 1024:.0f} KB of shared memory per program):"]
    bits = _twin(timed, best, convert="bits")
    if bits:
        lines.append(f"- the bit-move FP8 → float16 conversion instead of `cvt`: **{bits['us']:.1f} µs** "
                     f"({bits['us'] / best['us']:.2f}×)")
    if best["cfg_cache_v"] == best["cfg_cache_k"]:  # the winner loads once: its two-load twin
        two = _twin(timed, best, cache_v=".ca")
        if two:
            lines.append(f"- a second load of the tile for `p @ kv` (an L1/L2 hit, two copies in shared memory) "
                         f"instead of one load feeding both dots: **{two['us']:.1f} µs** ({two['us'] / best['us']:.2f}×), "
                         f"{two['regs']} registers, {two['shared_bytes'] / 1024:.0f} KB")
    else:
        one = _twin(timed, best, cache_v=best["cfg_cache_k"])
        if one:
            lines.append(f"- one tile load feeding both dots (instead of a second load, an L1/L2 hit, for `p @ kv`): "
                         f"**{one['us']:.1f} µs** ({one['us'] / best['us']:.2f}×), {one['regs']} registers, "
                         f"{one['shared_bytes'] / 1024:.0f} KB")
    if best.get("cfg_pairs"):
        nopairs = _twin(timed, best, pairs=False)
        if nopairs:
            lines.append(f"- the tile as FP8 elements (a shared-memory load per byte) instead of 16-bit pairs: "
                         f"**{nopairs['us']:.1f} µs** ({nopairs['us'] / best['us']:.2f}×), {nopairs['regs']} registers")
        else:
            nopairs = _twin(timed, best, pairs=False, cache_v=".ca")
            if nopairs:
                lines.append(f"- the tile as FP8 elements (a shared-memory load per byte) instead of 16-bit pairs "
                             f"(and two loads): **{nopairs['us']:.1f} µs** ({nopairs['us'] / best['us']:.2f}×), "
                             f"{nopairs['regs']} registers")
    tm = min((r for r in timed if r.get("cfg_tokens_m")), key=lambda r: r["us"], default=None)
    if tm:
        lines.append(f"- tokens as the MMA's M side ({launch_shape(tm)}): **{tm['us']:.1f} µs** "
                     f"({tm['us'] / best['us']:.2f}×), {tm['regs']} registers")
    values: dict[str, float] = {}
    fp8 = min((r for r in timed if r["cfg_s_fp8"]), key=lambda r: r["us"], default=None)
    fp16 = fp8 and _twin(timed, fp8, s_fp8=False)
    if fp8 and fp16:
        lines.append(f"- scores on FP8 tensor cores (no `K` conversion; the query in four e4m3 terms): "
                     f"**{fp8['us']:.1f} µs** against {fp16['us']:.1f} µs for the same shape in float16, with "
                     f"{fp8['shared_bytes'] / 1024:.0f} KB of shared memory per program against "
                     f"{fp16['shared_bytes'] / 1024:.0f} KB ({fp8['regs']} and {fp16['regs']} registers)")
        values = {"fp8_scores_us": fp8["us"], "fp16_scores_us": fp16["us"]}
    return "\n".join(lines), values


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _passed(rows: list[dict[str, Any]]) -> str:
    return f"{sum(bool(r['passed']) for r in rows)} / {len(rows)}"


def _inexact(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cases where the BF16 path is not exact, so the error ratio means something."""
    return [r for r in cases if r.get("ratio") is not None and (r.get("bf16_rel_err") or 0) > 0]


def validation_table(result: Result, caption: str) -> Table:
    """One line per head count (cases passed, worst error ratio against the BF16 path), then errors, CUDA graphs,
    FlashInfer's FP8 peers and compute-sanitizer where the run has them."""
    rows = []
    cases = result.table("cases")
    for heads in sorted({r["heads"] for r in cases}):
        sel = [r for r in cases if r["heads"] == heads]
        inexact = _inexact(sel)
        if inexact:
            worst = max(inexact, key=lambda r: r["ratio"])
            more = "…" if len(worst["lens"]) > 4 else ""
            detail = (f"worst ours/BF16-path error ratio {worst['ratio']:.2f} ({worst['rel_err']:.1e} vs "
                      f"{worst['bf16_rel_err']:.1e}, lengths {worst['lens'][:4]}{more})")
        else:
            detail = "both paths exact on every case (single tokens)"
        layouts = ", ".join(sorted({r["layout"] for r in sel}))
        rows.append({"what": f"{heads} heads: {len(sel)} cases ({layouts})", "passed": _passed(sel), "detail": detail})
    sections = {r["section"] for r in result.rows}
    for section, what in (("errors", "bad inputs raise before launch, out untouched"),
                          ("graph", "CUDA graph: capture once, replay with new lengths, indices and scales")):
        if section in sections:
            rows.append({"what": what, "passed": _passed(result.table(section)), "detail": ""})
    if "fp8_peers" in sections:
        ran = [r for r in result.table("fp8_peers") if r.get("rel_err") is not None]
        for peer in sorted({r["peer"] for r in ran}):
            sel = [r for r in ran if r["peer"] == peer]
            rows.append({"what": f"{peer}: same inputs", "passed": f"{len(sel)} cases ran",
                         "detail": f"its error vs float64 up to {max(r['rel_err'] for r in sel):.1e}; vs ours up to "
                                   f"{max(r['rel_diff_vs_ours'] for r in sel):.1e}"})
    if "sanitizer" in sections:
        san = result.table("sanitizer")[0]
        rows.append({"what": "`compute-sanitizer --tool memcheck`",
                     "passed": {True: "clean", False: "FAILED", None: "not run"}[san["passed"]],
                     "detail": san.get("summary", "")})
    return Table(rows, CHECK_COLUMNS, caption)


def validation_passed(result: Result) -> bool:
    """Every row of the run that has a verdict passed."""
    return all(bool(r["passed"]) for r in result.rows if r.get("passed") is not None)


def validation_ratio_text(result: Result) -> str:
    """The range of our error over the BF16 path's, where the BF16 path is not exact."""
    ratios = [r["ratio"] for r in _inexact(result.table("cases"))]
    if not ratios:
        return "The BF16 path is exact on every recorded case: no error ratio to compare."
    return (f"Our error is **{min(ratios):.2f}–{max(ratios):.2f}×** the BF16 path's over the recorded cases where "
            "the BF16 path is not exact: at or below it, consistent with the softmax weights `p` entering the second "
            "dot in float16 (11 significant bits) rather than BF16 (8).")

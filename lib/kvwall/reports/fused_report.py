"""Chapter 5's arithmetic and checks: what a decode should cost (bytes, FLOPs, which ceiling binds), what each of
ours' paths does per tile, the exactness claims of the design, and the validation of every path.

Every byte and FLOP count comes from :mod:`kvwall.model.roofline` (one byte count: each token's FP8 latent plus its
page-table index, 580 B per token for GLM-5 at page size 1); the per-tile counts from the kernels' own constants
(:mod:`kvwall.kernels.mla_decode.wgmma`, :mod:`kvwall.kernels.mla_decode.wgmma_tokens`) and the recorded tuning (the
Triton path's launch shapes). The grid is
:mod:`kvwall.reports.fused_bench_report`, the lab detail :mod:`kvwall.reports.fused_lab_report`.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable, Mapping

import torch

from kvwall.kernels.mla_decode import wgmma_tokens
from kvwall.kernels.mla_decode.wgmma import BLOCK_N, HEADS_PER_CTA
from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.model.paths import KERNEL_NAMES
from kvwall.model.roofline import decode_flops, full_pool_cast_bytes, gather_cast_bytes, kv_read_bytes, roofline_us
from kvwall.reports.tables import Table, number, plain, scientific, times
from kvwall.results import Result

__all__ = ["GRID_HEADS", "cost_text", "cost_table", "bytes_by_path", "fp8_to_float16_is_exact",
           "query_scaling_is_exact", "exactness_text", "tile_floors", "triton_shapes", "design_table", "wgmma_text",
           "tokens_text", "paths_said", "PATH_ABOUT", "recorded_paths", "paths_intro", "validation_table",
           "validation_passed", "validation_rule_text", "PATH_NAMES"]

#: The head counts of chapter 5's grid (GLM-5 per GPU at TP 4 = 16, DeepSeek-V3 at TP 4 = 32, ... all 128).
GRID_HEADS = (16, 32, 64, 128)
#: How the chapter names what a validation row ran.
PATH_NAMES = {"ours": "ours", **KERNEL_NAMES}


#: One clause per path of ours, for the chapter's list of the paths (dispatcher names).
PATH_ABOUT = {
    "triton": "the **Triton path**, which runs on any GPU Triton supports and in the CPU interpreter",
    "wgmma": "the **wgmma path**, CUDA C++ for Hopper with 64 heads per CTA as the warpgroup MMA's M side",
    "wgmma_tokens": "the **tokens-on-M wgmma path**, CUDA C++ for Hopper with a tile's 64 tokens as the MMA's M side "
                    "and 16 or 32 heads as its N, for few heads per GPU",
}
_COUNT = {1: "one path", 2: "two paths", 3: "three paths", 4: "four paths"}


def recorded_paths(paths: Result | None) -> list[str]:
    """Ours' paths a ``fused_decode_paths`` recording timed (its forced-path rows), in the dispatcher's order; every
    path of the library where there is no recording."""
    if paths is None:
        return list(KERNEL_NAMES)
    timed = {r.get("strategy") for r in paths.rows if r.get("section") == "bench"}
    return [k for k in KERNEL_NAMES if k in timed]


def paths_intro(paths: Result | None) -> str:
    """The chapter's sentence on the paths behind ours, following the recorded ``fused_decode_paths`` run (the paths it
    timed, counted), and naming any path of the library the recording predates."""
    listed = recorded_paths(paths)
    about = [PATH_ABOUT[k] for k in listed]
    said = about[0] if len(about) == 1 else "; ".join(about[:-1]) + "; and " + about[-1]  # the items hold commas
    text = (f"Behind it are {_COUNT.get(len(listed), f'{len(listed)} paths')}: {said}. The dispatcher picks one per "
            "call.")
    newer = [k for k in KERNEL_NAMES if k not in listed]
    if newer and paths is not None:
        text += (f" The library also has {paths_said(newer)}, which the recorded runs predate: no figure below "
                 "includes it until they are recorded again.")
    return text


def paths_said(paths: Iterable[str]) -> str:
    """``"the Triton path"``, ``"the Triton path and the wgmma path"``, ``"the Triton path, the wgmma path and the
    tokens-on-M wgmma path"``: ours' paths (dispatcher names) as the prose says them, in the dispatcher's order."""
    said = [f"the {KERNEL_NAMES[k]}" for k in KERNEL_NAMES if k in set(paths)]
    return said[0] if len(said) == 1 else ", ".join(said[:-1]) + " and " + said[-1] if said else "no path"


#: Hopper (SM90) per multiprocessor: dense 16-bit tensor-core FLOP per cycle (wgmma m64n64k16 in 32 cycles),
#: shared-memory bytes per cycle, shared memory and registers.
TENSOR_FLOP_PER_CYCLE, SMEM_BYTES_PER_CYCLE = 4096, 128
SM90_SMEM_PER_SM, SM90_REGS_PER_SM = 233_472, 65_536

# --------------------------------------------------------------------------------------------------
# What it should cost
# --------------------------------------------------------------------------------------------------


def _ridge(ceilings: Mapping[str, float]) -> float:
    return ceilings["bf16_tflops"] * 1e12 / (ceilings["copy_gbps"] * 1e9)


def cost_text(ceilings: Mapping[str, float] | None, geometry: MLAGeometry = GLM5) -> str:
    """Bytes and FLOPs per token, and (given the measured ``copy_gbps`` and ``bf16_tflops``) the ridge point."""
    per_token = kv_read_bytes(1, geometry)
    flops = decode_flops(1, 1, geometry)
    text = (f"Per token: **{per_token} B** read ({geometry.kv_dim} B of FP8 latent and rope key, "
            f"{per_token - geometry.kv_dim} B of page-table index; a BF16 cache would read "
            f"{kv_read_bytes(1, geometry, kv_dtype=torch.bfloat16)} B) and, per head, 2 × {geometry.kv_dim} + "
            f"2 × {geometry.kv_lora_rank} = **{flops:,} FLOPs**.")
    if ceilings:
        text += (f" The GPU's ceilings, measured at the start of the benchmark: copy **{ceilings['copy_gbps']:,.0f} "
                 f"GB/s**, BF16 matmul **{ceilings['bf16_tflops']:,.0f} TFLOP/s**, so the ridge is at "
                 f"**{_ridge(ceilings):,.0f} FLOP/B**.")
    return text


def cost_table(ceilings: Mapping[str, float] | None, caption: str, *, heads: Iterable[int] = GRID_HEADS,
               tokens: int = 131072, geometry: MLAGeometry = GLM5) -> Table:
    """Per head count: arithmetic intensity, which ceiling binds (given the ceilings), and the roofline of one
    ``tokens``-token request per layer, with the time at each ceiling alone."""
    rows = []
    for h in heads:
        flops, nbytes = decode_flops(h, tokens, geometry), kv_read_bytes(tokens, geometry)
        row: dict[str, Any] = {"heads": h, "intensity": flops / nbytes}
        if ceilings:
            row.update(bound="memory" if flops / nbytes < _ridge(ceilings) else "compute",
                       mem_us=nbytes / ceilings["copy_gbps"] / 1e3, math_us=flops / ceilings["bf16_tflops"] / 1e6,
                       roof=roofline_us(h, tokens, ceilings["copy_gbps"], ceilings["bf16_tflops"], geometry))
        rows.append(row)
    cols: dict[str, Any] = {"heads": "heads", "FLOP per byte": ("intensity", number(0))}
    if ceilings:
        cols.update({"bound by": "bound", "bytes at copy speed, µs": ("mem_us", number(1)),
                     "FLOPs at matmul rate, µs": ("math_us", number(1)), "roofline µs": ("roof", number(1))})
    return Table(rows, cols, caption + f" One request of {tokens // 1024}K tokens, one layer; computed with "
                                       "kvwall.model.roofline from the run's ceilings.")


def bytes_by_path(context: int = 131072, *, pool_tokens: int = ORIGINAL.pool_tokens,
                  geometry: MLAGeometry = GLM5) -> Table:
    """HBM bytes per layer each way of computing the decode moves for one request of ``context`` tokens."""
    bf16_attention = kv_read_bytes(context, geometry, kv_dtype=torch.bfloat16)
    ours = kv_read_bytes(context, geometry)
    paths = [("whole-pool cast + BF16 attention (the original)",
              full_pool_cast_bytes(geometry, pool_tokens)["total"] + bf16_attention),
             ("gather-then-cast + BF16 attention (chapter 4)", gather_cast_bytes(context, geometry) + bf16_attention),
             ("BF16 cache (twice the memory)", bf16_attention),
             ("ours: attention straight from FP8", ours)]
    rows = [{"path": p, "mb": b / 1e6, "x": b / ours} for p, b in paths]
    return Table(rows, {f"per layer, one {context // 1024}K-token request": "path", "MB moved": ("mb", number(1)),
                        "MB / ours' MB": ("x", times(1))},
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
    """Whether BF16 query rows with magnitudes over ±``decades`` decades survive the kernels' rule — scale each row
    by 2^(13 − ⌊log₂ max|q|⌋), convert to float16, scale back — unchanged; and the largest scaled |q|."""
    g = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** torch.empty(rows, 1, dtype=torch.float64).uniform_(-decades, decades, generator=g)
    q = (torch.randn(rows, GLM5.kv_dim, generator=g, dtype=torch.float64) * magnitudes).to(torch.bfloat16)
    exponent = 13 - torch.floor(torch.log2(q.double().abs().amax(1, keepdim=True)))
    q16 = (q.double() * 2.0 ** exponent).to(torch.float16)
    return bool(((q16.double() * 2.0 ** -exponent) == q.double()).all()), float(q16.abs().max())


def exactness_text() -> str:
    """The two exactness claims both paths rest on, checked on this machine, as Markdown."""
    n_fp8, fp8_exact = fp8_to_float16_is_exact()
    q_exact, largest = query_scaling_is_exact()
    verdict = {True: "all exact", False: "NOT exact"}
    return (f"- {n_fp8} finite e4m3 values → float16: **{verdict[fp8_exact]}**\n"
            f"- 64 BF16 query rows with magnitudes from 10⁻⁶ to 10⁶, scaled by 2^(13 − ⌊log₂ max|q|⌋) → float16 → "
            f"back: **{verdict[q_exact]}** (largest scaled |q|: {largest:,.0f}, float16's limit 65,504)")


# --------------------------------------------------------------------------------------------------
# The paths, per tile
# --------------------------------------------------------------------------------------------------


def tile_floors(geometry: MLAGeometry = GLM5) -> dict[str, float]:
    """Cycles one 64-token tile of 64 heads needs at least on one multiprocessor of the wgmma path: the scores' and
    the output products' tensor time, and its shared-memory traffic (the scores read the query and the converted
    tile, the output products read V and P, the conversion and P are written, all 16-bit) at 128 B per cycle."""
    d, dc, m, n = geometry.kv_dim, geometry.kv_lora_rank, HEADS_PER_CTA, BLOCK_N
    scores, out = 2 * m * n * d / TENSOR_FLOP_PER_CYCLE, 2 * m * n * dc / TENSOR_FLOP_PER_CYCLE
    traffic = (m * d + n * d) * 2 + n * dc * 2 + 2 * m * n * 2 + n * d * 2
    return {"flops": 2 * m * n * (d + dc), "scores": scores, "outputs": out, "tensor": scores + out,
            "smem_bytes": traffic, "smem": traffic / SMEM_BYTES_PER_CYCLE, "fp8_bytes": n * d}


def triton_shapes(tuning: Result, tokens: int = 131072) -> dict[int, dict[str, Any]]:
    """The Triton path's launch shape per head count of the grid, from the recorded tuning's winners: the winner of
    the smallest tuned head count >= heads (the launcher's rule, :func:`kvwall.kernels.mla_decode.kernel.tuned_entry`)
    at the context nearest ``tokens``."""
    winners = tuning.table("winner")
    tuned = sorted({w["heads"] for w in winners})
    out = {}
    for h in GRID_HEADS:
        th = next((t for t in tuned if t >= h), tuned[-1])
        w = min((w for w in winners if w["heads"] == th), key=lambda w: abs(math.log(w["tokens"] / tokens)))
        out[h] = {**w, "tuned_heads": th}
    return out


def design_table(tuning: Result | None, heads: Iterable[int] = GRID_HEADS) -> Table:
    """Per head count, what each path does with one tile of tokens: how many programs (CTAs) convert each token, and
    what share of the MMA's head side is padding (the Triton path's head block, the wgmma path's 64 rows, the
    tokens-on-M path's 16 or 32 columns)."""
    shapes = triton_shapes(tuning) if tuning else {}
    rows = []
    for h in heads:
        row: dict[str, Any] = {"heads": h}
        if h in shapes:
            bh = shapes[h]["cfg_block_h"]
            row.update(t_block=f"{bh} × {shapes[h]['cfg_block_n']}", t_conv=-(-h // bh),
                       t_pad=1 - h / (-(-h // bh) * bh))
        ctas = -(-h // HEADS_PER_CTA)
        row.update(w_conv=ctas, w_pad=1 - h / (ctas * HEADS_PER_CTA))
        hn = wgmma_tokens.heads_per_cta(h)
        row.update(k_conv=-(-h // hn), k_pad=1 - h / (-(-h // hn) * hn))
        rows.append(row)
    pct = lambda v: "—" if v is None else f"{v:.0%}"  # noqa: E731
    cols: dict[str, Any] = {"heads": "heads"}
    if shapes:
        cols.update({"Triton path: heads × tokens per step": "t_block", "programs converting each token": "t_conv",
                     "padded MMA rows": ("t_pad", pct)})
    cols.update({"wgmma path: CTAs converting each token": "w_conv", "padded MMA rows ": ("w_pad", pct),
                 "tokens-on-M wgmma path: CTAs converting each token": "k_conv",
                 "padded MMA columns": ("k_pad", pct)})
    caption = ((tuning.caption() + " Triton path: the tuned shape at 128K tokens (the launcher's rule: the smallest "
                "tuned head count at or above). ") if tuning else "") + \
        (f"wgmma path: {HEADS_PER_CTA} heads × {BLOCK_N} tokens per CTA (kvwall.kernels.mla_decode.wgmma). "
         f"Tokens-on-M wgmma path: {BLOCK_N} tokens × {' or '.join(map(str, wgmma_tokens.HEADS_PER_CTA))} heads "
         "per CTA (kvwall.kernels.mla_decode.wgmma_tokens.heads_per_cta).")
    return Table(rows, cols, caption)


def _nvcc_version(text: str | None) -> str:
    m = re.search(r"cuda_(\d+\.\d+)", text or "") or re.search(r"release (\d+\.\d+)", text or "")
    return m.group(1) if m else (text or "?")


def wgmma_text(paths: Result | Mapping[str, Any] | None) -> str:
    """The wgmma path's per-tile arithmetic (from its constants) and, from a ``fused_decode_paths`` result (or its
    ``build`` row), its compiled resources and how many CTAs a multiprocessor holds."""
    build = (next((r for r in paths.rows if r.get("section") == "build"), None) if isinstance(paths, Result)
             else paths)
    f = tile_floors()
    text = (f"Per {BLOCK_N}-token tile and {HEADS_PER_CTA} heads: {f['flops'] / 1e6:.1f} MFLOP on the tensor cores, "
            f"**{f['tensor']:,.0f} cycles** of one multiprocessor at {TENSOR_FLOP_PER_CYCLE:,} dense 16-bit FLOP per "
            f"cycle ({f['scores']:,.0f} of them the scores); shared memory carries {f['smem_bytes'] / 1024:.0f} KB "
            f"(the {f['fp8_bytes'] / 1024:.0f} KB FP8 tile converted and written, the query and the converted tile "
            f"read for the scores, V and P for the outputs, P written), **{f['smem']:,.0f} cycles** at "
            f"{SMEM_BYTES_PER_CYCLE} B per cycle. The two floors are nearly equal: a tile is as fast as the tensor "
            "cores and shared memory kept busy at once.")
    w = (build or {}).get("wgmma") or {}
    if w.get("runs") and w.get("registers"):
        per_sm = min(SM90_SMEM_PER_SM // w["smem"], SM90_REGS_PER_SM // (w["registers"] * w["threads"]))
        text += (f" Compiled ({w['arch']}, nvcc {_nvcc_version(build.get('nvcc'))}): {w['registers']} registers per "
                 "thread, "
                 f"{w['spill_bytes']} bytes of spills, {w['smem'] / 1024:.1f} KB of shared memory per CTA of "
                 f"{w['threads']} threads: **{per_sm} CTA per multiprocessor**.")
    elif build is not None:
        text += f" The wgmma path did not run in the recording ({w.get('why') or 'no build row'})."
    return text


def tokens_text(paths: Result | Mapping[str, Any] | None, geometry: MLAGeometry = GLM5) -> str:
    """The tokens-on-M wgmma path's tensor time per tile (from its constants: 64 tokens as M, 16 or 32 heads as N)
    beside the wgmma path's, and, from a ``fused_decode_paths`` result (or its ``build`` row), each instantiation's
    compiled resources; a recording made before the path says so."""
    build = (next((r for r in paths.rows if r.get("section") == "build"), None) if isinstance(paths, Result)
             else paths)
    flops = {hn: 2 * wgmma_tokens.BLOCK_N * hn * (geometry.kv_dim + geometry.kv_lora_rank)
             for hn in wgmma_tokens.HEADS_PER_CTA}
    cycles = " and ".join(f"**{f / TENSOR_FLOP_PER_CYCLE:,.0f} cycles** at {hn} heads per CTA"
                          for hn, f in flops.items())
    text = (f"Per {wgmma_tokens.BLOCK_N}-token tile its tensor cores run {cycles}, against the wgmma path's "
            f"{tile_floors(geometry)['tensor']:,.0f} for its {HEADS_PER_CTA} rows however few of them are heads.")
    t = (build or {}).get("wgmma_tokens")
    if t and t.get("runs") and t.get("per_cta"):
        parts = [f"{hn} heads per CTA: {c['registers']} registers per thread, {c['spill_bytes']} bytes of spills, "
                 f"{c['smem'] / 1024:.1f} KB of shared memory, {c['threads']} threads"
                 for hn, c in sorted(t["per_cta"].items(), key=lambda kv: int(kv[0]))]
        text += f" Compiled ({t['arch']}, nvcc {_nvcc_version(build.get('nvcc'))}): " + "; ".join(parts) + "."
    elif t:
        text += f" The tokens-on-M wgmma path did not run in the recording ({t.get('why') or 'no build'})."
    elif build is not None:
        text += " The recording predates the tokens-on-M wgmma path: it has no build of it."
    return text


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _inexact(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cases where the BF16 path is not exact, so the error ratio means something."""
    return [r for r in cases if r.get("ratio") is not None and (r.get("bf16_rel_err") or 0) > 0]


def _range(xs: list[float], fmt: str = ".2f") -> str:
    return "—" if not xs else f"{min(xs):{fmt}}–{max(xs):{fmt}}×"


def _path(row: Mapping[str, Any]) -> str:
    """What a case row ran: its ``path``."""
    return row["path"]


def validation_table(result: Result, caption: str) -> Table:
    """One line per path of the case table (ours and each path: cases passed, worst error against float64, error
    over the BF16 path's), one per peer run on the same inputs, then the contracts, bad inputs, CUDA graphs and
    compute-sanitizer where the run has them."""
    rows = []
    sections = {r.get("section") for r in result.rows}
    cases = result.table("cases")
    for path in [p for p in PATH_NAMES if any(_path(r) == p for r in cases)]:
        sel = [r for r in cases if _path(r) == path]
        errs = [r["rel_err"] for r in sel if r.get("rel_err") is not None]
        heads = sorted({r["heads"] for r in sel})
        ran = sorted({r["kernel_path"] for r in sel if r.get("kernel_path")})
        n = len({r["case"] for r in sel})
        what = f"{PATH_NAMES[path]}: {n} case{'s' if n != 1 else ''}, heads {', '.join(map(str, heads))}"
        if path == "ours" and ran:
            what += f" (ran {paths_said(ran)})"
        rows.append({"what": what, "passed": f"{sum(bool(r['passed']) for r in sel)} / {len(sel)}",
                     "err": max(errs, default=None), "ratio": _range([r["ratio"] for r in _inexact(sel)])})
    if "fp8_peers" in sections:
        from kvwall.reports.fused_bench_report import label

        ran = [r for r in result.table("fp8_peers") if r.get("rel_err") is not None]
        for peer in sorted({r["peer"] for r in ran}):
            sel = [r for r in ran if r["peer"] == peer]
            rows.append({"what": f"{label(peer)}, same inputs", "passed": f"{len(sel)} ran",
                         "err": max(r["rel_err"] for r in sel),
                         "ratio": _range([r["ratio_vs_bf16"] for r in sel if r.get("ratio_vs_bf16")], ".1f")})
    if "contract" in sections:
        con = result.table("contract")
        paths = sorted({r["path"] for r in con}, key=list(PATH_NAMES).index)
        rows.append({"what": f"contracts ({len({r['check'] for r in con})}, on {', '.join(paths)})",
                     "passed": f"{sum(bool(r['ok']) for r in con)} / {len(con)}"})
    for section, what in (("errors", "bad inputs raise before launch, out untouched"),
                          ("graph", "CUDA graph: capture once, replay with new lengths, indices and scales")):
        if section in sections:
            sel = result.table(section)
            rows.append({"what": what, "passed": f"{sum(bool(r['passed']) for r in sel)} / {len(sel)}"})
    if "sanitizer" in sections:
        san = result.table("sanitizer")[0]
        ran = san.get("paths", ["triton"])  # a row without paths was recorded when the program ran the Triton path only
        rows.append({"what": f"`compute-sanitizer --tool memcheck` on {paths_said(ran)}",
                     "passed": {True: "clean", False: "FAILED", None: "not run"}[san["passed"]]})
    return Table(rows, {"check": "what", "passed": "passed", "worst error vs float64": ("err", scientific),
                        "error / the BF16 path's": ("ratio", plain)}, caption)


def validation_passed(result: Result) -> bool:
    """Every row of the run that has a verdict passed (``passed`` or, for contracts, ``ok``)."""
    verdicts = [r.get("passed", r.get("ok")) for r in result.rows if r.get("section") != "setup"]
    return all(bool(v) for v in verdicts if v is not None)


def validation_rule_text(result: Result) -> tuple[str, dict[str, Any]]:
    """The flash-attention rule on the recorded cases: each path's error over the BF16 path's (where the BF16 path
    is not exact), against the bound of 2; and the values it quotes."""
    cases = result.table("cases")
    values: dict[str, Any] = {}
    parts = []
    for path in [p for p in PATH_NAMES if any(_path(r) == p for r in cases)]:
        ratios = [r["ratio"] for r in _inexact([r for r in cases if _path(r) == path])]
        if ratios:
            values[f"{path}_ratio_max"] = max(ratios)
            parts.append(f"{PATH_NAMES[path]} {min(ratios):.2f}–{max(ratios):.2f}×")
    if not parts:
        return "The BF16 path is exact on every recorded case: no error ratio to compare.", values
    worst = max(values.values())
    text = (f"Error over the BF16 path's, on the cases where the BF16 path is not exact: {'; '.join(parts)} — "
            f"{'within' if worst <= 2 else 'OUTSIDE'} the rule's bound of 2×, and at or below 1× where the softmax "
            "weights enter the second product in float16 (11 significant bits) rather than BF16 (8).")
    return text, values

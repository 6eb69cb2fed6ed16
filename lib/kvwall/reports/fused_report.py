"""Chapter 5's arithmetic and checks, as numbers and tables: what a decode should cost (bytes, FLOPs, which ceiling
binds), what each of ours' paths does per tile and what its build holds, the exactness claims of the design, and the
validation of every path. The chapter writes the sentences around them.

Every byte and FLOP count comes from :mod:`kvwall.model.roofline` (one byte count: each token's FP8 latent plus its
page-table index, 580 B per token for GLM-5 at page size 1); the per-tile counts from the kernels' own constants
(:mod:`kvwall.kernels.mla_decode.wgmma`, :mod:`kvwall.kernels.mla_decode.wgmma_tokens`) and the recorded tuning (the
Triton path's launch shapes). The grid is :mod:`kvwall.reports.fused_bench_report`, the lab detail
:mod:`kvwall.reports.fused_lab_report`.
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
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.model.roofline import decode_flops, full_pool_cast_bytes, gather_cast_bytes, kv_read_bytes, roofline_us
from kvwall.reports.fused_bench_report import WORDS, Row, label, rows_of
from kvwall.reports.tables import MISSING, Table
from kvwall.reports.words import columns
from kvwall.results import Result

#: The head counts of chapter 5's grid (GLM-5 per GPU at TP 4 = 16, DeepSeek-V3 at TP 4 = 32, ... all 128).
GRID_HEADS = (16, 32, 64, 128)
#: How the chapter names what a validation row ran.
PATH_NAMES = {"ours": "ours", **KERNEL_NAMES}
#: Hopper (SM90) per multiprocessor: dense 16-bit tensor-core FLOP per cycle (wgmma m64n64k16 in 32 cycles),
#: shared-memory bytes per cycle, shared memory and registers.
TENSOR_FLOP_PER_CYCLE, SMEM_BYTES_PER_CYCLE = 4096, 128
SM90_SMEM_PER_SM, SM90_REGS_PER_SM = 233_472, 65_536


def recorded_paths(paths: Result | None) -> list[str]:
    """Ours' paths a ``fused_decode_paths`` recording timed (its forced-path rows), in the dispatcher's order; every
    path of the library where there is no recording."""
    if paths is None:
        return list(KERNEL_NAMES)
    timed = {r.strategy for r in rows_of(paths, "bench")}
    return [k for k in KERNEL_NAMES if k in timed]


def paths_said(paths: Iterable[str]) -> str:
    """Ours' paths (dispatcher names) as a table cell names them, in the dispatcher's order: ``"the Triton path and
    the wgmma path"``."""
    said = [f"the {KERNEL_NAMES[k]}" for k in KERNEL_NAMES if k in set(paths)]
    return ", ".join(said[:-1]) + " and " * (len(said) > 1) + said[-1] if said else "no path"


# --------------------------------------------------------------------------------------------------
# What it should cost
# --------------------------------------------------------------------------------------------------


def _ridge(ceilings: Mapping[str, float]) -> float:
    c = Row(ceilings)
    return c.bf16_tflops * 1e12 / (c.copy_gbps * 1e9)


def cost_numbers(ceilings: Mapping[str, float] | None, geometry: MLAGeometry = GLM5) -> dict[str, float | None]:
    """Bytes read per token (FP8, its page-table index, and a BF16 cache's), FLOPs per token and head, and (given the
    measured ``copy_gbps`` and ``bf16_tflops``) the ceilings and the ridge point in FLOP per byte; None where the
    ceilings are not given."""
    per_token, c = kv_read_bytes(1, geometry), Row(ceilings or {})
    return dict(
        per_token_bytes=per_token,
        kv_dim=geometry.kv_dim,
        kv_lora_rank=geometry.kv_lora_rank,
        index_bytes=per_token - geometry.kv_dim,
        flops=decode_flops(1, 1, geometry),
        bf16_per_token_bytes=kv_read_bytes(1, geometry, kv_dtype=torch.bfloat16),
        copy_gbps=c.copy_gbps,
        bf16_tflops=c.bf16_tflops,
        ridge=_ridge(c) if c else None,
    )


def cost_table(
    ceilings: Mapping[str, float] | None,
    caption: str,
    *,
    heads: Iterable[int] = GRID_HEADS,
    tokens: int = 131072,
    geometry: MLAGeometry = GLM5,
) -> Table:
    """Per head count: arithmetic intensity, which ceiling binds (given the ceilings), and the roofline of one
    ``tokens``-token request per layer, with the time at each ceiling alone."""
    rows = []
    for h in heads:
        flops, nbytes = decode_flops(h, tokens, geometry), kv_read_bytes(tokens, geometry)
        row: dict[str, Any] = dict(heads=h, intensity=flops / nbytes)
        if ceilings:
            copy, tflops = Row(ceilings).copy_gbps, Row(ceilings).bf16_tflops
            row.update(
                bound=WORDS.bound[flops / nbytes < _ridge(ceilings)],
                mem_us=nbytes / copy / 1e3,
                math_us=flops / tflops / 1e6,
                roof=roofline_us(h, tokens, copy, tflops, geometry),
            )
        rows.append(row)
    cols = columns(WORDS.cost_table) | (columns(WORDS.cost_ceilings) if ceilings else {})
    return Table(rows, cols, caption)


def bytes_by_path(
    caption: str, context: int = 131072, *, pool_tokens: int = ORIGINAL.pool_tokens, geometry: MLAGeometry = GLM5
) -> Table:
    """HBM bytes per layer each way of computing the decode moves for one request of ``context`` tokens: the
    original's whole-pool cast, chapter 4's gather-then-cast (each followed by BF16 attention), a BF16 cache, ours."""
    bf16_attention = kv_read_bytes(context, geometry, kv_dtype=torch.bfloat16)
    ours = kv_read_bytes(context, geometry)
    moved = (
        full_pool_cast_bytes(geometry, pool_tokens)["total"] + bf16_attention,
        gather_cast_bytes(context, geometry) + bf16_attention,
        bf16_attention,
        ours,
    )
    rows = [dict(path=p, mb=b / 1e6, x=b / ours) for p, b in zip(WORDS.bytes_paths, moved)]
    return Table(rows, columns(WORDS.bytes_table, k=context // 1024), caption)


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
    q16 = (q.double() * 2.0**exponent).to(torch.float16)
    return bool(((q16.double() * 2.0**-exponent) == q.double()).all()), float(q16.abs().max())


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
    return dict(
        flops=2 * m * n * (d + dc),
        scores=scores,
        outputs=out,
        tensor=scores + out,
        smem_bytes=traffic,
        smem=traffic / SMEM_BYTES_PER_CYCLE,
        fp8_bytes=n * d,
    )


def tokens_tile_cycles(geometry: MLAGeometry = GLM5) -> dict[int, float]:
    """The tokens-on-M wgmma path's tensor cycles per 64-token tile, per instantiation (16 or 32 heads per CTA as the
    MMA's N)."""
    per_head = 2 * wgmma_tokens.BLOCK_N * (geometry.kv_dim + geometry.kv_lora_rank) / TENSOR_FLOP_PER_CYCLE
    return {hn: hn * per_head for hn in wgmma_tokens.HEADS_PER_CTA}


def build_resources(paths: Result | Mapping[str, Any] | None) -> dict[str, dict[str, Any] | None]:
    """From a ``fused_decode_paths`` result (or its ``build`` row): each wgmma kernel's compiled resources --
    ``"wgmma"``, and ``"wgmma_tokens_16"`` / ``"wgmma_tokens_32"`` per tokens-on-M instantiation -- as its build row
    (``registers``, ``spill_bytes``, ``smem`` bytes, ``threads``) with ``arch``, ``nvcc`` (the version), ``smem_kb``
    and ``ctas_per_sm`` (how many CTAs an SM90 multiprocessor holds, by shared memory and registers); None for a
    kernel the recording did not build or run, or predates."""
    build = Row(next(iter(rows_of(paths, "build")), {}) if isinstance(paths, Result) else paths or {})
    w, t = Row(build.wgmma or {}), Row(build.wgmma_tokens or {})
    per_cta = (t.per_cta or {}) if t.runs else {}
    found = {
        "wgmma": (w, w if w.runs and w.registers else None),
        **{f"wgmma_tokens_{hn}": (t, per_cta.get(str(hn))) for hn in wgmma_tokens.HEADS_PER_CTA},
    }
    m = re.search(r"cuda_(\d+\.\d+)|release (\d+\.\d+)", build.nvcc or "")
    out: dict[str, dict[str, Any] | None] = {}
    for name, (built, k) in found.items():
        k = Row(k or {})
        per_sm = min(SM90_SMEM_PER_SM // k.smem, SM90_REGS_PER_SM // (k.registers * k.threads)) if k else 0
        out[name] = (
            dict(
                k,
                arch=built.arch,
                nvcc=(m.group(1) or m.group(2)) if m else build.nvcc,
                smem_kb=(k.smem or 0) / 1024,
                ctas_per_sm=per_sm,
            )
            if k
            else None
        )
    return out


def design_table(tuning: Result | None, caption: str, heads: Iterable[int] = GRID_HEADS) -> Table:
    """Per head count, what each path does with one tile of tokens: how many programs (CTAs) convert each token, and
    what share of the MMA's head side is padding (the Triton path's head block, the wgmma path's 64 rows, the
    tokens-on-M path's 16 or 32 columns). The Triton path's columns where a tuning is given (its shape at 128K
    tokens, :func:`triton_shapes`)."""
    shapes = triton_shapes(tuning) if tuning else {}
    rows = []
    for h in heads:
        row: dict[str, Any] = dict(heads=h)
        if h in shapes:
            bh, bn = shapes[h].cfg_block_h, shapes[h].cfg_block_n
            row.update(t_block=f"{bh} × {bn}", t_conv=-(-h // bh), t_pad=1 - h / (-(-h // bh) * bh))
        ctas, hn = -(-h // HEADS_PER_CTA), wgmma_tokens.heads_per_cta(h)
        row.update(
            w_conv=ctas, w_pad=1 - h / (ctas * HEADS_PER_CTA), k_conv=-(-h // hn), k_pad=1 - h / (-(-h // hn) * hn)
        )
        rows.append(row)
    cols = columns(WORDS.design_table) | (columns(WORDS.design_triton) if shapes else {})
    return Table(rows, cols | columns(WORDS.design_wgmma), caption)


def triton_shapes(tuning: Result, tokens: int = 131072) -> dict[int, Row]:
    """The Triton path's launch shape per head count of the grid, from the recorded tuning's winners: the winner of
    the smallest tuned head count >= heads (the launcher's rule,
    :func:`kvwall.kernels.mla_decode.launch_shape.tuned_entry`) at the context nearest ``tokens``."""
    winners = rows_of(tuning, "winner")
    tuned = sorted({w.heads for w in winners})
    out = {}
    for h in GRID_HEADS:
        th = next((t for t in tuned if t >= h), tuned[-1])
        w = min((w for w in winners if w.heads == th), key=lambda w: abs(math.log(w.tokens / tokens)))
        out[h] = Row(w, tuned_heads=th)
    return out


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def _inexact(cases: list[Row]) -> list[Row]:
    """Cases where the BF16 path is not exact, so the error ratio means something."""
    return [r for r in cases if r.ratio is not None and (r.bf16_rel_err or 0) > 0]


def _range(xs: list[float], fmt: str = ".2f") -> str:
    return f"{min(xs):{fmt}}–{max(xs):{fmt}}×" if xs else MISSING


def _passed(rows: list[Row]) -> str:
    return f"{sum(bool(r.ok if r.passed is None else r.passed) for r in rows)} / {len(rows)}"


def validation_table(result: Result, caption: str) -> Table:
    """One line per path of the case table (ours and each path: cases passed, worst error against float64, error
    over the BF16 path's), one per peer run on the same inputs, then the contracts, bad inputs, CUDA graphs and
    compute-sanitizer where the run has them."""
    rows, cases = [], rows_of(result, "cases")
    for path in [p for p in PATH_NAMES if any(r.path == p for r in cases)]:
        sel = [r for r in cases if r.path == path]
        heads, n = sorted({r.heads for r in sel}), len({r.case for r in sel})
        ran = sorted({r.kernel_path for r in sel if r.kernel_path})
        what = f"{PATH_NAMES[path]}: {n} case{'s' * (n != 1)}, heads {', '.join(map(str, heads))}"
        what += f" (ran {paths_said(ran)})" if path == "ours" and ran else ""
        rows.append(
            dict(
                what=what,
                passed=_passed(sel),
                err=max((r.rel_err for r in sel if r.rel_err is not None), default=None),
                ratio=_range([r.ratio for r in _inexact(sel)]),
            )
        )
    peers = [r for r in rows_of(result, "fp8_peers") if r.rel_err is not None]
    for peer in sorted({r.peer for r in peers}):
        sel = [r for r in peers if r.peer == peer]
        rows.append(
            dict(
                what=f"{label(peer)}, same inputs",
                passed=f"{len(sel)} ran",
                err=max(r.rel_err for r in sel),
                ratio=_range([r.ratio_vs_bf16 for r in sel if r.ratio_vs_bf16], ".1f"),
            )
        )
    if con := rows_of(result, "contract"):
        paths = sorted({r.path for r in con}, key=list(PATH_NAMES).index)
        rows.append(dict(what=f"contracts ({len({r.check for r in con})}, on {', '.join(paths)})", passed=_passed(con)))
    said = WORDS.validation
    for section in ("errors", "graph"):
        if checks := rows_of(result, section):
            rows.append(dict(what=said[section], passed=_passed(checks)))
    for san in rows_of(result, "sanitizer")[:1]:  # a row without paths was recorded when it ran the Triton path only
        rows.append(
            dict(
                what=said.sanitizer.format(paths=paths_said(san.paths or ["triton"])),
                passed=said.sanitized[san.passed],
            )
        )
    return Table(rows, columns(WORDS.validation_table), caption)


def validation_passed(result: Result) -> bool:
    """Every row of the run that has a verdict passed (``passed`` or, for contracts, ``ok``)."""
    return all(
        bool(v) for r in result.rows if r.get("section") != "setup" and (v := r.get("passed", r.get("ok"))) is not None
    )


def validation_ratios(result: Result) -> dict[str, tuple[float, float]]:
    """The flash-attention rule on the recorded cases: per path (ours and each path), the range of its error over the
    BF16 path's on the cases where the BF16 path is not exact (the rule's bound is 2); paths without such a case are
    left out."""
    cases = rows_of(result, "cases")
    ratios = {p: [r.ratio for r in _inexact([r for r in cases if r.path == p])] for p in PATH_NAMES}
    return {p: (min(xs), max(xs)) for p, xs in ratios.items() if xs}

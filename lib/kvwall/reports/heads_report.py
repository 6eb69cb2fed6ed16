"""Chapter 6's "more heads per GPU": per head count and batch of chapter 5's grid, the fastest BF16-accurate path on
the FP8 cache (ours or gather_cast + FlashInfer) against FlashMLA BF16 and FP8. Numbers and a table; chapter 6
writes what they say."""

from __future__ import annotations


from kvwall.reports.answer_report import WORDS
from kvwall.reports.evidence import Evidence, bench_us
from kvwall.reports.rows import Row
from kvwall.reports.tables import Table
from kvwall.reports.words import columns


#: BF16-accurate kernels on the FP8 cache (what a patch can run), and the peers a reader weighs against them.
ACCURATE_FP8 = {"ours": "ours", "gather_cast_bf16": "gather_cast + FlashInfer"}


def kernel_rows(ev: Evidence) -> list[Row]:
    """Per heads and batch regime of chapter 5's grid (context 32K, or the grid's middle one): the faster
    BF16-accurate path on the FP8 cache (``best``, ours or gather_cast), its µs and the other's, FlashMLA BF16's (a
    BF16 cache: twice the memory) and FlashMLA FP8's (FP8 query) µs per layer, and their times over the best's
    (``bf16_x``, ``fp8_x``: above 1, the accurate path on the FP8 cache is faster)."""
    us = bench_us(ev.bench)
    if not us:
        return []
    ctxs = sorted({c for (_, _, c, _) in us})
    ctx = 32_768 if 32_768 in ctxs else ctxs[len(ctxs) // 2]
    rows = []
    for h in sorted({h for (_, h, _, _) in us}):
        for b in sorted({b for (_, hh, c, b) in us if hh == h and c == ctx}):
            acc = {k: us[(k, h, ctx, b)] for k in ACCURATE_FP8 if (k, h, ctx, b) in us}
            if not acc:
                continue
            best = min(acc, key=acc.__getitem__)
            fm_bf16, fm_fp8 = us.get(("flashmla_dense_bf16", h, ctx, b)), us.get(("flashmla_dense_fp8", h, ctx, b))
            rows.append(
                Row(
                    heads=h,
                    batch=b,
                    context=ctx,
                    best=ACCURATE_FP8[best],
                    best_us=acc[best],
                    other_us=next((v for k, v in acc.items() if k != best), None),
                    fm_bf16=fm_bf16,
                    fm_fp8=fm_fp8,
                    bf16_x=fm_bf16 and fm_bf16 / acc[best],
                    fp8_x=fm_fp8 and fm_fp8 / acc[best],
                )
            )
    return rows


def kernel_table(ev: Evidence, caption: str) -> Table | None:
    """:func:`kernel_rows` as a table (None without a recorded benchmark)."""
    rows = [Row(r, point=WORDS.heads_point.format(**r)) for r in kernel_rows(ev)]
    return Table(rows, columns(WORDS.heads_table), caption) if rows else None


def fastest_by_heads(ev: Evidence) -> dict[int, tuple[list[int], list[int], int]]:
    """Per head count of :func:`kernel_rows`: the batches where ours is the faster accurate path, every batch, and at
    how many of them FlashMLA BF16 (a BF16 cache) is faster still."""
    rows, out = kernel_rows(ev), {}
    for h in sorted({r.heads for r in rows}):
        sel = [r for r in rows if r.heads == h]
        out[h] = (
            [r.batch for r in sel if r.best == ACCURATE_FP8["ours"]],
            [r.batch for r in sel],
            sum(bool(r.fm_bf16 and r.fm_bf16 < r.best_us) for r in sel),
        )
    return out

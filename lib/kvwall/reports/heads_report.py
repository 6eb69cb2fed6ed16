"""Chapter 6's "more heads per GPU": per head count and batch of chapter 5's grid, the fastest BF16-accurate path on
the FP8 cache (ours or gather_cast + FlashInfer) against FlashMLA BF16 and FP8."""

from __future__ import annotations

from typing import Any

from kvwall.reports.evidence import Evidence, bench_us, flashmla_fp8_error
from kvwall.reports.tables import Table

__all__ = ["ACCURATE_FP8", "kernel_rows", "kernel_table", "kernel_text"]


#: BF16-accurate kernels on the FP8 cache (what a patch can run), and the peers a reader weighs against them.
ACCURATE_FP8 = {"ours": "ours", "gather_cast_bf16": "gather_cast + FlashInfer"}


def kernel_rows(ev: Evidence) -> list[dict[str, Any]]:
    """Per heads and batch regime of chapter 5's grid (context 32K, or the grid's middle one): the faster
    BF16-accurate path on the FP8 cache (ours or gather_cast), FlashMLA BF16 (a BF16 cache: twice the memory) and
    FlashMLA FP8 (FP8 query), µs per layer."""
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
            rows.append({"heads": h, "batch": b, "context": ctx, "best": ACCURATE_FP8[best], "best_us": acc[best],
                         "other_us": next((v for k, v in acc.items() if k != best), None),
                         "fm_bf16": us.get(("flashmla_dense_bf16", h, ctx, b)),
                         "fm_fp8": us.get(("flashmla_dense_fp8", h, ctx, b))})
    return rows


def kernel_table(ev: Evidence) -> Table | None:
    """:func:`kernel_rows` as a table (None without a recorded benchmark)."""
    rows = kernel_rows(ev)
    if not rows:
        return None
    for r in rows:
        r["point"] = f"{r['heads']} heads, batch {r['batch']}"
        r["bf16_x"] = f"{r['fm_bf16'] / r['best_us']:.2f}×" if r["fm_bf16"] else "—"
        r["fp8_x"] = f"{r['fm_fp8'] / r['best_us']:.2f}×" if r["fm_fp8"] else "—"
    err_fp8, err_ours, _ = flashmla_fp8_error(ev)
    err = (f" FlashMLA FP8's error against float64 is {err_fp8 / err_ours:.0f}× ours' on random Gaussian q and latent "
           "(chapter 5's regime; chapter 5b gives it per regime)." if err_fp8 and err_ours else "")
    return Table(rows, {"heads, batch": "point", "fastest accurate on FP8": "best",
                        "µs": ("best_us", lambda v: f"{v:.0f}"),
                        "other accurate µs": ("other_us", lambda v: f"{v:.0f}" if v else "—"),
                        "FlashMLA BF16 µs / its µs (>1: it is faster)": "bf16_x",
                        "FlashMLA FP8 µs / its µs (>1: it is faster)": "fp8_x"},
                 f"µs per layer at {rows[0]['context'] // 1024}K tokens a request (batches: mixed lengths, chapter "
                 f"5's grid). The ratios are FlashMLA's time over the fastest accurate path's, as in chapter 5: above "
                 f"1×, the accurate path on the FP8 cache is faster (FlashMLA BF16 reads a BF16 cache, twice the "
                 f"memory).{err} " + ev.bench.caption())


def kernel_text(ev: Evidence) -> str:
    """What :func:`kernel_rows` says, per head count: where ours is the faster accurate path on the FP8 cache, and
    how often FlashMLA BF16 (a BF16 cache) beats it."""
    rows = kernel_rows(ev)
    if not rows:
        return ""
    parts = []
    for h in sorted({r["heads"] for r in rows}):
        sel = [r for r in rows if r["heads"] == h]
        ours = [r["batch"] for r in sel if r["best"] == "ours"]
        who = ("ours at every batch" if len(ours) == len(sel) else "gather_cast + FlashInfer at every batch"
               if not ours else f"ours at batch {', '.join(map(str, ours))}, gather_cast + FlashInfer at the others")
        bf16 = sum(1 for r in sel if r["fm_bf16"] and r["fm_bf16"] < r["best_us"])
        parts.append(f"{h} heads: {who}; FlashMLA BF16 faster at {bf16} of {len(sel)}")
    wins = sum(1 for r in rows if r["best"] == "ours")
    runs = ("ours at every point of the table" if wins == len(rows) else
            "gather_cast + FlashInfer at every point of the table" if not wins else
            f"ours where it is the faster ({wins} of {len(rows)} points) and gather_cast + FlashInfer at the others")
    return ("Fastest BF16-accurate path on the FP8 cache, by heads per GPU (" + "; ".join(parts) + "). A patch that "
            f"keeps the FP8 cache and BF16 accuracy therefore runs {runs}; FlashMLA BF16 needs a BF16 cache (half the "
            "tokens), FlashMLA FP8 an FP8 query.")

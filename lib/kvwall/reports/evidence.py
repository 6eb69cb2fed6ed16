"""The recorded evidence the book's answer reads (:class:`Evidence`), and the readings of it that more than one row
or chapter needs: chapter 3's door matrix, FlashMLA FP8's error, the sweep's batch axis, the step per batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from kvwall.reports import fused_bench_report
from kvwall.reports.answer_report import SweepFit, fit_sweep, step_rows, sweep_rows
from kvwall.reports.doors_report import calls_for_matrix
from kvwall.reports.rows import Row, rows_of
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY, door_matrix
from kvwall.results import Result, ResultMissingError, load_result

#: The recorded results the decision reads, by :class:`Evidence` field (GPU recordings but ``doors_checks`` and
#: ``dsa_forced_dense``, CPU runs); the first two are required.
_SOURCE_OF = dict(
    step="decode_step_paths",
    sweep="path_sweep",
    bench="fused_decode_bench",
    validation="fused_decode_validation",
    doors_checks="doors_checks",
    doors_sm90="doors_sm90",
    accuracy="fp8_accuracy",
    dsa="dsa_decode",
    dsa_forced="dsa_forced_dense",
    step_batches="decode_step_batches",
    multi_token="multi_token_decode",
)
SOURCES = tuple(_SOURCE_OF.values())
#: The door of chapter 3's matrix that is the DSA (sparse) kernel.
SPARSE_DOOR = "sm120-sparse"


@dataclass
class Evidence:
    """The recorded results the decision reads (all but ``step`` and ``sweep`` may be missing: the rows that need
    them say so), and the cost model fitted on the sweep."""

    step: Result
    sweep: Result
    bench: Result | None = None
    validation: Result | None = None
    doors_checks: Result | None = None
    doors_sm90: Result | None = None
    accuracy: Result | None = None
    dsa: Result | None = None
    dsa_forced: Result | None = None
    step_batches: Result | None = None
    multi_token: Result | None = None
    fit: SweepFit | None = None

    def __post_init__(self) -> None:
        if self.fit is None:
            self.fit = fit_sweep(self.sweep)

    @classmethod
    def load(
        cls, loader: Callable[[str], Result | None] | None = None, fit: SweepFit | None = None, **known: Result | None
    ) -> Evidence:
        """Every result of :data:`SOURCES` through ``loader`` (a chapter's ``recorded_or_none``; default: the
        recorded files, a missing optional one as None); ``known``: results already loaded, by field name
        (``step=``, ``sweep=``)."""

        def default(name: str) -> Result | None:
            try:
                return load_result(name)
            except ResultMissingError:
                if name in SOURCES[:2]:
                    raise
                return None

        get = loader or default
        return cls(**{f: known[f] if f in known else get(n) for f, n in _SOURCE_OF.items()}, fit=fit)

    def results(self) -> list[Result]:
        return [r for r in (getattr(self, f) for f in _SOURCE_OF) if r is not None]


def door_cells(checks: Result | None, sm90: Result | None) -> list[Row]:
    """Chapter 3's matrix from its recorded evidence: the release's cited lines and replayed checks
    (``doors_checks``) and the H200's calls (``doors_sm90``, missing downloads set aside as chapter 3 does)."""
    if checks is None:
        return []
    calls = calls_for_matrix(sm90.table("calls")) if sm90 is not None else []
    return [Row(c) for c in door_matrix(checks.table("citations"), checks.table("replays"), calls)]


def open_doors(cells: Sequence[Row], family: str, *, dense: bool | None = None) -> list[Row]:
    """The cells of ``family`` that are not refused (``dense``: True only dense doors, False only the sparse one)."""
    return [
        c
        for c in cells
        if c.family == family and c.status != "refused" and (dense is None or (c.door != SPARSE_DOOR) == dense)
    ]


def refused_doors(cells: Sequence[Row], family: str) -> list[str]:
    return [
        DOOR_BY_KEY[c.door].label.split(" (")[0]
        for c in cells
        if c.family == family and c.status == "refused" and c.door != SPARSE_DOOR
    ]


def flashmla_fp8_error(ev: Evidence) -> tuple[float | None, float | None, str]:
    """FlashMLA dense FP8's worst relative error against float64 and ours' worst, and where they come from:
    ``fused_decode_bench`` (every output of the grid checked against float64 first) where it has both, else
    ``fused_decode_validation``. Both on chapter 5's random Gaussian inputs (:data:`RANDOM_INPUTS`)."""
    if ev.bench is not None:
        rows = [r for r in rows_of(ev.bench, "bench") if r.rel_err_f64 is not None]
        fp8 = [r.rel_err_f64 for r in rows if r.strategy == fused_bench_report.FM_FP8]
        ours = [r.rel_err_f64 for r in rows if r.strategy in (fused_bench_report.OURS, fused_bench_report.OURS_PAGE64)]
        if fp8 and ours:
            return max(fp8), max(ours), _SOURCE_OF["bench"]
    fp8, ours = fused_bench_report.flashmla_fp8_error(ev.validation)  # chapter 5's reading of the case table
    if fp8 is not None and ours is not None:
        return fp8, ours, _SOURCE_OF["validation"]
    return None, None, ""


def bench_us(bench: Result | None) -> dict[tuple[str, int, int, int], float]:
    """``(strategy, heads, context, batch) -> µs`` of every timed row of ``fused_decode_bench``."""
    if bench is None:
        return {}
    return {(r.strategy, r.heads, r.context, r.batch): r.us for r in rows_of(bench, "bench") if r.us}


def _sweep_batch(sweep: Result, heads: int = 16) -> dict[str, dict[int, float]]:
    """The sweep's batch axis: ``path -> {batch: µs per layer}``."""
    out: dict[str, dict[int, float]] = {}
    for r in sweep_rows(sweep):
        if r.axis == "batch" and r.heads == heads and r.us:
            out.setdefault(r.path, {})[r.batch] = r.us
    return out


def batch_comparison(sweep: Result, a: str, b: str, *, min_batch: int = 2) -> Row:
    """``a`` against ``b`` on the sweep's batch axis (16 heads, mixed lengths) from ``min_batch`` requests up:
    the batches, where ``a`` is slower, and the range of ``b / a``."""
    us = _sweep_batch(sweep)
    batches = sorted(set(us.get(a, {})) & set(us.get(b, {})))
    batches = [n for n in batches if n >= min_batch]
    ratios = [us[b][n] / us[a][n] for n in batches]
    return Row(
        batches=batches,
        slower_at=[n for n in batches if us[a][n] > us[b][n]],
        ratio_lo=min(ratios, default=None),
        ratio_hi=max(ratios, default=None),
        a_us={n: us[a][n] for n in batches},
        b_us={n: us[b][n] for n in batches},
    )


def step_at(ev: Evidence, path: str) -> dict[int, float]:
    """``{batch: step ms}`` of ``path``: batch 1 from ``decode_step_paths`` (the headline step), larger batches from
    ``decode_step_batches`` where it was recorded."""
    out = {1: r.step_ms for r in step_rows(ev.step) if r.path == path}
    if ev.step_batches is not None:
        out.update(
            {
                r.batch: r.step_ms
                for r in rows_of(ev.step_batches, "path")
                if r.path == path and r.step_ms and r.batch > 1
            }
        )
    return out


def steps_text(ev: Evidence, path: str) -> str:
    """``"22.7 ms (batch 1) … 29.8 ms (batch 64)"``: the step at the smallest and largest batch recorded."""
    s = step_at(ev, path)
    if not s:
        return "not measured"
    lo, hi = min(s), max(s)
    return f"{s[lo]:.1f} ms" + (f" (batch {lo}) … {s[hi]:.1f} ms (batch {hi})" if hi != lo else "")


def span(values: Sequence[float], d: int = 0) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{d}f}" if round(lo, d) == round(hi, d) else f"{lo:.{d}f}–{hi:.{d}f}"

"""Chapter 6's SGLang patch section: what ``sglang_patch_check`` ran and found, every figure from its rows.

Two checks share the result. ``checks`` (+ ``meta``): the backend's source executed with stand-ins for its sglang
imports, eagerly, on SGLang-shaped inputs (:func:`stand_in_summary`, :func:`patch_check_table`). ``real_*``: inside
SGLang 0.5.23's real modules, decode and target-verify, eager and CUDA-graph capture/replay, timed in a graph
(:func:`real_meta`, :func:`real_findings`, :func:`real_check_table`, :func:`real_timing_table`,
:func:`real_memory_table`). The functions return numbers and tables; chapter 6 writes the sentences. A row that failed
shows as failing in the tables, with its problems."""

from __future__ import annotations

from dataclasses import dataclass

from kvwall.peers.sglang_source import SGLangSourceUnavailable, sglang_source
from kvwall.reports.answer_report import WORDS, columns, fill
from kvwall.reports.rows import Row, rows_of
from kvwall.reports.tables import MISSING, Table, scientific
from kvwall.results import Result

#: The forward modes whose whole-pool casts the diffs remove (UPSTREAM.md), by the real check's ``mode`` name.
FORWARD_MODES = {
    "decode": "decode",
    "verify": "target-verify",
    "draft_extend": "draft-extend",
    "prefill": "paged prefill with a cached prefix",
}
VARIANTS = ("unpatched", "gather_cast", "fused")


#: The section's tables' columns and verdicts, in ``book/answer.yml``.
_WORDS = WORDS.patch


def _verdict(r: Row) -> str:
    return _WORDS.ok if r.ok else _WORDS.failed + "; ".join(r.problems or [_WORDS.not_run])


def _vs_unpatched(r: Row) -> str:
    return _WORDS.identical if r.bit_identical_vs_unpatched else scientific(r.max_abs_diff_vs_unpatched)


@dataclass(frozen=True)
class VariantSummary:
    """One variant's rows of a check: how many passed of how many, the whole-pool casts a step they made (each count
    once), the worst relative error against float64 and, for a patch, against unpatched: on how many rows it was
    bit-identical and within BF16 tolerance, and its largest absolute difference."""

    passed: int
    rows: int
    casts: tuple[int, ...]
    max_err: float
    identical: int
    within_tol: int
    max_abs_diff: float


def _summary(rows: list[Row], tol_key: str) -> VariantSummary:
    errors = [r.rel_err_vs_f64 for r in rows if r.rel_err_vs_f64 is not None]
    diffs = [r.max_abs_diff_vs_unpatched for r in rows if r.max_abs_diff_vs_unpatched is not None]
    return VariantSummary(
        sum(bool(r.ok) for r in rows),
        len(rows),
        tuple(sorted({r.whole_pool_casts for r in rows if r.whole_pool_casts is not None})),
        max(errors, default=float("nan")),
        sum(bool(r.bit_identical_vs_unpatched) for r in rows),
        sum(bool(r.get(tol_key)) for r in rows),
        max(diffs, default=0.0),
    )


def _by_variant(rows: list[Row], tol_key: str) -> dict[str, VariantSummary]:
    names = dict.fromkeys(r.variant for r in rows)
    return {v: _summary([r for r in rows if r.variant == v], tol_key) for v in names}


# ---------------------------------------------------------------------------------------------------------
# The check with stand-ins for SGLang's imports (``checks``)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StandIn:
    """The ``checks`` rows: how many cases, the layer counts run, and per variant a :class:`VariantSummary`."""

    cases: int
    layers: list[int]
    variants: dict[str, VariantSummary]


def stand_in_summary(result: Result) -> StandIn | None:
    """:class:`StandIn` of the check with stand-ins for SGLang's imports (None when the run had none)."""
    checks = rows_of(result, "checks")
    return (
        StandIn(
            len({r.case for r in checks}),
            sorted({r.layers for r in checks}),
            _by_variant(checks, "within_bf16_tolerance"),
        )
        if checks
        else None
    )


def patch_check_table(result: Result, caption: str) -> Table:
    """``checks``: per case and variant, the backend's own decode code run unpatched and patched (stand-ins for its
    sglang imports): how many whole-pool casts it made, how far its output is from the unpatched one's, its error
    against float64."""
    rows = [
        Row(
            r,
            what=fill(_WORDS.case, r=r),
            verdict=_verdict(r),
            vs_unpatched=MISSING if r.variant == VARIANTS[0] else _vs_unpatched(r),
        )
        for r in rows_of(result, "checks")
    ]
    return Table(rows, columns(_WORDS.check_table), caption)


# ---------------------------------------------------------------------------------------------------------
# The check inside SGLang's real modules (``real_meta``, ``real_check``, ``real_timing``, ``real_memory``)
# ---------------------------------------------------------------------------------------------------------


def real_meta(result: Result) -> Row | None:
    """What the check inside SGLang's real modules imported, stood in for and drove (None: not part of the run)."""
    rows = rows_of(result, "real_meta")
    return rows[0] if rows else None


def real_check_rows(result: Result) -> list[Row]:
    return rows_of(result, "real_check")


def real_timing_rows(result: Result) -> list[Row]:
    return rows_of(result, "real_timing")


def real_memory_rows(result: Result) -> list[Row]:
    """``real_memory``: per variant, the bytes its backend holds per GPU, measured (empty for results recorded before
    they were, or off a GPU: ``measured`` False)."""
    return [r for r in rows_of(result, "real_memory") if r.measured]


def extra_bytes(result: Result) -> dict[str, int]:
    """What each patch's backend holds per GPU beyond the unpatched one's, in bytes (empty where not measured)."""
    rows = {r.variant: r for r in real_memory_rows(result)}
    base = rows.pop(VARIANTS[0], None)
    return {v: r.total_bytes - base.total_bytes for v, r in rows.items()} if base else {}


@dataclass(frozen=True)
class Findings:
    """What the rows inside SGLang's real modules found: the forward modes driven (``verify``: target-verify at any
    number of draft tokens) and those of :data:`FORWARD_MODES` not driven, the draft tokens per request of
    target-verify, the layers, pool slots and batch, the tokens of the eager step and of each graph replay (those
    of the first variant and mode), the patched rows and how many of them cast the whole pool, and per variant a
    :class:`VariantSummary`."""

    modes: list[str]
    not_driven: list[str]
    draft_tokens: list[int]
    layers: int
    pool_slots: int
    batch: int
    eager_tokens: int | None
    replay_tokens: list[int]
    patched_rows: int
    patched_casting: int
    variants: dict[str, VariantSummary]


def real_findings(result: Result) -> Findings | None:
    """:class:`Findings` of the ``real_check`` rows (None without them)."""
    rows = real_check_rows(result)
    if not rows:
        return None
    first = rows[0]
    modes = list(dict.fromkeys(r.mode.split("_")[0] if r.mode.startswith("verify") else r.mode for r in rows))
    graph = [r for r in rows if r.variant == first.variant and r.mode == first.mode]
    patched = [r for r in rows if r.variant != VARIANTS[0]]
    return Findings(
        modes,
        [m for m in FORWARD_MODES if m not in modes],
        sorted({r.draft_tokens for r in rows if r.draft_tokens}),
        first.layers,
        first.pool_slots,
        first.batch,
        next((r.tokens for r in graph if r.phase == "eager"), None),
        [r.tokens for r in graph if str(r.phase).startswith("replay")],
        len(patched),
        sum(r.whole_pool_casts != 0 for r in patched),
        _by_variant(rows, "within_tol_vs_unpatched"),
    )


def real_check_table(result: Result, caption: str) -> Table:
    """``real_check``, one row per (mode, phase) with the variants side by side, in the rows' order: whole-pool casts
    per step (a graph's: the casts it holds, replayed every step, plus those at replay), errors vs float64, each
    patch's difference from unpatched, and whether every variant's row passed (the problems of any that did not).
    ``verify``: target-verify; ``replay k``: of a CUDA graph."""
    groups: dict[tuple[str, str], dict[str, Row]] = {}
    for r in real_check_rows(result):
        groups.setdefault((r.mode, str(r.phase)), {})[r.variant] = r
    variants = list(dict.fromkeys(r.variant for r in real_check_rows(result)))
    patches = variants[1:]

    def each(by: dict[str, Row], names: list[str], cell) -> str:
        return " / ".join(cell(by[v]) if v in by else MISSING for v in names)

    rows = []
    for (mode, phase), by in groups.items():
        failed = [f"{v}: " + _verdict(r).removeprefix(_WORDS.failed) for v, r in by.items() if not r.ok]
        rows.append(
            Row(
                mode=mode if mode == "verify" else FORWARD_MODES.get(mode, mode),
                phase=phase.replace(" ", "\u00a0"),
                tokens=next(iter(by.values())).tokens,
                casts=each(by, variants, lambda r: str(r.whole_pool_casts)),
                errors=each(by, variants, lambda r: scientific(r.rel_err_vs_f64)),
                vs_unpatched=each(by, patches, _vs_unpatched),
                verdict=_WORDS.ok if not failed else _WORDS.failed + "; ".join(failed),
            )
        )
    order, patched = " / ".join(variants), " / ".join(patches)
    return Table(rows, columns(_WORDS.real_check_table, order=order, patched=patched), caption)


def real_timing_table(result: Result, caption: str) -> Table:
    """``real_timing``: each variant's decode step (every layer) replayed in a CUDA graph: median, min–max, speed-up
    over unpatched; for the fused patch, its µs a layer beside ours alone on the same plan and inputs, in a graph."""
    rows = [
        Row(
            r,
            span=MISSING if r.ms_min is None else fill(_WORDS.span, r=r),
            what=fill(_WORDS.timing_what, len(set(r.lens)) == 1, r=r, tokens=sum(r.lens)),
        )
        for r in real_timing_rows(result)
    ]
    cols = columns(_WORDS.timing_table)
    if any(r.kernel_us_per_layer for r in rows):  # ours inside SGLang's backend against ours alone
        cols |= columns(_WORDS.timing_kernel)
    if any(r.error for r in rows):
        cols |= columns(_WORDS.timing_error)
    return Table(rows, cols, caption)


def real_memory_table(result: Result, caption: str) -> Table:
    """What each variant reserves per GPU, measured with ``torch.cuda.memory_allocated``: at set-up (construction +
    ``init_cuda_graph_state``) and at each capture (metadata buffers, the graph's pool), in MB (10^6 bytes)."""
    mb = 1e6
    rows = [
        Row(
            r,
            setup_mb=r.setup_bytes / mb,
            total_mb=r.total_bytes / mb,
            capture=", ".join(f"{k} {v / mb:,.1f}" for k, v in r.capture_bytes.items()) or MISSING,
            compact=f"{r.compact_rows_reserved:,}" if r.compact_rows_reserved else _WORDS.no_compact,
        )
        for r in real_memory_rows(result)
    ]
    return Table(rows, columns(_WORDS.memory_table), caption)


def sglang_pins(names: tuple[str, ...] = ("torch", "flashinfer_python")) -> dict[str, str]:
    """The versions SGLang 0.5.23 pins for ``names``, read from its wheel's ``METADATA``
    (``Requires-Dist: torch==...``); empty where the wheel cannot be had (offline, empty cache)."""
    try:
        meta = next(sglang_source().glob("sglang-*.dist-info/METADATA"), None)
    except SGLangSourceUnavailable:
        return {}
    pins = {}
    for line in meta.read_text().splitlines() if meta else []:
        name, _, pin = line.removeprefix("Requires-Dist: ").partition("==")
        if line.startswith("Requires-Dist: ") and name.split("[")[0].strip() in names and pin:
            pins[name.split("[")[0].strip()] = pin.split(";")[0].strip()
    return pins

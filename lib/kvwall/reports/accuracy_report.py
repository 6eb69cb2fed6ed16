"""What ``fp8_accuracy`` says, for the chapter "What an FP8 query costs", chapter 6 and the front page: numbers and
rows; chapter 5b writes the sentences, tables and figures around them.

The verdict of a path on a case (:func:`verdicts`): it **keeps BF16 accuracy** when its output's error against
float64 is at most :data:`RULE` times the BF16 reference path's on the same case (chapter 5's rule; the reference
is the most accurate BF16-query, BF16-math path that ran: FlashMLA dense BF16 or gather_cast + FlashInfer BF16; on
a machine where neither ran, the BF16 rounding of the exact output, ``floor_rel_err``), the tail keeps at least
:data:`TAIL_KEPT` of its mass, and the top token's weight is within :data:`TOP_ERR` of float64's.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.sharp_attention import PROFILES
from kvwall.results import Result
from kvwall.reports.rows import Row, rows_of

#: A path keeps BF16 accuracy on a case when its error is at most RULE x the BF16 reference's ...
RULE = 2.0
#: ... the tail keeps at least this fraction of its attention mass ...
TAIL_KEPT = 0.99
#: ... and the top token's (the needle's) weight is within this relative error.
TOP_ERR = 0.02
#: The BF16 paths a case's reference error is taken from (the smaller of those that ran).
BF16_REFERENCES = ("flashmla_dense_bf16", "gather_cast_bf16")
#: The paths the figures draw (the table has every path that ran).
FIGURE_PATHS = (
    "ours",
    "flashmla_dense_fp8",
    "flashmla_dense_bf16",
    "flashinfer_fp8_fa3",
    "gather_cast_bf16",
    "sglang_triton_fp8",
)
_ORDER = [p.name for p in PROFILES]
#: One color per path in every figure (plotly's default cycle repeats after ten series).
COLORS = dict(zip(FIGURE_PATHS, ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf")))


def label(strategy: str) -> str:
    """A path's name as the tables and figures show it."""
    return STRATEGIES[strategy].label if strategy in STRATEGIES else strategy


def order(profile: str) -> int:
    """A profile's place, flattest to sharpest."""
    return _ORDER.index(profile) if profile in _ORDER else len(_ORDER)


def _profiles(rows: list[Row]) -> list[str]:
    """The profiles of ``rows``, flattest to sharpest."""
    return sorted({r.profile for r in rows}, key=order)


def ran(result: Result) -> list[str]:
    """The paths that ran, in the peer table's order."""
    done = {r.strategy for r in rows_of(result, "path") if not r.error}
    return [s for s in STRATEGIES if s in done]


def verdicts(result: Result) -> list[Row]:
    """Every ``path`` row that ran, with its case's fields, ``ref_err`` (the case's BF16 reference error), ``ratio``
    (its error over it) and ``keeps`` (the verdict of the module docstring)."""
    cases = {r.case: r for r in rows_of(result, "case")}
    paths = [r for r in rows_of(result, "path") if not r.error and r.rel_err is not None]
    ref: dict[str, float] = {}
    for r in paths:
        if r.strategy in BF16_REFERENCES:
            ref[r.case] = min(ref.get(r.case, float("inf")), r.rel_err)
    out = []
    for r in paths:
        base = ref.get(r.case, cases[r.case].floor_rel_err)
        ratio = r.rel_err / base if base else None
        keeps = (
            ratio is not None
            and ratio <= RULE
            and (r.tail_mass_kept is None or r.tail_mass_kept >= TAIL_KEPT)
            and (r.top_err or 0.0) <= TOP_ERR
            and r.finite is not False
        )
        out.append(Row(cases[r.case], **r, ref_err=base, ratio=ratio, keeps=keeps))
    return out


def path_summary(result: Result, strategy: str) -> dict[str, Any] | None:
    """One path over every case it ran: cases, cases it keeps BF16 accuracy on, the worst error ratio, the least
    tail mass kept, the worst top-weight error, and the profiles (names) where it fails somewhere. None: it did not
    run."""
    rows = [r for r in verdicts(result) if r.strategy == strategy]
    if not rows:
        return None
    failing, profiles = {r.profile for r in rows if not r.keeps}, _profiles(rows)
    rated = [r for r in rows if r.ratio is not None]
    low, high = min(rated, key=lambda r: r.ratio), max(rated, key=lambda r: r.ratio)
    worst_tail = min(rows, key=lambda r: 1.0 if r.tail_mass_kept is None else r.tail_mass_kept)
    return Row(
        strategy=strategy,
        label=label(strategy),
        cases=len(rows),
        keeps=sum(r.keeps for r in rows),
        ratio_min=low.ratio,
        ratio_max=high.ratio,
        ratio_min_profile=low.profile,
        ratio_max_profile=high.profile,
        profiles=profiles,
        rel_err_max=max(r.rel_err for r in rows),
        tail_kept_min=worst_tail.tail_mass_kept,
        tail_worst_case=worst_tail.case,
        top_err_max=max((r.top_err or 0.0) for r in rows),
        sink_flushed_max=max([r.tail_token_flushed or 0.0 for r in rows if r.sinks] or [0.0]),
        failing_profiles=[p for p in profiles if p in failing],
        passing_profiles=[p for p in profiles if p not in failing],
    )


def _pick(rows: list[Row], **want: Any) -> list[Row]:
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def figure_point(result: Result) -> tuple[int, int]:
    """The heads and context the profile figure shows: 16 heads (or the fewest) at 128K (or the longest)."""
    cases = _pick(rows_of(result, "case"), batch=1)
    heads = min({r.heads for r in cases}, key=lambda h: (h != 16, h))
    contexts = sorted({r.context for r in cases if r.heads == heads})
    return heads, 131_072 if 131_072 in contexts else contexts[-1]


def error_points(result: Result) -> tuple[list[str], dict[str, list[float | None]], list[float | None]]:
    """Error against float64 by profile (flattest to sharpest), one request at the :func:`figure_point`: the profiles,
    each :data:`FIGURE_PATHS` path's error per profile (None where it did not run), and the BF16 rounding of the exact
    output per profile (the floor)."""
    heads, context = figure_point(result)
    rows, cases = (_pick(x, heads=heads, context=context, batch=1) for x in (verdicts(result), rows_of(result, "case")))
    profiles, by = _profiles(cases), {(r.strategy, r.profile): r.rel_err for r in rows}
    floor = {c.profile: c.floor_rel_err for c in cases}
    paths = [p for p in FIGURE_PATHS if any(r.strategy == p for r in rows)]
    return profiles, {p: [by.get((p, q)) for q in profiles] for p in paths}, [floor.get(q) for q in profiles]


def tail_points(result: Result, profile: str) -> tuple[str, dict[tuple[str, int], tuple[list[int], list[float]]]]:
    """The attention mass the tail keeps (kernel over float64, least over heads) against context, one request, for
    ``profile`` (or the sharpest profile recorded): the profile, and per :data:`FIGURE_PATHS` path and head count
    the contexts and the mass kept."""
    names = _profiles(rows_of(result, "case"))
    profile = profile if profile in names else names[-1]
    rows = [r for r in _pick(verdicts(result), profile=profile, batch=1) if r.strategy in FIGURE_PATHS]
    out = {}
    for s in [p for p in FIGURE_PATHS if any(r.strategy == p for r in rows)]:
        for h in sorted({r.heads for r in rows}):
            sel = sorted(_pick(rows, strategy=s, heads=h), key=lambda r: r.context)
            if sel:
                out[(s, h)] = ([r.context for r in sel], [r.tail_mass_kept for r in sel])
    return profile, out


def profile_verdicts(
    result: Result, heads: int | None = None, context: int | None = None
) -> tuple[int, int, list[str], list[dict[str, Any]]]:
    """Per profile, at one request of ``context`` tokens and ``heads`` heads (default: the :func:`figure_point`): each
    :data:`FIGURE_PATHS` path's verdict row (:func:`verdicts`; None where it did not run). Returns the heads, the
    context, the paths and one row per profile (``profile`` and a verdict per path)."""
    dh, dc = figure_point(result)
    heads, context = heads or dh, context or dc
    rows = _pick(verdicts(result), heads=heads, context=context, batch=1)
    paths = [p for p in FIGURE_PATHS if any(r.strategy == p for r in rows)]
    by = {(r.profile, r.strategy): r for r in rows}
    return (
        heads,
        context,
        paths,
        [dict(profile=prof, **{p: by.get((prof, p)) for p in paths}) for prof in _profiles(rows)],
    )


def prediction_rows(contexts: Sequence[int] = (4096, 32_768), heads: int = 16, seed: int = 0) -> list[dict[str, Any]]:
    """The arithmetic's prediction, computed here (float64, any machine): per profile and context, what an e4m3
    query (``q_``), e4m3 softmax weights (``p_``), and both (``qp_``) do to one request of ``heads`` heads
    (:func:`kvwall.model.sharp_attention.emulate_attention` against the exact attention of the same stored values):
    the output's error (``*_err``) and the tail mass kept, least over heads (``*_tail``)."""
    import torch

    from kvwall.experiments.accuracy import path_metrics
    from kvwall.model.geometry import GLM5
    from kvwall.model.sharp_attention import emulate_attention, sharp_request

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for prof in PROFILES:
        for n in contexts:
            req = sharp_request(prof, heads, n, sm_scale=GLM5.sm_scale, gen=gen, device=torch.device("cpu"))
            want = emulate_attention(req, GLM5.sm_scale, fp8_query=False, fp8_weights=False)[None]
            row = Row(profile=prof.name, tokens=n)
            for key, fq, fw in (("q", True, False), ("p", False, True), ("qp", True, True)):
                m = Row(
                    path_metrics(
                        emulate_attention(req, GLM5.sm_scale, fp8_query=fq, fp8_weights=fw)[None],
                        want,
                        needles=prof.needles > 0,
                    )
                )
                row.update({f"{key}_err": m.rel_err, f"{key}_tail": m.tail_mass_kept})
            rows.append(row)
    return rows


def tiny_weights(result: Result) -> dict[str, Any]:
    """The cases whose probed tail token weighs under 2^-24 of its head's largest weight (the median head's), a weight
    no BF16 output can register: how many (``cases``), their Gaussian spreads, the least and largest such weight over
    the largest (``vs_max``), and the paths that return exactly 0 for it on most heads (``zero``) and those that keep
    a nonzero value on every head (``kept``)."""
    cases = {c.case: c for c in rows_of(result, "case") if c.realized_tail_token_vs_max < 2.0**-24}
    rows = [r for r in verdicts(result) if r.case in cases]
    ratios = [c.realized_tail_token_vs_max for c in cases.values()]
    return dict(
        cases=len(cases),
        spreads=sorted({c.spread for c in cases.values()}),
        vs_max=(min(ratios), max(ratios)) if ratios else None,
        zero=[s for s in ran(result) if any(r.strategy == s and r.tail_token_flushed > 0.5 for r in rows)],
        kept=[s for s in ran(result) if all(r.tail_token_flushed == 0 for r in rows if r.strategy == s)],
    )


def sink_cases(result: Result, strategies: Sequence[str]) -> tuple[int, dict[str, dict[str, float]]]:
    """On the cases with sinks: how many, and for each of ``strategies`` that ran there the share of heads on which
    the probed tail token came out exactly 0 (at most, ``zeroed``) and the least and largest tail mass kept
    (``kept_min``, ``kept_max``)."""
    rows = [r for r in verdicts(result) if r.sinks]
    out = {}
    for s in strategies:
        sel = [r for r in rows if r.strategy == s]
        if sel:
            out[s] = dict(
                zeroed=max(r.tail_token_flushed for r in sel),
                kept_min=min(r.tail_mass_kept for r in sel),
                kept_max=max(r.tail_mass_kept for r in sel),
            )
    return len({r.case for r in rows}), out


def ratios_by_profile(result: Result, strategy: str, *, plain: bool = False) -> list[tuple[str, float, float]]:
    """``strategy``'s error over the BF16 reference's, least and largest per profile (flattest first); ``plain``: only
    the profiles without sinks or needles (Gaussian logits)."""
    rows = [
        r
        for r in verdicts(result)
        if r.strategy == strategy and r.ratio is not None and not (plain and (r.sinks or r.needles))
    ]
    return [(p, min(x), max(x)) for p in _profiles(rows) for x in [[r.ratio for r in rows if r.profile == p]]]


def case_spans(result: Result) -> list[dict[str, Any]]:
    """Per profile, what the stored values give (medians over heads; the least and largest over the profile's cases,
    None where it has none): the tail logits' spread, the gap between a head's largest and median logit, the sinks'
    mass, the needles' margin."""
    cases = rows_of(result, "case")

    def span(xs: list[float | None]) -> tuple[float, float] | None:
        xs = [x for x in xs if x is not None]
        return (min(xs), max(xs)) if xs else None

    return [
        dict(
            profile=prof,
            cases=len(sel),
            spread=span([c.realized_spread for c in sel]),
            gap=span([c.realized_max_gap for c in sel]),
            margin=span([c.realized_margin for c in sel]),
            sinks=span([c.realized_sink_mass for c in sel if c.sinks]),
        )
        for prof in _profiles(cases)
        for sel in [[c for c in cases if c.profile == prof]]
    ]


def floor_ratios(result: Result, strategy: str) -> tuple[float, float] | None:
    """``strategy``'s error over the BF16 rounding of the exact output on the same case (1.0: as accurate as any BF16
    output can be), the least and largest over the cases; None where it did not run."""
    r = [v.rel_err / v.floor_rel_err for v in verdicts(result) if v.strategy == strategy and v.floor_rel_err]
    return (min(r), max(r)) if r else None

"""What ``fp8_accuracy`` says, for the chapter "What an FP8 query costs", chapter 6 and the front page.

The verdict of a path on a case (:func:`verdicts`): it **keeps BF16 accuracy** when its output's error against
float64 is at most :data:`RULE` times the BF16 reference path's on the same case (chapter 5's rule; the reference
is the most accurate BF16-query, BF16-math path that ran: FlashMLA dense BF16 or gather_cast + FlashInfer BF16; on
a machine where neither ran, the BF16 rounding of the exact output, ``floor_rel_err``), the tail keeps at least
:data:`TAIL_KEPT` of its mass, and the top token's weight is within :data:`TOP_ERR` of float64's.
"""

from __future__ import annotations

from typing import Any, Sequence

import plotly.graph_objects as go

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.sharp_attention import PROFILES
from kvwall.reports.plots import with_caption
from kvwall.reports.tables import Table
from kvwall.results import Result

__all__ = ["RULE", "TAIL_KEPT", "TOP_ERR", "BF16_REFERENCES", "FIGURE_PATHS", "verdicts", "path_summary",
           "summary_table", "error_figure", "tail_figure", "fp8_verdict", "accuracy_cell", "profile_table",
           "prediction_table", "tiny_weights_note", "mechanism_text", "cases_table", "COLORS", "floor_text"]

#: A path keeps BF16 accuracy on a case when its error is at most RULE x the BF16 reference's ...
RULE = 2.0
#: ... the tail keeps at least this fraction of its attention mass ...
TAIL_KEPT = 0.99
#: ... and the top token's (the needle's) weight is within this relative error.
TOP_ERR = 0.02
#: The BF16 paths a case's reference error is taken from (the smaller of those that ran).
BF16_REFERENCES = ("flashmla_dense_bf16", "gather_cast_bf16")
#: The paths the figures draw (the table has every path that ran).
FIGURE_PATHS = ("ours", "flashmla_dense_fp8", "flashmla_dense_bf16", "flashinfer_fp8_fa3", "gather_cast_bf16",
                "sglang_triton_fp8")
_ORDER = [p.name for p in PROFILES]
#: One color per path in every figure (plotly's default cycle repeats after ten series).
COLORS = {"ours": "#1f77b4", "flashmla_dense_fp8": "#d62728", "flashmla_dense_bf16": "#2ca02c",
          "flashinfer_fp8_fa3": "#9467bd", "gather_cast_bf16": "#ff7f0e", "sglang_triton_fp8": "#17becf"}


def _label(strategy: str) -> str:
    return STRATEGIES[strategy].label if strategy in STRATEGIES else strategy


def _rows(result: Result, section: str) -> list[dict[str, Any]]:
    return [r for r in result.rows if r.get("section") == section]


def verdicts(result: Result) -> list[dict[str, Any]]:
    """Every ``path`` row that ran, with its case's fields, ``ref_err`` (the case's BF16 reference error), ``ratio``
    (its error over it) and ``keeps`` (the verdict of the module docstring)."""
    cases = {r["case"]: r for r in _rows(result, "case")}
    paths = [r for r in _rows(result, "path") if not r.get("error") and r.get("rel_err") is not None]
    ref: dict[str, float] = {}
    for r in paths:
        if r["strategy"] in BF16_REFERENCES:
            ref[r["case"]] = min(ref.get(r["case"], float("inf")), r["rel_err"])
    out = []
    for r in paths:
        case = cases[r["case"]]
        base = ref.get(r["case"], case["floor_rel_err"])
        ratio = r["rel_err"] / base if base else None
        tail = r.get("tail_mass_kept")
        keeps = (ratio is not None and ratio <= RULE and (tail is None or tail >= TAIL_KEPT)
                 and (r.get("top_err") or 0.0) <= TOP_ERR and bool(r.get("finite", True)))
        out.append({**case, **r, "ref_err": base, "ratio": ratio, "keeps": keeps})
    return out


def path_summary(result: Result, strategy: str) -> dict[str, Any] | None:
    """One path over every case it ran: cases, cases it keeps BF16 accuracy on, the worst error ratio, the least
    tail mass kept, the worst top-weight error, and the profiles (names) where it fails somewhere. None: it did not
    run."""
    rows = [r for r in verdicts(result) if r["strategy"] == strategy]
    if not rows:
        return None
    failing = [r for r in rows if not r["keeps"]]
    worst_tail = min(rows, key=lambda r: r.get("tail_mass_kept") if r.get("tail_mass_kept") is not None else 1.0)
    return {"strategy": strategy, "label": _label(strategy), "cases": len(rows), "keeps": len(rows) - len(failing),
            "ratio_max": max(r["ratio"] for r in rows if r["ratio"] is not None),
            "ratio_min": min(r["ratio"] for r in rows if r["ratio"] is not None),
            "ratio_min_profile": min((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"])["profile"],
            "ratio_max_profile": max((r for r in rows if r["ratio"] is not None), key=lambda r: r["ratio"])["profile"],
            "profiles": sorted({r["profile"] for r in rows}, key=_order),
            "rel_err_max": max(r["rel_err"] for r in rows),
            "tail_kept_min": worst_tail.get("tail_mass_kept"), "tail_worst_case": worst_tail["case"],
            "top_err_max": max((r.get("top_err") or 0.0) for r in rows),
            "sink_flushed_max": max([r.get("tail_token_flushed") or 0.0 for r in rows if r.get("sinks")] or [0.0]),
            "failing_profiles": sorted({r["profile"] for r in failing}, key=_order),
            "passing_profiles": sorted({r["profile"] for r in rows} - {r["profile"] for r in failing}, key=_order)}


def _order(profile: str) -> int:
    return _ORDER.index(profile) if profile in _ORDER else len(_ORDER)


def _ran(result: Result) -> list[str]:
    ran = {r["strategy"] for r in _rows(result, "path") if not r.get("error")}
    return [s for s in STRATEGIES if s in ran]


def summary_table(result: Result, provenance: str | None = None) -> Table:
    """One line per path that ran: how many cases it keeps BF16 accuracy on, and the worst of each measure;
    ``provenance``: the caption's last sentence (default: the recording's)."""
    rows = [s for s in (path_summary(result, n) for n in _ran(result)) if s]
    for r in rows:
        r["kept"] = f"{r['keeps']} / {r['cases']}"
    for r in rows:
        r["ratios"] = f"{r['ratio_min']:.1f}–{r['ratio_max']:.1f}×"
    return Table(rows, {"path": "label", "keeps BF16 accuracy": "kept",
                        "error / BF16's (every profile)": "ratios",
                        "least tail mass kept": ("tail_kept_min", lambda v: "—" if v is None else f"{v:.1%}"),
                        "worst needle-weight error": ("top_err_max", lambda v: f"{v:.1%}"),
                        "tail token at 0, with sinks": ("sink_flushed_max", lambda v: f"{v:.0%} of heads")},
                 f"Every case of the sweep (profiles x contexts x heads x batches). 'Keeps BF16 accuracy': error at "
                 f"most {RULE:g}x the BF16 reference path's on the same case, the tail keeps >= {TAIL_KEPT:.0%} of its "
                 f"mass, the needle's weight within {TOP_ERR:.0%}. The error ratio's range spans every profile; the "
                 "FP8-query paths' multiplier per regime is in the table of regimes. "
                 + (provenance or result.caption()))


def _pick(rows: list[dict[str, Any]], **want: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def _figure_point(result: Result) -> tuple[int, int]:
    """The heads and context the profile figure shows: 16 heads (or the fewest) at 128K (or the longest)."""
    cases = [r for r in _rows(result, "case") if r["batch"] == 1]
    heads = min({r["heads"] for r in cases}, key=lambda h: (h != 16, h))
    ctxs = sorted({r["context"] for r in cases if r["heads"] == heads})
    return heads, 131_072 if 131_072 in ctxs else ctxs[-1]


def error_figure(result: Result) -> go.Figure:
    """Error against float64 by profile (flattest to sharpest), one series per path, one request at the
    :func:`_figure_point`; the BF16 rounding of the exact output as a floor."""
    heads, ctx = _figure_point(result)
    rows = _pick(verdicts(result), heads=heads, context=ctx, batch=1)
    cases = _pick(_rows(result, "case"), heads=heads, context=ctx, batch=1)
    profiles = sorted({c["profile"] for c in cases}, key=_order)
    fig = go.Figure()
    for s in [p for p in FIGURE_PATHS if any(r["strategy"] == p for r in rows)]:
        by = {r["profile"]: r["rel_err"] for r in rows if r["strategy"] == s}
        fig.add_scatter(name=_label(s), x=profiles, y=[by.get(p) for p in profiles], mode="lines+markers",
                        line=dict(color=COLORS.get(s)))
    floor = {c["profile"]: c["floor_rel_err"] for c in cases}
    fig.add_scatter(name="BF16 rounding of the exact output", x=profiles, y=[floor.get(p) for p in profiles],
                    mode="lines", line=dict(dash="dot", color="#888"))
    fig.update_layout(title="Output error against float64, flat to sharp attention", yaxis_title="relative error",
                      xaxis_title=f"profile ({heads} heads, one request of {ctx // 1024}K tokens)")
    fig.update_yaxes(type="log", exponentformat="power")
    return with_caption(fig, ["Identical inputs for every path: one FP8 cache, its exact BF16 copy for the BF16 "
                              "paths. " + result.caption()], height=520)


def tail_figure(result: Result, profile: str = "4 sinks hold 99 %") -> go.Figure:
    """The attention mass the tail keeps (kernel over float64, least over heads) against context, one request, for
    ``profile`` (or the sharpest profile recorded), one series per path and head count."""
    cases = _rows(result, "case")
    names = {c["profile"] for c in cases}
    if profile not in names:
        profile = max(names, key=_order)
    rows = [r for r in _pick(verdicts(result), profile=profile, batch=1) if r["strategy"] in FIGURE_PATHS]
    fig = go.Figure()
    heads = sorted({r["heads"] for r in rows})
    for s in [p for p in FIGURE_PATHS if any(r["strategy"] == p for r in rows)]:
        for h in heads:
            sel = sorted(_pick(rows, strategy=s, heads=h), key=lambda r: r["context"])
            if sel:
                fig.add_scatter(name=f"{_label(s)}, {h} heads", x=[r["context"] for r in sel],
                                y=[r["tail_mass_kept"] for r in sel], mode="lines+markers",
                                line=dict(color=COLORS.get(s), dash="solid" if h == min(heads) else "dash"))
    fig.update_layout(title=f"Attention mass the tail keeps, '{profile}'", yaxis_title="kept / float64's (least "
                      "over heads)", xaxis_title="tokens in the request")
    fig.update_xaxes(type="log")
    return with_caption(fig, ["1.0: the tail's weights survive; 0: flushed to zero. Solid: "
                              f"{min(heads, default=0)} heads, dashed: {max(heads, default=0)}. " + result.caption()],
                        height=520)


def profile_table(result: Result, heads: int | None = None, context: int | None = None) -> Table:
    """Per profile, at one request of ``context`` tokens and ``heads`` heads (default: the figure's): each figure
    path's error over the BF16 reference, the tail mass it keeps, the needle weight's error."""
    dh, dc = _figure_point(result)
    heads, context = heads or dh, context or dc
    rows = _pick(verdicts(result), heads=heads, context=context, batch=1)
    paths = [p for p in FIGURE_PATHS if any(r["strategy"] == p for r in rows)]
    out = []
    for prof in sorted({r["profile"] for r in rows}, key=_order):
        line: dict[str, Any] = {"profile": prof}
        for p in paths:
            r = next((x for x in rows if x["profile"] == prof and x["strategy"] == p), None)
            if r is None:
                line[p] = "—"
                continue
            tail = "" if r.get("tail_mass_kept") is None else f", tail {r['tail_mass_kept']:.0%}"
            line[p] = f"{r['ratio']:.1f}×{tail}" + ("" if r["keeps"] else " ✗")
        out.append(line)
    return Table(out, {"profile": "profile", **{_label(p): p for p in paths}},
                 f"{heads} heads, one request of {context // 1024}K tokens: error over the BF16 reference's, and the "
                 f"tail mass kept (least over heads); ✗: does not keep BF16 accuracy (error > {RULE:g}x, tail < "
                 f"{TAIL_KEPT:.0%} or needle off by > {TOP_ERR:.0%}). " + result.caption())


def fp8_verdict(result: Result | None, strategy: str = "flashmla_dense_fp8") -> str:
    """When ``strategy`` keeps BF16 accuracy and when it does not, in one sentence ('' without a result)."""
    s = path_summary(result, strategy) if result is not None else None
    if s is None:
        return ""
    if not s["failing_profiles"]:
        every = (f"every profile from '{s['profiles'][0]}' to '{s['profiles'][-1]}'" if len(s["profiles"]) > 1
                 else f"profile '{s['profiles'][0]}'")
        return (f"{s['label']} keeps BF16 accuracy on all {s['cases']} cases, {every} (worst error "
                f"{s['ratio_max']:.1f}× the BF16 reference's, on '{s['ratio_max_profile']}').")
    tail = (f"; the tail keeps as little as {s['tail_kept_min']:.0%} of its mass ({s['tail_worst_case']})"
            if s["tail_kept_min"] is not None and s["tail_kept_min"] < TAIL_KEPT else "")
    needle = f"; a needle's weight is off by up to {s['top_err_max']:.0%}" if s["top_err_max"] > TOP_ERR else ""
    where = ("on no profile" if not s["passing_profiles"] else
             f"on {', '.join(s['passing_profiles'])}, not on {', '.join(s['failing_profiles'])}")
    return (f"{s['label']} keeps BF16 accuracy on {s['keeps']} of {s['cases']} cases, {where}: its error is "
            f"{s['ratio_min']:.1f}× the BF16 reference's at the least (on '{s['ratio_min_profile']}') and "
            f"{s['ratio_max']:.0f}× at the most (on '{s['ratio_max_profile']}'){needle}{tail}.")


def accuracy_cell(result: Result | None, strategies: Sequence[str]) -> str:
    """The decision table's accuracy cell for a row that runs ``strategies`` (the first that ran in the result):
    'BF16-accurate on N / N cases' or where it is not."""
    if result is None:
        return "not measured"
    for name in strategies:
        s = path_summary(result, name)
        if s is None:
            continue
        if not s["failing_profiles"]:
            return (f"BF16-accurate: {s['keeps']} / {s['cases']} cases (≤ {s['ratio_max']:.1f}× BF16's error, on "
                    f"'{s['ratio_max_profile']}')")
        worst = (f", tail down to {s['tail_kept_min']:.0%}" if s["tail_kept_min"] is not None
                 and s["tail_kept_min"] < TAIL_KEPT else "")
        return (f"{s['keeps']} / {s['cases']} cases BF16-accurate; fails on {len(s['failing_profiles'])} of "
                f"{len(s['failing_profiles']) + len(s['passing_profiles'])} profiles (≤ {s['ratio_max']:.0f}× "
                f"BF16's error, on '{s['ratio_max_profile']}'{worst})")
    return "not measured"


def prediction_table(contexts: Sequence[int] = (4096, 32_768), heads: int = 16, seed: int = 0) -> Table:
    """The arithmetic's prediction, computed here (float64, any machine): per profile and context, what an e4m3
    query, e4m3 softmax weights, and both do to one request (:func:`kvwall.model.sharp_attention.emulate_attention`
    against the exact attention of the same stored values): the output's error and the tail mass kept."""
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
            row: dict[str, Any] = {"profile": prof.name, "tokens": n}
            for key, fq, fw in (("q", True, False), ("p", False, True), ("qp", True, True)):
                m = path_metrics(emulate_attention(req, GLM5.sm_scale, fp8_query=fq, fp8_weights=fw)[None], want,
                                 needles=prof.needles > 0)
                row[f"{key}_err"], row[f"{key}_tail"] = m["rel_err"], m["tail_mass_kept"]
            rows.append(row)

    def cell(err: str, tail: str) -> Any:
        return lambda r: f"{r[err]:.1e}, tail {r[tail]:.0%}"

    return Table([{**r, "q": cell("q_err", "q_tail")(r), "p": cell("p_err", "p_tail")(r),
                   "qp": cell("qp_err", "qp_tail")(r)} for r in rows],
                 {"profile": "profile", "tokens": ("tokens", lambda v: f"{v // 1024}K"), "e4m3 query": "q",
                  "e4m3 weights": "p", "both": "qp"},
                 f"Predicted, not measured: one request, {heads} heads, the arithmetic of each FP8 step alone "
                 "(error against the exact attention of the same stored values; tail: the mass the tail keeps, "
                 "least over heads). Computed live on this machine in float64.")


def tiny_weights_note(result: Result) -> str:
    """Which paths return exactly 0 for a tail token whose weight is below 2^-24 of its head's largest (the median
    head's, in the cases where it is), and which keep a nonzero value: a weight no BF16 output can register."""
    cases = {c["case"]: c for c in _rows(result, "case") if c["realized_tail_token_vs_max"] < 2.0**-24}
    if not cases:
        return ""
    rows = [r for r in verdicts(result) if r["case"] in cases]
    zero = [s for s in _ran(result) if any(r["strategy"] == s and r["tail_token_flushed"] > 0.5 for r in rows)]
    kept = [s for s in _ran(result) if all(r["tail_token_flushed"] == 0 for r in rows if r["strategy"] == s)]
    ratios = [c["realized_tail_token_vs_max"] for c in cases.values()]
    spreads = ", ".join(sorted({f"{c['spread']:g}" for c in cases.values()}))
    return (f"In {len(cases)} cases (Gaussian spread {spreads})"
            f" the probed tail token weighs {min(ratios):.0e}–{max(ratios):.0e} of its head's largest weight. "
            f"{', '.join(_label(s) for s in zero) or 'No path'} return exactly 0 for it on most heads; "
            f"{', '.join(_label(s) for s in kept) or 'none'} a nonzero value. Either way it moves no output bit: "
            "it is not counted against any path.")


def mechanism_text(result: Result, fp8: str = "flashmla_dense_fp8", query_only: str = "sglang_triton_fp8") -> str:
    """What flushed and what did not, on the cases with sinks: the probed tail token's weight (zeroed or not) and the
    tail's mass, for ``fp8`` (FP8 query and weights) beside ``query_only`` (an FP8 query) and ours."""
    rows = [r for r in verdicts(result) if r.get("sinks")]
    parts = []
    for s in (fp8, query_only, "ours"):
        sel = [r for r in rows if r["strategy"] == s]
        if sel:
            parts.append(f"{_label(s)}: tail token zeroed on at most {max(r['tail_token_flushed'] for r in sel):.0%} "
                         f"of heads, tail mass kept {min(r['tail_mass_kept'] for r in sel):.0%}–"
                         f"{max(r['tail_mass_kept'] for r in sel):.0%}")
    plain = [r for r in verdicts(result) if r["strategy"] == fp8 and not r.get("sinks") and not r.get("needles")
             and r["ratio"] is not None]
    by_profile = [(p, [r["ratio"] for r in plain if r["profile"] == p])
                  for p in sorted({r["profile"] for r in plain}, key=_order)]
    spans = [f"{_times_span(min(x), max(x))}" + (" the BF16 reference's" if i == 0 else "") + f" on '{p}'"
             for i, (p, x) in enumerate(by_profile)]
    flat_text = (f" On Gaussian logits without sinks or needles, {_label(fp8)}'s output error is already "
                 + ", ".join(spans) + "." if spans else "")
    return ("On the cases with sinks (" + str(len({r['case'] for r in rows})) + "): " + "; ".join(parts) + "."
            + flat_text if parts else "")


def cases_table(result: Result) -> Table:
    """Per profile, what the stored values give (medians over heads, the range over the profile's cases): the tail
    logits' spread, the gap between a head's largest and median logit, the sinks' mass, the needles' margin."""
    cases = _rows(result, "case")
    out = []

    def span(xs: list[float], fmt: str) -> str:
        return "—" if not xs else (f"{min(xs):{fmt}}" if f"{min(xs):{fmt}}" == f"{max(xs):{fmt}}"
                                   else f"{min(xs):{fmt}}–{max(xs):{fmt}}")

    for prof in sorted({c["profile"] for c in cases}, key=_order):
        sel = [c for c in cases if c["profile"] == prof]
        out.append({"profile": prof, "cases": len(sel),
                    "spread": span([c["realized_spread"] for c in sel], ".2f"),
                    "gap": span([c["realized_max_gap"] for c in sel], ".0f"),
                    "sinks": span([c["realized_sink_mass"] for c in sel if c["sinks"]], ".1%"),
                    "margin": span([c["realized_margin"] for c in sel if c["realized_margin"] is not None], ".2f")})
    return Table(out, {"profile": "profile", "cases": "cases", "tail logits' spread": "spread",
                       "largest − median logit": "gap", "sinks' mass": "sinks", "needles' margin": "margin"},
                 "What the stored FP8 keys and BF16 queries give, in float64 (medians over heads; the range over "
                 "the profile's contexts, head counts and batches). " + result.caption())


def floor_text(result: Result, strategies: Sequence[str] = ("ours", "flashmla_dense_bf16", "flashmla_dense_fp8")) -> str:
    """Each path's error over the BF16 rounding of the exact output on the same case (1.0: as accurate as any BF16
    output can be), the range over the cases."""
    parts = []
    for s in strategies:
        r = [v["rel_err"] / v["floor_rel_err"] for v in verdicts(result) if v["strategy"] == s and v["floor_rel_err"]]
        if r:
            parts.append(f"{_label(s)} {min(r):.2f}–{max(r):.2f}×")
    profiles = sorted({c["profile"] for c in _rows(result, "case")}, key=_order)
    over = (f", each range over every profile from '{profiles[0]}' to '{profiles[-1]}'" if len(profiles) > 1
            else f" on '{profiles[0]}'" if profiles else "")
    return ("Against the exact output rounded to BF16 (the smallest error a BF16 output can have; 1.00× means no "
            "error beyond that rounding): " + ", ".join(parts) + over + ".") if parts else ""


def _times_span(lo: float, hi: float) -> str:
    """``"2.9–12×"``: one decimal under 10, none above; one number where both ends print the same."""
    def f(v: float) -> str:
        return f"{v:.1f}" if v < 10 else f"{v:.0f}"
    return f"{f(lo)}×" if f(lo) == f(hi) else f"{f(lo)}–{f(hi)}×"

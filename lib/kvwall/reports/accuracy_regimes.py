"""The FP8-query error multiplier, one per input regime, for chapters 5, 5b and 6.

An FP8-query path's output error over ours' (or over a BF16 path's) is a property of the path *and* of its inputs: the
query's rounding moves each logit by a fraction of its size, and the relative error divides the result by the output's
norm. So the multiplier is stated per regime (:func:`fp8_query_multipliers`): chapter 5's random Gaussian inputs (its
grid, ``fused_decode_bench``, and its case table, ``fused_decode_validation``) and each of chapter 5b's profiles
(``fp8_accuracy``), each regime named and described, with the range over its cases.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.sharp_attention import PROFILES
from kvwall.reports.accuracy_report import label, order, verdicts
from kvwall.reports.rows import Row, rows_of
from kvwall.results import Result

#: Chapter 5's inputs (``fused_decode_bench``'s grid and ``fused_decode_validation``'s case table): queries and
#: latents drawn independently from Gaussians (:func:`kvwall.kernels.mla_decode.reference.make_mla_inputs`; the
#: bench's ``make_point`` draws the same way), so the logits are narrow and the output is a small average.
RANDOM_INPUTS = "random Gaussian q and latent"
#: The path every multiplier is taken over, and the BF16 path of chapter 5's grid.
OURS_PATH, BENCH_BF16 = "ours", "flashmla_dense_bf16"
#: Words that name a regime: every sentence of chapters 5 and 5b (and of their reports) that cites an FP8-query
#: error multiplier ("N× ours'", "N× the BF16 reference's") holds one of them (tests/test_accuracy_regimes.py).
REGIME_WORDS = ("random Gaussian", "Gaussian logits", "gaussian, spread", "spread", "sinks", "needle")
#: The regimes' output norm is computed live at the sources' one-request contexts up to this many tokens.
SHAPE_MAX_TOKENS = 8192
#: The BF16 reference each source's multiplier is also taken over.
BF16_REFERENCE_OF = dict(
    fused_decode_bench="FlashMLA dense BF16 at the same point",
    fused_decode_validation="the case table's BF16 path (FlashInfer BF16 on the exactly cast cache)",
    fp8_accuracy="the BF16 reference (the better of FlashMLA dense BF16 and gather_cast + FlashInfer BF16)",
)


@dataclass(frozen=True)
class RegimeMultiplier:
    """One FP8-query path's error multiplier on one input regime, from one recorded result: its output's relative
    error against float64 over ours' on the same inputs (``over_ours``, the range over the regime's cases) and over a
    BF16 path's (``over_bf16``, where the result recorded one: ``bf16_reference`` says which); the cases at the ends
    of ``over_ours``; and the regime's inputs, each the least and largest over its cases (None where not known): the
    logits' spread, the output's norm over a value's (median over heads, drawn here at ``norm_points``, (heads,
    tokens) pairs), the largest − median logit (``max_gap``), and the query's and (chapter 5's draw) the latent's
    element RMS."""

    regime: str
    strategy: str
    label: str
    source: str
    cases: int
    over_ours: tuple[float, float]
    over_bf16: tuple[float, float] | None
    bf16_reference: str | None
    lowest_case: str
    highest_case: str
    logit_spread: tuple[float, float] | None = None
    output_norm: tuple[float, float] | None = None
    max_gap: tuple[float, float] | None = None
    query_rms: tuple[float, float] | None = None
    latent_rms: tuple[float, float] | None = None
    norm_points: tuple[tuple[int, int], ...] = ()


def _fp8_query_strategies(result: Result) -> list[str]:
    """The paths whose query is FP8: the recording's own ``precision`` (``setup`` row) where it has one, else the peer
    table's."""
    setup = next(iter(rows_of(result, "setup")), Row())
    recorded = {s: Row(p).query for s, p in (setup.precision or {}).items()}
    return [s for s in STRATEGIES if recorded.get(s, STRATEGIES[s].query) == "fp8"] + sorted(
        s for s, q in recorded.items() if q == "fp8" and s not in STRATEGIES
    )


@functools.lru_cache(maxsize=64)
def _random_inputs_draw(heads: int, tokens: int, seed: int = 0) -> tuple[float, float, float, float, float]:
    """Chapter 5's draw of one request (``make_mla_inputs``), in float64: (query element RMS, latent element RMS,
    logits' spread, largest − median logit, the output's norm over a value's), medians over heads."""
    import torch

    from kvwall.kernels.mla_decode.reference import make_mla_inputs
    from kvwall.model.geometry import GLM5

    inp = make_mla_inputs([tokens], heads, seed=seed, pool_slots=tokens)
    idx = inp.tok_slots[0].long()
    keys = torch.cat([inp.tok_ckv[idx], inp.tok_kpe[idx]], dim=-1).double()
    q = torch.cat([inp.q_nope[0], inp.q_pe[0]], dim=-1).double()
    return (
        float(q.pow(2).mean().sqrt()),
        float(keys.pow(2).mean().sqrt()),
        *_logits_and_output(q, keys, keys[:, : GLM5.kv_lora_rank], GLM5.sm_scale),
    )


@functools.lru_cache(maxsize=64)
def _profile_output_norm(profile: str, heads: int, tokens: int, seed: int = 0) -> float | None:
    """One request of chapter 5b's ``profile`` (:func:`kvwall.model.sharp_attention.sharp_request`): the output's norm
    over a value's (the channels the error is measured on, probes left out), median over heads; None: no such
    profile."""
    import torch

    from kvwall.model.geometry import GLM5
    from kvwall.model.sharp_attention import N_PROBES, sharp_request

    prof = next((p for p in PROFILES if p.name == profile), None)
    if prof is None:
        return None
    req = sharp_request(
        prof, heads, tokens, sm_scale=GLM5.sm_scale, gen=torch.Generator().manual_seed(seed), device=torch.device("cpu")
    )
    q = torch.cat([req.q_nope, req.q_pe], dim=-1).double()
    keys = req.keys.double()
    return _logits_and_output(q, keys, keys[:, N_PROBES : GLM5.kv_lora_rank], GLM5.sm_scale)[2]


def _logits_and_output(q: Any, keys: Any, values: Any, sm_scale: float) -> tuple[float, float, float]:
    """(the logits' spread, largest − median logit, ‖output‖ / RMS ‖value‖), medians over heads, float64."""
    z = (q @ keys.T) * sm_scale
    out = z.softmax(dim=-1) @ values
    value_norm = values.pow(2).sum(dim=-1).mean().sqrt()
    return (
        float(z.std(dim=-1).median()),
        float((z.amax(dim=-1) - z.median(dim=-1).values).median()),
        float((out.norm(dim=-1) / value_norm).median()),
    )


def _one_request_points(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """The (heads, tokens) of the one-request cases of ``rows`` short enough to draw here (:data:`SHAPE_MAX_TOKENS`)."""
    return sorted(
        {
            (r.heads, r.tokens)
            for r in map(Row, rows)
            if r.tokens and 2 <= r.tokens <= SHAPE_MAX_TOKENS and (r.batch or 1) == 1
        }
    )


@dataclass(frozen=True)
class _Shape:
    """A regime's inputs (:class:`RegimeMultiplier`'s last fields)."""

    logit_spread: tuple[float, float] | None = None
    output_norm: tuple[float, float] | None = None
    max_gap: tuple[float, float] | None = None
    query_rms: tuple[float, float] | None = None
    latent_rms: tuple[float, float] | None = None
    norm_points: tuple[tuple[int, int], ...] = ()


def _lo_hi(xs: Sequence[float]) -> tuple[float, float] | None:
    return (min(xs), max(xs)) if xs else None


def _random_inputs_shape(points: list[tuple[int, int]]) -> _Shape:
    """Chapter 5's inputs, drawn here at ``points`` (none: nothing known)."""
    shapes = [_random_inputs_draw(h, n) for h, n in points]
    q_rms, latent_rms, spread, gap, norm = (_lo_hi([s[i] for s in shapes]) for i in range(5))
    return _Shape(spread, norm, gap, q_rms, latent_rms, tuple(points))


def _profile_shape(profile: str, cases: list[dict[str, Any]], computed: bool = True) -> _Shape:
    """One of chapter 5b's profiles: its recorded cases' realized values, and its output norm drawn here."""
    points = _one_request_points(cases) if computed else []
    norms = [v for v in (_profile_output_norm(profile, h, n) for h, n in points) if v is not None]
    spread, gap, query = (
        [v for v in values if v is not None]
        for values in zip(*((c.realized_spread, c.realized_max_gap, c.realized_query_rms) for c in map(Row, cases)))
    )
    return _Shape(_lo_hi(spread), _lo_hi(norms), _lo_hi(gap), _lo_hi(query), None, tuple(points) if norms else ())


def _case_label(heads: int, tokens: int, batch: int) -> str:
    """``"128 heads, 256K tokens"``, ``"16 heads, 7 tokens"``, ``"16 heads, batch of 8 at 32K context"``."""
    n = f"{tokens // 1024}K" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"
    return f"{heads} heads, " + (f"{n} tokens" if batch == 1 else f"batch of {batch} at {n} context")


def _multiplier(
    regime: str, shape: _Shape, strategy: str, source: str, triples: list[tuple[str, float, float, float | None]]
) -> RegimeMultiplier | None:
    """From (case, FP8-query error, ours' error, BF16 reference's error) per case (errors > 0 only)."""
    usable = [(c, e / o, e / b if b else None) for c, e, o, b in triples if e and o]
    if not usable:
        return None
    lo, hi = min(usable, key=lambda t: t[1]), max(usable, key=lambda t: t[1])
    bf16 = _lo_hi([r for _, _, r in usable if r is not None])
    return RegimeMultiplier(
        regime,
        strategy,
        label(strategy),
        source,
        len(usable),
        (lo[1], hi[1]),
        bf16,
        BF16_REFERENCE_OF.get(source) if bf16 else None,
        lo[0],
        hi[0],
        **shape.__dict__,
    )


def _from_bench(bench: Result, computed: bool = True) -> list[RegimeMultiplier]:
    """Chapter 5's grid: every point (not the fixed-cost probes) where the FP8-query path and ours both ran."""
    floors = set(Row(bench.params).floor_contexts or [])
    rows = [r for r in rows_of(bench, "bench") if r.context not in floors and r.rel_err_f64 is not None]
    by = {(r.strategy, r.heads, r.context, r.batch): r.rel_err_f64 for r in rows}
    cases = [Row(r, tokens=r.context) for r in rows if r.strategy == OURS_PATH]
    shape = _random_inputs_shape(_one_request_points(cases) if computed else [])
    out = []
    for s in _fp8_query_strategies(bench):
        triples = [
            (_case_label(h, n, b), by[(s, h, n, b)], by[(OURS_PATH, h, n, b)], by.get((BENCH_BF16, h, n, b)))
            for (st, h, n, b) in by
            if st == OURS_PATH and (s, h, n, b) in by
        ]
        m = _multiplier(RANDOM_INPUTS, shape, s, bench.experiment, triples)
        if m:
            out.append(m)
    return out


def _from_validation(validation: Result, computed: bool = True) -> list[RegimeMultiplier]:
    """Chapter 5's case table: every case where the FP8-query peer, ours and the BF16 path have a nonzero error (a
    one-token request is exact on every path)."""
    cases = {r.case: r for r in rows_of(validation, "cases") if r.path == OURS_PATH}
    peers = [r for r in rows_of(validation, "fp8_peers") if r.rel_err is not None and r.case in cases]
    points = _one_request_points(
        [Row(heads=c.heads, tokens=sum(c.lens), batch=len(c.lens)) for c in cases.values() if c.rel_err]
    )
    shape = _random_inputs_shape(points if computed else [])
    out = []
    for s in [s for s in STRATEGIES if STRATEGIES[s].query == "fp8" and any(r.peer == s for r in peers)]:
        triples = [
            (
                _case_label(r.heads, sum(r.lens), len(r.lens)),
                r.rel_err,
                cases[r.case].rel_err,
                cases[r.case].bf16_rel_err,
            )
            for r in peers
            if r.peer == s
        ]
        m = _multiplier(RANDOM_INPUTS, shape, s, validation.experiment, triples)
        if m:
            out.append(m)
    return out


def _from_accuracy(accuracy: Result, computed: bool = True) -> list[RegimeMultiplier]:
    """Chapter 5b: one regime per profile, every case where the FP8-query path and ours ran."""
    rows, cases = verdicts(accuracy), rows_of(accuracy, "case")
    ours = {r.case: r.rel_err for r in rows if r.strategy == OURS_PATH}
    out = []
    for prof in sorted({c.profile for c in cases}, key=order):
        shape = _profile_shape(prof, [c for c in cases if c.profile == prof], computed)
        for s in _fp8_query_strategies(accuracy):
            triples = [
                (_case_label(r.heads, r.context, r.batch), r.rel_err, ours.get(r.case), r.ref_err)
                for r in rows
                if r.strategy == s and r.profile == prof
            ]
            m = _multiplier(prof, shape, s, accuracy.experiment, triples)
            if m:
                out.append(m)
    return out


def fp8_query_multipliers(
    accuracy: Result | None, bench: Result | None, validation: Result | None = None, *, computed: bool = True
) -> list[RegimeMultiplier]:
    """The FP8-query error multiplier per input regime: one row per regime x FP8-query path x source: chapter 5's
    random Gaussian inputs from its grid (``bench``, a ``fused_decode_bench`` run) and its case table
    (``validation``), then each of chapter 5b's profiles (``accuracy``, an ``fp8_accuracy`` run). Multipliers over
    ours' error on the same inputs, and over the source's BF16 reference (:data:`BF16_REFERENCE_OF`). A source that
    is None adds no rows. ``computed``: also draw each regime's inputs here (float64 on the CPU, a few seconds; chapter
    5b's profiles at up to :data:`SHAPE_MAX_TOKENS` tokens) for the logits' spread of chapter 5's inputs and every
    regime's output norm; False: only what the recordings say."""
    out: list[RegimeMultiplier] = []
    if bench is not None:
        out += _from_bench(bench, computed)
    if validation is not None:
        out += _from_validation(validation, computed)
    if accuracy is not None:
        out += _from_accuracy(accuracy, computed)
    return out

"""The FP8-query error multiplier, one per input regime (issue: "the accuracy headline is input-dependent"): the
function on the recorded results against a hand recomputation from their rows, on a synthetic result with known
errors, and the chapters' convention that every sentence citing a multiplier names its regime."""

from __future__ import annotations

import re

import pytest

import kvwall.experiments  # noqa: F401  (registers every experiment's row schema before loading)
from conftest import BOOK
from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.model.sharp_attention import PROFILES
from kvwall.reports import fused_bench_report
from kvwall.reports.accuracy_regimes import BF16_REFERENCE_OF, RANDOM_INPUTS, REGIME_WORDS, fp8_query_multipliers
from kvwall.results import Provenance, Result, load_result

FP8_QUERY = {s for s, spec in STRATEGIES.items() if spec.query == "fp8"}
CHAPTERS = ("05_fused_fp8_decode.md", "05b_fp8_accuracy.md")
#: Two of chapter 5b's input profiles, by what they are: Gaussian logits of spread 1; 4 sinks holding 99 % of the mass.
SPREAD_1 = next(p.name for p in PROFILES if (p.spread, p.sinks) == (1.0, 0))
SINKS_99 = next(p.name for p in PROFILES if p.sink_mass == 0.99 and not p.needles)


@pytest.fixture(scope="module")
def recorded() -> dict[str, Result]:
    return {n: load_result(n) for n in ("fp8_accuracy", "fused_decode_bench", "fused_decode_validation")}


@pytest.fixture(scope="module")
def regimes(recorded) -> list:
    return fp8_query_multipliers(
        recorded["fp8_accuracy"], recorded["fused_decode_bench"], recorded["fused_decode_validation"], computed=False
    )


# ---------------------------------------------------------------------------------------------------------
# On the recorded results
# ---------------------------------------------------------------------------------------------------------


def test_one_row_per_recorded_regime_path_and_source(recorded, regimes):
    keys = [(m.regime, m.strategy, m.source) for m in regimes]
    assert len(keys) == len(set(keys))
    acc = recorded["fp8_accuracy"]
    profiles = {r["profile"] for r in acc.rows if r.get("section") == "case"}
    acc_fp8 = {r["strategy"] for r in acc.rows if r.get("section") == "path" and r["strategy"] in FP8_QUERY}
    bench_fp8 = {
        r["strategy"]
        for r in recorded["fused_decode_bench"].rows  # a peer that did not run has no row
        if r.get("section") == "bench" and r["strategy"] in FP8_QUERY and not r.get("error")
    }
    val_fp8 = {
        r["peer"]
        for r in recorded["fused_decode_validation"].rows
        if r.get("section") == "fp8_peers" and r["peer"] in FP8_QUERY
    }
    want = (
        {(p, s, "fp8_accuracy") for p in profiles for s in acc_fp8}
        | {(RANDOM_INPUTS, s, "fused_decode_bench") for s in bench_fp8}
        | {(RANDOM_INPUTS, s, "fused_decode_validation") for s in val_fp8}
    )
    assert set(keys) == want
    assert {m.regime for m in regimes} == profiles | {RANDOM_INPUTS}
    assert {"flashmla_dense_fp8", "sglang_triton_fp8"} <= {m.strategy for m in regimes}
    for m in regimes:
        assert m.regime and m.label == STRATEGIES[m.strategy].label and m.cases > 0 and m.bf16_reference
        assert 0 < m.over_ours[0] <= m.over_ours[1] and m.over_bf16[0] <= m.over_bf16[1]


def test_the_ranges_match_a_hand_recomputation(recorded, regimes):
    by = {(m.regime, m.strategy, m.source): m for m in regimes}

    def check(key, over_ours, over_bf16):
        m = by[key]
        assert m.cases == len(over_ours)
        assert m.over_ours == pytest.approx((min(over_ours), max(over_ours)))
        assert m.over_bf16 == pytest.approx((min(over_bf16), max(over_bf16)))

    # chapter 5b: per profile, the FP8-query path's error over ours' and over the better BF16 path's, per case
    acc = recorded["fp8_accuracy"]
    err = {
        (r["case"], r["strategy"]): r["rel_err"]
        for r in acc.rows
        if r.get("section") == "path" and r.get("rel_err") is not None and not r.get("error")
    }
    for case_profile in {r["profile"] for r in acc.rows if r.get("section") == "case"}:
        cases = [r["case"] for r in acc.rows if r.get("section") == "case" and r["profile"] == case_profile]
        for s in ("flashmla_dense_fp8", "sglang_triton_fp8"):
            sel = [c for c in cases if (c, s) in err]
            bf16 = [min(err[(c, b)] for b in ("flashmla_dense_bf16", "gather_cast_bf16") if (c, b) in err) for c in sel]
            check(
                (case_profile, s, "fp8_accuracy"),
                [err[(c, s)] / err[(c, "ours")] for c in sel],
                [err[(c, s)] / b for c, b in zip(sel, bf16)],
            )

    # chapter 5's grid: every point but the fixed-cost probes, over ours' and FlashMLA BF16's at the same point
    bench = recorded["fused_decode_bench"]
    floors = set(bench.params["floor_contexts"])
    e = {
        (r["strategy"], r["heads"], r["context"], r["batch"]): r["rel_err_f64"]
        for r in bench.rows
        if r.get("section") == "bench" and r["context"] not in floors and not r.get("error")
    }
    for s in ("flashmla_dense_fp8", "sglang_triton_fp8"):
        pts = [p[1:] for p in e if p[0] == s]
        if not pts:  # a peer that did not run in this recording (its rows say why)
            assert (RANDOM_INPUTS, s, "fused_decode_bench") not in by
            continue
        check(
            (RANDOM_INPUTS, s, "fused_decode_bench"),
            [e[(s, *p)] / e[("ours", *p)] for p in pts],
            [e[(s, *p)] / e[("flashmla_dense_bf16", *p)] for p in pts],
        )
    # the lead quotes the same range
    lead = fused_bench_report.lead(fused_bench_report.Grid(bench), "")
    m = by[(RANDOM_INPUTS, "flashmla_dense_fp8", "fused_decode_bench")]
    assert lead.values["fm_fp8_err_over_ours_min"] == pytest.approx(m.over_ours[0])
    assert lead.values["fm_fp8_err_over_ours_max"] == pytest.approx(m.over_ours[1])

    # chapter 5's case table: the cases where every path has an error (a one-token request is exact)
    val = recorded["fused_decode_validation"]
    ours = {r["case"]: r for r in val.rows if r.get("section") == "cases" and r["path"] == "ours"}
    peer = [
        r
        for r in val.rows
        if r.get("section") == "fp8_peers"
        and r["peer"] == "flashmla_dense_fp8"
        and r["rel_err"]
        and ours[r["case"]]["rel_err"]
    ]
    check(
        (RANDOM_INPUTS, "flashmla_dense_fp8", "fused_decode_validation"),
        [r["rel_err"] / ours[r["case"]]["rel_err"] for r in peer],
        [r["rel_err"] / ours[r["case"]]["bf16_rel_err"] for r in peer],
    )


def test_the_regimes_differ_as_the_chapters_say(recorded):
    """5b's prose: chapter 5's logits are narrow and its output small next to a value, smaller than on any of 5b's
    profiles; and the multiplier on 5b's spread-1 profile is not chapter 5's."""
    rows = fp8_query_multipliers(recorded["fp8_accuracy"], recorded["fused_decode_bench"])
    fm = {m.regime: m for m in rows if m.strategy == "flashmla_dense_fp8"}
    ch5 = fm[RANDOM_INPUTS]
    assert ch5.logit_spread[1] < 1.0
    assert all(ch5.output_norm[1] < m.output_norm[0] for r, m in fm.items() if r != RANDOM_INPUTS)
    assert fm[SPREAD_1].over_ours[0] < ch5.over_ours[0]
    assert ch5.max_gap[1] < 2.0 and ch5.query_rms == pytest.approx((0.5, 0.5), abs=0.01)  # near-uniform attention
    assert ch5.latent_rms == pytest.approx((0.7, 0.7), abs=0.01) and ch5.norm_points
    assert all(m.logit_spread[0] > ch5.logit_spread[1] for r, m in fm.items() if r != RANDOM_INPUTS)


# ---------------------------------------------------------------------------------------------------------
# A synthetic result with known errors
# ---------------------------------------------------------------------------------------------------------


def _prov() -> Provenance:
    return Provenance(
        date="2026-12-01T00:00:00+00:00",
        device="cuda",
        gpu="NVIDIA H200",
        driver=None,
        cuda="13.0",
        torch="2.11.0",
        triton="3.6.0",
        flashinfer=None,
        python="3.12",
        git_commit="0" * 40,
        git_dirty=False,
        sources={},
    )


def _synthetic_accuracy() -> Result:
    """Two profiles, two cases each: ours 1e-3, the BF16 paths 2e-3 and 4e-3 (the better one counts), FlashMLA FP8
    3e-3 and 6e-3 on the Gaussian cases, 1e-2 and 2e-2 on the sink cases."""
    rows: list[dict] = []
    fm = {SPREAD_1: (3e-3, 6e-3), SINKS_99: (1e-2, 2e-2)}
    for prof, errs in fm.items():
        for ctx, e in zip((4096, 32768), errs):
            case = f"{prof} | 16 heads | batch 1 | {ctx}"
            rows.append(
                {
                    "section": "case",
                    "case": case,
                    "profile": prof,
                    "heads": 16,
                    "context": ctx,
                    "batch": 1,
                    "tokens": ctx,
                    "floor_rel_err": 1e-3,
                    "sinks": 4 if prof == SINKS_99 else 0,
                }
            )
            for s, err in (
                ("ours", 1e-3),
                ("flashmla_dense_bf16", 2e-3),
                ("gather_cast_bf16", 4e-3),
                ("flashmla_dense_fp8", e),
            ):
                rows.append(
                    {
                        "section": "path",
                        "case": case,
                        "strategy": s,
                        "heads": 16,
                        "context": ctx,
                        "batch": 1,
                        "rel_err": err,
                        "tail_mass_kept": 1.0,
                        "finite": True,
                    }
                )
    return Result("fp8_accuracy", {}, rows, _prov())


def _synthetic_bench() -> Result:
    """Two grid points and a fixed-cost probe: ours 2e-3, FlashMLA BF16 4e-3, FlashMLA FP8 3e-2 and 4e-2, SGLang
    2e-2; at the 64-token probe FlashMLA FP8 is 1.0 (it must not count)."""
    rows = []
    for ctx, fm in ((64, 1.0), (4096, 3e-2), (32768, 4e-2)):
        for s, err in (
            ("ours", 2e-3),
            ("flashmla_dense_bf16", 4e-3),
            ("flashmla_dense_fp8", fm),
            ("sglang_triton_fp8", 2e-2),
        ):
            rows.append(
                {
                    "section": "bench",
                    "strategy": s,
                    "heads": 16,
                    "context": ctx,
                    "batch": 1,
                    "page_size": STRATEGIES[s].page_size,
                    "rel_err_f64": err,
                    "us": 10.0,
                }
            )
    return Result("fused_decode_bench", {"floor_contexts": [64]}, rows, _prov())


def test_a_synthetic_result_gives_known_multipliers():
    rows = fp8_query_multipliers(_synthetic_accuracy(), _synthetic_bench(), computed=False)
    by = {(m.regime, m.strategy): m for m in rows}
    assert set(by) == {
        (RANDOM_INPUTS, "flashmla_dense_fp8"),
        (RANDOM_INPUTS, "sglang_triton_fp8"),
        (SPREAD_1, "flashmla_dense_fp8"),
        (SINKS_99, "flashmla_dense_fp8"),
    }
    g = by[(SPREAD_1, "flashmla_dense_fp8")]
    assert g.cases == 2 and g.over_ours == pytest.approx((3.0, 6.0)) and g.over_bf16 == pytest.approx((1.5, 3.0))
    # the cases at the ends: 16 heads, 4K and 32K tokens
    assert [c.split(", ") for c in (g.lowest_case, g.highest_case)] == [
        ["16 heads", "4K tokens"],
        ["16 heads", "32K tokens"],
    ]
    s = by[(SINKS_99, "flashmla_dense_fp8")]
    assert s.over_ours == pytest.approx((10.0, 20.0)) and s.over_bf16 == pytest.approx((5.0, 10.0))
    assert s.source == "fp8_accuracy" and s.output_norm is None and s.norm_points == ()  # computed=False: not drawn
    b = by[(RANDOM_INPUTS, "flashmla_dense_fp8")]
    assert b.cases == 2 and b.over_ours == pytest.approx((15.0, 20.0)) and b.over_bf16 == pytest.approx((7.5, 10.0))
    assert b.bf16_reference == BF16_REFERENCE_OF["fused_decode_bench"]  # FlashMLA BF16 at the same point
    assert by[(RANDOM_INPUTS, "sglang_triton_fp8")].over_ours == pytest.approx((10.0, 10.0))
    assert fp8_query_multipliers(None, None) == []
    assert list(dict.fromkeys(m.regime for m in rows)) == [RANDOM_INPUTS, SPREAD_1, SINKS_99]
    fm = [m for m in rows if m.strategy == "flashmla_dense_fp8"]  # what chapter 5b's sentence quotes: least, most
    assert min(fm, key=lambda m: m.over_ours[0]) is g and max(fm, key=lambda m: m.over_ours[1]) is b


# ---------------------------------------------------------------------------------------------------------
# The convention: a sentence that cites an FP8-query error multiplier names its regime
# ---------------------------------------------------------------------------------------------------------

#: "17× ours", "**16–17×** ours' error", "2.9× the BF16 reference's", "48× BF16's error", "16× our error".
CITES = re.compile(r"\d[\d.,]*(?:\s*[–-]\s*\d[\d.,]*)?\s*×\**\s*(?:ours|our error|the BF16|BF16's)")


def _sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=[.;:!?])\s+(?=[A-Z*(])", re.sub(r"\s+", " ", text)) if s]


def unnamed_citations(text: str) -> list[str]:
    """The sentences of ``text`` that cite an error multiplier without a word of :data:`REGIME_WORDS`."""
    return [s for s in _sentences(text) if CITES.search(s) and not any(w.lower() in s.lower() for w in REGIME_WORDS)]


#: A glue role, {glue:text}`key:format` (its value is in the executed notebook, not in the Markdown).
GLUE = re.compile(r"\{glue(?::\w*)?\}`([^`:]+)(?::([^`]*))?`")


def _prose(md: str, glued: dict[str, str] | None = None) -> str:
    """A chapter's Markdown without its code cells, each glue role replaced by its value in ``glued`` (``key:
    text/plain``, from the executed notebook) formatted as the role says, or by ``[glued]`` without it."""
    from myst_nb.core.variables import format_plain_text

    def value(m: re.Match) -> str:
        return "[glued]" if glued is None else format_plain_text(glued[m.group(1)], m.group(2) or "")

    return GLUE.sub(value, re.sub(r"```.*?```", "", md, flags=re.S))


def _glued(notebook) -> dict[str, str]:
    """Every glued value of an executed notebook, as its text/plain."""
    import nbformat

    out = {}
    for cell in nbformat.read(notebook, as_version=4).cells:
        for o in cell.get("outputs", []):
            name = o.get("metadata", {}).get("scrapbook", {}).get("name")
            data = o.get("data", {}).get("application/papermill.record/text/plain")
            if name and data is not None:
                out[name] = data
    return out


def test_the_checker_catches_an_unnamed_multiplier():
    unnamed = (
        "FlashMLA FP8's error is 17× ours' error.",
        "Its error is **16–17×** ours at every point.",
        "It is 2.9–48× the BF16 reference's.",
    )
    named = (
        f"On {RANDOM_INPUTS} its error is 17× ours' error.",
        f"On '{SPREAD_1}' it is 2.9× the BF16 reference's.",
        "Ours moves 2.0× the bytes.",  # no error multiplier
    )
    assert unnamed_citations(f"{unnamed[0]} {named[2]}") == [unnamed[0]]  # the sentence, not its neighbour
    assert [bool(unnamed_citations(s)) for s in unnamed + named] == [True] * 3 + [False] * 3


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_chapter_prose_names_the_regime_of_every_multiplier(chapter):
    assert unnamed_citations(_prose((BOOK / chapter).read_text())) == []


@pytest.mark.slow
def test_chapter_5b_as_rendered_names_the_regime_of_every_multiplier(executed):
    """Chapter 5b's sentences glue their multipliers and regimes from its run: check them with the values in."""
    chapter = BOOK / "05b_fp8_accuracy.md"
    text = _prose(chapter.read_text(), _glued(executed.notebook(chapter)))
    assert "[glued]" not in text and CITES.search(text)  # the multipliers are there, each with its regime
    assert unnamed_citations(text) == []


@pytest.mark.slow
def test_chapter_5_as_rendered_names_the_regime_of_every_multiplier(executed):
    """Chapter 5's lead glues FlashMLA FP8's multiplier over ours and the grid's regime from its run: the sentence, with
    the values in, names the regime."""
    chapter = BOOK / "05_fused_fp8_decode.md"
    text = _prose(chapter.read_text(), _glued(executed.notebook(chapter)))
    assert "[glued]" not in text and CITES.search(text)
    assert unnamed_citations(text) == []


def test_the_reports_name_the_regime_of_every_multiplier(recorded, regimes):
    grid = fused_bench_report.Grid(recorded["fused_decode_bench"])
    texts = [*fused_bench_report.what_to_run(grid, grid.caption).columns]  # chapter 5b's sentences: in its .md
    assert all(texts)
    for text in texts:
        assert unnamed_citations(text) == [], text
    # no profile of 5b is named after chapter 5's inputs (their multipliers differ: test_the_regimes_differ_...)
    assert not [p for p in PROFILES if "chapter 5" in p.name]

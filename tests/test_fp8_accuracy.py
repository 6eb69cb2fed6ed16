"""The accuracy experiment (issue 21): inputs that realize their profile, probes that read weights exactly, metrics
that catch a flushed tail, the experiment on CPU, the report, the chapter."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import BOOK
from kvwall.experiments import EXPERIMENTS
from kvwall.experiments.accuracy import build_case, path_metrics, unmet_needs
from kvwall.experiments.fused_decode.strategies import reference_f64
from kvwall.kernels.mla_decode.reference import mla_decode_reference
from kvwall.model.geometry import GLM5
from kvwall.model.sharp_attention import PROBES, PROFILES, Profile, emulate_attention, realized, sharp_request
from kvwall.reports import accuracy_report
from kvwall.results import Provenance, Result, load_result

CPU = torch.device("cpu")
SM = GLM5.sm_scale
BY_NAME = {p.name: p for p in PROFILES}
#: Two of the profiles, by what they are: Gaussian logits of spread 1; 4 sinks holding 99 % of the mass.
SPREAD_1 = next(p.name for p in PROFILES if (p.spread, p.sinks) == (1.0, 0))
SINKS_99 = next(p.name for p in PROFILES if p.sink_mass == 0.99 and not p.needles)


def _req(profile: Profile, heads: int = 16, n: int = 2048, seed: int = 0):
    return sharp_request(profile, heads, n, sm_scale=SM, gen=torch.Generator().manual_seed(seed), device=CPU)


@pytest.mark.parametrize("profile", PROFILES, ids=[p.name for p in PROFILES])
def test_stored_values_give_the_profile(profile):
    """The FP8 keys and BF16 queries realize the asked-for logits: spread, sink mass, needle margin."""
    req = _req(profile)
    got = realized(req, SM)
    assert req.saturated == 0 and math.isclose(got.spread, profile.spread, rel_tol=0.05)
    if profile.sinks:
        assert abs(got.sink_mass - profile.sink_mass) < 0.01
    if profile.needles:
        assert abs(got.margin - profile.margin) < 0.25
    assert got.max_gap > 0 and 0.2 < float(req.keys[:, 4:].float().pow(2).mean().sqrt()) < 3.0  # latent-like keys


def test_probe_channels_are_softmax_weights():
    """The query is zero on the probe channels and the keys 0/1, so those outputs are sums of weights, exactly."""
    req = _req(BY_NAME["needle +4, sinks 90 %"], heads=3, n=500)
    assert torch.all(req.q_nope[:, :4] == 0)
    q = torch.cat([req.q_nope, req.q_pe], -1).double()
    p = torch.softmax(q @ req.keys.double().T * SM, dim=-1)
    kv = req.keys
    indptr = torch.tensor([0, 500])
    out = mla_decode_reference(
        req.q_nope[None],
        req.q_pe[None],
        kv[:, :512],
        kv[:, 512:],
        indptr,
        torch.arange(500),
        SM,
        compute_dtype=torch.float64,
    )[0]
    assert torch.allclose(out[:, PROBES["top"]], p[:, int(req.needles[0])], rtol=1e-12)
    assert torch.allclose(out[:, PROBES["tail_mass"]], p[:, req.tail].sum(-1), rtol=1e-12)
    assert torch.allclose(out[:, PROBES["sink_mass"]], p[:, req.sinks].sum(-1), rtol=1e-12)


def test_metrics_catch_a_flushed_tail_and_a_moved_needle():
    req = _req(BY_NAME["needle +4, sinks 90 %"], n=1000)
    want = emulate_attention(req, SM, fp8_query=False, fp8_weights=False)[None]
    exact = path_metrics(want.clone(), want, needles=True)
    assert exact["rel_err"] == 0 and exact["tail_mass_kept"] == 1 and exact["tail_token_flushed"] == 0
    bad = want.clone()
    bad[..., PROBES["tail_mass"]] *= 0.5
    bad[..., PROBES["tail_token"]] = 0
    bad[..., PROBES["top"]] *= 1.1
    m = path_metrics(bad, want, needles=True)
    assert m["tail_mass_kept"] == pytest.approx(0.5) and m["tail_token_flushed"] == 1.0
    assert m["top_err"] == pytest.approx(0.1) and m["rel_err"] == 0  # the probes are not in the output's error
    assert path_metrics(bad, want, needles=False)["top_err"] is None


def test_the_prediction_fp8_weights_flush_the_tail_under_sinks():
    """The arithmetic the chapter predicts with: e4m3 weights zero a tail that sinks dwarf; BF16 weights do not."""
    req = _req(BY_NAME["4 sinks hold 90 %"], n=4096)
    want = emulate_attention(req, SM, fp8_query=False, fp8_weights=False)[None]
    fp8 = path_metrics(emulate_attention(req, SM, fp8_query=False, fp8_weights=True)[None], want, needles=False)
    assert fp8["tail_mass_kept"] < 0.2 and fp8["tail_token_flushed"] == 1.0 and fp8["rel_err"] < 0.05
    flat = _req(BY_NAME["gaussian, spread 1"], n=4096)
    want = emulate_attention(flat, SM, fp8_query=False, fp8_weights=False)[None]
    fp8 = path_metrics(emulate_attention(flat, SM, fp8_query=False, fp8_weights=True)[None], want, needles=False)
    assert fp8["tail_mass_kept"] > 0.99


def test_bad_profiles_and_requests_are_refused():
    with pytest.raises(ValueError, match="sink_mass strictly between 0 and 1"):
        Profile("x", 1.0, sinks=2, sink_mass=1.0)
    with pytest.raises(ValueError, match="a margin needs needles"):
        Profile("x", 1.0, margin=2.0)
    with pytest.raises(ValueError, match="cannot hold"):
        _req(BY_NAME["8 needles +2, sinks 90 %"], n=10)


def test_every_path_reads_the_same_values():
    """The page-size-1 slots are the paged layout's: the float64 reference is the same through both."""
    pt, pool, _ = build_case(BY_NAME["4 sinks hold 90 %"], 16, [100, 300], context=300, seed=3, device=CPU)
    assert torch.equal(reference_f64(pt, pool, paged=False), reference_f64(pt, pool, paged=True))
    assert "CUDA" in (unmet_needs("flashmla_dense_fp8", CPU) or "") and unmet_needs("ours", CPU) is None


@pytest.fixture(scope="module")
def small_run(executed) -> Result:
    """``run_experiment("fp8_accuracy", CPU, "small")``: the run chapter 5b makes live on a CPU (the session's run of
    the chapter), read from the result file it saved instead of running it a second time."""
    result = executed.live(BOOK / "05b_fp8_accuracy.md", "fp8_accuracy")
    small = EXPERIMENTS["fp8_accuracy"].small
    assert result.provenance.scale == "small" and {k: result.params[k] for k in small} == small, result.params
    return result


def test_experiment_runs_small_on_cpu(small_run):
    cases, paths = small_run.table("case"), small_run.table("path")
    assert len(cases) == 2 * len(PROFILES) and len(paths) == len(cases)
    assert all(p["strategy"] == "ours" and not p.get("error") for p in paths)
    s = accuracy_report.path_summary(small_run, "ours")
    assert s["keeps"] == s["cases"] and s["ratio_max"] < accuracy_report.RULE  # vs the BF16 rounding floor
    assert s["failing_profiles"] == [] and s["passing_profiles"] == [p.name for p in PROFILES]
    spans = accuracy_report.case_spans(small_run)
    assert [r["profile"] for r in spans] == [p.name for p in PROFILES] and all(r["cases"] == 2 for r in spans)
    assert 0.8 <= spans[3]["sinks"][0] <= spans[3]["sinks"][1] < 1.0  # 4 sinks hold 90 %
    assert spans[0]["sinks"] is None and spans[0]["margin"] is None  # Gaussian logits: no sinks, no needles
    lo, hi = accuracy_report.floor_ratios(small_run, "ours")
    assert 0.99 <= lo <= hi < accuracy_report.RULE  # at the BF16 rounding floor


def _synthetic() -> Result:
    """Two paths on two cases: one BF16-accurate, one that flushes the tail on the sink case."""
    prov = Provenance(
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
    rows: list[dict] = []
    for prof in (SPREAD_1, SINKS_99):
        case = f"{prof} | 16 heads | batch 1 | 131072"
        rows.append(
            {
                "section": "case",
                "case": case,
                "profile": prof,
                "heads": 16,
                "context": 131_072,
                "batch": 1,
                "floor_rel_err": 1.1e-3,
            }
        )
        sink = prof == SINKS_99
        rows.append(
            {
                "section": "path",
                "case": case,
                "strategy": "flashmla_dense_bf16",
                "heads": 16,
                "context": 131_072,
                "batch": 1,
                "rel_err": 1.7e-3,
                "tail_mass_kept": 1.0,
                "finite": True,
            }
        )
        rows.append(
            {
                "section": "path",
                "case": case,
                "strategy": "ours",
                "heads": 16,
                "context": 131_072,
                "batch": 1,
                "rel_err": 1.65e-3,
                "tail_mass_kept": 0.999,
                "finite": True,
            }
        )
        rows.append(
            {
                "section": "path",
                "case": case,
                "strategy": "flashmla_dense_fp8",
                "heads": 16,
                "context": 131_072,
                "batch": 1,
                "rel_err": 9e-3 if sink else 2.7e-2,
                "tail_mass_kept": 0.0 if sink else 0.999,
                "finite": True,
            }
        )
    return Result("fp8_accuracy", {}, rows, prov)


def test_report_verdicts_and_sentences():
    res = _synthetic()
    fm = accuracy_report.path_summary(res, "flashmla_dense_fp8")
    assert fm["keeps"] == 0 and fm["tail_kept_min"] == 0.0 and fm["failing_profiles"] == [SPREAD_1, SINKS_99]
    ours = accuracy_report.path_summary(res, "ours")
    assert ours["keeps"] == 2 and ours["ratio_max"] == pytest.approx(1.65 / 1.7)
    assert fm["cases"] == 2 and fm["passing_profiles"] == [] and fm["tail_worst_case"].startswith(SINKS_99)
    assert fm["ratio_min"] == pytest.approx(9e-3 / 1.7e-3) and fm["ratio_max_profile"] == SPREAD_1
    assert ours["cases"] == 2 and ours["failing_profiles"] == [] and accuracy_report.path_summary(res, "x") is None
    heads, context, paths, rows = accuracy_report.profile_verdicts(res)
    assert (heads, context, paths) == (16, 131_072, ["ours", "flashmla_dense_fp8", "flashmla_dense_bf16"])
    assert [r["profile"] for r in rows] == [SPREAD_1, SINKS_99]
    assert not rows[1]["flashmla_dense_fp8"]["keeps"] and rows[1]["ours"]["keeps"]
    profiles, errors, floor = accuracy_report.error_points(res)
    assert profiles == [SPREAD_1, SINKS_99] and floor == [1.1e-3, 1.1e-3]
    assert errors["ours"] == [1.65e-3, 1.65e-3] and errors["flashmla_dense_fp8"] == [2.7e-2, 9e-3]
    profile, tails = accuracy_report.tail_points(res, SINKS_99)
    assert profile == SINKS_99 and tails[("flashmla_dense_fp8", 16)] == ([131_072], [0.0])


@pytest.mark.slow
def test_chapter_runs_on_cpu(executed):
    rec = executed(BOOK / "05b_fp8_accuracy.md")
    v = rec["values"]
    assert v["live_cases"] == 2 * len(PROFILES) and v["live_ours_keeps"] == v["live_cases"]
    assert v["predicted_rows"] == 2 * len(PROFILES)
    recorded = load_result("fp8_accuracy")
    assert v["recorded_cases"] == len(recorded.table("case"))
    assert v["ours_keeps"] == v["ours_cases"] == v["recorded_cases"]  # ours keeps BF16 accuracy on every case


@pytest.mark.slow
def test_chapter_glues_every_number_its_text_names(executed):
    """The book is built with -W: every glue key chapter 5b's Markdown names must be glued by its run; with the
    recorded result present, none of them is the "not recorded" placeholder."""
    from test_gather_cast_chapter import glued_keys

    chapter = BOOK / "05b_fp8_accuracy.md"
    named, glued = glued_keys(chapter, executed.notebook(chapter))
    assert len(named) > 40 and named <= set(glued), sorted(named - set(glued))
    assert [k for k in named if glued[k] == repr("not recorded")] == []

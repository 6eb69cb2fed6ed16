"""The cost model (kvwall.model.cost): fitted on known rates it recovers them; held-out validation reports real
errors; transfer rules and architecture rules do what the chapter says; on the recorded sweep it meets the
accuracy chapter 6 states."""

import math
import re

import pytest

import kvwall.experiments  # noqa: F401 - registers the row schemas the recorded results load with
from kvwall.model.cost import (
    GPUS,
    PATHS,
    TRANSFER_RULES,
    ComponentFit,
    CostModel,
    Point,
    component_bytes,
    fit_cost_model,
    paths_on,
    split_train_test,
    validate,
)
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import decode_flops
from kvwall.reports import answer_report, original_gpu_report
from kvwall.results import load_result

TRUE = {  # component -> (c0 µs, GB/s, TFLOP/s or None)
    "fa3_bf16": (20.0, 2800.0, 400.0),
    "fa2_bf16": (22.0, 1600.0, 230.0),
    "ours": (11.0, 1300.0, 100.0),
    "flashinfer_fp8": (45.0, 520.0, 140.0),
    "flashmla_bf16": (18.0, 3300.0, 410.0),
    "flashmla_fp8": (13.0, 2400.0, 590.0),
    "full_cast": (6.0, 1040.0, None),
    "index_then_cast": (1.0, 1240.0, None),
    "gather_cast": (0.5, 4200.0, None),
    "triton": (12.0, 1100.0, 90.0),
}


def _truth() -> CostModel:
    return CostModel({k: ComponentFit(k, c0, bw, tf, 0, ()) for k, (c0, bw, tf) in TRUE.items()})


def _grid() -> list[Point]:
    pts = [Point(16, 1, t, 495_000) for t in (1024, 4096, 16_384, 65_536, 262_144)]
    pts += [Point(16, 1, 8192, p) for p in (65_536, 262_144, 1_048_576)]
    pts += [Point(h, 16, 65_536, 495_000) for h in (8, 32, 64, 128)]
    return pts


def test_fit_recovers_known_rates_from_exact_samples():
    truth = _truth()
    samples = [(path, p, truth.layer_us(path, p)) for path in PATHS for p in _grid()]
    fit = fit_cost_model(samples)
    for path in PATHS:
        for p in _grid():
            assert fit.layer_us(path, p) == pytest.approx(truth.layer_us(path, p), rel=0.06), (path, p)
    assert fit.components["full_cast"].gbps == pytest.approx(1040.0, rel=0.03)


def test_held_out_errors_are_measured_not_assumed():
    truth = _truth()
    samples = [
        ("context", path, p, truth.layer_us(path, p) * (1.5 if i % 2 else 1.0))
        for path in ("bf16_cache", "gather_cast")
        for i, p in enumerate(_grid())
    ]
    train, test = split_train_test(samples)
    assert len(train) + len(test) == len(samples) and all(s[1] in ("bf16_cache", "gather_cast") for s in test)
    rows = validate(fit_cost_model(train), test)
    # The held-out (odd) points were made 1.5x slower than the fitted (even) ones: validation must say so.
    errs = sorted(r["rel_err"] for r in rows)
    assert len(errs) == len(test) and all(e < -0.25 for e in errs)
    assert errs[len(errs) // 2] == pytest.approx(1 / 1.5 - 1, abs=0.03)


def test_component_bytes_follow_the_roofline():
    p = Point(16, 1, 8192, 495_000)
    assert component_bytes("full_cast", p) == 495_000 * GLM5.kv_dim * 3
    assert component_bytes("gather_cast", p) == 8192 * (GLM5.kv_dim * 3 + 4)
    fp8, bf16 = component_bytes("ours", p), component_bytes("fa3_bf16", p)
    assert bf16 - fp8 == 8192 * GLM5.kv_dim  # the same index and q/o bytes, twice the KV bytes
    assert component_bytes("flashmla_fp8", p) < fp8  # one index per 64-token page
    with pytest.raises(ValueError, match="unknown component"):
        component_bytes("nope", p)


def test_transfer_rules_and_architectures():
    truth = _truth()
    p = Point(16, 1, 131_072, 495_000)
    h200, pro = GPUS["h200"], GPUS["rtx-pro-6000"]
    assert truth.layer_range_us("gather_cast", p, h200)[0] == truth.layer_range_us("gather_cast", p, h200)[1]
    fraction_rule, per_sm_rule = TRANSFER_RULES  # fraction of peak bandwidth, per-SM rate
    frac = truth.layer_us("full_pool_cast_fa2", p, pro, fraction_rule)
    per_sm = truth.layer_us("full_pool_cast_fa2", p, pro, per_sm_rule)
    # Less bandwidth, more SMs: the fraction-of-peak rule predicts the slower cast on the RTX PRO 6000.
    assert frac > truth.layer_us("full_pool_cast_fa2", p) and per_sm < frac
    with pytest.raises(ValueError, match=r"'guess'.*" + re.escape(str(TRANSFER_RULES))):  # given, and allowed
        truth.layer_us("gather_cast", p, pro, "guess")
    assert set(paths_on("sm_120", 16)) == {
        "full_pool_cast_fa2",
        "index_then_cast_fa2",
        "gather_cast_fa2",
        "ours",
        "bf16_cache_fa2",
    }
    assert all("ours" in paths_on(a, h) for a in ("sm_90", "sm_100", "sm_120") for h in (16, 64, 128))
    assert "flashmla_fp8" in paths_on("sm_90", 16) and "fa3" not in " ".join(paths_on("sm_100", 16))
    assert truth.step_ms("gather_cast", p, rest_ms=10.0) == pytest.approx(
        10.0 + GLM5.num_layers * truth.layer_us("gather_cast", p) / 1e3
    )
    assert decode_flops(16, 131_072) > 0 and math.isfinite(truth.layer_us("ours", p, pro))


def test_recorded_sweep_fit_meets_what_chapter_6_says():
    fit = answer_report.fit_sweep(load_result("path_sweep"))
    by_path = {}
    for r in fit.held_out:
        by_path.setdefault(r["path"], []).append(abs(r["rel_err"]))
    assert max(by_path["full_pool_cast"]) < 0.05 and max(by_path["full_pool_cast_fa2"]) < 0.05  # "a few per cent"
    assert fit.median_abs_err < 0.15 and fit.share_within() > 0.7
    misses = answer_report.misses_table(fit, "c").rows
    assert sum(r["misses"] for r in misses) == sum(abs(r["rel_err"]) > 0.2 for r in fit.held_out)
    assert all(r["why"] and r["paths"] for r in misses)


def test_original_gpu_prediction_brackets_the_originals_cast():
    step = load_result("decode_step_paths")
    fit = answer_report.fit_sweep(load_result("path_sweep"))
    check = original_gpu_report.cast_check(fit.model, answer_report.headline_point(step))
    fraction, per_sm = TRANSFER_RULES
    assert check[per_sm] < check["original_cast_ms"] < check[fraction]
    rows = original_gpu_report.original_gpu_rows(fit.model, answer_report.headline_point(step))
    assert rows[0]["path"] == "full_pool_cast_fa2" and all(r["step_lo"] <= r["step_hi"] for r in rows)

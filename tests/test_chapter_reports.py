"""The notebook layer's per-chapter reports (chapters 1, 4 and 5), on small synthetic results: the numbers they show
follow from the rows given, and every byte count and roofline comes from kvwall.model.roofline."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvwall.notebook.chapter as chapter_module
from conftest import CHAPTERS
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import (full_pool_cast_bytes, gather_cast_bytes, kv_read_bytes, roofline_us)
from kvwall.notebook import fused_bench_report, fused_report, gather_report, gather_step_report, profile_report
from kvwall.notebook.chapter import start_chapter
from kvwall.notebook.source import source_of
from kvwall.notebook.tables import Table, number, percent, show_table, times
from kvwall.results import Provenance, Result, ResultFileError, ResultMissingError


def result(experiment: str, rows: list[dict[str, Any]], **params: Any) -> Result:
    provenance = Provenance(date="2026-11-30T00:00:00+00:00", device="cuda", gpu="NVIDIA H200", driver=None,
                            cuda="13.0", torch="2.11.0", triton="3.6.0", flashinfer=None, python="3.11",
                            git_commit="0" * 40, git_dirty=False, sources={})
    return Result(experiment, params, rows, provenance)


# ---------------------------------------------------------------------------------------------- tables


def test_formatters_and_missing_values():
    assert number(0)(4223.3) == "4,223" and number(2)(None) == "—"
    assert percent(0.734) == "73%" and times(2)(1.5) == "1.50×"
    table = Table([{"x": 0.5}, {}], {"share": ("x", percent)}, "caption")
    assert table.column("share") == ["50%", ""]
    assert table.markdown().endswith("*caption*")
    with pytest.raises(TypeError, match="pass a Table"):
        show_table([{"x": 1}])


def test_recorded_or_none_only_forgives_a_missing_file(monkeypatch, tmp_path):
    shown = []
    monkeypatch.setattr(chapter_module, "show_markdown", shown.append)
    run = start_chapter("x", mode="cpu", record=False, defaults={"gpu": {}, "cpu": {}})

    def missing(name):
        raise ResultMissingError(tmp_path / f"{name}.json", "no such result file")

    monkeypatch.setattr(chapter_module, "load_result", missing)
    assert run.recorded_or_none("fused_decode_bench") is None
    assert len(shown) == 1 and "Not recorded yet" in shown[0] and "fused_decode_bench" in shown[0]

    def corrupt(name):
        raise ResultFileError(tmp_path / f"{name}.json", "not valid JSON")

    monkeypatch.setattr(chapter_module, "load_result", corrupt)
    with pytest.raises(ResultFileError, match="not valid JSON"):
        run.recorded_or_none("fused_decode_bench")


# ---------------------------------------------------------------------------------------------- chapter 5


def test_cost_prediction_uses_the_one_roofline():
    ceilings = {"copy_gbps": 4000.0, "bf16_tflops": 700.0}
    text = fused_report.cost_prediction(ceilings, heads=(16, 128), tokens=131072)
    assert f"**{kv_read_bytes(1)} B**" in text and "**580 B**" in text
    for heads in (16, 128):
        assert f"**{roofline_us(heads, 131072, 4000.0, 700.0):.1f} µs**" in text
    assert "16 heads: 60 FLOP/B, **memory-bound**" in text and "128 heads" in text and "**compute-bound**" in text
    assert "ceilings" not in fused_report.cost_prediction(None)


def test_bytes_by_path_come_from_the_roofline_module():
    table = fused_report.bytes_by_path(context=1000, pool_tokens=5000)
    mb = {r["path"].split(" (")[0]: r["mb"] * 1e6 for r in table.rows}
    bf16 = kv_read_bytes(1000, kv_dtype=torch.bfloat16)
    assert mb["whole-pool cast + BF16 attention"] == pytest.approx(full_pool_cast_bytes(GLM5, 5000)["total"] + bf16)
    assert mb["gather-then-cast + BF16 attention"] == pytest.approx(gather_cast_bytes(1000) + bf16)
    assert mb["fused FP8 attention"] == pytest.approx(kv_read_bytes(1000))
    assert table.rows[-1]["x"] == 1.0


def test_exactness_checks_hold():
    assert fused_report.fp8_to_float16_is_exact() == (254, True)
    exact, largest = fused_report.query_scaling_is_exact()
    assert exact and 2 ** 13 <= largest < 2 ** 15


def _cfg(**overrides: Any) -> dict[str, Any]:
    cfg = {"cfg_block_h": 16, "cfg_block_n": 64, "cfg_num_warps": 4, "cfg_num_stages": 2, "cfg_convert": "cvt",
           "cfg_cache_k": "", "cfg_cache_v": ".ca", "cfg_s_fp8": False, "cfg_combine_block_d": 32}
    return {**cfg, **{f"cfg_{k}": v for k, v in overrides.items()}}


def test_tuning_lessons_compare_each_road_with_its_twin():
    base = {"section": "screen", "heads": 16, "regs": 200, "shared_bytes": 90 * 1024, "roofline_us": 18.0}
    rows = [{**base, **_cfg(), "us": 50.0},
            {**base, **_cfg(convert="bits"), "us": 60.0},
            {**base, **_cfg(cache_v=""), "us": 75.0},
            {**base, **_cfg(s_fp8=True), "us": 80.0, "shared_bytes": 140 * 1024},
            {**base, **_cfg(block_n=32), "error": "out of resources", "us": None}]
    tuning = result("fused_decode_tuning", rows)
    text, values = fused_report.tuning_lessons(tuning, heads=16)
    assert "**50.0 µs**" in text and "**60.0 µs** (1.20×)" in text and "**75.0 µs** (1.50×)" in text
    assert values == {"fp8_scores_us": 80.0, "fp16_scores_us": 50.0}
    screen = fused_report.screen_table(tuning)
    assert screen.column("µs at 128K")[-1] == "out of resources"
    assert screen.column("of roofline")[0] == "36%"  # 18 / 50
    assert fused_report.launch_shape(rows[3]) == "16×64, 4 warps, 2 stages, cvt, FP8 scores (4-term q), two loads"


def test_validation_table_counts_and_worst_ratio():
    case = {"section": "cases", "heads": 16, "layout": "paged", "lens": [1, 2, 3, 4, 5]}
    rows = [{**case, "passed": True, "ratio": 0.5, "rel_err": 1e-3, "bf16_rel_err": 2e-3},
            {**case, "passed": False, "ratio": 2.5, "rel_err": 5e-3, "bf16_rel_err": 2e-3},
            {**case, "passed": True, "ratio": 1.0, "rel_err": 0.0, "bf16_rel_err": 0.0},
            {"section": "errors", "passed": True}, {"section": "sanitizer", "passed": None, "summary": "no tool"}]
    validation = result("fused_decode_validation", rows)
    table = fused_report.validation_table(validation, "caption")
    assert table.rows[0]["passed"] == "2 / 3" and "ratio 2.50" in table.rows[0]["detail"] and "…" in table.rows[0]["detail"]
    assert [r["passed"] for r in table.rows[1:]] == ["1 / 1", "not run"]
    assert not fused_report.validation_passed(validation)
    assert "**0.50–2.50×**" in fused_report.validation_ratio_text(validation)


def _bench_row(strategy: str, heads: int, context: int, batch: int, us: float | None, **extra: Any) -> dict[str, Any]:
    return {"section": "bench", "strategy": strategy, "heads": heads, "context": context, "batch": batch,
            "us": us, "roofline_us": 10.0, "host_us": 100.0, "tflops": 50.0, "gbps": 1000.0, **extra}


def _bench() -> fused_bench_report.FusedBench:
    rows = [{"section": "ceilings", "bf16_tflops": 700.0, "host_us_means": "host time"}]
    fused_extra = {"tokens": 32768, "len_min": 100, "len_max": 20000, "num_splits": 10, "config": {"block_h": 16}}
    for context, fused, fa2, fa3, bf16, orig in ((32768, 20.0, 70.0, 80.0, 30.0, 900.0),
                                                 (131072, 40.0, 120.0, None, 30.0, 1000.0)):
        rows += [_bench_row("fused_fp8", 16, context, 1, fused, **fused_extra),
                 _bench_row("flashinfer_fp8_fa2", 16, context, 1, fa2),
                 _bench_row("flashinfer_fp8_fa3", 16, context, 1, fa3),
                 _bench_row("flashinfer_bf16_precast", 16, context, 1, bf16),
                 _bench_row("full_cast_bf16", 16, context, 1, orig)]
    rows.append(_bench_row("fused_fp8", 16, 32768, 8, 80.0, **fused_extra))
    rows.append(_bench_row("flashinfer_bf16_precast", 16, 32768, 8, 40.0))
    return fused_bench_report.FusedBench(result("fused_decode_bench", rows))


def _bench_gen2() -> tuple[fused_bench_report.FusedBench, Any]:
    """Three points: batch 1 and a mixed batch 32 with the same 32K tokens at 16 heads, and 64 heads at batch 8."""
    rows = [{"section": "ceilings", "bf16_tflops": 700.0, "host_us_means": "host time"}]
    for (h, ctx, b), fused, paged, bf16, fp8, extra in (
            ((16, 32768, 1), 20.0, 21.0, 30.0, 18.0, {}), ((16, 4096, 32), 40.0, 42.0, 35.0, 25.0, {}),
            ((64, 32768, 8), 80.0, 79.0, 40.0, 30.0, {"tflops": 90.0})):
        common = {"tokens": 32768 if h == 16 else 65536, "len_min": 100, "len_max": 4000}
        rows += [_bench_row("fused_fp8", h, ctx, b, fused, rel_err_f64=1.7e-3, work_items=40, chunk_tokens=512,
                            imbalance=1.1, **common, **extra),
                 _bench_row("fused_fp8_page64", h, ctx, b, paged, **common),
                 _bench_row("flashmla_dense_bf16", h, ctx, b, bf16, **common, **({"tflops": 500.0} if extra else {})),
                 _bench_row("flashmla_dense_fp8", h, ctx, b, fp8, rel_err_f64=2.7e-2, **common)]
    rows.append(_bench_row("full_cast_bf16", 16, 32768, 1, 900.0, tokens=32768))
    validation = result("fused_decode_validation", [
        {"section": "cases", "rel_err": 1e-3, "bf16_rel_err": 1.1e-3, "ratio": 0.9},
        {"section": "cases", "rel_err": 1.1e-3, "bf16_rel_err": 1e-3, "ratio": 1.1}])
    return fused_bench_report.FusedBench(result("fused_decode_bench", rows)), validation


def test_bench_targets_follow_the_rows():
    bench, validation = _bench_gen2()
    t = fused_bench_report.targets(bench, validation, key=(16, 32768, 1))
    assert [r["verdict"] for r in t.table.rows] == ["met", "missed", "missed", "missed", "met", "missed"]
    v = t.values
    assert v["targets_met"] == 2 and v["max_ratio_to_bf16_path"] == 1.1
    assert v["min_flashmla_fp8_err_x"] == pytest.approx(2.7e-2 / 1.7e-3)
    assert v["faster_than_flashmla_bf16"] == 1 and v["flashmla_bf16_points"] == 3
    assert v["min_share_16h"] == pytest.approx(10.0 / 40.0) and v["max_tflops_64_128h"] == 90.0
    assert v["page1_over_page64_max"] == pytest.approx(80 / 79) and v["balance_ratios"] == {"16h": pytest.approx(2.0)}
    assert v["x_vs_original_path_b1_16h"] == {32768: 45.0}
    assert "**2 of 6 targets met.**" in t.text and "32K **45×**" in t.text
    assert "slower at 16 h, 4K, b32; 64 h, 32K, b8 (worst 64 h, 32K, b8: 2.0×)" in t.table.rows[1]["measured"]
    balance = fused_bench_report.balance_table(bench)
    assert [r["point"] for r in balance.rows] == ["16 h, 4K, b32", "64 h, 32K, b8"]
    assert balance.rows[0]["b1"] == f"{20.0 / 32768 * 1e3:.2f} (32K, same tokens)"
    assert fused_bench_report.page_table(bench).column("page 1 / page 64")[2] == "1.01×"
    table = fused_bench_report.bench_table(bench)
    assert table.column("fused FP8 (this chapter)")[0] == "40.0 (25%)"


def test_per_point_names_where_the_fused_kernel_wins_and_loses():
    table, text, values = fused_bench_report.per_point(_bench())
    assert [r["point"] for r in table.rows] == ["16 h, 32K, b1", "16 h, 32K, b8", "16 h, 128K, b1"]
    assert values == {"points_fused_is_fastest": 1, "points_fastest_among_fp8_cache_paths": 3}
    assert "**1 of 3** points (16 h, 32K, b1)" in text and "FlashInfer BF16 on a BF16 cache at 2 points" in text


def test_against_flashmla_leads_with_the_losses_and_the_accuracy_trade():
    rows = [{"section": "ceilings", "bf16_tflops": 700.0}]
    for context, fused, fp8, bf16 in ((4096, 10.0, 12.0, 20.0), (32768, 30.0, 20.0, 25.0), (131072, 60.0, None, None)):
        rows += [_bench_row("fused_fp8", 16, context, 1, fused),
                 _bench_row("flashmla_dense_fp8", 16, context, 1, fp8,
                            **({} if fp8 else {"error": "ValueError: pages do not fit."})),
                 _bench_row("flashmla_dense_bf16", 16, context, 1, bf16)]
    bench = fused_bench_report.FusedBench(result("fused_decode_bench", rows))
    validation = result("fused_decode_validation", [
        {"section": "cases", "rel_err": 2e-3}, {"section": "cases", "rel_err": 1e-3},
        {"section": "fp8_peers", "peer": "flashmla_dense_fp8", "rel_err": 3e-2},
        {"section": "fp8_peers", "peer": "flashmla_dense_bf16", "rel_err": 2e-3}])
    table, text = fused_bench_report.against_flashmla(bench, validation)
    assert table.column("fused / FlashMLA FP8") == ["0.83×", "1.50×", "—"]
    assert "loses at 1 of 2 points" in text and "except 16 h, 4K, b1" in text and "up to 1.5× (16 h, 32K, b1)" in text
    assert "faster at 1 of 2 points" in text  # FlashMLA BF16: 25 < 30 at 32K only
    assert "not timed at 16 h, 128K, b1 (ValueError: pages do not fit:" in text
    assert "3.0e-02, 15× the fused kernel's worst (2.0e-03" in text
    _, without = fused_bench_report.against_flashmla(bench)
    assert "accuracy" not in without


def test_ncu_tables_and_text():
    profile = {"section": "profile", "heads": 16, "tokens": 131072, "min_bytes": 100.0, "dram_read_bytes": 90.0,
               "l2_bytes": 250.0, "flops": 1e9, "duration_ns": 1e4, "dynamic_smem_bytes": 2048.0,
               "registers_per_thread": 254.0, "achieved_occupancy_pct": 12.0, "issue_active_pct": 38.0,
               "theoretical_occupancy_pct": 12.5, "dram_pct_of_peak": 25.0, "stall_wait": 0.9, "stall_barrier": 0.1,
               "stall_mio_throttle": 0.5, "grid_size": 256.0, "block_size": 128.0}
    ncu = result("fused_decode_ncu", [profile, {"section": "profile", "heads": 64, "error": "ncu failed"}])
    main, stalls = fused_bench_report.ncu_tables(ncu)
    assert main.column("HBM read / FP8 bytes") == ["0.90×"] and main.column("L2 traffic / FP8 bytes") == ["2.50×"]
    assert [r["reason"] for r in stalls.rows] == ["wait", "mio throttle", "barrier"]
    text = fused_bench_report.ncu_text(ncu)
    assert "`wait` (0.90), `mio throttle` (0.50), `barrier` (0.10)" in text and "256 programs of 128 threads" in text


# ---------------------------------------------------------------------------------------------- chapter 4


def test_gather_prediction_bytes_and_step():
    before = {"step_ms": 90.0, "cast_op_ms_per_step": 66.0}
    p = gather_report.predict(8192, 65536, copy_gbps=4000.0, before=before, pool_tokens=1000)
    assert p.gather_bytes == gather_cast_bytes(8192) == 8192 * (576 * 3 + 4)
    assert p.full_pool_bytes == full_pool_cast_bytes(GLM5, 1000)["total"]
    per_layer_us = p.gather_bytes / 4000e3
    step = 90.0 - 66.0 + GLM5.num_layers * per_layer_us / 1e3
    assert f"**{per_layer_us:.1f} µs per layer**" in p.text and f"about **{step:.1f} ms**" in p.text
    assert "**1,732 B per row**" in p.text and "At the H200" not in gather_report.predict(8192, 65536).text


def test_suite_table_counts_each_implementation():
    case = {"section": "cases", "mismatched_values": 0, "overwritten_poison": 0}
    rows = [{**case, "impl": "triton", "nan_inputs": False, "ok": True},
            {**case, "impl": "triton", "nan_inputs": True, "ok": False, "mismatched_values": 3},
            {"section": "full_cast", "ok": True, "shape": [3, 1, 576]},
            {"section": "nvcc", "ok": None, "summary": "no nvcc on this machine"}]
    table = gather_report.suite_table(result("gather_cast_validation", rows), "caption")
    assert [(r["what"], r["passed"]) for r in table.rows] == [
        ("triton: cases", "1 / 1"), ("triton: cases (FP8 NaNs in the pool)", "0 / 1"),
        ("full_cast, whole pool", "1 / 1"), ("nvcc, CUDA C++ twin", "no nvcc")]
    assert table.rows[1]["detail"].startswith("3 mismatched values")


def test_gather_targets_from_a_small_sweep():
    rows = [{"section": "copy", "gbps": 4000.0},
            {"section": "full_pool", "impl": "full_cast (Triton)", "of_copy": 0.95},
            {"section": "full_pool", "impl": "PyTorch pool.to(bf16)", "of_copy": 0.25}]
    for n, kernel_ms, torch_ms in ((4096, 0.007, 0.017), (32768, 0.02, 0.08)):
        for impl, ms in (("gather_cast (Triton)", kernel_ms), (gather_report.TORCH_OP, torch_ms)):
            for layout in (gather_report.RANDOM_SLOTS, "batch 2, mixed lengths"):
                rows.append({"section": "sweep", "impl": impl, "n": n, "layout": layout, "ms": ms,
                             "gbps": gather_cast_bytes(n) / ms / 1e6, "of_copy": gather_cast_bytes(n) / ms / 4e9})
    rows.append({"section": "graph", "impl": "gather_cast (Triton)", "n": 4096, "ms": 0.004, "gbps": 1.0})
    bench = result("gather_cast_bench", rows, batch=2, pool_tokens=1000)
    t = gather_report.targets(bench, sizes=(4096, 32768))
    assert t.values["min_speedup_vs_torch_n_ge_32k"] == pytest.approx(4.0)
    assert t.values["us_at_4k"] == pytest.approx(7.0) and t.values["us_at_4k_graph"] == pytest.approx(4.0)
    assert t.values["min_of_copy_n_ge_32k"] == pytest.approx(gather_cast_bytes(32768) / 0.02 / 4e9)
    assert [r["impl"] for r in t.table.rows[:2]] == ["gather_cast (Triton)", gather_report.TORCH_OP]
    assert gather_report.of_copy(bench, 32768) == t.values["min_of_copy_n_ge_32k"]


def _strategy(name: str, graph_step: float | None, **extra: Any) -> dict[str, Any]:
    return {"section": "strategies", "strategy": name, "name": name, "layers": 2, "step_ms": 100.0,
            "kv_strategy_ms_per_step": 60.0, "graph_step_ms": graph_step, "graph_kv_ms_per_step": 60.0,
            "rel_err_vs_float64": 1e-3, **extra}


def test_capacity_gain_is_the_before_step_with_the_measured_kv_time():
    rows = [_strategy("full_pool_cast", 90.0),
            {"section": "capacity", "strategy": "index_then_cast_capacity", "capacity": 1000, "ms_per_layer": 3.0},
            {"section": "capacity", "strategy": "index_then_cast_capacity", "capacity": 9000, "ms_per_layer": 25.0},
            {"section": "capacity", "strategy": "gather_cast_capacity", "capacity": 1000, "ms_per_layer": 1.0}]
    profile = result("gather_cast_profile", rows, context_lens=[500])
    gain = gather_step_report.capacity_gain(profile)
    saved = {(r["strategy"], r["capacity"]): r["time_saved"] for r in gain.rows}
    # rest of the graph step: 90 - 60 = 30 ms; 2 layers at the measured per-layer time.
    assert saved[("index_then_cast_capacity", 1000)] == pytest.approx(1 - (30 + 6) / 90)
    assert saved[("index_then_cast_capacity", 9000)] == pytest.approx(1 - (30 + 50) / 90)
    assert saved[("gather_cast_capacity", 1000)] == pytest.approx(1 - 32 / 90)
    # 11 % is the closest to both readings of the original's figure (29 % saved; a 1.29x speed-up: 22.5 % saved)
    assert gain.text.count(f"**9,000** rows, which saves **{1 - 80 / 90:.0%}**") == 2
    assert ORIGINAL.reported_gather_cast_gain == pytest.approx(0.29, abs=0.01)
    assert ORIGINAL.gain_as_time_saved["speedup"] == pytest.approx(1 / 0.71)
    assert ORIGINAL.gain_as_speedup["time_saved"] == pytest.approx(1 - 1 / 1.29)


def test_the_original_share_is_computed_from_its_times():
    assert ORIGINAL.reported_cast_share == 0.69
    assert ORIGINAL.cast_share_of_step == pytest.approx(64.6 / 86)
    text = profile_report.original_text()
    assert "64.6 / 86 = **75.1%**, not 69%" in text


def test_gains_and_the_stall_story():
    rows = [_strategy("full_pool_cast", None), {"section": "gain", "strategy": "full_pool_cast", "time_saved": 0.0}]
    profile = result("gather_cast_profile", rows)
    assert gather_step_report.gain_rows(profile)[0]["name"] == "full_pool_cast"
    assert gather_step_report.stall_story(profile) is None  # no graph step, no marked steps
    assert gather_step_report.summary_text(profile, 0.8) is None


# ---------------------------------------------------------------------------------------------- chapter 1


def _step(step_ms: float, cast_ms: float, profiled_ms: float | None = None) -> dict[str, Any]:
    return {"section": "summary", "step_ms": step_ms, "cast_op_ms_per_step": cast_ms,
            "profiled_step_ms": profiled_ms, "cast_share": cast_ms / (profiled_ms or step_ms),
            "cast_bytes_per_layer": full_pool_cast_bytes(GLM5, 1000)["total"], "device_kind": "cpu"}


def _phases(cast_ms: float, rest_ms: float) -> list[dict[str, Any]]:
    return [{"section": "breakdown", "phase": "kv_strategy", "ms_per_step": cast_ms},
            {"section": "breakdown", "phase": "attention", "ms_per_step": rest_ms},
            {"section": "step", "step": 0, "ms": cast_ms + rest_ms}]


def test_profile_tables_take_shares_of_the_same_steps():
    ops = [{"section": "ops", "name": "aten::copy_", "calls_per_step": 2.0, "ms_per_step": 8.0},
           {"section": "ops", "name": "aten::mm", "calls_per_step": 4.0, "ms_per_step": 1.0}]
    live = result("decode_profile", [_step(10.0, 8.0, profiled_ms=16.0), *ops, *_phases(7.0, 3.0)],
                  profile_steps=2)
    # the profiler's times over the profiled steps' own clock, never over the phase-clocked step
    assert profile_report.ops_table(live, "caption").column("share of step") == ["50%", "6%"]
    shares = profile_report.step_shares(live)
    assert shares["profiler_share"] == 0.5 and shares["phase_share"] == pytest.approx(0.7)
    old = result("decode_profile", [_step(10.0, 8.0), *ops, *_phases(7.0, 3.0)])  # recorded before the clock
    assert "share of step" not in profile_report.ops_table(old, "c").columns
    assert profile_report.step_shares(old)["profiler_share"] is None
    side = profile_report.side_by_side(old, live, live_label="live", caption="c")
    assert side.rows[2] == {"what": "cast share of the step (phase clock)", "orig": "—", "rec": "70%", "live": "70%"}
    assert side.rows[4]["orig"].startswith(f"{ORIGINAL.cast_share_of_step:.0%} (64.6 / 86")
    assert side.rows[4]["rec"] == "not in this recording" and side.rows[4]["live"] == "50%"


def test_cast_rate_against_the_copy_and_the_integer_cast():
    rows = [{"section": "device_copy", "gbps": 4000.0},
            {"section": "copies", "copy": "fp8 -> bf16", "kernel": "unrolled_elementwise_kernel", "gbps": 1000.0},
            {"section": "copies", "copy": "int8 -> int16", "kernel": "unrolled_elementwise_kernel", "gbps": 2000.0}]
    kernels = result("cast_kernels", rows)
    copies, ceiling = profile_report.copy_rows(kernels)
    assert ceiling == 4000.0 and [r["of_copy"] for r in copies] == [0.25, 0.5]
    text = profile_report.cast_rate_text(kernels)
    assert "**1,000 GB/s, 25% of a plain copy**" in text and "reaches 50%" in text and "to 50% of what" in text
    assert profile_report.copies_table(kernels, "Recorded.").caption.endswith("4,000 GB/s (read + write).")


def test_sweep_text_compares_the_pool_cast_with_the_longest_request():
    cast = [{"pool_tokens": 1000, "ms": 0.5}, {"pool_tokens": ORIGINAL.pool_tokens, "ms": 0.8}]
    attention = [{"context_len": 131072, "ms": 0.2}, {"context_len": 1024, "ms": 0.01}]
    assert "**4.0×** the attention" in profile_report.sweep_text(cast, attention)


# ---------------------------------------------------------------------------------------------- source


def test_source_of_a_kernel_and_helpful_errors(tmp_path):
    (tmp_path / "k.py").write_text("import functools\n\n\n@functools.cache\ndef f(x):\n    return x\n\n\nclass C:\n    pass\n")
    code, first, last = source_of("k.py", "f", root=tmp_path)
    assert (first, last) == (4, 6) and code.startswith("@functools.cache\ndef f(x):")
    with pytest.raises(LookupError, match="defines no top-level 'g'; it defines C, f"):
        source_of("k.py", "g", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="relative to"):
        source_of("nope.py", "f", root=tmp_path)


def test_every_source_a_chapter_shows_exists():
    shown = [m for page in CHAPTERS for m in re.findall(r'show_source\("([^"]+)", "([^"]+)"\)', page.read_text())]
    assert {path for path, _ in shown} >= {"kernels/gather/kernel.py", "kernels/mla_decode/kernel.py"}
    for path, name in shown:
        code, _, _ = source_of(path, name)
        assert f"def {name}(" in code


def test_live_profile_params_fit_the_pool():
    small = {"capacity": 4096, "capacity_sweep": [2048, 8192, 60000]}
    params = gather_step_report.live_profile_params({"pool_tokens": 6000, "layers": 1, "context_len": 700}, small)
    assert params == {"pool_tokens": 6000, "layers": 1, "context_lens": [700], "capacity": 4096,
                      "capacity_sweep": [2048]}
    assert gather_step_report.live_profile_params({"pool_tokens": 3000, "layers": 1, "context_len": 5000},
                                                  small)["capacity"] == 3000


# ---------------------------------------------------------------------------------------------- chapter 5, CUDA paths


def _cuda_rows() -> list[dict[str, Any]]:
    """A two-point fused_decode_cuda result: the wgmma path, the mma.sync default, Triton and FlashMLA."""
    build = {"section": "build", "gpu": "NVIDIA H200", "sms": 132, "nvcc": "13.0", "build_s": 1.0,
             "copy_gbps": 4200.0, "bf16_tflops": 680.0, "shared_limit": 232448, "default_variant": 5,
             "variants": {"5": {"name": "v5", "warps": 4, "block_n": 64, "stages": 2, "min_blocks": 2, "v_bits": 0,
                                "smem": 99_000, "registers": 255, "stack_bytes": 0, "spill_bytes": 0}},
             "wgmma": {"runs": True, "arch": "sm_90a", "build_s": 4.0, "smem": 230400, "heads_per_cta": 64,
                       "block_n": 64, "threads": 256, "registers": 255, "stack_bytes": 0, "spill_bytes": 0},
             "flash_mla": {}}
    times_ = {(16, 32768, 1): {"cuda_wgmma": 20.0, "cuda_wgmma_page1": 21.0, "cuda_v5": 30.0,
                               "fused_fp8_page64": 25.0, "flashmla_dense_bf16": 40.0, "flashmla_dense_fp8": 22.0},
              (128, 32768, 8): {"cuda_wgmma": 80.0, "cuda_wgmma_page1": 80.0, "cuda_v5": 200.0,
                                "fused_fp8_page64": 190.0, "flashmla_dense_bf16": 40.0, "flashmla_dense_fp8": 35.0}}
    rows: list[dict[str, Any]] = [build]
    for (h, c, b), us in times_.items():
        for strategy, t in us.items():
            rows.append({"section": "bench", "strategy": strategy, "heads": h, "context": c, "batch": b,
                         "tokens": c * b, "len_min": c, "len_max": c, "roofline_us": 10.0, "us": t,
                         "timing": "graph", "tflops": 2 * h * c * b * 1088 / t / 1e6,
                         "rel_err_f64": 0.03 if strategy == "flashmla_dense_fp8" else 0.0017})
    rows.append({"section": "validation", "variant": "wgmma", "case": "c", "heads": 64, "tokens": 10,
                 "page_size": 1, "ok": True, "rel_err": 0.0017, "triton_rel_err": 0.0017})
    return rows


def test_the_wgmma_report_says_what_its_rows_say():
    from kvwall.notebook.cuda_path_report import CudaPath
    rep = CudaPath(result("fused_decode_cuda", _cuda_rows(), contexts=[32768]))
    text, values = rep.wgmma_summary()
    assert values["wgmma_faster_than_fm_bf16_16h"] == 1 and values["wgmma_faster_than_fm_bf16_64_128h"] == 0
    assert values["wgmma_faster_than_fm_fp8"] == 1  # 20 < 22 at 16 heads; 80 > 35 at 128
    assert values["wgmma_worst_vs_fm_bf16"] == 0.5 and "0.50× FlashMLA BF16's speed" in text
    assert values["wgmma_vs_best_other_geomean_64_128h"] == pytest.approx(190 / 80)
    assert values["wgmma_page1_over_page64_max"] == pytest.approx(1.05)
    fig = rep.wgmma_figure()
    bars = {t.name: list(t.y) for t in fig.data}
    assert bars["wgmma path"] == [2.0, 0.5] and bars["FlashMLA FP8 (FP8 query)"] == [40 / 22, 40 / 35]
    verdicts = {r["target"][:2]: r["verdict"] for r in rep.wgmma_targets().rows}
    # 128 heads x 262,144 tokens x 2,176 FLOP in 80 µs: 912 TFLOP/s, so target 4 holds on these rows
    assert verdicts == {"1.": "met", "2.": "missed", "3.": "missed", "4.": "met", "5.": "met"}


def test_what_to_run_names_the_fastest_accurate_kernel_per_heads_and_batch():
    from kvwall.notebook.cuda_path_report import CudaPath
    table = CudaPath(result("fused_decode_cuda", _cuda_rows(), contexts=[32768])).what_to_run()
    rows = {(r["heads"], r["batch"]): r for r in table.rows}
    assert rows[(16, "1")]["fastest"] == "wgmma path (1 of 1)" and rows[(16, "1")]["vs"] == 2.0
    assert rows[(128, "8–64")]["fastest"] == "FlashMLA BF16 (BF16 cache) (1 of 1)" and rows[(128, "8–64")]["vs"] == 0.5
    assert rows[(128, "8–64")]["fp8"] == pytest.approx(40 / 35)
    assert "18× our error" in table.markdown()  # 0.03 / 0.0017, the rows' FlashMLA FP8 error over ours


def test_target_6_pairs_a_mixed_batch_of_32_with_one_request_of_equal_tokens():
    from kvwall.notebook.cuda_path_report import CudaPath
    rows = _cuda_rows()
    for h, batch, tokens, us in ((16, 1, 65536, 30.0), (16, 32, 65536, 36.0), (128, 32, 65536, 50.0)):
        rows.append({"section": "bench", "strategy": "cuda_wgmma", "heads": h, "context": 8192, "batch": batch,
                     "tokens": tokens, "len_min": 1, "len_max": tokens, "roofline_us": 10.0, "us": us,
                     "timing": "graph"})
    rep = CudaPath(result("fused_decode_cuda", rows, contexts=[32768]))
    pairs = rep.balance_pairs()
    assert [(p["heads"], p["tokens"]) for p in pairs] == [(16, 65536)]  # 128 heads has no batch-1 twin
    assert pairs[0]["ratio"] == pytest.approx(1.2)
    target = next(r for r in rep.wgmma_targets().rows if r["target"].startswith("6."))
    assert target["verdict"] == "missed" and "1.20–1.20× over 1 pairs" in target["measured"]
    rows[-2]["us"] = 33.0  # within 15 %
    assert next(r for r in CudaPath(result("fused_decode_cuda", rows, contexts=[32768])).wgmma_targets().rows
                if r["target"].startswith("6."))["verdict"] == "met"


def test_the_phase_table_holds_each_warpgroup_against_the_tile_floors():
    from kvwall.kernels.mla_decode.wgmma import TRACE_PHASES
    from kvwall.notebook.tile_phases_report import TilePhases, tile_floors
    floors = tile_floors()
    # 64 heads x 64 tokens x (576 + 512) x 2 FLOP at 4,096 per cycle; 296 KB of shared-memory traffic
    assert floors["tensor"] == 2176 and floors["scores"] == 1152 and floors["smem_bytes"] == 303104
    per_tile = {"0": dict(zip(TRACE_PHASES[0], (100.0, 2304.0, 700.0, 50.0, 800.0, 600.0))),
                "1": dict(zip(TRACE_PHASES[1], (150.0, 900.0, 80.0, 1200.0, 1800.0)))}
    rows = _cuda_rows() + [{"section": "phases", "heads": 128, "context": 131072, "batch": 8, "tokens": 10**6,
                            "us": 100.0, "us_traced": 105.0, "work_items": 65, "ctas": 130, "tiles": 1300,
                            "per_tile": per_tile, "per_cta": {"0": {"query prologue": 9000.0},
                                                               "1": {"query prologue": 9000.0, "first tiles": 3000.0}}},
                           {"section": "phases", "heads": 16, "context": 4096, "batch": 1, "tokens": 4096,
                            "error": "RuntimeError: no tile"}]
    rep = TilePhases(result("fused_decode_cuda", rows, contexts=[32768]))
    table, text, values = rep.table()
    assert len(table.rows) == 1  # the failed trace is not a point
    row = table.rows[0]
    assert row["wg0"] == 4554 and row["wg1"] == 4130 and row["fixed"] == 12000 and row["tiles"] == 10
    assert row["vs_tensor"] == pytest.approx(4554 / 2176) and table.column("clock reads' cost") == ["+5%"]
    assert values["phase_scores_over_floor_min"] == 2.0 and "2.0–2.0× their tensor time" in text
    assert values["phase_wait_share_max"] == pytest.approx(230 / 4554)
    fig = rep.figure()
    stacks = {t.name: list(t.x) for t in fig.data}
    assert stacks["wg 0: scores (36 wgmma)"] == [2304.0, None] and stacks["wg 1: convert the next tile"] == [None, 1200.0]

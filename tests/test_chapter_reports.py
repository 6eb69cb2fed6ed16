"""The notebook layer's per-chapter reports (chapters 1, 4 and 5), on small synthetic results: the numbers they show
follow from the rows given, and every byte count and roofline comes from kvwall.model.roofline."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

import kvwall.reports.chapter as chapter_module
from conftest import BOOK, CHAPTERS
from kvwall.model.geometry import GLM5
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.model.original import ORIGINAL
from kvwall.model.roofline import full_pool_cast_bytes, gather_cast_bytes, kv_read_bytes, roofline_us
from kvwall.reports import (
    fused_bench_report,
    fused_lab_report,
    fused_report,
    gather_report,
    gather_step_report,
    profile_report,
)
from kvwall.reports.chapter import start_chapter
from kvwall.reports.fused_bench_report import label, point_label
from kvwall.reports.tables import Table, number, percent, times
from kvwall.results import Provenance, Result, ResultFileError, ResultMissingError


def result(experiment: str, rows: list[dict[str, Any]], **params: Any) -> Result:
    provenance = Provenance(
        date="2026-11-30T00:00:00+00:00",
        device="cuda",
        gpu="NVIDIA H200",
        driver=None,
        cuda="13.0",
        torch="2.11.0",
        triton="3.6.0",
        flashinfer=None,
        python="3.11",
        git_commit="0" * 40,
        git_dirty=False,
        sources={},
    )
    return Result(experiment, params, rows, provenance)


def keys(table: Table) -> list[str]:
    """The row keys a table's columns show, in order (a header is wording; the key is what it shows)."""
    return [spec if isinstance(spec, str) else spec[0] for spec in table.columns.values()]


def cells(table: Table, key: str) -> list[str]:
    """The formatted cells of the one column that shows row key ``key``."""
    (header,) = [h for h, k in zip(table.columns, keys(table)) if k == key]
    return table.column(header)


def fraction(cell: str) -> tuple[int, int]:
    """A ``"passed / of"`` cell as its two counts."""
    passed, of = cell.split(" / ")
    return int(passed), int(of)


# ---------------------------------------------------------------------------------------------- tables


def test_formatters_and_missing_values():
    assert number(0)(4223.3) == "4,223" and number(2)(None) == "—"
    assert percent(0.734) == "73%" and times(2)(1.5) == "1.50×"
    table = Table([{"x": 0.5}, {}], {"share": ("x", percent)}, "caption")
    assert table.column("share") == ["50%", ""]
    assert table.markdown().endswith("*caption*")


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


def test_cost_numbers_and_table_use_the_one_roofline():
    ceilings = {"copy_gbps": 4000.0, "bf16_tflops": 700.0}
    cost = fused_report.cost_numbers(ceilings)
    assert cost["per_token_bytes"] == kv_read_bytes(1) == 580 and cost["flops"] == 2176
    assert cost["index_bytes"] == 4 and cost["bf16_per_token_bytes"] == kv_read_bytes(1, kv_dtype=torch.bfloat16)
    assert cost["ridge"] == pytest.approx(175.0)  # 700e12 / 4000e9
    table = fused_report.cost_table(ceilings, "cap", heads=(16, 128), tokens=131072)
    assert [r["bound"] for r in table.rows] == ["memory", "compute"]
    for row, heads in zip(table.rows, (16, 128)):
        assert row["roof"] == pytest.approx(roofline_us(heads, 131072, 4000.0, 700.0))
    assert "roofline µs" not in fused_report.cost_table(None, "cap").columns
    assert fused_report.cost_numbers(None)["ridge"] is None and fused_report.cost_numbers(None)["copy_gbps"] is None


def test_bytes_by_path_come_from_the_roofline_module():
    table = fused_report.bytes_by_path("cap", context=1000, pool_tokens=5000)
    bf16 = kv_read_bytes(1000, kv_dtype=torch.bfloat16)
    # rows in order: the original's whole-pool cast, chapter 4's gather-then-cast, a BF16 cache, ours
    assert [r["mb"] * 1e6 for r in table.rows] == pytest.approx(
        [full_pool_cast_bytes(GLM5, 5000)["total"] + bf16, gather_cast_bytes(1000) + bf16, bf16, kv_read_bytes(1000)]
    )
    assert table.rows[-1]["x"] == 1.0


def test_exactness_checks_hold():
    assert fused_report.fp8_to_float16_is_exact() == (254, True)
    exact, largest = fused_report.query_scaling_is_exact()
    assert exact and 2**13 <= largest < 2**15


def _cfg(**overrides: Any) -> dict[str, Any]:
    cfg = {
        "cfg_block_h": 16,
        "cfg_block_n": 64,
        "cfg_num_warps": 4,
        "cfg_num_stages": 3,
        "cfg_pairs": True,
        "cfg_combine_block_d": 32,
        "cfg_combine_block_s": 0,
        "cfg_combine_warps": 0,
    }
    return {**cfg, **{f"cfg_{k}": v for k, v in overrides.items()}}


def _tuning() -> Any:
    base = {
        "section": "screen",
        "heads": 16,
        "tokens": 131072,
        "regs": 200,
        "shared_bytes": 56 * 1024,
        "roofline_us": 18.0,
        "spills": 0,
        "rel_err": 4e-4,
    }
    rows = [
        {"section": "ceilings", "copy_gbps": 4200.0, "bf16_tflops": 690.0},
        {**base, **_cfg(), "us": 50.0},
        {**base, **_cfg(pairs=False), "us": 60.0, "regs": 250},
        {**base, **_cfg(), "cfg_cache_v": ".ca", "us": 55.0, "shared_bytes": 88 * 1024},
        {**base, **_cfg(block_n=32), "error": "out of resources", "us": None},
        {**base, **_cfg(block_h=64, num_warps=8, pairs=False), "heads": 64, "us": 100.0, "spills": 10},
        {**base, **_cfg(block_h=32, num_warps=8, pairs=False), "heads": 64, "us": 130.0},
        {
            **base,
            **_cfg(block_h=64, num_warps=8, pairs=False),
            "section": "fastest_any",
            "heads": 64,
            "us": 100.0,
            "spills": 10,
        },
    ]
    for heads, bh in ((16, 16), (64, 32)):
        for tokens in (4096, 131072):
            rows.append(
                {
                    "section": "winner",
                    "heads": heads,
                    "tokens": tokens,
                    **_cfg(block_h=bh),
                    "us": 40.0,
                    "roofline_us": 18.0,
                    "splits": 132,
                    "split_kernel_us": 30.0,
                    "combine_kernel_us": 5.0,
                }
            )
    rows.append(
        {
            "section": "sweep",
            "heads": 16,
            "tokens": 131072,
            **_cfg(block_h=16),
            "us": 45.0,
            "roofline_us": 18.0,
            "splits": 66,
        }
    )
    return result("fused_decode_tuning", rows)


def test_the_triton_path_tuning_tables():
    tuning = _tuning()
    screen = fused_lab_report.screen_table(tuning, 16, "cap")
    # a launch that did not run shows its recorded error in place of its time
    assert screen.column("µs")[-1] == tuning.rows[4]["error"] and screen.column("of roofline")[0] == "36%"
    shape = fused_lab_report.launch_shape(tuning.rows[1]).split(", ")
    assert shape == ["16×64", "4 warps", "3 stages", "16-bit pairs"]
    # a row recorded with the retired second load (its own cache hint) and FP8 scores names both after the shape
    retired = fused_lab_report.launch_shape({**tuning.rows[3], "cfg_s_fp8": True}).split(", ")
    assert retired[:4] == shape and retired[4:] == ["two loads", "FP8 scores"]
    pairs = fused_lab_report.pairs_numbers(tuning, 16)
    assert pairs == {
        "shape": fused_lab_report.launch_shape(tuning.rows[1]),
        "us": 50.0,
        "regs": 200,
        "smem_kb": 56.0,
        "bytes_us": 60.0,
        "bytes_regs": 250,
    }  # the twin reading FP8 bytes; the 55 µs second load is not
    assert fused_lab_report.pairs_numbers(tuning, 32) == {}
    spill = fused_lab_report.spill_rule_table(tuning, "cap")
    assert spill.rows == [
        {
            "heads": 64,
            "fastest": fused_lab_report.launch_shape(tuning.rows[5]),
            "f_us": 100.0,
            "f_spills": 10,
            "c_us": 130.0,
            "x": 1.3,
        }
    ]
    assert [t.name for t in fused_lab_report.split_sweep_figure(tuning, "cap").data] == ["128K tokens"]


def test_design_table_counts_conversions_and_padding():
    table = fused_report.design_table(_tuning(), "cap")
    rows = {r["heads"]: r for r in table.rows}
    # the Triton path: 16 heads -> its 16-head shape; 32, 64, 128 -> the 64-head entry's 32-head block
    assert rows[16]["t_block"].split(" × ") == ["16", "64"] and rows[16]["t_conv"] == 1 and rows[16]["t_pad"] == 0
    assert rows[128]["t_conv"] == 4 and rows[32]["t_conv"] == 1
    # the wgmma path: 64 heads per CTA
    assert [rows[h]["w_conv"] for h in (16, 32, 64, 128)] == [1, 1, 1, 2]
    assert [rows[h]["w_pad"] for h in (16, 32, 64, 128)] == [0.75, 0.5, 0.0, 0.0]
    assert "t_block" in keys(table) and "t_block" not in keys(fused_report.design_table(None, "cap"))


def test_wgmma_tile_floors_and_build_resources():
    floors = fused_report.tile_floors()
    # 64 heads x 64 tokens x (576 + 512) x 2 FLOP at 4,096 per cycle; 296 KB of shared-memory traffic
    assert floors["tensor"] == 2176 and floors["scores"] == 1152 and floors["smem_bytes"] == 303104
    assert floors["smem"] == 2368 and floors["flops"] == 2 * 64 * 64 * 1088
    build = {
        "section": "build",
        "nvcc": "Build cuda_13.0.r13.0/compiler.1",
        "wgmma": {"runs": True, "arch": "sm_90a", "registers": 255, "spill_bytes": 0, "smem": 230400, "threads": 256},
    }
    w = fused_report.build_resources(build)["wgmma"]
    assert (w["nvcc"], w["arch"], w["registers"], w["ctas_per_sm"], w["smem_kb"]) == ("13.0", "sm_90a", 255, 1, 225.0)
    assert fused_report.build_resources({"wgmma": {"runs": False, "why": "no sm_90a"}})["wgmma"] is None
    assert fused_report.build_resources(None) == {"wgmma": None, "wgmma_tokens_16": None, "wgmma_tokens_32": None}


def _case(path: str, heads: int, ratio: float | None, passed: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "section": "cases",
        "path": path,
        "case": f"c{heads}",
        "heads": heads,
        "lens": [5],
        "layout": "flat",
        "passed": passed,
        "rel_err": 1.7e-3 if ratio else 0.0,
        "bf16_rel_err": 2e-3 if ratio else 0.0,
        "ratio": ratio,
        **extra,
    }


def _validation() -> Any:
    rows = [
        {"section": "setup", "device": "cuda", "paths": ["triton", "wgmma", "ours"], "skipped": {}},
        _case("triton", 16, 0.8),
        _case("triton", 16, 1.0),
        _case("wgmma", 64, 0.9),
        _case("ours", 16, 0.85, kernel_path="wgmma"),
        _case("ours", 64, None, kernel_path="triton"),
        {"section": "fp8_peers", "peer": "flashmla_dense_fp8", "rel_err": 3e-2, "ratio_vs_bf16": 15.0},
        {"section": "fp8_peers", "peer": "flashmla_dense_bf16", "rel_err": 2e-3, "ratio_vs_bf16": 1.0},
        {"section": "contract", "path": "triton", "check": "NaN stays in its request", "ok": True, "detail": ""},
        {"section": "contract", "path": "wgmma", "check": "NaN stays in its request", "ok": False, "detail": ""},
        {"section": "errors", "passed": True},
        {"section": "sanitizer", "passed": None, "summary": "no tool"},
    ]
    return result("fused_decode_validation", rows)


def test_validation_table_per_path_and_the_rule():
    validation = _validation()
    table = fused_report.validation_table(validation, "caption")
    what = [r["what"] for r in table.rows]
    # per path (ours first): its cases and heads; ours' row names the paths its cases ran
    assert [w.split(":")[0] for w in what[:3]] == [fused_report.PATH_NAMES[p] for p in ("ours", "triton", "wgmma")]
    assert re.findall(r"\d+", what[0].split("(")[0]) == ["2", "16", "64"] and re.findall(r"\d+", what[1]) == ["1", "16"]
    assert what[0].endswith(f"(ran {fused_report.paths_said(['triton', 'wgmma'])})")
    assert fraction(table.rows[1]["passed"]) == (2, 2) and table.rows[1]["ratio"] == "0.80–1.00×"
    # then the peers, by name: FlashMLA BF16 before FP8
    assert [r["what"].split(",")[0] for r in table.rows[3:5]] == [
        label("flashmla_dense_bf16"),
        label("flashmla_dense_fp8"),
    ]
    assert table.rows[4]["ratio"] == "15.0–15.0×"
    assert [fraction(r["passed"]) for r in table.rows[-3:-1]] == [(1, 2), (1, 1)]
    assert table.rows[-1]["passed"] == "not run"
    # memcheck's row says the paths it ran (a row recorded without them ran the Triton path alone)
    memcheck = table.rows[-1]["what"]
    assert memcheck.startswith("`compute-sanitizer") and memcheck.endswith(f" on {fused_report.paths_said(['triton'])}")
    every = result(
        "fused_decode_validation",
        [
            *validation.rows[:-1],
            {
                "section": "sanitizer",
                "passed": True,
                "summary": "ERROR SUMMARY: 0 errors",
                "paths": ["triton", "wgmma", "wgmma_tokens"],
            },
        ],
    )
    every_row = fused_report.validation_table(every, "caption").rows[-1]
    assert every_row["what"].endswith(f" on {fused_report.paths_said(['triton', 'wgmma', 'wgmma_tokens'])}")
    assert every_row["passed"] == "clean"
    assert not fused_report.validation_passed(validation)  # a contract failed
    assert fused_report.validation_ratios(validation) == {
        "ours": (0.85, 0.85),
        "triton": (0.8, 1.0),
        "wgmma": (0.9, 0.9),
    }
    assert fused_bench_report.flashmla_fp8_error(validation) == (3e-2, 1.7e-3)
    assert fused_bench_report.flashmla_fp8_error(None) == (None, None)
    contracts = fused_lab_report.contracts_table(validation, "cap")
    assert contracts.rows == [{"check": validation.rows[8]["check"], "triton": "yes", "wgmma": "NO"}]


#: (heads, context, batch) -> µs per strategy; ours ran the wgmma path except where it says "triton".
_TIMES = {
    (16, 4096, 1): {
        "ours": 14.0,
        "ours_page64": 14.5,
        "flashmla_dense_bf16": 24.0,
        "flashmla_dense_fp8": 15.0,
        "flashinfer_fp8_fa2": 35.0,
        "flashinfer_fp8_fa3": 50.0,
        "flashinfer_bf16_precast": 20.0,
        "sglang_triton_fp8": 46.0,
        "gather_cast_bf16": 23.0,
        "full_cast_bf16": 860.0,
    },
    (16, 131072, 8): {
        "ours": 80.0,
        "ours_page64": 78.0,
        "flashmla_dense_bf16": 100.0,
        "flashmla_dense_fp8": 70.0,
        "flashinfer_fp8_fa2": 300.0,
        "flashinfer_fp8_fa3": 270.0,
        "flashinfer_bf16_precast": 95.0,
        "sglang_triton_fp8": 210.0,
        "gather_cast_bf16": 220.0,
        "full_cast_bf16": 940.0,
    },
    (128, 32768, 8): {
        "ours": 200.0,
        "ours_page64": 196.0,
        "flashmla_dense_bf16": 100.0,
        "flashmla_dense_fp8": 80.0,
        "flashinfer_fp8_fa2": 400.0,
        "flashinfer_fp8_fa3": None,
        "flashinfer_bf16_precast": 150.0,
        "sglang_triton_fp8": 900.0,
        "gather_cast_bf16": 300.0,
        "full_cast_bf16": 1100.0,
    },
}


def _grid() -> fused_bench_report.Grid:
    rows: list[dict[str, Any]] = [
        {"section": "ceilings", "copy_gbps": 4200.0, "bf16_tflops": 690.0, "host_us_means": "host time"}
    ]
    for (h, c, b), times_ in _TIMES.items():
        tokens = c if b == 1 else c * b // 4
        for strategy, us in times_.items():
            fp8_query = strategy in ("flashmla_dense_fp8", "sglang_triton_fp8")
            row = {
                "section": "bench",
                "strategy": strategy,
                "heads": h,
                "context": c,
                "batch": b,
                "tokens": tokens,
                "len_min": 100 if b > 1 else c,
                "len_max": c,
                "us": us,
                "roofline_us": 10.0,
                "timing": "cuda_graph",
                "page_size": 64 if strategy in ("ours_page64", "flashmla_dense_bf16", "flashmla_dense_fp8") else 1,
                "rel_err_f64": 2.8e-2 if fp8_query else 1.7e-3,
                "host_us": 100.0,
                "tflops": 2 * h * tokens * 1088 / us / 1e6 if us else None,
            }
            if us is None:
                row["error"] = "RuntimeError: refused"
            if strategy.startswith("ours"):
                row.update(
                    kernel_path="triton" if (h, c, b) == (16, 131072, 8) else "wgmma",
                    path_why="measured",
                    work_items=132,
                    imbalance=1.05,
                )
            rows.append(row)
    return fused_bench_report.Grid(
        result(
            "fused_decode_bench",
            rows,
            heads=[16, 128],
            contexts=[4096, 32768, 131072],
            batches=[1, 8],
            max_total_tokens=2_000_000,
            pool_slots=495_000,
        )
    )


def test_the_lead_counts_where_ours_loses():
    grid = _grid()
    lead = fused_bench_report.lead(grid, "cap")
    v = lead.values
    assert v["grid_points"] == 3
    assert v["flashmla_dense_fp8_faster_than_ours"] == 2 and v["ours_faster_than_fm_fp8"] == 1
    assert v["flashmla_dense_bf16_faster_than_ours"] == 1 and v["ours_faster_than_fm_bf16"] == 2
    assert v["flashinfer_faster_than_ours"] == 1  # FlashInfer BF16, 150 < 200 at 128 heads
    assert v["sglang_triton_fp8_faster_than_ours"] == 0 and v["ours_fastest"] == 1 and v["fm_fp8_fastest"] == 2
    assert v["ours_fastest_fp8_cache_bf16_query"] == 3
    assert v["fm_fp8_err_over_ours_min"] == pytest.approx(2.8e-2 / 1.7e-3) == v["fm_fp8_err_over_ours_max"]
    assert v["worst_point"] == (128, 32768, 8) and v["worst_x"] == 2.5  # ours 200 µs, FlashMLA FP8 80
    assert v["sglang_error"] is None
    assert lead.table.rows[2]["speed"] == "0.93–2.50×"  # ours / FlashMLA FP8: 14/15 .. 200/80
    fig = fused_bench_report.lead_figure(grid, "cap")
    ours = [t for t in fig.data if t.legendgroup == "ours"]
    assert [list(t.y) for t in ours] == [[24 / 14, 100 / 80], [100 / 200]]  # one panel per head count
    assert ours[0].name.startswith(label("ours")) and ours[0].name.endswith(f"≤ {1.7e-3:.1e})")  # its worst error


def test_the_grid_by_heads_losses_and_what_to_run():
    grid = _grid()
    table, values = fused_bench_report.by_heads(grid, "cap")
    assert values["h16"]["vs_fm_fp8_wins"] == 1 and values["h16"]["paths"] == {"wgmma": 1, "triton": 1}
    assert values["h128"]["vs_fm_bf16_geomean"] == 0.5 and [r["heads"] for r in table.rows] == [16, 128]
    assert table.rows[0]["won"] == "4K·1, 128K·8" and table.rows[1]["won"] == ""  # ours beat FlashMLA BF16 there
    groups = fused_bench_report.loss_groups(grid)
    assert groups["few_heads"]["points"] == 2 and groups["many_heads_batched"]["vs_fm_bf16"] == 0.5
    assert "many_heads_b1" not in groups and groups["many_heads_batched"]["batches"] == [8]
    assert groups["few_heads"]["heads"] == [16] and groups["many_heads_batched"]["heads"] == [128]
    table = fused_bench_report.what_to_run(grid, "cap")
    rows = {(r["heads"], r["batch"]): r for r in table.rows}
    assert [r["winner"] for r in table.rows] == [label(s) for s in ("ours", "ours", "flashmla_dense_bf16")]
    # the fastest, and at how many of the class's points it was
    for row in rows[(16, "1")], rows[(128, "8–64")]:
        of = re.findall(r"\d+", row["fastest"].removeprefix(row["winner"]))
        assert row["fastest"].startswith(row["winner"]) and of == ["1", "1"]
    assert rows[(16, "1")]["vs"] == pytest.approx(24 / 14)
    assert fused_bench_report.path_counts(grid) == {"wgmma": 2, "triton": 1}


def test_the_appendix_tables_of_the_grid():
    grid = _grid()
    tables = fused_lab_report.bench_tables(grid, "cap")
    assert [keys(t)[0] for t in tables] == ["point", "point"]  # one table per head count, its count in the header
    assert [re.findall(r"\d+", list(t.columns)[0]) for t in tables] == [["16"], ["128"]]
    assert cells(tables[0], "point") == ["4K·1", "128K·8"]
    assert tables[0].column("ours") == ["14.0", "80.0"] and tables[0].column("full cast") == ["860", "940"]
    assert tables[0].column("FI FP8") == ["35.0", "270"] and tables[1].column("FI FP8") == ["400"]
    assert len(tables[0].columns) <= 10, "the wide table must fit the page"
    page = fused_lab_report.page_table(grid, "cap")
    assert page.rows[0]["ours"] == f"{14 / 14.5:.2f}–{80 / 78:.2f}×"
    balance = fused_lab_report.balance_table(grid, "cap")
    assert [r["point"] for r in balance.rows] == [point_label(p) for p in ((16, 131072, 8), (128, 32768, 8))]
    assert balance.rows[0]["b1"] == pytest.approx(14.0 / 4096 * 1e3)  # batch 1 at its longest context, 4K
    host = fused_lab_report.host_table(grid, "cap", heads=16)
    assert host.rows[0]["s"] == "ours" and host.rows[0][4096] == 100.0


def _paths() -> fused_bench_report.Grid:
    rows: list[dict[str, Any]] = [
        {
            "section": "build",
            "gpu": "NVIDIA H200",
            "capability": [9, 0],
            "sms": 132,
            "nvcc": "13.0",
            "copy_gbps": 4200.0,
            "copy_ms": 0.5,
            "bf16_tflops": 690.0,
            "wgmma": {"runs": True},
        }
    ]
    for (h, c, b), (t, w) in {
        (16, 64, 1): (10.0, 9.0),
        (16, 4096, 1): (15.0, 14.0),
        (16, 131072, 1): (50.0, 55.0),
        (128, 4096, 8): (80.0, 40.0),
    }.items():
        for page, slower in ((1, 1.0), (64, 0.98)):
            for strategy, us in (("triton", t), ("wgmma", w)):
                rows.append(
                    {
                        "section": "bench",
                        "strategy": strategy,
                        "heads": h,
                        "context": c,
                        "batch": b,
                        "tokens": c * b,
                        "len_min": c,
                        "len_max": c,
                        "us": us * slower,
                        "roofline_us": 1.0,
                        "timing": "cuda_graph",
                        "page_size": page,
                        "kernel_path": strategy,
                    }
                )
    return fused_bench_report.Grid(result("fused_decode_paths", rows, floor_contexts=[64]))


def test_the_dispatcher_tables():
    paths = _paths()
    assert paths.floor_points == [(16, 64, 1)] and len(paths.points) == 3
    counts = fused_lab_report.dispatch_counts(paths)
    triton_at = [point_label((16, 131072, 1))]
    assert counts == {"dispatch_points": 3, "dispatch_wgmma": 2, "dispatch_triton": 1, "triton_at": triton_at}
    table = fused_lab_report.dispatcher_table(paths, "cap")
    assert cells(table, "pick") == [KERNEL_NAMES[k] for k in ("wgmma", "wgmma", "triton", "wgmma")]
    floor = fused_lab_report.floor_table(paths, "cap")
    assert floor.rows[0]["triton1"] == 10.0 and floor.rows[0]["wgmma64"] == pytest.approx(9.0 * 0.98)
    table_json = {"NVIDIA H200": {"capability": [9, 0], "points": [[64, 32768, 8, "wgmma", 90.0, 50.0]]}}
    others = fused_lab_report.other_gpus_table("cap", table_json, heads=64, batch=8, max_len=32768)
    assert [r["path"] for r in others.rows] == [KERNEL_NAMES[k] for k in ("wgmma", "triton", "triton")]
    assert "NVIDIA H200" in others.rows[0]["why"]  # the H100 read the H200's measured choices


def _paths3() -> fused_bench_report.Grid:
    """A paths run with the tokens-on-M wgmma path: fastest at 16 heads, slower than the wgmma path at 128."""
    rows: list[dict[str, Any]] = [
        {
            "section": "build",
            "gpu": "NVIDIA H200",
            "capability": [9, 0],
            "sms": 132,
            "nvcc": "13.0",
            "copy_gbps": 4200.0,
            "copy_ms": 0.5,
            "bf16_tflops": 690.0,
            "wgmma": {"runs": True},
            "wgmma_tokens": {"runs": True},
        }
    ]
    for (h, c, b), times3 in {
        (16, 64, 1): (10.0, 9.0, 8.0),
        (16, 131072, 1): (50.0, 55.0, 43.0),
        (16, 131072, 32): (320.0, 314.0, 224.0),
        (128, 4096, 8): (80.0, 40.0, 60.0),
    }.items():
        for strategy, us in zip(("triton", "wgmma", "wgmma_tokens"), times3):
            rows.append(
                {
                    "section": "bench",
                    "strategy": strategy,
                    "heads": h,
                    "context": c,
                    "batch": b,
                    "tokens": c * b,
                    "len_min": c,
                    "len_max": c,
                    "us": us,
                    "roofline_us": 1.0,
                    "timing": "cuda_graph",
                    "page_size": 1,
                    "kernel_path": strategy,
                }
            )
    return fused_bench_report.Grid(result("fused_decode_paths", rows, floor_contexts=[64]))


def test_the_dispatcher_tables_follow_the_recorded_paths():
    """With the tokens-on-M path timed: a column, a count and a fixed cost of its own; without (the two-path grid),
    none of them; the paths a recording timed are the ones the chapter names."""
    paths = _paths3()
    assert fused_lab_report.timed_paths(paths) == ["triton", "wgmma", "wgmma_tokens"]
    assert fused_lab_report.dispatch_counts(paths) == {
        "dispatch_points": 3,
        "dispatch_wgmma_tokens": 2,
        "dispatch_wgmma": 1,
        "dispatch_triton": 0,
        "triton_at": [],
    }
    table = fused_lab_report.dispatcher_table(paths, "cap")
    assert keys(table)[1:4] == ["triton", "wgmma", "wgmma_tokens"]  # a µs column per timed path
    assert cells(table, "pick") == [KERNEL_NAMES["wgmma_tokens"]] * 3 + [KERNEL_NAMES["wgmma"]]
    assert table.rows[2]["x"] == pytest.approx(314.0 / 224.0) and table.rows[3]["x"] == pytest.approx(60.0 / 40.0)
    assert fused_lab_report.floor_table(paths, "cap").rows[0]["wgmma_tokens1"] == 8.0
    assert fused_lab_report.floor_ranges(paths)["wgmma_tokens"] == (8.0, 8.0)
    two = _paths()
    assert "wgmma_tokens" not in keys(fused_lab_report.dispatcher_table(two, "cap"))
    assert not any("tokens" in c for c in fused_lab_report.floor_table(two, "cap").columns)
    assert fused_report.recorded_paths(paths.result) == ["triton", "wgmma", "wgmma_tokens"]
    assert fused_report.recorded_paths(two.result) == ["triton", "wgmma"]
    assert fused_report.recorded_paths(None) == ["triton", "wgmma", "wgmma_tokens"]


def test_tokens_on_m_tile_cycles_and_resources():
    assert fused_report.tokens_tile_cycles() == {16: 544, 32: 1088}  # against the wgmma path's 2,176
    assert fused_report.build_resources({"section": "build", "wgmma": {}})["wgmma_tokens_16"] is None  # predates it
    built = {
        "nvcc": "Build cuda_13.0.r13.0/compiler.1",
        "wgmma_tokens": {
            "runs": True,
            "arch": "sm_90a",
            "per_cta": {
                "32": {"registers": 168, "spill_bytes": 0, "smem": 189696, "threads": 384},
                "16": {"registers": 168, "spill_bytes": 0, "smem": 168576, "threads": 384},
            },
        },
    }
    found = fused_report.build_resources(built)
    assert found["wgmma_tokens_16"]["registers"] == 168 and found["wgmma_tokens_16"]["nvcc"] == "13.0"
    assert found["wgmma_tokens_32"]["smem_kb"] == pytest.approx(185.25) and found["wgmma"] is None
    refused = {"wgmma_tokens": {"runs": False, "why": "no sm_90a"}}
    assert fused_report.build_resources(refused)["wgmma_tokens_32"] is None
    rows = {r["heads"]: r for r in fused_report.design_table(None, "cap").rows}
    assert [rows[h]["k_conv"] for h in (16, 32, 64, 128)] == [1, 1, 2, 4]
    assert [rows[h]["k_pad"] for h in (16, 32, 64, 128)] == [0.0, 0.0, 0.0, 0.0]
    # the paths named in the dispatcher's order, whatever order they are given in
    said = [f"the {KERNEL_NAMES[k]}" for k in ("triton", "wgmma", "wgmma_tokens")]
    assert fused_report.paths_said(["wgmma_tokens", "triton"]).split(" and ") == [said[0], said[2]]
    assert fused_report.paths_said(["wgmma_tokens", "wgmma", "triton"]).split(", ") == [said[0], " and ".join(said[1:])]


def test_ncu_summary_and_ranges_per_path():
    profile = {
        "section": "profile",
        "heads": 16,
        "tokens": 131072,
        "path": "wgmma",
        "min_bytes": 100,
        "dram_read_bytes": 90.0,
        "l2_bytes": 250.0,
        "flops": 10**9,
        "duration_ns": 1e4,
        "dynamic_smem_bytes": 2048.0,
        "registers_per_thread": 255.0,
        "achieved_occupancy_pct": 12.4,
        "issue_active_pct": 26.0,
        "theoretical_occupancy_pct": 12.5,
        "dram_pct_of_peak": 25.0,
        "stall_wait": 0.9,
        "stall_barrier": 1.8,
        "stall_mio_throttle": 0.5,
        "tensor_pipe_pct": 41.0,
    }
    ncu = result(
        "fused_decode_profile",
        [
            {**profile, "path": "triton", "stall_barrier": 0.1, "tensor_pipe_pct": None},
            profile,
            {
                "section": "profile",
                "heads": 128,
                "tokens": 131072,
                "path": "wgmma",
                "min_bytes": 1,
                "error": "ncu failed",
            },
        ],
    )
    summary = fused_lab_report.ncu_summary(ncu, "cap")
    points = [p.split(", ") for p in cells(summary, "point")]
    assert points == [[KERNEL_NAMES["triton"], "16 h", "128K"], [KERNEL_NAMES["wgmma"], "16 h", "128K"]]
    assert cells(summary, "stall") == ["wait (0.9)", "barrier (1.8)"]
    assert cells(summary, "tensor_pipe_pct") == ["—", "41"]
    full = fused_lab_report.ncu_table(ncu, "cap")
    assert cells(full, "dram") == ["0.90×", "0.90×"] and cells(full, "l2")[0] == "2.5×"
    assert [r["reason"] for r in fused_lab_report.stall_table(ncu, "cap").rows] == ["wait", "mio throttle", "barrier"]
    spans = fused_lab_report.ncu_ranges(ncu)
    assert spans["launches"] == 2 and spans["paths"] == ["triton", "wgmma"]
    assert spans["dram_pct_of_peak"] == (25.0, 25.0) and spans["tensor_pipe_pct"] == (41.0, 41.0)
    assert spans["achieved_occupancy_pct"] == (12.4, 12.4)
    failed = fused_lab_report.ncu_ranges(result("fused_decode_profile", [ncu.rows[2]]))
    assert failed["launches"] == 0 and failed["dram_pct_of_peak"] is None


def test_the_peer_profile_reads_each_call_by_its_split_and_combine_and_names_whose_metrics_it_shows():
    """``peers`` rows: the split and combine µs come from the call's launches by name, the rates are of the longest
    kernel and the table says which (a combine where it is the longest), a failed row is left out, and the facts the
    chapter quotes are keyed by point and strategy."""

    def peer(strategy, launches, **metrics):
        main = max(launches, key=lambda k: k[1])
        return {
            "section": "peers",
            "heads": 128,
            "context": 32768,
            "batch": 64,
            "strategy": strategy,
            "main_kernel": main[0],
            "launches": [{"kernel": k, "duration_ns": ns} for k, ns in launches],
            "total_duration_ns": float(sum(ns for _, ns in launches)),
            "duration_ns": main[1],
            **metrics,
        }

    prof = result(
        "fused_decode_profile",
        [
            peer(
                "ours",
                [("mla_wgmma_split_kernel<0>", 400_000.0), ("_mla_combine_kernel", 40_000.0)],
                tensor_pipe_pct=49.0,
                l1_throughput_pct=73.0,
                global_ld_requests=1.0e6,
                global_ld_sectors=14.5e6,
                warp_instructions=78.6e6,
                stall_barrier=1.8,
                stall_wait=1.7,
                stall_gmma=0.1,
            ),
            peer(
                "flashmla_dense_bf16",
                [("flash_fwd_splitkv_mla_kernel", 50_000.0), ("flash_fwd_mla_combine_kernel", 60_000.0)],
                tensor_pipe_pct=0.0,
            ),
            {
                "section": "peers",
                "heads": 128,
                "context": 32768,
                "batch": 64,
                "strategy": "flashmla_dense_fp8",
                "error": "ncu failed",
            },
        ],
    )
    table = fused_lab_report.peer_profile_table(prof, "cap")
    assert cells(table, "who") == ["ours", "FM BF16"]
    assert cells(table, "us_parts") == ["440.0 (400.0 + 40.0)", "110.0 (50.0 + 60.0)"]
    assert cells(table, "longest") == ["split", "combine"]
    assert cells(table, "stalls")[0].split(", ") == ["barrier 1.8", "wait 1.7"]
    work = fused_lab_report.peer_work_table(prof, "cap")
    assert cells(work, "sectors")[0] == "14.5" and cells(work, "warp_instructions_m")[0] == "78.6"
    facts = fused_lab_report.peer_profile_facts(prof)
    assert set(facts[128, 32768, 64]) == {"ours", "flashmla_dense_bf16"}
    assert facts[128, 32768, 64]["ours"]["top_stall"] == "barrier"
    assert fused_lab_report.peer_points(prof) == [(128, 32768, 64)]


def test_the_phase_table_holds_each_warpgroup_against_the_tile_floors():
    from kvwall.kernels.mla_decode.wgmma import TRACE_PHASES
    from kvwall.reports.tile_phases_report import TilePhases

    per_tile = {
        "0": dict(zip(TRACE_PHASES[0], (100.0, 2304.0, 700.0, 50.0, 800.0, 600.0))),
        "1": dict(zip(TRACE_PHASES[1], (150.0, 900.0, 80.0, 1200.0, 1800.0))),
    }
    rows = [
        {
            "section": "phases",
            "heads": 128,
            "context": 131072,
            "batch": 8,
            "tokens": 10**6,
            "page_size": 64,
            "us": 100.0,
            "us_traced": 105.0,
            "work_items": 65,
            "ctas": 130,
            "tiles": 1300,
            "per_tile": per_tile,
            "per_cta": {"0": {"query prologue": 9000.0}, "1": {"query prologue": 9000.0, "first tiles": 3000.0}},
        },
        {
            "section": "phases",
            "heads": 16,
            "context": 4096,
            "batch": 1,
            "tokens": 4096,
            "page_size": 64,
            "error": "RuntimeError: no tile",
        },
    ]
    rep = TilePhases(result("fused_decode_profile", rows))
    table, values = rep.table("cap")
    assert len(table.rows) == 1  # the failed trace is not a point
    row = table.rows[0]
    assert row["wg0"] == 4554 and row["wg1"] == 4130 and row["fixed"] == 12000 and row["tiles"] == 10
    assert row["vs_tensor"] == pytest.approx(4554 / 2176) and cells(table, "cost") == ["+5%"]
    assert values["phase_scores_over_floor_min"] == values["phase_scores_over_floor_max"] == 2.0
    assert values["phase_points"] == 1 and values["phase_cycles_min"] == values["phase_cycles_max"] == 4554
    assert values["phase_wait_share_max"] == pytest.approx(230 / 4554)
    assert len(table.columns) <= 8, "the phase table must fit the page"
    fig = rep.figure("cap")
    stacks = {t.name: list(t.x) for t in fig.data}
    assert stacks[f"wg 0: {TRACE_PHASES[0][1]}"] == [2304.0, None]
    assert stacks[f"wg 1: {TRACE_PHASES[1][3]}"] == [None, 1200.0]
    assert TilePhases(result("fused_decode_profile", rows[1:])).table("cap")[1] == {}


# ---------------------------------------------------------------------------------------------- chapter 4


def test_gather_prediction_bytes_and_step():
    before = {"step_ms": 90.0, "cast_op_ms_per_step": 66.0}
    p = gather_report.predict(8192, 65536, copy_gbps=4000.0, before=before, pool_tokens=1000)
    assert p.gather_bytes == gather_cast_bytes(8192) == 8192 * (576 * 3 + 4)
    assert p.full_pool_bytes == full_pool_cast_bytes(GLM5, 1000)["total"]
    per_layer_us = p.gather_bytes / 4000e3
    step = 90.0 - 66.0 + GLM5.num_layers * per_layer_us / 1e3
    assert p.per_layer_us == pytest.approx(per_layer_us) and p.step_ms == pytest.approx(step)
    assert p.time_saved == pytest.approx(1 - step / 90.0)
    assert p.cast_ms_at_copy == pytest.approx(p.full_pool_bytes / 4e9)
    assert (p.per_row, p.row_read, p.row_written, p.index_bytes) == (1732, 576, 1152, 4)
    without = gather_report.predict(8192, 65536)  # no copy bandwidth, no recorded step: no step predicted
    assert without.step_ms is None and without.per_layer_us is None and without.gather_bytes == p.gather_bytes


def test_suite_table_counts_each_implementation():
    case = {"section": "cases", "mismatched_values": 0, "overwritten_poison": 0}
    rows = [
        {**case, "impl": "triton", "nan_inputs": False, "ok": True},
        {**case, "impl": "triton", "nan_inputs": True, "ok": False, "mismatched_values": 3},
        {"section": "full_cast", "ok": True, "shape": [3, 1, 576]},
        {"section": "nvcc", "ok": None, "summary": "no nvcc on this machine"},
    ]
    table = gather_report.suite_table(result("gather_cast_validation", rows), "caption")
    # rows: the cases without and with FP8 NaNs in the pool, full_cast, the nvcc compile (none here)
    assert [re.split("[:,]", r["what"])[0] for r in table.rows] == ["triton", "triton", "full_cast", "nvcc"]
    assert table.rows[1]["what"].startswith(table.rows[0]["what"]) and "NaN" in table.rows[1]["what"]
    assert [fraction(r["passed"]) for r in table.rows[:3]] == [(1, 1), (0, 1), (1, 1)]
    assert table.rows[3]["passed"] == "no nvcc" and table.rows[3]["detail"] == rows[3]["summary"]
    assert re.findall(r"\d+", table.rows[1]["detail"]) == ["3", "0"]  # mismatched, poisoned values overwritten


def test_gather_targets_from_a_small_sweep():
    rows = [
        {"section": "copy", "gbps": 4000.0},
        {"section": "full_pool", "impl": "full_cast (Triton)", "of_copy": 0.95},
        {"section": "full_pool", "impl": "PyTorch pool.to(bf16)", "of_copy": 0.25},
    ]
    for n, kernel_ms, torch_ms in ((4096, 0.007, 0.017), (32768, 0.02, 0.08)):
        for impl, ms in (("gather_cast (Triton)", kernel_ms), (gather_report.TORCH_OP, torch_ms)):
            for layout in (gather_report.RANDOM_SLOTS, "batch 2, mixed lengths"):
                rows.append(
                    {
                        "section": "sweep",
                        "impl": impl,
                        "n": n,
                        "layout": layout,
                        "ms": ms,
                        "gbps": gather_cast_bytes(n) / ms / 1e6,
                        "of_copy": gather_cast_bytes(n) / ms / 4e9,
                    }
                )
    rows.append({"section": "graph", "impl": "gather_cast (Triton)", "n": 4096, "ms": 0.004, "gbps": 1.0})
    bench = result("gather_cast_bench", rows, batch=2, pool_tokens=1000)
    t = gather_report.targets(bench, sizes=(4096, 32768))
    assert t.values["min_speedup_vs_torch_n_ge_32k"] == pytest.approx(4.0)
    assert t.values["us_at_4k"] == pytest.approx(7.0) and t.values["us_at_4k_graph"] == pytest.approx(4.0)
    assert t.values["min_of_copy_n_ge_32k"] == pytest.approx(gather_cast_bytes(32768) / 0.02 / 4e9)
    assert [r["impl"] for r in t.rows[:2]] == ["gather_cast (Triton)", gather_report.TORCH_OP]
    assert t.rows[1]["vs_torch"] == pytest.approx(1.0) and t.rows[0]["vs_torch"] == pytest.approx(0.017 / 0.007)
    assert gather_report.of_copy(bench, 32768) == t.values["min_of_copy_n_ge_32k"]


def _strategy(name: str, graph_step: float | None, **extra: Any) -> dict[str, Any]:
    return {
        "section": "strategies",
        "strategy": name,
        "name": name,
        "layers": 2,
        "step_ms": 100.0,
        "kv_strategy_ms_per_step": 60.0,
        "graph_step_ms": graph_step,
        "graph_kv_ms_per_step": 60.0,
        "rel_err_vs_float64": 1e-3,
        **extra,
    }


def test_capacity_gain_is_the_before_step_with_the_measured_kv_time():
    rows = [
        _strategy("full_pool_cast", 90.0),
        {"section": "capacity", "strategy": "index_then_cast_capacity", "capacity": 1000, "ms_per_layer": 3.0},
        {"section": "capacity", "strategy": "index_then_cast_capacity", "capacity": 9000, "ms_per_layer": 25.0},
        {"section": "capacity", "strategy": "gather_cast_capacity", "capacity": 1000, "ms_per_layer": 1.0},
    ]
    profile = result("gather_cast_profile", rows, context_lens=[500])
    gain = gather_step_report.capacity_gain(profile)
    saved = {(r["strategy"], r["capacity"]): r["time_saved"] for r in gain}
    # rest of the graph step: 90 - 60 = 30 ms; 2 layers at the measured per-layer time.
    assert saved[("index_then_cast_capacity", 1000)] == pytest.approx(1 - (30 + 6) / 90)
    assert saved[("index_then_cast_capacity", 9000)] == pytest.approx(1 - (30 + 50) / 90)
    assert saved[("gather_cast_capacity", 1000)] == pytest.approx(1 - 32 / 90)
    # Both readings of the original's figure (29 % saved; a 1.29x speed-up: 22.5 % saved) lie between the two
    # measured capacities: the capacity that saves each, linear between them, is what the chapter names.
    readings = gather_step_report.capacity_readings(gain)
    for key, saved in (
        ("time_saved", ORIGINAL.gain_as_time_saved["time_saved"]),
        ("speedup", ORIGINAL.gain_as_speedup["time_saved"]),
    ):
        t = (saved - (1 - 36 / 90)) / ((1 - 80 / 90) - (1 - 36 / 90))
        assert readings[key]["capacity"] == pytest.approx(1000 + t * 8000) and readings[key]["saved"] == saved
        assert (readings[key]["a"]["capacity"], readings[key]["b"]["capacity"]) == (1000, 9000)
        capacity, _, _ = gather_step_report.capacity_for(
            [r for r in gain if r["strategy"] == "index_then_cast_capacity"], saved
        )
        step = 30 + 2 * (3.0 + (capacity - 1000) * 22.0 / 8000)  # the step at that capacity, from the rows
        assert 1 - step / 90 == pytest.approx(saved)
    assert ORIGINAL.reported_gather_cast_gain == pytest.approx(0.29, abs=0.01)
    assert ORIGINAL.gain_as_time_saved["speedup"] == pytest.approx(1 / 0.71)
    assert ORIGINAL.gain_as_speedup["time_saved"] == pytest.approx(1 - 1 / 1.29)


def test_the_original_share_is_computed_from_its_times():
    assert ORIGINAL.reported_cast_share == 0.69
    assert ORIGINAL.cast_share_of_step == pytest.approx(64.6 / 86)
    assert f"{ORIGINAL.cast_share_of_step:.1%}" == "75.1%"  # what chapter 1 shows beside the reported 69 %


def test_gains_and_the_stall_story():
    rows = [_strategy("full_pool_cast", None), {"section": "gain", "strategy": "full_pool_cast", "time_saved": 0.0}]
    profile = result("gather_cast_profile", rows)
    assert gather_step_report.gain_rows(profile)[0]["name"] == "full_pool_cast"
    assert gather_step_report.stalls(profile) is None  # no graph step, no marked steps
    assert gather_step_report.closing(profile) is None and gather_step_report.host_summary(profile) is None


# ---------------------------------------------------------------------------------------------- chapter 1


def _step(step_ms: float, cast_ms: float, profiled_ms: float | None = None) -> dict[str, Any]:
    return {
        "section": "summary",
        "step_ms": step_ms,
        "cast_op_ms_per_step": cast_ms,
        "profiled_step_ms": profiled_ms,
        "cast_share": cast_ms / (profiled_ms or step_ms),
        "cast_bytes_per_layer": full_pool_cast_bytes(GLM5, 1000)["total"],
        "device_kind": "cpu",
    }


def _phases(cast_ms: float, rest_ms: float) -> list[dict[str, Any]]:
    return [
        {"section": "breakdown", "phase": "kv_strategy", "ms_per_step": cast_ms},
        {"section": "breakdown", "phase": "attention", "ms_per_step": rest_ms},
        {"section": "step", "step": 0, "ms": cast_ms + rest_ms},
    ]


def test_profile_tables_take_shares_of_the_same_steps():
    ops = [
        {"section": "ops", "name": "aten::copy_", "calls_per_step": 2.0, "ms_per_step": 8.0},
        {"section": "ops", "name": "aten::mm", "calls_per_step": 4.0, "ms_per_step": 1.0},
    ]
    live = result("decode_profile", [_step(10.0, 8.0, profiled_ms=16.0), *ops, *_phases(7.0, 3.0)], profile_steps=2)
    # the profiler's times over the profiled steps' own clock, never over the phase-clocked step
    assert [r["share"] for r in profile_report.ranked(live, "ops", 8)] == [0.5, 1 / 16]
    assert [r["name"] for r in profile_report.ranked(live, "ops", 1)] == ["aten::copy_"]
    shares = profile_report.step_shares(live)
    assert shares.profiler_share == 0.5 and shares.profiler_step_ms == 16.0 and shares.copy_ms == 8.0
    assert shares.phase_share == pytest.approx(0.7) and shares.phase_step_ms == 10.0 and shares.phase_cast_ms == 7.0
    assert shares.copy_calls == 2.0 and shares.timed_steps == 1 and shares.profiled_steps == 2
    old = result("decode_profile", [_step(10.0, 8.0), *ops, *_phases(7.0, 3.0)])  # recorded before the clock
    assert [r["share"] for r in profile_report.ranked(old, "ops", 8)] == [None, None]
    old_shares = profile_report.step_shares(old)
    assert old_shares.profiler_share is None and old_shares.profiler_step_ms is None
    assert old_shares.phase_share == pytest.approx(0.7)  # the phase clock needs no profiled steps


def test_cast_rate_against_the_copy_and_the_integer_cast():
    rows = [
        {"section": "device_copy", "gbps": 4000.0},
        {"section": "copies", "copy": "fp8 -> bf16", "kernel": "unrolled_elementwise_kernel", "gbps": 1000.0},
        {"section": "copies", "copy": "int8 -> int16", "kernel": "unrolled_elementwise_kernel", "gbps": 2000.0},
    ]
    kernels = result("cast_kernels", rows)
    copies, ceiling = profile_report.copy_rows(kernels)
    assert ceiling == 4000.0 and [r["of_copy"] for r in copies] == [0.25, 0.5]
    rate = profile_report.cast_rate(kernels)
    assert (rate.cast_gbps, rate.cast_of_copy, rate.integer_of_copy, rate.cast_of_integer) == (1000.0, 0.25, 0.5, 0.5)
    assert rate.integer_kernel == "unrolled_elementwise_kernel"
    # the original's rate: its MB per layer over all layers, in its cast time
    original = ORIGINAL.cast_mb_per_layer * 1e6 * GLM5.num_layers / (ORIGINAL.cast_ms * 1e-3) / 1e9
    assert rate.original_gbps == pytest.approx(original) and rate.original_over_cast == pytest.approx(original / 1000)


def test_the_sweep_compares_the_pool_cast_with_the_longest_request():
    cast = [{"pool_tokens": 1000, "ms": 0.5}, {"pool_tokens": ORIGINAL.pool_tokens, "ms": 0.8}]
    attention = [{"context_len": 131072, "ms": 0.2}, {"context_len": 1024, "ms": 0.01}]
    compared = profile_report.sweep_comparison(cast, attention)
    assert (compared.pool_tokens, compared.pool_cast_ms) == (ORIGINAL.pool_tokens, 0.8)
    assert (compared.longest_context, compared.longest_attention_ms) == (131072, 0.2)
    assert compared.cast_over_attention == pytest.approx(4.0)


# ---------------------------------------------------------------------------------------------- source


def test_every_source_a_chapter_shows_exists():
    """Every ``{literalinclude}`` of a ``:pyobject:`` (its path relative to book/) names an object its file defines,
    as Sphinx's literalinclude finds it (``sphinx.pycode.ModuleAnalyzer``)."""
    from sphinx.pycode import ModuleAnalyzer

    shown = [
        (path, name)
        for page in CHAPTERS
        for path, name in re.findall(
            r"```\{literalinclude\} (\S+)\n(?::[a-z-]+:.*\n)*?:pyobject: (\w+)", page.read_text()
        )
    ]
    assert {path for path, _ in shown} >= {"../kernels/mla_decode/work_list.py", "../kernels/gather/kernel.py"}
    for path, name in shown:
        assert name in ModuleAnalyzer.for_file(str(BOOK / path), "").find_tags(), f"{path} defines no {name}"


def test_live_profile_params_fit_the_pool():
    small = {"capacity": 4096, "capacity_sweep": [2048, 8192, 60000]}
    params = gather_step_report.live_profile_params({"pool_tokens": 6000, "layers": 1, "context_len": 700}, small)
    assert params == {
        "pool_tokens": 6000,
        "layers": 1,
        "context_lens": [700],
        "capacity": 4096,
        "capacity_sweep": [2048],
    }
    assert (
        gather_step_report.live_profile_params({"pool_tokens": 3000, "layers": 1, "context_len": 5000}, small)[
            "capacity"
        ]
        == 3000
    )


def test_floor_ranges_each_kernels_fixed_cost():
    paths = _paths()
    assert fused_lab_report.floor_ranges(paths) == {"triton": (10.0, 10.0), "wgmma": (9.0, 9.0)}
    assert point_label((16, 64, 1)).split(", ") == ["16 h", "64 tokens", "b1"]  # under 1K: in tokens
    assert point_label((16, 131072, 8)).split(", ") == ["16 h", "128K", "b8"]


def test_worst_errors_take_the_worst_checked_output():
    worst = fused_bench_report.worst_errors(_grid(), _paths())
    assert worst == {"ours": 1.7e-3, "flashmla_dense_bf16": 1.7e-3, "flashmla_dense_fp8": 2.8e-2}
    # the synthetic paths rows carry no error: no path is named


def test_breakable_leaves_inline_code_exactly_as_it_is():
    """A path or a command in a table cell must copy as that path: inline code gets no zero-width spaces (the book's
    CSS wraps it); a long plain word does."""
    from kvwall.reports.tables import breakable

    code, long_path, short = (
        "`book/results/decode_profile.json` read",
        "flashinfer/mla/_core.py:4498 is long",
        "short words 12,345",
    )
    assert breakable(code) == code and breakable(short) == short
    assert "\u200b" in breakable(long_path) and breakable(long_path).replace("\u200b", "") == long_path

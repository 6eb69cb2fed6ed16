"""Chapter 5 under papermill with CPU parameters: the live validation in Triton's interpreter, and every number it
shows from the recorded H200 runs equal to the result files'."""

import pytest

import kvwall.experiments  # noqa: F401 - registers the row schemas load_result validates against
from conftest import BOOK, run_chapter
from kvwall.results import load_result

pytestmark = pytest.mark.slow


def test_chapter_5_on_cpu(tmp_path):
    rec = run_chapter(BOOK / "05_fused_fp8_decode.md", tmp_path, mode="cpu")
    v = rec["values"]
    assert rec["mode"] == "cpu" and rec["scale"] == "small"
    assert rec["duration_s"] < 180, "chapter 5 must run in 3 minutes on a 2-core CPU"
    assert v["live_validation_passed"] is True
    assert {u["experiment"] for u in rec["recorded_used"]} == {"fused_decode_tuning", "fused_decode_validation",
                                                             "fused_decode_bench", "fused_decode_ncu",
                                                             "fused_decode_cuda"}
    assert not any(u["stale"] for u in rec["recorded_used"])
    validation = load_result("fused_decode_validation").table("cases")
    assert v["recorded_validation_cases"] == len(validation)
    assert v["recorded_validation_passed"] == sum(bool(r["passed"]) for r in validation)
    bench = {(r["strategy"], r["heads"], r["context"], r["batch"]): r
             for r in load_result("fused_decode_bench").table("bench")}
    point = bench[("fused_fp8", 16, 131072, 1)]
    assert v["us_b1_16h_128k"] == point["us"] and v["roofline_us_b1_16h_128k"] == point["roofline_us"]
    points = {k[1:] for k in bench}
    assert v["points"] == len(points)
    both = [p for p in points if bench.get(("fused_fp8", *p), {}).get("us")
            and bench.get(("flashmla_dense_bf16", *p), {}).get("us")]
    assert v["flashmla_bf16_points"] == len(both)
    assert v["faster_than_flashmla_bf16"] == sum(bench[("fused_fp8", *p)]["us"] < bench[("flashmla_dense_bf16", *p)]["us"]
                                                 for p in both)
    paged = [bench[("fused_fp8", *p)]["us"] / bench[("fused_fp8_page64", *p)]["us"] for p in points
             if bench.get(("fused_fp8_page64", *p), {}).get("us") and bench.get(("fused_fp8", *p), {}).get("us")]
    assert v["page1_over_page64_min"] == min(paged) and v["page1_over_page64_max"] == max(paged)
    ratios = [r["ratio"] for r in validation if r.get("ratio") is not None and (r.get("bf16_rel_err") or 0) > 0]
    assert v["max_ratio_to_bf16_path"] == max(ratios)
    assert 0 <= v["targets_met"] <= 6
    # The CUDA C++ path's section: its counts recomputed from the result file.
    cuda = load_result("fused_decode_cuda")
    default = next(r for r in cuda.rows if r["section"] == "build")["default_variant"]
    us = {}
    for r in cuda.table("bench"):
        us.setdefault((r["heads"], r["context"], r["batch"]), {})[r["strategy"]] = r["us"]
    grid = {k: u for k, u in us.items() if k[1] in cuda.params["contexts"]}
    mine = f"cuda_v{default}"
    assert v["cuda_points"] == len(grid) == 36
    assert v["cuda_faster_than_triton"] == sum(u[mine] < u["fused_fp8_page64"] for u in grid.values())
    assert v["cuda_faster_than_flashmla_bf16"] == sum(u[mine] < u["flashmla_dense_bf16"] for u in grid.values())
    assert v["cuda_faster_than_flashmla_fp8"] == sum(u[mine] < u["flashmla_dense_fp8"] for u in grid.values())
    assert v["cuda_16h_128k_us"] == us[(16, 131072, 1)][mine]
    assert v["cuda_16h_floor_us"] == us[(16, cuda.params["floor_contexts"][0], 1)][mine]
    # The wgmma path's summary at the top of the chapter: its counts recomputed from the result file.
    wg = {k: u for k, u in grid.items() if u.get("cuda_wgmma")}
    assert v["wgmma_points"] == len(wg) == 36
    assert v["wgmma_faster_than_fm_bf16_16h"] == sum(u["cuda_wgmma"] < u["flashmla_dense_bf16"]
                                                     for k, u in wg.items() if k[0] == 16)
    assert v["wgmma_faster_than_fm_bf16_64_128h"] == sum(u["cuda_wgmma"] < u["flashmla_dense_bf16"]
                                                         for k, u in wg.items() if k[0] in (64, 128))
    assert v["wgmma_faster_than_fm_fp8"] == sum(u["cuda_wgmma"] < u["flashmla_dense_fp8"] for u in wg.values())
    assert v["wgmma_worst_vs_fm_bf16"] == min(u["flashmla_dense_bf16"] / u["cuda_wgmma"]
                                              for k, u in wg.items() if k[0] in (64, 128))
    checks = [r for r in cuda.table("validation") if r["variant"] == "wgmma"]
    assert v["wgmma_validation_runs"] == len(checks) > 0
    assert v["wgmma_validation_passed"] == sum(bool(r["ok"]) for r in checks)

"""Chapter 5 and its lab page under papermill with CPU parameters: the live validation in Triton's interpreter, and
every count the pages quote from the recorded H200 runs recomputed here from the result files (and the dispatcher's
shipped table checked against the run it was derived from)."""

import json
import math

import pytest

from kvwall.results import awaiting_rerecord

import kvwall.experiments  # noqa: F401 - registers the row schemas load_result validates against
from conftest import BOOK
from kvwall.experiments.fused_decode.kernel_paths import PATHS_FILE, path_points
from kvwall.kernels.mla_decode.dispatch import KERNEL_PATHS
from kvwall.results import load_result

pytestmark = pytest.mark.slow

CHAPTER5_RESULTS = {
    "fused_decode_tuning",
    "fused_decode_paths",
    "fused_decode_validation",
    "fused_decode_bench",
    "fused_decode_profile",
}


def _us(rows, strategy, point):
    r = rows.get((strategy, *point))
    return r["us"] if r and r.get("us") else None


def test_chapter_5_on_cpu(executed):
    rec = executed(BOOK / "05_fused_fp8_decode.md")
    v = rec["values"]
    assert rec["mode"] == "cpu" and rec["scale"] == "small"
    assert rec["duration_s"] < 180, "chapter 5 must run in 3 minutes on a 2-core CPU"
    assert v["live_validation_passed"] is True
    assert {u["experiment"] for u in rec["recorded_used"]} == CHAPTER5_RESULTS | {"multi_token_decode"}
    awaiting = awaiting_rerecord()  # stale, listed with the reason, shown with the STALE warning
    assert not any(u["stale"] and u["experiment"] not in awaiting for u in rec["recorded_used"])
    # The lead: every count recomputed from the benchmark's rows.
    bench = {
        (r["strategy"], r["heads"], r["context"], r["batch"]): r
        for r in load_result("fused_decode_bench").table("bench")
    }
    params = load_result("fused_decode_bench").params
    floors = set(params.get("floor_contexts") or [])  # one short request per head count: fixed costs, not the grid
    points = sorted({k[1:] for k in bench if _us(bench, "ours", k[1:]) and k[2] not in floors})
    assert v["grid_points"] == len(points) == len(params["heads"]) * len(params["contexts"]) * len(params["batches"])
    for peer in ("flashmla_dense_fp8", "flashmla_dense_bf16", "sglang_triton_fp8"):
        both = [p for p in points if _us(bench, peer, p)]
        assert v[f"{peer}_points"] == len(both)
        assert v[f"{peer}_faster_than_ours"] == sum(_us(bench, peer, p) < _us(bench, "ours", p) for p in both)
    fi = {
        p: min(
            u
            for s in ("flashinfer_fp8_fa2", "flashinfer_fp8_fa3", "flashinfer_bf16_precast")
            if (u := _us(bench, s, p))
        )
        for p in points
    }
    assert v["flashinfer_faster_than_ours"] == sum(fi[p] < _us(bench, "ours", p) for p in points)
    assert v["ours_faster_than_fm_fp8"] == sum(
        _us(bench, "ours", p) < _us(bench, "flashmla_dense_fp8", p)
        for p in points
        if _us(bench, "flashmla_dense_fp8", p)
    )
    h16 = [p for p in points if p[0] == 16 and _us(bench, "flashmla_dense_bf16", p)]
    assert v["by_heads"]["h16"]["vs_fm_bf16_geomean"] == pytest.approx(
        math.exp(sum(math.log(_us(bench, "flashmla_dense_bf16", p) / _us(bench, "ours", p)) for p in h16) / len(h16))
    )
    assert v["by_heads"]["h16"]["paths"] == {
        k: sum(bench[("ours", *p)]["kernel_path"] == k for p in points if p[0] == 16)
        for k in v["by_heads"]["h16"]["paths"]
    }
    # The dispatcher: the shipped kernel_paths.json is the one derived from the recorded paths run,
    # and the counts match.
    paths = load_result("fused_decode_paths")
    build = next(r for r in paths.rows if r["section"] == "build")
    shipped = json.loads(PATHS_FILE.read_text())[build["gpu"]]["points"]
    derived = [path_points(paths)]
    if "fused_decode_paths" in awaiting_rerecord():
        # awaiting its re-record, the recorded run may still stand behind a table the earlier rule (page 1 alone) wrote
        derived.append(path_points(paths, other_pages=False))
    assert shipped in derived, "kernel_paths.json is not the table derived from fused_decode_paths"
    grid_picks = [p for p in derived[0] if p[1] not in paths.params["floor_contexts"]]  # the chapter's: the run's
    assert v["dispatch_points"] == len(grid_picks)
    assert v["dispatch_wgmma"] == sum(p[3] == "wgmma" for p in grid_picks)
    assert v.get("dispatch_wgmma_tokens", 0) == sum(p[3] == "wgmma_tokens" for p in grid_picks)
    # Accuracy: the benchmark's check of every output, and the recorded case table.
    assert v["ours_worst_rel_err"] == max(
        r["rel_err_f64"] for r in bench.values() if r["strategy"] == "ours" and r.get("rel_err_f64")
    )
    cases = load_result("fused_decode_validation").table("cases")
    assert v["recorded_validation_cases"] == len(cases)
    assert v["recorded_validation_passed"] == sum(bool(r["passed"]) for r in cases)
    for path in {r.get("path") or "triton" for r in cases}:  # rows without a path ran the Triton path
        ratios = [
            r["ratio"]
            for r in cases
            if (r.get("path") or "triton") == path and r.get("ratio") is not None and (r.get("bf16_rel_err") or 0) > 0
        ]
        if ratios:
            assert v[f"{path}_ratio_max"] == max(ratios)


def test_chapter_5_lab_page_on_cpu(executed):
    toc = (BOOK.parent / "_toc.yml").read_text()
    assert "book/05a_fused_decode_lab" in toc, "the lab page must be in the table of contents"
    assert "{doc}`05a_fused_decode_lab`" in (BOOK / "05_fused_fp8_decode.md").read_text(), "chapter 5 must link it"
    rec = executed(BOOK / "05a_fused_decode_lab.md")
    assert rec["duration_s"] < 180
    assert {u["experiment"] for u in rec["recorded_used"]} == CHAPTER5_RESULTS
    v = rec["values"]
    paths = load_result("fused_decode_paths")
    assert sum(v["dispatch"].get(f"dispatch_{k}", 0) for k in KERNEL_PATHS) == v["dispatch"]["dispatch_points"]
    assert v["dispatch"]["dispatch_points"] == len(
        [p for p in path_points(paths) if p[1] not in paths.params["floor_contexts"]]
    )
    traced = [r for r in load_result("fused_decode_profile").rows if r["section"] == "phases" and r.get("per_tile")]
    if traced:
        assert v["phases"]["phase_points"] == len(traced)

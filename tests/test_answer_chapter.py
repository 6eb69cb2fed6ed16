"""Chapter 6 runs on a CPU under papermill, within three minutes, and computes what its text says; its decision
table is the front page's (the same rows from the same recorded results)."""

import json
import shutil

import pytest

from conftest import BOOK
from kvwall.kernels.mla_decode import wgmma, wgmma_tokens
from kvwall.model.cost import TRANSFER_RULES
from kvwall.model.step_paths import PATH_INFO
from kvwall.reports.original_gpu_report import build_label
from kvwall.tuning.arch_check_cuda import TOKENS_KERNEL
import kvwall.experiments  # noqa: F401  (registers the row schemas)
from kvwall.reports import decision

pytestmark = pytest.mark.slow


def test_chapter_6_on_cpu(executed):
    rec = executed(BOOK / "06_the_answer.md")
    v = rec["values"]
    assert rec["mode"] == "cpu" and rec["duration_s"] < 180, "chapter 6 must run in 3 minutes on a 2-core CPU"
    assert v["live_paths"] == [p for p, info in PATH_INFO.items() if not info.gpu_only]
    assert v["live_fused_kernels"] == {"triton": 1}, "on a CPU the dispatcher runs the Triton path"
    assert sum(v["recorded_fused_kernels"]["step"].values()) == 1 and v["recorded_fused_kernels"]["sweep"]
    steps = v["recorded_step_ms"]
    assert steps["full_pool_cast"] > 3 * max(ms for p, ms in steps.items() if p != "full_pool_cast")
    assert v["model_held_out"] > 50 and v["model_median_abs_err"] < 0.15
    assert "full_pool_cast_fa2" in v["sm120_paths"] and not any("fa3" in p or "flashmla" in p for p in v["sm120_paths"])
    peak, per_sm = TRANSFER_RULES  # the cast on SM120: the per-SM rate predicts it faster than the fraction of peak
    assert v["sm120_cast_ms"][per_sm] < v["sm120_cast_ms"][peak]
    # The offline check's wgmma builds (nvcc for sm_90a): the heads-on-M kernel and each tokens-on-M instantiation,
    # each with its registers, no spill, no stack, within an H100 / H200 block's shared memory.
    if shutil.which("nvcc"):
        built = v["wgmma_builds"]
        assert set(built) == {f"wgmma:{wgmma.HEADS_PER_CTA}"} | {f"wgmma_tokens:{hn}" for hn in (16, 32)}
        assert all(b["regs"] and b["spills"] == 0 and b["stack_bytes"] == 0 and b["fits"] for b in built.values()), (
            built
        )
        assert built["wgmma_tokens:32"]["shared_bytes"] == wgmma_tokens.smem_bytes(32)
        tokens_32 = build_label({"kernel": TOKENS_KERNEL, "heads": None, "heads_per_cta": 32})
        assert v["arch_fits"][f"{tokens_32}:sm_90a"] is True
    assert {u["experiment"] for u in rec["recorded_used"]} >= {
        "decode_step_paths",
        "path_sweep",
        "sglang_patch_check",
        "fused_decode_bench",
        "fused_decode_validation",
        "doors_checks",
        "doors_sm90",
    }
    # The SGLang patch section reads the recorded check inside SGLang's real modules: no patched row casts the pool.
    pr = v["patch_real"]
    assert (
        pr["rows"] > 0
        and pr["patched_casts"] == [0]
        and pr["modes"] == ["decode", "draft_extend", "prefill", "verify_2", "verify_4"]
    )
    assert pr["speedup"]["fused"] > 1 and pr["speedup"]["gather_cast"] > 1
    # The front page computes its table with the same function from the same files: the same rows.
    ev = decision.Evidence.load()
    front = [json.loads(json.dumps(d.as_dict(), default=list)) for d in decision.decide(ev)]
    assert json.loads(json.dumps(v["decision"], default=list)) == front

"""The dispatcher between the Triton and CUDA paths of the fused FP8 MLA decode (kvwall.kernels.mla_decode.dispatch),
and its measured table (kernels/mla_decode/paths.json, derived from the recorded fused_decode_cuda result)."""

from __future__ import annotations

import json

import pytest
import torch

import kvwall.experiments  # noqa: F401  (registers the row schemas)
from kvwall.experiments.fused_decode.paths import path_points, path_table
from kvwall.kernels.mla_decode import cuda as cuda_path
from kvwall.kernels.mla_decode.cases import SM_SCALE
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode.dispatch import (PATHS_FILE, choose_path, measured_choice, mla_decode,
                                                plan_mla_decode_auto)
from kvwall.kernels.mla_decode.kernel import MLADecodePlan, mla_decode_fp8
from kvwall.kernels.mla_decode.reference import make_mla_inputs
from kvwall.results import load_result


def test_the_path_table_is_the_recorded_results():
    """paths.json says what the recorded fused_decode_cuda result says (re-recording without --write fails here)."""
    result = load_result("fused_decode_cuda")
    table = json.loads(PATHS_FILE.read_text())
    (gpu, entry), = path_table(result).items()
    assert table[gpu]["points"] == entry["points"] == path_points(result)
    assert table[gpu]["variant"] == cuda_path.DEFAULT_VARIANT
    for h, c, b, path, cuda_us, triton_us, wgmma_us in entry["points"]:
        timed = {"cuda": cuda_us, "triton": triton_us, "wgmma": wgmma_us}
        assert path == min((p for p in timed if timed[p]), key=lambda p: timed[p])


def test_measured_choice_takes_the_nearest_point_in_log_scale():
    table = {"points": [[16, 4096, 1, "triton", 18.0, 15.0], [16, 131072, 64, "cuda", 600.0, 620.0],
                        [128, 32768, 32, "cuda", 600.0, 700.0]]}
    assert measured_choice(table, 16, 1, 3000)[0] == "triton"
    assert measured_choice(table, 16, 48, 100_000)[0] == "cuda"
    assert measured_choice(table, 100, 40, 40_000)[1][0] == 128
    assert measured_choice({}, 16, 1, 1) is None


def test_where_the_measured_winner_cannot_run_the_faster_of_the_rest_is_taken():
    table = {"points": [[128, 131072, 8, "wgmma", 650.0, 750.0, 350.0], [16, 4096, 1, "triton", 18.0, 15.0, None]]}
    assert measured_choice(table, 128, 8, 131072)[0] == "wgmma"
    assert measured_choice(table, 128, 8, 131072, ("triton", "cuda"))[0] == "cuda"
    assert measured_choice(table, 128, 8, 131072, ("triton",))[0] == "triton"
    assert measured_choice(table, 16, 1, 4096)[0] == "triton"  # a point without a wgmma time


def test_on_cpu_the_dispatcher_runs_the_triton_path():
    path, why = choose_path(16, 1, 131072, torch.device("cpu"))
    assert path == "triton" and "cannot run" in why
    inp = make_mla_inputs([7, 65, 0], 3, seed=5, layout="pool_view", pool_slots=512, device="cpu")
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    plan = plan_mla_decode_auto(inp.kv_indptr, heads=3)
    assert type(plan) is MLADecodePlan
    got = mla_decode(*args, plan=plan)
    want = mla_decode_fp8(*args, plan=plan)
    assert torch.equal(got, want)
    assert torch.equal(mla_decode(*args), want)


def test_forcing_the_cuda_path_on_cpu_is_refused_with_a_clear_error():
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    with pytest.raises(ValueError, match="mla_decode_fp8_cuda: the CUDA path cannot run here"):
        mla_decode(*args, path="cuda")
    with pytest.raises(ValueError, match="path must be"):
        mla_decode(*args, path="fast")
    cuda_plan = cuda_path.plan_mla_decode_cuda(inp.kv_indptr, heads=16)
    with pytest.raises(ValueError, match="the plan is for the cuda path"):
        mla_decode(*args, plan=cuda_plan, path="triton")
    with pytest.raises(ValueError, match="mla_decode_fp8_wgmma: the CUDA path cannot run here: tensors are on cpu"):
        mla_decode(*args, path="wgmma")
    wgmma_plan = wgmma_path.plan_mla_decode_wgmma(inp.kv_indptr, heads=16)
    with pytest.raises(ValueError, match="the plan is for the wgmma path"):
        mla_decode(*args, plan=wgmma_plan, path="cuda")


@pytest.mark.parametrize("q,kind,words", [
    (lambda q: q[:0], ValueError, r"q_nope has shape \(0, 3, 512\): an empty batch"),
    (lambda q: q.tolist(), TypeError, "q_nope must be a torch.Tensor, got list"),
    (lambda q: q[0], ValueError, r"q_nope has shape \(3, 512\); expected \[batch, heads, dim\]"),
])
def test_dispatch_refuses_a_bad_query_in_words(q, kind, words):
    """Issue 24, finding 4: batch 0, a list or a 2-D q_nope is refused by name before the path is chosen (no
    ZeroDivisionError, AttributeError or unpacking ValueError from the max_len estimate)."""
    inp = make_mla_inputs([7, 65], 3, seed=5, layout="pool_view", pool_slots=512, device="cpu")
    with pytest.raises(kind, match=f"^mla_decode: {words}"):
        mla_decode(q(inp.q_nope), inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    with pytest.raises(TypeError, match="^mla_decode: kv_indices must be a torch.Tensor"):
        mla_decode(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, [0, 1], SM_SCALE)

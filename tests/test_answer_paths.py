"""Chapter 6's fused path runs the kernel the dispatcher picks (kvwall.kernels.mla_decode.dispatch), on the step
(kvwall.model.paths) and in the sweep (kvwall.experiments.answer.sweep), and says which one ran; the chapter's
report and the cost model read both the rows recorded before that (no kernel_path: the Triton kernel) and after."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvwall.experiments  # noqa: F401 - registers the row schemas
from conftest import _interpreter_gap
from kvwall.experiments.answer import sweep
from kvwall.experiments.fused_decode.bench_strategies import make_point
from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode.cuda import CudaPlan
from kvwall.kernels.mla_decode.kernel import MLADecodePlan, mla_decode_fp8
from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache
from kvwall.kernels.mla_decode.wgmma import WgmmaPlan
from kvwall.model.cost import GPUS, PATHS, ComponentFit, CostModel, Point, paths_on
from kvwall.model.geometry import GLM5
from kvwall.model.paths import KERNEL_NAMES, build_step_path, kernel_that_ran, kernels_that_ran
from kvwall.model.pool import TokenPool, make_decode_batch
from kvwall.notebook import answer_report
from kvwall.results import RowSchemaError, load_result, validate_rows

CPU = torch.device("cpu")
GEOMETRY = GLM5.with_tensor_parallel(4)  # 16 heads per GPU, as the step
#: Tests that run the Triton kernel on CPU tensors (Triton's interpreter).
interpreted = pytest.mark.skipif(bool(_interpreter_gap()), reason=_interpreter_gap() or "the interpreter runs")


@pytest.fixture(scope="module")
def step_inputs():
    pool = TokenPool.random(GEOMETRY, 4001, 1, device=CPU, seed=3)
    return pool, make_decode_batch([150, 70], pool.num_slots, seed=3, device=CPU)


def _queries(batch, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    heads, dc, dr = GEOMETRY.heads_per_gpu, GEOMETRY.kv_lora_rank, GEOMETRY.qk_rope_head_dim
    return ((torch.randn(batch.batch_size, heads, dc, generator=gen) * 0.5).to(torch.bfloat16),
            (torch.randn(batch.batch_size, heads, dr, generator=gen) * 0.5).to(torch.bfloat16))


def _choose(path: str):
    return lambda *args, **kwargs: (path, f"{path}: chosen by the test")


@interpreted
def test_on_cpu_the_steps_fused_path_runs_and_reports_the_triton_kernel(step_inputs):
    pool, batch = step_inputs
    _, attention, info = build_step_path("fused_fp8", pool, batch, bf16_backend="fa2")
    assert info["backend"] == info["kernel_path"] == "triton" and "cannot run" in info["why"]
    assert type(attention.kernel.plan) is MLADecodePlan and "triton path" in attention.name
    q_nope, q_pe = _queries(batch)
    ckv, kpe = split_latent_cache(pool.key_buffer(0), GEOMETRY.kv_lora_rank)
    first = attention(q_nope, q_pe, ckv, kpe).clone()
    again = attention(q_nope, q_pe, ckv, kpe)  # unchecked, the same plan and launch shape
    ref = mla_decode_reference(q_nope, q_pe, ckv, kpe, batch.kv_indptr, batch.kv_indices, GEOMETRY.sm_scale,
                               compute_dtype=torch.float64)
    assert torch.equal(first, again)
    assert (first.double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("path, plan_type", [("cuda", CudaPlan), ("wgmma", WgmmaPlan)])
def test_the_steps_fused_path_plans_and_calls_the_kernel_the_dispatcher_chooses(step_inputs, monkeypatch, path,
                                                                                 plan_type):
    pool, batch = step_inputs
    monkeypatch.setattr(dispatch, "choose_path", _choose(path))
    _, attention, info = build_step_path("fused_fp8", pool, batch, bf16_backend="fa2")
    assert type(attention.kernel.plan) is plan_type
    assert info["backend"] == info["kernel_path"] == path and info["why"] == f"{path}: chosen by the test"
    assert f"{path} path" in attention.name
    calls = []
    monkeypatch.setattr(dispatch, "mla_decode", lambda *args, **kwargs: calls.append(kwargs) or attention.out)
    q_nope, q_pe = _queries(batch)
    ckv, kpe = split_latent_cache(pool.key_buffer(0), GEOMETRY.kv_lora_rank)
    for _ in range(3):
        attention(q_nope, q_pe, ckv, kpe)
    # One plan made outside the calls, only the first call checked (the rest CUDA-graph capturable), no Triton
    # launch shape for a CUDA C++ kernel.
    assert [c["check_range"] for c in calls] == [True, False, False]
    assert all(c["plan"] is attention.kernel.plan and c["out"] is attention.out and "config" not in c for c in calls)


def test_a_cuda_plan_reaches_the_cuda_path(step_inputs, monkeypatch):
    """Nothing between the step and the dispatcher falls back to Triton: on a CPU the CUDA path refuses."""
    pool, batch = step_inputs
    monkeypatch.setattr(dispatch, "choose_path", _choose("cuda"))
    _, attention, _ = build_step_path("fused_fp8", pool, batch, bf16_backend="fa2")
    ckv, kpe = split_latent_cache(pool.key_buffer(0), GEOMETRY.kv_lora_rank)
    with pytest.raises(ValueError, match="mla_decode_fp8_cuda: the CUDA path cannot run here"):
        attention(*_queries(batch), ckv, kpe)


@pytest.fixture(scope="module")
def sweep_point():
    pool = (torch.randn(2048, 1, GLM5.kv_dim, generator=torch.Generator().manual_seed(4)) * 0.7).to(
        torch.float8_e4m3fn)
    pt = make_point(16, 200, 1, pool_slots=2048, max_total=2047, gen=torch.Generator().manual_seed(4), seed=4,
                    device=CPU)
    return pt, pool


@interpreted
def test_the_sweeps_fused_path_runs_the_dispatchers_kernel_and_keeps_the_triton_kernel_apart(sweep_point):
    pt, pool = sweep_point
    fn, info = sweep._build("fused_fp8", pt, pool, sm_count=1)
    assert info["kernel_path"] == "triton" and "cannot run" in info["why"]
    plan = dispatch.plan_mla_decode_auto(pt.indptr, heads=pt.heads)
    want = mla_decode_fp8(pt.q_nope, pt.q_pe, pool[:, 0, :GLM5.kv_lora_rank], pool[:, 0, GLM5.kv_lora_rank:],
                          pt.indptr, pt.idx, GLM5.sm_scale, plan=plan)
    assert torch.equal(fn(), want)
    triton_fn, triton_info = sweep._build("fused_fp8_triton", pt, pool, sm_count=1)
    assert triton_info["kernel_path"] == "triton" and "why" not in triton_info
    assert torch.equal(triton_fn(), want)
    assert set(sweep.SWEEP_PATHS) <= set(PATHS), "every sweep path is a cost-model path"


def test_the_sweep_records_the_kernel_the_dispatcher_chose(sweep_point, monkeypatch):
    pt, pool = sweep_point
    monkeypatch.setattr(dispatch, "choose_path", _choose("wgmma"))
    _, info = sweep._build("fused_fp8", pt, pool, sm_count=1)
    assert info["kernel_path"] == "wgmma" and info["why"] == "wgmma: chosen by the test"


def _legacy(rows):
    """Rows as recorded before the fused path was dispatched: no ``kernel_path``/``why``, no Triton-only series."""
    return [{k: v for k, v in r.items() if k not in ("kernel_path", "why")} for r in rows
            if r.get("path") != "fused_fp8_triton"]


def test_rows_with_and_without_the_kernel_validate():
    step = load_result("decode_step_paths")
    fused = next(r for r in step.rows if r.get("path") == "fused_fp8")
    legacy = _legacy([fused])
    validate_rows("decode_step_paths", legacy)
    assert kernels_that_ran(legacy) == {"triton": 1}  # a row without the field ran the Triton kernel
    assert kernels_that_ran([{**fused, "kernel_path": "wgmma"}]) == {"wgmma": 1}
    validate_rows("decode_step_paths", [{**fused, "kernel_path": "wgmma", "why": "wgmma: measured"}])
    with pytest.raises(RowSchemaError, match="kernel_path"):
        validate_rows("decode_step_paths", [{**fused, "kernel_path": "fast"}])


def _as_dispatched(result, kernel: str):
    """``result`` as if its fused path had run ``kernel`` everywhere (the rows a GPU re-recording would hold)."""
    rows = [{**r, "kernel_path": kernel, "why": f"{kernel}: measured"} if r.get("path") == "fused_fp8" else r
            for r in result.rows]
    return dataclasses.replace(result, rows=rows)


def test_the_report_says_which_kernel_ran():
    step, sweep_result = load_result("decode_step_paths"), load_result("path_sweep")
    assert "Triton's tensor-core code" in answer_report.sweep_findings(
        dataclasses.replace(sweep_result, rows=_legacy(sweep_result.rows)))
    fused = next(r for r in step.rows if r.get("path") == "fused_fp8")  # the recording as it is
    assert KERNEL_NAMES[kernel_that_ran(fused)] in answer_report.fused_kernel_text(step, "the step")
    text = answer_report.fused_kernel_text(_as_dispatched(step, "wgmma"), "the step")
    assert text.startswith("In the step, our fused path ran the wgmma path") and "“wgmma: measured”" in text
    fused_points = sum(r.get("path") == "fused_fp8" and r.get("us") is not None for r in sweep_result.rows)
    dispatched = _as_dispatched(sweep_result, "cuda")
    assert f"the CUDA C++ mma.sync path at {fused_points} of {fused_points} points" in answer_report.fused_kernel_text(
        dispatched, "the sweep")
    findings = answer_report.sweep_findings(dispatched)
    assert "Triton's tensor-core code" not in findings and "CUDA C++ mma.sync path at 128 heads" in findings


def test_off_the_reference_gpu_the_fused_path_is_predicted_from_the_triton_kernel():
    fast, slow = ComponentFit("fused_fp8", 5.0, 3000.0, None, 0, ()), ComponentFit("fused_fp8_triton", 9.0, 1500.0,
                                                                                     None, 0, ())
    p, pro = Point(16, 1, 32_768, 495_000), GPUS["rtx-pro-6000"]
    both = CostModel({"fused_fp8": fast, "fused_fp8_triton": slow})
    assert both.layer_us("fused_fp8", p) == fast.us(p) < both.layer_us("fused_fp8_triton", p) == slow.us(p)
    for rule in ("fraction of peak", "per-SM rate"):
        assert both.layer_us("fused_fp8", p, pro, rule) == both.layer_us("fused_fp8_triton", p, pro, rule)
    # A sweep recorded before the dispatcher: its fused_fp8 is the Triton kernel, and carries over as it is.
    legacy = CostModel({"fused_fp8": dataclasses.replace(slow, component="fused_fp8")})
    assert legacy.layer_us("fused_fp8", p, pro) == both.layer_us("fused_fp8", p, pro)
    assert "fused_fp8_triton" not in {q for arch in ("sm_90", "sm_100", "sm_120") for q in paths_on(arch, 16)}

"""Chapter 6 runs ours -- the dispatcher's path with the step's plan (kvwall.kernels.mla_decode.dispatch) -- on the step
(kvwall.model.step_paths) and in the sweep (kvwall.experiments.answer.sweep, built from chapter 5's peer table), says
which path ran and why, keeps the forced Triton path apart (the cost model's stand-in off Hopper), and puts FlashMLA on
the step where it runs (GPU, SM90)."""

from __future__ import annotations

import pytest
import torch

import kvwall.experiments  # noqa: F401 - registers the row schemas
from conftest import BOOK, _interpreter_gap
from kvwall.experiments import EXPERIMENTS
from kvwall.experiments.answer import step, sweep
from kvwall.experiments.fused_decode.strategies import STRATEGIES, make_point
from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode.plan import MLADecodePlan
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8
from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache
from kvwall.kernels.mla_decode.wgmma import WgmmaPlan
from kvwall.kernels.mla_decode.wgmma_tokens import WgmmaTokensPlan
from kvwall.model.cost import GPUS, OFF_REFERENCE, PATHS, ComponentFit, CostModel, Point, paths_on
from kvwall.model.geometry import GLM5
from kvwall.model.step_paths import (
    KERNEL_NAMES,
    PATH_INFO,
    STEP_PATHS,
    build_step_path,
    kernel_that_ran,
    kernels_that_ran,
)
from kvwall.model.pool import TokenPool, make_decode_batch
from kvwall.results import RowSchemaError, validate_rows

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
    return (
        (torch.randn(batch.batch_size, heads, dc, generator=gen) * 0.5).to(torch.bfloat16),
        (torch.randn(batch.batch_size, heads, dr, generator=gen) * 0.5).to(torch.bfloat16),
    )


def _choose(path: str):
    return lambda *args, **kwargs: (path, f"{path}: chosen by the test")


def test_the_step_paths_are_named_as_the_book_names_them():
    assert STEP_PATHS == (
        "full_pool_cast",
        "index_then_cast",
        "gather_cast",
        "ours",
        "flashinfer_fp8",
        "bf16_cache",
        "flashmla_fp8",
        "flashmla_bf16",
    )
    assert tuple(KERNEL_NAMES) == dispatch.KERNEL_PATHS and len(set(KERNEL_NAMES.values())) == len(KERNEL_NAMES)
    chapter_5 = (BOOK / "05_fused_fp8_decode.md").read_text()  # where the book introduces each path by its name
    assert all(name in chapter_5 for name in KERNEL_NAMES.values())
    assert all(PATH_INFO[p].gpu_only and PATH_INFO[p].peer for p in ("flashmla_fp8", "flashmla_bf16"))
    assert PATH_INFO["flashmla_bf16"].cache_dtype == torch.bfloat16
    full, small = EXPERIMENTS["decode_step_paths"].full, EXPERIMENTS["decode_step_paths"].small
    assert "flashmla_fp8" in full["paths"] and "ours" in full["paths"]  # every step figure can show FlashMLA FP8
    assert not {"flashmla_fp8", "flashmla_bf16", "flashinfer_fp8"} & set(small["paths"])


@interpreted
def test_on_cpu_the_steps_ours_runs_the_triton_path(step_inputs):
    pool, batch = step_inputs
    _, attention, info = build_step_path("ours", pool, batch, bf16_backend="fa2")
    assert info["backend"] == info["kernel_path"] == "triton" and "cannot run" in info["path_why"]
    assert attention.plan.path == "triton" and type(attention.plan.work) is MLADecodePlan
    assert "Triton path" in attention.name
    q_nope, q_pe = _queries(batch)
    ckv, kpe = split_latent_cache(pool.key_buffer(0), GEOMETRY.kv_lora_rank)
    first = attention(q_nope, q_pe, ckv, kpe).clone()
    again = attention(q_nope, q_pe, ckv, kpe)  # the same plan and launch shape
    ref = mla_decode_reference(
        q_nope, q_pe, ckv, kpe, batch.kv_indptr, batch.kv_indices, GEOMETRY.sm_scale, compute_dtype=torch.float64
    )
    assert torch.equal(first, again)
    assert (first.double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("path,plan_type", [("wgmma", WgmmaPlan), ("wgmma_tokens", WgmmaTokensPlan)])
def test_the_steps_ours_plans_once_and_launches_the_path_the_dispatcher_chooses(
    step_inputs, monkeypatch, path, plan_type
):
    """One plan for the step, made outside the calls; every layer's call launches the chosen Hopper path with it
    (on a CPU the launch itself is replaced: it records what it was given)."""
    pool, batch = step_inputs
    monkeypatch.setattr(dispatch, "choose_path", _choose(path))
    monkeypatch.setattr(dispatch.wgmma_path, "wgmma_refusal", lambda device: None)
    _, attention, info = build_step_path("ours", pool, batch, bf16_backend="fa2")
    assert type(attention.plan.work) is plan_type
    assert info["backend"] == info["kernel_path"] == path and info["path_why"] == _choose(path)()[1]  # its reason
    assert KERNEL_NAMES[path] in attention.name
    launches = []
    monkeypatch.setattr(
        dispatch.hopper, "launch_planned", lambda kind, work, *args, **kw: launches.append((kind, work))
    )
    q_nope, q_pe = _queries(batch)
    ckv, kpe = split_latent_cache(pool.key_buffer(0), GEOMETRY.kv_lora_rank)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: type("S", (), {"cuda_stream": 0})())
    for _ in range(3):
        attention(q_nope, q_pe, ckv, kpe)
    assert launches == [(path, attention.plan.work)] * 3


def test_a_forced_hopper_path_is_refused_at_plan_time_where_it_cannot_run(step_inputs):
    pool, batch = step_inputs
    ckv, kpe = split_latent_cache(pool.key_buffer(0), GEOMETRY.kv_lora_rank)
    for path in ("wgmma", "wgmma_tokens"):
        with pytest.raises(ValueError, match="^plan_mla_decode: the .*wgmma path cannot run here: tensors are on cpu"):
            dispatch.plan_mla_decode(
                batch.kv_indptr,
                batch.kv_indices,
                heads=16,
                sm_scale=GEOMETRY.sm_scale,
                path=path,
                ckv_cache=ckv,
                kpe_cache=kpe,
            )


def test_flashmla_on_the_step_is_built_above_the_model_and_needs_a_gpu(step_inputs):
    pool, batch = step_inputs
    with pytest.raises(ValueError, match="peer"):
        build_step_path("flashmla_fp8", pool, batch, bf16_backend="fa2")
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        step.flashmla_step_path("flashmla_fp8", pool, batch, seed=0)
    paged, same = step.PagedViews().prepare_kv(pool, 0, torch.bfloat16)
    buf = pool.key_buffer(0)
    assert paged is same and paged.shape == (buf.shape[0] // 64, 64, 1, GLM5.kv_dim)
    assert paged.data_ptr() == buf.data_ptr()  # a view of the pool: no copy


@pytest.fixture(scope="module")
def sweep_point():
    pool = (torch.randn(2048, 1, GLM5.kv_dim, generator=torch.Generator().manual_seed(4)) * 0.7).to(torch.float8_e4m3fn)
    pt = make_point(
        16, 200, 1, pool_slots=2048, max_total=2047, gen=torch.Generator().manual_seed(4), seed=4, device=CPU
    )
    return pt, pool


@interpreted
def test_the_sweeps_ours_runs_the_dispatchers_path_and_keeps_the_triton_path_apart(sweep_point):
    pt, pool = sweep_point
    fn, info = sweep.build_sweep_path("ours", pt, pool, sm_count=1)
    assert info["strategy"] == "ours" and info["kernel_path"] == "triton" and "cannot run" in info["path_why"]
    # the Triton path by name, on the work list ours planned: the same bits
    triton_plan = dispatch.plan_mla_decode(pt.indptr, pt.idx, heads=pt.heads, sm_scale=GLM5.sm_scale).work
    want = mla_decode_fp8(
        pt.q_nope,
        pt.q_pe,
        pool[:, 0, : GLM5.kv_lora_rank],
        pool[:, 0, GLM5.kv_lora_rank :],
        pt.indptr,
        pt.idx,
        GLM5.sm_scale,
        plan=triton_plan,
    )
    assert torch.equal(fn(), want)
    triton_fn, triton_info = sweep.build_sweep_path("triton", pt, pool, sm_count=1)
    assert triton_info["kernel_path"] == "triton" and "path_why" not in triton_info
    assert torch.equal(triton_fn(), want)
    assert set(sweep.SWEEP_PATHS) <= set(PATHS), "every sweep path is a cost-model path"
    assert {s for s, _ in sweep.SWEEP_PATHS.values()} <= set(STRATEGIES), "... and an entry of the peer table"


def test_the_sweep_records_the_path_the_dispatcher_chose(sweep_point, monkeypatch):
    pt, pool = sweep_point
    monkeypatch.setattr(dispatch, "choose_path", _choose("wgmma"))
    monkeypatch.setattr(dispatch.wgmma_path, "wgmma_refusal", lambda device: None)
    _, info = sweep.build_sweep_path("ours", pt, pool, sm_count=1)
    assert info["kernel_path"] == "wgmma" and info["path_why"] == _choose("wgmma")()[1]


def _ours_row(**kw) -> dict:
    return {"section": "path", "path": "ours", "label": PATH_INFO["ours"].label, "step_ms": 20.0, **kw}


def test_ours_rows_say_which_path_ran():
    rows = [
        _ours_row(kernel_path="wgmma", path_why="wgmma: measured"),
        _ours_row(kernel_path="triton"),
        {"section": "path", "path": "bf16_cache", "label": "x", "step_ms": 30.0},
        _ours_row(kernel_path="wgmma", error="did not run"),
    ]
    validate_rows("decode_step_paths", rows)
    assert kernels_that_ran(rows) == {"wgmma": 1, "triton": 1}
    assert kernel_that_ran({"path": "ours"}) == "triton"
    with pytest.raises(RowSchemaError, match="kernel_path"):
        validate_rows("decode_step_paths", [_ours_row(kernel_path="cuda")])  # the retired mma.sync path
    point = {
        "section": "point",
        "axis": "context",
        "path": "ours",
        "heads": 16,
        "context": 4096,
        "batch": 1,
        "pool_tokens": 495_000,
        "tokens": 4096,
        "len_max": 4096,
        "us": 14.0,
        "strategy": "ours",
        "page_size": 1,
        "kernel_path": "wgmma",
        "path_why": "wgmma: measured",
    }
    validate_rows("path_sweep", [point])
    validate_rows("path_sweep", [{**point, "kernel_path": "wgmma_tokens", "path_why": "tokens-on-M wgmma: measured"}])
    validate_rows("decode_step_paths", [_ours_row(kernel_path="wgmma_tokens")])


def test_off_hopper_ours_is_predicted_from_the_triton_path():
    assert OFF_REFERENCE == {"ours": "triton"}
    fast, slow = ComponentFit("ours", 5.0, 3000.0, None, 0, ()), ComponentFit("triton", 9.0, 1500.0, None, 0, ())
    p, pro, h100 = Point(16, 1, 32_768, 495_000), GPUS["rtx-pro-6000"], GPUS["h100"]
    both = CostModel({"ours": fast, "triton": slow})
    assert both.layer_us("ours", p) == fast.us(p) < both.layer_us("triton", p) == slow.us(p)
    for rule in ("fraction of peak", "per-SM rate"):
        assert both.layer_us("ours", p, pro, rule) == both.layer_us("triton", p, pro, rule)
    # an H100 is Hopper: the dispatcher runs its paths there (the H200's crossovers), so ours keeps its own fit
    assert both.layer_us("ours", p, h100) < both.layer_us("triton", p, h100)
    # a sweep without a triton series: ours itself carries over
    alone = CostModel({"ours": fast})
    assert alone.layer_us("ours", p, pro) == CostModel({"ours": fast}).layer_us("ours", p, pro)
    assert "triton" not in {q for arch in ("sm_90", "sm_100", "sm_120") for q in paths_on(arch, 16)}
    assert all("ours" in paths_on(a, 16) for a in ("sm_90", "sm_100", "sm_120"))


@interpreted
def test_the_step_experiment_runs_on_cpu_at_small_scale(executed):
    """The small run chapter 6 makes live on a CPU (the session's run of the chapter), read from the result file it
    saved."""
    result = executed.live(BOOK / "06_the_answer.md", "decode_step_paths")
    small = EXPERIMENTS["decode_step_paths"].small
    assert result.provenance.scale == "small" and {k: result.params[k] for k in small} == small, result.params
    validate_rows("decode_step_paths", result.rows)
    rows = {r["path"]: r for r in result.table("path")}
    assert list(rows) == [p for p in STEP_PATHS if not PATH_INFO[p].gpu_only]
    ours = rows["ours"]
    assert "error" not in ours and ours["kernel_path"] == "triton" and ours["path_why"]
    assert ours["rel_err_vs_float64"] < 1e-2 and ours["step_ms"] > 0

"""Chapter 5's experiments (kvwall.experiments.fused_decode): the one peer table, the validation's small run on CPU
(Triton's interpreter; every path's contracts), that the validation and the bench driver can fail, the dispatcher's
table derived from synthetic ``fused_decode_paths`` rows, the bytes / FLOPs / roofline arithmetic by hand, the timers
and peers they use, registration and recording order, GPU-only experiments refusing a CPU, and (GPU only) the
experiments at a tiny scale."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
import torch

from conftest import BOOK
from kvwall import cli
from kvwall.experiments import EXPERIMENTS, run_experiment
from kvwall.experiments.answer import sweep
from kvwall.experiments.fused_decode import bench, contracts, strategies, validation
from kvwall.experiments.fused_decode import kernel_paths as paths
from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.results import collect_provenance, Result, validate_rows
from kvwall.kernels import mla_decode_fp8
from kvwall.kernels.mla_decode import dispatch, path_table, wgmma_tokens
from kvwall.kernels.mla_decode.cases import validation_cases
from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig
from kvwall.measure import sanitizer, timing
from kvwall.measure.accuracy import bf16_bits, finite_or_none, relative_error, same_bits
from kvwall.measure.ncu import parse_ncu_csv
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.model.roofline import decode_flops, kv_read_bytes, qo_bytes, roofline_us
from kvwall.peers import flashmla, sglang
from kvwall.tuning.fused import candidates, loop_instruction_mix


def _interpreter_gap() -> str:
    """Why this Triton's CPU interpreter cannot run the kernel ('' when it can): before 3.9 it has no bfloat16
    constants (as tests/conftest.py says for the kernel's own test modules)."""
    import triton

    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return "" if (major, minor) >= (3, 9) else f"Triton {triton.__version__}'s interpreter cannot run the kernel"


needs_interpreter = pytest.mark.skipif(bool(_interpreter_gap()), reason=_interpreter_gap() or "ok")
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

CASE_FIELDS = {
    "section",
    "path",
    "case",
    "heads",
    "lens",
    "batch",
    "tokens",
    "layout",
    "page_size",
    "index_dtype",
    "ckv_scale",
    "kpe_scale",
    "seed",
    "num_splits",
    "rel_err",
    "bf16_path",
    "bf16_rel_err",
    "ratio",
    "finite",
    "empty_requests",
    "empty_out_zero",
    "passed",
}
ERROR_FIELDS = {"section", "input", "expected", "raised", "message", "out_untouched", "passed"}
BENCH_FIELDS = {
    "section",
    "strategy",
    "page_size",
    "heads",
    "context",
    "batch",
    "tokens",
    "len_min",
    "len_max",
    "active_bytes",
    "qo_bytes",
    "flops",
    "roofline_us",
    "us",
    "host_us",
    "gbps",
    "tflops",
    "pct_roofline",
}
CPU = torch.device("cpu")
#: Why the wgmma paths cannot run on the CPU, as the kernels say it.
CPU_REFUSAL = dispatch.wgmma_path.wgmma_refusal(CPU)
#: The error a test's stand-in for a missing peer raises, to find in the row it becomes.
GONE = "peer-not-here"


# ---------------------------------------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------------------------------------


def test_registered_and_listed(capsys):
    val, bench_exp = EXPERIMENTS["fused_decode_validation"], EXPERIMENTS["fused_decode_bench"]
    assert "cuda" in val.requires and "compute-sanitizer" in val.requires and "flashinfer" in bench_exp.requires
    assert set(val.small) <= set(val.full) and set(bench_exp.small) <= set(bench_exp.full)
    assert bench_exp.full["heads"] == [16, 64, 128] and bench_exp.full["contexts"] == [4096, 32_768, 131_072]
    assert bench_exp.full["batches"] == [1, 8, 32, 64] and bench_exp.full["pool_slots"] == 495_000
    # the bench times every entry of the one peer table but the forced paths (fused_decode_paths times those)
    assert bench_exp.full["strategies"] == [s for s in STRATEGIES if s not in strategies.FORCED_PATHS]
    assert bench_exp.full["cast_backend"] == "fa3"  # every FlashInfer BF16 path on fa3 (Hopper), fa2 where it refuses
    assert val.full["paths"] == ["triton", "wgmma", "wgmma_tokens", "ours"]
    # the full validation reaches both tokens-on-M instantiations (32 heads: DeepSeek at TP 4) and the heads-on-M
    # path's full and double head blocks; the small (CPU) scale stays at 1, 3 and 16 heads
    assert val.full["heads"] == [16, 32, 64, 128] and val.small["heads"] == [1, 3, 16]
    assert {wgmma_tokens.heads_per_cta(h) for h in val.full["heads"]} == set(wgmma_tokens.HEADS_PER_CTA)
    fdp = EXPERIMENTS["fused_decode_paths"]
    assert fdp.full["heads"] == [16, 32, 64, 128] and fdp.full["floor_contexts"] == [64]
    assert fdp.full["page_sizes"] == [1, 64] and fdp.after_record is paths.write_path_table
    assert all(EXPERIMENTS[n].after_record is None for n in EXPERIMENTS if n != "fused_decode_paths")
    assert "fused_decode_cuda" not in EXPERIMENTS and "fused_decode_ncu" not in EXPERIMENTS
    assert cli.main(["list"]) == 0
    listed = capsys.readouterr().out
    assert "fused_decode_validation" in listed and "fused_decode_bench" in listed and "fused_decode_paths" in listed


def test_recording_order_is_dependency_order():
    names = list(EXPERIMENTS)
    order = [
        "fused_decode_tuning",
        "fused_decode_paths",
        "fused_decode_validation",
        "fused_decode_bench",
        "fused_decode_profile",
        "decode_step_paths",
        "path_sweep",
        "sglang_patch_check",
    ]
    assert [n for n in names if n in order] == order


# ---------------------------------------------------------------------------------------------------------
# The one peer table
# ---------------------------------------------------------------------------------------------------------


def test_every_peer_is_one_entry_with_a_label_and_a_build_function():
    assert list(STRATEGIES)[:5] == ["ours", "ours_page64", "triton", "wgmma", "wgmma_tokens"]
    assert strategies.FORCED_PATHS == ("triton", "wgmma", "wgmma_tokens") == dispatch.KERNEL_PATHS
    assert {
        "full_cast_bf16",
        "index_then_cast",
        "gather_cast_bf16",
        "flashinfer_fp8_fa2",
        "flashinfer_fp8_fa3",
        "flashinfer_bf16_precast",
        "sglang_triton_fp8",
        "flashmla_dense_bf16",
        "flashmla_dense_fp8",
    } <= set(STRATEGIES)
    for name, s in STRATEGIES.items():
        assert s.name == name and s.label and callable(s.build), s
        assert s.cache in ("fp8", "bf16") and s.query in ("bf16", "fp8") and s.page_size in s.page_sizes
        assert "fused" not in name and "fused" not in s.label.lower()
    assert STRATEGIES["ours_page64"].page_size == 64 and STRATEGIES["ours"].page_size == 1
    assert STRATEGIES["triton"].page_sizes == STRATEGIES["wgmma"].page_sizes == (1, 64)
    assert STRATEGIES["wgmma_tokens"].page_sizes == (1, 64) and STRATEGIES["wgmma_tokens"].needs == ("sm90",)
    assert all(STRATEGIES[n].page_size == 64 for n in ("flashmla_dense_bf16", "flashmla_dense_fp8"))
    with pytest.raises(ValueError, match="unknown strategy"):
        strategies.build_strategy("fused_fp8", None, None)


def test_the_sweep_and_the_bench_take_their_peers_from_the_table():
    assert {s for s, _ in sweep.SWEEP_PATHS.values()} <= set(STRATEGIES)
    assert sweep.SWEEP_PATHS["ours"] == ("ours", "-") and sweep.SWEEP_PATHS["triton"] == ("triton", "-")
    # the fa2 twins are a backend, not copies
    assert sweep.SWEEP_PATHS["gather_cast_fa2"] == ("gather_cast_bf16", "fa2")
    assert set(bench.BENCH_STRATEGIES) <= set(STRATEGIES)
    assert not any(n.startswith("fused") for n in sweep.SWEEP_PATHS)


@needs_interpreter
def test_strategies_build_on_cpu_where_they_can(monkeypatch):
    """Ours, ours on pages of 64 and the forced Triton path build and run in the interpreter, agreeing with float64;
    the GPU-only peers become error rows naming why."""
    monkeypatch.setattr(flashmla, "_FLASH_MLA", {"error": GONE})
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(2048, 1, 576, generator=gen) * 0.7).to(torch.float8_e4m3fn)
    pt = strategies.make_point(16, 150, 2, pool_slots=2048, max_total=2_000_000, gen=gen, seed=0, device=CPU)
    fake_clock = lambda fn, flush, device, reps, rounds: (25.0, "fake clock", None)  # noqa: E731
    rows = bench.bench_point_rows(
        pt,
        pool,
        CPU,
        [
            "ours",
            "ours_page64",
            ("triton", 1),
            ("triton", 64),
            ("wgmma", 64),
            ("wgmma_tokens", 1),
            "flashmla_dense_fp8",
        ],
        lambda: None,
        copy_gbps=4000.0,
        bf16_tflops=800.0,
        reps=1,
        rounds=1,
        host_calls=1,
        ctx=strategies.BuildContext(),
        sglang_split_sweep=[],
        timer=fake_clock,
    )
    ours, ours64, t1, t64, w64, k1, fm = rows
    assert [r["page_size"] for r in rows] == [1, 64, 1, 64, 64, 1, 64]
    for r in (ours, ours64):
        assert r["kernel_path"] == "triton" and CPU_REFUSAL in r["path_why"] and r["rel_err_f64"] < 3e-3, r
    for r in (t1, t64):
        assert r["kernel_path"] == "triton" and "path_why" not in r and r["rel_diff_vs_ours"] == 0.0, r
    for r in (w64, k1):  # a forced wgmma path is refused at plan time, the row saying why
        assert r["us"] is None and r["error"].startswith("ValueError: plan_mla_decode:") and CPU_REFUSAL in r["error"]
    assert fm["us"] is None and GONE in fm["error"]
    validate_rows("fused_decode_bench", rows)


# ---------------------------------------------------------------------------------------------------------
# The dispatcher's table from fused_decode_paths (synthetic rows)
# ---------------------------------------------------------------------------------------------------------


def _paths_result(rows: list[dict], **build_extra: Any) -> Result:
    build = {
        "section": "build",
        "gpu": "NVIDIA H200",
        "capability": [9, 0],
        "sms": 132,
        "nvcc": "12.8",
        "copy_gbps": 4200.0,
        "copy_ms": 0.5,
        "bf16_tflops": 700.0,
        "wgmma": {"runs": True, "why": None},
        "seconds_total": 70.0,
        **build_extra,
    }
    return Result("fused_decode_paths", {}, [build] + rows, collect_provenance(CPU, paths.__name__))


def _path_row(strategy: str, page: int, h: int, c: int, b: int, us: float | None) -> dict:
    return {
        "section": "bench",
        "strategy": strategy,
        "page_size": page,
        "heads": h,
        "context": c,
        "batch": b,
        "tokens": c * b,
        "len_min": c,
        "len_max": c,
        "active_bytes": c * b * 580,
        "qo_bytes": 1,
        "flops": 1,
        "roofline_us": 1.0,
        "us": us,
        "timing": "cuda_graph",
        "host_us": None,
        "gbps": None,
        "tflops": None,
        "pct_roofline": None,
        "kernel_path": strategy,
    }


def test_path_table_from_synthetic_rows(tmp_path):
    rows = [
        _path_row("triton", 1, 16, 4096, 1, 15.0),
        _path_row("wgmma", 1, 16, 4096, 1, 14.0),
        _path_row("triton", 1, 16, 131072, 1, 50.0),
        _path_row("wgmma", 1, 16, 131072, 1, 55.0),
        _path_row("triton", 1, 64, 64, 1, 14.0),
        _path_row("wgmma", 1, 64, 64, 1, None),  # wgmma failed there
        _path_row("triton", 64, 16, 4096, 1, 99.0),
        _path_row("wgmma", 64, 16, 4096, 1, 1.0),
    ]
    result = _paths_result(rows)
    validate_rows("fused_decode_paths", result.rows)
    table = paths.path_table(result)
    entry = table["NVIDIA H200"]
    assert entry == {
        "capability": [9, 0],
        "page_size": 1,
        "points": [
            [16, 4096, 1, "wgmma", 4096, 4096],
            [16, 131072, 1, "triton", 131072, 131072],
            [64, 64, 1, "triton", 64, 64],
        ],
    }  # the choices and the shapes they key, nothing else
    times = paths.measured_table(result)["NVIDIA H200"]
    assert "fused_decode_paths" in times["by"] and times["points"] == [
        [16, 4096, 1, 15.0, 14.0, None, 99.0, 1.0, None],  # then the same point on pages of 64
        [16, 131072, 1, 50.0, 55.0, None, None, None, None],
        [64, 64, 1, 14.0, None, None, None, None, None],
    ]
    assert times["columns"][-3:] == ["triton_us_page64", "wgmma_us_page64", "wgmma_tokens_us_page64"]
    assert paths.path_table(result, page_size=64)["NVIDIA H200"]["points"] == [[16, 4096, 1, "wgmma", 4096, 4096]]
    # record's after_record: merged into the file, other GPUs' entries kept, the written paths returned
    target = tmp_path / "kernel_paths.json"
    target.write_text(json.dumps({"Other GPU": {"points": []}}))
    assert paths.write_path_table(result, target) == [target, target.with_name("kernel_paths_measured.json")]
    written = json.loads(target.read_text())
    assert set(written) == {"Other GPU", "NVIDIA H200"} and written["NVIDIA H200"]["points"] == entry["points"]


def test_path_table_with_the_tokens_on_m_path(tmp_path):
    """Three paths timed: each point names the fastest, and the dispatcher reading the written table picks it."""
    rows = [
        _path_row("triton", 1, 16, 131072, 32, 320.0),
        _path_row("wgmma", 1, 16, 131072, 32, 314.0),
        _path_row("wgmma_tokens", 1, 16, 131072, 32, 224.0),
        _path_row("triton", 1, 128, 32768, 32, 751.0),
        _path_row("wgmma", 1, 128, 32768, 32, 223.0),
        _path_row("wgmma_tokens", 1, 128, 32768, 32, 400.0),
        _path_row("triton", 1, 32, 4096, 1, 17.0),
        _path_row("wgmma", 1, 32, 4096, 1, 15.0),
        _path_row("wgmma_tokens", 1, 32, 4096, 1, None),
    ]  # the tokens-on-M path failed there
    built = {
        "runs": True,
        "why": None,
        "arch": "sm_90a",
        "build_s": 20.0,
        "heads_per_cta": [16, 32],
        "per_cta": {
            "16": {
                "smem": 168576,
                "block_n": 64,
                "threads": 384,
                "ptxas_ok": True,
                "registers": 168,
                "stack_bytes": 0,
                "spill_bytes": 0,
            }
        },
    }
    result = _paths_result(rows, wgmma_tokens=built)
    validate_rows("fused_decode_paths", result.rows)
    points = paths.path_table(result)["NVIDIA H200"]["points"]
    assert points == [
        [16, 131072, 32, "wgmma_tokens", 4194304, 131072],
        [32, 4096, 1, "wgmma", 4096, 4096],
        [128, 32768, 32, "wgmma", 1048576, 32768],
    ]
    assert paths.measured_table(result)["NVIDIA H200"]["points"] == [
        [16, 131072, 32, 320.0, 314.0, 224.0],
        [32, 4096, 1, 17.0, 15.0, None],
        [128, 32768, 32, 751.0, 223.0, 400.0],
    ]
    target = tmp_path / "kernel_paths.json"
    assert path_table.read_table(target) == {}  # read (no file yet) and cached, as a choice before the recording does
    paths.write_path_table(result, target)
    table = json.loads(target.read_text())
    # record runs the experiments after this one in the same process: they read the table just written
    assert path_table.read_table(target) == table
    for h, c, b, want, n, m in points:
        assert (
            path_table.decide_path(h, b, m, tokens=n, gpu="NVIDIA H200", capability=(9, 0), refusal=None, table=table)[
                0
            ]
            == want
        )


@pytest.mark.parametrize("name", ["fused_decode_paths", "fused_decode_bench", "fused_decode_profile"])
def test_gpu_only_experiments_refuse_a_cpu(name):
    with pytest.raises(RuntimeError, match=f"^{name} .*NVIDIA GPU"):
        run_experiment(name, CPU, "small")


# ---------------------------------------------------------------------------------------------------------
# Arithmetic, by hand
# ---------------------------------------------------------------------------------------------------------


def test_active_bytes_and_flops_by_hand():
    assert kv_read_bytes(1000) == 1000 * (576 + 4) == 580_000
    assert kv_read_bytes(131_072) == 76_021_760
    assert kv_read_bytes(10, index_bytes=0) == 5_760
    assert decode_flops(16, 4096) == 2 * 16 * 4096 * 1088 == 142_606_336
    assert decode_flops(128, 131_072) == 36_507_222_016
    assert qo_bytes(8, 128) == 8 * 128 * (576 + 512) * 2 == 2_228_224


def test_roofline_by_hand():
    # 16 heads, 128K tokens, 4000 GB/s, 800 TFLOP/s: 76,021,760 B / 4e9 B/ms... = 19.00544 µs of memory against
    # 4,563,402,752 FLOPs / 8e14 FLOP/s = 5.704 µs of math: memory-bound.
    assert roofline_us(16, 131_072, 4000.0, 800.0) == pytest.approx(19.00544, rel=1e-12)
    # 128 heads: 36,507,222,016 FLOPs / 8e14 = 45.634 µs > 19.005 µs: compute-bound.
    assert roofline_us(128, 131_072, 4000.0, 800.0) == pytest.approx(45.63402752, rel=1e-12)
    assert roofline_us(16, 4096, 2000.0, 1000.0) == pytest.approx(4096 * 580 / 2e6, rel=1e-12)
    with pytest.raises(ValueError):
        roofline_us(16, 4096, 0.0, 800.0)


def test_sglang_split_cap_by_hand():
    assert sglang.sglang_max_kv_splits(132, 131_072) == 256  # H200: next_pow2(132) = 256 < next_pow2(4096)
    assert sglang.sglang_max_kv_splits(132, 4096) == 128  # next_pow2(4096 / 32) = 128
    assert sglang.sglang_max_kv_splits(16, 100) == 8  # the --triton-attention-num-kv-splits floor
    assert sglang.sglang_max_kv_splits(0, 131_072) == 8  # no device to size against


def test_bench_lengths():
    bench_lengths = strategies.bench_lengths
    assert bench_lengths(4096, 1, max_total=2_000_000, seed=0) == [4096]
    lens = bench_lengths(32_768, 8, max_total=2_000_000, seed=3)
    assert len(lens) == 8 and sum(lens) == 32_768 * 8 // 4 and min(lens) >= 1 and len(set(lens)) > 1
    assert sum(bench_lengths(131_072, 32, max_total=2_000_000, seed=1)) == 1_048_576
    assert sum(bench_lengths(131_072, 32, max_total=5_000, seed=1)) == 5_000  # the cap


def test_case_table_covers_the_brief():
    cases = validation_cases(
        [1, 3, 16], [[1], [7], [0, 7, 130, 1, 33], [65, 0, 129, 2], [333], [0, 0]], [[1, 0, 63, 64, 65, 200]], 64
    )
    assert {c.layout for c in cases} == {"pool_view", "contiguous", "pool_view_3d", "paged"}
    assert {(c.ckv_scale, c.kpe_scale) for c in cases} >= {(1.0, 1.0), (0.37, 0.74), (2.5, 0.625)}
    assert {c.index_dtype for c in cases} == {"int32", "int64"} and {c.num_splits for c in cases} >= {None, 1, 7}
    for c in cases:  # the BF16 path's inputs stay exact only if kpe_scale / ckv_scale is a power of two
        assert math.frexp(c.kpe_scale / c.ckv_scale)[0] == 0.5
    assert len({c.seed for c in cases}) == len(cases)


# ---------------------------------------------------------------------------------------------------------
# The validation's small run (CPU: Triton's interpreter)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_validation(executed):
    """``run_experiment("fused_decode_validation", CPU, "small")``: the run chapter 5 makes live on a CPU (the
    session's run of the chapter), read from the result file it saved instead of running it a second time."""
    if _interpreter_gap():
        pytest.skip(_interpreter_gap())
    result = executed.live(BOOK / "05_fused_fp8_decode.md", "fused_decode_validation")
    small = EXPERIMENTS["fused_decode_validation"].small
    assert result.provenance.scale == "small" and {k: result.params[k] for k in small} == small, result.params
    return result


@needs_interpreter
def test_small_validation_rows_all_pass(small_validation):
    result = small_validation
    json.dumps({"params": result.params, "rows": result.rows}, allow_nan=False)  # recordable as it is
    cases = result.table("cases")
    small = EXPERIMENTS["fused_decode_validation"].small
    setup = result.table("setup")[0]
    assert setup["paths"] == ["triton", "ours"] and "H100" in setup["skipped"]["wgmma"]  # the CPU refuses wgmma
    assert "H100" in setup["skipped"]["wgmma_tokens"]  # and the tokens-on-M path, with the same refusal
    n_cases = len(small["heads"]) * (len(small["length_sets"]) + len(small["paged_length_sets"]))
    assert len(cases) == 2 * n_cases and {r["path"] for r in cases} == {"triton", "ours"}
    assert all(r["kernel_path"] == "triton" and r["path_why"] for r in cases if r["path"] == "ours")
    for row in cases:
        assert CASE_FIELDS <= set(row), CASE_FIELDS - set(row)
        assert "error" not in row, row
        assert row["passed"] is True, row
        assert row["finite"] and row["empty_out_zero"]
        if row["tokens"]:
            assert row["bf16_path"].startswith("torch")  # no FlashInfer on a CPU: the torch reference in BF16
            assert row["rel_err"] <= 2 * row["bf16_rel_err"] and row["ratio"] <= 2
            assert row["rel_err"] < 5e-3 and row["bf16_inputs_exact"]
        else:
            assert row["rel_err"] is None
    assert {r["heads"] for r in cases} == {1, 3, 16}
    assert {r["layout"] for r in cases} == {"pool_view", "contiguous", "pool_view_3d", "paged"}
    assert any(r["empty_requests"] and r["tokens"] for r in cases)  # mixed batches with empty requests
    assert any(r["ckv_scale"] != 1 and r["kpe_scale"] != 1 for r in cases)
    # a one-token request: the softmax weight is exactly 1, both outputs are the cached row, rounded once
    one = [r for r in cases if r["lens"] == [1] and r["ckv_scale"] == 1.0]
    assert one and all(r["rel_err"] == 0.0 and r["bf16_rel_err"] == 0.0 for r in one)
    errors = result.table("errors")
    assert len(errors) >= 15
    for row in errors:
        assert ERROR_FIELDS <= set(row) and row["passed"] is True, row
    contract = result.table("contract")
    assert {r["path"] for r in contract} == {"triton", "ours"}
    for row in contract:
        assert row["ok"] is True, row
    checks = {(r["path"], r["check"]) for r in contract}
    assert len(checks) == len(contract)  # one row a check
    # the forced Triton path refuses a plan of each other path, each a row naming it
    refused = [c for p, c in checks if p == "triton" and "plan" in c]
    assert len(refused) == len(dispatch.KERNEL_PATHS) - 1
    assert all(any(KERNEL_NAMES[o] in c for c in refused) for o in dispatch.KERNEL_PATHS if o != "triton")
    # ours routes misaligned rows to the Triton path (the row's detail: the plan's path)
    (odd,) = [r for r in contract if r["path"] == "ours" and "16-byte" in r["check"]]
    assert odd["detail"].startswith("path triton")
    assert sum("NaN" in c for _, c in checks) == 2  # the NaN isolation, on each path
    assert {r["section"] for r in result.rows} == {"setup", "cases", "contract", "errors"}  # GPU sections: a GPU


@needs_interpreter
def test_validation_fails_a_kernel_that_is_off(monkeypatch):
    """The rule has teeth: a kernel 1 % off everywhere, and one that ignores kpe_scale, fail their cases."""

    def off_by_one_percent(*args, **kw):
        out = mla_decode_fp8(*args, **kw)
        out.copy_((out.float() * 1.01).to(torch.bfloat16))
        return out

    def drops_kpe_scale(*args, kpe_scale=1.0, **kw):
        return mla_decode_fp8(*args, **kw)

    params = dict(
        heads=[3],
        length_sets=[[40], [0, 70]],
        paged_length_sets=[],
        page_size=64,
        pool_slots=512,
        peers=False,
        graph=False,
        sanitizer=False,
        paths=["triton"],
        contract_heads=16,
        contract_lens=[20, 40, 3],
        seed=5,
    )
    monkeypatch.setattr(validation, "mla_decode_fp8", off_by_one_percent)
    rows = validation.run_fused_decode_validation(CPU, **params).table("cases")
    assert rows and not any(r["passed"] for r in rows) and all(r["ratio"] > 2 for r in rows)
    monkeypatch.setattr(validation, "mla_decode_fp8", drops_kpe_scale)
    params["length_sets"] = [[40], [70], [9], [33], [20]]  # scales rotate every three cases: the last two 0.37/0.74
    rows = validation.run_fused_decode_validation(CPU, **params).table("cases")
    assert [r["kpe_scale"] for r in rows] == [1.0, 1.0, 1.0, 0.74, 0.74]
    assert [r["passed"] for r in rows] == [True, True, True, False, False]


def test_error_rows_catch_a_write_before_raising(monkeypatch):
    def scribbles(*args, out=None, **kw):
        if out is not None:
            out.zero_()
        raise ValueError("too late")

    monkeypatch.setattr(contracts, "mla_decode_fp8", scribbles)
    rows = contracts.error_rows(CPU)
    assert rows and not any(r["passed"] for r in rows)
    assert all(r["raised"] == "ValueError" and not r["out_untouched"] for r in rows)


# ---------------------------------------------------------------------------------------------------------
# The bench driver on CPU (fake clock): rows, derived numbers, one failing peer = one error row
# ---------------------------------------------------------------------------------------------------------


@needs_interpreter
def test_bench_point_rows_on_cpu(monkeypatch):
    monkeypatch.setattr(sglang, "_SGLANG", {"error": "sglang-" + GONE, "source": "test"})
    monkeypatch.setattr(flashmla, "_FLASH_MLA", {"error": "flash_mla-" + GONE})
    fake_clock = lambda fn, flush, device, reps, rounds: (25.0, "fake clock", None)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    pool = (torch.randn(2000, 1, 576, generator=gen) * 0.7).to(torch.float8_e4m3fn)
    pt = strategies.make_point(16, 256, 8, pool_slots=2000, max_total=2_000_000, gen=gen, seed=0, device=CPU)
    assert pt.tokens == 512 and pt.batch == 8 and pt.idx.numel() == 512
    names = ["ours", "flashinfer_fp8_fa2", "sglang_triton_fp8", "flashmla_dense_fp8"]
    rows = bench.bench_point_rows(
        pt,
        pool,
        CPU,
        names,
        lambda: None,
        copy_gbps=4000.0,
        bf16_tflops=800.0,
        reps=1,
        rounds=1,
        host_calls=1,
        ctx=strategies.BuildContext(sm_count=132),
        sglang_split_sweep=[8],
        timer=fake_clock,
    )
    assert [r["strategy"] for r in rows] == names
    ours, fi, sg, fm = rows
    for r in rows:
        assert BENCH_FIELDS <= set(r), BENCH_FIELDS - set(r)
        assert r["tokens"] == 512 and r["active_bytes"] == 512 * 580
        assert r["roofline_us"] == pytest.approx(roofline_us(16, 512, 4000.0, 800.0))
    assert "error" not in ours and ours["us"] == 25.0 and ours["host_us"] > 0 and ours["timing"] == "fake clock"
    assert ours["gbps"] == pytest.approx(512 * 580 / 25.0 / 1e3)
    assert ours["tflops"] == pytest.approx(2 * 16 * 512 * 1088 / 25.0 / 1e6)
    assert ours["pct_roofline"] == pytest.approx(roofline_us(16, 512, 4000.0, 800.0) / 25.0 * 100)
    assert ours["work_items"] >= 8 and ours["imbalance"] >= 1.0 and ours["config"]["block_h"] == 16
    assert ours["kernel_path"] == "triton" and ours["path_why"]
    assert ours["rel_err_f64"] < 3e-3  # the interpreter: float32 dots, only the output's BF16 rounding
    assert fi["us"] is None and fi["error"]  # FlashInfer cannot run on a CPU: a row saying so, no crash
    assert sg["us"] is None and "sglang-" + GONE in sg["error"]
    assert fm["us"] is None and "flash_mla-" + GONE in fm["error"] and fm["timing"] == "not timed"
    assert [r["page_size"] for r in rows] == [1, 1, 1, 64]
    validate_rows("fused_decode_bench", rows)


def test_sglang_loader_reports_a_bad_path(monkeypatch, tmp_path):
    monkeypatch.setattr(sglang, "_SGLANG", {})
    monkeypatch.setenv("KVWALL_SGLANG_PATH", str(tmp_path))
    info = sglang.load_sglang()
    # the error names the variable, its value and what the folder lacks
    assert f"KVWALL_SGLANG_PATH={tmp_path}" in info["error"] and "sglang/" in info["error"]
    assert str(tmp_path) in info["source"]


# ---------------------------------------------------------------------------------------------------------
# GPU: both experiments at a tiny scale
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
def test_bench_tiny_on_gpu():
    result = run_experiment(
        "fused_decode_bench",
        torch.device("cuda"),
        "small",
        heads=[16],
        contexts=[4096],
        batches=[1, 8],
        reps=3,
        rounds=1,
        host_calls=3,
        sglang_split_sweep=[],
        floor_contexts=[],
    )
    json.dumps({"params": result.params, "rows": result.rows}, allow_nan=False)
    head = result.table("ceilings")[0]
    assert head["copy_gbps"] > 100 and head["bf16_tflops"] > 1
    rows = result.table("bench")
    assert len(rows) == 2 * len(bench.BENCH_STRATEGIES)
    for r in rows:
        assert BENCH_FIELDS <= set(r)
        assert (r["us"] is not None and r["us"] > 0) or r.get("error"), r
    ours = [r for r in rows if r["strategy"] in ("ours", "ours_page64")]
    for r in ours:
        assert "error" not in r and r["timing"] == "cuda_graph", r
        # any of ours' paths: on an H100 / H200 with a kernel_paths.json that times the tokens-on-M path,
        # 16 heads may run it
        assert 0 < r["pct_roofline"] <= 110 and r["host_us"] > 0 and r["kernel_path"] in dispatch.KERNEL_PATHS
    for r in rows:
        if r["strategy"] in ("full_cast_bf16", "gather_cast_bf16", "flashinfer_bf16_precast") and "error" not in r:
            assert r["rel_diff_vs_ours"] < 2e-2, r  # the same attention, up to BF16 roundings
            assert r["backend"] == ("fa3" if torch.cuda.get_device_capability()[0] == 9 else "fa2"), r


@pytest.mark.gpu
@needs_gpu
def test_validation_tiny_on_gpu():
    result = run_experiment(
        "fused_decode_validation",
        torch.device("cuda"),
        "small",
        heads=[16],
        length_sets=[[1], [0, 7, 130, 1, 33], [4097]],
        paged_length_sets=[[1, 0, 63, 64, 65, 200]],
        pool_slots=50_000,
        sanitizer=False,
    )
    json.dumps({"params": result.params, "rows": result.rows}, allow_nan=False)
    for row in result.table("cases") + result.table("errors") + result.table("graph"):
        assert row["passed"] is True, row
    for row in result.table("contract"):
        assert row["ok"] is True, row
    for row in result.table("fp8_peers"):
        assert row.get("error") or row["rel_err"] < 5e-2, row


@pytest.mark.gpu
@needs_gpu
def test_paths_tiny_on_gpu():
    result = run_experiment(
        "fused_decode_paths",
        torch.device("cuda"),
        "small",
        heads=[16],
        contexts=[4096],
        batches=[1, 8],
        floor_contexts=[],
        reps=3,
        rounds=1,
    )
    rows = result.table("bench")
    assert {(r["strategy"], r["page_size"]) for r in rows} >= {("triton", 1), ("triton", 64)}
    for r in rows:
        assert r.get("error") or (r["us"] > 0 and r["rel_err_f64"] < 1e-2), r
    assert paths.path_table(result)[torch.cuda.get_device_name()]["points"]


# ----------------------------------------------------------------------------------------------
# The tuning and profiling records (fused_tuning.py) and the compiled-loop evidence of chapter 5
# ----------------------------------------------------------------------------------------------


def test_parse_ncu_csv_reads_base_unit_metrics_and_rejects_empty_output():
    head = (
        '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
        '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
    )
    row = (
        '"0","1","python3","h","_mla_split_kernel","1","7","(128, 1, 1)","(1, 264, 1)","0","9.0",'
        '"Command line profiler metrics","{name}","{unit}","{value}"'
    )
    text = "\n".join(
        [
            "==PROF== Connected to process",
            head,
            row.format(name="dram__bytes_read.sum", unit="byte", value="68,983,040"),
            row.format(name="launch__registers_per_thread", unit="register/thread", value="254"),
            row.format(name="some__other.metric", unit="", value="1"),
            row.format(name="sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed", unit="%", value="31.5"),
            row.format(name="sm__inst_executed.sum", unit="inst", value="n/a"),
        ]
    )
    got = parse_ncu_csv(text)
    assert got == {"dram_read_bytes": 68_983_040.0, "registers_per_thread": 254.0, "tensor_pipe_pct": 31.5}
    ncu_said = "==PROF== Connected\n==ERROR== no kernels were profiled"
    with pytest.raises(ValueError, match=re.escape(ncu_said)):  # the error shows what ncu said
        parse_ncu_csv(ncu_said)


def test_profile_kernel_drops_a_metric_this_ncu_does_not_know_and_names_it(tmp_path, monkeypatch):
    """A fake ncu that knows every metric but the wgmma stall: the first run fails on that name, the second, without
    it, returns the rest; the row names what was dropped. A failure that is not about a metric name still raises."""
    import kvwall.measure.ncu as ncu_mod

    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    crash = "==ERROR== the application crashed"
    fake = tmp_path / "ncu"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import sys\n"
        "metrics = sys.argv[sys.argv.index('--metrics') + 1].split(',')\n"
        "if 'smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio' in metrics:\n"
        "    print('==ERROR== Failed to find metric smsp__average_warps_issue_stalled_gmma_per_issue_active"
        ".ratio', file=sys.stderr); sys.exit(1)\n"
        f"if 'boom' in sys.argv: print({crash!r}); sys.exit(1)\n"
        f"print({head!r})\n"
        'for i, m in enumerate(metrics): print(f\'"0","k","{m}","","{i + 1}"\')\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(ncu_mod, "ncu_path", lambda: str(fake))
    got = ncu_mod.profile_kernel("m", [], kernel_regex="k", launch_skip=0, timeout_s=30)
    assert got["ncu_missing"] == ["stall_gmma"] and "stall_gmma" not in got
    assert got["tensor_pipe_pct"] > 0 and got["duration_ns"] == 1.0
    assert set(ncu_mod.NCU_METRICS.values()) <= set(got)
    with pytest.raises(ValueError, match=re.escape(crash)):  # the error shows what ncu said
        ncu_mod.profile_kernel("m", ["boom"], kernel_regex="k", launch_skip=0, timeout_s=30)


def test_profile_window_reads_every_launch_of_the_window_in_order(tmp_path, monkeypatch):
    """``profile_window`` asks ncu for the profiler window (not a kernel name) and reads each launch apart, in launch
    order, named; the ``peers`` rows take the longest launch's metrics, list every launch and sum their times -- and
    a strategy whose program fails is a row with its error, not a crash."""
    import kvwall.measure.ncu as ncu_mod
    from kvwall.experiments.fused_decode import profile as prof

    head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
    fake = tmp_path / "ncu"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import sys\n"
        "assert sys.argv[sys.argv.index('--profile-from-start') + 1] == 'off' and '--kernel-name' not in sys.argv\n"
        "if 'flashmla_dense_fp8' in sys.argv: print('==ERROR== the application crashed'); sys.exit(1)\n"
        "metrics = sys.argv[sys.argv.index('--metrics') + 1].split(',')\n"
        f"print({head!r})\n"
        "for kid, name, ns in (('10', 'combine', '2,000'), ('9', 'split<64>', '30,000'), ('11', 'fill', '500')):\n"
        "    for m in metrics:\n"
        "        value = ns if m == 'gpu__time_duration.sum' else ('55.5' if name.startswith('split') else '1')\n"
        '        print(f\'"{kid}","{name}","{m}","","{value}"\')\n'
    )
    fake.chmod(0o755)
    monkeypatch.setattr(ncu_mod, "ncu_path", lambda: str(fake))
    monkeypatch.setattr(prof, "ncu_path", lambda: str(fake))
    launches, missing = ncu_mod.profile_window("m", [], timeout_s=30)
    assert [k["kernel"] for k in launches] == ["split<64>", "combine", "fill"] and missing == []
    assert launches[0]["duration_ns"] == 30_000.0 and launches[1]["tensor_pipe_pct"] == 1.0

    rows = prof._peer_rows([[16, 4096, 8]], pool_slots=1000, max_total=10_000, seed=0, timeout_s=30)
    assert [r["strategy"] for r in rows] == list(prof.PEERS_PROFILED)
    ours = rows[0]
    assert ours["main_kernel"] == "split<64>" and ours["tensor_pipe_pct"] == 55.5 and ours["duration_ns"] == 30_000.0
    assert ours["total_duration_ns"] == 32_500.0 and len(ours["launches"]) == 3 and "error" not in ours
    assert "application crashed" in rows[2]["error"] and "main_kernel" not in rows[2]
    validate_rows("fused_decode_profile", rows)


def test_tuning_candidates_cover_the_roads_not_taken():
    c16, c64 = candidates(16), candidates(64)
    assert len(set(c16)) == len(c16) and len(set(c64)) == len(c64)
    assert any(c.pairs for c in c16) and any(not c.pairs for c in c16)
    assert any(c.pairs for c in c64) and any(not c.pairs for c in c64)
    assert all(c.block_h == 16 for c in c16) and {c.block_h for c in c64} >= {32, 64}


def test_compiled_loop_shows_byte_wise_shared_loads():
    """Chapter 5's evidence: the split kernel compiled for sm_90 (no GPU needed) reads FP8 from shared memory a
    byte at a time in its main loop, and its dots are tensor-core instructions."""
    mix = loop_instruction_mix(config=MLADecodeConfig(16, 64, 4, 2))
    assert mix["byte_loads"] > 0 and mix["counts"]["mma.sync"] > 0 and mix["counts"]["cp.async"] > 0
    assert mix["total"] == sum(mix["counts"].values()) > 500


# ----------------------------------------------------------------------------------------------
# What the experiments stand on: the stopwatches' contracts, accuracy helpers, the peers' loaders
# ----------------------------------------------------------------------------------------------


def test_host_timer_counts_calls_and_graph_timer_refuses_a_cpu():
    calls = []
    us = timing.host_us_per_call(lambda: calls.append(1), CPU, calls=7)
    assert len(calls) == 8 and us > 0  # one warm-up call, then the timed ones
    assert timing.bench_ms(lambda: sum(range(1000)), CPU, rep_ms=1) > 0
    with pytest.raises(RuntimeError, match=f"NVIDIA GPU.*{CPU}"):
        timing.graph_ms([lambda: None], CPU)
    with pytest.raises(RuntimeError, match="tensor cores"):
        timing.matmul_tflops(CPU)


def test_accuracy_helpers():
    want = torch.tensor([3.0, 4.0])
    assert relative_error(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1)
    assert relative_error(torch.zeros(2), torch.zeros(2)) == 0.0 and relative_error(want, torch.zeros(2)) == math.inf
    assert finite_or_none(float("nan")) is None and finite_or_none(math.inf) is None and finite_or_none(2) == 2.0
    a = torch.tensor([float("nan"), -0.0], dtype=torch.bfloat16)
    assert same_bits(a, a.clone()) and not same_bits(a, torch.tensor([float("nan"), 0.0], dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="16-bit"):
        bf16_bits(torch.zeros(2))


def test_memcheck_row_without_the_tool(monkeypatch):
    monkeypatch.setattr(sanitizer.shutil, "which", lambda tool: None)
    row = sanitizer.memcheck_row("kvwall.kernels.gather.sanitize", 10)
    assert row["ran"] is False and row["passed"] is None and "not found" in row["summary"]


def test_the_validation_runs_memcheck_on_every_path_the_device_runs(monkeypatch):
    """The sanitizer row runs the program with --paths naming the kernel paths that run on the device (on a CPU the
    Triton path; on an H100 / H200 all three) and says which."""
    from kvwall.kernels.mla_decode import sanitize

    calls = []
    monkeypatch.setattr(
        validation,
        "memcheck_row",
        lambda module, timeout_s, args=(): (
            calls.append((module, timeout_s, list(args))) or {"section": "sanitizer", "passed": True}
        ),
    )
    assert validation.sanitizer_row(CPU, 30) == {"section": "sanitizer", "passed": True, "paths": ["triton"]}
    monkeypatch.setattr(sanitize.wgmma_path, "wgmma_refusal", lambda device: None)  # as on an H100 / H200
    assert validation.sanitizer_row(CPU, 30)["paths"] == ["triton", "wgmma", "wgmma_tokens"]
    assert calls == [
        ("kvwall.kernels.mla_decode.sanitize", 30, ["--paths", "triton"]),
        ("kvwall.kernels.mla_decode.sanitize", 30, ["--paths", "triton", "wgmma", "wgmma_tokens"]),
    ]


def test_flashmla_page_table_and_a_missing_wheel(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    table, seqlens = flashmla.random_page_table([1, 64, 65, 0], 10, gen, CPU)
    assert seqlens.tolist() == [1, 64, 65, 0] and table.shape == (4, 2) and table.dtype == torch.int32
    used = [int(p) for row, n in zip(table.tolist(), [1, 1, 2, 0]) for p in row[:n]]
    assert len(set(used)) == len(used) == 4 and max(used) < 10  # distinct pages of the pool
    big, _ = flashmla.random_page_table([64 * 11], 10, gen, CPU)  # more pages than the pool: repeats, in range
    assert big.shape == (1, 11) and 0 <= int(big.min()) and int(big.max()) < 10
    monkeypatch.setattr(flashmla, "_FLASH_MLA", {"error": "flash_mla import failed: not here"})
    q = torch.zeros(1, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not here"):
        flashmla.FlashMLADecode(
            q, q[..., :64], torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16), table[:1], seqlens[:1], 0.1
        )

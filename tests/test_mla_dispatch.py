"""Ours -- the dispatcher between the paths of the fused FP8 MLA decode (kvwall.kernels.mla_decode.dispatch) --
its measured table (kernels/mla_decode/paths.json), and the contracts every path keeps, each one test body
parametrized over the paths ("triton", "wgmma", "wgmma_tokens"), skipped with a reason where a path cannot run here.

The rule (choose_path / decide_path): the Triton path where the wgmma paths cannot run (not compute capability 9.0,
other widths, misaligned rows); else the measured entry of this GPU, else one of the same compute capability, the
fastest path timed at the nearest point; with no entry, the tokens-on-M wgmma path up to 32 heads, the wgmma path
above. A table point is [heads, context, batch, path, triton_us, wgmma_us, wgmma_tokens_us]; a six-element point
(the format before the tokens-on-M path) has no tokens-on-M time.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.cases import SM_SCALE
from kvwall.kernels.mla_decode.dispatch import (KERNEL_PATHS, PATHS_FILE, choose_path, decide_path, measured_choice,
                                                mla_decode, path_of_plan, path_point, plan_mla_decode_auto,
                                                table_entry)
from kvwall.kernels.mla_decode.kernel import MLADecodePlan, mla_decode_fp8
from kvwall.kernels.mla_decode.reference import make_mla_inputs

DC, DR = 512, 64
FP8 = torch.float8_e4m3fn
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
TABLE = {H200: {"by": "test", "recorded": "test", "capability": [9, 0], "points": [
    path_point(16, 4096, 1, 15.0, 18.0), path_point(16, 131072, 64, 620.0, 570.0),
    path_point(128, 32768, 32, 700.0, 220.0)]}}
#: A table with the tokens-on-M time: faster at 16 heads and batch 32, slower at 128 heads, not timed at one point;
#: and one point in the six-element format of before (no tokens-on-M time).
TABLE3 = {H200: {"by": "test", "recorded": "test", "capability": [9, 0], "points": [
    path_point(16, 4096, 1, 15.0, 18.0, 12.0), path_point(16, 131072, 32, 320.0, 314.0, 224.0),
    path_point(32, 131072, 1, 89.0, 57.0, None), path_point(128, 32768, 32, 700.0, 220.0, 400.0),
    [64, 32768, 8, "wgmma", 98.25, 54.45]]}}


# ----------------------------------------------------------------------------------------------
# The rule and the table (no GPU needed)
# ----------------------------------------------------------------------------------------------

def test_a_point_names_the_faster_path():
    assert path_point(16, 64, 1, 9.876, 8.951) == [16, 64, 1, "wgmma", 9.88, 8.95, None]
    assert path_point(16, 131072, 1, 50.11, 53.48)[3] == "triton"
    assert path_point(16, 4096, 1, 15.0, None) == [16, 4096, 1, "triton", 15.0, None, None]


def test_a_point_names_the_fastest_of_three_paths():
    assert path_point(16, 131072, 32, 320.4, 314.01, 224.333) == [16, 131072, 32, "wgmma_tokens", 320.4, 314.01,
                                                                  224.33]
    assert path_point(128, 32768, 32, 751.4, 222.95, 400.0)[3] == "wgmma"
    assert path_point(16, 131072, 1, 49.82, 54.52, 50.0)[3] == "triton"
    assert path_point(16, 64, 1, 9.0, None, 8.0) == [16, 64, 1, "wgmma_tokens", 9.0, None, 8.0]
    assert path_point(16, 64, 1, 9.0, 9.0, 9.0)[3] == "triton"  # a tie: the earlier path
    assert path_point(16, 64, 1, 9.5, 9.0, 9.0)[3] == "wgmma"


def test_measured_choice_takes_the_nearest_point_in_log_scale():
    entry = TABLE[H200]
    assert measured_choice(entry, 16, 1, 3000)[0] == "triton"
    assert measured_choice(entry, 16, 48, 100_000)[0] == "wgmma"
    assert measured_choice(entry, 100, 40, 40_000)[1][0] == 128
    assert measured_choice({"points": [path_point(16, 4096, 1, 15.0, None)]}, 16, 1, 4096)[0] == "triton"
    assert measured_choice({}, 16, 1, 1) is None


def test_measured_choice_reads_the_third_time_and_old_points():
    entry = TABLE3[H200]
    assert measured_choice(entry, 16, 1, 4096)[0] == "wgmma_tokens"
    assert measured_choice(entry, 16, 32, 131072)[0] == "wgmma_tokens"
    assert measured_choice(entry, 32, 1, 131072)[0] == "wgmma"  # the tokens-on-M path not timed there
    assert measured_choice(entry, 128, 32, 32768)[0] == "wgmma"
    path, point = measured_choice(entry, 64, 8, 32768)  # a six-element point: no tokens-on-M time
    assert path == "wgmma" and len(point) == 6


def test_the_synthetic_table_decides_with_the_third_time():
    path, why = decide_path(16, 32, 131072, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma_tokens" and why.startswith(
        "tokens-on-M wgmma: measured triton 320.0 µs, wgmma 314.0 µs, wgmma_tokens 224.0 µs at the nearest point "
        "(16 heads, 131072 tokens, batch 32)")
    path, why = decide_path(64, 8, 32768, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma" and "wgmma_tokens" not in why
    on_h100 = decide_path(16, 1, 4096, gpu=H100, capability=(9, 0), refusal=None, table=TABLE3)
    assert on_h100[0] == "wgmma_tokens" and "the same compute capability" in on_h100[1]
    refusal = "compute capability 10.0: the wgmma path is built for sm_90a (9.0) only"
    assert decide_path(16, 32, 131072, gpu="NVIDIA B200", capability=(10, 0), refusal=refusal,
                       table=TABLE3)[0] == "triton"


def test_choose_path_reads_a_paths_json_with_the_third_time(tmp_path, monkeypatch):
    """choose_path on a (pretended) H200 with a paths.json file holding the tokens-on-M times: the file's fastest
    path at the nearest point, and the Triton path for misaligned rows whatever the file says."""
    table_file = tmp_path / "paths.json"
    table_file.write_text(json.dumps(TABLE3))
    monkeypatch.setattr(dispatch.wgmma_path, "wgmma_refusal", lambda device: None)
    monkeypatch.setattr(dispatch, "gpu_name", lambda device: H200)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda", 0)
    assert choose_path(16, 32, 131072, cuda, table_file=table_file)[0] == "wgmma_tokens"
    assert choose_path(128, 32, 32768, cuda, table_file=table_file)[0] == "wgmma"
    raw = torch.zeros(256 * 577 + 16, dtype=torch.uint8)
    odd = raw[1:1 + 256 * 577].view(-1, 577).view(FP8)
    path, why = choose_path(16, 32, 131072, cuda, ckv_cache=odd[:, :DC], kpe_cache=odd[:, DC:DC + DR],
                            table_file=table_file)
    assert path == "triton" and "16-byte" in why
    assert choose_path(16, 1, 4096, cuda, dims=(256, 64), table_file=table_file)[0] == "triton"


def test_the_table_is_looked_up_by_gpu_name():
    path, why = decide_path(16, 1, 4096, gpu=H200, capability=(9, 0), refusal=None, table=TABLE)
    assert path == "triton" and why.startswith("Triton: measured triton 15.0 µs, wgmma 18.0 µs") and H200 in why
    assert "same compute capability" not in why
    path, why = decide_path(128, 32, 32768, gpu=H200, capability=(9, 0), refusal=None, table=TABLE)
    assert path == "wgmma" and "(128 heads, 32768 tokens, batch 32)" in why


def test_a_gpu_without_an_entry_uses_the_entry_of_its_compute_capability():
    """An H100 runs the H200's crossovers: the same point gives the same path, and the reason says whose table."""
    assert table_entry(TABLE, H100, (9, 0)) == (H200, TABLE[H200])
    assert table_entry(TABLE, H100, (10, 0)) is None and table_entry(TABLE, H100, None) is None
    for point in TABLE[H200]["points"]:
        on_h100 = decide_path(point[0], point[2], point[1], gpu=H100, capability=(9, 0), refusal=None, table=TABLE)
        assert on_h100[0] == point[3] and f"on {H200} (the same compute capability as this {H100})" in on_h100[1]


def test_without_a_table_the_capability_rule_decides():
    """The tokens-on-M wgmma path up to 32 heads (faster than the heads-on-M path at every 16- and 32-head point
    measured), the wgmma path above."""
    path, why = decide_path(16, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table={})
    assert path == "wgmma_tokens" and "no measured table" in why and "capability rule" in why
    assert decide_path(32, 8, 4096, gpu=H100, capability=(9, 0), refusal=None, table={})[0] == "wgmma_tokens"
    assert decide_path(33, 8, 4096, gpu=H100, capability=(9, 0), refusal=None, table={})[0] == "wgmma"
    path, why = decide_path(128, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table={})
    assert path == "wgmma" and "capability rule" in why
    other = {"NVIDIA B200": {**TABLE[H200], "capability": [10, 0]}}
    assert decide_path(16, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table=other)[0] == "wgmma_tokens"
    assert decide_path(64, 1, 131072, gpu=H100, capability=(9, 0), refusal=None, table=other)[0] == "wgmma"


def test_where_wgmma_cannot_run_the_triton_path_runs_whatever_the_table_says():
    refusal = "compute capability 12.0: the wgmma path is built for sm_90a (9.0) only"
    path, why = decide_path(128, 32, 32768, gpu="NVIDIA RTX PRO 6000", capability=(12, 0), refusal=refusal,
                            table=TABLE)
    assert path == "triton" and why == f"Triton: the wgmma paths cannot run this call ({refusal})"
    assert decide_path(16, 1, 4096, gpu="NVIDIA RTX PRO 6000", capability=(12, 0), refusal=refusal,
                       table=TABLE3)[0] == "triton"


def test_misaligned_rows_go_to_the_triton_path():
    """Rows 577 bytes apart, one byte past a 16-byte boundary: the wgmma path's 16-byte loads cannot read them."""
    raw = torch.zeros(256 * 577 + 16, dtype=torch.uint8)
    odd = raw[1:1 + 256 * 577].view(-1, 577).view(FP8)
    refusal = wgmma_path.rows_refusal((DC, DR), {"ckv_cache": odd[:, :DC], "kpe_cache": odd[:, DC:DC + DR]})
    assert refusal and refusal.startswith("ckv_cache: the wgmma path loads 16-byte pieces")
    path, why = decide_path(128, 32, 32768, gpu=H200, capability=(9, 0), refusal=refusal, table=TABLE)
    assert path == "triton" and "16-byte" in why
    assert wgmma_path.rows_refusal((DC, DR), {"ckv_cache": raw[16:16 + 256 * 576].view(-1, 576).view(FP8)}) is None


def test_on_cpu_the_dispatcher_runs_the_triton_path():
    path, why = choose_path(16, 1, 131072, torch.device("cpu"))
    assert path == "triton" and "cannot run" in why and "tensors are on cpu" in why
    inp = make_mla_inputs([7, 65, 0], 3, seed=5, layout="pool_view", pool_slots=512, device="cpu")
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    plan = plan_mla_decode_auto(inp.kv_indptr, heads=3)
    assert type(plan) is MLADecodePlan
    want = mla_decode_fp8(*args, plan=plan)
    assert torch.equal(mla_decode(*args, plan=plan), want)
    assert torch.equal(mla_decode(*args), want)


def test_a_bad_path_name_is_refused():
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    for bad in ("fast", "cuda", "tokens"):
        with pytest.raises(ValueError, match="path must be 'auto' or one of 'triton', 'wgmma', 'wgmma_tokens'"):
            mla_decode(*args, path=bad)
        with pytest.raises(ValueError, match="path must be 'auto' or one of 'triton', 'wgmma', 'wgmma_tokens'"):
            plan_mla_decode_auto(inp.kv_indptr, heads=16, path=bad)


def test_each_plan_names_its_path_and_the_dispatcher_routes_by_it():
    """plan_mla_decode_auto makes each path's own plan; mla_decode sends a plan to its path's call (on a CPU the
    wgmma paths refuse, under their own names, before any launch)."""
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    kinds = {"triton": MLADecodePlan, "wgmma": wgmma_path.WgmmaPlan, "wgmma_tokens": tokens_path.WgmmaTokensPlan}
    for path in KERNEL_PATHS:
        plan = plan_mla_decode_auto(inp.kv_indptr, heads=16, path=path)
        assert type(plan) is kinds[path] and path_of_plan(plan) == path
    tokens_plan = plan_mla_decode_auto(inp.kv_indptr, heads=16, path="wgmma_tokens")
    assert tokens_plan.config.block_h == 16 and tokens_plan.config.block_n == 64
    with pytest.raises(ValueError, match="^mla_decode_fp8_wgmma_tokens: the wgmma path cannot run here"):
        mla_decode(*args, plan=tokens_plan)
    with pytest.raises(ValueError, match="^mla_decode_fp8_wgmma_tokens: the wgmma path cannot run here"):
        mla_decode(*args, path="wgmma_tokens")
    with pytest.raises(ValueError, match="^mla_decode_fp8_wgmma: the wgmma path cannot run here"):
        mla_decode(*args, plan=plan_mla_decode_auto(inp.kv_indptr, heads=16, path="wgmma"))


def test_the_shipped_table_is_in_todays_format():
    """Every GPU entry names its compute capability; every point is [heads, context, batch, path, triton_us,
    wgmma_us, wgmma_tokens_us] with ``path`` the fastest of the times."""
    table = json.loads(PATHS_FILE.read_text())
    assert table
    for gpu, entry in table.items():
        assert {"by", "recorded", "capability", "points"} <= set(entry), gpu
        assert len(entry["capability"]) == 2 and all(isinstance(x, int) for x in entry["capability"]), gpu
        for point in entry["points"]:
            h, c, b, path, *times = point
            assert len(times) == len(KERNEL_PATHS) and path in KERNEL_PATHS
            assert path_point(h, c, b, *times) == point


# ----------------------------------------------------------------------------------------------
# The contracts both paths keep: one body each, parametrized over the paths
# ----------------------------------------------------------------------------------------------

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _device(path: str, *, gpu_only: bool = False) -> torch.device:
    """Where ``path`` runs here (the Triton path on the CPU in its interpreter, unless ``gpu_only``), else skip."""
    if path in ("wgmma", "wgmma_tokens"):
        if not _hopper():
            pytest.skip(f"the {path} path needs an H100 / H200 (sm_90a code)")
        if shutil.which("nvcc") is None:
            pytest.skip("no nvcc on this machine: the wgmma path is built at first use")
        return torch.device("cuda", torch.cuda.current_device())
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if gpu_only:
        pytest.skip("CUDA graphs need an NVIDIA GPU")
    return torch.device("cpu")


def _inputs(device: torch.device, layout: str, heads: int = 16):
    small = device.type == "cpu"
    inp = make_mla_inputs([30, 50, 9] if small else [300, 5000, 70], heads, seed=3, layout=layout,
                          page_size=16 if small else 64, pool_slots=4096 if small else 100_000, device=device)
    page_size = inp.ckv_cache.shape[1] if layout == "paged" else 1
    return inp, page_size, (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr)


@pytest.mark.parametrize("layout", ["pool_view", "paged"])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_an_unchecked_out_of_range_index_makes_exactly_its_request_nan(path, layout):
    """Request 1 gets an index outside the cache in an unchecked planned call: its rows are NaN, the other
    requests' rows are the bits of the same call with valid indices."""
    device = _device(path)
    inp, page_size, args = _inputs(device, layout)
    plan = plan_mla_decode_auto(inp.kv_indptr, inp.kv_len, heads=16, page_size=page_size, device=device, path=path)
    for bad in (10**8, -1):
        idx = inp.kv_indices.clone()
        idx[int(inp.kv_indptr[1]) + 2] = bad
        out = mla_decode(*args, idx, SM_SCALE, kv_len=inp.kv_len, check_range=False, plan=plan)
        clean = mla_decode(*args, inp.kv_indices, SM_SCALE, kv_len=inp.kv_len, check_range=False, plan=plan)
        assert [bool(out[b].isnan().all()) for b in range(3)] == [False, True, False]
        assert [bool(out[b].isnan().any()) for b in range(3)] == [False, True, False]
        assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2]) and not clean.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["pool_view", "paged"])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_planned_call_replayed_in_a_cuda_graph_equals_the_eager_call(path, layout):
    """Captured once, the graph replays what an eager call computes, bit for bit, also after the query and the
    scale tensors it reads change in place."""
    device = _device(path, gpu_only=True)
    inp, page_size, args = _inputs(device, layout)
    plan = plan_mla_decode_auto(inp.kv_indptr, inp.kv_len, heads=16, page_size=page_size, device=device, path=path)
    scales = dict(ckv_scale=torch.tensor([0.37], device=device), kpe_scale=torch.tensor([0.74], device=device))
    kw = dict(kv_len=inp.kv_len, check_range=False, plan=plan, **scales)
    eager = mla_decode(*args, inp.kv_indices, SM_SCALE, **kw)
    graphed = torch.empty_like(eager)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the capture (the Triton kernels compile here)
        mla_decode(*args, inp.kv_indices, SM_SCALE, out=graphed, **kw)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(*args, inp.kv_indices, SM_SCALE, out=graphed, **kw)
    graphed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(graphed, eager)
    inp.q_nope.mul_(-0.5)
    scales["ckv_scale"].fill_(1.5)
    scales["kpe_scale"].fill_(0.75)
    graphed.fill_(float("nan"))
    graph.replay()
    changed = mla_decode(*args, inp.kv_indices, SM_SCALE, **kw)
    torch.cuda.synchronize(device)
    assert torch.equal(graphed, changed) and not torch.equal(changed, eager)


_CALL = {"triton": mla_decode_fp8, "wgmma": wgmma_path.mla_decode_fp8_wgmma,
         "wgmma_tokens": tokens_path.mla_decode_fp8_wgmma_tokens}
_PLANNER = {"triton": r"plan_mla_decode \(the Triton path\)", "wgmma": "plan_mla_decode_wgmma,",
            "wgmma_tokens": "plan_mla_decode_wgmma_tokens,"}


@pytest.mark.parametrize("other", KERNEL_PATHS)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_plan_of_another_path_is_refused(path, other):
    """By the dispatcher (a plan forced onto another path: any machine) and by the path's own call (before any
    launch, where the path runs)."""
    if other == path:
        pytest.skip("a path's own plan")
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    plan = plan_mla_decode_auto(inp.kv_indptr, heads=16, path=other)
    with pytest.raises(ValueError, match=f"the plan is for the {other} path, but path='{path}'"):
        mla_decode(*args, plan=plan, path=path)
    device = _device(path)
    inp, _, args = _inputs(device, "pool_view")
    plan = plan_mla_decode_auto(inp.kv_indptr, heads=16, device=device, path=other)
    with pytest.raises(TypeError, match=f"plan must come from {_PLANNER[path]}"):
        _CALL[path](*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_an_unchecked_call_without_a_plan(path):
    """The wgmma paths refuse it (their plan is made once per step, outside graph capture); the Triton path runs its
    uniform launch, the same as the checked call's result to float32 rounding of the splits."""
    device = _device(path)
    inp, _, args = _inputs(device, "pool_view")
    if path != "triton":
        with pytest.raises(ValueError, match=f"needs plan= from {_PLANNER[path][:-1]}"):
            mla_decode(*args, inp.kv_indices, SM_SCALE, path=path, check_range=False)
        return
    out = mla_decode(*args, inp.kv_indices, SM_SCALE, path=path, check_range=False, num_splits=1)
    assert torch.equal(out, mla_decode(*args, inp.kv_indices, SM_SCALE, path=path, num_splits=1))


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_misaligned_cache_rows(path):
    """Rows 577 bytes apart starting one byte past a 16-byte boundary: the wgmma paths refuse them before any launch
    (naming the Triton path), the Triton path reads them, and "auto" routes them to the Triton path."""
    device = _device(path)
    inp, _, _ = _inputs(device, "pool_view")
    slots = inp.ckv_cache.shape[0]
    gen = torch.Generator(device=device).manual_seed(7)
    raw = torch.randint(0, 0x70, (slots * 577 + 16,), generator=gen, dtype=torch.uint8, device=device)  # no NaN
    odd = raw[1:1 + slots * 577].view(-1, 577).view(FP8)
    args = (inp.q_nope, inp.q_pe, odd[:, :DC], odd[:, DC:DC + DR], inp.kv_indptr, inp.kv_indices, SM_SCALE)
    if path != "triton":
        with pytest.raises(ValueError, match=r"ckv_cache: the wgmma path loads 16-byte pieces.*row stride 577"):
            mla_decode(*args, path=path)
        assert torch.equal(mla_decode(*args), mla_decode(*args, path="triton"))  # auto: the Triton path
        return
    assert torch.isfinite(mla_decode(*args, path=path)).all()


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

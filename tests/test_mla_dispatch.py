"""Ours -- the dispatcher between the paths of the fused FP8 MLA decode (kvwall.kernels.mla_decode.dispatch) --
its measured table (kernels/mla_decode/paths.json), and the contracts every path keeps, each one test body
parametrized over the paths ("triton", "wgmma", "wgmma_tokens"), skipped with a reason where a path cannot run here.

The rule (choose_path / decide_path): the Triton path where the wgmma paths cannot run (not compute capability 9.0,
other widths, misaligned rows); else the measured entry of this GPU, else one of the same compute capability, the
fastest path timed at the nearest point; with no entry, the tokens-on-M wgmma path up to 32 heads, the wgmma path
above. A table point is [heads, context, batch, path] (kernels.mla_decode.path_table); the times behind it are in the
sidecar paths_measured.json, which the dispatcher does not read.
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
from kvwall.kernels.mla_decode.dispatch import choose_path, mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.path_table import (KERNEL_PATHS, PATHS_FILE, decide_path, fastest, measured_choice,
                                                  path_point, table_entry, table_text)
from kvwall.kernels.mla_decode.kernel import MLADecodePlan, mla_decode_fp8, plan_mla_decode_triton
from kvwall.kernels.mla_decode.reference import make_mla_inputs

DC, DR = 512, 64
FP8 = torch.float8_e4m3fn
H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
TABLE = {H200: {"capability": [9, 0], "page_size": 1, "points": [
    path_point(16, 4096, 1, 15.0, 18.0), path_point(16, 131072, 64, 620.0, 570.0),
    path_point(128, 32768, 32, 700.0, 220.0)]}}
#: A table with the tokens-on-M path: fastest at 16 heads, slower at 128 heads, not timed at one point; and one point
#: as tables before the split wrote it (its times after the path: read alike, by its path).
TABLE3 = {H200: {"capability": [9, 0], "page_size": 1, "points": [
    path_point(16, 4096, 1, 15.0, 18.0, 12.0), path_point(16, 131072, 32, 320.0, 314.0, 224.0),
    path_point(32, 131072, 1, 89.0, 57.0, None), path_point(128, 32768, 32, 700.0, 220.0, 400.0),
    [64, 32768, 8, "wgmma", 98.25, 54.45]]}}

# ----------------------------------------------------------------------------------------------
# The rule and the table (no GPU needed)
# ----------------------------------------------------------------------------------------------

def test_a_point_names_the_faster_path():
    assert path_point(16, 64, 1, 9.876, 8.951) == [16, 64, 1, "wgmma"]
    assert path_point(16, 131072, 1, 50.11, 53.48) == [16, 131072, 1, "triton"]
    assert path_point(16, 4096, 1, 15.0, None) == [16, 4096, 1, "triton"]


def test_a_point_names_the_fastest_of_three_paths():
    assert path_point(16, 131072, 32, 320.4, 314.01, 224.333) == [16, 131072, 32, "wgmma_tokens"]
    assert path_point(128, 32768, 32, 751.4, 222.95, 400.0)[3] == "wgmma"
    assert path_point(16, 131072, 1, 49.82, 54.52, 50.0)[3] == "triton"
    assert path_point(16, 64, 1, 9.0, None, 8.0) == [16, 64, 1, "wgmma_tokens"]
    assert path_point(16, 64, 1, 9.0, 9.0, 9.0)[3] == "triton"  # a tie: the earlier path
    assert path_point(16, 64, 1, 9.5, 9.0, 9.0)[3] == "wgmma"
    assert path_point(16, 64, 1, 9.0, 9.004, None)[3] == "triton"  # compared at 0.01 µs, as the sidecar keeps them
    assert fastest({"triton": None, "wgmma": 3.0, "wgmma_tokens": None}) == "wgmma"
    with pytest.raises(ValueError, match="no path was timed"):
        fastest({"triton": None})


def test_measured_choice_takes_the_nearest_point_in_log_scale():
    entry = TABLE[H200]
    assert measured_choice(entry, 16, 1, 3000) == ("triton", [16, 4096, 1, "triton"])
    assert measured_choice(entry, 16, 48, 100_000)[0] == "wgmma"
    assert measured_choice(entry, 100, 40, 40_000)[1][0] == 128
    assert measured_choice({"points": [path_point(16, 4096, 1, 15.0, None)]}, 16, 1, 4096)[0] == "triton"
    assert measured_choice({}, 16, 1, 1) is None


def test_measured_choice_reads_the_choice_and_old_points():
    """The dispatcher reads the path each point names, nothing else; a point written before the table was split
    (times after the path) names it at the same place."""
    entry = TABLE3[H200]
    assert measured_choice(entry, 16, 1, 4096)[0] == "wgmma_tokens"
    assert measured_choice(entry, 16, 32, 131072)[0] == "wgmma_tokens"
    assert measured_choice(entry, 32, 1, 131072)[0] == "wgmma"  # the tokens-on-M path not timed there
    assert measured_choice(entry, 128, 32, 32768)[0] == "wgmma"
    path, point = measured_choice(entry, 64, 8, 32768)
    assert path == "wgmma" and len(point) == 6


def test_the_synthetic_table_decides_with_the_third_path():
    path, why = decide_path(16, 32, 131072, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma_tokens" and why == ("tokens-on-M wgmma: measured fastest at the nearest point "
                                              f"(16 heads, 131072 tokens, batch 32) on {H200}")
    path, why = decide_path(64, 8, 32768, gpu=H200, capability=(9, 0), refusal=None, table=TABLE3)
    assert path == "wgmma" and "µs" not in why
    on_h100 = decide_path(16, 1, 4096, gpu=H100, capability=(9, 0), refusal=None, table=TABLE3)
    assert on_h100[0] == "wgmma_tokens" and "the same compute capability" in on_h100[1]
    refusal = "compute capability 10.0: the wgmma path is built for sm_90a (9.0) only"
    assert decide_path(16, 32, 131072, gpu="NVIDIA B200", capability=(10, 0), refusal=refusal,
                       table=TABLE3)[0] == "triton"


def test_choose_path_reads_a_paths_json_with_the_third_path(tmp_path, monkeypatch):
    """choose_path on a (pretended) H200 with a paths.json file naming the tokens-on-M path: the file's choice at the
    nearest point, and the Triton path for misaligned rows whatever the file says."""
    table_file = tmp_path / "paths.json"
    table_file.write_text(table_text(TABLE3))
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
    assert path == "triton" and why == ("Triton: measured fastest at the nearest point (16 heads, 4096 tokens, batch 1) "
                                        f"on {H200}")
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
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=3, sm_scale=SM_SCALE)
    assert plan.path == "triton" and type(plan.work) is MLADecodePlan and "cannot run" in plan.why
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache)
    want = mla_decode_fp8(*args, inp.kv_indptr, inp.kv_indices, SM_SCALE, plan=plan.work)
    assert torch.equal(mla_decode(*args, plan), want)


def test_a_bad_path_name_is_refused():
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    for bad in ("fast", "cuda", "tokens"):
        with pytest.raises(ValueError, match="path must be 'auto' or one of 'triton', 'wgmma', 'wgmma_tokens'"):
            plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path=bad)


def test_each_forced_path_plans_its_own_work_list_and_names_it(monkeypatch):
    """A forced path's plan holds that path's work list (the tokens-on-M path: 16 rows x 64 tokens a CTA); where a
    Hopper path cannot run, forcing it is refused at plan time, before any launch."""
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    with pytest.raises(ValueError, match="^plan_mla_decode: the tokens-on-M wgmma path cannot run here"):
        plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path="wgmma_tokens")
    monkeypatch.setattr(wgmma_path, "wgmma_refusal", lambda device: None)
    kinds = {"triton": MLADecodePlan, "wgmma": wgmma_path.WgmmaPlan, "wgmma_tokens": tokens_path.WgmmaTokensPlan}
    for path in KERNEL_PATHS:
        plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path=path)
        assert type(plan.work) is kinds[path] and plan.path == path and "forced" in plan.why
    tokens = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path="wgmma_tokens")
    assert tokens.work.config.block_h == 16 and tokens.work.config.block_n == 64
    assert tokens.launch.startswith("tokens-on-M wgmma: 16 rows a CTA")


def test_the_shipped_table_holds_only_choices_and_its_sidecar_the_times():
    """paths.json: per GPU its compute capability, page size and points [heads, context, batch, path], nothing else
    (so re-timing without a changed choice rewrites the same bytes); the sidecar has the times at the same points, in
    the same order, and each choice is the fastest of them; the file is as the writer writes it."""
    from kvwall.experiments.fused_decode.paths import MEASURED_COLUMNS, MEASURED_FILE

    text = PATHS_FILE.read_text()
    table, measured = json.loads(text), json.loads(MEASURED_FILE.read_text())
    assert table and text == table_text(table) and set(measured) == set(table)
    for gpu, entry in table.items():
        assert set(entry) == {"capability", "page_size", "points"}, gpu
        assert len(entry["capability"]) == 2 and all(isinstance(x, int) for x in entry["capability"]), gpu
        times = measured[gpu]
        assert {"by", "recorded", "page_size", "columns", "points"} <= set(times)
        assert times["page_size"] == entry["page_size"]
        assert times["columns"] == list(MEASURED_COLUMNS) and len(times["points"]) == len(entry["points"])
        for point, timed in zip(entry["points"], times["points"]):
            assert len(point) == 4 and point[3] in KERNEL_PATHS and timed[:3] == point[:3]
            assert path_point(*timed) == point


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


def _plan(inp, page_size: int, path: str, heads: int = 16):
    return plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=heads, sm_scale=SM_SCALE, kv_len=inp.kv_len,
                           page_size=page_size, path=path, ckv_cache=inp.ckv_cache, kpe_cache=inp.kpe_cache)


@pytest.mark.parametrize("layout", ["pool_view", "paged"])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_an_out_of_range_index_written_after_the_plan_makes_exactly_its_request_nan(path, layout):
    """The plan checked the page table; an index the engine writes into it afterwards (the plan keeps the table by
    reference, as a graph replay reads it) that falls outside the cache makes request 1's rows NaN, and the other
    requests' rows are the bits of the same call with valid indices."""
    device = _device(path)
    inp, page_size, args = _inputs(device, layout)
    plan = _plan(inp, page_size, path)
    clean = mla_decode(*args[:4], plan)
    for bad in (10**8, -1):
        keep = inp.kv_indices.clone()
        inp.kv_indices[int(inp.kv_indptr[1]) + 2] = bad
        out = mla_decode(*args[:4], plan)
        inp.kv_indices.copy_(keep)
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
    plan = _plan(inp, page_size, path)
    scales = dict(ckv_scale=torch.tensor([0.37], device=device), kpe_scale=torch.tensor([0.74], device=device))
    eager = mla_decode(*args[:4], plan, **scales)
    graphed = torch.empty_like(eager)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the capture (the Triton kernels compile here)
        mla_decode(*args[:4], plan, out=graphed, **scales)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(*args[:4], plan, out=graphed, **scales)
    graphed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(device)
    assert torch.equal(graphed, eager)
    inp.q_nope.mul_(-0.5)
    scales["ckv_scale"].fill_(1.5)
    scales["kpe_scale"].fill_(0.75)
    graphed.fill_(float("nan"))
    graph.replay()
    changed = mla_decode(*args[:4], plan, **scales)
    torch.cuda.synchronize(device)
    assert torch.equal(graphed, changed) and not torch.equal(changed, eager)


_CALL = {"triton": mla_decode_fp8, "wgmma": wgmma_path.mla_decode_fp8_wgmma,
         "wgmma_tokens": tokens_path.mla_decode_fp8_wgmma_tokens}
_PLAN = {"triton": plan_mla_decode_triton, "wgmma": wgmma_path.plan_mla_decode_wgmma,
         "wgmma_tokens": tokens_path.plan_mla_decode_wgmma_tokens}
_PLANNER = {"triton": r"plan_mla_decode_triton \(the Triton path\)", "wgmma": "plan_mla_decode_wgmma,",
            "wgmma_tokens": "plan_mla_decode_wgmma_tokens,"}


@pytest.mark.parametrize("other", KERNEL_PATHS)
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_plan_of_another_path_is_refused_by_a_path_called_by_name(path, other):
    """Each path's own call (for tests and benchmarks) refuses another path's work list, before any launch."""
    if other == path:
        pytest.skip("a path's own plan")
    device = _device(path)
    inp, _, args = _inputs(device, "pool_view")
    plan = _PLAN[other](inp.kv_indptr, heads=16, device=device)
    with pytest.raises(TypeError, match=f"plan must come from {_PLANNER[path]}"):
        _CALL[path](*args, inp.kv_indices, SM_SCALE, check_range=False, plan=plan)


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_an_unchecked_call_by_name_without_a_plan(path):
    """The wgmma paths refuse it (their plan is made once per step, outside graph capture); the Triton path runs its
    uniform launch, the same as the checked call's result."""
    device = _device(path)
    inp, _, args = _inputs(device, "pool_view")
    if path != "triton":
        with pytest.raises(ValueError, match=f"needs plan= from {_PLANNER[path][:-1]}"):
            _CALL[path](*args, inp.kv_indices, SM_SCALE, check_range=False)
        return
    out = mla_decode_fp8(*args, inp.kv_indices, SM_SCALE, check_range=False, num_splits=1)
    assert torch.equal(out, mla_decode_fp8(*args, inp.kv_indices, SM_SCALE, num_splits=1))


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_misaligned_cache_rows(path):
    """Rows 577 bytes apart starting one byte past a 16-byte boundary: forcing a wgmma path on them is refused at
    plan time (naming the Triton path), the Triton path reads them, and "auto" routes them to the Triton path."""
    device = _device(path)
    inp, _, _ = _inputs(device, "pool_view")
    slots = inp.ckv_cache.shape[0]
    gen = torch.Generator(device=device).manual_seed(7)
    raw = torch.randint(0, 0x70, (slots * 577 + 16,), generator=gen, dtype=torch.uint8, device=device)  # no NaN
    odd = raw[1:1 + slots * 577].view(-1, 577).view(FP8)
    ckv, kpe = odd[:, :DC], odd[:, DC:DC + DR]

    def plan(p: str):
        return plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM_SCALE, path=p, ckv_cache=ckv,
                               kpe_cache=kpe)

    if path != "triton":
        with pytest.raises(ValueError, match=r"ckv_cache: the wgmma path loads 16-byte pieces.*row stride 577"):
            plan(path)
        auto = plan("auto")
        assert auto.path == "triton"
        assert torch.equal(mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, auto),
                           mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, plan("triton")))
        return
    assert torch.isfinite(mla_decode(inp.q_nope, inp.q_pe, ckv, kpe, plan(path))).all()


@pytest.mark.parametrize("q,words", [
    (lambda q: q[:0], r"q_nope must be a torch.bfloat16 tensor of shape \(2, 3, 512\)"),
    (lambda q: q.tolist(), "q_nope must be a torch.bfloat16 tensor .* got list"),
    (lambda q: q[0], r"q_nope must be a torch.bfloat16 tensor .* got torch.bfloat16 \(3, 512\)"),
])
def test_a_bad_query_is_refused_in_words(q, words):
    """Issue 24, finding 4: batch 0, a list or a 2-D q_nope is refused by name before any launch."""
    inp = make_mla_inputs([7, 65], 3, seed=5, layout="pool_view", pool_slots=512, device="cpu")
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=3, sm_scale=SM_SCALE)
    with pytest.raises(ValueError, match=f"^mla_decode: {words}"):
        mla_decode(q(inp.q_nope), inp.q_pe, inp.ckv_cache, inp.kpe_cache, plan)
    with pytest.raises(TypeError, match="^plan_mla_decode: kv_indices must be a tensor"):
        plan_mla_decode(inp.kv_indptr, [0, 1], heads=3, sm_scale=SM_SCALE)

"""Ours' front door (``from kvwall.kernels import plan_mla_decode, mla_decode``), on the CPU (Triton interpreter):
one keyword set whatever the path, validation at plan time, shape/dtype/device checks at call time, multi-token
queries (q_len 1..8, causal over the draft) against float64, graph plans refilled in place, and the fall-back to the
Triton path (one warning) where a Hopper library cannot be built.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from conftest import on_hopper
from kvwall.kernels import DecodePlan, mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode import dispatch
from kvwall.kernels.mla_decode.reference import make_mla_inputs
from kvwall.kernels.mla_decode.verify_reference import mla_verify_reference

SM = 1 / 576**0.5
FP8 = torch.float8_e4m3fn


def _queries(batch: int, q_len: int, heads: int, seed: int, spread: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qn = (torch.randn(batch * q_len, heads, 512, generator=g) * spread).to(torch.bfloat16)
    qp = (torch.randn(batch * q_len, heads, 64, generator=g) * spread).to(torch.bfloat16)
    return qn, qp


def _reference64(inp, qn, qp, q_len: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 over the dequantized cache, on the token-level view of the same batch."""
    keep = list(range(inp.kv_indptr.numel() - 1))
    ptr, idx, _ = inp.token_batch(keep)
    ckv = inp.tok_ckv.to(torch.float64) * scale
    kpe = inp.tok_kpe.to(torch.float64) * scale
    return mla_verify_reference(
        qn.double(), qp.double(), ckv, kpe, ptr, idx, SM, q_len=q_len, compute_dtype=torch.float64, return_lse=True
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", ["pool_view", "paged"])
def test_ours_matches_float64_at_every_q_len(q_len, layout):
    """Odd lengths, a request cut into chunks (its last chunk shorter than q_len: rows that see none of it), and a
    request exactly q_len long: within the BF16 output's rounding of float64, the LSE to float32's."""
    lens = [70, q_len, 137, 9 + q_len]
    page = 16 if layout == "paged" else 1
    inp = make_mla_inputs(lens, 16, seed=q_len, layout=layout, page_size=page)
    qn, qp = _queries(len(lens), q_len, 16, seed=10 + q_len)
    plan = plan_mla_decode(
        inp.kv_indptr,
        inp.kv_indices,
        heads=16,
        sm_scale=SM,
        kv_len=inp.kv_len,
        q_len=q_len,
        page_size=page,
        ckv_cache=inp.ckv_cache,
        kpe_cache=inp.kpe_cache,
    )
    assert isinstance(plan, DecodePlan) and plan.path == "triton" and plan.rows == 16 * q_len
    assert plan.work.work_list.max_chunks > 1  # the long request is cut: the combine runs
    out, lse = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, return_lse=True)
    want, want_lse = _reference64(inp, qn, qp, q_len)
    assert out.shape == (len(lens) * q_len, 16, 512) and out.dtype == torch.bfloat16
    assert _rel(out, want) < 4e-3
    assert float((lse.double() - want_lse).abs().max()) < 1e-4


def test_the_causal_mask_is_per_draft_token():
    """Token j of a request sees its first n - (q_len - 1 - j) tokens: changing the last cached token changes the
    last query token's output only."""
    inp = make_mla_inputs([40], 16, seed=5)
    qn, qp = _queries(1, 4, 16, seed=6)
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=4)
    before = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan)
    last = int(inp.kv_indices[39])
    inp.ckv_cache[last] = (inp.ckv_cache[last].float() * -2).to(FP8)
    after = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan)
    changed = [(after[j] != before[j]).any().item() for j in range(4)]
    assert changed == [False, False, False, True]


def test_sharp_softmax_and_scales_stay_accurate():
    """A sharp softmax (queries 10x larger) and per-layer FP8 scales (number and tensor give the same bits)."""
    inp = make_mla_inputs([300, 33], 16, seed=7)
    qn, qp = _queries(2, 2, 16, seed=8, spread=5.0)
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=2)
    out = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, ckv_scale=0.5, kpe_scale=0.5)
    as_tensor = mla_decode(
        qn, qp, inp.ckv_cache, inp.kpe_cache, plan, ckv_scale=torch.tensor([0.5]), kpe_scale=torch.tensor([0.5])
    )
    assert torch.equal(out, as_tensor)
    want, _ = _reference64(inp, qn, qp, 2, scale=0.5)
    assert _rel(out, want) < 4e-3


def test_a_graph_plan_refilled_for_new_lengths_equals_an_eager_plan():
    """A graph plan keeps its buffers (size and address) and is re-cut in place; its output equals a fresh plan's."""
    inp = make_mla_inputs([200, 64, 5], 16, seed=9)
    qn, qp = _queries(3, 2, 16, seed=11)
    graph = plan_mla_decode(
        inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=2, graph_max_len=256, lengths=[256, 256, 256]
    )
    addresses = (graph.work.work.data_ptr(), graph.work.part_o.data_ptr())
    graph.refill([200, 64, 5])
    assert (graph.work.work.data_ptr(), graph.work.part_o.data_ptr()) == addresses
    eager = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=2)
    a = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, graph)
    b = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, eager)
    want, _ = _reference64(inp, qn, qp, 2)
    assert _rel(a, want) < 4e-3 and _rel(b, want) < 4e-3
    with pytest.raises(ValueError, match="graph_max_len"):  # how to make a plan that refills
        eager.refill([200, 64, 5])


def test_host_lengths_mean_no_device_read(monkeypatch):
    """With ``lengths`` the plan reads nothing back from the device; without, it reads once."""
    inp = make_mla_inputs([50, 20], 16, seed=12)
    reads = []
    real = dispatch._host_lengths
    monkeypatch.setattr(dispatch, "_host_lengths", lambda *a, **k: reads.append(1) or real(*a, **k))
    plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, lengths=[50, 20])
    assert reads == []
    plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM)
    assert reads == [1]


@pytest.mark.parametrize(
    "change,kind,words",
    [
        (dict(q_len=9), ValueError, "q_len must be a whole number >= 1, got 9 .and at most 8.; ours takes decode"),
        (dict(q_len=0), ValueError, "q_len must be a whole number >= 1, got 0"),
        (dict(lengths=[50, 1], q_len=2), ValueError, "request 1 holds 1 tokens, fewer than its q_len=2"),
        (dict(lengths=[50]), ValueError, "lengths has 1 entries"),
        (dict(path="cutlass"), ValueError, "path must be 'auto' or one of"),
        (dict(config=object()), ValueError, "config is the Triton path's launch shape"),
        (dict(sm_scale="x"), TypeError, "sm_scale must be a finite Python number"),
        (dict(bad_index=True), IndexError, "kv_indices reach outside the cache"),
        (dict(bad_indptr=True), ValueError, "kv_indptr must start at 0, never decrease"),
    ],
)
def test_the_plan_refuses_bad_input_in_words(change, kind, words):
    inp = make_mla_inputs([50, 20], 16, seed=13)
    indices, indptr = inp.kv_indices.clone(), inp.kv_indptr.clone()
    if change.pop("bad_index", False):
        indices[3] = 10**7
    if change.pop("bad_indptr", False):
        indptr[1] = 80
    args = dict(heads=16, sm_scale=SM, ckv_cache=inp.ckv_cache, kpe_cache=inp.kpe_cache) | change
    with pytest.raises(kind, match=f"^plan_mla_decode: {words}"):
        plan_mla_decode(indptr, indices, **args)


@pytest.mark.parametrize(
    "what,words",
    [
        ("q_rows", "q_nope must be a torch.bfloat16 tensor of shape"),
        ("q_dtype", "q_nope must be a torch.bfloat16 tensor of shape"),
        ("cache_dtype", "ckv_cache must be an FP8 e4m3 tensor"),
        ("out_shape", "out must be a torch.bfloat16 tensor of shape"),
        ("plan", "plan must come from plan_mla_decode"),
    ],
)
def test_the_call_checks_shapes_dtypes_and_devices_before_any_launch(what, words):
    inp = make_mla_inputs([30, 20], 16, seed=14)
    qn, qp = _queries(2, 2, 16, seed=15)
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=2)
    out = torch.full((4, 16, 512), float("nan"), dtype=torch.bfloat16)
    args = [qn, qp, inp.ckv_cache, inp.kpe_cache, plan]
    kw: dict = dict(out=out)
    if what == "q_rows":
        args[0] = qn[:2]
    elif what == "q_dtype":
        args[0] = qn.float()
    elif what == "cache_dtype":
        args[2] = inp.ckv_cache.to(torch.bfloat16)
    elif what == "out_shape":
        kw["out"] = out[:2]
    else:
        args[4] = plan.work
    with pytest.raises((ValueError, TypeError), match=f"^mla_decode: {words}"):
        mla_decode(*args, **kw)
    assert out.isnan().all()  # nothing launched


def test_a_query_in_another_layout_is_folded_by_a_copy():
    """q rows not evenly spaced (heads not packed) still give the same result: the call folds through a copy."""
    inp = make_mla_inputs([60, 40], 16, seed=16)
    qn, qp = _queries(2, 3, 16, seed=17)
    wide = torch.zeros(6, 16, 1024, dtype=torch.bfloat16)
    wide[:, :, :512] = qn
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=3)
    a = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan)
    spread = torch.zeros(6, 32, 512, dtype=torch.bfloat16)[:, ::2]
    spread.copy_(qn)
    b = mla_decode(spread, qp, inp.ckv_cache, inp.kpe_cache, plan)
    c = mla_decode(wide[:, :, :512], qp, inp.ckv_cache, inp.kpe_cache, plan)
    assert torch.equal(a, b) and torch.equal(a, c)


def test_an_unbuildable_hopper_path_falls_back_to_triton_with_one_warning(monkeypatch):
    """No nvcc (or a failed build): the plan says why and runs the Triton path; the warning comes once a process."""
    refusal = "no-nvcc-in-test"
    monkeypatch.setattr(dispatch.hopper, "build_refusal", lambda kind: refusal)
    monkeypatch.setattr(dispatch, "_WARNED", set())
    cuda = torch.device("cuda", 0)
    chosen = f"{dispatch.SAID['wgmma_tokens']}: the rule's reason"
    with pytest.warns(RuntimeWarning, match=rf"{dispatch.SAID['wgmma_tokens']}.*{refusal}.*Triton"):
        path, why = dispatch._usable("wgmma_tokens", chosen, cuda)
    assert path == "triton" and why.startswith("Triton:") and dispatch.SAID["wgmma_tokens"] in why and refusal in why
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert dispatch._usable("wgmma_tokens", chosen, cuda)[0] == "triton"


# ----------------------------------------------------------------------------------------------
# On an H100 / H200: every path, q_len 1..8, against float64; a graph plan captured once and replayed
# ----------------------------------------------------------------------------------------------


def _gpu_inputs(lens, heads, q_len, layout, seed):
    page = 64 if layout == "paged" else 1
    inp = make_mla_inputs(lens, heads, seed=seed, layout=layout, page_size=page, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(seed)
    qn = (torch.randn(len(lens) * q_len, heads, 512, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    qp = (torch.randn(len(lens) * q_len, heads, 64, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    return inp, qn, qp, page


@on_hopper
@pytest.mark.parametrize("layout", ["pool_view", "paged"])
@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
@pytest.mark.parametrize("heads", [16, 32, 128])
@pytest.mark.parametrize("path", ["triton", "wgmma", "wgmma_tokens"])
def test_every_path_matches_float64_at_every_q_len_on_the_gpu(path, heads, q_len, layout):
    lens = [4097, q_len, 300, 1500 + q_len]
    inp, qn, qp, page = _gpu_inputs(lens, heads, q_len, layout, seed=heads + q_len)
    plan = plan_mla_decode(
        inp.kv_indptr,
        inp.kv_indices,
        heads=heads,
        sm_scale=SM,
        kv_len=inp.kv_len,
        q_len=q_len,
        page_size=page,
        path=path,
        ckv_cache=inp.ckv_cache,
        kpe_cache=inp.kpe_cache,
    )
    assert plan.path == path
    out, lse = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, return_lse=True)
    want, want_lse = _reference64(inp, qn, qp, q_len)
    assert _rel(out, want) < 4e-3, (path, heads, q_len, layout)
    assert float((lse.double() - want_lse).abs().max()) < 2e-3


@on_hopper
@pytest.mark.parametrize("path", ["triton", "wgmma", "wgmma_tokens"])
def test_a_graph_plan_captured_once_replays_new_lengths_on_the_gpu(path):
    """Captured with the graph's batch at its context limit; refilled with other lengths and replayed, the output
    agrees with float64 and with an eager plan's (whose work list may merge differently: BF16 rounding apart)."""
    lens = [3000, 700, 64]
    inp, qn, qp, _ = _gpu_inputs(lens, 16, 2, "pool_view", seed=21)
    plan = plan_mla_decode(
        inp.kv_indptr,
        inp.kv_indices,
        heads=16,
        sm_scale=SM,
        q_len=2,
        path=path,
        graph_max_len=4096,
        lengths=[4096] * 3,
        ckv_cache=inp.ckv_cache,
        kpe_cache=inp.kpe_cache,
    )
    out = torch.empty(6, 16, 512, dtype=torch.bfloat16, device="cuda")
    plan.refill(lens)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, out=out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, out=out)
    eager_plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=2, path=path)
    graph.replay()
    want, _ = _reference64(inp, qn, qp, 2)
    assert _rel(out, want) < 4e-3
    eager = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, eager_plan)
    assert _rel(out, eager.double()) < 4e-3


@on_hopper
@pytest.mark.parametrize("path", ["triton", "wgmma_tokens"])
def test_the_combines_direct_launch_gives_the_jits_bits(path):
    """The first launch of a combine compilation goes through Triton's JIT, the next ones call the compiled kernel
    directly: the same bits, for a plan that cuts every request into chunks."""
    from kvwall.kernels.mla_decode import combine

    inp, qn, qp, _ = _gpu_inputs([8000, 3000], 16, 2, "pool_view", seed=31)
    plan = plan_mla_decode(inp.kv_indptr, inp.kv_indices, heads=16, sm_scale=SM, q_len=2, path=path)
    assert plan.work.work_list.combine
    combine._COMBINE_COMPILED.clear()
    first = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, return_lse=True)
    assert combine._COMBINE_COMPILED  # kept for the direct launch
    second = mla_decode(qn, qp, inp.ckv_cache, inp.kpe_cache, plan, return_lse=True)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])

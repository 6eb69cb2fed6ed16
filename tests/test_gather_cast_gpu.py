"""The gather-cast suite on a GPU: Triton and the CUDA C++ twin, FP8 NaNs included, CUDA graphs, errors.

Skipped (with the reason) on machines without an NVIDIA GPU; the recorded run of
``gather_cast_validation`` holds the same checks' results from the H200.
"""

from __future__ import annotations

import pytest
import torch

from kvwall.experiments.gather_cast import _error_rows, _graph_rows, implementations
from kvwall.kernels.gather.cases import VALIDATION_CASES, check_case
from kvwall.kernels import full_cast, gather_cast, gather_cast_cuda
from kvwall.kernels.gather.reference import bits, make_gather_inputs
from kvwall.kernels.gather.sanitize import unchecked_out_of_range_gives_nan
from test_kernels_large_offsets import check_gather, check_mla, far_indices, wide_pool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA kernels)"),
]
IMPLS = ("triton", "cuda")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "with_fp8_nan"])
@pytest.mark.parametrize("case", VALIDATION_CASES, ids=lambda c: c.name)
def test_bit_exact_on_gpu(impl, nan, case):
    row = check_case(implementations(torch.device("cuda"))[impl], case, "cuda", nan=nan)
    assert row["ok"], row


@pytest.mark.parametrize("impl", IMPLS)
def test_graph_replay_with_changed_indices(impl):
    rows = _graph_rows(torch.device("cuda"), impl, implementations(torch.device("cuda"))[impl], seed=1)
    assert rows and all(r["ok"] for r in rows), rows


@pytest.mark.parametrize("impl", IMPLS)
def test_errors_before_launch_on_gpu(impl):
    rows = _error_rows(torch.device("cuda"), impl, implementations(torch.device("cuda"))[impl])
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]


def test_checked_call_refuses_graph_capture():
    inp = make_gather_inputs(num_slots=100, dim=576, context_lens=[10], seed=0, device="cuda")
    gather_cast(inp.pool, inp.kv_indices, inp.kv_indptr, check_range=False)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="pass check_range=False"):
        with torch.cuda.graph(graph):
            gather_cast(inp.pool, inp.kv_indices, inp.kv_indptr)


def test_full_cast_on_gpu_with_nan():
    pool = make_gather_inputs(num_slots=4097, dim=577, context_lens=[1], seed=2, nan=True, device="cuda").pool
    got, want = full_cast(pool), pool.to(torch.bfloat16)
    assert bool(((bits(got) == bits(want)) | (torch.isnan(got) & torch.isnan(want))).all())


@pytest.mark.parametrize("impl", IMPLS)
def test_unchecked_out_of_range_gives_nan_rows(impl):
    assert unchecked_out_of_range_gives_nan(implementations(torch.device("cuda"))[impl], torch.device("cuda"))


@pytest.fixture(scope="module")
def gpu_wide_pool():
    pool = wide_pool("cuda")
    yield pool
    del pool
    torch.cuda.empty_cache()


@pytest.mark.parametrize("variant", ["chunks", "tiles"])
def test_offsets_past_2_31_on_a_strided_view(gpu_wide_pool, variant):
    check_gather(gpu_wide_pool, variant)


def test_cuda_twin_offsets_past_2_31_on_a_strided_view(gpu_wide_pool):
    view = gpu_wide_pool[:, :, :512]
    idx = far_indices("cuda")
    assert torch.equal(bits(gather_cast_cuda(view, idx)), bits(view[idx.long()].to(torch.bfloat16)))


def test_mla_decode_offsets_past_2_31_on_a_strided_view(gpu_wide_pool):
    check_mla(gpu_wide_pool)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("end", [2**57, 2**61, 2**63 - 1, 2**31 - 1])
def test_an_unchecked_indptr_end_past_the_capacity_is_clamped_on_gpu(impl, end):
    """Unchecked, a paged pool's int64 ``kv_indptr`` end far past the capacity is clamped to it (not wrapped by the
    multiply by the page size): every row of the page table is written, as the docstring says."""
    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (4, 64, 16), generator=g, dtype=torch.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0  # no FP8 NaN: the comparison below is of finite values
    pool = raw.view(torch.float8_e4m3fn).cuda()
    idx = torch.tensor([2, 0, 3], dtype=torch.int64, device="cuda")
    ptr = torch.tensor([0, end], dtype=torch.int64, device="cuda")
    fn = gather_cast if impl == "triton" else gather_cast_cuda
    out = fn(pool, idx, ptr, check_range=False)
    want = pool[idx].to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))

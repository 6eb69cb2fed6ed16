"""Both kernels on a row-strided pool view whose byte offsets pass 2^31 while its element count does not.

``pool[:, :, :512]`` of a 3.8M-slot ``[slots, 1, 576]`` FP8 pool holds 1.95G values (< 2^31) but its last row
starts 2.19G values in: a kernel that picks 32-bit offsets by ``numel()`` wraps around and reads outside the
pool (a crash in the interpreter). The 2.2 GB storage is allocated but only its first and last rows are
written, so the machine's memory is barely touched; the kernels run in Triton's interpreter on CPU, and on a GPU
(``gpu``-marked, skipped elsewhere) the fused decode runs on each of its paths ("triton"; "wgmma" and "wgmma_tokens"
on an H100 / H200).
"""

from __future__ import annotations

import pytest
import torch

from kvwall.kernels import gather_cast_reference, mla_decode_fp8, mla_decode_reference
from kvwall.kernels.gather.kernel import largest_pool_offset, launch_gather, plan_gather
from kvwall.kernels.gather.reference import bits
from kvwall.kernels.mla_decode.dispatch import KERNEL_PATHS, mla_decode, plan_mla_decode

SLOTS, D, DC = 3_800_000, 576, 512
FP8 = torch.float8_e4m3fn


def wide_pool(device: str) -> torch.Tensor:
    """A ``[SLOTS, 1, 576]`` FP8 pool, its first and last 64 rows random (no NaN), the rest never touched."""
    storage = torch.empty(SLOTS, 1, D, dtype=torch.uint8, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in (storage[:64], storage[-64:]):
        rows.copy_(torch.randint(0, 256, rows.shape, generator=gen, device=device, dtype=torch.uint8))
        rows[(rows & 0x7F) == 0x7F] = 0x3C  # no NaN: the reference comparisons below are plain
    return storage.view(FP8)


def far_indices(device: str) -> torch.Tensor:
    return torch.tensor([SLOTS - 1, 3, SLOTS - 64, SLOTS - 2, 0, SLOTS - 33], dtype=torch.int32, device=device)


def check_gather(pool: torch.Tensor, variant: str) -> None:
    view = pool[:, :, :DC]
    assert view.numel() < 2**31 <= largest_pool_offset(view)  # the premise: offsets, not values, pass 2^31
    idx = far_indices(str(pool.device))
    got = launch_gather(plan_gather(view, idx), variant=variant)
    assert torch.equal(bits(got), bits(gather_cast_reference(view, idx)))


def check_mla(pool: torch.Tensor, path: str = "triton") -> None:
    device = pool.device
    gen = torch.Generator(device=device).manual_seed(1)
    idx = far_indices(str(device))
    q_nope = (torch.randn(1, 2, DC, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    q_pe = (torch.randn(1, 2, D - DC, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    indptr = torch.tensor([0, idx.numel()], dtype=torch.int32, device=device)
    ckv, kpe = pool[:, 0, :DC], pool[:, 0, DC:]
    if path == "triton":
        out = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, 0.1, num_splits=2)
    else:
        plan = plan_mla_decode(indptr, idx, heads=2, sm_scale=0.1, path=path, ckv_cache=ckv, kpe_cache=kpe)
        out = mla_decode(q_nope, q_pe, ckv, kpe, plan)
    compact = torch.arange(idx.numel(), device=device)
    want = mla_decode_reference(
        q_nope,
        q_pe,
        ckv[idx.long()].double(),
        kpe[idx.long()].double(),
        indptr,
        compact,
        0.1,
        compute_dtype=torch.float64,
    )
    assert float((out.double() - want).norm() / want.norm()) <= 1e-2


@pytest.fixture(scope="module")
def cpu_pool():
    return wide_pool("cpu")


@pytest.mark.parametrize("variant", ["chunks", "tiles"])
def test_gather_cast_past_2_31_on_a_strided_view(cpu_pool, variant):
    check_gather(cpu_pool, variant)


def test_mla_decode_past_2_31_on_a_strided_view(cpu_pool):
    check_mla(cpu_pool)


def _gpu_for(path: str) -> str:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    if path != "triton" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"the {path} path needs an H100 / H200 (sm_90a code)")
    return "cuda"


@pytest.mark.gpu
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_mla_decode_past_2_31_on_a_strided_view_on_gpu(path):
    check_mla(wide_pool(_gpu_for(path)), path)

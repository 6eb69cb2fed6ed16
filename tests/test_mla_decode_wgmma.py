"""The fused kernel's wgmma path (:mod:`kvwall.kernels.mla_decode.wgmma`, ``mla_decode_wgmma.cu``).

On any machine with nvcc: ptxas compiles the kernel for sm_90a with no spills and no stack (the ``KVWALL_TRACE``
build too), and a host program linked with the source prints the ``Params`` size and the kernel's shape, which must
equal the host side's (the ctypes mirror, ``SMEM_BYTES``, 64 heads and 64 tokens per CTA); the shared memory fits an
H100 / H200 block. On any machine: CPU tensors are refused naming the Triton path; plans hold whole 64-token tiles
and count 64-head blocks; rows the kernel cannot read are named. On an H100 / H200 (``gpu``-marked, skipped
elsewhere): the case table against float64 and the traced build. The contracts both paths share (NaN isolation,
graph replay, refusals) are one parametrized test body each, in ``tests/test_mla_dispatch.py``.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import pytest
import torch
from conftest import on_hopper

from kvwall.kernels.mla_decode import wgmma
from kvwall.kernels.mla_decode.cases import SANITIZED_CASES, SM_SCALE, check_case, validation_cases
from kvwall.kernels.mla_decode.work_list import TO_THE_END
from kvwall.kernels.mla_decode.reference import make_mla_inputs
from kvwall.kernels.mla_decode.wgmma import (
    BLOCK_N,
    HEADS_PER_CTA,
    SMEM_BYTES,
    THREADS,
    WgmmaPlan,
    mla_decode_fp8_wgmma,
    plan_mla_decode_wgmma,
)

NVCC = shutil.which("nvcc")
#: The per-block shared memory an H100 / H200 CTA may opt into (the only GPUs sm_90a code runs on).
HOPPER_SHARED_PER_BLOCK = 232_448

HOST_PROGRAM = r"""
#include <cstdio>
extern "C" int kvwall_mla_params_size();
extern "C" int kvwall_mla_wgmma_shape(int* smem, int* heads, int* block_n, int* threads);
int main() {
  int smem = 0, heads = 0, block_n = 0, threads = 0;
  kvwall_mla_wgmma_shape(&smem, &heads, &block_n, &threads);
  std::printf("%d %d %d %d %d\n", kvwall_mla_params_size(), smem, heads, block_n, threads);
  return 0;
}
"""


def test_ptxas_compiles_it_for_sm90a_without_spills_or_stack():
    if NVCC is None:
        pytest.skip("no nvcc on this machine")
    for multi in (False, True):  # the decode instantiation (q_len 1) and the multi-token one
        rep = wgmma.nvcc_compile_check_wgmma(multi=multi)
        assert rep.ok, rep.log[-2000:]
        assert rep.registers <= 255 and rep.spill_bytes == 0 and rep.stack_bytes == 0, (multi, rep.log[-2000:])
    assert "serialized" not in rep.log, "ptxas serialized the wgmma instructions:\n" + rep.log[-2000:]


def test_the_trace_build_compiles_too():
    """The KVWALL_TRACE build (clock64 per phase) compiles for sm_90a, still without wgmma serialization."""
    if NVCC is None:
        pytest.skip("no nvcc on this machine")
    rep = wgmma.nvcc_compile_check_wgmma(trace=True)
    assert rep.ok and rep.trace and rep.registers <= 255 and rep.spill_bytes == 0, rep.log[-2000:]
    assert "serialized" not in rep.log, rep.log[-2000:]


def test_the_host_side_agrees_with_the_compiled_shape(tmp_path):
    """Params size and (shared memory, heads, tokens, threads) as the C++ says them, against the host's constants;
    the shared memory fits an H100 / H200 block."""
    if NVCC is None:
        pytest.skip("no nvcc on this machine")
    main = tmp_path / "main.cu"
    main.write_text(HOST_PROGRAM)
    prog = tmp_path / "shape"
    build = subprocess.run(
        [
            NVCC,
            *wgmma.NVCC_FLAGS,
            "-gencode=arch=compute_90a,code=compute_90a",
            "-o",
            str(prog),
            str(main),
            str(wgmma.WGMMA_SOURCE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    run = subprocess.run([str(prog)], capture_output=True, text=True, timeout=60)
    params, smem, heads, block_n, threads = (int(x) for x in run.stdout.split())
    assert params == ctypes.sizeof(wgmma.Params)
    assert (smem, heads, block_n, threads) == (SMEM_BYTES, HEADS_PER_CTA, BLOCK_N, THREADS)
    assert SMEM_BYTES <= HOPPER_SHARED_PER_BLOCK


def test_cpu_tensors_are_refused_naming_the_triton_path():
    inp = make_mla_inputs([7, 65], 64, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    with pytest.raises(
        ValueError,
        match=rf"^mla_decode_fp8_wgmma: .*{re.escape(wgmma.wgmma_refusal(torch.device('cpu')))}",  # the Triton call
    ):
        mla_decode_fp8_wgmma(
            inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE
        )
    assert wgmma.wgmma_refusal(torch.device("cpu"))


@pytest.mark.parametrize("heads", [16, 64, 128, 192])
def test_plans_hold_whole_tiles_of_64_tokens(heads):
    lens = [0, 1, 777, 4096, 33, 20000, 130, 5]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    plan = plan_mla_decode_wgmma(indptr, heads=heads, programs=132)
    assert isinstance(plan, WgmmaPlan) and plan.config.block_h == HEADS_PER_CTA
    covered = {b: 0 for b in range(len(lens))}
    for b, lo, hi, _ in plan.work_list.items:
        assert lo % BLOCK_N == 0 and (hi == TO_THE_END or hi % BLOCK_N == 0)
        covered[b] += min(hi, lens[b]) - lo
    assert covered == dict(enumerate(lens))


def _numbers(text: str) -> set[int]:
    return {int(n) for n in re.findall(r"\d+", text)}


def test_rows_the_kernel_cannot_read_are_named():
    """Widths other than 512 / 64, rows not starting 16-byte aligned, row strides not a multiple of 16 bytes; a
    [slots, 1, 576] pool's views and a paged [pages, 64, 576] pool's views qualify."""
    pool = torch.zeros(64 * 8, 576, dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert wgmma.rows_refusal((512, 64), {"ckv_cache": pool[:, :512], "kpe_cache": pool[:, 512:]}) is None
    assert wgmma.rows_refusal((512, 64), {"ckv_cache": pool.view(-1, 1, 576)[:, :, :512], "kpe_cache": None}) is None
    assert wgmma.rows_refusal((512, 64), {"ckv_cache": pool.view(8, 64, 576)[:, :, :512]}) is None
    odd = torch.zeros(64 * 577 + 16, dtype=torch.uint8)[1 : 1 + 64 * 577].view(-1, 577).view(torch.float8_e4m3fn)
    why = wgmma.rows_refusal((512, 64), {"ckv_cache": odd[:, :512]})
    # the cache, its data_ptr % 16 and its row stride in bytes
    assert why and why.startswith("ckv_cache") and {1, 577} <= _numbers(why), why
    assert {512, 64, 256} <= _numbers(wgmma.rows_refusal((256, 64), {}))  # the widths built, and those given


# ----------------------------------------------------------------------------------------------
# On an H100 / H200
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu() -> torch.device:
    if NVCC is None:
        pytest.skip("no nvcc on this machine: the wgmma path is built at first use")
    wgmma.load_mla_decode_wgmma()
    return torch.device("cuda", torch.cuda.current_device())


def _fn(*args, num_splits=None, **kwargs):  # pylint: disable=unused-argument
    return mla_decode_fp8_wgmma(*args, **kwargs)


GPU_CASES = validation_cases(
    [64, 128, 16, 20, 3, 192],
    [[4096], [32768], [0, 1, 777, 4096, 33, 20000, 130, 5]],
    [[1, 0, 63, 64, 65, 200], [5000, 70000]],
    64,
)


@on_hopper
@pytest.mark.parametrize(
    "c,pool",
    [(c, 600_000) for c in GPU_CASES] + [(c, 2_000) for c in SANITIZED_CASES],
    ids=[c.name for c in GPU_CASES] + [c.name for c in SANITIZED_CASES],
)
def test_case_table_on_hopper(gpu, c, pool):
    row = check_case(_fn, c, gpu, pool)
    assert row["ok"], row


@on_hopper
def test_the_traced_build_computes_the_same_and_counts_every_tile(gpu):
    inp = make_mla_inputs([300, 5000, 70], 128, seed=5, layout="paged", page_size=64, pool_slots=100_000, device=gpu)
    plan = plan_mla_decode_wgmma(inp.kv_indptr, inp.kv_len, heads=128, page_size=64)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    out = torch.full((3, 128, 512), float("nan"), dtype=torch.bfloat16, device=gpu)
    call = lambda: mla_decode_fp8_wgmma(*args, kv_len=inp.kv_len, check_range=False, plan=plan, out=out)  # noqa: E731
    shipped = call().clone()
    trace = wgmma.trace_wgmma_phases(call)
    assert torch.equal(out, shipped)
    # every item's tiles, once per head block; every CTA counted by both warpgroups
    tiles = sum(-(-max(t, 0) // BLOCK_N) for t in plan.work_list.item_tokens()) * 2
    assert trace.tiles == tiles and trace.ctas == plan.items * 2
    for wg, names in wgmma.TRACE_PHASES.items():
        assert set(trace.per_tile[wg]) == set(names) and all(v >= 0 for v in trace.per_tile[wg].values())
        assert sum(trace.per_tile[wg].values()) > 0


@pytest.mark.parametrize(
    "lens,head_blocks",
    [
        ([131072] * 8, 2),
        ([131072], 2),
        ([4096] * 8, 1),
        ([32768] * 32, 2),
        ([1000, 30000, 7, 0, 12000] * 7, 2),
        ([5] * 300, 1),
        ([131072] * 8 + [100] * 3, 2),
    ],
)
def test_whole_wave_items_fill_whole_waves(lens, head_blocks):
    """The work list asked for ``whole_wave_items`` is estimated no slower than asking for one wave's worth of items
    directly (waves x (largest chunk + per-item overhead)): where that overshoots one wave by a few CTAs (each
    request's chunks round up), the second, nearly empty wave is avoided."""
    from kvwall.kernels.mla_decode.work_list import build_work_list

    slots = 132

    def cost(wl):
        return -(-len(wl.items) * head_blocks // slots) * (wl.chunk_tokens + wgmma.ITEM_OVERHEAD_TOKENS)

    chosen = build_work_list(lens, block_n=BLOCK_N, items_wanted=wgmma.whole_wave_items(lens, head_blocks, slots))
    naive = build_work_list(lens, block_n=BLOCK_N, items_wanted=slots // head_blocks)
    assert cost(chosen) <= cost(naive)
    assert sum(chosen.item_tokens()) == sum(lens)

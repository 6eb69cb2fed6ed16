"""The tokens-on-M wgmma kernel (:mod:`kvwall.kernels.mla_decode.wgmma_tokens`, ``mla_decode_wgmma_tokens.cu``):
16 or 32 heads per CTA as wgmma's N, a tile's 64 tokens as M (issue 22; the dispatcher's "wgmma_tokens" path:
tests/test_mla_dispatch.py covers its choice and the contracts every path keeps).

On any machine with nvcc: ptxas compiles both instantiations for sm_90a with no spills, no stack and no serialized
wgmma; a host program linked with the source prints the ``Params`` size and each instantiation's shape, which must
be what the host plans for (64 tokens a tile, 384 threads, shared memory within an H100 / H200 block). On any
machine: CPU tensors are refused before any launch, under this call's name; plans hold whole 64-token tiles and
count 16- or 32-head blocks. On an H100 / H200
(``gpu``-marked, skipped elsewhere): the case table against float64 (odd head counts, empty and one-token requests,
pages of 64, every scale), a sharp softmax, NaN confined to a request with an out-of-range index, a CUDA-graph
replay bitwise equal to the eager call, and the sanitizer program's checks of both wgmma paths, plain and under
``compute-sanitizer --tool memcheck`` (where it is installed).
"""

from __future__ import annotations

import ctypes
import re
import dataclasses
import shutil
import subprocess

import pytest
import torch
from conftest import on_hopper

from kvwall.kernels.mla_decode import sanitize, wgmma, wgmma_tokens
from kvwall.kernels.mla_decode.cases import (
    SANITIZED_CASES,
    SM_SCALE,
    WGMMA_SANITIZED_CASES,
    check_case,
    validation_cases,
)
from kvwall.kernels.mla_decode.work_list import TO_THE_END
from kvwall.kernels.mla_decode.reference import make_mla_inputs, mla_decode_reference, reference64
from kvwall.kernels.mla_decode.wgmma_tokens import (
    BLOCK_N,
    HEADS_PER_CTA,
    WgmmaTokensPlan,
    heads_per_cta,
    mla_decode_fp8_wgmma_tokens,
    plan_mla_decode_wgmma_tokens,
)

NVCC = shutil.which("nvcc")
HOPPER_SHARED_PER_BLOCK = 232_448
#: One consumer and two producer warpgroups.
THREADS = 384

HOST_PROGRAM = r"""
#include <cstdio>
extern "C" int kvwall_mla_params_size();
extern "C" int kvwall_mla_wgmma_tokens_shape(int hn, int* smem, int* block_n, int* threads);
int main() {
  std::printf("%d", kvwall_mla_params_size());
  for (int hn : {16, 32, 64}) {
    int smem = 0, block_n = 0, threads = 0;
    int rc = kvwall_mla_wgmma_tokens_shape(hn, &smem, &block_n, &threads);
    std::printf(" %d %d %d %d", rc, smem, block_n, threads);
  }
  std::printf("\n");
  return 0;
}
"""


def test_ptxas_compiles_both_instantiations_for_sm90a_without_spills_or_stack():
    if NVCC is None:
        pytest.skip("no nvcc on this machine")
    reports = wgmma_tokens.nvcc_compile_check_wgmma_tokens()
    multi = wgmma_tokens.nvcc_compile_check_wgmma_tokens(multi=True)  # the multi-token (q_len > 1) instantiations
    assert set(reports) == set(multi) == set(HEADS_PER_CTA)
    for hn, rep in [*reports.items(), *multi.items()]:
        assert rep.ok, rep.log[-2000:]
        # 168 registers at launch (384 threads); setmaxnreg then gives the consumer 240 and each producer 128
        assert rep.registers is not None and rep.registers <= 168, (hn, rep.log[-2000:])
        assert rep.spill_bytes == 0 and rep.stack_bytes == 0, (hn, rep.log[-2000:])
    assert "serialized" not in reports[16].log, "ptxas serialized the wgmma instructions:\n" + reports[16].log[-2000:]


def test_the_host_side_agrees_with_the_compiled_shapes(tmp_path):
    """Params size and, per instantiation, (shared memory, tokens a tile, threads) as the C++ says them; 64 heads a
    CTA is not an instantiation (-1)."""
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
            str(wgmma_tokens.TOKENS_SOURCE),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    out = [int(x) for x in subprocess.run([str(prog)], capture_output=True, text=True, timeout=60).stdout.split()]
    assert out[0] == ctypes.sizeof(wgmma.Params)
    shapes = {hn: out[1 + 4 * i : 5 + 4 * i] for i, hn in enumerate((16, 32, 64))}
    for hn in HEADS_PER_CTA:
        rc, smem, block_n, threads = shapes[hn]
        # the host's shape (wgmma_tokens.host_shape: the source's Layout formula) is the compiled one
        assert rc == 0 and (smem, block_n, threads) == wgmma_tokens.host_shape(hn)
        assert block_n == BLOCK_N and threads == THREADS and smem <= HOPPER_SHARED_PER_BLOCK
    assert shapes[64][0] == -1


def test_the_host_shape_knows_only_the_instantiations():
    """On any machine: each instantiation's host shape fits an H100 / H200 block (384 threads, 64-token tiles);
    another head count per CTA is no instantiation (the compiled shapes are checked against it above)."""
    for hn in HEADS_PER_CTA:
        smem, block_n, threads = wgmma_tokens.host_shape(hn)
        assert smem <= wgmma_tokens.SHARED_LIMIT == HOPPER_SHARED_PER_BLOCK and (block_n, threads) == (BLOCK_N, THREADS)
    assert wgmma_tokens.smem_bytes(16) < wgmma_tokens.smem_bytes(32)
    with pytest.raises(ValueError, match=rf"\b64\b.*{re.escape(str(HEADS_PER_CTA))}"):  # asked for, and those there are
        wgmma_tokens.smem_bytes(64)


def test_cpu_tensors_are_refused_before_any_launch():
    inp = make_mla_inputs([7, 65], 16, seed=6, layout="pool_view", pool_slots=512, device="cpu")
    with pytest.raises(
        ValueError,
        match=rf"^mla_decode_fp8_wgmma_tokens: .*{re.escape(wgmma.wgmma_refusal(torch.device('cpu')))}",
    ):
        mla_decode_fp8_wgmma_tokens(
            inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE
        )


@pytest.mark.parametrize("heads,hn", [(1, 16), (8, 16), (16, 16), (17, 32), (20, 32), (32, 32), (64, 32), (128, 32)])
def test_plans_hold_whole_tiles_and_count_head_blocks(heads, hn):
    assert heads_per_cta(heads) == hn
    lens = [0, 1, 777, 4096, 33, 20000, 130, 5]
    indptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    plan = plan_mla_decode_wgmma_tokens(indptr, heads=heads, programs=132)
    assert isinstance(plan, WgmmaTokensPlan) and plan.config.block_h == hn and plan.config.block_n == BLOCK_N
    covered = {b: 0 for b in range(len(lens))}
    for b, lo, hi, _ in plan.work_list.items:
        assert lo % BLOCK_N == 0 and (hi == TO_THE_END or hi % BLOCK_N == 0)
        covered[b] += min(hi, lens[b]) - lo
    assert covered == dict(enumerate(lens))


# ----------------------------------------------------------------------------------------------
# On an H100 / H200
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu() -> torch.device:
    if NVCC is None:
        pytest.skip("no nvcc on this machine: the kernel is built at first use")
    wgmma_tokens.load_mla_decode_wgmma_tokens()
    return torch.device("cuda", torch.cuda.current_device())


def _fn(*args, num_splits=None, **kwargs):  # pylint: disable=unused-argument
    return mla_decode_fp8_wgmma_tokens(*args, **kwargs)


GPU_CASES = validation_cases(
    [16, 32, 8, 20, 64, 3],
    [[1], [7], [4097], [32_768], [0, 1, 777, 4096, 33, 20_000, 130, 5], [65, 0, 129, 2], [0, 0], [131_072]],
    [[1, 0, 4097, 30_000, 64, 65]],
    64,
)


@on_hopper
@pytest.mark.parametrize(
    "c,pool",
    [(c, 200_000) for c in GPU_CASES] + [(c, 2_000) for c in SANITIZED_CASES],
    ids=[c.name for c in GPU_CASES] + [c.name for c in SANITIZED_CASES],
)
def test_case_table_on_hopper(gpu, c, pool):
    row = check_case(_fn, c, gpu, pool)
    assert row["ok"], row


@on_hopper
@pytest.mark.parametrize("heads", [16, 32])
def test_a_sharp_softmax_keeps_the_heads_on_m_paths_error(gpu, heads):
    inp = make_mla_inputs([9000, 300], heads, seed=11, pool_slots=50_000, device=gpu)
    sharp = dataclasses.replace(inp, q_nope=(inp.q_nope.float() * 6).bfloat16(), q_pe=(inp.q_pe.float() * 6).bfloat16())
    args = (sharp.q_nope, sharp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    want = reference64(sharp, [0, 1], 1.0, 1.0, SM_SCALE)
    err = float((mla_decode_fp8_wgmma_tokens(*args).double() - want).norm() / want.norm())
    ref = float((wgmma.mla_decode_fp8_wgmma(*args).double() - want).norm() / want.norm())
    assert err <= 1.01 * ref and err < 3e-3, (err, ref)


@on_hopper
@pytest.mark.parametrize(
    "path,heads,q_len", [("wgmma_tokens", 16, 2), ("wgmma_tokens", 8, 4), ("wgmma", 16, 4), ("wgmma", 128, 2)]
)
def test_a_multi_token_query_sees_its_causal_prefix_on_hopper(gpu, path, heads, q_len):
    """The fold on the kernels: token j of a request equals the float64 decode of its first length - (q_len - 1 - j)
    tokens; a token that sees none gives zeros and -inf, no NaN (one chunk and several)."""
    call, plan_fn = {
        "wgmma": (wgmma.mla_decode_fp8_wgmma, wgmma.plan_mla_decode_wgmma),
        "wgmma_tokens": (mla_decode_fp8_wgmma_tokens, plan_mla_decode_wgmma_tokens),
    }[path]
    gen = torch.Generator(device=gpu).manual_seed(q_len)
    pool = (torch.randn(50_000, 576, generator=gen, device=gpu) * 0.7).to(torch.float8_e4m3fn)
    lens = [q_len - 2, 9, 20_000, q_len, 64 + q_len - 1]
    ptr = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=gpu)
    idx = torch.randint(0, 50_000, (sum(lens),), generator=gen, dtype=torch.int32, device=gpu)
    q = (torch.randn(len(lens), q_len * heads, 576, generator=gen, device=gpu) * 0.5).to(torch.bfloat16)
    plan = plan_fn(ptr, heads=heads, q_len=q_len)
    got, lse = call(
        q[..., :512],
        q[..., 512:],
        pool[:, :512],
        pool[:, 512:],
        ptr,
        idx,
        SM_SCALE,
        plan=plan,
        q_len=q_len,
        return_lse=True,
    )
    assert not torch.isnan(got).any() and not torch.isnan(lse).any()
    for b, n in enumerate(lens):
        for j in range(q_len):
            rows, seen = slice(j * heads, (j + 1) * heads), n - (q_len - 1 - j)
            if seen <= 0:
                assert (got[b, rows] == 0).all() and (lse[b, rows] == -float("inf")).all(), (b, j)
                continue
            want = mla_decode_reference(
                q[b : b + 1, rows, :512],
                q[b : b + 1, rows, 512:],
                pool[:, :512],
                pool[:, 512:],
                torch.tensor([0, seen], device=gpu),
                idx[ptr[b] : ptr[b] + seen].long(),
                SM_SCALE,
                compute_dtype=torch.float64,
            )
            err = float((got[b : b + 1, rows].double() - want).norm() / want.norm())
            assert err < 3e-3, (b, j, err)


@on_hopper
def test_an_out_of_range_index_poisons_only_its_request(gpu):
    inp = make_mla_inputs([100, 200], 16, seed=5, pool_slots=5000, device=gpu)
    idx = inp.kv_indices.clone()
    idx[150] = 10**7
    plan = plan_mla_decode_wgmma_tokens(inp.kv_indptr, heads=16)
    got = mla_decode_fp8_wgmma_tokens(
        inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, idx, SM_SCALE, check_range=False, plan=plan
    )
    assert torch.isfinite(got[0]).all() and torch.isnan(got[1]).all()


@on_hopper
def test_a_graph_replay_equals_the_eager_call(gpu):
    inp = make_mla_inputs([5000, 17, 70_000], 16, seed=7, pool_slots=100_000, device=gpu)
    plan = plan_mla_decode_wgmma_tokens(inp.kv_indptr, heads=16)
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16, device=gpu)

    def call():
        return mla_decode_fp8_wgmma_tokens(
            inp.q_nope,
            inp.q_pe,
            inp.ckv_cache,
            inp.kpe_cache,
            inp.kv_indptr,
            inp.kv_indices,
            SM_SCALE,
            out=out,
            check_range=False,
            plan=plan,
        )

    eager = call().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@on_hopper
def test_the_sanitizer_program_checks_both_wgmma_paths(gpu, capsys):
    """What memcheck runs (kvwall.kernels.mla_decode.sanitize, --paths wgmma wgmma_tokens), without it: every case
    of both paths right and the unchecked calls' NaN rows where they belong."""
    assert sanitize.main(["--paths", "wgmma", "wgmma_tokens"]) == 0
    lines = capsys.readouterr().out.splitlines()
    device, paths, names = sanitize.parse_args(["--paths", "wgmma", "wgmma_tokens"])
    want = [name for name, _ in sanitize.checks(device, names, paths)]  # each case, then the unchecked calls
    assert {c.name for cases in WGMMA_SANITIZED_CASES.values() for c in cases} <= set(want)
    assert any(n.startswith("wgmma_tokens h32") and "unchecked" in n for n in want)
    said = dict(line.rsplit(None, 1) for line in lines if len(line.split()) > 1)  # "name  ok" / "name  WRONG"
    assert [said.get(n) for n in want] == ["ok"] * len(want), lines
    assert lines[-1].endswith("none")  # no wrong result


@on_hopper
def test_memcheck_finds_no_error_on_either_wgmma_path(gpu):
    from kvwall.measure.sanitizer import memcheck_row

    if shutil.which("compute-sanitizer") is None:
        pytest.skip("compute-sanitizer is not on PATH")
    # fused_decode_validation's bound (300 s, all three paths): a device call runs 600 s at most, and no recording has
    # run memcheck over a wgmma kernel yet -- a hang must not take the rest of the call with it
    row = memcheck_row(sanitize.__name__, 300, ["--paths", "wgmma", "wgmma_tokens"])
    assert row["passed"], row["summary"] + "\n" + row["output_tail"]

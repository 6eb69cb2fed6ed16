"""The fused kernel's CUDA C++ path (:mod:`kvwall.kernels.mla_decode.cuda`, ``mla_decode_mma.cu``).

On any machine: the variant table the host side reads from the source (``VARIANTS``, ``Variant.smem``) and the
``Params`` mirror equal what the compiled C++ says (a host program built by nvcc, no GPU needed); a call on CPU
tensors is refused naming the Triton path; the plans cut for a variant hold whole tiles. On a GPU (the
``gpu``-marked tests, skipped elsewhere): the case table against float64 with the default variant, every variant
that fits the GPU on the edge cases, the unchecked call's NaN for an out-of-range index, CUDA-graph replay, and the
refusals that come before any launch -- what chapter 5's ``fused_decode_cuda`` recorded on the H200.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from kvwall.kernels.mla_decode import cuda
from kvwall.kernels.mla_decode.cases import SANITIZED_CASES, SM_SCALE, check_case, validation_cases
from kvwall.kernels.mla_decode.cuda import (DEFAULT_VARIANT, VARIANTS, CudaPlan, mla_decode_fp8_cuda,
                                            plan_mla_decode_cuda)
from kvwall.kernels.mla_decode.kernel import plan_mla_decode
from kvwall.kernels.mla_decode.plan import TO_THE_END
from kvwall.kernels.mla_decode.reference import make_mla_inputs

DC, DR = 512, 64
D = DC + DR
FP8 = torch.float8_e4m3fn
NVCC = shutil.which("nvcc")
#: Lengths with empty, one-token, odd and long requests: the plan tests' batch.
LENS = [0, 1, 777, 4096, 33, 20000, 130, 5]

# ----------------------------------------------------------------------------------------------
# The variant table: Python's reading of the source against the compiled C++
# ----------------------------------------------------------------------------------------------

HOST_PROGRAM = r"""
#include <cstdio>
extern "C" int kvwall_mla_params_size();
extern "C" int kvwall_mla_variant(int v, int* warps, int* block_n, int* stages, int* smem);
int main() {
  std::printf("params %d\n", kvwall_mla_params_size());
  for (int v = -2; v < %(last)d; ++v) {
    int warps = 0, block_n = 0, stages = 0, smem = 0;
    const int rc = kvwall_mla_variant(v, &warps, &block_n, &stages, &smem);
    std::printf("variant %%d %%d %%d %%d %%d %%d\n", v, rc, warps, block_n, stages, smem);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def compiled_table(tmp_path_factory) -> dict:
    """What the C++ says: a host program linked with mla_decode_mma.cu prints ``kvwall_mla_params_size()`` and
    ``kvwall_mla_variant(v)`` for every index around the compiled ones. One nvcc run (~5 s): device code as
    compute_90 PTX only (no ptxas; the architecture check compiles the machine code), and the program never
    touches a GPU."""
    if NVCC is None:
        pytest.skip("no nvcc on this machine: the host program that prints the C++ variant table was not compiled")
    folder = tmp_path_factory.mktemp("mla_cuda_host")
    main = folder / "main.cu"
    main.write_text(HOST_PROGRAM.replace("%(last)d", str(max(VARIANTS) + 8)).replace("%%", "%"))
    prog = folder / "variants"
    build = subprocess.run([NVCC, *cuda.NVCC_FLAGS, "-gencode=arch=compute_90,code=compute_90", "-o", str(prog),
                            str(main), str(cuda.CUDA_SOURCE)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    run = subprocess.run([str(prog)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    table: dict = {"variants": {}, "unknown": []}
    for line in run.stdout.splitlines():
        word, *nums = line.split()
        if word == "params":
            table["params"] = int(nums[0])
        elif int(nums[1]) == 0:
            table["variants"][int(nums[0])] = tuple(int(x) for x in nums[2:])
        else:
            table["unknown"].append((int(nums[0]), int(nums[1])))
    return table


def test_python_variant_table_is_the_compiled_one(compiled_table):
    """VARIANTS (parsed from KVWALL_MLA_VARIANTS) and Variant.smem (a Python formula) equal the C++ launch shapes
    and ``Shape<>::SMEM``; every other index is refused (-1)."""
    python = {i: (v.warps, v.block_n, v.stages, v.smem) for i, v in VARIANTS.items()}
    assert compiled_table["variants"] == python
    assert compiled_table["unknown"] and all(rc == -1 for _, rc in compiled_table["unknown"])
    assert DEFAULT_VARIANT in compiled_table["variants"]


def test_params_mirror_is_the_compiled_size(compiled_table):
    assert compiled_table["params"] == ctypes.sizeof(cuda._Params)  # pylint: disable=protected-access


# ----------------------------------------------------------------------------------------------
# CPU: refusal and plans
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", ["pool_view", "paged"])
def test_cpu_tensors_are_refused_pointing_at_the_triton_path(layout, monkeypatch):
    def no_build(*_, **__):
        raise AssertionError("the CUDA path was built or launched for CPU tensors")

    monkeypatch.setattr(cuda, "load_mla_decode_cuda", no_build)
    inp = make_mla_inputs([5, 0, 70], 16, seed=1, layout=layout, page_size=64)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    words = r"^mla_decode_fp8_cuda: the CUDA path cannot run here: tensors are on cpu.*use mla_decode_fp8\b"
    with pytest.raises(ValueError, match=words):
        mla_decode_fp8_cuda(*args, kv_len=inp.kv_len)
    plan = plan_mla_decode_cuda(inp.kv_indptr, inp.kv_len, heads=16, page_size=inp.ckv_cache.shape[1]
                                if layout == "paged" else 1)
    with pytest.raises(ValueError, match=words):
        mla_decode_fp8_cuda(*args, kv_len=inp.kv_len, check_range=False, plan=plan)


def _indptr(lens, page_size):
    units = [-(-n // page_size) for n in lens]
    ptr = torch.tensor([0, *torch.tensor(units).cumsum(0).tolist()], dtype=torch.int32)
    return ptr, (torch.tensor(lens, dtype=torch.int32) if page_size > 1 else None)


def test_plan_carries_its_variant():
    ptr, _ = _indptr(LENS, 1)
    plan = plan_mla_decode_cuda(ptr, heads=16)
    assert isinstance(plan, CudaPlan) and plan.variant == DEFAULT_VARIANT
    for i, v in VARIANTS.items():
        plan = plan_mla_decode_cuda(ptr, heads=16, variant=i)
        assert isinstance(plan, CudaPlan) and plan.variant == i, plan.variant
        assert (plan.config.block_n, plan.config.num_warps, plan.config.num_stages) == (v.block_n, v.warps,
                                                                                        v.stages)
        assert plan.config.block_h == 16 and plan.kv_lora_rank == DC and plan.device == torch.device("cpu")


@pytest.mark.parametrize("variant", [-1, max(VARIANTS) + 1, 99])
def test_plan_for_an_unknown_variant_is_refused(variant):
    ptr, _ = _indptr(LENS, 1)
    with pytest.raises(ValueError, match=rf"plan_mla_decode_cuda: variant {variant} is not compiled; known: "):
        plan_mla_decode_cuda(ptr, heads=16, variant=variant)


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_plan_chunks_are_whole_tiles_but_a_requests_last(variant, page_size):
    """Each request's chunks run from token 0 back to back; every chunk but the last starts and ends on the
    variant's tile boundaries (``block_n`` tokens); the last runs to the end (TO_THE_END); a request of one chunk
    writes its output directly (partial row -1), the others write distinct partial rows of their own."""
    block_n = VARIANTS[variant].block_n
    ptr, kv_len = _indptr(LENS, page_size)
    plan = plan_mla_decode_cuda(ptr, kv_len, heads=20, page_size=page_size, variant=variant, programs=40)
    wl = plan.work_list
    assert plan.batch == len(LENS) and plan.page_size == page_size and wl.lengths == tuple(LENS)
    assert plan.work.tolist() == [list(item) for item in wl.items]  # what the kernel reads
    multi = 0
    for b, n in enumerate(LENS):
        chunks = sorted((lo, hi, row) for r, lo, hi, row in wl.items if r == b)
        assert chunks and chunks[0][0] == 0 and chunks[-1][1] == TO_THE_END, (b, chunks)
        assert all(hi == nxt for (_, hi, _), (nxt, _, _) in zip(chunks, chunks[1:])), (b, chunks)
        for lo, hi, _ in chunks[:-1]:
            assert lo % block_n == 0 and (hi - lo) % block_n == 0 and 0 < hi - lo <= wl.chunk_tokens, (b, lo, hi)
        assert chunks[-1][0] < max(n, 1) and n - chunks[-1][0] <= wl.chunk_tokens, (b, n, chunks[-1])
        rows = [row for _, _, row in chunks]
        if len(chunks) == 1:
            assert rows == [-1], (b, chunks)
        else:
            multi += 1
            k = wl.combine.index(b)
            assert sorted(rows) == list(range(wl.part_indptr[k], wl.part_indptr[k + 1])), (b, rows)
    assert multi >= 2, "no request was cut: the test checks nothing"


# ----------------------------------------------------------------------------------------------
# GPU: the compiled kernel (gpu marker; skipped without an NVIDIA GPU)
# ----------------------------------------------------------------------------------------------

def on_gpu(test):
    """A GPU test: marked ``gpu`` and skipped, saying why, where there is no NVIDIA GPU."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="needs an NVIDIA GPU (the CUDA C++ path builds and runs there)")
    return pytest.mark.gpu(skip(test))


@pytest.fixture(scope="module")
def gpu() -> torch.device:
    """The GPU, with the CUDA path built (once per source version): skipped where it cannot run."""
    device = torch.device("cuda", torch.cuda.current_device())
    why = cuda.cuda_refusal(device)
    if why:
        pytest.skip(f"the CUDA path cannot run on this GPU: {why}")
    if NVCC is None:
        pytest.skip("no nvcc on this machine: the CUDA path is built at first use")
    cuda.load_mla_decode_cuda()
    return device


def _variant_fn(variant: int):
    """``mla_decode_fp8``'s signature for check_case: the case table's forced split counts are dropped (the CUDA
    path always plans)."""
    def fn(*args, num_splits=None, **kwargs):  # pylint: disable=unused-argument
        return mla_decode_fp8_cuda(*args, variant=variant, **kwargs)
    return fn


GPU_CASES = validation_cases([16, 64, 128, 3, 20], [[4096], [32768], [0, 1, 777, 4096, 33, 20000, 130, 5]],
                             [[1, 0, 63, 64, 65, 200], [5000, 70000]], 64)
GPU_POOL = 600_000
#: Cases every variant runs: the sanitizer's edges (pool of 2,000 slots) and two long batches (the table's pool).
VARIANT_CASES = [(c, 2_000) for c in SANITIZED_CASES] + [
    (c, GPU_POOL) for c in GPU_CASES if c.heads == 16 and c.lens in ((0, 1, 777, 4096, 33, 20000, 130, 5),
                                                                      (5000, 70000))]


@on_gpu
@pytest.mark.parametrize("c", GPU_CASES, ids=lambda c: c.name)
def test_case_table_on_gpu(gpu, c):
    row = check_case(_variant_fn(DEFAULT_VARIANT), c, gpu, GPU_POOL)
    assert row["ok"], row


@on_gpu
@pytest.mark.parametrize("c,pool", VARIANT_CASES, ids=[c.name for c, _ in VARIANT_CASES])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_fitting_variant_on_gpu(gpu, variant, c, pool):
    """Every variant that fits this GPU's shared memory per block passes; one that does not is refused before any
    launch, naming its shared memory."""
    if VARIANTS[variant].smem > cuda.shared_limit(gpu):
        with pytest.raises(ValueError, match="shared memory per CTA"):
            check_case(_variant_fn(variant), c, gpu, pool)
        return
    row = check_case(_variant_fn(variant), c, gpu, pool)
    assert row["ok"], row


def _contract_inputs(gpu, layout):
    inp = make_mla_inputs([300, 5000, 70], 16, seed=3, layout=layout, page_size=64, pool_slots=100_000, device=gpu)
    page_size = inp.ckv_cache.shape[1] if layout == "paged" else 1
    plan = plan_mla_decode_cuda(inp.kv_indptr, inp.kv_len, heads=16, page_size=page_size)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr)
    return inp, plan, args


@on_gpu
@pytest.mark.parametrize("bad", [10**8, -1])
@pytest.mark.parametrize("layout", ["pool_view", "paged"])
def test_unchecked_out_of_range_index_makes_exactly_its_request_nan(gpu, layout, bad):
    """Request 1 (5,000 tokens) gets an index outside the cache: its rows are NaN, the other requests' rows are
    the bits of the same call with valid indices."""
    inp, plan, args = _contract_inputs(gpu, layout)
    idx = inp.kv_indices.clone()
    first = int(inp.kv_indptr[1])
    idx[first + (10 if layout == "pool_view" else 2)] = bad  # request 1's 11th token / 3rd page
    out = mla_decode_fp8_cuda(*args, idx, SM_SCALE, kv_len=inp.kv_len, check_range=False, plan=plan)
    clean = mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, kv_len=inp.kv_len, check_range=False, plan=plan)
    torch.cuda.synchronize(gpu)
    assert [bool(out[b].isnan().all()) for b in range(3)] == [False, True, False]
    assert [bool(out[b].isnan().any()) for b in range(3)] == [False, True, False]
    assert torch.equal(out[0], clean[0]) and torch.equal(out[2], clean[2])
    assert not clean.isnan().any()


@on_gpu
@pytest.mark.parametrize("layout", ["pool_view", "paged"])
def test_planned_call_replayed_in_a_cuda_graph_equals_the_eager_call(gpu, layout):
    """Captured once, the graph replays what an eager call computes, bit for bit, also after the query and the
    scale tensors it reads change in place."""
    inp, plan, args = _contract_inputs(gpu, layout)
    scales = dict(ckv_scale=torch.tensor([0.37], device=gpu), kpe_scale=torch.tensor([0.74], device=gpu))
    kw = dict(kv_len=inp.kv_len, check_range=False, plan=plan, **scales)
    eager = mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, **kw)
    graphed = torch.empty_like(eager)
    side = torch.cuda.Stream(gpu)
    side.wait_stream(torch.cuda.current_stream(gpu))
    with torch.cuda.stream(side):  # warm-up outside the capture (the Triton combine compiles here)
        mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, out=graphed, **kw)
    torch.cuda.current_stream(gpu).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, out=graphed, **kw)
    graphed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(gpu)
    assert torch.equal(graphed, eager)
    inp.q_nope.mul_(-0.5)
    scales["ckv_scale"].fill_(1.5)
    scales["kpe_scale"].fill_(0.75)
    graphed.fill_(float("nan"))
    graph.replay()
    changed = mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, **kw)
    torch.cuda.synchronize(gpu)
    assert torch.equal(graphed, changed) and not torch.equal(changed, eager)


def _refused(monkeypatch, call, kind, words):
    """``call`` raises ``kind`` matching ``words`` before the CUDA path is built or launched."""
    def no_launch(*_, **__):
        raise AssertionError("the CUDA path was launched")

    monkeypatch.setattr(cuda, "load_mla_decode_cuda", no_launch)
    with pytest.raises(kind, match=words):
        call()


@on_gpu
def test_misaligned_cache_rows_are_refused_before_any_launch(gpu, monkeypatch):
    """Rows 577 bytes apart starting one byte past a 16-byte boundary: the 16-byte cp.async cannot load them."""
    inp = make_mla_inputs([300, 5000, 70], 16, seed=3, layout="pool_view", pool_slots=20_000, device=gpu)
    slots = inp.ckv_cache.shape[0]
    mis = torch.empty(slots * 577 + 16, dtype=torch.uint8, device=gpu)
    odd = mis[1:1 + slots * 577].view(-1, 577).view(FP8)
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(inp.q_nope, inp.q_pe, odd[:, :DC], odd[:, DC:D],
                                                      inp.kv_indptr, inp.kv_indices, SM_SCALE),
             ValueError, r"ckv_cache: the CUDA path loads 16-byte pieces.*data_ptr % 16 = 1.*row stride 577")
    aligned = mis[16:16 + slots * 576].view(-1, 576).view(FP8)  # rows 16-byte aligned, the kpe part 1 B off
    shifted = mis[1:1 + slots * 576].view(-1, 576).view(FP8)
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(inp.q_nope, inp.q_pe, aligned[:, :DC], shifted[:, DC:D],
                                                      inp.kv_indptr, inp.kv_indices, SM_SCALE),
             ValueError, r"kpe_cache: the CUDA path loads 16-byte pieces")


@on_gpu
def test_bad_calls_are_refused_before_any_launch(gpu, monkeypatch):
    inp, plan, args = _contract_inputs(gpu, "pool_view")
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, check_range=False),
             ValueError, r"needs plan= from plan_mla_decode_cuda")
    bad = inp.kv_indices.clone()
    bad[5] = -1
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(*args, bad, SM_SCALE), IndexError, "outside")
    triton_plan = plan_mla_decode(inp.kv_indptr, heads=16, device=gpu)
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, check_range=False,
                                                      plan=triton_plan),
             TypeError, "plan must come from plan_mla_decode_cuda")
    other = next(i for i, v in VARIANTS.items() if v.block_n != VARIANTS[plan.variant].block_n)
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(*args, inp.kv_indices, SM_SCALE, check_range=False,
                                                      plan=plan, variant=other),
             ValueError, f"variant {other} does not run a plan cut for")
    _refused(monkeypatch, lambda: mla_decode_fp8_cuda(inp.q_nope[..., :256], inp.q_pe, inp.ckv_cache[:, :256],
                                                      inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE),
             ValueError, "built for latent width 512 and rope width 64")

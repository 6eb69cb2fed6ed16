"""The CUDA C++ path of the fused FP8 MLA decode: ``mla_decode_mma.cu``'s split kernel (mma.sync straight from the
FP8 tile), the Triton combine, the same plan, semantics and validation as :func:`kvwall.kernels.mla_decode_fp8`.

- :func:`mla_decode_fp8_cuda`: the call (checked or, with a plan, unchecked and CUDA-graph capturable);
- :func:`plan_mla_decode_cuda`: the batch's work list for a variant (tiles of the variant's ``block_n`` tokens,
  programs from its occupancy);
- :data:`VARIANTS`: the compiled launch shapes (warps, tokens per tile, pipeline stages), read from the source;
- :func:`nvcc_compile_check`: compile for an architecture without a GPU, with ptxas's resource report per variant
  (the architecture check, :mod:`kvwall.tuning.arch_check`, runs it for sm_90, sm_100 and sm_120).

On a GPU machine :func:`load_mla_decode_cuda` builds the source with ``torch.utils.cpp_extension.load`` (cached
per source version) and calls its C launcher through ``ctypes`` on the current stream, as chapter 4's CUDA twin
does. It needs ``cvt.rn.f16x2.e4m3x2`` (compute capability 8.9 or later) and 16-byte aligned cache rows (the tile
loads are 16-byte ``cp.async``); the caches' views of one ``[slots, 1, 576]`` pool qualify.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from kvwall.kernels._common import Fail, check_output, fail, sm_count
from kvwall.kernels.mla_decode.kernel import (LOG2E, MLADecodeConfig, MLADecodePlan, _kernel, _scale, _validate,
                                              plan_mla_decode)

_fail: Fail = functools.partial(fail, "mla_decode_fp8_cuda")

__all__ = ["mla_decode_fp8_cuda", "plan_mla_decode_cuda", "CudaPlan", "load_mla_decode_cuda", "nvcc_compile_check",
           "bind_library", "NvccReport", "VARIANTS", "Variant", "CUDA_SOURCE", "DEFAULT_VARIANT", "MIN_CAPABILITY", "cuda_refusal"]

CUDA_SOURCE = Path(__file__).with_name("mla_decode_mma.cu")
#: The header both CUDA C++ paths include (launch parameters, item bounds, the FP8 conversion).
CUDA_HEADER = Path(__file__).with_name("mla_decode_common.cuh")
NVCC_FLAGS = ["-O3", "-std=c++17"]
#: ``cvt.rn.f16x2.e4m3x2`` (the FP8 -> float16 conversion) needs sm_89 or later.
MIN_CAPABILITY = (8, 9)
DC, DR = 512, 64


@dataclass(frozen=True)
class Variant:
    index: int
    warps: int
    block_n: int
    stages: int
    min_blocks: int  # CTAs per SM the registers are capped for (__launch_bounds__)
    v_bits: int = 0  # 1: V converted by bit moves (integer pipes), K by cvt

    @property
    def smem(self) -> int:
        """Dynamic shared memory per CTA, bytes (the source's ``Shape<>::SMEM``)."""
        kv = self.stages * self.block_n * (DC + DR + 16)
        q = 16 * (DC + DR) * 2
        p = 16 * (self.block_n + 8) * 2
        return kv + q + p + 2 * self.warps * 16 * 4 + 2 * 16 * 4

    def __str__(self) -> str:
        return (f"v{self.index} ({self.warps} warps, {self.block_n} tokens, {self.stages} stages, "
                f"{self.min_blocks} CTA/SM{', V by bit moves' if self.v_bits else ''})")


def _read_variants() -> dict[int, Variant]:
    text = CUDA_SOURCE.read_text()
    block = text[text.index("#define KVWALL_MLA_VARIANTS"):]
    block = block[: block.index("\n\n")]
    return {int(i): Variant(int(i), int(w), int(n), int(s), int(m), int(vb)) for i, w, n, s, m, vb in
            re.findall(r"X\((\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+),\s*(\d+)\)", block)}


#: The launch shapes compiled into the library, by index.
VARIANTS: dict[int, Variant] = _read_variants()
#: The variant a call without one runs: 4 warps, 64-token tiles, 2 stages, 2 CTAs per SM (97 KB of shared
#: memory, so it also fits SM120's 99 KB per block); the fastest or within 5 % of it at most points measured.
DEFAULT_VARIANT = 5


class _Params(ctypes.Structure):
    """Mirror of ``kvwall_mla::Params`` (its size is checked against the library's at load)."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "qn", "qp", "ckv", "kpe", "indptr", "indices", "kvlen", "ckv_scale_ptr", "kpe_scale_ptr", "part_o",
        "part_lse", "out", "lse", "work")] + [(name, ctypes.c_int64) for name in (
            "stride_qn_b", "stride_qn_h", "stride_qp_b", "stride_qp_h", "stride_ckv", "stride_kpe", "stride_o_b",
            "stride_o_h")] + [(name, ctypes.c_float) for name in ("ckv_scale_val", "kpe_scale_val", "qk_scale")] + [
        (name, ctypes.c_int) for name in ("H", "num_indices", "num_units", "page", "indptr64", "indices64", "kvlen64",
                                          "scale_from_ptr", "write_lse", "q_vec", "out_vec")]


def _source_hash(source: Path = CUDA_SOURCE) -> str:
    """The build's cache key: ``source`` and the shared header."""
    return hashlib.sha256(source.read_bytes() + CUDA_HEADER.read_bytes()).hexdigest()[:10]


@functools.cache
def load_mla_decode_cuda(verbose: bool = False) -> ctypes.CDLL:
    """Build (once per source version) and load the CUDA path; needs CUDA, nvcc and a GPU of compute capability
    8.9 or later."""
    if not torch.cuda.is_available():
        raise RuntimeError("mla_decode_fp8_cuda needs an NVIDIA GPU; on this machine use mla_decode_fp8 (Triton, "
                           "which runs on CPU in the interpreter) or nvcc_compile_check() to compile-check the source.")
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    path = load(name="kvwall_mla_decode_mma_" + _source_hash(), sources=[str(CUDA_SOURCE)],
                extra_cuda_cflags=NVCC_FLAGS, is_python_module=False, verbose=verbose)
    return bind_library(ctypes.CDLL(path), "kvwall_mla_split",
                        [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p],
                        CUDA_SOURCE.name)


def bind_library(lib: ctypes.CDLL, split: str, split_args: list, source: str) -> ctypes.CDLL:
    """Declare a built CUDA path's entry points (its split launcher ``split`` with ``split_args``, the error string,
    the ``Params`` size) and check its ``Params`` against the ctypes mirror."""
    getattr(lib, split).restype = ctypes.c_int
    getattr(lib, split).argtypes = split_args
    lib.kvwall_mla_error_string.restype = ctypes.c_char_p
    lib.kvwall_mla_error_string.argtypes = [ctypes.c_int]
    lib.kvwall_mla_params_size.restype = ctypes.c_int
    if lib.kvwall_mla_params_size() != ctypes.sizeof(_Params):
        raise RuntimeError(f"{source}'s Params is {lib.kvwall_mla_params_size()} bytes, the ctypes mirror "
                           f"{ctypes.sizeof(_Params)}: they disagree.")
    return lib


@dataclass(frozen=True)
class CudaPlan(MLADecodePlan):
    """A work list cut for one CUDA variant (:func:`plan_mla_decode_cuda`): the plan and the variant it runs."""

    variant: int = DEFAULT_VARIANT


def cuda_refusal(device: torch.device) -> str | None:
    """Why the CUDA path cannot run on ``device`` (None when it can)."""
    if device.type != "cuda":
        return f"tensors are on {device}; the CUDA path needs a GPU (use mla_decode_fp8, the Triton path, on CPU)"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"compute capability {cap[0]}.{cap[1]} has no cvt.rn.f16x2.e4m3x2 (needs "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or later)")
    return None


def shared_limit(device: torch.device) -> int:
    """Shared memory a CTA may ask for on ``device`` (bytes, the opt-in limit)."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024)


def _programs(variant: Variant, device: torch.device) -> int:
    """CTAs the GPU runs at once for ``variant``: SMs x CTAs per SM by shared memory (1 KB reserved per CTA)."""
    props = torch.cuda.get_device_properties(device)
    per_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
    return sm_count(device) * max(1, per_sm // (variant.smem + 1024))


def plan_mla_decode_cuda(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None = None, *, heads: int,
                         page_size: int = 1, device: torch.device | None = None, variant: int = DEFAULT_VARIANT,
                         programs: int | None = None, waves: int = 1, min_chunk: int | None = None) -> MLADecodePlan:
    """The batch's work list (:func:`kvwall.kernels.mla_decode.plan_mla_decode`) cut for ``variant``'s tiles:
    ``programs`` CTAs at once (default: the variant's occupancy) times ``waves``; ``min_chunk`` tokens at least per
    chunk (default one tile)."""
    if variant not in VARIANTS:
        raise ValueError(f"plan_mla_decode_cuda: variant {variant} is not compiled; known: {sorted(VARIANTS)}.")
    v = VARIANTS[variant]
    device = torch.device(device) if device is not None else kv_indptr.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if programs is None:
        programs = _programs(v, device) if device.type == "cuda" else 1
    cfg = MLADecodeConfig(block_h=16, block_n=v.block_n, num_warps=v.warps, num_stages=v.stages)
    plan = plan_mla_decode(kv_indptr, kv_len, heads=heads, kv_lora_rank=DC, page_size=page_size, device=device,
                           config=cfg, programs=programs * max(1, waves), min_chunk=min_chunk)
    return CudaPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)}, variant=variant)


def _scales(ckv_scale, kpe_scale, device: torch.device) -> list[tuple[torch.Tensor | None, float]]:
    """``[(tensor or None, number)]`` for ckv_scale and kpe_scale, in one mode: if either is a tensor (read in the
    kernel, so a captured graph replays with what it holds), both are."""
    parsed = [_scale(name, s, device) for name, s in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale))]
    if any(t is not None for t, _ in parsed):
        parsed = [(t if t is not None else torch.full((1,), v, dtype=torch.float32, device=device), v)
                  for t, v in parsed]
    return parsed


def _rows_16b(t: torch.Tensor) -> bool:
    """Every ``[b, h]`` row of a 3-D 16-bit tensor starts 16-byte aligned (16-byte loads and stores are legal)."""
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


@dataclass
class _Inputs:
    """A validated call's tensors (row views of the caches), scales and sizes, shared by the CUDA C++ paths."""

    ckv: torch.Tensor
    kpe: torch.Tensor
    page_size: int
    scales: list[tuple[torch.Tensor | None, float]]  # [(ckv_scale tensor or None, value), (kpe_scale ...)]


def _checked_inputs(fail_: Fail, refusal, q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out,
                    check_range, kv_len, ckv_scale, kpe_scale) -> _Inputs:
    """The Triton path's validation plus what a CUDA C++ path needs (``refusal(device)``: why this path cannot run
    on the device, or None; widths 512 / 64; 16-byte aligned cache rows), each failure raised before any launch."""
    ckv, kpe, page_size, _ = _validate(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out,
                                       check_range, kv_len)
    device = q_nope.device
    why = refusal(device)
    if why:
        fail_(ValueError, f"the CUDA path cannot run here: {why}.")
    dc, dr = q_nope.shape[-1], q_pe.shape[-1]
    if (dc, dr) != (DC, DR):
        fail_(ValueError, f"the CUDA path is built for latent width {DC} and rope width {DR}; got {dc} and {dr} "
              "(mla_decode_fp8, the Triton path, takes any powers of two).")
    for name, rows in (("ckv_cache", ckv), ("kpe_cache", kpe)):
        if rows.data_ptr() % 16 or (rows.stride(0) * rows.element_size()) % 16:
            fail_(ValueError, f"{name}: the CUDA path loads 16-byte pieces of each row, so rows must start "
                  f"16-byte aligned (data_ptr % 16 = {rows.data_ptr() % 16}, row stride {rows.stride(0)} bytes); "
                  "use mla_decode_fp8 (Triton), which takes any row stride.")
    scales = _scales(ckv_scale, kpe_scale, device)
    if out is not None:
        check_output(out, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
                           "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_len": kv_len,
                           "ckv_scale": scales[0][0], "kpe_scale": scales[1][0]}, fail_)
    return _Inputs(ckv, kpe, page_size, scales)


def _check_plan(fail_: Fail, plan: MLADecodePlan, q_nope: torch.Tensor, page_size: int) -> None:
    batch, heads, dc = q_nope.shape
    want = (batch, heads, dc, page_size, q_nope.device)
    have = (plan.batch, plan.heads, plan.kv_lora_rank, plan.page_size, plan.device)
    if have != want:
        fail_(ValueError, f"the plan was made for (batch, heads, kv_lora_rank, page_size, device) = {have}; this "
              f"call has {want}.")


def _launch(launcher, who: str, inputs: _Inputs, plan: MLADecodePlan, q_nope, q_pe, kv_indptr, kv_indices,
            kv_len, sm_scale, out, return_lse, heads_per_cta: int):
    """Fill ``Params``, run ``launcher(params, head_blocks, items, stream)`` (a C launcher returning a CUDA error
    code), then the Triton combine for the requests with more than one chunk."""
    batch, heads, dc = q_nope.shape
    device = q_nope.device
    ckv, kpe = inputs.ckv, inputs.kpe
    (c_t, c_v), (k_t, k_v) = inputs.scales
    num_indices = kv_indices.numel()
    if num_indices == 0:
        kv_indices = torch.zeros(1, dtype=torch.int32, device=device)
    if out is None:
        out = torch.empty(batch, heads, dc, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device) if return_lse else None
    p = _Params(
        qn=q_nope.data_ptr(), qp=q_pe.data_ptr(), ckv=ckv.data_ptr(), kpe=kpe.data_ptr(), indptr=kv_indptr.data_ptr(),
        indices=kv_indices.data_ptr(), kvlen=(kv_len if kv_len is not None else kv_indptr).data_ptr(),
        ckv_scale_ptr=c_t.data_ptr() if c_t is not None else None,
        kpe_scale_ptr=k_t.data_ptr() if k_t is not None else None,
        part_o=plan.part_o.data_ptr(), part_lse=plan.part_lse.data_ptr(), out=out.data_ptr(),
        lse=lse.data_ptr() if lse is not None else None, work=plan.work.data_ptr(),
        stride_qn_b=q_nope.stride(0), stride_qn_h=q_nope.stride(1), stride_qp_b=q_pe.stride(0),
        stride_qp_h=q_pe.stride(1), stride_ckv=ckv.stride(0), stride_kpe=kpe.stride(0), stride_o_b=out.stride(0),
        stride_o_h=out.stride(1), ckv_scale_val=c_v, kpe_scale_val=k_v, qk_scale=float(sm_scale) * LOG2E,
        H=heads, num_indices=num_indices, num_units=ckv.shape[0] // inputs.page_size, page=inputs.page_size,
        indptr64=int(kv_indptr.dtype == torch.int64), indices64=int(kv_indices.dtype == torch.int64),
        kvlen64=int(kv_len is not None and kv_len.dtype == torch.int64), scale_from_ptr=int(c_t is not None),
        write_lse=int(return_lse), q_vec=int(_rows_16b(q_nope) and _rows_16b(q_pe)), out_vec=int(_rows_16b(out)))
    stream = torch.cuda.current_stream(device).cuda_stream
    code, message = launcher(p, -(-heads // heads_per_cta), plan.items, stream)
    if code != 0:
        raise RuntimeError(f"{who}: launch failed: {message} (code {code}).")
    combined = len(plan.work_list.combine)
    if combined:
        cfg = plan.config
        block_d = min(cfg.combine_block_d, dc)
        block_s = cfg.combine_block_s or min(1 << max(0, (plan.work_list.max_chunks - 1).bit_length()), 512)
        warps = cfg.combine_warps or (8 if block_s * block_d >= 8192 else 4)
        _kernel("combine", False)[(combined, heads, dc // block_d)](
            plan.part_o, plan.part_lse, out, lse if lse is not None else plan.part_lse, heads, 0, out.stride(0),
            out.stride(1), plan.combine_requests, plan.part_indptr, DC=dc, BLOCK_D=block_d, BLOCK_S=block_s,
            WRITE_LSE=return_lse, RNE_BY_BITS=False, WORKLIST=True, num_warps=warps)
    return (out, lse) if return_lse else out


def mla_decode_fp8_cuda(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                        kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *,
                        ckv_scale: float | torch.Tensor = 1.0, kpe_scale: float | torch.Tensor = 1.0,
                        out: torch.Tensor | None = None, return_lse: bool = False, kv_len: torch.Tensor | None = None,
                        check_range: bool = True, plan: MLADecodePlan | None = None, variant: int | None = None):
    """:func:`kvwall.kernels.mla_decode_fp8`'s contract, run by the CUDA C++ split kernel (``variant``: one of
    :data:`VARIANTS`, default the plan's, else :data:`DEFAULT_VARIANT`) and the Triton combine. A checked call
    plans for itself; an unchecked one (``check_range=False``, CUDA-graph capture) needs ``plan`` from
    :func:`plan_mla_decode_cuda`. Latent width 512 and rope width 64 only (DeepSeek / GLM MLA)."""
    inputs = _checked_inputs(_fail, cuda_refusal, q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices,
                             sm_scale, out, check_range, kv_len, ckv_scale, kpe_scale)
    device = q_nope.device
    heads = q_nope.shape[1]
    if plan is None:
        if not check_range:
            _fail(ValueError, "an unchecked call (check_range=False) of the CUDA path needs plan= from "
                  "plan_mla_decode_cuda (made once per step, outside CUDA-graph capture).")
        plan = plan_mla_decode_cuda(kv_indptr, kv_len, heads=heads, page_size=inputs.page_size, device=device,
                                    variant=DEFAULT_VARIANT if variant is None else variant)
    if not isinstance(plan, CudaPlan):
        _fail(TypeError, f"plan must come from plan_mla_decode_cuda, got {type(plan).__name__}.")
    if variant is None:
        variant = plan.variant
    elif variant not in VARIANTS or VARIANTS[variant].block_n != VARIANTS[plan.variant].block_n:
        _fail(ValueError, f"variant {variant} does not run a plan cut for {VARIANTS[plan.variant]} (tiles of "
              f"{VARIANTS[plan.variant].block_n} tokens).")
    if VARIANTS[variant].smem > shared_limit(device):
        _fail(ValueError, f"{VARIANTS[variant]} needs {VARIANTS[variant].smem} B of shared memory per CTA; this GPU "
              f"allows {shared_limit(device)} B: pick a variant that fits (e.g. {DEFAULT_VARIANT}).")
    _check_plan(_fail, plan, q_nope, inputs.page_size)
    lib = load_mla_decode_cuda()

    def launcher(params, head_blocks, items, stream):
        code = lib.kvwall_mla_split(ctypes.byref(params), variant, head_blocks, items, stream)
        return code, lib.kvwall_mla_error_string(code).decode() if code else ""

    return _launch(launcher, "mla_decode_fp8_cuda", inputs, plan, q_nope, q_pe, kv_indptr, kv_indices, kv_len, sm_scale, out,
                   return_lse, heads_per_cta=16)


@dataclass
class NvccReport:
    """ptxas's resource report for one CUDA source (``mla_decode_mma.cu`` unless said) on one architecture, per
    variant."""

    ok: bool
    arch: str
    seconds: float
    nvcc: str
    registers: dict[int, int]  # variant -> registers per thread
    spill_bytes: dict[int, int]  # variant -> spill stores + loads (bytes)
    stack_bytes: dict[int, int]  # variant -> stack frame (bytes)
    log: str
    source: str = "mla_decode_mma.cu"

    def summary(self) -> str:
        regs = ", ".join(f"v{k}: {v}" for k, v in sorted(self.registers.items()))
        spills = sum(self.spill_bytes.values())
        return (f"nvcc {'compiled' if self.ok else 'FAILED on'} {self.source} for {self.arch} in "
                f"{self.seconds:.1f} s ({self.nvcc}); registers {regs or 'n/a'}; "
                f"{'spills: ' + str(self.spill_bytes) if spills else 'no spills'}.")


_ENTRY = re.compile(r"Compiling entry function "
                    r"'_ZN10kvwall_mla16mla_split_kernelILi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E")


def nvcc_compile_check(arch: str = "sm_90", nvcc: str | None = None) -> NvccReport:
    """Compile ``mla_decode_mma.cu`` for ``arch`` with ``nvcc`` (no GPU needed); ptxas reports each variant's
    registers, stack frame and spills."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH: install the CUDA toolkit to compile-check mla_decode_mma.cu.")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    number = arch.removeprefix("sm_")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_{number},code=sm_{number}", "-Xptxas", "-v",
                               "-c", str(CUDA_SOURCE), "-o", str(Path(tmp) / "mla.o")],
                              capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    by_shape = {(v.warps, v.block_n, v.stages, v.min_blocks, v.v_bits): v.index for v in VARIANTS.values()}
    registers: dict[int, int] = {}
    spills: dict[int, int] = {}
    stack: dict[int, int] = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = by_shape.get(tuple(int(x) for x in m.groups()))
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stack[current] = int(m.group(1))
            spills[current] = int(m.group(2)) + int(m.group(3))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            registers[current] = int(m.group(1))
    return NvccReport(proc.returncode == 0, arch, seconds, version, registers, spills, stack, log)


def _profile_one(heads: int, tokens: int, variant: int, page_size: int = 64, seed: int = 0) -> None:
    """What ``fused_decode_cuda`` runs under ncu: one request of ``tokens`` tokens on random pages of a 495K-slot
    FP8 pool, ``variant``'s split kernel called four times (ncu skips three)."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = 495_000 // page_size * page_size
    pool = (torch.randn(slots, DC + DR, generator=gen, device=device) * 0.7).to(torch.float8_e4m3fn)
    paged = pool.view(slots // page_size, page_size, DC + DR)
    n_pages = -(-tokens // page_size)
    indices = torch.randperm(slots // page_size, generator=gen, device=device)[:n_pages].to(torch.int32)
    indptr = torch.tensor([0, n_pages], dtype=torch.int32, device=device)
    kv_len = torch.tensor([tokens], dtype=torch.int32, device=device)
    q_nope = (torch.randn(1, heads, DC, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    q_pe = (torch.randn(1, heads, DR, generator=gen, device=device) * 0.5).to(torch.bfloat16)
    plan = plan_mla_decode_cuda(indptr, kv_len, heads=heads, page_size=page_size, variant=variant)
    for _ in range(4):
        mla_decode_fp8_cuda(q_nope, q_pe, paged[:, :, :DC], paged[:, :, DC:], indptr, indices, 1 / 16, kv_len=kv_len,
                            check_range=False, plan=plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 5 and sys.argv[1] == "--profile-one":
        _profile_one(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        print("usage: python -m kvwall.kernels.mla_decode.cuda --profile-one HEADS TOKENS VARIANT")
        sys.exit(2)

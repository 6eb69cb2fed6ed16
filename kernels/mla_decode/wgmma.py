"""The wgmma path of the fused FP8 MLA decode (Hopper): ``mla_decode_wgmma.cu``'s split kernel (warpgroup MMA, 64
heads per CTA, the FP8 tile converted once into a swizzled float16 tile that serves as K and as V), the Triton
combine, and the same plan, semantics and validation as the Triton path (:func:`kvwall.kernels.mla_decode_fp8`).

- :func:`mla_decode_fp8_wgmma`: the call (checked, or unchecked with a plan: CUDA-graph capturable);
- :func:`plan_mla_decode_wgmma`: the batch's work list for this kernel (64-token tiles, 64 heads per CTA, one CTA
  per SM), a :class:`WgmmaPlan`;
- :func:`wgmma_refusal`: why it cannot run on a device (it is built for sm_90a only: H100 / H200);
  :func:`rows_refusal`: why given cache rows cannot be read by it (16-byte aligned rows, latent 512 / rope 64);
- :func:`nvcc_compile_check_wgmma`: ptxas's resource report (:class:`NvccReport`) without a GPU;
- :func:`trace_wgmma_phases`: where a tile's cycles go, per warpgroup and phase (a ``KVWALL_TRACE`` build).

The kernel is built with nvcc directly (``-gencode=arch=compute_90a,code=sm_90a``, a shared library cached per
source version in ``$KVWALL_BUILD_CACHE``, default ``~/.cache/kvwall``) and called through ``ctypes`` on the
current stream with :class:`Params`, the mirror of ``mla_decode_common.cuh``'s ``kvwall_mla::Params`` (its size is
checked against the library's at load).
"""

from __future__ import annotations

import contextlib
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
from typing import Callable, Iterator

import torch

from kvwall.kernels._common import Fail, check_output, fail, sm_count
from kvwall.kernels.mla_decode.kernel import (LOG2E, MLADecodeConfig, MLADecodePlan, launch_combine, parse_scale,
                                              plan_mla_decode, validate_call)
from kvwall.kernels.mla_decode.plan import build_work_list

__all__ = ["mla_decode_fp8_wgmma", "plan_mla_decode_wgmma", "WgmmaPlan", "wgmma_refusal", "rows_refusal",
           "profile_inputs", "profile_main",
           "load_mla_decode_wgmma", "nvcc_compile_check_wgmma", "NvccReport", "Params", "source_hash",
           "trace_wgmma_phases", "traced_build", "PhaseTrace", "TRACE_PHASES", "TRACE_FIXED", "WGMMA_SOURCE",
           "CUDA_HEADER", "NVCC_FLAGS", "DC", "DR", "HEADS_PER_CTA", "BLOCK_N", "THREADS", "SMEM_BYTES", "ARCH",
           "whole_wave_items", "ITEM_OVERHEAD_TOKENS"]

_fail: Fail = functools.partial(fail, "mla_decode_fp8_wgmma")

WGMMA_SOURCE = Path(__file__).with_name("mla_decode_wgmma.cu")
#: The header the source includes (launch parameters, item bounds, the FP8 conversion): part of the build's key.
CUDA_HEADER = Path(__file__).with_name("mla_decode_common.cuh")
NVCC_FLAGS = ["-O3", "-std=c++17"]
#: The only architecture this kernel is built for: wgmma needs the sm_90a target, whose code runs on 9.0 alone.
ARCH = "sm_90a"
#: The latent (ckv) and rope (kpe) widths the kernel is built for (DeepSeek / GLM MLA).
DC, DR = 512, 64
HEADS_PER_CTA = 64
BLOCK_N = 64
THREADS = 256
#: Dynamic shared memory per CTA (the source's ``wg::SMEM``): Q, two converted tiles, P, the row exchanges.
SMEM_BYTES = 3 * 9 * 64 * 128 + 64 * 128 + 4 * 64 * 4


class Params(ctypes.Structure):
    """Mirror of ``kvwall_mla::Params`` (``mla_decode_common.cuh``); its size is checked against the library's at
    load."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "qn", "qp", "ckv", "kpe", "indptr", "indices", "kvlen", "ckv_scale_ptr", "kpe_scale_ptr", "part_o",
        "part_lse", "out", "lse", "work")] + [(name, ctypes.c_int64) for name in (
            "stride_qn_b", "stride_qn_h", "stride_qp_b", "stride_qp_h", "stride_ckv", "stride_kpe", "stride_o_b",
            "stride_o_h")] + [(name, ctypes.c_float) for name in ("ckv_scale_val", "kpe_scale_val", "qk_scale")] + [
        (name, ctypes.c_int) for name in ("H", "num_indices", "num_units", "page", "indptr64", "indices64", "kvlen64",
                                          "scale_from_ptr", "write_lse", "q_vec", "out_vec")]


def source_hash() -> str:
    """The build's cache key: the source and the header it includes, as bytes (10 hex digits)."""
    return hashlib.sha256(WGMMA_SOURCE.read_bytes() + CUDA_HEADER.read_bytes()).hexdigest()[:10]


@dataclass(frozen=True)
class WgmmaPlan(MLADecodePlan):
    """A work list cut for the warpgroup kernel (:func:`plan_mla_decode_wgmma`)."""


def wgmma_refusal(device: torch.device) -> str | None:
    """Why the wgmma path cannot run on ``device`` (None when it can): it needs a GPU of compute capability 9.0."""
    if device.type != "cuda":
        return f"tensors are on {device}; the wgmma path needs an H100 / H200 (use mla_decode_fp8, the Triton path)"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return (f"compute capability {cap[0]}.{cap[1]}: the wgmma path is built for sm_90a (9.0) only; use "
                "mla_decode_fp8 (the Triton path)")
    return None


def rows_refusal(dims: tuple[int, int], rows: dict[str, torch.Tensor | None]) -> str | None:
    """Why the wgmma path cannot read these caches (None when it can): ``dims`` (latent, rope widths) must be
    (512, 64), and each of ``rows`` (name -> a cache, ``[slots, width]``, ``[slots, 1, width]`` or ``[pages, page_size,
    width]``; None: not known) must start 16-byte aligned with a token row stride that is a multiple of 16 bytes
    (the kernel loads 16-byte pieces of each row)."""
    if tuple(dims) != (DC, DR):
        return (f"the wgmma path is built for latent width {DC} and rope width {DR}; got {dims[0]} and {dims[1]} "
                "(mla_decode_fp8, the Triton path, takes any powers of two)")
    for name, t in rows.items():
        if t is None:
            continue
        # a token's row stride: [slots, D] and [slots, 1, D] step by dim 0, [pages, page_size, D] by dim 1
        stride = (t.stride(0) if t.dim() == 2 or t.shape[-2] == 1 else t.stride(-2)) * t.element_size()
        if t.data_ptr() % 16 or stride % 16:
            return (f"{name}: the wgmma path loads 16-byte pieces of each row, so rows must start 16-byte aligned "
                    f"(data_ptr % 16 = {t.data_ptr() % 16}, row stride {stride} bytes); use mla_decode_fp8 (the "
                    "Triton path), which takes any row stride")
    return None


def _nvcc() -> str:
    nvcc = shutil.which("nvcc") or (os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")
                                    if "CUDA_HOME" in os.environ else None)
    if nvcc is None or not os.path.exists(nvcc):
        raise FileNotFoundError("nvcc is not on PATH: the wgmma path is built with nvcc at first use.")
    return nvcc


def _cache_dir() -> Path:
    root = Path(os.environ.get("KVWALL_BUILD_CACHE", Path.home() / ".cache" / "kvwall"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the library's entry points and check its ``Params`` and shape against the host's."""
    lib.kvwall_mla_wgmma_split.restype = ctypes.c_int
    lib.kvwall_mla_wgmma_split.argtypes = [ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.kvwall_mla_error_string.restype = ctypes.c_char_p
    lib.kvwall_mla_error_string.argtypes = [ctypes.c_int]
    lib.kvwall_mla_params_size.restype = ctypes.c_int
    if lib.kvwall_mla_params_size() != ctypes.sizeof(Params):
        raise RuntimeError(f"{WGMMA_SOURCE.name}'s Params is {lib.kvwall_mla_params_size()} bytes, the ctypes mirror "
                           f"{ctypes.sizeof(Params)}: they disagree.")
    shape = (ctypes.c_int * 4)()
    lib.kvwall_mla_wgmma_shape(*(ctypes.byref(shape, 4 * i) for i in range(4)))
    if tuple(shape) != (SMEM_BYTES, HEADS_PER_CTA, BLOCK_N, THREADS):
        raise RuntimeError(f"{WGMMA_SOURCE.name}'s shape {tuple(shape)} differs from the host's "
                           f"{(SMEM_BYTES, HEADS_PER_CTA, BLOCK_N, THREADS)}.")
    return lib


@functools.cache
def load_mla_decode_wgmma(trace: bool = False) -> ctypes.CDLL:
    """Build (once per source version) and load the wgmma path; ``trace``: the diagnostic ``KVWALL_TRACE`` build
    (:func:`trace_wgmma_phases`), a library of its own."""
    if not torch.cuda.is_available():
        raise RuntimeError("mla_decode_fp8_wgmma needs an H100 / H200; on this machine use mla_decode_fp8 (Triton) or "
                           "nvcc_compile_check_wgmma() to compile-check the source.")
    tag = "_trace" if trace else ""
    so = _cache_dir() / f"kvwall_mla_wgmma{tag}_{source_hash()}.so"
    if not so.exists():
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([_nvcc(), *NVCC_FLAGS, *(["-DKVWALL_TRACE"] if trace else []),
                               f"-gencode=arch=compute_90a,code={ARCH}", "-shared", "-Xcompiler", "-fPIC",
                               str(WGMMA_SOURCE), "-o", str(tmp)], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed to build {WGMMA_SOURCE.name}:\n{proc.stdout}{proc.stderr}")
        os.replace(tmp, so)
    lib = _bind(ctypes.CDLL(str(so)))
    if trace:
        lib.kvwall_mla_trace.restype = ctypes.c_int
        lib.kvwall_mla_trace.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    return lib


#: The ``KVWALL_TRACE`` build's phases of one tile, per warpgroup, in the order of the source's ``TRACE(k)`` marks
#: (k = the index here): each is the cycles from the previous mark to this one, as lane 0 of the warpgroup's first
#: warp sees them (``clock64``).
TRACE_PHASES: dict[int, tuple[str, ...]] = {
    0: ("wait for the tile", "scores (36 wgmma)", "softmax", "wait for P's buffer", "hand P over",
        "P V, columns 0-255"),
    1: ("wait for P", "P V, columns 256-511", "wait for a free buffer", "convert the next tile",
        "issue the next loads"),
}
#: Once per CTA, by mark index: the query prologue, the first tiles' loads (warpgroup 1), the write at the end.
TRACE_FIXED: dict[int, str] = {8: "query prologue", 10: "first tiles", 9: "normalize and write"}


@dataclass(frozen=True)
class PhaseTrace:
    """One traced launch: ``per_tile[warpgroup][phase]`` = cycles per tile summed over CTAs / tiles;
    ``per_cta[warpgroup][fixed phase]`` = cycles per CTA."""

    ctas: int
    tiles: int
    per_tile: dict[int, dict[str, float]]
    per_cta: dict[int, dict[str, float]]


_TRACING = False


@contextlib.contextmanager
def traced_build() -> Iterator[None]:
    """Within it, :func:`mla_decode_fp8_wgmma` launches the ``KVWALL_TRACE`` build (e.g. to time what the clock
    reads cost)."""
    global _TRACING
    _TRACING = True
    try:
        yield
    finally:
        _TRACING = False


def trace_wgmma_phases(call: Callable[[], object]) -> PhaseTrace:
    """Run ``call`` (one or more :func:`mla_decode_fp8_wgmma` calls, none captured in a graph) once on the
    ``KVWALL_TRACE`` build and return where its tiles' cycles went. The build differs from the shipped one only
    by the clock reads and their shared-memory sums; time the shipped build, not this one."""
    lib = load_mla_decode_wgmma(trace=True)
    counters = (ctypes.c_ulonglong * 32)()
    for step in ("zero", "read"):  # zero what earlier traced launches left, run, read
        if step == "read":
            with traced_build():
                call()
            torch.cuda.synchronize()
        code = lib.kvwall_mla_trace(counters, 1)
        if code:
            raise RuntimeError(f"kvwall_mla_trace: {lib.kvwall_mla_error_string(code).decode()}")
    v = list(counters)
    per_tile: dict[int, dict[str, float]] = {}
    per_cta: dict[int, dict[str, float]] = {}
    for wg, names in TRACE_PHASES.items():
        row = v[16 * wg:16 * wg + 16]
        ctas, tiles = row[14], row[15]
        if not ctas or not tiles:
            raise RuntimeError("trace_wgmma_phases: the call ran no wgmma tile (is it a wgmma call with tokens?)")
        per_tile[wg] = {name: row[k] / tiles for k, name in enumerate(names)}
        per_cta[wg] = {name: row[k] / ctas for k, name in TRACE_FIXED.items() if wg == 1 or k != 10}
    return PhaseTrace(ctas=v[14], tiles=v[15], per_tile=per_tile, per_cta=per_cta)


#: Per-CTA fixed work in tokens' worth, for choosing how many waves a work list fills (query load, first tiles'
#: latency, partial write): about five tiles.
ITEM_OVERHEAD_TOKENS = 5 * BLOCK_N


def whole_wave_items(lengths: list[int], head_blocks: int, slots: int, max_waves: int = 4) -> int:
    """Items per head block to ask the work list for so that ``head_blocks`` x items fills whole waves of ``slots``
    CTAs (one per SM): for each wave count ``k`` the largest request that yields at most ``k * slots / head_blocks``
    items, then the ``k`` with the least estimated time, ``k`` x (largest chunk + :data:`ITEM_OVERHEAD_TOKENS`).
    (Asking for ``slots / head_blocks`` items directly can yield a few more -- each request's chunks round up --
    and a second wave of a handful of CTAs doubles the time.)"""
    best: tuple[float, int] | None = None
    for k in range(1, max_waves + 1):
        limit = max(1, k * slots // head_blocks)
        want = limit
        while want >= 1:
            wl = build_work_list(lengths, block_n=BLOCK_N, items_wanted=want)
            if len(wl.items) <= limit:
                cost = k * (wl.chunk_tokens + ITEM_OVERHEAD_TOKENS)
                if best is None or cost < best[0]:
                    best = (cost, want)
                break
            want -= max(1, want // 32)
    return best[1] if best else 1


def plan_mla_decode_wgmma(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None = None, *, heads: int,
                          page_size: int = 1, device: torch.device | None = None, programs: int | None = None,
                          waves: int = 1, min_chunk: int | None = None) -> WgmmaPlan:
    """The batch's work list (:func:`kvwall.kernels.mla_decode.plan_mla_decode`) for 64-token tiles and 64 heads per
    CTA. Default: items sized to fill whole waves of one CTA per SM (:func:`whole_wave_items`); ``programs``:
    aim at that many CTAs at once instead, times ``waves``."""
    device = torch.device(device) if device is not None else kv_indptr.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    head_blocks = -(-heads // HEADS_PER_CTA)
    if programs is None and device.type == "cuda" and min_chunk is None:
        ptr = [int(x) for x in kv_indptr.tolist()]
        lengths = ([int(x) for x in kv_len.tolist()] if page_size != 1 and kv_len is not None
                   else [b - a for a, b in zip(ptr, ptr[1:])])
        programs = head_blocks * whole_wave_items(lengths, head_blocks, sm_count(device) * max(1, waves))
        waves = 1
    elif programs is None:
        programs = sm_count(device) if device.type == "cuda" else 1
    cfg = MLADecodeConfig(block_h=HEADS_PER_CTA, block_n=BLOCK_N, num_warps=THREADS // 32, num_stages=2)
    plan = plan_mla_decode(kv_indptr, kv_len, heads=heads, kv_lora_rank=DC, page_size=page_size, device=device,
                           config=cfg, programs=programs * max(1, waves), min_chunk=min_chunk)
    return WgmmaPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)})


def _rows_16b(t: torch.Tensor) -> bool:
    """Every ``[b, h]`` row of a 3-D 16-bit tensor starts 16-byte aligned (16-byte loads and stores are legal)."""
    return t.data_ptr() % 16 == 0 and all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


@dataclass(frozen=True)
class _Inputs:
    """A validated call's cache row views, page size and scales (``(tensor or None, value)`` for ckv, kpe)."""

    ckv: torch.Tensor
    kpe: torch.Tensor
    page_size: int
    scales: tuple[tuple[torch.Tensor | None, float], tuple[torch.Tensor | None, float]]


def _checked_inputs(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range, kv_len,
                    ckv_scale, kpe_scale) -> _Inputs:
    """The Triton path's validation (:func:`~kvwall.kernels.mla_decode.kernel.validate_call`) plus what this kernel
    needs (an H100 / H200, widths 512 / 64, 16-byte aligned cache rows), each failure raised before any launch."""
    ckv, kpe, page_size, _ = validate_call(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out,
                                           check_range, kv_len)
    device = q_nope.device
    why = wgmma_refusal(device) or rows_refusal((q_nope.shape[-1], q_pe.shape[-1]),
                                                {"ckv_cache": ckv, "kpe_cache": kpe})
    if why:
        _fail(ValueError, f"the wgmma path cannot run here: {why}.")
    parsed = [parse_scale(name, s, device) for name, s in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale))]
    if any(t is not None for t, _ in parsed):  # one mode for both: a tensor (read in the kernel) for the number
        parsed = [(t if t is not None else torch.full((1,), v, dtype=torch.float32, device=device), v)
                  for t, v in parsed]
    if out is not None:
        check_output(out, {"q_nope": q_nope, "q_pe": q_pe, "ckv_cache": ckv_cache, "kpe_cache": kpe_cache,
                           "kv_indptr": kv_indptr, "kv_indices": kv_indices, "kv_len": kv_len,
                           "ckv_scale": parsed[0][0], "kpe_scale": parsed[1][0]}, _fail)
    return _Inputs(ckv, kpe, page_size, (parsed[0], parsed[1]))


def _params(inputs: _Inputs, plan: MLADecodePlan, q_nope, q_pe, kv_indptr, kv_indices, num_indices: int, kv_len,
            sm_scale, out, lse) -> Params:
    """The launch parameters of one call: ``kv_indices`` a valid pointer (one dummy entry where the call has none),
    ``num_indices`` the call's own count (``kv_indptr`` is clamped to it), ``out`` allocated."""
    ckv, kpe = inputs.ckv, inputs.kpe
    (c_t, c_v), (k_t, k_v) = inputs.scales
    return Params(
        qn=q_nope.data_ptr(), qp=q_pe.data_ptr(), ckv=ckv.data_ptr(), kpe=kpe.data_ptr(), indptr=kv_indptr.data_ptr(),
        indices=kv_indices.data_ptr(), kvlen=(kv_len if kv_len is not None else kv_indptr).data_ptr(),
        ckv_scale_ptr=c_t.data_ptr() if c_t is not None else None,
        kpe_scale_ptr=k_t.data_ptr() if k_t is not None else None,
        part_o=plan.part_o.data_ptr(), part_lse=plan.part_lse.data_ptr(), out=out.data_ptr(),
        lse=lse.data_ptr() if lse is not None else None, work=plan.work.data_ptr(),
        stride_qn_b=q_nope.stride(0), stride_qn_h=q_nope.stride(1), stride_qp_b=q_pe.stride(0),
        stride_qp_h=q_pe.stride(1), stride_ckv=ckv.stride(0), stride_kpe=kpe.stride(0), stride_o_b=out.stride(0),
        stride_o_h=out.stride(1), ckv_scale_val=c_v, kpe_scale_val=k_v, qk_scale=float(sm_scale) * LOG2E,
        H=q_nope.shape[1], num_indices=num_indices, num_units=ckv.shape[0] // inputs.page_size,
        page=inputs.page_size, indptr64=int(kv_indptr.dtype == torch.int64),
        indices64=int(kv_indices.dtype == torch.int64), kvlen64=int(kv_len is not None and kv_len.dtype == torch.int64),
        scale_from_ptr=int(c_t is not None), write_lse=int(lse is not None),
        q_vec=int(_rows_16b(q_nope) and _rows_16b(q_pe)), out_vec=int(_rows_16b(out)))


def mla_decode_fp8_wgmma(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                         kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *,
                         ckv_scale: float | torch.Tensor = 1.0, kpe_scale: float | torch.Tensor = 1.0,
                         out: torch.Tensor | None = None, return_lse: bool = False,
                         kv_len: torch.Tensor | None = None, check_range: bool = True,
                         plan: MLADecodePlan | None = None):
    """:func:`kvwall.kernels.mla_decode_fp8`'s contract on the warpgroup kernel and the Triton combine (H100 / H200
    only). A checked call plans for itself; an unchecked one (``check_range=False``, CUDA-graph capture) needs
    ``plan`` from :func:`plan_mla_decode_wgmma`. Latent width 512 and rope width 64 only, 16-byte aligned cache
    rows (:func:`rows_refusal`)."""
    inputs = _checked_inputs(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range,
                             kv_len, ckv_scale, kpe_scale)
    batch, heads, dc = q_nope.shape
    device = q_nope.device
    if plan is None:
        if not check_range:
            _fail(ValueError, "an unchecked call (check_range=False) of the wgmma path needs plan= from "
                  "plan_mla_decode_wgmma (made once per step, outside CUDA-graph capture).")
        plan = plan_mla_decode_wgmma(kv_indptr, kv_len, heads=heads, page_size=inputs.page_size, device=device)
    if not isinstance(plan, WgmmaPlan):
        _fail(TypeError, f"plan must come from plan_mla_decode_wgmma, got {type(plan).__name__}.")
    want = (batch, heads, dc, inputs.page_size, device)
    have = (plan.batch, plan.heads, plan.kv_lora_rank, plan.page_size, plan.device)
    if have != want:
        _fail(ValueError, f"the plan was made for (batch, heads, kv_lora_rank, page_size, device) = {have}; this "
              f"call has {want}.")
    lib = load_mla_decode_wgmma(trace=_TRACING)
    num_indices = kv_indices.numel()
    if num_indices == 0:  # a valid pointer for the (never executed) index loads
        kv_indices = torch.zeros(1, dtype=torch.int32, device=device)
    if out is None:
        out = torch.empty(batch, heads, dc, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device) if return_lse else None
    params = _params(inputs, plan, q_nope, q_pe, kv_indptr, kv_indices, num_indices, kv_len, sm_scale, out, lse)
    code = lib.kvwall_mla_wgmma_split(ctypes.byref(params), -(-heads // HEADS_PER_CTA), plan.items,
                                      torch.cuda.current_stream(device).cuda_stream)
    if code != 0:
        raise RuntimeError(f"mla_decode_fp8_wgmma: launch failed: {lib.kvwall_mla_error_string(code).decode()} "
                           f"(code {code}).")
    launch_combine(plan, out, lse)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class NvccReport:
    """ptxas's resource report for ``mla_decode_wgmma.cu``'s split kernel (:func:`nvcc_compile_check_wgmma`):
    registers per thread, stack frame and spill stores + loads in bytes (None where ptxas did not report them)."""

    ok: bool
    arch: str
    seconds: float
    nvcc: str
    registers: int | None
    spill_bytes: int | None
    stack_bytes: int | None
    log: str
    trace: bool = False

    def summary(self) -> str:
        build = " (KVWALL_TRACE build)" if self.trace else ""
        return (f"nvcc {'compiled' if self.ok else 'FAILED on'} {WGMMA_SOURCE.name}{build} for {self.arch} in "
                f"{self.seconds:.1f} s ({self.nvcc}); {self.registers} registers, {self.stack_bytes} B stack, "
                f"{self.spill_bytes} B spilled.")


_ENTRY = re.compile(r"Compiling entry function '_ZN10kvwall_mla2wg22mla_wgmma_split_kernel")


def nvcc_compile_check_wgmma(nvcc: str | None = None, *, trace: bool = False) -> NvccReport:
    """Compile ``mla_decode_wgmma.cu`` for sm_90a with ``nvcc`` (no GPU needed) and read ptxas's report of the split
    kernel. ``trace``: the ``KVWALL_TRACE`` build."""
    nvcc = nvcc or _nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([nvcc, *NVCC_FLAGS, *(["-DKVWALL_TRACE"] if trace else []),
                               f"-gencode=arch=compute_90a,code={ARCH}", "-Xptxas", "-v", "-c",
                               str(WGMMA_SOURCE), "-o", str(Path(tmp) / "wg.o")],
                              capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    registers = spills = stack = None
    seen = False
    for line in log.splitlines():
        if _ENTRY.search(line):
            seen = True
            continue
        if not seen:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            stack, spills = int(m.group(1)), int(m.group(2)) + int(m.group(3))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            registers = int(m.group(1))
    return NvccReport(proc.returncode == 0 and seen, ARCH, seconds, version, registers, spills, stack, log, trace)


def profile_inputs(heads: int, tokens: int, page_size: int = 64, seed: int = 0) -> tuple[tuple, dict]:
    """What the profile experiment's program runs under ncu (this path's and the tokens-on-M path's): one request of
    ``tokens`` tokens on random pages of a 495K-slot FP8 pool; ``(the call's positional arguments, kv_len and
    page_size)``."""
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
    return (q_nope, q_pe, paged[:, :, :DC], paged[:, :, DC:], indptr, indices, 1 / 16), {"kv_len": kv_len,
                                                                                          "page_size": page_size}


def _profile_one(heads: int, tokens: int, page_size: int = 64, seed: int = 0) -> None:
    """What the profile experiment runs under ncu: :func:`profile_inputs`, the wgmma split kernel called four times
    (ncu skips three)."""
    args, at = profile_inputs(heads, tokens, page_size, seed)
    plan = plan_mla_decode_wgmma(args[4], at["kv_len"], heads=heads, page_size=at["page_size"])
    for _ in range(4):
        mla_decode_fp8_wgmma(*args, kv_len=at["kv_len"], check_range=False, plan=plan)
    torch.cuda.synchronize()


def profile_main(module: str, run: Callable[[int, int], None], argv: list[str]) -> int:
    """``python -m <module> --profile-one HEADS TOKENS``: ``run(heads, tokens)`` (this module's and the tokens-on-M
    module's program for Nsight Compute); the exit status."""
    if len(argv) == 3 and argv[0] == "--profile-one":
        run(int(argv[1]), int(argv[2]))
        return 0
    print(f"usage: python -m {module} --profile-one HEADS TOKENS")
    return 2


if __name__ == "__main__":
    import sys

    sys.exit(profile_main("kvwall.kernels.mla_decode.wgmma", _profile_one, sys.argv[1:]))

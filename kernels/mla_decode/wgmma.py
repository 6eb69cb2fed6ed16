"""The wgmma path of the fused FP8 MLA decode (Hopper): ``mla_decode_wgmma.cu``'s split kernel (warpgroup MMA, 64
rows per CTA -- heads, or a multi-token query's heads x tokens --, the FP8 tile converted once into a swizzled float16
tile that serves as K and as V), the Triton combine, and the same plan, semantics and validation as the Triton path
(:func:`kvwall.kernels.mla_decode_fp8`). What it shares with the tokens-on-M path -- the build, ``Params``, the
checks, the launch -- is :mod:`.hopper` (re-exported here under the names callers know).

- :func:`mla_decode_fp8_wgmma`: the call (checked, or unchecked with a plan: CUDA-graph capturable);
- :func:`plan_mla_decode_wgmma`: the batch's work list for this kernel (64-token tiles, 64 rows per CTA, one CTA
  per SM), a :class:`WgmmaPlan`;
- :func:`wgmma_refusal`: why it cannot run on a device (it is built for sm_90a only: H100 / H200);
  :func:`rows_refusal`: why given cache rows cannot be read by it (16-byte aligned rows, latent 512 / rope 64);
- :func:`nvcc_compile_check_wgmma`: ptxas's resource report (:class:`NvccReport`) without a GPU;
- :func:`trace_wgmma_phases`: where a tile's cycles go, per warpgroup and phase (a ``KVWALL_TRACE`` build).

Multi-token queries: the call takes the folded ``[batch, q_len * heads, D]`` tensors and ``q_len``; the plan is
made with ``q_len=`` for ``q_len * heads`` rows (16 heads x 4 draft tokens fill one CTA: a verify costs a decode).
``python -m kvwall.kernels.mla_decode.wgmma --profile-one HEADS TOKENS``: what the profile experiment runs under
Nsight Compute.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass
from typing import Callable

import torch

from kvwall.kernels.mla_decode import hopper
from kvwall.kernels.mla_decode.hopper import (
    ARCH,
    DC,
    DR,
    ITEM_OVERHEAD_TOKENS,
    NVCC_FLAGS,
    HopperPlan,
    Params,
    rows_refusal,
    wgmma_refusal,
    whole_wave_items,
)
from kvwall.kernels.mla_decode.plan import MLADecodePlan

__all__ = [
    "mla_decode_fp8_wgmma",
    "plan_mla_decode_wgmma",
    "WgmmaPlan",
    "wgmma_refusal",
    "rows_refusal",
    "profile_inputs",
    "profile_main",
    "check_library",
    "load_mla_decode_wgmma",
    "nvcc_compile_check_wgmma",
    "NvccReport",
    "Params",
    "source_hash",
    "trace_wgmma_phases",
    "traced_build",
    "PhaseTrace",
    "TRACE_PHASES",
    "TRACE_FIXED",
    "WGMMA_SOURCE",
    "CUDA_HEADER",
    "NVCC_FLAGS",
    "DC",
    "DR",
    "HEADS_PER_CTA",
    "BLOCK_N",
    "THREADS",
    "SMEM_BYTES",
    "ARCH",
    "whole_wave_items",
    "ITEM_OVERHEAD_TOKENS",
]

WGMMA_SOURCE = hopper.SOURCES["wgmma"]
#: The header with the launch parameters, item bounds and FP8 conversion (the build key covers every header).
CUDA_HEADER = WGMMA_SOURCE.with_name("mla_decode_common.cuh")
HEADS_PER_CTA = 64
BLOCK_N = 64
THREADS = 256
#: Dynamic shared memory per CTA (the source's ``wg::SMEM``): Q, two converted tiles, P, the row exchanges.
SMEM_BYTES = 3 * 9 * 64 * 128 + 64 * 128 + 4 * 64 * 4


def source_hash() -> str:
    """The shipped build's cache key (:func:`~kvwall.kernels.mla_decode.hopper.build_key`)."""
    return hopper.build_key("wgmma", hopper._nvcc(), hopper._flags(False))  # pylint: disable=protected-access


@dataclass(frozen=True)
class WgmmaPlan(HopperPlan):
    """A work list cut for the warpgroup kernel (:func:`plan_mla_decode_wgmma`)."""


def check_library(lib: ctypes.CDLL) -> None:
    """Declare the split entry point and check the library's shape against the host's (at load)."""
    lib.kvwall_mla_wgmma_split.restype = ctypes.c_int
    lib.kvwall_mla_wgmma_split.argtypes = [ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    shape = (ctypes.c_int * 4)()
    lib.kvwall_mla_wgmma_shape(*(ctypes.byref(shape, 4 * i) for i in range(4)))
    if tuple(shape) != (SMEM_BYTES, HEADS_PER_CTA, BLOCK_N, THREADS):
        raise RuntimeError(
            f"{WGMMA_SOURCE.name}'s shape {tuple(shape)} differs from the host's "
            f"{(SMEM_BYTES, HEADS_PER_CTA, BLOCK_N, THREADS)}."
        )
    if hasattr(lib, "kvwall_mla_trace"):
        lib.kvwall_mla_trace.restype = ctypes.c_int
        lib.kvwall_mla_trace.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]


def load_mla_decode_wgmma(trace: bool = False) -> ctypes.CDLL:
    """Build (once per build key) and load the wgmma path; ``trace``: the diagnostic ``KVWALL_TRACE`` build
    (:func:`trace_wgmma_phases`), a library of its own."""
    return hopper.load_library("wgmma", trace)


#: The ``KVWALL_TRACE`` build's phases of one tile, per warpgroup, in the order of the source's ``TRACE(k)`` marks
#: (k = the index here): each is the cycles from the previous mark to this one, as lane 0 of the warpgroup's first
#: warp sees them (``clock64``).
TRACE_PHASES: dict[int, tuple[str, ...]] = {
    0: (
        "wait for the tile",
        "scores (36 wgmma)",
        "softmax",
        "wait for P's buffer",
        "hand P over",
        "P V, columns 0-255",
    ),
    1: (
        "wait for P",
        "P V, columns 256-511",
        "wait for a free buffer",
        "convert the next tile",
        "issue the next loads",
    ),
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


def traced_build() -> contextlib.AbstractContextManager[None]:
    """Within it, :func:`mla_decode_fp8_wgmma` launches the ``KVWALL_TRACE`` build (e.g. to time what the clock
    reads cost)."""
    return hopper.traced_build("wgmma")


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
        row = v[16 * wg : 16 * wg + 16]
        ctas, tiles = row[14], row[15]
        if not ctas or not tiles:
            raise RuntimeError("trace_wgmma_phases: the call ran no wgmma tile (is it a wgmma call with tokens?)")
        per_tile[wg] = {name: row[k] / tiles for k, name in enumerate(names)}
        per_cta[wg] = {name: row[k] / ctas for k, name in TRACE_FIXED.items() if wg == 1 or k != 10}
    return PhaseTrace(ctas=v[14], tiles=v[15], per_tile=per_tile, per_cta=per_cta)


def plan_mla_decode_wgmma(
    kv_indptr: torch.Tensor,
    kv_len: torch.Tensor | None = None,
    *,
    heads: int,
    page_size: int = 1,
    device: torch.device | None = None,
    programs: int | None = None,
    waves: int = 1,
    min_chunk: int | None = None,
    q_len: int = 1,
) -> WgmmaPlan:
    """The batch's work list (:func:`kvwall.kernels.mla_decode.triton_path.plan_mla_decode_triton`) for 64-token tiles
    and 64 rows per CTA (``q_len`` x ``heads`` rows a request: ``q_len`` query tokens of ``heads`` heads). Default:
    items sized to fill whole waves of one CTA per SM (:func:`whole_wave_items`); ``programs``: aim at that many CTAs at
    once instead, times ``waves``."""
    return hopper.plan_hopper(
        WgmmaPlan,
        "plan_mla_decode_wgmma",
        kv_indptr,
        kv_len,
        heads=heads,
        heads_per_cta=lambda rows: HEADS_PER_CTA,
        warps=THREADS // 32,
        page_size=page_size,
        device=device,
        programs=programs,
        waves=waves,
        min_chunk=min_chunk,
        q_len=q_len,
    )


def mla_decode_fp8_wgmma(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    ckv_scale: float | torch.Tensor = 1.0,
    kpe_scale: float | torch.Tensor = 1.0,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    kv_len: torch.Tensor | None = None,
    check_range: bool = True,
    plan: MLADecodePlan | None = None,
    q_len: int = 1,
):
    """:func:`kvwall.kernels.mla_decode_fp8`'s contract on the warpgroup kernel and the Triton combine (H100 / H200
    only). A checked call plans for itself; an unchecked one (``check_range=False``, CUDA-graph capture) needs
    ``plan`` from :func:`plan_mla_decode_wgmma`. Latent width 512 and rope width 64 only, 16-byte aligned cache
    rows (:func:`rows_refusal`). ``q_len`` > 1: ``q_nope`` / ``q_pe`` (and ``out``) are folded, ``[batch, q_len *
    heads, D]``, and row ``r`` (token ``r // heads``) sees its token's causal prefix."""
    return hopper.run_checked(
        "wgmma",
        WgmmaPlan,
        plan_mla_decode_wgmma,
        (q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale),
        ckv_scale=ckv_scale,
        kpe_scale=kpe_scale,
        out=out,
        return_lse=return_lse,
        kv_len=kv_len,
        check_range=check_range,
        plan=plan,
        q_len=q_len,
    )


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
        return (
            f"nvcc {'compiled' if self.ok else 'FAILED on'} {WGMMA_SOURCE.name}{build} for {self.arch} in "
            f"{self.seconds:.1f} s ({self.nvcc}); {self.registers} registers, {self.stack_bytes} B stack, "
            f"{self.spill_bytes} B spilled."
        )


def nvcc_compile_check_wgmma(nvcc: str | None = None, *, trace: bool = False, multi: bool = False) -> NvccReport:
    """Compile ``mla_decode_wgmma.cu`` for sm_90a with ``nvcc`` (no GPU needed) and read ptxas's report of the split
    kernel: its decode instantiation (q_len 1), or with ``multi`` the multi-token one. ``trace``: the
    ``KVWALL_TRACE`` build."""
    ok, seconds, version, log, entries = hopper.ptxas_check("wgmma", nvcc, trace=trace)
    entry = f"_ZN10kvwall_mla2wg22mla_wgmma_split_kernelILb{int(multi)}EEEvNS_6ParamsE"
    none = {"registers": None, "spill_bytes": None, "stack_bytes": None}
    return NvccReport(ok and entry in entries, ARCH, seconds, version, log=log, trace=trace, **entries.get(entry, none))


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
    return (q_nope, q_pe, paged[:, :, :DC], paged[:, :, DC:], indptr, indices, 1 / 16), {
        "kv_len": kv_len,
        "page_size": page_size,
    }


def profile_main(module: str, call: Callable, plan_fn: Callable, argv: list[str]) -> int:
    """``python -m <module> --profile-one HEADS TOKENS``: what the profile experiment runs under Nsight Compute --
    :func:`profile_inputs`, the path's ``call`` four times on a ``plan_fn`` plan (ncu skips three); the exit
    status."""
    if len(argv) != 3 or argv[0] != "--profile-one":
        print(f"usage: python -m {module} --profile-one HEADS TOKENS")
        return 2
    heads, tokens = int(argv[1]), int(argv[2])
    args, at = profile_inputs(heads, tokens)
    plan = plan_fn(args[4], at["kv_len"], heads=heads, page_size=at["page_size"])
    for _ in range(4):
        call(*args, kv_len=at["kv_len"], check_range=False, plan=plan)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(profile_main("kvwall.kernels.mla_decode.wgmma", mla_decode_fp8_wgmma, plan_mla_decode_wgmma, sys.argv[1:]))

"""The tokens-on-M wgmma path of the fused FP8 MLA decode (Hopper, few heads per GPU): ``mla_decode_wgmma_tokens.cu``'s
split kernel -- warpgroup MMA with a tile's 64 tokens as M and 16 or 32 heads as N, so 16 heads are not computed as
64 -- with the same plan, partials, combine, contract and checks as the heads-on-M wgmma path (:mod:`.wgmma`). One
consumer warpgroup does the math; two producer warpgroups gather and convert alternate tiles (two tiles of loads in
flight per SM). Validated and timed on the H200 in exploration (``NOTES.md``, generation 6); the dispatcher
(:mod:`.dispatch`, ``"wgmma_tokens"``) chooses it where ``paths.json`` says it is the fastest (``fused_decode_paths``
times it beside the other two paths), and, with no measured table, up to 32 heads.

- :func:`mla_decode_fp8_wgmma_tokens`: the call (checked, or unchecked with a plan: CUDA-graph capturable);
- :func:`plan_mla_decode_wgmma_tokens`: the batch's work list for this kernel (:class:`WgmmaTokensPlan`);
- :func:`heads_per_cta`: the kernel's N for a head count (16 up to 16 heads, else 32);
- :func:`nvcc_compile_check_wgmma_tokens`: ptxas's resource report per instantiation, without a GPU;
- :func:`kernel_shape`: an instantiation's shared memory, tokens a tile and threads, as the library says them;
  :func:`host_shape` (:func:`smem_bytes`, :data:`THREADS`): the same as the host plans for them, without a build
  (the library is checked against it at load).

Built as the heads-on-M path is (nvcc, ``sm_90a``, a shared library cached per source version, ``ctypes``).
``python -m kvwall.kernels.mla_decode.wgmma_tokens --profile-one HEADS TOKENS``: what the profile experiment runs
under Nsight Compute.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from kvwall.kernels._common import Fail, fail, sm_count
from kvwall.kernels.mla_decode.kernel import MLADecodeConfig, MLADecodePlan, launch_combine, plan_mla_decode
from kvwall.kernels.mla_decode.wgmma import (ARCH, CUDA_HEADER, DC, DR, NVCC_FLAGS, NvccReport, Params,
                                             _cache_dir, _checked_inputs, _nvcc, _params, profile_inputs,
                                             profile_main, whole_wave_items)

__all__ = ["mla_decode_fp8_wgmma_tokens", "plan_mla_decode_wgmma_tokens", "WgmmaTokensPlan", "heads_per_cta",
           "load_mla_decode_wgmma_tokens", "nvcc_compile_check_wgmma_tokens", "source_hash", "TOKENS_SOURCE",
           "HEADS_PER_CTA", "BLOCK_N", "THREADS", "CONSUMERS", "PRODUCERS", "SHARED_LIMIT", "smem_bytes", "host_shape",
           "kernel_shape", "TokensNvccReport"]

_fail: Fail = functools.partial(fail, "mla_decode_fp8_wgmma_tokens")

TOKENS_SOURCE = Path(__file__).with_name("mla_decode_wgmma_tokens.cu")
#: The kernel's instantiations: heads per CTA (wgmma's N).
HEADS_PER_CTA = (16, 32)
BLOCK_N = 64
#: Warpgroups per CTA of every instantiation (the source's ``consumers<HN>()`` and ``producers<HN>()``).
CONSUMERS, PRODUCERS = 1, 2
#: Threads per CTA (the source's ``Layout::NT``): 128 per warpgroup.
THREADS = 128 * (CONSUMERS + PRODUCERS)
#: Shared memory an H100 / H200 CTA may opt into (bytes per block).
SHARED_LIMIT = 232_448
#: 64-column chunks of a [rows x 576] float16 block (8 latent + 1 rope), 128 bytes a row (the source's NCHUNK).
_NCHUNK = (DC + DR) // 64


def smem_bytes(hn: int) -> int:
    """Dynamic shared memory per CTA of the instantiation for ``hn`` heads per CTA -- the source's
    ``Layout<HN, CONSUMERS, PRODUCERS>::SMEM``: two converted [64 x 576] float16 tiles, the query block
    [hn x 576] and P^T [hn x 64] per consumer (128-byte swizzled rows of 64 float16), then the floats (per-warp
    maxima and sums, score scales) and a flag."""
    if hn not in HEADS_PER_CTA:
        raise ValueError(f"{TOKENS_SOURCE.name} has no instantiation for {hn} heads per CTA; it has "
                         f"{HEADS_PER_CTA}.")
    tile, qchunk = _NCHUNK * BLOCK_N * 128, hn * 128
    floats = CONSUMERS * 4 * hn + 4 * hn + 2 * hn
    return 2 * tile + _NCHUNK * qchunk + CONSUMERS * qchunk + floats * 4 + 16


def host_shape(hn: int) -> tuple[int, int, int]:
    """(dynamic shared memory bytes, tokens per tile, threads) the host plans the instantiation for ``hn`` heads per
    CTA with: what :func:`kernel_shape` must report for it (checked at load)."""
    return smem_bytes(hn), BLOCK_N, THREADS


def heads_per_cta(heads: int) -> int:
    """The instantiation a call of ``heads`` heads runs: 16 heads per CTA up to 16 heads, else 32."""
    return 16 if heads <= 16 else 32


def source_hash() -> str:
    return hashlib.sha256(TOKENS_SOURCE.read_bytes() + CUDA_HEADER.read_bytes()).hexdigest()[:10]


@dataclass(frozen=True)
class WgmmaTokensPlan(MLADecodePlan):
    """A work list cut for the tokens-on-M kernel (:func:`plan_mla_decode_wgmma_tokens`)."""


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.kvwall_mla_wgmma_tokens_split.restype = ctypes.c_int
    lib.kvwall_mla_wgmma_tokens_split.argtypes = [ctypes.POINTER(Params), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                                  ctypes.c_void_p]
    lib.kvwall_mla_error_string.restype = ctypes.c_char_p
    lib.kvwall_mla_error_string.argtypes = [ctypes.c_int]
    if lib.kvwall_mla_params_size() != ctypes.sizeof(Params):
        raise RuntimeError(f"{TOKENS_SOURCE.name}'s Params is {lib.kvwall_mla_params_size()} bytes, the ctypes "
                           f"mirror {ctypes.sizeof(Params)}: they disagree.")
    for hn in HEADS_PER_CTA:
        smem, block_n, threads = kernel_shape(lib, hn)
        if (smem, block_n, threads) != host_shape(hn) or smem > SHARED_LIMIT:
            raise RuntimeError(f"{TOKENS_SOURCE.name}'s shape for {hn} heads per CTA (shared memory {smem} B, "
                               f"{block_n} tokens a tile, {threads} threads) is not what the host plans for "
                               f"{host_shape(hn)}.")
    return lib


def kernel_shape(lib: ctypes.CDLL, hn: int) -> tuple[int, int, int]:
    """(dynamic shared memory bytes, tokens per tile, threads) of the instantiation for ``hn`` heads per CTA."""
    shape = (ctypes.c_int * 3)()
    if lib.kvwall_mla_wgmma_tokens_shape(hn, *(ctypes.byref(shape, 4 * i) for i in range(3))):
        raise RuntimeError(f"{TOKENS_SOURCE.name} has no instantiation for {hn} heads per CTA.")
    return shape[0], shape[1], shape[2]


@functools.cache
def load_mla_decode_wgmma_tokens() -> ctypes.CDLL:
    """Build (once per source version) and load the kernel."""
    if not torch.cuda.is_available():
        raise RuntimeError("mla_decode_fp8_wgmma_tokens needs an H100 / H200; on this machine use mla_decode_fp8 "
                           "(Triton) or nvcc_compile_check_wgmma_tokens() to compile-check the source.")
    so = _cache_dir() / f"kvwall_mla_wgmma_tokens_{source_hash()}.so"
    if not so.exists():
        tmp = so.with_suffix(f".{os.getpid()}.tmp")
        proc = subprocess.run([_nvcc(), *NVCC_FLAGS, f"-gencode=arch=compute_90a,code={ARCH}", "-shared",
                               "-Xcompiler", "-fPIC", str(TOKENS_SOURCE), "-o", str(tmp)],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc failed to build {TOKENS_SOURCE.name}:\n{proc.stdout}{proc.stderr}")
        os.replace(tmp, so)
    return _bind(ctypes.CDLL(str(so)))


def plan_mla_decode_wgmma_tokens(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None = None, *, heads: int,
                                 page_size: int = 1, device: torch.device | None = None, programs: int | None = None,
                                 waves: int = 1, min_chunk: int | None = None) -> WgmmaTokensPlan:
    """The batch's work list for 64-token tiles and :func:`heads_per_cta` heads per CTA, one CTA per SM. Default:
    items sized to fill whole waves (:func:`kvwall.kernels.mla_decode.wgmma.whole_wave_items`); ``programs``: aim
    at that many CTAs at once instead, times ``waves``."""
    device = torch.device(device) if device is not None else kv_indptr.device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    hn = heads_per_cta(heads)
    head_blocks = -(-heads // hn)
    if programs is None:
        if device.type != "cuda" or min_chunk is not None:
            programs = sm_count(device) if device.type == "cuda" else 1
        else:  # whole waves of one CTA per SM, at the lengths the step has now
            ptr = kv_indptr.tolist()
            paged = page_size != 1 and kv_len is not None
            lengths = kv_len.tolist() if paged else [b - a for a, b in zip(ptr, ptr[1:])]
            programs, waves = head_blocks * whole_wave_items(lengths, head_blocks, sm_count(device) * max(1, waves)), 1
    cfg = MLADecodeConfig(block_h=hn, block_n=BLOCK_N, num_warps=8, num_stages=2)
    plan = plan_mla_decode(kv_indptr, kv_len, heads=heads, kv_lora_rank=DC, page_size=page_size, device=device,
                           config=cfg, programs=programs * max(1, waves), min_chunk=min_chunk)
    return WgmmaTokensPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)})


def mla_decode_fp8_wgmma_tokens(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                                kpe_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                                sm_scale: float, *, ckv_scale: float | torch.Tensor = 1.0,
                                kpe_scale: float | torch.Tensor = 1.0, out: torch.Tensor | None = None,
                                return_lse: bool = False, kv_len: torch.Tensor | None = None,
                                check_range: bool = True, plan: MLADecodePlan | None = None):
    """:func:`kvwall.kernels.mla_decode_fp8`'s contract on the tokens-on-M kernel and the Triton combine (H100 / H200
    only; latent width 512, rope width 64, 16-byte aligned cache rows). A checked call plans for itself; an
    unchecked one (``check_range=False``, CUDA-graph capture) needs ``plan`` from
    :func:`plan_mla_decode_wgmma_tokens`."""
    try:  # the heads-on-M path's checks, every one before any launch, reported under this call's name
        inputs = _checked_inputs(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out,
                                 check_range, kv_len, ckv_scale, kpe_scale)
    except (ValueError, TypeError) as exc:
        theirs = "mla_decode_fp8_wgmma: "
        if not str(exc).startswith(theirs):
            raise
        raise type(exc)(f"mla_decode_fp8_wgmma_tokens: {str(exc)[len(theirs):]}") from None
    batch, heads, dc = q_nope.shape
    device = q_nope.device
    if plan is None:
        if not check_range:
            _fail(ValueError, "an unchecked call (check_range=False) of the tokens-on-M wgmma path needs plan= from "
                  "plan_mla_decode_wgmma_tokens (made once per step, outside CUDA-graph capture).")
        plan = plan_mla_decode_wgmma_tokens(kv_indptr, kv_len, heads=heads, page_size=inputs.page_size,
                                            device=device)
    if not isinstance(plan, WgmmaTokensPlan):
        _fail(TypeError, f"plan must come from plan_mla_decode_wgmma_tokens, got {type(plan).__name__}.")
    want = (batch, heads, dc, inputs.page_size, device)
    have = (plan.batch, plan.heads, plan.kv_lora_rank, plan.page_size, plan.device)
    if have != want:
        _fail(ValueError, f"the plan was made for (batch, heads, kv_lora_rank, page_size, device) = {have}; this "
              f"call has {want}.")
    lib = load_mla_decode_wgmma_tokens()
    num_indices = kv_indices.numel()  # with none, a one-entry tensor stands for the (never executed) index loads
    indices = kv_indices if num_indices else torch.zeros(1, dtype=torch.int32, device=device)
    out = out if out is not None else torch.empty(batch, heads, dc, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=device) if return_lse else None
    params = _params(inputs, plan, q_nope, q_pe, kv_indptr, indices, num_indices, kv_len, sm_scale, out, lse)
    hn = plan.config.block_h
    code = lib.kvwall_mla_wgmma_tokens_split(ctypes.byref(params), hn, -(-heads // hn), plan.items,
                                             torch.cuda.current_stream(device).cuda_stream)
    if code != 0:
        raise RuntimeError(f"mla_decode_fp8_wgmma_tokens: launch failed: "
                           f"{lib.kvwall_mla_error_string(code).decode()} (code {code}).")
    launch_combine(plan, out, lse)
    return (out, lse) if return_lse else out


@dataclass(frozen=True)
class TokensNvccReport(NvccReport):
    """ptxas's report for one instantiation of ``mla_decode_wgmma_tokens.cu`` (``heads_per_cta`` heads a CTA);
    ``registers`` is the launch's count (setmaxnreg then moves registers between the warpgroups)."""

    heads_per_cta: int = 16

    def summary(self) -> str:
        return (f"nvcc {'compiled' if self.ok else 'FAILED on'} {TOKENS_SOURCE.name} ({self.heads_per_cta} heads a "
                f"CTA) for {self.arch} in {self.seconds:.1f} s ({self.nvcc}); {self.registers} registers at launch, "
                f"{self.stack_bytes} B stack, {self.spill_bytes} B spilled.")


_ENTRY = re.compile(r"Compiling entry function '(_ZN10kvwall_mla2wt23mla_wgmma_tokens_kernelILi(\d+)E\w*)'")


def nvcc_compile_check_wgmma_tokens(nvcc: str | None = None) -> dict[int, TokensNvccReport]:
    """Compile the source for sm_90a (no GPU needed) and read ptxas's report of each instantiation (heads per CTA
    -> :class:`TokensNvccReport`)."""
    nvcc = nvcc or _nvcc()
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([nvcc, *NVCC_FLAGS, f"-gencode=arch=compute_90a,code={ARCH}", "-Xptxas", "-v", "-c",
                               str(TOKENS_SOURCE), "-o", str(Path(tmp) / "wt.o")],
                              capture_output=True, text=True, timeout=600)
        seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    found: dict[int, dict] = {}
    current = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = int(m.group(2))
            found[current] = {"registers": None, "spill_bytes": None, "stack_bytes": None}
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            found[current].update(stack_bytes=int(m.group(1)), spill_bytes=int(m.group(2)) + int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            found[current]["registers"] = int(m.group(1))
    none = {"registers": None, "spill_bytes": None, "stack_bytes": None}
    return {hn: TokensNvccReport(proc.returncode == 0 and hn in found, ARCH, seconds, version, log=log,
                                 heads_per_cta=hn, **found.get(hn, none)) for hn in HEADS_PER_CTA}


def _profile_one(heads: int, tokens: int, page_size: int = 64, seed: int = 0) -> None:
    """What the profile experiment runs under ncu: the wgmma path's inputs
    (:func:`kvwall.kernels.mla_decode.wgmma.profile_inputs`), this kernel called four times (ncu skips three)."""
    args, at = profile_inputs(heads, tokens, page_size, seed)
    plan = plan_mla_decode_wgmma_tokens(args[4], at["kv_len"], heads=heads, page_size=at["page_size"])
    for _ in range(4):
        mla_decode_fp8_wgmma_tokens(*args, kv_len=at["kv_len"], check_range=False, plan=plan)
    torch.cuda.synchronize()


if __name__ == "__main__":
    import sys

    sys.exit(profile_main("kvwall.kernels.mla_decode.wgmma_tokens", _profile_one, sys.argv[1:]))

"""The tokens-on-M wgmma path of the fused FP8 MLA decode (Hopper, few heads per GPU): ``mla_decode_wgmma_tokens.cu``'s
split kernel -- warpgroup MMA with a tile's 64 tokens as M and 16 or 32 heads as N, so 16 heads are not computed as
64 -- with the same plan, partials, combine, contract and checks as the heads-on-M wgmma path (:mod:`.wgmma`). One
consumer warpgroup does the math; two producer warpgroups gather and convert alternate tiles (two tiles of loads in
flight per SM). Validated and timed on the H200 in exploration (``NOTES.md``, generation 6); the dispatcher
(:mod:`.dispatch`, ``"wgmma_tokens"``) chooses it where ``kernel_paths.json`` says it is the fastest
(``fused_decode_paths`` times it beside the other two paths), and, with no measured table, up to 32 heads.

- :func:`mla_decode_fp8_wgmma_tokens`: the call (checked, or unchecked with a plan: CUDA-graph capturable);
- :func:`plan_mla_decode_wgmma_tokens`: the batch's work list for this kernel (:class:`WgmmaTokensPlan`);
- :func:`heads_per_cta`: the kernel's N for a head count (16 up to 16 heads, else 32);
- :func:`nvcc_compile_check_wgmma_tokens`: ptxas's resource report per instantiation, without a GPU;
- :func:`kernel_shape`: an instantiation's shared memory, tokens a tile and threads, as the library says them;
  :func:`host_shape` (:func:`smem_bytes`, :data:`THREADS`): the same as the host plans for them, without a build
  (the library is checked against it at load).

Built, bound and launched as the heads-on-M path is, by :mod:`.hopper` (nvcc, ``sm_90a``, a shared library cached
per build key, ``ctypes``). Multi-token queries: the call takes the folded ``[batch, q_len * heads, D]`` tensors and
``q_len``; the plan is made with ``q_len=`` for ``q_len * heads`` head columns (masked per column at its token's
causal limit).
``python -m kvwall.kernels.mla_decode.wgmma_tokens --profile-one HEADS TOKENS``: what the profile experiment runs
under Nsight Compute.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvwall.kernels.mla_decode import hopper
from kvwall.kernels.mla_decode.hopper import ARCH, DC, DR, HopperPlan, Params
from kvwall.kernels.mla_decode.plan import MLADecodePlan
from kvwall.kernels.mla_decode.wgmma import NvccReport, profile_main

__all__ = [
    "mla_decode_fp8_wgmma_tokens",
    "plan_mla_decode_wgmma_tokens",
    "WgmmaTokensPlan",
    "heads_per_cta",
    "load_mla_decode_wgmma_tokens",
    "nvcc_compile_check_wgmma_tokens",
    "source_hash",
    "TOKENS_SOURCE",
    "HEADS_PER_CTA",
    "BLOCK_N",
    "THREADS",
    "CONSUMERS",
    "PRODUCERS",
    "SHARED_LIMIT",
    "smem_bytes",
    "host_shape",
    "kernel_shape",
    "TokensNvccReport",
    "check_library",
]

TOKENS_SOURCE = hopper.SOURCES["wgmma_tokens"]
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
        raise ValueError(f"{TOKENS_SOURCE.name} has no instantiation for {hn} heads per CTA; it has {HEADS_PER_CTA}.")
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
    """The build's cache key (:func:`~kvwall.kernels.mla_decode.hopper.build_key`)."""
    return hopper.build_key("wgmma_tokens", hopper._nvcc(), hopper._flags(False))  # pylint: disable=protected-access


@dataclass(frozen=True)
class WgmmaTokensPlan(HopperPlan):
    """A work list cut for the tokens-on-M kernel (:func:`plan_mla_decode_wgmma_tokens`)."""


def check_library(lib: ctypes.CDLL) -> None:
    """Declare the split entry point and check each instantiation's shape against the host's (at load)."""
    lib.kvwall_mla_wgmma_tokens_split.restype = ctypes.c_int
    lib.kvwall_mla_wgmma_tokens_split.argtypes = [
        ctypes.POINTER(Params),
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    for hn in HEADS_PER_CTA:
        smem, block_n, threads = kernel_shape(lib, hn)
        if (smem, block_n, threads) != host_shape(hn) or smem > SHARED_LIMIT:
            raise RuntimeError(
                f"{TOKENS_SOURCE.name}'s shape for {hn} heads per CTA (shared memory {smem} B, "
                f"{block_n} tokens a tile, {threads} threads) is not what the host plans for "
                f"{host_shape(hn)}."
            )


def kernel_shape(lib: ctypes.CDLL, hn: int) -> tuple[int, int, int]:
    """(dynamic shared memory bytes, tokens per tile, threads) of the instantiation for ``hn`` heads per CTA."""
    shape = (ctypes.c_int * 3)()
    if lib.kvwall_mla_wgmma_tokens_shape(hn, *(ctypes.byref(shape, 4 * i) for i in range(3))):
        raise RuntimeError(f"{TOKENS_SOURCE.name} has no instantiation for {hn} heads per CTA.")
    return shape[0], shape[1], shape[2]


def load_mla_decode_wgmma_tokens() -> ctypes.CDLL:
    """Build (once per build key) and load the kernel."""
    return hopper.load_library("wgmma_tokens")


def plan_mla_decode_wgmma_tokens(
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
) -> WgmmaTokensPlan:
    """The batch's work list for 64-token tiles and :func:`heads_per_cta` head columns per CTA (of ``q_len`` x
    ``heads``: ``q_len`` query tokens of ``heads`` heads), one CTA per SM. Default: items sized to fill whole waves
    (:func:`kvwall.kernels.mla_decode.hopper.whole_wave_items`); ``programs``: aim at that many CTAs at once
    instead, times ``waves``."""
    return hopper.plan_hopper(
        WgmmaTokensPlan,
        "plan_mla_decode_wgmma_tokens",
        kv_indptr,
        kv_len,
        heads=heads,
        heads_per_cta=heads_per_cta,
        warps=8,
        page_size=page_size,
        device=device,
        programs=programs,
        waves=waves,
        min_chunk=min_chunk,
        q_len=q_len,
    )


def mla_decode_fp8_wgmma_tokens(
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
    """:func:`kvwall.kernels.mla_decode_fp8`'s contract on the tokens-on-M kernel and the Triton combine (H100 / H200
    only; latent width 512, rope width 64, 16-byte aligned cache rows). A checked call plans for itself; an
    unchecked one (``check_range=False``, CUDA-graph capture) needs ``plan`` from
    :func:`plan_mla_decode_wgmma_tokens`. ``q_len`` > 1: ``q_nope`` / ``q_pe`` (and ``out``) are folded, ``[batch,
    q_len * heads, D]``."""
    return hopper.run_checked(
        "wgmma_tokens",
        WgmmaTokensPlan,
        plan_mla_decode_wgmma_tokens,
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
class TokensNvccReport(NvccReport):
    """ptxas's report for one instantiation of ``mla_decode_wgmma_tokens.cu`` (``heads_per_cta`` heads a CTA);
    ``registers`` is the launch's count (setmaxnreg then moves registers between the warpgroups)."""

    heads_per_cta: int = 16

    def summary(self) -> str:
        return (
            f"nvcc {'compiled' if self.ok else 'FAILED on'} {TOKENS_SOURCE.name} ({self.heads_per_cta} heads a "
            f"CTA) for {self.arch} in {self.seconds:.1f} s ({self.nvcc}); {self.registers} registers at launch, "
            f"{self.stack_bytes} B stack, {self.spill_bytes} B spilled."
        )


def nvcc_compile_check_wgmma_tokens(nvcc: str | None = None, *, multi: bool = False) -> dict[int, TokensNvccReport]:
    """Compile the source for sm_90a (no GPU needed) and read ptxas's report of each instantiation (heads per CTA
    -> :class:`TokensNvccReport`): the decode ones (q_len 1), or with ``multi`` the multi-token ones."""
    ok, seconds, version, log, entries = hopper.ptxas_check("wgmma_tokens", nvcc)
    none = {"registers": None, "spill_bytes": None, "stack_bytes": None}
    reports = {}
    for hn in HEADS_PER_CTA:
        entry = (
            f"_ZN10kvwall_mla2wt23mla_wgmma_tokens_kernelILi{hn}ELi{CONSUMERS}ELi{PRODUCERS}ELb{int(multi)}"
            "EEEvNS_6ParamsE"
        )
        reports[hn] = TokensNvccReport(
            ok and entry in entries, ARCH, seconds, version, log=log, heads_per_cta=hn, **entries.get(entry, none)
        )
    return reports


if __name__ == "__main__":
    import sys

    sys.exit(
        profile_main(
            "kvwall.kernels.mla_decode.wgmma_tokens",
            mla_decode_fp8_wgmma_tokens,
            plan_mla_decode_wgmma_tokens,
            sys.argv[1:],
        )
    )

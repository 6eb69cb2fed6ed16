"""The fused kernel's two wgmma paths in the offline architecture check (:mod:`kvwall.tuning.arch_check`): nvcc
compiles each for its only target, sm_90a (H100 / H200; no GPU needed), ptxas reports each split kernel's
registers, stack frame and spills, and its shared memory is held against the architecture's per-block limit. Other
architectures run the Triton path (the dispatcher never picks a wgmma path there), so they have no wgmma row.

- the wgmma path (heads on M, ``mla_decode_wgmma.cu``, :mod:`kvwall.kernels.mla_decode.wgmma`): one row, its
  shared memory :data:`~kvwall.kernels.mla_decode.wgmma.SMEM_BYTES`;
- the tokens-on-M wgmma path (``mla_decode_wgmma_tokens.cu``, :mod:`kvwall.kernels.mla_decode.wgmma_tokens`): one
  row per shipped instantiation (16 and 32 heads per CTA), from one compile
  (:func:`~kvwall.kernels.mla_decode.wgmma_tokens.nvcc_compile_check_wgmma_tokens`), the shared memory of each
  (:func:`~kvwall.kernels.mla_decode.wgmma_tokens.smem_bytes`); ``registers`` is the launch's count.

Rows in :mod:`~kvwall.tuning.arch_check`'s row format (``format_rows`` prints them), plus ``stack_bytes`` and
``heads_per_cta``; ``heads`` 0 (each serves every head count the dispatcher gives it); ``role`` the dispatcher's
name of the path (``"wgmma"``, ``"wgmma_tokens"``: :data:`WGMMA_ROLES`); ``shipped``. Each compile runs once per
process.
"""

from __future__ import annotations

import functools
import subprocess
from typing import Any

from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path

__all__ = [
    "WGMMA_KERNEL",
    "TOKENS_KERNEL",
    "WGMMA_ROLES",
    "WGMMA_ARCH_NAME",
    "WGMMA_SHARED_LIMIT",
    "wgmma_report",
    "tokens_reports",
    "wgmma_rows",
    "tokens_rows",
]

#: The ``kernel`` of the wgmma path's row.
WGMMA_KERNEL = "fused split (wgmma, CUDA C++)"
#: The ``kernel`` of the tokens-on-M wgmma path's rows (one per instantiation: ``heads_per_cta``).
TOKENS_KERNEL = "fused split (tokens-on-M wgmma, CUDA C++)"
#: ``role`` -> ``kernel`` of the rows of each wgmma path (the role is the dispatcher's name of the path).
WGMMA_ROLES = {"wgmma": WGMMA_KERNEL, "wgmma_tokens": TOKENS_KERNEL}
#: Their only architecture, as the rows name architectures.
WGMMA_ARCH_NAME = "sm_90a: H100, H200"
#: Shared memory an H100 / H200 CTA may opt into (bytes per block): the limit the tokens-on-M host checks its
#: builds against.
WGMMA_SHARED_LIMIT = tokens_path.SHARED_LIMIT


@functools.cache
def wgmma_report() -> wgmma_path.NvccReport | str:
    """``mla_decode_wgmma.cu`` compiled by nvcc for sm_90a (once per process), or why it could not be (no nvcc, a
    compile past its time limit)."""
    try:
        return wgmma_path.nvcc_compile_check_wgmma()
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return str(exc)


@functools.cache
def tokens_reports() -> dict[int, tokens_path.TokensNvccReport] | str:
    """``mla_decode_wgmma_tokens.cu`` compiled by nvcc for sm_90a (once per process): ptxas's report per
    instantiation (heads per CTA), or why it could not be compiled."""
    try:
        return tokens_path.nvcc_compile_check_wgmma_tokens()
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def _error(rep: wgmma_path.NvccReport | str, kernel: str) -> str | None:
    if isinstance(rep, str):
        return rep
    if not rep.ok:
        return f"nvcc failed for {rep.arch}: {rep.log[-300:]}"
    if rep.registers is None or rep.stack_bytes is None:
        return f"ptxas reported no resources for {kernel} on {rep.arch} (its name not parsed?)"
    return None


def _row(
    kernel: str,
    role: str,
    rep: wgmma_path.NvccReport | str,
    what: str,
    *,
    heads_per_cta: int,
    shared: int,
    threads: int,
    shape: str,
    regs_per_sm: int,
) -> dict[str, Any]:
    """One wgmma row: ``rep`` (ptxas's report, or why there is none) held against an H100 / H200 block."""
    error = _error(rep, what)
    regs = None if error else rep.registers
    return dict(
        kernel=kernel,
        heads=0,
        shape=shape,
        arch=WGMMA_ARCH_NAME,
        cap=90,
        shared_bytes=shared,
        shared_limit=WGMMA_SHARED_LIMIT,
        regs=regs,
        spills=None if error else rep.spill_bytes,
        stack_bytes=None if error else rep.stack_bytes,
        threads=threads,
        blocks_per_sm_by_regs=regs_per_sm // (regs * threads) if regs else None,
        fits=error is None and shared <= WGMMA_SHARED_LIMIT,
        trap_only=False,
        error=error,
        role=role,
        shipped=True,
        tmem_columns=0,
        tmem_limit=0,
        config=None,
        triton=None,
        heads_per_cta=heads_per_cta,
    )


def wgmma_rows(regs_per_sm: int = 65_536) -> list[dict[str, Any]]:
    """The wgmma split kernel's row on sm_90a. ``spills``: spill stores + loads (bytes); ``fits``: compiled, and
    its shared memory within an H100 / H200 block's."""
    threads = wgmma_path.THREADS
    shape = (
        f"{wgmma_path.HEADS_PER_CTA} heads × {wgmma_path.BLOCK_N} tokens, {threads // 32} warps (two "
        "warpgroups), one CTA per SM"
    )
    return [
        _row(
            WGMMA_KERNEL,
            "wgmma",
            wgmma_report(),
            "the wgmma split kernel",
            heads_per_cta=wgmma_path.HEADS_PER_CTA,
            shared=wgmma_path.SMEM_BYTES,
            threads=threads,
            shape=shape,
            regs_per_sm=regs_per_sm,
        )
    ]


def tokens_rows(regs_per_sm: int = 65_536) -> list[dict[str, Any]]:
    """The tokens-on-M split kernel's rows on sm_90a, one per shipped instantiation (16 and 32 heads per CTA), from
    one compile; ``regs``: the launch's count (setmaxnreg then moves registers between the warpgroups)."""
    reports = tokens_reports()
    rows = []
    for hn in tokens_path.HEADS_PER_CTA:
        smem, block_n, threads = tokens_path.host_shape(hn)
        shape = f"{block_n} tokens × {hn} heads, {threads // 32} warps ({threads // 128} warpgroups), one CTA per SM"
        rep = reports if isinstance(reports, str) else reports[hn]
        rows.append(
            _row(
                TOKENS_KERNEL,
                "wgmma_tokens",
                rep,
                f"the tokens-on-M split kernel ({hn} heads per CTA)",
                heads_per_cta=hn,
                shared=smem,
                threads=threads,
                shape=shape,
                regs_per_sm=regs_per_sm,
            )
        )
    return rows

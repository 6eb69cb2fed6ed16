"""The fused kernel's wgmma path (``mla_decode_wgmma.cu``, :mod:`kvwall.kernels.mla_decode.wgmma`) in the offline
architecture check (:mod:`kvwall.tuning.arch_check`): nvcc compiles it for its only target, sm_90a (H100 / H200; no
GPU needed), and ptxas reports the split kernel's registers, stack frame and spills; its shared memory
(:data:`~kvwall.kernels.mla_decode.wgmma.SMEM_BYTES`) is held against the architecture's per-block limit. Other
architectures run the Triton path (the dispatcher never picks wgmma there), so they have no wgmma row.

One row, in :mod:`~kvwall.tuning.arch_check`'s row format (``format_rows`` prints it), plus ``stack_bytes``;
``role`` ``"wgmma"``, ``shipped``.
"""

from __future__ import annotations

import functools
import subprocess
from typing import Any

from kvwall.kernels.mla_decode import wgmma as wgmma_path

__all__ = ["WGMMA_KERNEL", "WGMMA_ARCH_NAME", "WGMMA_SHARED_LIMIT", "wgmma_report", "wgmma_rows"]

#: The ``kernel`` of the wgmma path's row.
WGMMA_KERNEL = "fused split (wgmma, CUDA C++)"
#: Its only architecture, as the rows name architectures.
WGMMA_ARCH_NAME = "sm_90a: H100, H200"
#: Shared memory an H100 / H200 CTA may opt into (bytes per block).
WGMMA_SHARED_LIMIT = 232_448


@functools.cache
def wgmma_report() -> wgmma_path.NvccReport | str:
    """``mla_decode_wgmma.cu`` compiled by nvcc for sm_90a (once per process), or why it could not be (no nvcc, a
    compile past its time limit)."""
    try:
        return wgmma_path.nvcc_compile_check_wgmma()
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def _error(rep: wgmma_path.NvccReport | str) -> str | None:
    if isinstance(rep, str):
        return rep
    if not rep.ok:
        return f"nvcc failed for {rep.arch}: {rep.log[-300:]}"
    if rep.registers is None or rep.stack_bytes is None:
        return f"ptxas reported no resources for the wgmma split kernel on {rep.arch} (its name not parsed?)"
    return None


def wgmma_rows(regs_per_sm: int = 65_536) -> list[dict[str, Any]]:
    """The wgmma split kernel's row on sm_90a. ``spills``: spill stores + loads (bytes); ``fits``: compiled, and
    its shared memory within an H100 / H200 block's."""
    rep = wgmma_report()
    error = _error(rep)
    regs = None if error else rep.registers
    threads = wgmma_path.THREADS
    return [dict(
        kernel=WGMMA_KERNEL, heads=0,
        shape=(f"{wgmma_path.HEADS_PER_CTA} heads × {wgmma_path.BLOCK_N} tokens, {threads // 32} warps (two "
               "warpgroups), one CTA per SM"),
        arch=WGMMA_ARCH_NAME, cap=90, shared_bytes=wgmma_path.SMEM_BYTES, shared_limit=WGMMA_SHARED_LIMIT, regs=regs,
        spills=None if error else rep.spill_bytes, stack_bytes=None if error else rep.stack_bytes, threads=threads,
        blocks_per_sm_by_regs=regs_per_sm // (regs * threads) if regs else None,
        fits=error is None and wgmma_path.SMEM_BYTES <= WGMMA_SHARED_LIMIT, trap_only=False, error=error,
        role="wgmma", shipped=True, tmem_columns=0, tmem_limit=0, config=None, triton=None)]

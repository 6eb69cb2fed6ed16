"""The fused kernel's CUDA C++ path (``mla_decode_mma.cu``, :mod:`kvwall.kernels.mla_decode.cuda`) in the offline
architecture check (:mod:`kvwall.tuning.arch_check`): nvcc compiles the source once per architecture (no GPU
needed) and ptxas reports each variant's registers, stack frame and spills; each variant's shared memory (its shape's
``Shape<>::SMEM``, :attr:`~kvwall.kernels.mla_decode.cuda.Variant.smem`) is held against the architecture's
per-block limit.

A row per (variant, architecture), in :mod:`~kvwall.tuning.arch_check`'s row format (``format_rows`` prints it),
plus ``variant`` and ``stack_bytes``. ``role``: ``"default"`` for the default variant (``shipped``: what a call
without a variant runs, :data:`~kvwall.kernels.mla_decode.cuda.DEFAULT_VARIANT`), ``"variant"`` for the others
(picked by name; one that does not fit a GPU is refused at the call, so here it is a finding, not a failure).
"""

from __future__ import annotations

import dataclasses
import functools
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from kvwall.kernels.mla_decode import cuda as mla_cuda

__all__ = ["CUDA_FUSED", "cuda_mla_report", "cuda_mla_rows"]

#: The ``kernel`` of the CUDA path's rows.
CUDA_FUSED = "fused split (CUDA C++)"


@functools.cache
def cuda_mla_report(cap: int) -> mla_cuda.NvccReport | str:
    """``mla_decode_mma.cu`` compiled by nvcc for ``sm_<cap>`` (once per architecture and process), or why it could
    not be (no nvcc, a compile past its time limit)."""
    try:
        return mla_cuda.nvcc_compile_check(f"sm_{cap}")
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return str(exc)


def _error(rep: mla_cuda.NvccReport | str, variant: int) -> str | None:
    if isinstance(rep, str):
        return rep
    if not rep.ok:
        return f"nvcc failed for {rep.arch}: {rep.log[-300:]}"
    if variant not in rep.registers or variant not in rep.stack_bytes:
        return f"ptxas reported no resources for variant {variant} on {rep.arch} (its kernel name not parsed?)"
    return None


def cuda_mla_rows(archs: Sequence[Any]) -> list[dict[str, Any]]:
    """A row per (variant, architecture) for each of ``archs`` (:class:`~kvwall.tuning.arch_check.ArchLimits`), the
    architectures compiled at once. ``spills``: spill stores + loads (bytes); ``fits``: compiled, and the variant's
    shared memory within the per-block limit."""
    with ThreadPoolExecutor(max_workers=max(1, len(archs))) as pool:
        reports = list(pool.map(cuda_mla_report, [a.cap for a in archs]))
    rows = []
    for limits, rep in zip(archs, reports):
        for i, v in mla_cuda.VARIANTS.items():
            error = _error(rep, i)
            regs = None if error else rep.registers[i]
            threads = 32 * v.warps
            rows.append(dict(
                kernel=CUDA_FUSED, heads=0, shape=str(v), arch=limits.name, cap=limits.cap, shared_bytes=v.smem,
                shared_limit=limits.shared_per_block, regs=regs, spills=None if error else rep.spill_bytes.get(i, 0),
                stack_bytes=None if error else rep.stack_bytes[i], threads=threads,
                blocks_per_sm_by_regs=limits.regs_per_sm // (regs * threads) if regs else None,
                fits=error is None and v.smem <= limits.shared_per_block, trap_only=False, error=error,
                role="default" if i == mla_cuda.DEFAULT_VARIANT else "variant",
                shipped=i == mla_cuda.DEFAULT_VARIANT, tmem_columns=0, tmem_limit=limits.tmem_columns,
                config=dataclasses.asdict(v), triton=None, variant=i))
    return rows

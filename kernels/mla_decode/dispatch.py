"""Which implementation runs a fused FP8 MLA decode call: the Triton kernel (:mod:`.kernel`, the portable path:
every GPU Triton supports, and the CPU interpreter), the CUDA C++ mma.sync path (:mod:`.cuda`, compute capability
8.9+) or the warpgroup-MMA path (:mod:`.wgmma`, H100 / H200 only).

:func:`choose_path` decides by architecture and shape: a CUDA C++ path only where it can run (the right GPU,
latent 512 and rope 64, 16-byte aligned cache rows, shared memory that fits) *and* where it was measured fastest
on this GPU model -- the nearest point (heads, batch, tokens per request, in log scale) of ``paths.json``, which
``python -m kvwall.experiments.fused_decode.paths --write`` derives from the recorded ``fused_decode_cuda`` result;
where the measured winner cannot run, the faster of the others at that point. A GPU model with no entry runs the
Triton path. :func:`plan_mla_decode_auto` makes
the plan of the chosen path; :func:`mla_decode` runs a call on the path of its plan (or chooses one), with either
path's contract.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Literal

import torch

from kvwall.kernels._common import check_batch_shapes, fail, gpu_name, read_tuned_table, require_tensors
from kvwall.kernels.mla_decode import cuda as cuda_path
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode.kernel import MLADecodePlan, mla_decode_fp8, plan_mla_decode

__all__ = ["PATHS_FILE", "KernelPath", "choose_path", "plan_mla_decode_auto", "mla_decode", "measured_choice"]

_fail = functools.partial(fail, "mla_decode")
#: Measured path per GPU model and point (written by ``python -m kvwall.experiments.fused_decode.paths --write``).
PATHS_FILE = Path(__file__).with_name("paths.json")
KernelPath = Literal["triton", "cuda", "wgmma"]
#: Where each path's time sits in a ``paths.json`` point ``[heads, context, batch, path, cuda_us, triton_us,
#: wgmma_us]`` (tables written before the wgmma path have six entries).
_US_AT = {"cuda": 4, "triton": 5, "wgmma": 6}


def measured_choice(table: dict, heads: int, batch: int, max_len: int,
                    runnable: tuple[str, ...] = ("triton", "cuda", "wgmma")) -> tuple[KernelPath, list] | None:
    """The fastest of the ``runnable`` paths at the measured point nearest to (heads, batch, max_len) in log scale,
    and that point's row; None for an empty table."""
    points = table.get("points") or []
    if not points:
        return None

    def distance(p: list) -> float:
        return (abs(math.log2(p[0] / max(heads, 1))) + abs(math.log2(p[2] / max(batch, 1)))
                + abs(math.log2(p[1] / max(max_len, 1))))

    best = min(points, key=distance)
    timed = {p: best[i] for p, i in _US_AT.items() if p in runnable and i < len(best) and best[i]}
    return min(timed, key=lambda p: timed[p]), best


@functools.cache
def _table(gpu: str, path: Path) -> dict:
    return read_tuned_table(path, gpu)


def _cuda_can_run(device: torch.device, ckv_rows: torch.Tensor | None, kpe_rows: torch.Tensor | None,
                  dims: tuple[int, int]) -> str | None:
    why = cuda_path.cuda_refusal(device)
    if why:
        return why
    if dims != (cuda_path.DC, cuda_path.DR):
        return f"latent/rope widths {dims}: the CUDA path is built for {(cuda_path.DC, cuda_path.DR)}"
    for name, rows in (("ckv_cache", ckv_rows), ("kpe_cache", kpe_rows)):
        if rows is not None and (rows.data_ptr() % 16 or (rows.stride(-2) * rows.element_size()) % 16):
            return f"{name} rows are not 16-byte aligned"
    if cuda_path.VARIANTS[cuda_path.DEFAULT_VARIANT].smem > cuda_path.shared_limit(device):
        return "its default variant does not fit this GPU's shared memory"
    return None


def choose_path(heads: int, batch: int, max_len: int, device: torch.device, *, ckv_cache: torch.Tensor | None = None,
                kpe_cache: torch.Tensor | None = None, dims: tuple[int, int] = (512, 64),
                table_file: Path | None = None) -> tuple[KernelPath, str]:
    """``(path, why)`` for a call of ``heads`` heads, ``batch`` requests of at most ``max_len`` tokens on
    ``device`` (caches given: their row alignment is checked too)."""
    why = _cuda_can_run(device, ckv_cache, kpe_cache, dims)
    if why:
        return "triton", f"Triton: the CUDA path cannot run ({why})"
    runnable = ("triton", "cuda") + (("wgmma",) if wgmma_path.wgmma_refusal(device) is None else ())
    gpu = gpu_name(device)
    found = measured_choice(_table(gpu, table_file or PATHS_FILE), heads, batch, max_len, runnable)
    if found is None:
        return "triton", (f"Triton: no measured table for {gpu} "
                          "(python -m kvwall.experiments.fused_decode.paths --write)")
    choice, point = found
    times = ", ".join(f"{p} {point[i]:.1f} µs" for p, i in _US_AT.items() if i < len(point) and point[i])
    return choice, (f"{choice}: measured {times} at the nearest point ({point[0]} heads, {point[1]} tokens, batch "
                    f"{point[2]}) on {gpu}")


def _lengths(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None, page_size: int) -> tuple[int, int]:
    ptr = kv_indptr.tolist()
    lens = kv_len.tolist() if kv_len is not None else [b - a for a, b in zip(ptr, ptr[1:])]
    return len(ptr) - 1, max(lens or [0]) * (1 if kv_len is not None else page_size)


def plan_mla_decode_auto(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None = None, *, heads: int,
                         page_size: int = 1, device: torch.device | None = None, path: str = "auto",
                         ckv_cache: torch.Tensor | None = None,
                         kpe_cache: torch.Tensor | None = None) -> MLADecodePlan:
    """The plan (once per decode step) of the path :func:`choose_path` picks (``path="auto"``) or of ``path``:
    a :class:`~kvwall.kernels.mla_decode.cuda.CudaPlan` for the CUDA path, a
    :class:`~kvwall.kernels.mla_decode.wgmma.WgmmaPlan` for the wgmma path, else an
    :class:`~kvwall.kernels.mla_decode.kernel.MLADecodePlan`."""
    if path not in ("auto", "triton", "cuda", "wgmma"):
        raise ValueError(f"plan_mla_decode_auto: path must be 'auto', 'triton', 'cuda' or 'wgmma', got {path!r}.")
    device = torch.device(device) if device is not None else kv_indptr.device
    if path == "auto":
        batch, max_len = _lengths(kv_indptr, kv_len, page_size)
        path = choose_path(heads, batch, max_len, device, ckv_cache=ckv_cache, kpe_cache=kpe_cache)[0]
    if path == "cuda":
        return cuda_path.plan_mla_decode_cuda(kv_indptr, kv_len, heads=heads, page_size=page_size, device=device)
    if path == "wgmma":
        return wgmma_path.plan_mla_decode_wgmma(kv_indptr, kv_len, heads=heads, page_size=page_size, device=device)
    return plan_mla_decode(kv_indptr, kv_len, heads=heads, page_size=page_size, device=device)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *, path: str = "auto",
               plan: MLADecodePlan | None = None, **kwargs):
    """:func:`~kvwall.kernels.mla_decode_fp8`'s contract on the path of ``plan`` (a CUDA plan runs the CUDA path, a
    wgmma plan the wgmma path), else on ``path`` (``"auto"``: :func:`choose_path`). ``kwargs``: the chosen
    implementation's keywords."""
    check_batch_shapes({"q_nope": q_nope, "q_pe": q_pe}, 3, _fail, layout="[batch, heads, dim]")
    require_tensors({"ckv_cache": ckv_cache, "kpe_cache": kpe_cache, "kv_indptr": kv_indptr,
                     "kv_indices": kv_indices}, _fail)
    if plan is not None:
        chosen = ("cuda" if isinstance(plan, cuda_path.CudaPlan) else
                  "wgmma" if isinstance(plan, wgmma_path.WgmmaPlan) else "triton")
        if path not in ("auto", chosen):
            raise ValueError(f"mla_decode: the plan is for the {chosen} path, but path={path!r}.")
    elif path == "auto":
        batch, heads, dc = q_nope.shape
        max_len = -(-kv_indices.numel() * max(1, ckv_cache.shape[-2] if ckv_cache.dim() == 3 else 1) // batch)
        chosen = choose_path(heads, batch, max_len, q_nope.device, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
                             dims=(dc, q_pe.shape[-1]))[0]
        if chosen != "triton" and kwargs.get("check_range") is False:
            chosen = "triton"  # an unchecked CUDA call needs a plan (made outside graph capture); Triton does not
    elif path in ("triton", "cuda", "wgmma"):
        chosen = path
    else:
        raise ValueError(f"mla_decode: path must be 'auto', 'triton', 'cuda' or 'wgmma', got {path!r}.")
    fn = {"cuda": cuda_path.mla_decode_fp8_cuda, "wgmma": wgmma_path.mla_decode_fp8_wgmma}.get(chosen, mla_decode_fp8)
    return fn(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, plan=plan, **kwargs)

"""Which path runs a fused FP8 MLA decode call -- what a user calls ("ours"): :func:`mla_decode` with the per-step
plan of :func:`plan_mla_decode_auto`. The paths (:data:`KERNEL_PATHS`):

- ``"triton"``: the Triton kernel (:mod:`.kernel`), portable: every GPU Triton supports (SM100 and SM120 included)
  and the CPU interpreter;
- ``"wgmma"``: the heads-on-M warpgroup-MMA kernel (:mod:`.wgmma`, 64 heads per CTA as wgmma's M), Hopper only
  (sm_90a: H100 / H200);
- ``"wgmma_tokens"``: the tokens-on-M warpgroup-MMA kernel (:mod:`.wgmma_tokens`, a tile's 64 tokens as M and 16 or
  32 heads per CTA as N: no head padding at few heads), Hopper only, with the wgmma path's refusals.

:func:`choose_path` decides, in this order:

1. where the wgmma paths cannot run -- not a GPU of compute capability 9.0, latent / rope widths other than
   512 / 64, cache rows not 16-byte aligned (both wgmma paths refuse the same calls) -- the Triton path;
2. else by the measured table ``paths.json``: the entry of this GPU model, else an entry measured on a GPU of the same
   compute capability (an H100 uses the H200's crossovers); at the measured point nearest to the call (heads,
   batch, longest request, in log scale), the fastest of the paths timed there;
3. with no entry for this GPU or its capability: the tokens-on-M wgmma path up to :data:`TOKENS_MAX_HEADS` heads (on
   the H200 it was faster than the heads-on-M path at every 16- and 32-head point measured, ``NOTES.md``
   generation 6), the wgmma path above.

``paths.json``: ``{gpu name: {"by", "recorded", "capability": [major, minor], "points": [[heads, context, batch,
path, triton_us, wgmma_us, wgmma_tokens_us], ...]}}`` (``path``: the fastest at that point; a time None where that
path was not timed; a point of six elements, the format before the tokens-on-M path, is read as one whose
``wgmma_tokens_us`` was not timed), derived from the recorded ``fused_decode_paths`` result; :func:`path_point` makes
a point.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Literal, get_args

import torch

from kvwall.kernels._args import check_batch_shapes, require_tensors
from kvwall.kernels._common import fail, gpu_name
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.kernel import MLADecodePlan, mla_decode_fp8, plan_mla_decode

__all__ = ["PATHS_FILE", "KernelPath", "KERNEL_PATHS", "TOKENS_MAX_HEADS", "choose_path", "decide_path",
           "table_entry", "measured_choice", "path_point", "path_of_plan", "plan_mla_decode_auto", "mla_decode",
           "reload_table"]

_fail = functools.partial(fail, "mla_decode")
#: The measured table (GPU model -> its crossovers), derived from the recorded ``fused_decode_paths`` result.
PATHS_FILE = Path(__file__).with_name("paths.json")
KernelPath = Literal["triton", "wgmma", "wgmma_tokens"]
KERNEL_PATHS: tuple[KernelPath, ...] = get_args(KernelPath)
#: Where each path's time sits in a point ``[heads, context, batch, path, triton_us, wgmma_us, wgmma_tokens_us]``.
_US_AT: dict[KernelPath, int] = {"triton": 4, "wgmma": 5, "wgmma_tokens": 6}
#: The paths that run on the Hopper kernels (sm_90a), with the same refusals (:func:`wgmma_path.wgmma_refusal`,
#: :func:`wgmma_path.rows_refusal`).
_HOPPER_PATHS: tuple[KernelPath, ...] = ("wgmma", "wgmma_tokens")
#: With no measured table: the tokens-on-M wgmma path up to this many heads (its instantiations: 16 and 32 heads per
#: CTA), the heads-on-M wgmma path above.
TOKENS_MAX_HEADS = 32
#: How the dispatcher's reasons name each path.
_SAID: dict[KernelPath, str] = {"triton": "Triton", "wgmma": "wgmma", "wgmma_tokens": "tokens-on-M wgmma"}


def path_point(heads: int, context: int, batch: int, triton_us: float, wgmma_us: float | None,
               wgmma_tokens_us: float | None = None) -> list:
    """A ``paths.json`` point: ``[heads, context, batch, path, triton_us, wgmma_us, wgmma_tokens_us]``, ``path`` the
    fastest of the timed paths (a tie goes to the earlier of :data:`KERNEL_PATHS`: the Triton path first), times
    rounded to 0.01 µs (None: not timed)."""
    times = [round(triton_us, 2), *(None if us is None else round(us, 2) for us in (wgmma_us, wgmma_tokens_us))]
    timed = {p: times[i - 4] for p, i in _US_AT.items() if times[i - 4] is not None}
    path = min(timed, key=lambda p: (timed[p], KERNEL_PATHS.index(p)))
    return [heads, context, batch, path, *times]


def _us(point: list, path: KernelPath) -> float | None:
    """``path``'s time at ``point`` (None: not timed; a six-element point has no tokens-on-M time)."""
    i = _US_AT[path]
    return point[i] if i < len(point) else None


def measured_choice(entry: dict, heads: int, batch: int, max_len: int) -> tuple[KernelPath, list] | None:
    """The faster path at the point of ``entry`` (one GPU's table) nearest to (heads, batch, max_len) in log scale,
    and that point; None for an entry without points."""
    points = entry.get("points") or []
    if not points:
        return None

    def distance(p: list) -> float:
        return (abs(math.log2(p[0] / max(heads, 1))) + abs(math.log2(p[2] / max(batch, 1)))
                + abs(math.log2(p[1] / max(max_len, 1))))

    best = min(points, key=distance)
    timed = {p: us for p in KERNEL_PATHS if (us := _us(best, p)) is not None}
    return min(timed, key=lambda p: (timed[p], KERNEL_PATHS.index(p))), best


@functools.cache
def _read_table(path: Path) -> dict:
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return table if isinstance(table, dict) else {}


def reload_table() -> None:
    """Forget the tables read so far: the next :func:`choose_path` reads ``paths.json`` (or its ``table_file``) again
    (after ``fused_decode_paths`` rewrote it, in the process that recorded it)."""
    _read_table.cache_clear()


def table_entry(table: dict, gpu: str, capability: tuple[int, int] | None) -> tuple[str, dict] | None:
    """``(measured GPU, its entry)``: the entry for ``gpu`` itself, else the first entry measured on a GPU of the same
    ``capability`` (an entry's ``"capability": [major, minor]``); None where neither exists."""
    if isinstance(table.get(gpu), dict):
        return gpu, table[gpu]
    if capability is not None:
        for name, entry in table.items():
            if isinstance(entry, dict) and tuple(entry.get("capability") or ()) == tuple(capability):
                return name, entry
    return None


def decide_path(heads: int, batch: int, max_len: int, *, gpu: str, capability: tuple[int, int] | None,
                refusal: str | None, table: dict) -> tuple[KernelPath, str]:
    """:func:`choose_path`'s rule without a device: ``gpu`` / ``capability`` the GPU's model and compute capability,
    ``refusal`` why the wgmma paths cannot run this call (None: they can; both refuse the same calls), ``table`` the
    whole ``paths.json``."""
    if refusal:
        return "triton", f"Triton: the wgmma paths cannot run this call ({refusal})"
    found = table_entry(table, gpu, capability)
    choice = measured_choice(found[1], heads, batch, max_len) if found else None
    if choice is None:
        path: KernelPath = "wgmma_tokens" if heads <= TOKENS_MAX_HEADS else "wgmma"
        return path, (f"{_SAID[path]}: no measured table for {gpu} nor for its compute capability "
                      f"{'.'.join(map(str, capability or ()))}, so the capability rule: where the wgmma paths can run "
                      f"(sm_90a, latent 512 / rope 64, 16-byte aligned rows), the tokens-on-M wgmma path up to "
                      f"{TOKENS_MAX_HEADS} heads, the wgmma path above ({heads} heads)")
    path, point = choice
    times = ", ".join(f"{p} {us:.1f} µs" for p in KERNEL_PATHS if (us := _us(point, p)) is not None)
    where = found[0] if found[0] == gpu else f"{found[0]} (the same compute capability as this {gpu})"
    return path, (f"{_SAID[path]}: measured {times} at the nearest point "
                  f"({point[0]} heads, {point[1]} tokens, batch {point[2]}) on {where}")


def choose_path(heads: int, batch: int, max_len: int, device: torch.device, *, ckv_cache: torch.Tensor | None = None,
                kpe_cache: torch.Tensor | None = None, dims: tuple[int, int] = (512, 64),
                table_file: Path | None = None) -> tuple[KernelPath, str]:
    """``(path, why)`` for a call of ``heads`` heads, ``batch`` requests of at most ``max_len`` tokens on ``device``,
    latent / rope widths ``dims`` (caches given: their row alignment is checked too); the rule is the module
    docstring's, ``why`` says which step decided and on what numbers. Both wgmma paths refuse what
    :func:`~kvwall.kernels.mla_decode.wgmma.wgmma_refusal` and :func:`~kvwall.kernels.mla_decode.wgmma.rows_refusal`
    refuse: the tokens-on-M path checks its inputs with the wgmma path's code."""
    refusal = wgmma_path.wgmma_refusal(device) or wgmma_path.rows_refusal(
        dims, {"ckv_cache": ckv_cache, "kpe_cache": kpe_cache})
    on_gpu = device.type == "cuda"
    return decide_path(heads, batch, max_len, gpu=gpu_name(device) if on_gpu else str(device),
                       capability=torch.cuda.get_device_capability(device) if on_gpu else None, refusal=refusal,
                       table=_read_table(table_file or PATHS_FILE))


def _lengths(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None, page_size: int) -> tuple[int, int]:
    ptr = kv_indptr.tolist()
    lens = kv_len.tolist() if kv_len is not None else [b - a for a, b in zip(ptr, ptr[1:])]
    return len(ptr) - 1, max(lens or [0]) * (1 if kv_len is not None else page_size)


def _check_path(who: str, path: str) -> None:
    if path != "auto" and path not in KERNEL_PATHS:
        raise ValueError(f"{who}: path must be 'auto' or one of {', '.join(map(repr, KERNEL_PATHS))}, got {path!r}.")


def path_of_plan(plan: MLADecodePlan) -> KernelPath:
    """The path a plan was made for: a :class:`~kvwall.kernels.mla_decode.wgmma.WgmmaPlan` the wgmma path's, a
    :class:`~kvwall.kernels.mla_decode.wgmma_tokens.WgmmaTokensPlan` the tokens-on-M path's, any other the Triton
    path's."""
    if isinstance(plan, tokens_path.WgmmaTokensPlan):
        return "wgmma_tokens"
    return "wgmma" if isinstance(plan, wgmma_path.WgmmaPlan) else "triton"


def plan_mla_decode_auto(kv_indptr: torch.Tensor, kv_len: torch.Tensor | None = None, *, heads: int,
                         page_size: int = 1, device: torch.device | None = None, path: str = "auto",
                         ckv_cache: torch.Tensor | None = None,
                         kpe_cache: torch.Tensor | None = None) -> MLADecodePlan:
    """The plan (once per decode step) of the path :func:`choose_path` picks (``path="auto"``) or of ``path``: a
    :class:`~kvwall.kernels.mla_decode.wgmma.WgmmaPlan` for the wgmma path, a
    :class:`~kvwall.kernels.mla_decode.wgmma_tokens.WgmmaTokensPlan` for the tokens-on-M wgmma path, else an
    :class:`~kvwall.kernels.mla_decode.kernel.MLADecodePlan` (the Triton path)."""
    _check_path("plan_mla_decode_auto", path)
    device = torch.device(device) if device is not None else kv_indptr.device
    if path == "auto":
        batch, max_len = _lengths(kv_indptr, kv_len, page_size)
        path = choose_path(heads, batch, max_len, device, ckv_cache=ckv_cache, kpe_cache=kpe_cache)[0]
    if path == "wgmma":
        return wgmma_path.plan_mla_decode_wgmma(kv_indptr, kv_len, heads=heads, page_size=page_size, device=device)
    if path == "wgmma_tokens":
        return tokens_path.plan_mla_decode_wgmma_tokens(kv_indptr, kv_len, heads=heads, page_size=page_size,
                                                        device=device)
    return plan_mla_decode(kv_indptr, kv_len, heads=heads, page_size=page_size, device=device)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
               kv_indptr: torch.Tensor, kv_indices: torch.Tensor, sm_scale: float, *, path: str = "auto",
               plan: MLADecodePlan | None = None, **kwargs):
    """:func:`~kvwall.kernels.mla_decode_fp8`'s contract on the path of ``plan`` (:func:`path_of_plan`: a
    :class:`~kvwall.kernels.mla_decode.wgmma.WgmmaPlan` runs the wgmma path, a
    :class:`~kvwall.kernels.mla_decode.wgmma_tokens.WgmmaTokensPlan` the tokens-on-M wgmma path, any other plan the
    Triton path), else on ``path`` (``"auto"``: :func:`choose_path`). ``kwargs``: the chosen path's keywords."""
    check_batch_shapes({"q_nope": q_nope, "q_pe": q_pe}, 3, _fail, layout="[batch, heads, dim]")
    require_tensors({"ckv_cache": ckv_cache, "kpe_cache": kpe_cache, "kv_indptr": kv_indptr,
                     "kv_indices": kv_indices}, _fail)
    _check_path("mla_decode", path)
    if plan is not None:
        chosen: KernelPath = path_of_plan(plan)
        if path not in ("auto", chosen):
            raise ValueError(f"mla_decode: the plan is for the {chosen} path, but path={path!r}.")
    elif path == "auto":
        batch, heads, dc = q_nope.shape
        max_len = -(-kv_indices.numel() * max(1, ckv_cache.shape[-2] if ckv_cache.dim() == 3 else 1) // batch)
        chosen = choose_path(heads, batch, max_len, q_nope.device, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
                             dims=(dc, q_pe.shape[-1]))[0]
        if chosen in _HOPPER_PATHS and kwargs.get("check_range") is False:
            chosen = "triton"  # an unchecked wgmma call needs a plan (made outside graph capture); Triton does not
    else:
        chosen = path  # type: ignore[assignment]
    fn = {"wgmma": wgmma_path.mla_decode_fp8_wgmma, "wgmma_tokens": tokens_path.mla_decode_fp8_wgmma_tokens,
          "triton": mla_decode_fp8}[chosen]
    return fn(q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, plan=plan, **kwargs)

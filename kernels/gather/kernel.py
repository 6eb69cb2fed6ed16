"""Gather-then-cast: convert only the KV rows a batch's page table references, FP8 -> BF16.

SGLang's ``flashinfer_mla`` backend cast the *whole* layer pool to BF16 on every layer of every
decode step. :func:`gather_cast` reads just the rows ``kv_indices`` names and writes them, in that
order, into a compact BF16 buffer: ``out[i] = pool[kv_indices[i]] (* scale)``. The attention is then
planned over that buffer with indices ``0..n-1`` (:func:`compact_kv_indices`).

Calling conventions (the same for the CUDA C++ twin, :func:`kvwall.kernels.gather.cuda.gather_cast_cuda`):

- ``pool``: ``float8_e4m3fn``, ``(num_slots, D)``, SGLang's ``(num_slots, 1, D)``, or a paged pool
  ``(num_pages, page_size, D)``. **Page sizes above 1**: ``kv_indices`` are then *page* indices (as
  FlashInfer's paged wrappers take them) and every referenced page is copied whole, so
  ``out[i] = pool[kv_indices[i]]`` is a ``(page_size, D)`` page; plan the attention with pages
  ``0..n-1`` and the same ``kv_last_page_len``. To gather *token* slots out of a paged pool
  instead, pass ``pool.view(-1, D)`` and token indices ``page * page_size + offset``. Rows may be
  strided (``pool[:, :, :512]`` of a wider pool); offsets are 64-bit wherever the pool's last row
  lies past 2^31 values (:func:`largest_pool_offset`), 32-bit otherwise.
- ``kv_indices``: 1-D ``int32`` or ``int64``, contiguous. Repeated and unsorted indices are fine.
- ``kv_indptr`` (optional, CSR request boundaries on the pool's device): only its *last* entry is
  read, **inside the kernel**, and bounds how many of ``kv_indices`` are real; rows past it are not
  written. No host synchronization: this is what lets the call sit in a CUDA-graph-captured
  decode step, where ``kv_indices`` and ``out`` are fixed-capacity buffers and lengths change.
- ``out`` (optional): a BF16 buffer with at least ``len(kv_indices)`` rows (its capacity), its
  own memory: one that overlaps itself (``expand``) or shares bytes with an input is refused.
- ``scale`` (optional): a Python number (finite as float32: NaN and infinities are refused, the rule of
  ``mla_decode_fp8``'s scales) or a one-element float32 tensor on the pool's device (read
  in the kernel, so a graph replays with whatever the tensor holds). Products are rounded to
  BF16 to nearest-even, exactly as ``(row.float() * scale).to(torch.bfloat16)``.
- ``check_range=True`` validates indices and ``kv_indptr`` on the host *before* the launch (a
  device sync). ``check_range=False`` skips that sync (needed inside graph capture). **Unchecked
  calls** (the contract :func:`kvwall.kernels.mla_decode.triton_path.mla_decode_fp8` shares): the
  kernel never reads outside the pool or ``kv_indices`` and never writes outside ``out``; an
  out-of-range index gives NaN (here: its row of ``out`` is NaN), and a ``kv_indptr`` end past the
  capacity is clamped to it. Bad page tables show up as NaN downstream instead of an exception
  naming the bad index.

FP8 -> BF16 is exact (e4m3 values are a subset of BF16), so without ``scale`` the result is
bit-identical to ``pool[idx].to(torch.bfloat16)``, FP8 NaN included (NaN stays NaN), compiled or
interpreted: Triton's interpreter reads e4m3's NaN patterns as ±480, and the kernels put the NaN
back there (:data:`kvwall.kernels._common.keep_fp8_nan`). Tests check bit-exactness on both paths.

On a CPU tensor the kernels run in Triton's interpreter (constructed here, whatever
``TRITON_INTERPRET`` says, so import order does not matter); on CUDA they are compiled.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from kvwall.kernels._common import (
    Fail,
    build_kernel,
    check_indices_in_range,
    check_kv_indptr,
    check_output,
    fail,
    gpu_name,
    keep_fp8_nan,
    needs_int64,
    read_tuned_table,
    refuse_graph_capture,
    round_bf16_by_bits,
    sm_count,
)
from kvwall.kernels._args import MAX_TOKENS, below_float32_normal, scale_number

__all__ = [
    "gather_cast",
    "full_cast",
    "compact_kv_indices",
    "GatherPlan",
    "plan_gather",
    "launch_gather",
    "check_same_layout",
    "GatherConfig",
    "gather_config",
    "chunk_width",
    "largest_pool_offset",
    "SUPPORTED_INDEX_DTYPES",
]

SUPPORTED_INDEX_DTYPES = (torch.int32, torch.int64)
POOL_DTYPE = torch.float8_e4m3fn
OUT_DTYPE = torch.bfloat16


def _gather_cast_kernel(
    pool_ptr,
    kv_indices_ptr,
    out_ptr,
    indptr_end_ptr,
    scale_ptr,
    scale_value,
    capacity_rows,  # len(kv_indices) * PAGE: output rows (tokens) the launch covers
    num_pages,  # pool.shape[0]: valid indices are 0 <= i < num_pages
    pool_page_stride,
    out_page_stride,  # elements between consecutive pages
    D: tl.constexpr,
    PAGE: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    SCALE_MODE: tl.constexpr,  # 0: none, 1: scale_value, 2: *scale_ptr
    WIDE: tl.constexpr,  # int64 chunk/row arithmetic and output offsets (only when they can pass 2^31 - 1)
    POOL_WIDE: tl.constexpr,  # int64 pool offsets (only when the largest the launch can form passes 2^31 - 1)
    EVICT_LOADS: tl.constexpr,
    EVICT_STORES: tl.constexpr,  # evict_first hints for the pool reads / out writes
    LOAD_VEC: tl.constexpr,  # FP8 values per load vector: 8 matches the 16-byte BF16 stores' thread layout
):
    # The rows are cut into CHUNK-value pieces (576 = 9 x 64): chunk j is piece j % (D // CHUNK) of token
    # row j // (D // CHUNK). A program moves BLOCK chunks at once, a [BLOCK, CHUNK] tile: no column
    # masking (CHUNK divides D), vector loads and 16-byte stores, and BLOCK * CHUNK / threads bytes of
    # independent loads in flight per thread. A grid smaller than the work walks the blocks
    # persistently; the end comes from the device-side real length, so a launch sized for a graph's
    # capacity costs only what the real rows need.
    NC: tl.constexpr = D // CHUNK
    limit = tl.full((), 0, tl.int64) + capacity_rows
    if HAS_INDPTR:  # the end clamped to the capacity (in pages) before it is multiplied: 2^57 x 64 would wrap
        limit = tl.minimum(tl.maximum(tl.load(indptr_end_ptr).to(tl.int64), 0), limit // PAGE) * PAGE
    if not WIDE:
        limit = limit.to(tl.int32)
    if SCALE_MODE == 1:
        scale = scale_value
    elif SCALE_MODE == 2:
        scale = tl.load(scale_ptr)
    cols = tl.arange(0, CHUNK)[None, :]
    # The same offsets, seen by the compiler as contiguous in runs of LOAD_VEC only: with 8, the FP8 loads get the
    # BF16 stores' layout (8 values a thread) and the tile needs no layout conversion through shared memory.
    load_cols = (cols // LOAD_VEC) * LOAD_VEC + cols % LOAD_VEC
    for block in range(tl.program_id(0), (limit * NC + BLOCK - 1) // BLOCK, tl.num_programs(0)):
        # [BLOCK, 1] columns: one slot load per chunk (the few chunks of a row share it through L1), index math
        # in 32-bit unless WIDE, 64-bit pool offsets only where the pool's last page lies past 2^31 values
        # (POOL_WIDE: decided by the offsets, not the element count, so a row-strided view is covered).
        j = block * BLOCK + tl.arange(0, BLOCK)[:, None]
        if WIDE:
            j = j.to(tl.int64)
        live = j < limit * NC
        row = j // NC
        piece = (j - row * NC) * CHUNK
        if PAGE == 1:
            page = row
            within = piece
        else:
            page = row // PAGE
            within = (row - page * PAGE) * D + piece
        slot = tl.load(kv_indices_ptr + page, mask=live, other=0).to(tl.int64)
        in_pool = (slot >= 0) & (slot < num_pages)
        if POOL_WIDE:
            src = pool_ptr + (slot * pool_page_stride + within)
        else:
            src = pool_ptr + (tl.where(in_pool, slot, 0).to(tl.int32) * pool_page_stride + within)
        if WIDE:
            dst = out_ptr + (page * out_page_stride + within)
        else:
            dst = out_ptr + (page * out_page_stride + within).to(tl.int32)
        if EVICT_LOADS:
            x = tl.load(src + load_cols, mask=live & in_pool, other=0.0, eviction_policy="evict_first")
        else:
            x = tl.load(src + load_cols, mask=live & in_pool, other=0.0)
        if SCALE_MODE == 0:
            y = keep_fp8_nan(x, x.to(tl.bfloat16))
        else:  # rounded by integer ops: the same arithmetic in the interpreter, which truncates
            y = round_bf16_by_bits(keep_fp8_nan(x, x.to(tl.float32)) * scale)
        y = tl.where(in_pool, y, float("nan")).to(tl.bfloat16)
        if EVICT_STORES:
            tl.store(dst + cols, y, mask=live, eviction_policy="evict_first")
        else:
            tl.store(dst + cols, y, mask=live)


def _gather_cast_tiles_kernel(
    pool_ptr,
    kv_indices_ptr,
    out_ptr,
    indptr_end_ptr,
    scale_ptr,
    scale_value,
    capacity_rows,
    num_pages,
    pool_page_stride,
    out_page_stride,
    D: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    HAS_INDPTR: tl.constexpr,
    SCALE_MODE: tl.constexpr,
):
    # The general-D path (D not a multiple of 16: 1, 33, 70, ...) and the first version's kernel for D = 576:
    # rows in blocks, each row in BLOCK_COLS-column tiles, the last one masked.
    limit = capacity_rows
    if HAS_INDPTR:  # clamped to the capacity (in pages) before it is multiplied, as above
        limit = tl.minimum(tl.maximum(tl.load(indptr_end_ptr).to(tl.int64), 0), capacity_rows // PAGE) * PAGE
    if SCALE_MODE == 1:
        scale = scale_value
    elif SCALE_MODE == 2:
        scale = tl.load(scale_ptr)
    for block in range(tl.program_id(0), (limit + BLOCK_ROWS - 1) // BLOCK_ROWS, tl.num_programs(0)):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS).to(tl.int64)
        real = rows < limit
        page = rows // PAGE
        slot = tl.load(kv_indices_ptr + page, mask=real, other=0).to(tl.int64)
        in_pool = (slot >= 0) & (slot < num_pages)
        src = pool_ptr + slot * pool_page_stride + (rows % PAGE) * D
        dst = out_ptr + page * out_page_stride + (rows % PAGE) * D
        for c in tl.static_range(0, D, BLOCK_COLS):
            cols = c + tl.arange(0, BLOCK_COLS)
            col_ok = cols < D
            x = tl.load(src[:, None] + cols[None, :], mask=(real & in_pool)[:, None] & col_ok[None, :], other=0.0)
            if SCALE_MODE == 0:
                y = keep_fp8_nan(x, x.to(tl.bfloat16))
            else:
                y = round_bf16_by_bits(keep_fp8_nan(x, x.to(tl.float32)) * scale)
            y = tl.where(in_pool[:, None], y, float("nan")).to(tl.bfloat16)
            tl.store(dst[:, None] + cols[None, :], y, mask=real[:, None] & col_ok[None, :])


def _full_cast_kernel(src_ptr, out_ptr, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(src_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, keep_fp8_nan(x, x.to(tl.bfloat16)), mask=mask)


@functools.cache
def _kernel(name: str, interpreted: bool):
    fn = {
        "gather_cast": _gather_cast_kernel,
        "gather_cast_tiles": _gather_cast_tiles_kernel,
        "full_cast": _full_cast_kernel,
    }[name]
    return build_kernel(fn, interpreted)


# ----------------------------------------------------------------------------------------------
# Validation: everything a launch needs, checked before it, with errors that say what to do.
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherPlan:
    """What a gather-cast launch needs, validated; shared by the Triton kernel and the CUDA twin."""

    pool: torch.Tensor
    kv_indices: torch.Tensor
    out: torch.Tensor
    indptr_end: torch.Tensor | None  # a one-element view of kv_indptr[-1:]
    scale_tensor: torch.Tensor | None
    scale_value: float | None
    page_size: int
    dim: int

    @property
    def capacity(self) -> int:
        return self.kv_indices.numel()

    @property
    def scale_mode(self) -> int:
        return 2 if self.scale_tensor is not None else (1 if self.scale_value is not None else 0)


_fail: Fail = functools.partial(fail, "gather_cast")


def plan_gather(
    pool: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float | torch.Tensor | None = None,
    check_range: bool = True,
) -> GatherPlan:
    """Check every argument of :func:`gather_cast` and allocate ``out`` if not given."""
    if not isinstance(pool, torch.Tensor) or not isinstance(kv_indices, torch.Tensor):
        _fail(
            TypeError,
            f"pool and kv_indices must be tensors, got {type(pool).__name__} and {type(kv_indices).__name__}.",
        )
    if pool.dtype != POOL_DTYPE:
        _fail(
            TypeError,
            f"pool has dtype {pool.dtype}; it must be {POOL_DTYPE} (the FP8 KV cache). "
            "For a BF16 pool no cast is needed: index it directly.",
        )
    if pool.dim() not in (2, 3):
        _fail(
            ValueError,
            f"pool has shape {tuple(pool.shape)}; expected (num_slots, D), SGLang's "
            "(num_slots, 1, D) or a paged (num_pages, page_size, D).",
        )
    if pool.shape[-1] < 1 or pool.shape[0] < 1 or (pool.dim() == 3 and pool.shape[1] < 1):
        _fail(ValueError, f"pool has shape {tuple(pool.shape)}: every dimension must be at least 1.")
    dim = pool.shape[-1]
    page_size = pool.shape[1] if pool.dim() == 3 else 1
    if pool.stride(-1) != 1 or (pool.dim() == 3 and page_size > 1 and pool.stride(1) != dim):
        _fail(
            ValueError,
            f"pool strides {pool.stride()} (shape {tuple(pool.shape)}): the rows of a page must be "
            "contiguous (last dim stride 1, and page stride D inside a page); pass pool.contiguous().",
        )
    if pool.device.type not in ("cuda", "cpu"):
        _fail(ValueError, f"pool is on {pool.device}; gather_cast runs on CUDA (compiled) or CPU (Triton interpreter).")
    if kv_indices.dtype not in SUPPORTED_INDEX_DTYPES:
        _fail(TypeError, f"kv_indices has dtype {kv_indices.dtype}; use torch.int32 or torch.int64.")
    if kv_indices.dim() != 1:
        _fail(ValueError, f"kv_indices has shape {tuple(kv_indices.shape)}; it must be 1-D (the flattened page table).")
    if kv_indices.numel() > 1 and kv_indices.stride(0) != 1:
        _fail(ValueError, "kv_indices is not contiguous; pass kv_indices.contiguous().")
    if kv_indices.device != pool.device:
        _fail(
            ValueError, f"kv_indices is on {kv_indices.device} but pool is on {pool.device}; move them to one device."
        )
    n = kv_indices.numel()
    out_shape = (n, page_size, dim) if pool.dim() == 3 else (n, dim)
    out_given = out is not None
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != OUT_DTYPE:
            _fail(TypeError, f"out has dtype {getattr(out, 'dtype', type(out).__name__)}; it must be {OUT_DTYPE}.")
        if out.device != pool.device:
            _fail(ValueError, f"out is on {out.device} but pool is on {pool.device}.")
        if out.dim() != pool.dim() or tuple(out.shape[1:]) != tuple(pool.shape[1:]):
            _fail(
                ValueError,
                f"out has shape {tuple(out.shape)}; for a pool of shape {tuple(pool.shape)} it must be "
                f"(capacity, {', '.join(map(str, pool.shape[1:]))}).",
            )
        if out.shape[0] < n:
            _fail(
                ValueError,
                f"out holds {out.shape[0]} rows but kv_indices has {n}: out is too small. "
                f"Allocate at least len(kv_indices) rows (the capacity).",
            )
        if out.stride(-1) != 1 or (out.dim() == 3 and page_size > 1 and out.stride(1) != dim):
            _fail(ValueError, f"out strides {out.stride()}: its rows must be contiguous like the pool's.")
    indptr_end = None
    if kv_indptr is not None:
        if not isinstance(kv_indptr, torch.Tensor) or kv_indptr.dtype not in SUPPORTED_INDEX_DTYPES:
            _fail(
                TypeError,
                f"kv_indptr has dtype {getattr(kv_indptr, 'dtype', type(kv_indptr).__name__)}; "
                "use torch.int32 or torch.int64.",
            )
        if kv_indptr.dim() != 1 or kv_indptr.numel() < 1:
            _fail(ValueError, f"kv_indptr has shape {tuple(kv_indptr.shape)}; it must be 1-D with batch + 1 entries.")
        if kv_indptr.device != pool.device:
            _fail(
                ValueError,
                f"kv_indptr is on {kv_indptr.device} but pool is on {pool.device}; the kernel reads "
                "it on the device (no host sync), so it must live there.",
            )
        indptr_end = kv_indptr[-1:]
    scale_tensor = scale_value = None
    if isinstance(scale, torch.Tensor):
        if scale.dtype != torch.float32 or scale.numel() != 1:
            _fail(
                TypeError,
                f"scale tensor has dtype {scale.dtype} and {scale.numel()} elements; it must be one float32 value.",
            )
        if scale.device != pool.device:
            _fail(ValueError, f"scale is on {scale.device} but pool is on {pool.device}.")
        scale_tensor = scale.reshape(1)
    elif scale is not None:
        scale_value = scale_number("scale", scale, _fail)
        if pool.device.type == "cpu" and below_float32_normal(scale_value):  # (the interpreter: see the helper)
            scale_tensor, scale_value = torch.tensor([scale_value], dtype=torch.float32), None
    if out_given:
        check_output(
            out, {"pool": pool, "kv_indices": kv_indices, "kv_indptr": kv_indptr, "scale": scale_tensor}, _fail
        )
    if check_range:
        refuse_graph_capture(pool.device, _fail)
        n = check_kv_indptr(kv_indptr, kv_indices.numel(), _fail)[-1] if kv_indptr is not None else kv_indices.numel()
        check_indices_in_range(kv_indices[:n], pool.shape[0], "pages" if page_size > 1 else "slots", "the pool", _fail)
    if out is None:  # allocated once every argument has passed
        out = torch.empty(out_shape, dtype=OUT_DTYPE, device=pool.device)
    return GatherPlan(pool, kv_indices, out, indptr_end, scale_tensor, scale_value, page_size, dim)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GatherConfig:
    """Launch shape of the chunked kernel: ``block`` chunks per program step, ``num_warps``, and the grid,
    ``programs_per_sm`` x the multiprocessors (a persistent grid; 0: one program per block)."""

    block: int
    num_warps: int
    programs_per_sm: int
    evict_loads: bool = True
    evict_stores: bool = False
    load_vec: int = 8

    def as_dict(self) -> dict:
        return {
            "block": self.block,
            "num_warps": self.num_warps,
            "programs_per_sm": self.programs_per_sm,
            "evict_loads": self.evict_loads,
            "evict_stores": self.evict_stores,
            "load_vec": self.load_vec,
        }

    def label(self) -> str:
        grid = "1 program/block" if self.programs_per_sm <= 0 else f"{self.programs_per_sm}/SM"
        ev = ("L" if self.evict_loads else "") + ("S" if self.evict_stores else "")
        return f"B{self.block} w{self.num_warps} {grid} ev:{ev or '-'} v{self.load_vec}"


#: Used where the tuned table (``tuned.json`` beside this file, written by ``python -m kvwall.tuning.gather``
#: on the device) has no entry for the GPU: 16 KB of FP8 per program step (128 B a thread in flight).
DEFAULT_CONFIGS = {"small": GatherConfig(128, 4, 0), "large": GatherConfig(256, 4, 8)}
#: A launch of at most this many rows (its capacity) uses the "small" configuration.
SMALL_ROWS = 16384
TUNED_CONFIG_FILE = Path(__file__).with_name("tuned.json")


@functools.cache
def _device_configs(name: str) -> tuple[dict[str, GatherConfig], int]:
    """The tuned configurations for a GPU model (by ``torch.cuda.get_device_name``), else the defaults."""
    entry = read_tuned_table(TUNED_CONFIG_FILE, name)
    if not entry:
        return DEFAULT_CONFIGS, SMALL_ROWS
    fields = {f for f in GatherConfig.__dataclass_fields__}
    configs = {k: GatherConfig(**{f: v for f, v in entry[k].items() if f in fields}) for k in ("small", "large")}
    return configs, int(entry.get("small_rows", SMALL_ROWS))


def largest_pool_offset(pool: torch.Tensor) -> int:
    """The largest element offset a launch can form in ``pool``: the last value of its last page, whatever the
    row stride (``pool[:, :, :512]`` of a 3.8M-slot pool has 1.9G values but offsets up to 2.2G)."""
    page_values = (pool.shape[1] if pool.dim() == 3 else 1) * pool.shape[-1]
    return (pool.shape[0] - 1) * pool.stride(0) + page_values - 1


def chunk_width(dim: int) -> int:
    """The largest power of two <= 128 dividing ``dim`` (576 -> 64): the chunked kernel's piece of a row."""
    return min(dim & -dim, 128)


def gather_config(plan: "GatherPlan") -> GatherConfig:
    """The configuration a CUDA launch of ``plan`` uses (by GPU model and the launch's row capacity)."""
    configs, small_rows = _device_configs(gpu_name(plan.pool.device))
    return configs["small" if plan.capacity * plan.page_size <= small_rows else "large"]


def _tiles_config(dim: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_ROWS, BLOCK_COLS, num_warps) of the general-D tile kernel. Columns: the largest power of two
    <= 128 dividing D, else 64 with a masked tail."""
    cols = 128
    while cols > 16 and dim % cols:
        cols //= 2
    if dim % cols:
        cols = 64 if dim > 32 else triton.next_power_of_2(dim)
    if interpreted:  # few, large programs: the interpreter's cost is per program
        return max(16, 8192 // cols), cols, 1
    return max(1, 2048 // cols), cols, 4


def check_same_layout(plan: "GatherPlan", pool: torch.Tensor) -> None:
    ref = plan.pool
    if pool.shape != ref.shape or pool.stride() != ref.stride() or pool.dtype != ref.dtype or pool.device != ref.device:
        _fail(
            ValueError,
            f"pool {tuple(pool.shape)} {pool.dtype} strides {pool.stride()} on {pool.device} does not "
            f"match the planned {tuple(ref.shape)} {ref.dtype} strides {ref.stride()} on {ref.device}.",
        )


def launch_gather(
    plan: GatherPlan, *, pool: torch.Tensor | None = None, config: GatherConfig | None = None, variant: str = "auto"
) -> torch.Tensor:
    """Launch the Triton kernel for a validated :class:`GatherPlan`; returns ``plan.out``.

    ``pool``: another pool of exactly the planned layout (another layer's buffer), so that a caller that
    validated once can launch per layer without re-planning. ``config`` overrides the tuned launch shape;
    ``variant``: "auto" (chunks when 16 divides D, else tiles), "chunks", or "tiles" (the first version).
    """
    if pool is None:
        pool = plan.pool
    elif pool is not plan.pool:
        check_same_layout(plan, pool)
    rows = plan.capacity * plan.page_size
    if rows == 0:
        return plan.out
    interpreted = pool.device.type == "cpu"
    dummy = plan.kv_indices
    indptr = plan.indptr_end if plan.indptr_end is not None else dummy
    scale_ptr = plan.scale_tensor if plan.scale_tensor is not None else pool
    scale_value = plan.scale_value if plan.scale_value is not None else 1.0
    chunk = chunk_width(plan.dim)
    if variant == "auto":
        variant = "chunks" if chunk >= 16 else "tiles"
    if variant == "chunks":  # any D (an odd D gives 1-value chunks: correct, slow; "auto" avoids that)
        total = rows * (plan.dim // chunk)
        if interpreted:  # few, large programs: the interpreter's cost is per program
            cfg = GatherConfig(max(1, 65536 // chunk), 1, 0, False, False, 8)
        else:
            cfg = config or gather_config(plan)
        blocks = triton.cdiv(total, cfg.block)
        grid = (blocks if cfg.programs_per_sm <= 0 else min(blocks, sm_count(pool.device) * cfg.programs_per_sm),)
        wide = needs_int64(plan.capacity * plan.out.stride(0) + cfg.block * chunk) or needs_int64(total + cfg.block)
        _kernel("gather_cast", interpreted)[grid](
            pool,
            plan.kv_indices,
            plan.out,
            indptr,
            scale_ptr,
            scale_value,
            rows,
            pool.shape[0],
            pool.stride(0),
            plan.out.stride(0),
            D=plan.dim,
            PAGE=plan.page_size,
            CHUNK=chunk,
            BLOCK=cfg.block,
            HAS_INDPTR=plan.indptr_end is not None,
            SCALE_MODE=plan.scale_mode,
            WIDE=wide,
            POOL_WIDE=needs_int64(largest_pool_offset(pool)),
            EVICT_LOADS=cfg.evict_loads,
            EVICT_STORES=cfg.evict_stores,
            LOAD_VEC=min(cfg.load_vec, chunk),
            num_warps=cfg.num_warps,
            num_stages=1,
        )
        return plan.out
    if variant != "tiles":
        _fail(ValueError, f"variant={variant!r}: use 'auto', 'chunks' or 'tiles'.")
    br, bc, nw = _tiles_config(plan.dim, interpreted)
    blocks = triton.cdiv(rows, br)
    grid = (blocks if interpreted else min(blocks, sm_count(pool.device) * 8),)
    _kernel("gather_cast_tiles", interpreted)[grid](
        pool,
        plan.kv_indices,
        plan.out,
        indptr,
        scale_ptr,
        scale_value,
        rows,
        pool.shape[0],
        pool.stride(0),
        plan.out.stride(0),
        D=plan.dim,
        PAGE=plan.page_size,
        BLOCK_ROWS=br,
        BLOCK_COLS=bc,
        HAS_INDPTR=plan.indptr_end is not None,
        SCALE_MODE=plan.scale_mode,
        num_warps=nw,
        num_stages=1,
    )
    return plan.out


def gather_cast(
    pool: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float | torch.Tensor | None = None,
    check_range: bool = True,
) -> torch.Tensor:
    """``out[i] = pool[kv_indices[i]]`` in BF16 (times ``scale``), for the rows ``kv_indptr`` makes real.

    See the module docstring for shapes, page sizes, capacity and the ``check_range`` trade-off.
    Returns ``out`` (allocated with ``len(kv_indices)`` rows if not given).
    """
    return launch_gather(plan_gather(pool, kv_indices, kv_indptr, out=out, scale=scale, check_range=check_range))


_fail_full: Fail = functools.partial(fail, "full_cast")
#: The most values one program of ``full_cast`` may move (Triton's largest tensor).
MAX_FULL_CAST_BLOCK = 1 << 20


def full_cast(pool: torch.Tensor, *, out: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """The whole pool, FP8 -> BF16, as one vectorized pass (what ``pool.to(torch.bfloat16)`` should cost).

    ``pool``: any contiguous ``float8_e4m3fn`` tensor; ``out``: a contiguous BF16 tensor of the same shape
    (allocated if not given), not sharing memory with ``pool``; ``block``: values per program, a power of two
    up to 2^20 (default 8192 on a GPU, 65536 in the interpreter). All checked before the launch. Offsets are
    64-bit. Bit-identical to ``pool.to(torch.bfloat16)``, NaN included, on both paths.
    """
    if not isinstance(pool, torch.Tensor) or pool.dtype != POOL_DTYPE:
        _fail_full(TypeError, f"pool must be a {POOL_DTYPE} tensor, got {getattr(pool, 'dtype', type(pool).__name__)}.")
    if not pool.is_contiguous():
        _fail_full(ValueError, "pool is not contiguous; pass pool.contiguous().")
    if pool.device.type not in ("cuda", "cpu"):
        _fail_full(ValueError, f"pool is on {pool.device}; it runs on CUDA or CPU (Triton interpreter).")
    if out is None:
        out = torch.empty(pool.shape, dtype=OUT_DTYPE, device=pool.device)
    else:
        if not isinstance(out, torch.Tensor):
            _fail_full(TypeError, f"out must be a {OUT_DTYPE} tensor, got {type(out).__name__}.")
        if out.dtype != OUT_DTYPE or out.shape != pool.shape or not out.is_contiguous() or out.device != pool.device:
            _fail_full(
                ValueError,
                f"out must be a contiguous {OUT_DTYPE} tensor of shape {tuple(pool.shape)} on "
                f"{pool.device}; got {out.dtype} {tuple(out.shape)} on {out.device}"
                f"{'' if out.is_contiguous() else ', not contiguous'}.",
            )
        check_output(out, {"pool": pool}, _fail_full)
    interpreted = pool.device.type == "cpu"
    if block is None:
        block = 1 << 16 if interpreted else 8192
    elif (
        isinstance(block, bool)
        or not isinstance(block, int)
        or not 1 <= block <= MAX_FULL_CAST_BLOCK
        or block & (block - 1)
    ):
        _fail_full(
            ValueError,
            f"block={block!r}: give a power of two from 1 to {MAX_FULL_CAST_BLOCK} (values per "
            "program), or None for the default.",
        )
    numel = pool.numel()
    if numel == 0:
        return out
    _kernel("full_cast", interpreted)[(triton.cdiv(numel, block),)](
        pool, out, numel, BLOCK=block, num_warps=1 if interpreted else 8
    )
    return out


def compact_kv_indices(kv_indptr: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """The page table of the compact buffer :func:`gather_cast` writes: ``0..kv_indptr[-1]-1``. ``kv_indptr``: a 1-D
    int32 / int64 tensor of batch + 1 >= 1 entries starting at 0 and never decreasing, ending at most at 2^31 - 1 (the
    most indices a decode call takes); ``dtype`` torch.int32 or torch.int64. Checked before anything is allocated
    (reading ``kv_indptr`` is one synchronization, as reading its end always was)."""
    fail_: Fail = functools.partial(fail, "compact_kv_indices")
    if not isinstance(kv_indptr, torch.Tensor) or kv_indptr.dim() != 1 or kv_indptr.numel() < 1:
        got = f"shape {tuple(kv_indptr.shape)}" if isinstance(kv_indptr, torch.Tensor) else type(kv_indptr).__name__
        fail_(
            ValueError,
            "kv_indptr must be a 1-D tensor of batch + 1 >= 1 entries (its last is the rows gather_cast "
            f"wrote); got {got}.",
        )
    if kv_indptr.dtype not in SUPPORTED_INDEX_DTYPES:
        fail_(TypeError, f"kv_indptr has dtype {kv_indptr.dtype}; use torch.int32 or torch.int64.")
    if kv_indptr.device.type not in ("cuda", "cpu"):
        fail_(ValueError, f"kv_indptr is on {kv_indptr.device}; give it on CUDA or the CPU.")
    if dtype not in SUPPORTED_INDEX_DTYPES:
        fail_(TypeError, f"dtype must be torch.int32 or torch.int64 (an index dtype), got {dtype!r}.")
    ptr = kv_indptr.tolist()
    if ptr[0] != 0 or any(b < a for a, b in zip(ptr, ptr[1:])) or ptr[-1] > MAX_TOKENS:
        fail_(
            ValueError,
            f"kv_indptr must start at 0, never decrease and end at most at {MAX_TOKENS} (2^31 - 1); "
            f"got {ptr[:6]}{'...' if len(ptr) > 6 else ''} ending at {ptr[-1]}.",
        )
    return torch.arange(ptr[-1], dtype=dtype, device=kv_indptr.device)

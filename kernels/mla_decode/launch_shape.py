"""The Triton path's launch shapes: :class:`MLADecodeConfig` (tile, warps, stages, 16-bit pairs; the combine's
block), the tuned table (``tuned.json``, written by ``python -m kvwall.tuning.fused --write``: the entry nearest to the
GPU model, head count and context, :func:`tuned_entry`), the fallback shapes filtered by what the device fits
(:func:`fallback_config`: compiled offline, shared memory within the per-block limit, no trap-only kernel, no spills),
and the programs a launch aims for (:func:`programs_wanted`, :func:`default_num_splits`). Offline compiles for any
architecture (:func:`compile_offline`) serve the architecture check (:mod:`kvwall.tuning.arch_check`)."""

from __future__ import annotations

import functools
import math
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import triton

from kvwall.kernels._common import gpu_name, read_tuned_table, sm_count
from kvwall.kernels.mla_decode.triton_kernel import kernel_for

__all__ = [
    "MLADecodeConfig",
    "default_config",
    "default_num_splits",
    "programs_wanted",
    "blocks_per_sm",
    "tuned_entry",
    "fallback_config",
    "fallback_shapes",
    "FALLBACK_SHAPES",
    "split_constexprs",
    "kernel_signature",
    "compile_offline",
    "split_resources",
    "SplitResources",
    "is_trap_only",
    "cubin_resources",
    "TUNED_CONFIG_FILE",
]


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch shape of the split kernel (``block_h`` heads x ``block_n`` tokens per step, its warps and
    software-pipeline stages; ``pairs``: the tile read as 16-bit pairs of FP8 values) and of the combine
    (``combine_block_d`` latent columns per program; ``combine_block_s`` splits per step and ``combine_warps``;
    0 = sized from the work by :func:`combine_shape`)."""

    block_h: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    pairs: bool = False
    combine_block_d: int = 0
    combine_block_s: int = 0
    combine_warps: int = 0


#: Tuned launch shapes per GPU model, head count and context (written by ``python -m kvwall.tuning.fused --write``).
TUNED_CONFIG_FILE = Path(__file__).with_name("tuned.json")


def tuned_entry(heads: int, max_len: int | None, gpu: str, *, path: Path | None = None) -> dict | None:
    """The entry of the tuned table (``path``, default :data:`TUNED_CONFIG_FILE`) for GPU model ``gpu`` (as
    ``torch.cuda.get_device_name`` says it) nearest to (heads, context): the smallest tuned head count >= heads
    (else the largest), and the context nearest to ``max_len`` in log scale. Returns ``{"heads": tuned head
    count, "config": {...MLADecodeConfig fields}, "splits": ...}``, or None when the table has no entry for
    ``gpu``."""
    table = read_tuned_table(path or TUNED_CONFIG_FILE, gpu)
    counts = sorted(int(h) for h in table if h.isdigit())
    if not counts:
        return None
    h = next((c for c in counts if c >= heads), counts[-1])
    by_ctx = table[str(h)]
    n = max(1, max_len or 1)
    ctx = min(by_ctx, key=lambda c: abs(math.log(int(c) / n)))
    return {"heads": h, **by_ctx[ctx]}


@functools.cache
def _device_entry(gpu: str, heads: int, max_len: int | None) -> dict | None:
    return tuned_entry(heads, max_len, gpu)


def _entry_for(heads: int, max_len: int | None, device: torch.device) -> dict | None:
    return _device_entry(gpu_name(device), heads, max_len) if device.type == "cuda" else None


#: Launch shapes a GPU missing from the tuned table may get, best first, for up to 16 heads and for more: the
#: launcher takes the first whose compiled shared memory fits the device's per-block limit and that is not a
#: trap-only kernel (:func:`fallback_config`). The later ones exist for SM120's 99 KB blocks and SM100's 512
#: tensor-memory columns.
FALLBACK_SHAPES: dict[str, tuple[MLADecodeConfig, ...]] = {
    "up to 16 heads": (
        MLADecodeConfig(16, 64, 4, 3, pairs=True),
        MLADecodeConfig(16, 64, 4, 2),
        MLADecodeConfig(16, 64, 4, 1),
    ),
    "more than 16 heads": (
        MLADecodeConfig(64, 32, 8, 3),
        MLADecodeConfig(32, 64, 8, 3),
        MLADecodeConfig(32, 32, 8, 2),
        MLADecodeConfig(16, 64, 4, 1),
    ),
}


def fallback_shapes(heads: int) -> tuple[MLADecodeConfig, ...]:
    return FALLBACK_SHAPES["up to 16 heads" if heads <= 16 else "more than 16 heads"]


def split_constexprs(
    cfg: MLADecodeConfig,
    *,
    dc: int = 512,
    dr: int = 64,
    page: int = 1,
    worklist: bool = True,
    direct: bool = False,
    write_lse: bool = False,
    scale_from_ptr: bool = False,
    on_gpu: bool = True,
    causal: bool = False,
) -> dict:
    """The split kernel's compile-time parameters for a launch with ``cfg`` (what the launcher passes)."""
    return dict(
        DC=dc,
        DCH=dc // 4,
        DR=dr,
        BLOCK_H=cfg.block_h,
        BLOCK_N=cfg.block_n,
        PAGE=page,
        SCALE_FROM_PTR=scale_from_ptr,
        DIRECT=direct and not worklist,
        WRITE_LSE=write_lse,
        ON_GPU=on_gpu,
        KV_MUL=1.0 if on_gpu else 256.0,
        WORKLIST=worklist,
        PAIRS=cfg.pairs,
        CAUSAL=causal,
    )


_POINTER_TYPES = {
    "qn_ptr": "*bf16",
    "qp_ptr": "*bf16",
    "out_ptr": "*bf16",
    "ckv_ptr": "*fp8e4nv",
    "kpe_ptr": "*fp8e4nv",
    "indptr_ptr": "*i32",
    "indices_ptr": "*i32",
    "kvlen_ptr": "*i32",
    "work_ptr": "*i32",
    "combine_req_ptr": "*i32",
    "part_indptr_ptr": "*i32",
}
_FLOAT_ARGS = ("ckv_scale_val", "kpe_scale_val", "qk_scale")


def kernel_signature(name: str, constexprs: dict) -> dict[str, str]:
    """Argument types of kernel ``name`` ("split" or "combine") for an offline compile: int32 indices, BF16 queries
    and output, FP8 caches, float32 scales and partials."""
    fn = kernel_for(name, False)
    sig = {}
    for arg in fn.arg_names:
        if arg in constexprs:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = _POINTER_TYPES.get(arg, "*fp32")
        else:
            sig[arg] = "fp32" if arg in _FLOAT_ARGS else "i32"
    return sig


def compile_offline(name: str, constexprs: dict, num_warps: int, num_stages: int, cap: int):
    """Kernel ``name`` compiled for compute capability ``cap`` without launching it (no GPU of that kind needed:
    Triton's ``triton.compile`` with its bundled ptxas). Raises what the compiler raises."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = kernel_signature(name, constexprs)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*") or "stride" in k}
    return triton.compile(
        ASTSource(fn=kernel_for(name, False), signature=sig, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", cap, 32),
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )


def is_trap_only(compiled) -> bool:
    """Where Triton gives up on a layout (e.g. more tensor-memory columns than SM100's 512) it emits a kernel that
    only traps: it compiles, and fails at launch."""
    ptx = compiled.asm.get("ptx", "")
    return "trap;" in ptx and sum(1 for line in ptx.splitlines() if line.strip().endswith(";")) < 50


def cubin_resources(asm: dict) -> tuple[int | None, int | None]:
    """(registers per thread, local-memory bytes per thread) of a compiled kernel's cubin, read with the
    ``cuobjdump`` Triton ships beside its ptxas; (None, None) where it is missing or cannot read the cubin. The local
    memory is the stack frame plus any ``.local`` data (``STACK`` + ``LOCAL``): what the driver reports as the
    kernel's local size. Triton kernels declare no local arrays and call no functions, so it is register spills."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = asm.get("cubin")
    if not tool.is_file() or not cubin:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    regs = re.search(r"REG:(\d+)", out)
    local = [int(n) for n in re.findall(r"(?:STACK|LOCAL):(\d+)", out)]
    return (int(regs.group(1)) if regs else None), (sum(local) if local else None)


@dataclass(frozen=True)
class SplitResources:
    """What the compiler gave one launch shape on one architecture: shared memory per block, registers per thread
    and spilled (local-memory) bytes per thread (None when they cannot be read), and whether the kernel only
    traps."""

    shared: int
    regs: int | None
    trap_only: bool
    spills: int | None = None


@functools.cache
def split_resources(cfg: MLADecodeConfig, cap: int) -> SplitResources:
    """:class:`SplitResources` of the split kernel (work-list launch) with ``cfg`` compiled for ``cap`` (registers
    and spills from the cubin; on the GPU of that capability, from loading the binary where cuobjdump is
    missing)."""
    compiled = compile_offline("split", split_constexprs(cfg), cfg.num_warps, cfg.num_stages, cap)
    regs, spills = cubin_resources(compiled.asm)
    if regs is None and torch.cuda.is_available() and torch.cuda.get_device_capability() == divmod(cap, 10):
        compiled._init_handles()
        regs, spills = int(compiled.n_regs), int(compiled.n_spills) * 4
    return SplitResources(int(compiled.metadata.shared), regs, is_trap_only(compiled), spills)


def _device_limits(device: torch.device) -> tuple[int, int]:
    props = torch.cuda.get_device_properties(device)
    return props.major * 10 + props.minor, int(props.shared_memory_per_block_optin)


def fallback_config(heads: int, cap: int, shared_limit: int) -> MLADecodeConfig:
    """The first of :data:`FALLBACK_SHAPES` for ``heads`` that compiles for ``cap`` within ``shared_limit`` bytes of
    shared memory per block, is not trap-only and does not spill registers (where the spills can be read); the
    last one if none is."""
    shapes = fallback_shapes(heads)
    for cfg in shapes:
        try:
            res = split_resources(cfg, cap)
        except Exception:  # noqa: BLE001 - a shape the compiler refuses is skipped
            continue
        if res.shared <= shared_limit and not res.trap_only and not res.spills:
            return cfg
    return shapes[-1]


def default_config(heads: int, dc: int, device: torch.device, max_len: int | None = None) -> MLADecodeConfig:
    """The launch shape: the tuned one for this GPU, head count and context if the table has it; else the first of
    :data:`FALLBACK_SHAPES` that fits this device (:func:`fallback_config`: shared memory within the device's real
    per-block limit, not a trap-only kernel). In the interpreter, large tiles (its cost is per program and per
    operation, not per element)."""
    if device.type == "cpu":
        block_h = min(max(16, triton.next_power_of_2(heads)), 64)
        return MLADecodeConfig(
            block_h=block_h,
            block_n=64,
            num_warps=1,
            num_stages=1,
            combine_block_d=dc,
            combine_block_s=16,
            combine_warps=1,
        )
    entry = _entry_for(heads, max_len, device)
    if entry is not None:
        return MLADecodeConfig(**{k: v for k, v in entry["config"].items() if not k.startswith("combine_")})
    if device.type != "cuda":  # e.g. "meta": the first preference, unfiltered
        return fallback_shapes(heads)[0]
    return fallback_config(heads, *_device_limits(device))


def blocks_per_sm(cfg: MLADecodeConfig, device: torch.device) -> int:
    """Split-kernel programs with ``cfg`` one multiprocessor of ``device`` holds at once: the least of what its
    shared memory (per SM, 1 KB reserved per block), registers and thread slots allow, from the compiled kernel."""
    props = torch.cuda.get_device_properties(device)
    res = split_resources(cfg, props.major * 10 + props.minor)
    threads = 32 * cfg.num_warps
    by_smem = int(props.shared_memory_per_multiprocessor) // (res.shared + 1024)
    by_threads = int(props.max_threads_per_multi_processor) // threads
    by_regs = int(props.regs_per_multiprocessor) // (-(-res.regs // 8) * 8 * threads) if res.regs else by_threads
    return max(1, min(by_smem, by_regs, by_threads))


def programs_wanted(heads: int, max_len: int, device: torch.device, config: MLADecodeConfig | None = None) -> int:
    """Split-kernel programs to launch at once on ``device``: the tuned count (the tuned batch-1 run's splits x head
    blocks) where the table has one, else one full wave at the compiled kernel's occupancy (:func:`blocks_per_sm`
    x multiprocessors)."""
    entry = _entry_for(heads, max_len, device)
    if entry is not None and entry.get("splits"):
        return entry["splits"] * triton.cdiv(entry["heads"], entry["config"]["block_h"])
    cfg = config or default_config(heads, 512, device, max_len)
    return blocks_per_sm(cfg, device) * sm_count(device)


def default_num_splits(
    batch: int, heads: int, max_len: int, device: torch.device, config: MLADecodeConfig | None = None
) -> int:
    """Splits per request of the uniform launch (no plan): :func:`programs_wanted` shared among the batch, never
    more splits than ``block_n`` tiles. On CPU: at most 3 splits (enough to exercise the combine)."""
    if max_len <= 0:
        return 1
    if device.type == "cpu":
        return max(1, min(3, triton.cdiv(max_len, 64)))
    cfg = config or default_config(heads, 512, device, max_len)
    want = triton.cdiv(programs_wanted(heads, max_len, device, cfg), batch * triton.cdiv(heads, cfg.block_h))
    return max(1, min(want, triton.cdiv(max_len, cfg.block_n)))

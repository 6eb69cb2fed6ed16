"""Our fused kernel compiled for a GPU we do not have: Triton's offline compile for sm_90, sm_100 and sm_120 (no GPU
needed, Triton's bundled ptxas), with the launch shape the launcher picks on a GPU missing from the tuned table,
and its shared memory, registers and spills against each architecture's limits.

Run with ``python -m kvwall.tuning.arch_check``; chapter 6 calls :func:`check_architectures`. What a compile cannot
say is left out and said so: the tensor-memory columns of SM100's tcgen05 MMAs are not in Triton's metadata.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kvwall.kernels.gather.cuda import nvcc_compile_check
from kvwall.kernels.gather.kernel import DEFAULT_CONFIGS, _kernel as _gather_kernel, chunk_width
from kvwall.kernels.mla_decode.kernel import CONVERSIONS, MLADecodeConfig, _kernel, default_config
from kvwall.measure.failures import error_text
from kvwall.model.geometry import GLM5

__all__ = ["ARCHS", "ArchLimits", "KernelBuild", "fallback_config", "compile_split", "compile_gather", "cuda_twin_builds",
           "check_architectures", "main"]


@dataclass(frozen=True)
class ArchLimits:
    """Per-block shared memory a kernel may use (the opt-in maximum), registers per SM, SMs of the GPU named."""

    cap: int
    name: str
    shared_per_block: int
    regs_per_sm: int = 65_536


ARCHS = (ArchLimits(90, "sm_90: H100, H200", 232_448), ArchLimits(100, "sm_100: B200", 232_448),
         ArchLimits(120, "sm_120: RTX PRO 6000, 5090", 101_376))

_POINTER_TYPES = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "out_ptr": "*bf16", "ckv_ptr": "*fp8e4nv",
                  "kpe_ptr": "*fp8e4nv", "indptr_ptr": "*i32", "indices_ptr": "*i32", "kvlen_ptr": "*i32",
                  "pool_ptr": "*fp8e4nv", "kv_indices_ptr": "*i32", "indptr_end_ptr": "*i32"}
_FLOAT_SCALARS = ("ckv_scale_val", "kpe_scale_val", "qk_scale", "scale_value")


def fallback_config(heads: int) -> MLADecodeConfig:
    """The launch shape ``mla_decode_fp8`` picks on a GPU missing from the tuned table (the launcher's own rule,
    asked on a device with no tuned entry)."""
    return default_config(heads, GLM5.kv_lora_rank, torch.device("meta"))


def _signature(fn: Any, constexprs: dict[str, Any]) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = _POINTER_TYPES.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name in _FLOAT_SCALARS else "i32"
    return sig


@dataclass(frozen=True)
class KernelBuild:
    """One compile: the shape, the architecture, and what the compiler reports (or why it failed). ``spills``:
    local-memory bytes per thread (register spills; they slow a kernel, they do not stop it). ``fits``: it would
    launch (shared memory within the limit, not a trap-only kernel)."""

    kernel: str
    heads: int
    shape: str
    arch: str
    cap: int
    shared_bytes: int | None
    shared_limit: int
    regs: int | None
    spills: int | None
    threads: int
    blocks_per_sm_by_regs: int | None
    fits: bool
    trap_only: bool = False
    error: str | None = None


def _compile(kernel: str, fn: Any, const: dict[str, Any], num_warps: int, num_stages: int, shape: str, heads: int,
             limits: ArchLimits) -> KernelBuild:
    """Compile ``fn`` for ``limits.cap`` offline and hold its report against the limits; never raises."""
    sig = _signature(fn, const)
    attrs = {(i,): [["tt.divisibility", 16]] for i, k in enumerate(sig) if sig[k].startswith("*") or "stride" in k}
    threads = 32 * num_warps
    base = dict(kernel=kernel, heads=heads, shape=shape, arch=limits.name, cap=limits.cap,
                shared_limit=limits.shared_per_block, threads=threads)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    try:
        compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                                  target=GPUTarget("cuda", limits.cap, 32),
                                  options=dict(num_warps=num_warps, num_stages=num_stages))
    except Exception as exc:  # noqa: BLE001 - a shape an architecture cannot compile is a finding
        return KernelBuild(**base, shared_bytes=None, regs=None, spills=None, blocks_per_sm_by_regs=None, fits=False,
                           error=error_text(exc, 300))
    regs, spills = _regs_from_asm(compiled.asm)  # Triton's n_regs is filled only when a GPU loads the binary
    shared = int(compiled.metadata.shared)
    # Where the compiler gives up on a layout (e.g. more tensor-memory columns than SM100's 512) it emits a kernel
    # that only traps: it compiles, and fails at launch.
    ptx = compiled.asm.get("ptx", "")
    trap_only = "trap;" in ptx and sum(1 for line in ptx.splitlines() if line.strip().endswith(";")) < 50
    return KernelBuild(**base, shared_bytes=shared, regs=regs, spills=spills,
                       blocks_per_sm_by_regs=(limits.regs_per_sm // (regs * threads)) if regs else None,
                       fits=shared <= limits.shared_per_block and not trap_only, trap_only=trap_only)


def compile_split(config: MLADecodeConfig, limits: ArchLimits, heads: int) -> KernelBuild:
    """The fused kernel's split launch with ``config``, for ``limits.cap``."""
    how, kv_mul = CONVERSIONS[config.convert]
    const = dict(DC=GLM5.kv_lora_rank, DCH=GLM5.kv_lora_rank // 4, DR=GLM5.qk_rope_head_dim, BLOCK_H=config.block_h,
                 BLOCK_N=config.block_n, PAGE=1, SCALE_FROM_PTR=False, DIRECT=False, WRITE_LSE=False, ON_GPU=True,
                 CONVERT=how, KV_MUL=kv_mul, CACHE_K=config.cache_k, CACHE_V=config.cache_v, S_FP8=config.s_fp8)
    shape = (f"{config.block_h} heads × {config.block_n} tokens, {config.num_warps} warps, {config.num_stages} "
             "stages")
    return _compile("fused split", _kernel("split", False), const, config.num_warps, config.num_stages, shape, heads,
                    limits)


def compile_gather(limits: ArchLimits) -> KernelBuild:
    """Chapter 4's gather_cast (Triton) with its default large-launch configuration, for ``limits.cap``."""
    cfg, d = DEFAULT_CONFIGS["large"], GLM5.kv_dim
    const = dict(D=d, PAGE=1, CHUNK=chunk_width(d), BLOCK=cfg.block, HAS_INDPTR=True, SCALE_MODE=0, WIDE=False,
                 POOL_WIDE=False, EVICT_LOADS=cfg.evict_loads, EVICT_STORES=cfg.evict_stores, LOAD_VEC=cfg.load_vec)
    shape = f"{cfg.block} × {chunk_width(d)}-value chunks, {cfg.num_warps} warps"
    return _compile("gather_cast (Triton)", _gather_kernel("gather_cast", False), const, cfg.num_warps, 1, shape, 0,
                    limits)


def cuda_twin_builds() -> list[dict[str, Any]]:
    """Chapter 4's CUDA C++ twin compiled by nvcc for each architecture (registers per instantiation, spills)."""
    rows = []
    for limits in ARCHS:
        try:
            rep = nvcc_compile_check(f"sm_{limits.cap}")
            regs = max(rep.registers.values()) if rep.registers else None
            spilled = max((int(n) for n in re.findall(r"(\d+) bytes spill stores", rep.log)), default=0)
            rows.append(dict(kernel="gather_cast (CUDA C++)", heads=0, shape="every vector width (most registers)",
                             arch=limits.name, cap=limits.cap, shared_bytes=0, shared_limit=limits.shared_per_block,
                             regs=regs, spills=spilled, threads=0, blocks_per_sm_by_regs=None, fits=rep.ok,
                             trap_only=False, error=None if rep.ok else rep.log[-300:]))
        except FileNotFoundError as exc:
            rows.append(dict(kernel="gather_cast (CUDA C++)", heads=0, shape="", arch=limits.name, cap=limits.cap,
                             shared_bytes=None, shared_limit=limits.shared_per_block, regs=None, spills=None,
                             threads=0, blocks_per_sm_by_regs=None, fits=False, trap_only=False, error=str(exc)))
    return rows


def _regs_from_asm(asm: dict[str, Any]) -> tuple[int | None, int | None]:
    """(registers per thread, local-memory bytes per thread: spills) of the compiled cubin, read with the
    ``cuobjdump`` Triton ships beside its ptxas; (None, None) where it is missing or cannot read the cubin."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    cubin = asm.get("cubin")
    if not tool.is_file() or not cubin:
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    regs, local = re.search(r"REG:(\d+)", out), re.search(r"LOCAL:(\d+)", out)
    return (int(regs.group(1)) if regs else None), (int(local.group(1)) if local else None)


def check_architectures(heads: tuple[int, ...] = (16, 32, 64, 128), *, cast_kernels: bool = False
                        ) -> list[dict[str, Any]]:
    """Every head count's fallback launch shape of the fused kernel, compiled for every architecture of
    :data:`ARCHS`; with ``cast_kernels``, chapter 4's Triton gather_cast and (where nvcc is) its CUDA twin too."""
    rows = []
    for h in heads:
        cfg = fallback_config(h)
        for limits in ARCHS:
            rows.append(dataclasses.asdict(compile_split(cfg, limits, h)))
    if cast_kernels:
        rows += [dataclasses.asdict(compile_gather(limits)) for limits in ARCHS]
        rows += cuda_twin_builds()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 32, 64, 128])
    args = parser.parse_args(argv)
    print(f"triton {triton.__version__}")
    for r in check_architectures(tuple(args.heads), cast_kernels=True):
        print(f"{r['kernel']:<22} {r['arch']:<34} {r['heads']:>4} heads  {r['shape']:<60} shared {r['shared_bytes']} / "
              f"{r['shared_limit']} B  regs {r['regs']}  spills {r['spills']} B  {'fits' if r['fits'] else 'DOES NOT FIT'}"
              + ("  (trap-only kernel)" if r["trap_only"] else "")
              + (f"  ({r['error']})" if r["error"] else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

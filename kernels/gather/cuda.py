"""The CUDA C++ twin of :func:`kvwall.kernels.gather.kernel.gather_cast`: build, compile-check, launch.

``gather_cast.cu`` includes only CUDA headers and exports a C launcher. On a GPU machine
:func:`load_gather_cast_cuda` builds it with ``torch.utils.cpp_extension.load`` (cached in torch's
extension folder) and calls it through ``ctypes`` on the current stream, so it can be captured in a
CUDA graph like the Triton kernel. On a machine without a GPU, :func:`nvcc_compile_check` compiles
it with ``nvcc`` for a given architecture and reports the compiler's resource usage.

Arguments, validation and semantics are those of the Triton kernel (:func:`plan_gather` is shared),
the unchecked-call contract included. Pool and output offsets are 64-bit in the kernel (so row-strided
pool views of any size are fine); the chunk counter is 32-bit, so a launch is limited to under 2^31
output values (refused, naming the limit, before the launch).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvwall.kernels._common import sm_count
from kvwall.kernels.gather.kernel import GatherPlan, check_same_layout, plan_gather

__all__ = [
    "gather_cast_cuda",
    "load_gather_cast_cuda",
    "launch_gather_cuda",
    "nvcc_compile_check",
    "NvccReport",
    "CUDA_SOURCE",
]

CUDA_SOURCE = Path(__file__).with_name("gather_cast.cu")
_NVCC_FLAGS = ["-O3", "-std=c++17"]


@functools.cache
def load_gather_cast_cuda(verbose: bool = False) -> ctypes.CDLL:
    """Build (once per source version) and load the CUDA twin; needs CUDA, nvcc and a GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "gather_cast_cuda needs an NVIDIA GPU; on this machine use gather_cast (Triton, which "
            "runs on CPU in the interpreter) or nvcc_compile_check() to compile-check the source."
        )
    from torch.utils.cpp_extension import load

    major, minor = torch.cuda.get_device_capability()
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", f"{major}.{minor}")
    name = "kvwall_gather_cast_" + _source_hash()
    path = load(
        name=name, sources=[str(CUDA_SOURCE)], extra_cuda_cflags=_NVCC_FLAGS, is_python_module=False, verbose=verbose
    )
    lib = ctypes.CDLL(path)
    lib.kvwall_gather_cast.restype = ctypes.c_int
    lib.kvwall_gather_cast.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_float,
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_void_p,
    ]
    lib.kvwall_cuda_error_string.restype = ctypes.c_char_p
    lib.kvwall_cuda_error_string.argtypes = [ctypes.c_int]
    return lib


def _source_hash() -> str:
    return hashlib.sha256(CUDA_SOURCE.read_bytes()).hexdigest()[:10]


def launch_gather_cuda(plan: GatherPlan, *, pool: torch.Tensor | None = None) -> torch.Tensor:
    """Launch the CUDA twin for a validated plan; ``pool``: another pool of exactly the planned layout."""
    if pool is None:
        pool = plan.pool
    elif pool is not plan.pool:
        check_same_layout(plan, pool)
    if pool.device.type != "cuda":
        raise RuntimeError(f"gather_cast_cuda: tensors are on {pool.device}; the CUDA twin needs them on a GPU.")
    lib = load_gather_cast_cuda()
    rows = plan.capacity * plan.page_size
    if rows * plan.dim >= 1 << 31:
        raise ValueError(
            f"gather_cast_cuda: capacity {plan.capacity} x page {plan.page_size} x D {plan.dim} is over "
            "2^31 values; split the call (the Triton kernel has no such limit)."
        )
    if rows == 0:
        return plan.out
    stream = torch.cuda.current_stream(pool.device).cuda_stream
    code = lib.kvwall_gather_cast(
        pool.data_ptr(),
        plan.kv_indices.data_ptr(),
        int(plan.kv_indices.dtype == torch.int64),
        plan.out.data_ptr(),
        plan.indptr_end.data_ptr() if plan.indptr_end is not None else None,
        int(plan.indptr_end is not None and plan.indptr_end.dtype == torch.int64),
        plan.scale_tensor.data_ptr() if plan.scale_tensor is not None else None,
        plan.scale_value if plan.scale_value is not None else 1.0,
        plan.scale_mode,
        plan.capacity * plan.page_size,
        pool.shape[0],
        pool.stride(0),
        plan.out.stride(0),
        plan.page_size,
        plan.dim,
        sm_count(pool.device) * 16,
        stream,
    )
    if code != 0:
        raise RuntimeError(
            f"gather_cast_cuda: launch failed: {lib.kvwall_cuda_error_string(code).decode()} (code {code})."
        )
    return plan.out


def gather_cast_cuda(
    pool: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    scale: float | torch.Tensor | None = None,
    check_range: bool = True,
) -> torch.Tensor:
    """Same contract as :func:`kvwall.kernels.gather.kernel.gather_cast`, run by the CUDA C++ kernel."""
    return launch_gather_cuda(plan_gather(pool, kv_indices, kv_indptr, out=out, scale=scale, check_range=check_range))


@dataclass
class NvccReport:
    ok: bool
    arch: str
    seconds: float
    nvcc: str  # version line
    registers: dict[str, int]  # kernel instantiation (VEC) -> registers per thread
    spills: bool
    log: str

    def summary(self) -> str:
        regs = ", ".join(f"VEC={k}: {v}" for k, v in sorted(self.registers.items(), key=lambda kv: int(kv[0])))
        return (
            f"nvcc {'compiled' if self.ok else 'FAILED on'} gather_cast.cu for {self.arch} in {self.seconds:.1f} s"
            f" ({self.nvcc}); registers per thread {regs or 'n/a'}; {'spills!' if self.spills else 'no spills'}."
        )


def nvcc_compile_check(arch: str = "sm_90", nvcc: str | None = None) -> NvccReport:
    """Compile ``gather_cast.cu`` to an object file with ``nvcc`` (no GPU needed); ptxas reports resources."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH: install the CUDA toolkit to compile-check gather_cast.cu.")
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                nvcc,
                *_NVCC_FLAGS,
                f"-arch={arch}",
                "-Xptxas",
                "-v",
                "-c",
                str(CUDA_SOURCE),
                "-o",
                str(Path(tmp) / "gather_cast.o"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    registers: dict[str, int] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '\S*gather_cast_kernelILi(\d+)E", line)
        if m:
            current = m.group(1)
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            registers[current] = int(m.group(1))
    spills = bool(re.search(r"[1-9]\d* bytes spill", log))
    return NvccReport(proc.returncode == 0, arch, seconds, version, registers, spills, log)

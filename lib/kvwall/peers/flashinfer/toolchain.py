"""The CUDA toolchain FlashInfer's JIT builds with: which nvcc, and its version.

No GPU is needed to compile: nvcc alone builds FlashInfer's kernels for any target arch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, Optional

from kvwall.peers.flashinfer.errors import NvccNotFoundError

__all__ = ["find_nvcc", "require_nvcc", "nvcc_version"]


def find_nvcc() -> Optional[Path]:
    """The nvcc FlashInfer's JIT would use: ``$CUDA_HOME/bin/nvcc`` (or ``$CUDA_PATH``), else the
    one on ``PATH``.  ``None`` if there is none."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            p = Path(home) / "bin" / "nvcc"
            return p if p.exists() else None
    w = shutil.which("nvcc")
    return Path(w) if w else None


def require_nvcc() -> Path:
    """The nvcc :func:`find_nvcc` finds, or :class:`NvccNotFoundError` saying how to get one."""
    nvcc = find_nvcc()
    if nvcc is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        where = (
            f"CUDA_HOME/CUDA_PATH is set to {home!r} but {home}/bin/nvcc does not exist"
            if home
            else "nvcc is not on PATH and neither CUDA_HOME nor CUDA_PATH is set"
        )
        raise NvccNotFoundError(
            f"No CUDA compiler: {where}. FlashInfer builds its MLA kernel just in time with nvcc "
            f"(CUDA 12.8 or newer for sm_120a), no GPU needed. Install the CUDA toolkit (or the "
            f"'cuda-nvcc' package) and put its bin/ on PATH, or set CUDA_HOME to its root. "
            f"Results already in the cache can be read without nvcc: cached_result(...)."
        )
    return nvcc


_NVCC_VERSION_CACHE: Dict[str, str] = {}


def nvcc_version(nvcc: Optional[Path] = None) -> str:
    """``"13.0.88"``-style version of ``nvcc`` (the one :func:`find_nvcc` finds by default)."""
    nvcc = nvcc or require_nvcc()
    key = str(nvcc)
    if key not in _NVCC_VERSION_CACHE:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release [\d.]+, V([\d.]+)", out) or re.search(r"release ([\d.]+)", out)
        _NVCC_VERSION_CACHE[key] = m.group(1) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"
    return _NVCC_VERSION_CACHE[key]

"""``compute-sanitizer --tool memcheck`` over a Python module, as one recorded row.

The module (``python -m kvwall.kernels.gather.sanitize``, ``python -m kvwall.kernels.mla_decode.sanitize``) runs
small cases that reach every edge of a kernel and exits non-zero on a wrong result; memcheck flags every
out-of-bounds or misaligned access. PyTorch's caching allocator is switched off
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``) so every tensor is its own allocation and memcheck sees exact bounds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from typing import Any, Sequence

__all__ = ["memcheck_row"]


def _text(stream: str | bytes | None) -> str:
    if isinstance(stream, bytes):
        return stream.decode(errors="replace")
    return stream or ""


def memcheck_row(module: str, timeout_s: int, args: Sequence[str] = ()) -> dict[str, Any]:
    """One ``sanitizer`` row: whether memcheck ran, its return code and seconds, its ``ERROR SUMMARY`` line, the
    command, the output's last 40 lines, and ``passed`` (exit 0 and 0 errors; None when it could not run)."""
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        return {
            "section": "sanitizer",
            "tool": "memcheck",
            "ran": False,
            "returncode": None,
            "summary": "compute-sanitizer not found on PATH",
            "output_tail": "",
            "passed": None,
        }
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    cmd = [tool, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-m", module, *args]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output, code = _text(exc.stdout) + _text(exc.stderr), None
    summaries = re.findall(r"ERROR SUMMARY: .*", output)
    summary = summaries[-1] if summaries else "(no summary line)"
    return {
        "section": "sanitizer",
        "tool": "memcheck",
        "ran": True,
        "returncode": code,
        "seconds": round(time.time() - t0, 1),
        "summary": summary,
        "command": " ".join(["compute-sanitizer", *cmd[1:5], "python3", "-m", module, *args]),
        "output_tail": "\n".join(output.strip().splitlines()[-40:]),
        "passed": code == 0 and summary.startswith("ERROR SUMMARY: 0 errors"),
    }

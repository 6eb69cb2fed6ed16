"""Build one of the importable FlashInfer's JIT modules for a target arch, on the CPU, with nvcc.

Chapter 3 asks FlashInfer's own kernel generators for the modules an MLA door would need on SM120
(XQA MLA, the SM120 sparse MLA). :func:`build_generator` runs the generator in a subprocess
(``python -m`` :mod:`kvwall.peers.flashinfer.jit_driver`, task ``"generator"``), then compiles its
ninja file to object files with the generator's own nvcc flags: no link, no GPU. Without nvcc
only the generator's own checks run.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from kvwall.peers.flashinfer.jit_driver import run_jit_driver
from kvwall.peers.flashinfer.nvcc_errors import parse_nvcc_output, path_roots
from kvwall.peers.flashinfer.toolchain import find_nvcc, nvcc_version

__all__ = ["GeneratorBuild", "build_generator"]


@dataclass(frozen=True)
class GeneratorBuild:
    """One call of a FlashInfer JIT generator: ``module.generator(*args)`` for FlashInfer arch
    ``arch`` (``"12.0a"``). An argument naming a torch dtype (``"float8_e4m3fn"``) is that dtype."""

    module: str  # e.g. "flashinfer.jit.xqa"
    generator: str  # e.g. "gen_xqa_module_mla"
    args: tuple[Any, ...]
    arch: str
    about: str  # what the build shows, for the chapter


def build_generator(build: GeneratorBuild, *, timeout_s: float = 400, jobs: Optional[int] = None) -> dict[str, Any]:
    """Run ``build`` with the importable FlashInfer: its generator, its own ninja file and nvcc
    flags, object files only. ``status``: ``generator_refused`` (the generator raised before any
    compiler ran: type, message, file:line), ``compiled`` / ``nvcc_failed`` (with the compiler
    errors parsed, the object files built and failed), ``no_nvcc`` (no CUDA compiler here; the
    generator accepted the configuration), ``timeout`` or ``driver_error``."""
    nvcc = find_nvcc()
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    row: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix=f"kvwall-generator-{build.generator}-") as tmp:
        env = dict(
            os.environ,
            FLASHINFER_CUDA_ARCH_LIST=build.arch,
            TORCH_CUDA_ARCH_LIST=build.arch,
            FLASHINFER_WORKSPACE_BASE=tmp,
            CUDA_VISIBLE_DEVICES="",
            PYTHONWARNINGS="ignore",
            PATH=os.pathsep.join(
                ([str(nvcc.parent)] if nvcc else []) + [str(Path(sys.executable).parent), os.environ.get("PATH", "")]
            ),
        )
        request = {
            "task": "generator",
            "module": build.module,
            "generator": build.generator,
            "args": list(build.args),
            "compile": nvcc is not None,
            "ninja": ninja,
            "jobs": jobs or os.cpu_count() or 2,
            "timeout_s": timeout_s,
        }
        t0 = time.perf_counter()
        run = run_jit_driver(
            request,
            env=env,
            cwd=Path(tmp),
            timeout_s=timeout_s + 120,
            description=f"building {build.generator} for {build.arch}",
        )
        d = (
            run.report
            if run.report is not None
            else {"status": "timeout" if run.timed_out else "driver_error", "message": "no result"}
        )
        row["seconds"] = round(time.perf_counter() - t0, 1)
    if d.get("status") == "generator_accepted":
        d = {"status": "no_nvcc", "message": "the generator accepted the configuration; no nvcc here to compile it"}
    row["nvcc"] = nvcc_version(nvcc) if nvcc else None
    row["status"] = d.get("status")
    for k in ("exc_type", "message", "where", "compile_seconds", "objects", "returncode", "built", "failed"):
        if k in d:
            row[k] = d[k]
    if d.get("status") in ("compiled", "nvcc_failed"):
        errors = parse_nvcc_output(
            d.get("output", ""), path_roots({"include_dir": d.get("include_dir"), "csrc_dir": d.get("csrc_dir")})
        )
        row["errors"] = [{"file": e.file, "line": e.line, "message": e.message} for e in errors][:20]
        row["sources"] = [re.sub(r".*/flashinfer/data/", "", s) for s in d.get("sources", [])]
    return row

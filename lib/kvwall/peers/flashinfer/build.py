"""Drive a FlashInfer release's own JIT build of its MLA kernel, on the CPU, and say what happened.

The book's wall lives in the *compiler*: FlashInfer's MLA paged-attention kernel (the one SGLang's
``flashinfer_mla`` backend calls) would not compile for an FP8 KV cache before 0.6.18.post1.
:func:`build_mla` lets a chapter reproduce that on any machine that has ``nvcc``, without a GPU:
in a subprocess with the release first on ``sys.path``
(``python -m`` :mod:`kvwall.peers.flashinfer.jit_driver`), the release's own Python-level checks
of ``BatchMLAPagedAttentionWrapper.plan`` run with the device capability of the requested arch,
then its own JIT module generator (``gen_batch_mla_module``) for head dims ckv 512 / kpe 64, and
the generated sources are compiled to object files with the release's own ninja file and nvcc
flags. No link, no GPU. The :class:`BuildResult` says ``"compiled"``, ``"python_refused"`` or
``"nvcc_failed"``, with the compiler errors parsed (:mod:`kvwall.peers.flashinfer.nvcc_errors`).
Results are cached per (release, config) as JSON; a second call returns at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvwall.peers.flashinfer.errors import BuildTimeoutError, InvalidConfigError, ReleaseImportError
from kvwall.peers.flashinfer.jit_driver import run_jit_driver
from kvwall.peers.flashinfer.nvcc_errors import (
    CompilerError,
    InstantiationFrame,
    clean_compiler_output,
    parse_nvcc_output,
    path_roots,
    shorten_path,
)
from kvwall.peers.flashinfer.releases import CacheRoot, cache_root_path, install_release, validate_release
from kvwall.peers.flashinfer.toolchain import find_nvcc, nvcc_version, require_nvcc

__all__ = [
    "BACKENDS",
    "Q_DTYPES",
    "KV_DTYPES",
    "ARCH_TO_FLASHINFER",
    "ARCHS",
    "HEAD_DIM_CKV",
    "HEAD_DIM_KPE",
    "STATUSES",
    "BuildConfig",
    "PythonRefusal",
    "BuildResult",
    "validate_config",
    "arch_capability",
    "cached_result",
    "build_mla",
]

#: FlashInfer's two in-wrapper MLA backends: ``fa2`` (portable, mma.sync) and ``fa3`` (SM90 wgmma).
BACKENDS: Tuple[str, ...] = ("fa2", "fa3")
#: Query / output dtypes (torch attribute names).
Q_DTYPES: Tuple[str, ...] = ("bfloat16", "float16")
#: KV-cache dtypes (torch attribute names).
KV_DTYPES: Tuple[str, ...] = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
#: Target architectures -> the value FlashInfer's ``FLASHINFER_CUDA_ARCH_LIST`` takes.
ARCH_TO_FLASHINFER: Dict[str, str] = {
    "sm_80": "8.0",
    "sm_86": "8.6",
    "sm_89": "8.9",
    "sm_90a": "9.0a",
    "sm_100a": "10.0a",
    "sm_100f": "10.0f",
    "sm_103a": "10.3a",
    "sm_110a": "11.0a",
    "sm_120a": "12.0a",
    "sm_120f": "12.0f",
    "sm_121a": "12.1a",
}
ARCHS: Tuple[str, ...] = tuple(ARCH_TO_FLASHINFER)
#: MLA head dims of DeepSeek-V2/V3 and GLM-5: compressed KV 512, rope part 64.
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
STATUSES: Tuple[str, ...] = ("compiled", "python_refused", "nvcc_failed")

_RESULT_SCHEMA = 1


@dataclass(frozen=True)
class BuildConfig:
    """One MLA paged-attention kernel configuration (head dims fixed at ckv 512 / kpe 64)."""

    backend: str = "fa2"
    q_dtype: str = "bfloat16"
    kv_dtype: str = "float8_e4m3fn"
    arch: str = "sm_120a"
    head_dim_ckv: int = HEAD_DIM_CKV
    head_dim_kpe: int = HEAD_DIM_KPE

    @property
    def key(self) -> str:
        """File-name-safe identity of this config, e.g. ``fa2-bfloat16-float8_e4m3fn-sm_120a-512-64``."""
        return f"{self.backend}-{self.q_dtype}-{self.kv_dtype}-{self.arch}-{self.head_dim_ckv}-{self.head_dim_kpe}"

    def describe(self) -> str:
        return (
            f"MLA {self.backend}, Q {self.q_dtype}, KV {self.kv_dtype}, {self.arch}, "
            f"ckv {self.head_dim_ckv} / kpe {self.head_dim_kpe}"
        )


@dataclass(frozen=True)
class PythonRefusal:
    """The release's Python code refused the config before any compiler ran."""

    exc_type: str  # e.g. "ValueError"
    message: str
    where: str = ""  # "flashinfer/mla/_core.py:2203" (the raise), relative to the release
    phase: str = ""  # "plan checks" or "module generator"


@dataclass(frozen=True)
class BuildResult:
    """What one FlashInfer release's JIT build of one MLA config did."""

    release: str
    config: BuildConfig
    status: str  # one of STATUSES
    duration_s: float  # wall time of the build (of the original build when from_cache)
    errors: Tuple[CompilerError, ...] = ()
    refusal: Optional[PythonRefusal] = None
    nvcc_version: str = ""
    flashinfer_arch_list: str = ""  # the FLASHINFER_CUDA_ARCH_LIST value the build ran with
    translation_units: Tuple[str, ...] = ()  # the .cu files compiled
    compiler_output: str = ""  # nvcc/ninja output, paths shortened, command lines elided
    python_checks: str = ""  # "ran", "skipped: <why>"
    created: str = ""  # ISO time of the build
    from_cache: bool = False

    @property
    def ok(self) -> bool:
        return self.status == "compiled"

    def unique_errors(self) -> List[CompilerError]:
        """Errors with the same (file, line, message) folded together (first kept)."""
        seen, out = set(), []
        for e in self.errors:
            k = (e.file, e.line, e.message)
            if k not in seen:
                seen.add(k)
                out.append(e)
        return out

    def summary(self) -> str:
        head = f"flashinfer {self.release}, {self.config.describe()}: {self.status} ({self.duration_s:.1f} s)"
        if self.status == "python_refused" and self.refusal is not None:
            return f"{head}\n  {self.refusal.exc_type}: {self.refusal.message}"
        if self.status == "nvcc_failed":
            lines = [head]
            for e in self.unique_errors():
                lines.append(f"  {e}")
                for fr in e.instantiation_chain:
                    lines.append(f"      from {fr}")
            return "\n".join(lines)
        return head

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("from_cache", None)
        d["schema"] = _RESULT_SCHEMA
        return d

    @classmethod
    def from_json(cls, d: dict, from_cache: bool = True) -> "BuildResult":
        errors = tuple(
            CompilerError(
                file=e["file"],
                line=int(e["line"]),
                message=e["message"],
                source_line=e.get("source_line", ""),
                instantiation_chain=tuple(InstantiationFrame(**fr) for fr in e.get("instantiation_chain", ())),
                translation_unit=e.get("translation_unit", ""),
            )
            for e in d.get("errors", ())
        )
        refusal = PythonRefusal(**d["refusal"]) if d.get("refusal") else None
        return cls(
            release=d["release"],
            config=BuildConfig(**d["config"]),
            status=d["status"],
            duration_s=float(d["duration_s"]),
            errors=errors,
            refusal=refusal,
            nvcc_version=d.get("nvcc_version", ""),
            flashinfer_arch_list=d.get("flashinfer_arch_list", ""),
            translation_units=tuple(d.get("translation_units", ())),
            compiler_output=d.get("compiler_output", ""),
            python_checks=d.get("python_checks", ""),
            created=d.get("created", ""),
            from_cache=from_cache,
        )


def _check_choice(what: str, value, allowed: Sequence[str], hint: str = "") -> str:
    if value not in allowed:
        raise InvalidConfigError(
            f"Unknown {what} {value!r}. Allowed values: {', '.join(allowed)}.{(' ' + hint) if hint else ''}"
        )
    return value


def validate_config(
    backend: str = "fa2", q_dtype: str = "bfloat16", kv_dtype: str = "float8_e4m3fn", arch: str = "sm_120a"
) -> BuildConfig:
    """Return the :class:`BuildConfig` for these strings, or raise :class:`InvalidConfigError`
    naming the allowed values.  Dtypes are torch attribute names (``"float8_e4m3fn"``); a
    ``torch.dtype`` or ``"torch.bfloat16"`` is accepted too."""

    def dt(x):
        s = str(x)
        return s[len("torch.") :] if s.startswith("torch.") else s

    _check_choice("backend", backend, BACKENDS)
    _check_choice("Q dtype", dt(q_dtype), Q_DTYPES, "(the query and output are 16-bit in FlashInfer's MLA.)")
    _check_choice("KV dtype", dt(kv_dtype), KV_DTYPES)
    _check_choice(
        "arch",
        arch,
        ARCHS,
        "Write it as nvcc's sm_XY[a|f] name, e.g. 'sm_120a' for RTX PRO 6000 / RTX 50xx, 'sm_90a' for H100/H200.",
    )
    return BuildConfig(backend=backend, q_dtype=dt(q_dtype), kv_dtype=dt(kv_dtype), arch=arch)


def arch_capability(arch: str) -> Tuple[int, int]:
    """The compute capability an nvcc arch name targets: ``"sm_120a"`` -> ``(12, 0)``."""
    _check_choice("arch", arch, ARCHS)
    major, minor = ARCH_TO_FLASHINFER[arch].split(".")
    return int(major), int(re.match(r"\d+", minor).group(0))


def _results_dir(cache_root: CacheRoot) -> Path:
    return cache_root_path(cache_root) / "builds"


def _result_path(release: str, config: BuildConfig, cache_root: CacheRoot, python_checks: bool = True) -> Path:
    name = config.key + ("" if python_checks else "-nochecks")
    return _results_dir(cache_root) / f"flashinfer-{release}" / f"{name}.json"


def _load_result(path: Path) -> Optional[BuildResult]:
    if not path.exists():
        return None
    try:
        d = json.loads(path.read_text())
        if d.get("schema") != _RESULT_SCHEMA:
            return None
        return BuildResult.from_json(d, from_cache=True)
    except (ValueError, KeyError, TypeError):
        return None


def cached_result(
    release: str,
    backend: str = "fa2",
    q_dtype: str = "bfloat16",
    kv_dtype: str = "float8_e4m3fn",
    arch: str = "sm_120a",
    *,
    cache_root: CacheRoot = None,
    python_checks: bool = True,
) -> Optional[BuildResult]:
    """The cached :class:`BuildResult` of this (release, config), or ``None``.  Needs no nvcc."""
    release = validate_release(release)
    config = validate_config(backend, q_dtype, kv_dtype, arch)
    return _load_result(_result_path(release, config, cache_root, python_checks))


def build_mla(
    release: str,
    backend: str = "fa2",
    q_dtype: str = "bfloat16",
    kv_dtype: str = "float8_e4m3fn",
    arch: str = "sm_120a",
    *,
    cache_root: CacheRoot = None,
    rebuild: bool = False,
    python_checks: bool = True,
    timeout_s: float = 900.0,
    jobs: Optional[int] = None,
    keep_workdir: bool = False,
) -> BuildResult:
    """Run FlashInfer ``release``'s own JIT build of its MLA paged-attention kernel (ckv 512 /
    kpe 64) for one config, on the CPU, and say what happened.

    ``backend``: one of :data:`BACKENDS`; ``q_dtype``: :data:`Q_DTYPES` (the output dtype is the
    same); ``kv_dtype``: :data:`KV_DTYPES`; ``arch``: :data:`ARCHS`.  Everything is validated
    before anything is installed or built.

    ``python_checks``: first run the release's ``BatchMLAPagedAttentionWrapper.plan()`` checks with
    the device capability of ``arch`` (a release that refuses the config there gives
    ``status="python_refused"``, as it would at ``plan()`` on that GPU).  ``rebuild``: ignore the
    cached result.  A cached result built with another nvcc version is rebuilt when nvcc is here;
    without nvcc a cached result is still returned.  ``jobs``: ninja's ``-j`` (default: ninja's).

    Raises :class:`InvalidConfigError`, :class:`NvccNotFoundError`,
    :class:`NetworkUnavailableError`, :class:`ReleaseNotFoundError`, :class:`ReleaseImportError`,
    :class:`BuildTimeoutError`.
    """
    release = validate_release(release)
    config = validate_config(backend, q_dtype, kv_dtype, arch)
    if not rebuild:
        hit = _load_result(_result_path(release, config, cache_root, python_checks))
        if hit is not None:
            nvcc = find_nvcc()
            if nvcc is None or nvcc_version(nvcc) == hit.nvcc_version:
                return hit
    nvcc = require_nvcc()
    nv_version = nvcc_version(nvcc)
    rdir = install_release(release, cache_root)
    ninja = shutil.which("ninja") or (str(rdir / "bin" / "ninja") if (rdir / "bin" / "ninja").exists() else None)
    if ninja is None:
        raise ReleaseImportError(
            "No `ninja` to run FlashInfer's JIT build file with: install it (apt install ninja-build, "
            "or pip install ninja) and retry."
        )

    work = Path(
        tempfile.mkdtemp(prefix=f"build-{release}-{config.key}-", dir=_ensure(cache_root_path(cache_root) / "work"))
    )
    arch_list = ARCH_TO_FLASHINFER[config.arch]
    env = dict(os.environ)
    env.update(
        FLASHINFER_CUDA_ARCH_LIST=arch_list,
        TORCH_CUDA_ARCH_LIST=arch_list,
        FLASHINFER_WORKSPACE_BASE=str(work),
        CUDA_VISIBLE_DEVICES="",  # the target arch comes from the arch list, never from a GPU here
        PYTHONPATH=os.pathsep.join([str(rdir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        PYTHONNOUSERSITE="1",
        PYTHONWARNINGS="ignore",
        PATH=os.pathsep.join([str(nvcc.parent), str(rdir / "bin"), env.get("PATH", "")]),
    )
    request = {
        "task": "mla",
        "release_dir": str(rdir),
        "config": dataclasses.asdict(config),
        "capability": list(arch_capability(config.arch)),
        "python_checks": bool(python_checks),
        "ninja": ninja,
        "jobs": jobs,
        "timeout_s": float(timeout_s),
    }
    t0 = time.perf_counter()
    try:
        run = run_jit_driver(
            request,
            env=env,
            cwd=work,
            timeout_s=timeout_s + 120,
            description=f"building FlashInfer {release} MLA {config.backend} {config.arch}",
        )
        if run.timed_out:
            raise BuildTimeoutError(
                f"FlashInfer {release} build of {config.describe()} ran past {timeout_s + 120:.0f} s; "
                f"pass a larger timeout_s or jobs= to build_mla()."
            )
        if run.report is None:
            raise ReleaseImportError(
                f"The build driver for FlashInfer {release} exited (code {run.returncode}) without a "
                f"result.\n{run.output_tail}"
            )
        result = _interpret(release, config, run.report, time.perf_counter() - t0, nv_version, arch_list, rdir)
    finally:
        if not keep_workdir:
            shutil.rmtree(work, ignore_errors=True)
    path = _result_path(release, config, cache_root, python_checks)
    _ensure(path.parent)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result.to_json(), indent=1))
    os.replace(tmp, path)
    return result


def _ensure(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _interpret(
    release: str, config: BuildConfig, d: Dict[str, Any], duration: float, nv_version: str, arch_list: str, rdir: Path
) -> BuildResult:
    """The driver's report as a :class:`BuildResult`; a release we could not drive raises."""
    err = d.get("error")
    common = dict(
        release=release,
        config=config,
        duration_s=round(duration, 2),
        nvcc_version=nv_version,
        flashinfer_arch_list=arch_list,
        python_checks=d.get("python_checks", ""),
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    if err == "import":
        raise ReleaseImportError(
            f"FlashInfer {release} (installed at {rdir}) could not be imported or has no MLA module "
            f"generator this module knows: {d.get('exc_type')}: {d.get('message')}. If a package is "
            f"missing, it must be importable from this Python (torch is taken from here).\n"
            f"{d.get('traceback', '')}"
        )
    if err == "refused":
        return BuildResult(
            status="python_refused",
            refusal=PythonRefusal(
                exc_type=d.get("exc_type", ""), message=d.get("message", ""), where=d.get("where", ""),
                phase=d.get("phase", ""),
            ),
            **common,
        )  # fmt: skip
    if err == "timeout":
        raise BuildTimeoutError(f"FlashInfer {release} build of {config.describe()} timed out: {d.get('message')}")
    if err == "driver":
        raise ReleaseImportError(
            f"Driving FlashInfer {release}'s JIT build failed before nvcc ran: {d.get('exc_type')}: "
            f"{d.get('message')}\n{d.get('traceback', '')}"
        )
    roots = path_roots(d)
    output = d.get("output", "")
    errors = parse_nvcc_output(output, roots)
    tus = tuple(shorten_path(s, roots) for s in d.get("sources", ()))
    status = "compiled" if d.get("returncode") == 0 else "nvcc_failed"
    if status == "nvcc_failed" and not errors:
        tail = [ln for ln in output.splitlines() if ln.strip()][-1:] or ["(no output)"]
        errors = [CompilerError(file="", line=0, message=f"build failed without a parsable error: {tail[0][:500]}")]
    return BuildResult(
        status=status,
        errors=tuple(errors),
        translation_units=tus,
        compiler_output=clean_compiler_output(output, roots),
        **common,
    )

"""Install any FlashInfer release in isolation and drive its own JIT build of the MLA kernel.

The book shows a wall that lives in the *compiler*: FlashInfer's MLA paged-attention kernel (the
one SGLang's ``flashinfer_mla`` backend calls) would not compile for an FP8 KV cache before
0.6.18.post1.  This module lets a chapter reproduce that on any machine that has ``nvcc``, without
a GPU:

* :func:`install_release` installs ``flashinfer-python==X`` with ``pip install --no-deps --target``
  into its own folder of a cache (default ``~/.cache/kvwall/flashinfer``, or ``$KVWALL_CACHE``),
  plus the few packages it needs to *import* (``apache-tvm-ffi`` at the version the release
  declares, ``packaging``, ``nvidia-ml-py``, ``tqdm``, ``requests`` and its dependencies).  Torch
  comes from the calling environment.
* :func:`build_mla` runs, in a subprocess with that release first on ``sys.path``, the release's
  own Python-level checks of ``BatchMLAPagedAttentionWrapper.plan`` (with the device capability
  taken from the requested arch), then its own JIT module generator (``gen_batch_mla_module``) for
  head dims ckv 512 / kpe 64, and compiles the generated sources to object files with the release's
  own ninja file and nvcc flags for the requested arch.  No link, no GPU.  The result says
  ``"compiled"``, ``"python_refused"`` or ``"nvcc_failed"``, with the compiler errors parsed
  (file relative to FlashInfer's include dir, line, message, instantiation chain).
* Results are cached per (release, config) as JSON; a second call returns at once.
* :func:`read_source` and :func:`find_definition` show the release's own source.

Only the standard library is used here: FlashInfer and torch run in the subprocess.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "BACKENDS",
    "Q_DTYPES",
    "KV_DTYPES",
    "ARCHS",
    "HEAD_DIM_CKV",
    "HEAD_DIM_KPE",
    "STATUSES",
    "FlashInferReleaseError",
    "InvalidConfigError",
    "NvccNotFoundError",
    "NetworkUnavailableError",
    "ReleaseNotFoundError",
    "ReleaseImportError",
    "BuildTimeoutError",
    "BuildConfig",
    "InstantiationFrame",
    "CompilerError",
    "PythonRefusal",
    "BuildResult",
    "SourceExcerpt",
    "SourceLocation",
    "default_cache_root",
    "validate_release",
    "validate_config",
    "find_nvcc",
    "nvcc_version",
    "release_dir",
    "is_installed",
    "install_release",
    "install_record",
    "wheelhouse",
    "include_dir",
    "cached_result",
    "build_mla",
    "parse_nvcc_output",
    "read_source",
    "find_definition",
]

# --------------------------------------------------------------------------------------------
# What can be asked for
# --------------------------------------------------------------------------------------------

#: FlashInfer's two in-wrapper MLA backends: ``fa2`` (portable, mma.sync) and ``fa3`` (SM90 wgmma).
BACKENDS: Tuple[str, ...] = ("fa2", "fa3")
#: Query / output dtypes (torch attribute names).
Q_DTYPES: Tuple[str, ...] = ("bfloat16", "float16")
#: KV-cache dtypes (torch attribute names).
KV_DTYPES: Tuple[str, ...] = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")
#: Target architectures -> the value FlashInfer's ``FLASHINFER_CUDA_ARCH_LIST`` takes.
_ARCH_TO_FLASHINFER: Dict[str, str] = {
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
ARCHS: Tuple[str, ...] = tuple(_ARCH_TO_FLASHINFER)
#: MLA head dims of DeepSeek-V2/V3 and GLM-5: compressed KV 512, rope part 64.
HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
STATUSES: Tuple[str, ...] = ("compiled", "python_refused", "nvcc_failed")

_PACKAGE = "flashinfer-python"
_RESULT_SCHEMA = 1
_INSTALL_MARKER = ".kvwall-install.json"
# Packages a FlashInfer release needs to import ``flashinfer.jit`` and ``flashinfer.mla`` (found by
# trying, in a venv holding only torch): apache-tvm-ffi, packaging, nvidia-ml-py (pynvml), tqdm,
# requests (+ urllib3, idna, certifi; charset-normalizer silences requests' warning).  numpy,
# einops, click and tabulate are declared but not needed for this; jinja2 and filelock come with
# torch.  When the release declares a version range for one of these, that range is used.
_IMPORT_DEPS: Tuple[str, ...] = (
    "apache-tvm-ffi",
    "packaging",
    "nvidia-ml-py",
    "tqdm",
    "requests",
    "urllib3",
    "idna",
    "certifi",
    "charset-normalizer",
)
#: Exact dependency pins that the package index no longer carries, for which the nearest published
#: version is not enough: the C++ headers FlashInfer compiles against changed.  For these the
#: headers are taken from the dependency's own git history, at the commit that declared that version,
#: out of a local clone named by the environment variable.  (FlashInfer 0.4.1 pins
#: apache-tvm-ffi==0.1.0b15, removed from PyPI; 0.1.0 turned ``TensorView->data`` into ``.data_ptr()``.)
_HEADER_PINS: Dict[str, Tuple[str, str, str]] = {
    # pin: (environment variable naming a clone, commit, include folder in the repository)
    "apache-tvm-ffi==0.1.0b15": ("KVWALL_TVM_FFI_GIT", "22a78943b78306a73011757fa635afa9dce35114", "include"),
}
_RELEASE_RE = re.compile(r"^\d+(\.\d+){1,3}((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$")
_NETWORK_PATTERNS = (
    "NewConnectionError",
    "Failed to establish a new connection",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "ConnectTimeout",
    "Read timed out",
    "ProxyError",
    "Could not fetch URL",
    "No route to host",
    "Connection refused",
    "SSLError",
)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class FlashInferReleaseError(RuntimeError):
    """Something stopped us from installing or building a FlashInfer release (not a build result:
    a refused or failed build is a :class:`BuildResult`)."""


class InvalidConfigError(FlashInferReleaseError, ValueError):
    """A release string, backend, dtype or arch that this module does not accept."""


class NvccNotFoundError(FlashInferReleaseError):
    """No CUDA compiler to drive the JIT build with."""


class NetworkUnavailableError(FlashInferReleaseError):
    """The package index could not be reached to install a release that is not cached yet."""


class ReleaseNotFoundError(FlashInferReleaseError):
    """The package index has no installable wheel of ``flashinfer-python`` at that version."""


class ReleaseImportError(FlashInferReleaseError):
    """The installed release could not be imported or driven (missing dependency, or an API this
    module does not know)."""


class BuildTimeoutError(FlashInferReleaseError):
    """The JIT build ran past its time limit."""


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


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
        return (
            f"{self.backend}-{self.q_dtype}-{self.kv_dtype}-{self.arch}-"
            f"{self.head_dim_ckv}-{self.head_dim_kpe}"
        )

    def describe(self) -> str:
        return (
            f"MLA {self.backend}, Q {self.q_dtype}, KV {self.kv_dtype}, {self.arch}, "
            f"ckv {self.head_dim_ckv} / kpe {self.head_dim_kpe}"
        )


@dataclass(frozen=True)
class InstantiationFrame:
    """One ``instantiation of "<signature>" at line N of FILE`` note: ``function`` was instantiated
    from ``file``:``line``."""

    function: str  # short qualified name, e.g. "flashinfer::mla::compute_mla_pv"
    file: str  # relative to FlashInfer's include dir where possible
    line: int
    signature: str = ""  # the compiler's full text, template arguments included

    def __str__(self) -> str:
        return f"{self.function} / {self.file}({self.line})"


@dataclass(frozen=True)
class CompilerError:
    """One compiler error, located in FlashInfer's sources."""

    file: str  # relative to the include dir (e.g. "flashinfer/mma.cuh"), "generated/..." or absolute
    line: int
    message: str
    source_line: str = ""  # the offending line as the compiler echoed it
    instantiation_chain: Tuple[InstantiationFrame, ...] = ()
    translation_unit: str = ""  # the .cu being compiled, e.g. "generated/batch_mla_run.cu"

    @property
    def chain(self) -> List[str]:
        """The instantiation chain as ``"function / file(line)"`` strings, innermost first."""
        return [str(f) for f in self.instantiation_chain]

    def __str__(self) -> str:
        return f"{self.file}({self.line}): error: {self.message}"


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


@dataclass(frozen=True)
class SourceExcerpt:
    """Lines ``first``..``last`` of a file inside an installed release."""

    release: str
    file: str  # as resolved, relative to the release's include dir (or to flashinfer/data)
    path: str  # absolute path on this machine
    line: int  # the line asked for
    lines: Tuple[Tuple[int, str], ...]  # (number, text) pairs

    @property
    def text(self) -> str:
        """The line asked for, without its newline."""
        return dict(self.lines).get(self.line, "")

    def render(self, mark: str = ">") -> str:
        width = len(str(self.lines[-1][0])) if self.lines else 1
        out = []
        for n, t in self.lines:
            out.append(f"{mark if n == self.line else ' '} {n:>{width}} | {t}")
        return "\n".join(out)


@dataclass(frozen=True)
class SourceLocation:
    """Where a function is defined inside a release's include tree."""

    file: str  # relative to the include dir
    line: int  # the line holding the name
    text: str


# --------------------------------------------------------------------------------------------
# Validation and environment
# --------------------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$KVWALL_CACHE`` if set, else ``~/.cache/kvwall/flashinfer``."""
    env = os.environ.get("KVWALL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvwall" / "flashinfer"


def _root(cache_root) -> Path:
    return Path(cache_root).expanduser() if cache_root is not None else default_cache_root()


def validate_release(release: str) -> str:
    """Check that ``release`` looks like a FlashInfer version (``0.6.12``, ``0.6.18.post1``)."""
    if not isinstance(release, str) or not _RELEASE_RE.match(release.strip()):
        raise InvalidConfigError(
            f"Release {release!r} is not a version number. Expected a flashinfer-python version as "
            f"published on PyPI, such as '0.6.12' or '0.6.18.post1' (no 'v' prefix, no '==')."
        )
    return release.strip()


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
        return s[len("torch."):] if s.startswith("torch.") else s

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


def _require_nvcc() -> Path:
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
    nvcc = nvcc or _require_nvcc()
    key = str(nvcc)
    if key not in _NVCC_VERSION_CACHE:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release [\d.]+, V([\d.]+)", out) or re.search(r"release ([\d.]+)", out)
        _NVCC_VERSION_CACHE[key] = m.group(1) if m else out.strip().splitlines()[-1] if out.strip() else "unknown"
    return _NVCC_VERSION_CACHE[key]


# --------------------------------------------------------------------------------------------
# Installing releases
# --------------------------------------------------------------------------------------------


def release_dir(release: str, cache_root=None) -> Path:
    """The folder ``release`` is (or would be) installed into: ``<cache>/flashinfer-<release>``."""
    return _root(cache_root) / f"flashinfer-{validate_release(release)}"


def is_installed(release: str, cache_root=None) -> bool:
    return (release_dir(release, cache_root) / _INSTALL_MARKER).exists()


def include_dir(release: str, cache_root=None, install: bool = True) -> Path:
    """The release's C++ include root (``.../flashinfer/data/include``; it holds ``flashinfer/``)."""
    d = install_release(release, cache_root) if install else release_dir(release, cache_root)
    for cand in (d / "flashinfer" / "data" / "include", d / "flashinfer" / "include"):
        if cand.is_dir():
            return cand
    raise ReleaseImportError(f"flashinfer {release} installed at {d} has no include/ folder (flashinfer/data/include).")


def wheelhouse() -> Optional[Path]:
    """``$KVWALL_WHEELHOUSE`` as a folder, or ``None``: when set, every install is offline
    (``pip --no-index --find-links <folder>``), for machines without network that carry wheels."""
    env = os.environ.get("KVWALL_WHEELHOUSE")
    if not env:
        return None
    p = Path(env).expanduser().resolve()
    if not p.is_dir():
        raise NetworkUnavailableError(
            f"KVWALL_WHEELHOUSE={env!r} is not a folder. It must name a folder of wheels (pip download "
            f"-d <folder> flashinfer-python==X apache-tvm-ffi==Y ...); unset it to install from the index."
        )
    return p


def _pip(args: List[str], timeout: float = 900, *, command: str = "install",
         binary_only: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", command, "--no-deps", "--no-input", "--disable-pip-version-check"]
    if binary_only:
        cmd.append("--only-binary=:all:")
    house = wheelhouse()
    if house is not None:
        cmd += ["--no-index", "--find-links", str(house)]
    else:
        cmd += ["--retries", "1", "--timeout", "30"]
    cmd += args
    env = dict(os.environ, PIP_NO_INPUT="1")
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise NetworkUnavailableError(
            f"pip did not finish within {timeout:.0f} s installing {' '.join(args[-1:])}: the package "
            f"index is unreachable or very slow. Check the network (or PIP_INDEX_URL), then retry."
        ) from e


def _pip_failure(spec: str, proc: subprocess.CompletedProcess, release: str) -> FlashInferReleaseError:
    out = (proc.stdout or "") + (proc.stderr or "")
    tail = "\n".join(out.strip().splitlines()[-8:])
    house = os.environ.get("KVWALL_WHEELHOUSE")
    if house and "No matching distribution" in out:
        return NetworkUnavailableError(
            f"{spec} is not in the wheelhouse KVWALL_WHEELHOUSE={house!r} (installs are offline while it "
            f"is set). Add its wheel there (pip download --no-deps --only-binary=:all: -d {house} ...), "
            f"or unset KVWALL_WHEELHOUSE to install from the index.\npip said:\n{tail}"
        )
    if any(p in out for p in _NETWORK_PATTERNS):
        return NetworkUnavailableError(
            f"Could not reach the package index to install {spec} (FlashInfer {release} is not in the "
            f"cache yet). Connect to the network (or point PIP_INDEX_URL at a mirror) and retry; "
            f"releases already installed keep working offline.\npip said:\n{tail}"
        )
    m = re.search(r"\(from versions: ([^)]*)\)", out)
    if m and "No matching distribution" in out:
        versions = [v.strip() for v in m.group(1).split(",") if v.strip() and v.strip() != "none"]
        if not versions:
            return NetworkUnavailableError(
                f"The package index listed no versions at all of {spec.split('==')[0]}: either it "
                f"cannot be reached (no network?) or it does not carry this package. Check the "
                f"network / PIP_INDEX_URL and retry.\npip said:\n{tail}"
            )
        if spec.startswith(_PACKAGE + "=="):
            recent = ", ".join(versions[-12:])
            return ReleaseNotFoundError(
                f"FlashInfer release {release!r} has no installable wheel of {_PACKAGE} on the "
                f"package index (it does not exist, or was published only as a source "
                f"distribution). Pick one of the published versions; the most recent are: {recent}."
            )
        return ReleaseImportError(
            f"No wheel of {spec} for this Python ({sys.version.split()[0]}) on the package index; "
            f"FlashInfer {release} needs it to import. Versions listed: {', '.join(versions[-10:])}."
        )
    return FlashInferReleaseError(f"pip could not install {spec} for FlashInfer {release}.\npip said:\n{tail}")


def _declared_requirements(target: Path) -> Dict[str, str]:
    """``{normalized name: requirement string}`` from the installed release's METADATA."""
    reqs: Dict[str, str] = {}
    for meta in target.glob("flashinfer_python-*.dist-info/METADATA"):
        for line in meta.read_text(errors="replace").splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = line.split(":", 1)[1].strip()
            if ";" in req:  # extras / markers: not needed to import
                continue
            name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
            reqs[re.sub(r"[-_.]+", "-", name).lower()] = req
    return reqs


def _published_versions(pip_output: str) -> List[str]:
    m = re.search(r"\(from versions: ([^)]*)\)", pip_output)
    return [v.strip() for v in m.group(1).split(",") if v.strip() and v.strip() != "none"] if m else []


def _version_key(v: str):
    """A sort key for PEP 440 versions (packaging's when importable)."""
    try:
        from packaging.version import Version

        return (0, Version(v))
    except Exception:  # noqa: BLE001 - packaging absent or an odd string: numeric parts only
        return (1, tuple(int(x) for x in re.findall(r"\d+", v)))


def _nearest_published(requirement: str, pip_output: str) -> Optional[str]:
    """For an exact pin ``name==X`` the index does not carry (a removed pre-release, say), the
    lowest published version above X: ``name==Y``.  ``None`` if the pin is not exact or none is above."""
    m = re.match(r"^\s*([A-Za-z0-9._-]+)\s*==\s*([^,;\s]+)\s*$", requirement)
    if not m:
        return None
    name, pinned = m.groups()
    above = [v for v in _published_versions(pip_output) if _version_key(v) > _version_key(pinned)]
    return f"{name}=={min(above, key=_version_key)}" if above else None


def _distribution_present(requirement: str) -> bool:
    """Whether the calling environment already has this distribution (any version)."""
    import importlib.metadata as md

    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def _install_from_sdist(release: str, target: Path, wheel_failure: FlashInferReleaseError) -> Dict[str, str]:
    """Install a release the index has only as a source distribution.

    FlashInfer is a JIT package: its sdist holds Python code, the C++/CUDA sources and a build
    backend (``build_backend.py``) that only copies ``include/``, ``csrc/`` and ``3rdparty/`` into
    ``flashinfer/data`` -- nothing is compiled at install time.  So the release's own backend builds
    a pure-Python wheel here, without build isolation (its pinned build requirements need not
    resolve: setuptools comes from this environment), and that wheel is installed like any other.
    Refuses (with the reason) an sdist whose wheel is not pure Python."""
    work = Path(tempfile.mkdtemp(prefix=f".sdist-flashinfer-{release}-", dir=target.parent))
    try:
        spec = f"{_PACKAGE}=={release}"
        proc = _pip(["-d", str(work / "sdist"), "--no-binary", _PACKAGE, "--no-build-isolation", spec],
                    command="download", binary_only=False)  # fmt: skip
        sdists = sorted((work / "sdist").glob("*.tar.gz")) + sorted((work / "sdist").glob("*.zip"))
        if proc.returncode != 0 or not sdists:
            out = (proc.stdout or "") + (proc.stderr or "")
            if "No matching distribution" in out:
                raise ReleaseNotFoundError(
                    f"{wheel_failure} It has no source distribution either."
                ) from wheel_failure
            raise _pip_failure(spec + " (source distribution)", proc, release)
        proc = _pip(["-w", str(work / "wheel"), "--no-build-isolation", str(sdists[0])], command="wheel",
                    binary_only=False)  # fmt: skip
        wheels = sorted((work / "wheel").glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            tail = "\n".join(((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()[-12:])
            raise ReleaseImportError(
                f"FlashInfer {release} exists only as a source distribution ({sdists[0].name}), and its own "
                f"build backend could not make a wheel of it here (it needs setuptools>=77 in this "
                f"environment, no compiler).\npip said:\n{tail}"
            )
        if not wheels[0].name.endswith("-py3-none-any.whl"):
            raise ReleaseImportError(
                f"FlashInfer {release}'s source distribution built {wheels[0].name}, which is not pure "
                f"Python: installing it would mean compiling its extension ahead of time, which this "
                f"module does not do."
            )
        proc = _pip(["--target", str(target), str(wheels[0])], binary_only=False)
        if proc.returncode != 0:
            raise _pip_failure(wheels[0].name, proc, release)
        return {"from": "sdist", "sdist": sdists[0].name, "wheel_built": wheels[0].name}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _overlay_pinned_headers(pin: str, target: Path) -> str:
    """Replace the substituted dependency's C++ headers with those of the pinned version, from a
    local git clone (see :data:`_HEADER_PINS`).  Returns what was done, for the install marker."""
    var, commit, folder = _HEADER_PINS[pin]
    clone = os.environ.get(var)
    if not clone:
        return f"not replaced: set {var} to a git clone of the dependency holding commit {commit}"
    name = re.match(r"[A-Za-z0-9._-]+", pin).group(0).replace("-", "_")
    pkg = target / name.removeprefix("apache_")
    dest = pkg / "include"
    if not dest.is_dir():
        return f"not replaced: {dest} is not a folder"
    proc = subprocess.run(["git", "-C", clone, "archive", "--format=tar", commit, folder], capture_output=True)
    if proc.returncode != 0:
        return f"not replaced: git archive {commit} in {clone} failed: {proc.stderr.decode(errors='replace')[-300:]}"
    import io
    import tarfile

    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(tmp)
        shutil.copytree(Path(tmp) / folder, dest, dirs_exist_ok=True)
    return f"{folder}/ from commit {commit} (the commit that declared {pin.split('==')[1]})"


def install_release(release: str, cache_root=None, *, quiet: bool = True) -> Path:
    """Install ``flashinfer-python==release`` and what it needs to import into
    ``<cache>/flashinfer-<release>`` (once; later calls return at once).  Returns that folder.

    A release published only as a source distribution is installed from it (FlashInfer's sdist
    builds a pure-Python wheel: see :func:`_install_from_sdist`).  A dependency pinned to a version
    the index no longer carries is replaced by the nearest later one, and the install marker
    (``.kvwall-install.json``) says so.  With ``$KVWALL_WHEELHOUSE`` set, everything comes from that
    folder (no network), and import dependencies the calling environment already has are not
    installed again (the build subprocess sees them).

    Raises :class:`NetworkUnavailableError`, :class:`ReleaseNotFoundError` or
    :class:`FlashInferReleaseError` with pip's own words when pip fails."""
    release = validate_release(release)
    final = release_dir(release, cache_root)
    if (final / _INSTALL_MARKER).exists():
        return final
    house = wheelhouse()
    root = _root(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".installing-flashinfer-{release}-", dir=root))
    t0 = time.perf_counter()
    try:
        spec = f"{_PACKAGE}=={release}"
        proc = _pip(["--target", str(tmp), spec])
        source: Dict[str, str] = {"from": "wheel"}
        if proc.returncode != 0:
            failure = _pip_failure(spec, proc, release)
            if not isinstance(failure, ReleaseNotFoundError) or house is not None:
                raise failure
            source = _install_from_sdist(release, tmp, failure)
        declared = _declared_requirements(tmp)
        deps = [declared.get(name, name) for name in _IMPORT_DEPS]
        if shutil.which("ninja") is None:  # FlashInfer's JIT runs `ninja`; the wheel ships one
            deps.append(declared.get("ninja", "ninja"))
        if house is not None:  # offline: what this environment has is seen by the subprocess too
            deps = [d for d in deps if d.startswith("apache-tvm-ffi") or not _distribution_present(d)]
        substituted: Dict[str, str] = {}
        if deps:
            proc = _pip(["--target", str(tmp)] + deps)
            if proc.returncode != 0:
                out = (proc.stdout or "") + (proc.stderr or "")
                missing = re.search(r"No matching distribution found for (\S+)", out)
                swap = _nearest_published(missing.group(1), out) if missing else None
                if swap is None:
                    raise _pip_failure(" ".join(deps), proc, release)
                substituted[missing.group(1)] = swap
                deps = [swap if d == missing.group(1) else d for d in deps]
                proc = _pip(["--target", str(tmp)] + deps)
                if proc.returncode != 0:
                    raise _pip_failure(" ".join(deps), proc, release)
        headers = {pin: _overlay_pinned_headers(pin, tmp) for pin in substituted if pin in _HEADER_PINS}
        installed = sorted(p.name for p in tmp.glob("*.dist-info"))
        (tmp / _INSTALL_MARKER).write_text(
            json.dumps(
                {
                    "release": release,
                    "python": sys.version.split()[0],
                    "source": source,
                    "wheelhouse": str(house) if house else None,
                    "dependencies": deps,
                    "substituted": substituted,
                    "pinned_headers": headers,
                    "installed": installed,
                    "seconds": round(time.perf_counter() - t0, 2),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                },
                indent=2,
            )
        )
        if final.exists():  # a half-finished earlier attempt, or a concurrent install won
            if (final / _INSTALL_MARKER).exists():
                shutil.rmtree(tmp, ignore_errors=True)
                return final
            shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def install_record(release: str, cache_root=None) -> dict:
    """What :func:`install_release` wrote about how ``release`` was installed (``{}`` if not installed)."""
    marker = release_dir(release, cache_root) / _INSTALL_MARKER
    return json.loads(marker.read_text()) if marker.exists() else {}


# --------------------------------------------------------------------------------------------
# The build driver (runs in a subprocess, with the release first on sys.path)
# --------------------------------------------------------------------------------------------

_DRIVER = r'''
import inspect, json, os, re, subprocess, sys, time, traceback
args = json.loads(sys.argv[1])
sys.path.insert(0, args["release_dir"])
out = {"phase": "import"}

def emit():
    with open(args["result_path"], "w") as f:
        json.dump(out, f)

def where(exc):
    tb = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(tb):
        if fr.filename.startswith(args["release_dir"]):
            return os.path.relpath(fr.filename, args["release_dir"]) + ":" + str(fr.lineno)
    return (tb[-1].filename + ":" + str(tb[-1].lineno)) if tb else ""

try:
    import torch
    import flashinfer
    gen = None
    for modname in ("flashinfer.jit.attention.modules", "flashinfer.jit.attention", "flashinfer.jit"):
        try:
            mod = __import__(modname, fromlist=["gen_batch_mla_module"])
        except ImportError:
            continue
        gen = getattr(mod, "gen_batch_mla_module", None)
        if gen is not None:
            break
    if gen is None:
        raise ImportError("this release has no gen_batch_mla_module in flashinfer.jit")
    out["flashinfer_version"] = getattr(flashinfer, "__version__", "")
except BaseException as e:
    out.update(error="import", exc_type=type(e).__name__, message=str(e), traceback=traceback.format_exc()[-4000:])
    emit(); sys.exit(0)

cfg = args["config"]
dq, dkv = getattr(torch, cfg["q_dtype"]), getattr(torch, cfg["kv_dtype"])
major, minor = args["capability"]

# 1. The release's own Python-level checks: BatchMLAPagedAttentionWrapper.plan(), with the device
#    capability of the requested arch, stopped at the point where it asks for the JIT module.
class _Reached(Exception):
    pass

out["phase"] = "plan checks"
out["python_checks"] = "skipped"
if args["python_checks"]:
    try:
        import flashinfer.mla as fmla
        W = getattr(fmla, "BatchMLAPagedAttentionWrapper")
        core = sys.modules[W.__module__]
        names = set(inspect.signature(W.plan).parameters)
        needed = {"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr", "num_heads", "head_dim_ckv",
                  "head_dim_kpe", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type"}
        if not needed <= names or not hasattr(core, "get_batch_mla_module"):
            raise LookupError("this release's BatchMLAPagedAttentionWrapper.plan() (in " + W.__module__
                              + ") is not the 0.6.x shape whose checks this module can replay; "
                              "only the JIT generator and nvcc were run")
    except BaseException as e:
        out["python_checks"] = "skipped: " + type(e).__name__ + ": " + str(e)
    else:
        def fake_cc(*a, **k):
            return (major, minor)
        def stop(*a, **k):
            raise _Reached()
        for name in ("get_compute_capability",):
            if hasattr(core, name):
                setattr(core, name, fake_cc)
        core.get_batch_mla_module = stop
        w = object.__new__(W)
        w._backend = cfg["backend"]
        w.device = torch.device("cpu")
        w._use_cuda_graph = False
        i32 = torch.int32
        kw = dict(qo_indptr=torch.tensor([0, 1], dtype=i32), kv_indptr=torch.tensor([0, 1], dtype=i32),
                  kv_indices=torch.tensor([0], dtype=i32), kv_len_arr=torch.tensor([1], dtype=i32),
                  num_heads=16, head_dim_ckv=cfg["head_dim_ckv"], head_dim_kpe=cfg["head_dim_kpe"],
                  page_size=1, causal=False, sm_scale=1.0 / (192 ** 0.5), q_data_type=dq, kv_data_type=dkv)
        try:
            W.plan(w, **kw)
            out["python_checks"] = "skipped: plan() returned without asking for the MLA module"
        except _Reached:
            out["python_checks"] = "ran"
        except BaseException as e:
            out.update(error="refused", phase="plan checks", exc_type=type(e).__name__, message=str(e),
                       where=where(e), python_checks="ran")
            emit(); sys.exit(0)

# 2. The release's own JIT module generator.
out["phase"] = "module generator"
try:
    spec = gen(cfg["backend"], dq, dkv, dq, torch.int32, cfg["head_dim_ckv"], cfg["head_dim_kpe"], False)
except BaseException as e:
    out.update(error="refused", exc_type=type(e).__name__, message=str(e), where=where(e))
    emit(); sys.exit(0)

# 3. Its own ninja file and nvcc flags; build the object files only (no link).
out["phase"] = "compile"
try:
    from flashinfer.jit import env as jit_env
    out["include_dir"] = str(jit_env.FLASHINFER_INCLUDE_DIR)
    out["csrc_dir"] = str(getattr(jit_env, "FLASHINFER_CSRC_DIR", ""))
    out["gen_dir"] = str(getattr(jit_env, "FLASHINFER_GEN_SRC_DIR", ""))
    out["sources"] = [str(s) for s in spec.sources]
    spec.write_ninja()
    ninja_file = str(spec.ninja_path)
    text = open(ninja_file).read()
    variables = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", text, re.M))  # top-level ninja variables
    objs = [re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), o)
            for o in re.findall(r"^build (\S+?\.o)\s*:", text, re.M)]
    build_dir = getattr(spec, "build_dir", None) or jit_env.FLASHINFER_JIT_DIR  # 0.4.x: the JIT dir
    cmd = [args["ninja"], "-v", "-k", "0", "-C", str(build_dir), "-f", ninja_file] + objs
    if args.get("jobs"):
        cmd += ["-j", str(args["jobs"])]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=args["timeout_s"])
    out.update(returncode=p.returncode, output=p.stdout + p.stderr, compile_seconds=time.perf_counter() - t0)
except subprocess.TimeoutExpired as e:
    out.update(error="timeout", message=str(e))
except BaseException as e:
    out.update(error="driver", exc_type=type(e).__name__, message=str(e), traceback=traceback.format_exc()[-4000:])
emit()
'''


def _results_dir(cache_root) -> Path:
    return _root(cache_root) / "builds"


def _result_path(release: str, config: BuildConfig, cache_root, python_checks: bool = True) -> Path:
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
    cache_root=None,
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
    cache_root=None,
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
    nvcc = _require_nvcc()
    nv_version = nvcc_version(nvcc)
    rdir = install_release(release, cache_root)
    ninja = shutil.which("ninja") or (str(rdir / "bin" / "ninja") if (rdir / "bin" / "ninja").exists() else None)
    if ninja is None:
        raise ReleaseImportError(
            "No `ninja` to run FlashInfer's JIT build file with: install it (apt install ninja-build, "
            "or pip install ninja) and retry."
        )

    root = _root(cache_root)
    work = Path(tempfile.mkdtemp(prefix=f"build-{release}-{config.key}-", dir=_ensure(root / "work")))
    result_tmp = work / "driver-result.json"
    arch_list = _ARCH_TO_FLASHINFER[config.arch]
    major = int(arch_list.split(".")[0])
    minor = int(re.match(r"\d+", arch_list.split(".")[1]).group(0))
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
    payload = {
        "release_dir": str(rdir),
        "config": dataclasses.asdict(config),
        "capability": [major, minor],
        "python_checks": bool(python_checks),
        "result_path": str(result_tmp),
        "ninja": ninja,
        "jobs": jobs,
        "timeout_s": float(timeout_s),
    }
    t0 = time.perf_counter()
    try:
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _DRIVER, json.dumps(payload)],
                capture_output=True, text=True, env=env, cwd=str(work), timeout=timeout_s + 120,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise BuildTimeoutError(
                f"FlashInfer {release} build of {config.describe()} ran past {timeout_s + 120:.0f} s; "
                f"pass a larger timeout_s or jobs= to build_mla()."
            ) from e
        duration = time.perf_counter() - t0
        if not result_tmp.exists():
            raise ReleaseImportError(
                f"The build driver for FlashInfer {release} exited (code {proc.returncode}) without a "
                f"result.\n{(proc.stdout + proc.stderr)[-3000:]}"
            )
        d = json.loads(result_tmp.read_text())
        result = _interpret(release, config, d, duration, nv_version, arch_list, rdir)
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


def _interpret(release, config, d, duration, nv_version, arch_list, rdir) -> BuildResult:
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
    roots = _path_roots(d)
    output = d.get("output", "")
    errors = parse_nvcc_output(output, roots)
    tus = tuple(_shorten(s, roots) for s in d.get("sources", ()))
    status = "compiled" if d.get("returncode") == 0 else "nvcc_failed"
    if status == "nvcc_failed" and not errors:
        tail = [ln for ln in output.splitlines() if ln.strip()][-1:] or ["(no output)"]
        errors = [CompilerError(file="", line=0, message=f"build failed without a parsable error: {tail[0][:500]}")]
    return BuildResult(
        status=status,
        errors=tuple(errors),
        translation_units=tus,
        compiler_output=_clean_output(output, roots),
        **common,
    )


def _path_roots(d: dict) -> List[Tuple[str, str]]:
    """(absolute prefix, short prefix) pairs, longest first."""
    pairs = []
    inc = d.get("include_dir")
    if inc:
        pairs.append((str(Path(inc).resolve()) + "/", ""))
        pairs.append((inc.rstrip("/") + "/", ""))
    gen = d.get("gen_dir")
    if gen:
        pairs.append((gen.rstrip("/") + "/", "generated/"))
    csrc = d.get("csrc_dir")
    if csrc:
        pairs.append((csrc.rstrip("/") + "/", "csrc/"))
    pairs.sort(key=lambda p: -len(p[0]))
    return pairs


def _shorten(path: str, roots: Sequence[Tuple[str, str]]) -> str:
    path = path.strip()
    for prefix, short in roots:
        if path.startswith(prefix):
            rest = path[len(prefix):]
            if short == "generated/":  # generated/<arch>/generated/<uri>/file -> generated/file
                rest = rest.split("/")[-1]
            return short + rest
    return path


def _clean_output(output: str, roots) -> str:
    lines = []
    for ln in output.splitlines():
        if ln.startswith("ninja: Entering directory"):
            continue
        if ln.startswith("FAILED:"):
            lines.append("FAILED: " + " ".join(Path(t).name for t in ln.split()[1:]))
            continue
        m = re.match(r"^(\[\d+/\d+\]|FAILED:)?\s*(\S*nvcc|\S*c\+\+|\S*g\+\+)\s.*?\s-c\s+(\S+)", ln)
        if m and len(ln) > 300:  # an elided command line
            lines.append(f"{m.group(1) or ''} {Path(m.group(2)).name} ... -c {_shorten(m.group(3), roots)}".strip())
            continue
        for prefix, short in roots:
            if short == "generated/":
                ln = re.sub(re.escape(prefix) + r"\S*/", "generated/", ln)
            else:
                ln = ln.replace(prefix, "include/" if short == "" else short)
        lines.append(ln)
    text = "\n".join(lines)
    return text[-40000:]


# --------------------------------------------------------------------------------------------
# Parsing nvcc output
# --------------------------------------------------------------------------------------------

_EDG_ERR = re.compile(r"^(?P<file>\S[^()]*?)\((?P<line>\d+)\): (?:catastrophic )?error(?: #[\w-]+)?: (?P<msg>.*)$")
_GCC_ERR = re.compile(r"^(?P<file>/\S+?):(?P<line>\d+):(?:\d+:)? (?:fatal )?error: (?P<msg>.*)$")
_OTHER_ERR = re.compile(r"^(?P<msg>(?:nvcc fatal|ptxas (?:fatal|error)|nvlink error)\s*:.*)$")
_INST = re.compile(
    r"^\s*(?:detected during(?::)?\s*)?(?P<kind>instantiation of|implicit generation of)\s+"
    r"(?:class |variable )?\"(?P<sig>.*)\"(?: based on [^\"]*\")?\s+at line (?P<line>\d+)(?: of (?P<file>.+?))?\s*$"
)
_TU = re.compile(r'^\d+ errors? detected in the compilation of "(?P<tu>[^"]+)"')


def _short_name(sig: str) -> str:
    """``void flashinfer::mma::f<X>(float *, DType *) [with ...]`` -> ``flashinfer::mma::f``."""
    s = re.sub(r"\s*\[with .*\]\s*$", "", sig).strip()
    depth, cut = 0, len(s)
    for i, ch in enumerate(s):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    head = s[:cut]
    # drop template arguments at depth 0 and the return type
    out, depth = [], 0
    for ch in head:
        if ch == "<":
            depth += 1
            continue
        if ch == ">":
            depth -= 1
            continue
        if depth == 0:
            out.append(ch)
    name = "".join(out).strip()
    return name.split()[-1] if name.split() else s


def parse_nvcc_output(output: str, roots: Sequence[Tuple[str, str]] = ()) -> List[CompilerError]:
    """Compiler errors in ninja/nvcc output, in order, with their instantiation chains.

    ``roots``: ``(absolute prefix, short prefix)`` pairs used to shorten paths (the release's
    include dir maps to ``""`` so files read ``flashinfer/mma.cuh``)."""
    errors: List[dict] = []
    cur: Optional[dict] = None
    pending: List[dict] = []  # errors of the current translation unit, to tag with its name
    lines = output.splitlines()
    for i, ln in enumerate(lines):
        m = _EDG_ERR.match(ln) or _GCC_ERR.match(ln)
        if m:
            src = ""
            if i + 1 < len(lines) and lines[i + 1].startswith(" ") and "detected during" not in lines[i + 1]:
                src = lines[i + 1].strip()
            cur = {"file": _shorten(m.group("file"), roots), "line": int(m.group("line")), "message": m.group("msg").strip(),
                   "source_line": src, "instantiation_chain": [], "translation_unit": ""}  # fmt: skip
            errors.append(cur)
            pending.append(cur)
            continue
        m = _OTHER_ERR.match(ln.strip())
        if m:
            cur = None
            e = {"file": "", "line": 0, "message": m.group("msg"), "source_line": "", "instantiation_chain": [],
                 "translation_unit": ""}  # fmt: skip
            errors.append(e)
            pending.append(e)
            continue
        m = _INST.match(ln)
        if m and cur is not None:
            cur["instantiation_chain"].append(
                InstantiationFrame(
                    function=_short_name(m.group("sig")),
                    # the compiler leaves out "of FILE" when it is the file of the error itself
                    file=_shorten(m.group("file"), roots) if m.group("file") else cur["file"],
                    line=int(m.group("line")),
                    signature=m.group("sig"),
                )
            )
            continue
        m = _TU.match(ln)
        if m:
            for e in pending:
                e["translation_unit"] = _shorten(m.group("tu"), roots)
            pending, cur = [], None
            continue
        if ln.startswith("[") or ln.startswith("FAILED:") or ln.startswith("ninja:"):
            cur = None
    return [
        CompilerError(
            file=e["file"], line=e["line"], message=e["message"], source_line=e["source_line"],
            instantiation_chain=tuple(e["instantiation_chain"]), translation_unit=e["translation_unit"],
        )
        for e in errors
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# Reading a release's sources
# --------------------------------------------------------------------------------------------


def _resolve_source(release: str, file: str, cache_root) -> Tuple[Path, str]:
    inc = include_dir(release, cache_root)
    data = inc.parent
    f = file.strip().lstrip("/")
    candidates = []
    for prefix in ("include/", "flashinfer/data/include/", "data/include/"):
        if f.startswith(prefix):
            candidates.append((inc / f[len(prefix):], f[len(prefix):]))
    candidates += [(inc / f, f), (inc / "flashinfer" / f, "flashinfer/" + f), (data / f, f)]
    if f.startswith("csrc/"):
        candidates.append((data / f, f))
    for path, rel in candidates:
        if path.is_file():
            return path, rel
    raise FileNotFoundError(
        f"{file!r} is not in FlashInfer {release}'s sources. Give a path relative to its include dir, "
        f"such as 'flashinfer/mma.cuh' or 'flashinfer/attention/mla.cuh' (looked under {inc})."
    )


def read_source(release: str, file: str, line: int, context: int = 5, *, cache_root=None) -> SourceExcerpt:
    """Lines ``line - context`` .. ``line + context`` of ``file`` in the installed ``release``
    (installed on demand).  ``file`` is relative to the include dir (``"flashinfer/mma.cuh"``;
    ``"include/flashinfer/mma.cuh"`` and ``"attention/mla.cuh"`` work too) or to ``flashinfer/data``
    (``"csrc/batch_mla_run.cu"``)."""
    path, rel = _resolve_source(release, file, cache_root)
    text = path.read_text(errors="replace").splitlines()
    if not 1 <= line <= len(text):
        raise ValueError(f"{rel} in FlashInfer {release} has {len(text)} lines; line {line} is outside it.")
    lo, hi = max(1, line - context), min(len(text), line + context)
    return SourceExcerpt(
        release=release,
        file=rel,
        path=str(path),
        line=line,
        lines=tuple((n, text[n - 1]) for n in range(lo, hi + 1)),
    )


_NOT_A_TYPE = {"return", "else", "case", "new", "delete", "throw", "co_return", "goto", "sizeof", "decltype"}


def find_definition(release: str, function: str, *, cache_root=None) -> List[SourceLocation]:
    """Where ``function`` is defined in ``release``'s include tree (``*.cuh``, ``*.h``, ``*.hpp``),
    as a list (overloads give several).  ``function`` may be qualified
    (``"flashinfer::mma::m16k16_rowsum_f16f16f32"`` or ``"mla::compute_mla_pv"``); the namespaces
    given must be opened in the file.  Calls and declarations ending in ``;`` are not definitions."""
    parts = [p for p in function.split("::") if p]
    if not parts:
        raise InvalidConfigError(f"Expected a function name such as 'mma::m16k16_rowsum_f16f16f32', got {function!r}.")
    name, namespaces = parts[-1], [p for p in parts[:-1] if p != "flashinfer"]
    inc = include_dir(release, cache_root)
    pat = re.compile(r"(?<![\w.>:])(?:\w+::)*" + re.escape(name) + r"\s*(?:<[^()]*>)?\s*\(")
    hits: List[SourceLocation] = []
    files = sorted(p for ext in ("*.cuh", "*.h", "*.hpp") for p in inc.rglob(ext))
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if name not in text:
            continue
        if namespaces and not all(re.search(r"namespace\s+" + re.escape(ns) + r"\b", text) for ns in namespaces):
            continue
        lines = text.splitlines()
        for i, ln in enumerate(lines):
            m = pat.search(ln)
            if not m:
                continue
            prefix = ln[: m.start()].strip()
            if prefix.startswith(("//", "*", "/*", "#")):
                continue
            if prefix:
                if re.search(r"[=(),.;{}\"]|->", prefix) or prefix.split()[-1] in _NOT_A_TYPE:
                    continue
                if prefix.split()[0] in _NOT_A_TYPE:
                    continue
            else:
                prev = lines[i - 1].rstrip() if i else ""
                if not re.search(r"[\w>*&]$", prev) or prev.strip().startswith(("//", "#")):
                    continue
            # a definition has its body before the next ';'
            rest = "\n".join(lines[i : i + 40])[m.end():]
            brace, semi = rest.find("{"), rest.find(";")
            if brace == -1 or (semi != -1 and semi < brace):
                continue
            hits.append(SourceLocation(file=str(path.relative_to(inc)), line=i + 1, text=ln.rstrip()))
    return hits

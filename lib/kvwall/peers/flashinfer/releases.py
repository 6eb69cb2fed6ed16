"""Install any FlashInfer release in isolation, next to the one this environment imports.

The book shows a wall that lives in FlashInfer's *compiler* build, and the releases that later got
past it; each release is asked its own question. :func:`install_release` installs
``flashinfer-python==X`` with ``pip install --no-deps --target`` into its own folder of a cache
(default ``~/.cache/kvwall/flashinfer``, or ``$KVWALL_CACHE``), plus the few packages it needs to
*import* (``apache-tvm-ffi`` at the version the release declares, ``packaging``, ``nvidia-ml-py``,
``tqdm``, ``requests`` and its dependencies); torch comes from the calling environment. With
``$KVWALL_WHEELHOUSE`` set, every install is offline, from that folder of wheels. A release is
then driven in a subprocess with its folder first on ``sys.path`` (see
:mod:`kvwall.peers.flashinfer.build` and :mod:`kvwall.peers.flashinfer.jit_driver`).

Only the standard library (and tqdm, for progress on a terminal) is used here.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple, Union

from kvwall.peers.flashinfer.errors import (
    FlashInferReleaseError,
    InvalidConfigError,
    NetworkUnavailableError,
    ReleaseImportError,
    ReleaseNotFoundError,
)
from packaging.version import InvalidVersion, Version
from tqdm import tqdm

from kvwall.peers.flashinfer.progress import progress

__all__ = [
    "CacheRoot",
    "default_cache_root",
    "cache_root_path",
    "validate_release",
    "release_dir",
    "is_installed",
    "wheelhouse",
    "install_release",
    "install_record",
    "release_root",
]

#: Where releases are cached: ``None`` for :func:`default_cache_root`, or a folder.
CacheRoot = Union[str, Path, None]

_PACKAGE = "flashinfer-python"
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


def default_cache_root() -> Path:
    """``$KVWALL_CACHE`` if set, else ``~/.cache/kvwall/flashinfer``."""
    env = os.environ.get("KVWALL_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "kvwall" / "flashinfer"


def cache_root_path(cache_root: CacheRoot) -> Path:
    """``cache_root`` as a folder (``None``: :func:`default_cache_root`)."""
    return Path(cache_root).expanduser() if cache_root is not None else default_cache_root()


def validate_release(release: str) -> str:
    """Check that ``release`` looks like a FlashInfer version (``0.6.12``, ``0.6.18.post1``)."""
    if not isinstance(release, str) or not _RELEASE_RE.match(release.strip()):
        raise InvalidConfigError(
            f"Release {release!r} is not a version number. Expected a flashinfer-python version as "
            f"published on PyPI, such as '0.6.12' or '0.6.18.post1' (no 'v' prefix, no '==')."
        )
    return release.strip()


def release_dir(release: str, cache_root: CacheRoot = None) -> Path:
    """The folder ``release`` is (or would be) installed into: ``<cache>/flashinfer-<release>``."""
    return cache_root_path(cache_root) / f"flashinfer-{validate_release(release)}"


def is_installed(release: str, cache_root: CacheRoot = None) -> bool:
    """Whether ``release`` is fully installed in the cache (an interrupted install is not)."""
    return (release_dir(release, cache_root) / _INSTALL_MARKER).exists()


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


def _pip(
    args: List[str], timeout: float = 900, *, command: str = "install", binary_only: bool = True
) -> subprocess.CompletedProcess:
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
        return (0, Version(v))
    except InvalidVersion:  # an odd string: numeric parts only
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
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
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
                raise ReleaseNotFoundError(f"{wheel_failure} It has no source distribution either.") from wheel_failure
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
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(tmp)
        shutil.copytree(Path(tmp) / folder, dest, dirs_exist_ok=True)
    return f"{folder}/ from commit {commit} (the commit that declared {pin.split('==')[1]})"


def _pip_install_into(
    release: str, target: Path, house: Optional[Path], bar: tqdm
) -> Tuple[Dict[str, str], List[str], Dict[str, str]]:
    """The pip steps of :func:`install_release`: the release (from its sdist when the index has no
    wheel), then its import dependencies, an exact pin the index no longer carries swapped for the
    nearest published version. Returns (where the release came from, the dependencies, the swaps)."""
    spec = f"{_PACKAGE}=={release}"
    bar.set_postfix_str(spec)
    proc = _pip(["--target", str(target), spec])
    source: Dict[str, str] = {"from": "wheel"}
    if proc.returncode != 0:
        failure = _pip_failure(spec, proc, release)
        if not isinstance(failure, ReleaseNotFoundError) or house is not None:
            raise failure
        bar.set_postfix_str(f"{spec} from its source distribution")
        source = _install_from_sdist(release, target, failure)
    bar.update()
    declared = _declared_requirements(target)
    deps = [declared.get(name, name) for name in _IMPORT_DEPS]
    if shutil.which("ninja") is None:  # FlashInfer's JIT runs `ninja`; the wheel ships one
        deps.append(declared.get("ninja", "ninja"))
    if house is not None:  # offline: what this environment has is seen by the subprocess too
        deps = [d for d in deps if d.startswith("apache-tvm-ffi") or not _distribution_present(d)]
    substituted: Dict[str, str] = {}
    if deps:
        bar.set_postfix_str("import dependencies")
        proc = _pip(["--target", str(target)] + deps)
        if proc.returncode != 0:
            out = (proc.stdout or "") + (proc.stderr or "")
            missing = re.search(r"No matching distribution found for (\S+)", out)
            swap = _nearest_published(missing.group(1), out) if missing else None
            if swap is None:
                raise _pip_failure(" ".join(deps), proc, release)
            substituted[missing.group(1)] = swap
            deps = [swap if d == missing.group(1) else d for d in deps]
            proc = _pip(["--target", str(target)] + deps)
            if proc.returncode != 0:
                raise _pip_failure(" ".join(deps), proc, release)
    bar.update()
    return source, deps, substituted


def install_release(release: str, cache_root: CacheRoot = None) -> Path:
    """Install ``flashinfer-python==release`` and what it needs to import into
    ``<cache>/flashinfer-<release>`` (once; later calls return at once).  Returns that folder.

    A release published only as a source distribution is installed from it (FlashInfer's sdist
    builds a pure-Python wheel: see :func:`_install_from_sdist`).  A dependency pinned to a version
    the index no longer carries is replaced by the nearest later one, and the install marker
    (``.kvwall-install.json``) says so.  With ``$KVWALL_WHEELHOUSE`` set, everything comes from that
    folder (no network), and import dependencies the calling environment already has are not
    installed again (the build subprocess sees them). On a terminal a progress bar names each
    pip step (:mod:`kvwall.peers.flashinfer.progress`); elsewhere the install is silent.

    Raises :class:`NetworkUnavailableError`, :class:`ReleaseNotFoundError` or
    :class:`FlashInferReleaseError` with pip's own words when pip fails."""
    release = validate_release(release)
    final = release_dir(release, cache_root)
    if (final / _INSTALL_MARKER).exists():
        return final
    house = wheelhouse()
    root = cache_root_path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".installing-flashinfer-{release}-", dir=root))
    t0 = time.perf_counter()
    try:
        with progress(f"installing FlashInfer {release}") as bar:
            source, deps, substituted = _pip_install_into(release, tmp, house, bar)
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


def install_record(release: str, cache_root: CacheRoot = None) -> dict:
    """What :func:`install_release` wrote about how ``release`` was installed (``{}`` if not installed)."""
    marker = release_dir(release, cache_root) / _INSTALL_MARKER
    return json.loads(marker.read_text()) if marker.exists() else {}


def release_root(release: Optional[str] = None) -> Tuple[str, Path]:
    """``(version, folder holding the flashinfer package)`` of ``release``. ``None``: the FlashInfer
    this environment imports (found without importing it). A release other than that one is
    installed into the cache by :func:`install_release` (network on first use)."""
    spec = importlib.util.find_spec("flashinfer")
    here = None
    if spec is not None and spec.origin:
        here = (importlib.metadata.version(_PACKAGE), Path(spec.origin).resolve().parents[1])
    if release is None:
        if here is None:
            raise ReleaseImportError(
                "FlashInfer is not importable here: install flashinfer-python (make setup does), or name a "
                "release to install into the cache."
            )
        return here
    if here is not None and here[0] == release:
        return here
    return release, install_release(release)

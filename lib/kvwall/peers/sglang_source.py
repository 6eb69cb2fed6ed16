"""SGLang 0.5.23's own files, obtained the same way on every machine: the pinned wheel from PyPI, checked, unpacked.

:func:`sglang_source` downloads ``sglang==0.5.23`` once (``pip download --no-deps``; the one wheel PyPI has,
``cp311 manylinux_2_34_x86_64``, asked for by platform so any host gets it), refuses it unless its sha256 is
:data:`WHEEL_SHA256`, unpacks it into ``$KVWALL_CACHE/sglang-0.5.23`` (default ``~/.cache/kvwall/sglang-0.5.23``) and
returns that folder: ``sglang/...`` and ``sglang-0.5.23.dist-info/`` (its ``RECORD`` lets importers check each
file). A folder already unpacked from the checked wheel is reused. ``$KVWALL_SGLANG_SRC`` names a folder that holds
the same files (``sglang/`` inside) to use instead, offline.

:func:`sglang_import_deps` installs, into a sibling folder, the few PyPI packages that importing SGLang's own modules
on a CPU machine needs beyond the project's venv (:data:`IMPORT_DEPS`); callers append it to ``sys.path`` last.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

__all__ = [
    "VERSION",
    "WHEEL",
    "WHEEL_SHA256",
    "IMPORT_DEPS",
    "SGLangSourceUnavailable",
    "cache_root",
    "sglang_source",
    "sglang_import_deps",
]

VERSION = "0.5.23"
WHEEL = f"sglang-{VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
#: sha256 of :data:`WHEEL` as PyPI serves it (computed 2026-12-03 from `pip download --no-deps sglang==0.5.23`).
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
#: What importing SGLang's memory-pool and backend modules needs beyond the venv (sglang 0.5.23's METADATA pins
#: transformers==5.19.0 and leaves msgspec and pillow open; these are the versions the reproduction ran with).
IMPORT_DEPS = ("msgspec==0.23.0", "transformers==5.19.0", "pillow==13.0.0")
_MARK = ".kvwall-sha256"


class SGLangSourceUnavailable(RuntimeError):
    """The pinned SGLang wheel could not be obtained (offline, or a checksum that does not match)."""


def cache_root() -> Path:
    """``$KVWALL_CACHE`` if set, else ``~/.cache/kvwall``."""
    env = os.environ.get("KVWALL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kvwall"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, check=False)


def _download(dest: Path) -> Path:
    p = _pip(
        [
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.11",
            "--platform",
            "manylinux_2_34_x86_64",
            f"sglang=={VERSION}",
            "-d",
            str(dest),
        ]
    )
    wheel = dest / WHEEL
    if p.returncode or not wheel.exists():
        tail = (p.stdout + p.stderr).strip()[-600:]
        raise SGLangSourceUnavailable(
            f"could not download sglang=={VERSION} from PyPI (pip exited {p.returncode}): {tail}\n"
            f"This needs network access to PyPI once; after that the unpacked wheel in {cache_root()} is reused. "
            f"Offline, set KVWALL_SGLANG_SRC to a folder holding the wheel's files (sglang/ inside), or put "
            f"{WHEEL} (sha256 {WHEEL_SHA256}) in {dest}."
        )
    return wheel


def sglang_source() -> Path:
    """The folder holding SGLang 0.5.23's unpacked wheel (``sglang/``, ``sglang-0.5.23.dist-info/``): downloaded,
    checked against :data:`WHEEL_SHA256` and unpacked once, reused after. Raises :class:`SGLangSourceUnavailable`
    saying what to do when that is impossible."""
    env = os.environ.get("KVWALL_SGLANG_SRC")
    if env:
        if not (Path(env) / "sglang").is_dir():
            raise SGLangSourceUnavailable(
                f"KVWALL_SGLANG_SRC={env} has no sglang/ folder; point it at the folder "
                f"the {WHEEL} wheel was unpacked into"
            )
        return Path(env)
    target = cache_root() / f"sglang-{VERSION}"
    mark = target / _MARK
    if mark.exists() and mark.read_text().strip() == WHEEL_SHA256 and (target / "sglang").is_dir():
        return target
    downloads = cache_root() / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    wheel = downloads / WHEEL
    if not wheel.exists():
        wheel = _download(downloads)
    got = _sha256(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise SGLangSourceUnavailable(
            f"{WHEEL} has sha256 {got}, expected {WHEEL_SHA256}: refused and deleted. "
            "Run again to download it afresh; if it still differs, PyPI serves a "
            "different file than the one this book was checked against."
        )
    cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"sglang-{VERSION}-", dir=cache_root()))
    try:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        (tmp / _MARK).write_text(WHEEL_SHA256 + "\n")
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def sglang_import_deps() -> Path:
    """A folder holding :data:`IMPORT_DEPS` (installed once with ``pip install --target``), to append to
    ``sys.path`` after the venv's own packages. Raises :class:`SGLangSourceUnavailable` when pip cannot install."""
    target = cache_root() / f"sglang-{VERSION}-import-deps"
    mark = target / ".kvwall-deps"
    want = "\n".join(IMPORT_DEPS)
    if mark.exists() and mark.read_text() == want:
        return target
    cache_root().mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="sglang-deps-", dir=cache_root()))
    p = _pip(["install", "--quiet", "--target", str(tmp), *IMPORT_DEPS])
    if p.returncode:
        shutil.rmtree(tmp, ignore_errors=True)
        raise SGLangSourceUnavailable(
            f"pip could not install {' '.join(IMPORT_DEPS)} (exit {p.returncode}): "
            f"{(p.stdout + p.stderr).strip()[-600:]}"
        )
    (tmp / ".kvwall-deps").write_text(want)
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)
    return target

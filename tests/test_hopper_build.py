"""The Hopper kernels build as a library builds (:mod:`kvwall.kernels.mla_decode.hopper`), checked without a GPU.

A stand-in nvcc (a script: ``--version`` prints ``$FAKE_NVCC_VERSION``, a build logs one line to ``$FAKE_NVCC_LOG``,
waits a little and writes its ``-o`` file, or fails like nvcc with ``$FAKE_NVCC_FAIL`` set) shows: the build key
changes with the sources (a header the ``.cu`` includes too), the flags, ``nvcc --version`` and the architecture;
two builds at once run nvcc once (the lock beside the library); :func:`build_refusal` answers in one line, once per
process, without nvcc on ``PATH`` / ``CUDA_HOME`` or when nvcc fails, and never raises. With the real nvcc: the real
library builds, loads and has the host's ``Params`` (the refusal is None).
"""

from __future__ import annotations

import re
import shutil
import sys
import threading
from pathlib import Path

import pytest

from kvwall.kernels.mla_decode import hopper

FAKE_NVCC = f"""#!{sys.executable}
import os, sys, time
if "--version" in sys.argv:
    print(os.environ.get("FAKE_NVCC_VERSION", "fake nvcc 1.0"))
    sys.exit(0)
with open(os.environ["FAKE_NVCC_LOG"], "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
time.sleep(0.5)
if os.environ.get("FAKE_NVCC_FAIL"):
    print("kernel.cu(12): error: identifier \\"oops\\" is undefined", file=sys.stderr)
    print("1 error detected in the compilation of \\"kernel.cu\\".", file=sys.stderr)
    sys.exit(1)
open(sys.argv[sys.argv.index("-o") + 1], "wb").write(b"not a library")
"""


@pytest.fixture
def fake_nvcc(tmp_path, monkeypatch) -> Path:
    """A stand-in nvcc alone on PATH, a fresh build cache, no cached answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setenv("KVWALL_BUILD_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FAKE_NVCC_LOG", str(tmp_path / "nvcc.log"))
    monkeypatch.setattr(hopper, "_REFUSALS", {})
    hopper.nvcc_version.cache_clear()
    yield nvcc
    hopper.nvcc_version.cache_clear()


def _runs(tmp_path: Path) -> list[str]:
    log = tmp_path / "nvcc.log"
    return log.read_text().splitlines() if log.exists() else []


def test_the_key_covers_sources_headers_flags_nvcc_and_arch(fake_nvcc, tmp_path, monkeypatch):
    src = tmp_path / "k.cu"
    header = tmp_path / "k.cuh"
    src.write_text('#include "k.cuh"\n__global__ void k() {}\n')
    header.write_text("#pragma once\n")
    monkeypatch.setitem(hopper.SOURCES, "wgmma", src)
    nvcc, flags = str(fake_nvcc), hopper._flags(False)  # pylint: disable=protected-access
    key = hopper.build_key("wgmma", nvcc, flags)
    assert hopper.build_key("wgmma", nvcc, flags) == key
    assert hopper.build_key("wgmma", nvcc, hopper._flags(True)) != key  # pylint: disable=protected-access
    header.write_text("#pragma once\n// changed\n")
    assert hopper.build_key("wgmma", nvcc, flags) != key
    key = hopper.build_key("wgmma", nvcc, flags)
    monkeypatch.setenv("FAKE_NVCC_VERSION", "fake nvcc 2.0")
    hopper.nvcc_version.cache_clear()
    assert hopper.build_key("wgmma", nvcc, flags) != key
    key = hopper.build_key("wgmma", nvcc, flags)
    monkeypatch.setattr(hopper, "ARCH", "sm_100a")
    assert hopper.build_key("wgmma", nvcc, flags) != key


def test_the_real_sources_key_names_every_header():
    """Each kernel's key reads the shared headers (an edit of one rebuilds both)."""
    for kind in hopper.KINDS:
        names = [p.name for p in hopper._sources(hopper.SOURCES[kind])]  # pylint: disable=protected-access
        assert names == [hopper.SOURCES[kind].name, "mla_decode_hopper.cuh", "mla_decode_common.cuh"], names


def test_two_builds_at_once_run_nvcc_once(fake_nvcc, tmp_path):
    built: list[Path] = []
    threads = [threading.Thread(target=lambda: built.append(hopper.build_library("wgmma"))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 2 and built[0] == built[1] and built[0].read_bytes() == b"not a library"
    assert len(_runs(tmp_path)) == 1
    assert not list(built[0].parent.glob("*.tmp"))  # written to a temporary file and renamed
    assert hopper.build_library("wgmma") == built[0] and len(_runs(tmp_path)) == 1  # the cache answers
    hopper.build_library("wgmma", trace=True)  # another build: its own key and file
    assert len(_runs(tmp_path)) == 2 and "-DKVWALL_TRACE" in _runs(tmp_path)[1]


def test_without_nvcc_the_refusal_says_so_once(fake_nvcc, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    why = hopper.build_refusal("wgmma_tokens")
    assert why is not None and "\n" not in why and re.search(r"\bnvcc\b.*\bPATH\b", why), why  # what to install where
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-cuda"))
    assert hopper.find_nvcc() is None
    monkeypatch.setenv("CUDA_HOME", str(fake_nvcc.parent.parent))  # $CUDA_HOME/bin/nvcc is found
    assert hopper.find_nvcc() == str(fake_nvcc)
    assert hopper.build_refusal("wgmma_tokens") == why  # answered once per process
    assert not _runs(tmp_path)


def test_a_failing_nvcc_is_one_line_with_its_error(fake_nvcc, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_NVCC_FAIL", "1")
    why = hopper.build_refusal("wgmma")
    assert why is not None and "\n" not in why
    # the source that failed, and nvcc's own error (the stand-in's, in nvcc's words)
    # quoted: nvcc's error format
    assert hopper.SOURCES["wgmma"].name in why and 'identifier "oops" is undefined' in why, why
    assert not list((tmp_path / "cache").glob("*.so")) and not list((tmp_path / "cache").glob("*.tmp"))


def test_a_library_that_does_not_load_is_refused(fake_nvcc):
    """The stand-in's output is no shared library: loading it fails, and that is the reason given."""
    why = hopper.build_refusal("wgmma")
    assert why is not None and "\n" not in why and why.startswith("wgmma"), why
    assert str(hopper.build_library("wgmma")) in why, why  # the loader's error names the file it could not load


@pytest.mark.skipif(hopper.find_nvcc() is None, reason="no nvcc on this machine")
def test_the_real_library_builds_and_loads_without_a_gpu(tmp_path, monkeypatch):
    """nvcc builds the heads-on-M library here; it loads (the CUDA runtime is linked statically) and its Params
    is the mirror's size (with q_len and heads_per_token)."""
    monkeypatch.setenv("KVWALL_BUILD_CACHE", str(tmp_path))
    monkeypatch.setattr(hopper, "_REFUSALS", {})
    assert hopper.build_refusal("wgmma") is None
    assert len(list(tmp_path.glob("kvwall_mla_wgmma_*.so"))) == 1

"""Tests of kvwall.peers.flashinfer.releases: installing FlashInfer releases and driving their JIT build.

Fast tests (no network, no nvcc) check validation, error messages and the nvcc-output parser.
Slow tests install FlashInfer 0.6.12 (network, once; cached under $KVWALL_CACHE or
~/.cache/kvwall/flashinfer) and build its fa2 FP8-KV MLA kernel for sm_120a with nvcc (about 15-20 s
on a 2-core machine).  They skip, saying why, when nvcc or the package index is missing.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import go_offline, static_assert_line

from kvwall.peers.flashinfer import build, nvcc_errors, progress, releases, sources, toolchain
from kvwall.peers.flashinfer.errors import (
    InvalidConfigError,
    NetworkUnavailableError,
    NvccNotFoundError,
    ReleaseNotFoundError,
)

WALL_RELEASE = "0.6.12"  # last release whose fa2 MLA kernel cannot be built with FP8 KV


# ---------------------------------------------------------------------------------------------
# Helpers to decide what can run here
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _index_reachable() -> str:
    """'' when pip can see flashinfer-python on its index, else the reason it cannot."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "flashinfer-python", "--retries", "0", "--timeout", "15"],
        capture_output=True,
        text=True,
    )
    if proc.returncode == 0 and WALL_RELEASE in proc.stdout:
        return ""
    last = ((proc.stdout + proc.stderr).strip().splitlines() or ["no output"])[-1]
    return f"`pip index versions flashinfer-python` said: {last}"


def _cache_root() -> Path:
    return releases.default_cache_root()


def require_nvcc():
    if toolchain.find_nvcc() is None:
        pytest.skip("nvcc not found (not on PATH, no CUDA_HOME): the FlashInfer JIT build tests need the CUDA toolkit")


def require_release(release: str = WALL_RELEASE):
    """Skip unless ``release`` is installed already or the package index can be reached."""
    if releases.is_installed(release):
        return
    why = _index_reachable()
    if why:
        pytest.skip(f"flashinfer-python {release} is not cached and the package index is unreachable: {why}")


@pytest.fixture(scope="module")
def wall_build():
    """The 0.6.12 fa2 Q-bf16 / KV-e4m3 build for sm_120a (from the cache when there is one)."""
    require_nvcc()
    require_release(WALL_RELEASE)
    t0 = time.perf_counter()
    r = build.build_mla(WALL_RELEASE, "fa2", "bfloat16", "float8_e4m3fn", "sm_120a")
    return r, time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Validation: nothing is installed or built for a bad request
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVWALL_CACHE", str(root))
    return root


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(backend="fa4"), ["backend", "'fa4'", "fa2", "fa3"]),
        (dict(backend="auto"), ["backend", "fa2", "fa3"]),
        (dict(q_dtype="float32"), ["Q dtype", "bfloat16", "float16"]),
        (dict(kv_dtype="int8"), ["KV dtype", "float8_e4m3fn", "bfloat16"]),
        (dict(arch="sm_120"), ["arch", "'sm_120'", "sm_120a", "sm_90a"]),
        (dict(arch="120a"), ["arch", "sm_120a"]),
    ],
)
def test_bad_config_is_refused_before_anything_happens(empty_cache, kwargs, words):
    t0 = time.perf_counter()
    with pytest.raises(InvalidConfigError) as ei:
        build.build_mla("0.6.12", **kwargs)
    assert time.perf_counter() - t0 < 1.0
    msg = str(ei.value)
    for w in words:
        assert w in msg
    assert not empty_cache.exists(), "validation must happen before any install"


@pytest.mark.parametrize("release", ["v0.6.12", "0.6.x", "latest", "flashinfer-python==0.6.12", ""])
def test_bad_release_string(empty_cache, release):
    with pytest.raises(InvalidConfigError, match="version"):
        build.build_mla(release)
    assert not empty_cache.exists()


def test_invalid_config_is_also_a_value_error():
    with pytest.raises(ValueError):
        build.validate_config(backend="fa4")


def test_validate_config_accepts_torch_style_names():
    c = build.validate_config("fa3", "torch.bfloat16", "torch.float8_e4m3fn", "sm_90a")
    assert (c.backend, c.q_dtype, c.kv_dtype, c.arch) == ("fa3", "bfloat16", "float8_e4m3fn", "sm_90a")
    assert (c.head_dim_ckv, c.head_dim_kpe) == (512, 64)
    assert c.key == "fa3-bfloat16-float8_e4m3fn-sm_90a-512-64"


def test_cache_root_default_env_and_argument(monkeypatch, tmp_path):
    monkeypatch.delenv("KVWALL_CACHE", raising=False)
    assert releases.default_cache_root() == Path.home() / ".cache" / "kvwall" / "flashinfer"
    monkeypatch.setenv("KVWALL_CACHE", str(tmp_path / "a"))
    assert releases.default_cache_root() == tmp_path / "a"
    assert releases.release_dir("0.6.12") == tmp_path / "a" / "flashinfer-0.6.12"
    assert releases.release_dir("0.6.12", cache_root=tmp_path / "b") == tmp_path / "b" / "flashinfer-0.6.12"


def test_no_nvcc_gives_a_clear_error(empty_cache, monkeypatch, tmp_path):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    assert toolchain.find_nvcc() is None
    with pytest.raises(NvccNotFoundError) as ei:
        build.build_mla("0.6.12")
    msg = str(ei.value)
    assert "nvcc" in msg and "CUDA_HOME" in msg and "PATH" in msg
    assert not (empty_cache / "flashinfer-0.6.12").exists(), "no install without a compiler"


def test_cuda_home_without_nvcc(empty_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    assert toolchain.find_nvcc() is None
    with pytest.raises(NvccNotFoundError, match="CUDA_HOME"):
        build.build_mla("0.6.12")


def test_cached_result_needs_neither_nvcc_nor_network(empty_cache):
    assert build.cached_result("0.6.12", "fa2", "bfloat16", "float8_e4m3fn", "sm_120a") is None


def test_no_network_gives_a_clear_error(empty_cache, monkeypatch):
    go_offline(monkeypatch, empty_cache)
    t0 = time.perf_counter()
    with pytest.raises(NetworkUnavailableError) as ei:
        releases.install_release("0.6.13")
    assert time.perf_counter() - t0 < 60
    assert "network" in str(ei.value).lower()
    assert not (empty_cache / "flashinfer-0.6.13").exists()
    assert sources.why_sources_unavailable("0.6.13").startswith("NetworkUnavailableError: ")


# ---------------------------------------------------------------------------------------------
# Progress: a bar on a terminal, nothing under papermill or CI
# ---------------------------------------------------------------------------------------------


def test_progress_is_silent_off_a_terminal(capsys):
    assert not progress.on_a_terminal()  # pytest captures stderr: not a terminal
    with progress.progress("installing FlashInfer 0.6.12") as bar:
        progress.follow_ninja(bar, "[2/5] /usr/local/bin/nvcc -c x.cu")
    assert bar.disable and capsys.readouterr().err == ""


def test_progress_follows_ninja_on_a_terminal(capsys, monkeypatch):
    monkeypatch.setattr(progress, "on_a_terminal", lambda: True)
    label = "building FlashInfer 0.6.12 MLA fa2 sm_120a"
    with progress.progress(label, unit="object") as bar:
        progress.follow_ninja(bar, "[2/5] /usr/local/bin/nvcc -c x.cu")
        progress.follow_ninja(bar, "include/flashinfer/mma.cuh(523): error: static assertion failed")
        assert (bar.n, bar.total) == (2, 5)
    err = capsys.readouterr().err
    assert label in err and "2/5" in err  # the bar: its label, and ninja's count


# ---------------------------------------------------------------------------------------------
# The nvcc-output parser, on a recorded excerpt (no compiler needed)
# ---------------------------------------------------------------------------------------------

_INC = "/c/flashinfer-0.6.12/flashinfer/data/include/"
_GEN = "/w/.cache/flashinfer/0.6.12/120a/generated/"
_RECORDED = f"""\
[1/3]  /usr/local/bin/nvcc --generate-dependencies-with-compile -c {_GEN}uri/batch_mla_run.cu -o x.o
FAILED: x.o
{_INC}flashinfer/mma.cuh(523): error: static assertion failed with "DType must be 16bit floating data type"
    static_assert(sizeof(DType) == 2, "DType must be 16bit floating data type");
    ^
          detected during:
            instantiation of "void flashinfer::mma::m16k16_rowsum_f16f16f32(float *, DType *) [with DType=DTypeKV]" at line 511 of {_INC}flashinfer/attention/mla.cuh
            instantiation of "void flashinfer::mla::compute_mla_pv<KTraits>(KTraits::SharedStorage *, uint32_t, KTraits::DTypeQKAccum (*)[8], KTraits::DTypeQKAccum *, float (*)[8]) [with KTraits=flashinfer::mla::KernelTraits<false, 2U, true, 512U, 64U, 64U, 64U, DTypeQ, DTypeKV, DTypeO, IdType>]" at line 986 of {_INC}flashinfer/attention/mla.cuh
            instantiation of "cudaError_t flashinfer::mla::BatchMLAPagedAttention<MASK_MODE,HEAD_DIM_CKV,HEAD_DIM_KPE,Params>(Params, uint32_t, uint32_t, cudaStream_t) [with MASK_MODE=flashinfer::MaskMode::kNone]" at line 64 of {_GEN}uri/batch_mla_run.cu

{_INC}flashinfer/permuted_smem.cuh(80): error: static assertion failed
        static_assert(stride == 4);
        ^
          detected during instantiation of "uint32_t flashinfer::smem_t<swizzle_mode>::get_permuted_offset<stride>(uint32_t, uint32_t) [with swizzle_mode=flashinfer::SwizzleMode::k64B, stride=2U]" at line 522 of {_INC}flashinfer/attention/mla.cuh

2 errors detected in the compilation of "{_GEN}uri/batch_mla_run.cu".
nvcc fatal   : Unsupported gpu architecture 'compute_999a'
ninja: build stopped: cannot make progress due to previous errors.
"""  # noqa: E501 - nvcc's output, verbatim


def test_parse_recorded_nvcc_output():
    roots = [(_INC, ""), (_GEN, "generated/")]
    errs = nvcc_errors.parse_nvcc_output(_RECORDED, roots)
    assert len(errs) == 3
    e = errs[0]
    assert (e.file, e.line) == ("flashinfer/mma.cuh", 523)
    # quoted: nvcc's log
    assert e.message.startswith("static assertion failed")
    # quoted: FlashInfer's source
    assert e.source_line.startswith("static_assert(sizeof(DType) == 2")
    assert e.translation_unit == "generated/batch_mla_run.cu"
    # quoted: nvcc's instantiation chain
    assert e.chain == [
        "flashinfer::mma::m16k16_rowsum_f16f16f32 / flashinfer/attention/mla.cuh(511)",
        "flashinfer::mla::compute_mla_pv / flashinfer/attention/mla.cuh(986)",
        "flashinfer::mla::BatchMLAPagedAttention / generated/batch_mla_run.cu(64)",
    ]
    assert "KernelTraits<false, 2U" in e.instantiation_chain[1].signature
    e2 = errs[1]
    # quoted: FlashInfer's source
    assert (e2.file, e2.line, e2.source_line) == (
        "flashinfer/permuted_smem.cuh",
        80,
        "static_assert(stride == 4);",
    )
    # quoted: nvcc's instantiation chain
    assert e2.chain == ["flashinfer::smem_t::get_permuted_offset / flashinfer/attention/mla.cuh(522)"]
    # quoted: nvcc's log
    assert (errs[2].file, errs[2].line) == ("", 0) and "Unsupported gpu architecture" in errs[2].message


def test_result_json_round_trip():
    errs = nvcc_errors.parse_nvcc_output(_RECORDED, [(_INC, ""), (_GEN, "generated/")])
    r = build.BuildResult(
        release="0.6.12",
        config=build.validate_config(),
        status="nvcc_failed",
        duration_s=12.5,
        errors=tuple(errs),
        refusal=build.PythonRefusal("ValueError", "no", "flashinfer/mla/_core.py:1", "plan checks"),
    )
    back = build.BuildResult.from_json(r.to_json())
    assert back.from_cache and back.errors == r.errors and back.refusal == r.refusal and back.config == r.config
    assert "flashinfer/mma.cuh(523)" in back.summary()


# ---------------------------------------------------------------------------------------------
# The real wall: FlashInfer 0.6.12, fa2, FP8 KV, sm_120a (nvcc + network or a warm cache)
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_wall_release_fails_in_nvcc_at_the_static_assert(wall_build):
    r, _ = wall_build
    assert r.status == "nvcc_failed", r.summary()
    assert r.release == WALL_RELEASE and r.config.key == "fa2-bfloat16-float8_e4m3fn-sm_120a-512-64"
    assert r.refusal is None and r.python_checks == "ran"
    line = static_assert_line(WALL_RELEASE)
    hits = [e for e in r.errors if e.file == "flashinfer/mma.cuh" and e.line == line]
    assert hits, r.summary()
    e = hits[0]
    # quoted: nvcc's log
    assert "static assertion failed" in e.message
    # quoted: FlashInfer's source
    assert "sizeof(DType) == 2" in e.source_line
    assert e.instantiation_chain[0].function == "flashinfer::mma::m16k16_rowsum_f16f16f32"
    assert any(f.function == "flashinfer::mla::compute_mla_pv" for f in e.instantiation_chain)
    assert any(f.file == "flashinfer/attention/mla.cuh" for f in e.instantiation_chain)
    # The two innermost frames point at real call sites in the installed mla.cuh (outer ones sit
    # inside dispatch macros, so their lines need not name the callee).
    for f in e.instantiation_chain[:2]:
        assert f.file == "flashinfer/attention/mla.cuh"
        called = f.function.split("::")[-1]
        assert called in sources.read_source(WALL_RELEASE, f.file, f.line, context=0).text
    # The second wall: permuted_smem.cuh static_assert(stride == 4).
    # quoted: FlashInfer's source
    assert any(e.file == "flashinfer/permuted_smem.cuh" and "stride == 4" in e.source_line for e in r.errors)
    assert "include/flashinfer/mma.cuh(" in r.compiler_output


@pytest.mark.slow
def test_wall_build_is_cached(wall_build):
    first, _ = wall_build
    t0 = time.perf_counter()
    again = build.build_mla(WALL_RELEASE, "fa2", "bfloat16", "float8_e4m3fn", "sm_120a")
    assert time.perf_counter() - t0 < 1.0
    assert again.from_cache
    assert (again.status, again.errors, again.duration_s) == (first.status, first.errors, first.duration_s)
    assert build.cached_result(WALL_RELEASE, "fa2", "bfloat16", "float8_e4m3fn", "sm_120a") == again


@pytest.mark.slow
def test_read_source_and_find_definition():
    require_release(WALL_RELEASE)
    line = static_assert_line(WALL_RELEASE)
    ex = sources.read_source(WALL_RELEASE, "include/flashinfer/mma.cuh", line, context=2)
    assert ex.file == "flashinfer/mma.cuh"
    # quoted: FlashInfer's source
    assert "static_assert(sizeof(DType) == 2" in ex.text
    assert [n for n, _ in ex.lines] == list(range(line - 2, line + 3))
    assert "m16k16_rowsum_f16f16f32" in ex.render()
    pv = sources.find_definition(WALL_RELEASE, "flashinfer::mla::compute_mla_pv")
    files = [loc.file for loc in pv]
    assert "flashinfer/attention/mla.cuh" in files  # (mla_hopper.cuh has its own)
    loc = pv[files.index("flashinfer/attention/mla.cuh")]
    assert "compute_mla_pv" in sources.read_source(WALL_RELEASE, "attention/mla.cuh", loc.line, 0).text
    assert "__device__" in sources.read_source(WALL_RELEASE, loc.file, loc.line, 0).text
    assert sources.find_definition(WALL_RELEASE, "no_such_function_anywhere") == []
    with pytest.raises(FileNotFoundError, match="flashinfer/mma.cuh"):
        sources.read_source(WALL_RELEASE, "flashinfer/no_such.cuh", 1)


@pytest.mark.slow
def test_release_that_does_not_exist():
    why = _index_reachable()
    if why:
        pytest.skip(f"package index unreachable: {why}")
    with pytest.raises(ReleaseNotFoundError) as ei:
        releases.install_release("0.6.999", cache_root=_cache_root() / "_test-missing")
    assert "0.6.999" in str(ei.value) and "published versions" in str(ei.value)
    assert not (_cache_root() / "_test-missing" / "flashinfer-0.6.999").exists()
    shutil.rmtree(_cache_root() / "_test-missing", ignore_errors=True)

"""Chapter 2, the wall: the timeline experiment, the GPU driver's plumbing, offline installs, and
the chapter itself under papermill on a CPU.

What a build *did* is never typed here: the static_assert's line is read from the installed
release's own ``mma.cuh``, and the chapter's structured result is compared with it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import BOOK, background_job, go_offline, run_chapter, static_assert_line
from kvwall.peers.flashinfer import build, nvcc_errors, releases, toolchain
from kvwall.peers.flashinfer.errors import InvalidConfigError, NetworkUnavailableError
from kvwall.experiments import EXPERIMENTS, run_experiment
from kvwall.experiments import wall
from kvwall.results import load_result

WALL = "0.6.12"


# ---------------------------------------------------------------------------------------------
# Classifying builds (no compiler needed)
# ---------------------------------------------------------------------------------------------


def _result(status, errors=(), refusal=None):
    return build.BuildResult(
        release="0.6.12",
        config=build.validate_config(),
        status=status,
        duration_s=1.0,
        errors=tuple(errors),
        refusal=refusal,
    )


def test_classify_each_outcome():
    frame = nvcc_errors.InstantiationFrame(
        "flashinfer::mma::m16k16_rowsum_f16f16f32", "flashinfer/attention/mla.cuh", 511
    )
    sa = nvcc_errors.CompilerError(
        "flashinfer/mma.cuh", 523, 'static assertion failed with "x"', "static_assert(x);", (frame,)
    )
    other = nvcc_errors.CompilerError("generated/batch_mla_run.cu", 42, "operator -> applied to ...")
    c = wall.classify(_result("nvcc_failed", [other, sa]))
    assert (c["outcome"], c["assert_file"], c["assert_line"], c["reached_from_mla"]) == (
        "static_assert",
        "flashinfer/mma.cuh",
        523,
        True,
    )
    # quoted: nvcc's instantiation chain
    assert c["chain"] == ["flashinfer::mma::m16k16_rowsum_f16f16f32 / flashinfer/attention/mla.cuh(511)"]
    assert wall.classify(_result("nvcc_failed", [other]))["outcome"] == "failed_elsewhere"
    assert wall.classify(_result("compiled"))["outcome"] == "compiled"
    refused = wall.classify(_result("python_refused", refusal=build.PythonRefusal("ValueError", "SM90 only")))
    assert refused["outcome"] == "refused"
    assert set(wall.OUTCOMES) >= {"compiled", "static_assert", "failed_elsewhere", "refused", "unavailable"}


def test_compiler_excerpt_starts_at_the_first_error():
    out = "[1/3] nvcc ...\nFAILED: x.o\ninclude/flashinfer/mma.cuh(523): error: static assertion failed\n  line\n"
    assert wall.compiler_excerpt(out, lines=2) == "\n".join(out.splitlines()[2:4])  # from nvcc's first error
    assert wall.compiler_excerpt("all good\n") == ""


# ---------------------------------------------------------------------------------------------
# Bad input: clear errors naming the allowed values, before anything is installed or built
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("KVWALL_CACHE", str(root))
    return root


@pytest.mark.parametrize(
    "override, words",
    [
        ({"releases": ["v0.6.12"]}, ["version", "0.6.12"]),
        ({"releases": ["latest"]}, ["version"]),
        ({"configs": [["fa4", "sm_90a"]]}, ["backend", "'fa4'", "fa2", "fa3"]),
        ({"configs": [["fa2", "sm120a"]]}, ["arch", "'sm120a'", "sm_120a"]),
        ({"configs": [["fa2", "sm_120"]]}, ["arch", "sm_120a", "sm_90a"]),
    ],
)
def test_timeline_bad_input(empty_cache, override, words):
    t0 = time.perf_counter()
    with pytest.raises(InvalidConfigError) as info:
        run_experiment("wall_timeline", torch.device("cpu"), "small", **override)
    assert time.perf_counter() - t0 < 2
    for w in words:
        assert w in str(info.value)
    assert not empty_cache.exists(), "nothing may be installed for a bad request"


def test_timeline_unknown_parameter():
    with pytest.raises(TypeError, match="releases"):
        run_experiment("wall_timeline", torch.device("cpu"), "small", release="0.6.12")


def test_wall_on_gpu_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(RuntimeError, match=r"^wall_on_gpu\b.*CUDA"):
        run_experiment("wall_on_gpu", torch.device("cpu"), "small")
    assert "cuda" in EXPERIMENTS["wall_on_gpu"].requires and "cuda" not in EXPERIMENTS["wall_timeline"].requires
    assert "nvcc" in EXPERIMENTS["wall_timeline"].requires


# ---------------------------------------------------------------------------------------------
# The GPU driver's plumbing, on a CPU
# ---------------------------------------------------------------------------------------------


def test_gpu_cases_plan():
    spec_wall, spec_fp8 = wall._GPU_RELEASES[0], wall._GPU_RELEASES[2]
    assert spec_wall["release"] == WALL and spec_wall["expect_wall"]
    warm = wall._warm_cases(spec_wall)
    assert warm == [{"backend": "fa2", "kv": "float8_e4m3fn", "context_len": 1024, "run_in_warm": True}]
    warm = wall._warm_cases(spec_fp8)
    assert {(c["backend"], c["kv"]) for c in warm} == {
        (b, k) for b in ("fa2", "fa3") for k in ("float8_e4m3fn", "bfloat16")
    }
    planned = {
        "cases": [
            {"backend": "fa3", "kv": "float8_e4m3fn", "status": "planned"},
            {"backend": "fa3", "kv": "bfloat16", "status": "planned"},
            {"backend": "fa2", "kv": "float8_e4m3fn", "status": "failed"},
            {"backend": "fa2", "kv": "bfloat16", "status": "planned"},
        ]
    }
    cases = wall._measure_cases(spec_fp8, planned, [4096, 32768])
    assert len(cases) == 6 and not any(c["backend"] == "fa2" and c["kv"] == "float8_e4m3fn" for c in cases)
    assert all(c["compare_bf16"] == (c["kv"] == "float8_e4m3fn") for c in cases)


def test_jit_exception_is_parsed_into_compiler_errors():
    inc = "/x/flashinfer-0.6.12/flashinfer/data/include/"
    message = (
        "Ninja build failed. Ninja output:\n[1/3] nvcc ... -c /w/gen/batch_mla_run.cu\nFAILED: a.o\n"
        f'{inc}flashinfer/mma.cuh(523): error: static assertion failed with "DType must be 16bit"\n'
        '    static_assert(sizeof(DType) == 2, "DType must be 16bit");\n    ^\n'
        "          detected during:\n"
        f'            instantiation of "void flashinfer::mma::m16k16_rowsum_f16f16f32(float *, DType *) '
        f'[with DType=DTypeKV]" at line 511 of {inc}flashinfer/attention/mla.cuh\n'
    )
    errs = wall._parse_compiler_errors({"message": message}, {"include_dir": inc.rstrip("/")})
    assert errs[0]["file"] == "flashinfer/mma.cuh" and errs[0]["line"] == 523
    # quoted: nvcc's instantiation chain
    assert errs[0]["chain"] == ["flashinfer::mma::m16k16_rowsum_f16f16f32 / flashinfer/attention/mla.cuh(511)"]
    # quoted: torch's error
    assert wall._parse_compiler_errors({"message": "CUDA out of memory"}, {}) == []


def test_a_driver_that_dies_is_a_row_not_a_crash(tmp_path):
    log = tmp_path / "x.log"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )
    d = wall._finish_release(
        proc,
        {"result_path": str(tmp_path / "none.json"), "log_path": str(log), "started": time.perf_counter()},
        time.perf_counter() + 30,
    )
    assert d["error"] == "driver" and d["returncode"] == 3 and "boom" in d["output_tail"]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    d = wall._finish_release(
        proc,
        {"result_path": str(tmp_path / "none.json"), "log_path": str(log), "started": time.perf_counter()},
        time.perf_counter() + 1,
    )
    assert d["error"] == "timeout"
    row = wall._release_row("0.6.14", "warm", d, 4)
    assert row["error"] == "timeout" and row["cases_done"] == 0


# ---------------------------------------------------------------------------------------------
# Offline installs (KVWALL_WHEELHOUSE) and dependency pins the index no longer carries
# ---------------------------------------------------------------------------------------------


def test_wheelhouse_that_is_not_a_folder(empty_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("KVWALL_WHEELHOUSE", str(tmp_path / "nowhere"))
    with pytest.raises(NetworkUnavailableError, match="KVWALL_WHEELHOUSE"):
        releases.install_release("0.6.12")


def test_release_missing_from_the_wheelhouse(empty_cache, monkeypatch, tmp_path):
    house = tmp_path / "wheels"
    house.mkdir()
    monkeypatch.setenv("KVWALL_WHEELHOUSE", str(house))
    t0 = time.perf_counter()
    with pytest.raises(NetworkUnavailableError) as info:
        releases.install_release("0.6.12")
    assert time.perf_counter() - t0 < 30
    # the release asked for, and the wheelhouse it is missing from
    assert "0.6.12" in str(info.value) and f"KVWALL_WHEELHOUSE={str(house)!r}" in str(info.value)
    assert not (empty_cache / "flashinfer-0.6.12").exists()


@pytest.mark.slow
def test_install_from_a_wheelhouse(empty_cache, monkeypatch, tmp_path):
    """The GPU machine's path: everything from a folder of wheels, the index unreachable."""
    house = tmp_path / "wheels"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(house),
            f"flashinfer-python=={WALL}",
            "apache-tvm-ffi==0.1.11",
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot fetch the wheels to fill a wheelhouse: {proc.stderr[-300:]}")
    monkeypatch.setenv("KVWALL_WHEELHOUSE", str(house))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # any use of an index would fail
    rdir = releases.install_release(WALL)
    rec = releases.install_record(WALL)
    assert rec["wheelhouse"] == str(house.resolve()) and rec["source"] == {"from": "wheel"}
    assert (rdir / "flashinfer" / "data" / "include" / "flashinfer" / "mma.cuh").is_file()
    assert any(d.startswith("apache-tvm-ffi") for d in rec["dependencies"])
    assert any(p.name.startswith("apache_tvm_ffi-0.1.11") for p in rdir.glob("*.dist-info"))


def test_nearest_published_version_for_a_removed_pin():
    out = (
        "ERROR: Could not find a version that satisfies the requirement x==0.1.0b15 "
        "(from versions: 0.1.0, 0.1.1, 0.1.10)"
    )
    assert releases._nearest_published("apache-tvm-ffi==0.1.0b15", out) == "apache-tvm-ffi==0.1.0"
    assert releases._nearest_published("apache-tvm-ffi>=0.1", out) is None
    assert releases._nearest_published("apache-tvm-ffi==0.2.0", out) is None


@background_job
def sdist_install(out: Path):
    """FlashInfer 0.4.1 installed into a release cache at ``out`` (pip builds its wheel): a background job."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "flashinfer-python"], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip("package index unreachable")
    return releases.install_release("0.4.1", cache_root=out), releases.install_record("0.4.1", cache_root=out)


@pytest.mark.slow
def test_sdist_only_release_installs_without_compiling(background):
    """0.4.1 is on PyPI only as a source distribution: its own backend builds a pure-Python wheel."""
    rdir, rec = background(sdist_install)
    assert rec["source"]["from"] == "sdist" and rec["source"]["wheel_built"].endswith("-py3-none-any.whl")
    assert (rdir / "flashinfer" / "data" / "include" / "flashinfer" / "attention" / "mla.cuh").is_file()
    assert "apache-tvm-ffi==0.1.0b15" in rec["substituted"]


# ---------------------------------------------------------------------------------------------
# The recorded timeline
# ---------------------------------------------------------------------------------------------


def test_recorded_timeline_is_complete():
    rec = load_result("wall_timeline")
    cells = {(r["release"], r["backend"], r["arch"]): r for r in rec.table("timeline")}
    for release in ("0.4.1", "0.5.3", "0.6.0", "0.6.12", "0.6.13", "0.6.14", "0.6.17", "0.6.18.post1"):
        assert release in rec.params["releases"]
    newest_07 = [r for r in rec.params["releases"] if r.startswith("0.7.")]
    assert newest_07, "the timeline needs the newest 0.7.x"
    for release in rec.params["releases"]:
        for backend, arch in wall.TIMELINE_CONFIGS:
            cell = cells[(release, backend, arch)]
            assert cell["outcome"] in wall.OUTCOMES
            assert cell["outcome"] != "unavailable", cell.get("reason")
            assert cell["q_dtype"] == "bfloat16" and cell["kv_dtype"] == "float8_e4m3fn"
            if cell["outcome"] == "static_assert":
                assert cell["assert_file"] and cell["assert_line"] > 0 and cell["chain"]
            if cell["outcome"] == "refused":
                assert cell["refusal_message"] and cell["refusal_type"]
            if cell["status"] != "error":
                assert cell["nvcc_version"]
    assert rec.table("toolchain")[0]["nvcc_version"]
    # The wall itself: 0.6.12 fa2 stops at the 16-bit static_assert in mma.cuh, reached from mla.cuh.
    w = cells[(WALL, "fa2", "sm_120a")]
    assert w["outcome"] == "static_assert" and w["assert_file"] == "flashinfer/mma.cuh" and w["reached_from_mla"]
    if releases.is_installed(WALL):
        assert w["assert_line"] == static_assert_line(WALL)


# ---------------------------------------------------------------------------------------------
# The chapter, under papermill on a CPU
# ---------------------------------------------------------------------------------------------


def _check_wall_builds(builds):
    line = static_assert_line(WALL)
    assert {b["arch"] for b in builds} == {"sm_120a", "sm_90a"}
    for b in builds:
        assert b["release"] == WALL and b["status"] == "nvcc_failed" and b["outcome"] == "static_assert"
        assert (b["assert_file"], b["assert_line"]) == ("flashinfer/mma.cuh", line)
        # quoted: FlashInfer's source
        assert "sizeof(DType) == 2" in b["assert_source"]
        assert b["reached_from_mla"]
        # quoted: nvcc's instantiation chain
        assert b["chain"][0].startswith("flashinfer::mma::m16k16_rowsum_f16f16f32 / flashinfer/attention/mla.cuh(")
        # quoted: nvcc's instantiation chain
        assert any(f.startswith("flashinfer::mla::compute_mla_pv / flashinfer/attention/mla.cuh(") for f in b["chain"])


@pytest.mark.slow
def test_chapter_2_on_cpu(executed):
    if toolchain.find_nvcc() is None:
        pytest.skip("no nvcc: test_chapter_2_without_nvcc covers this machine")
    rec = executed(BOOK / "02_the_wall.md")
    v = rec["values"]
    assert rec["mode"] == "cpu"
    assert rec["duration_s"] < 240, "chapter 2 must run in 4 minutes on a CPU"
    assert v["build_live"] is True and v["wall_release"] == WALL
    _check_wall_builds(v["builds"])
    # quoted: FlashInfer's source
    assert "static_assert(sizeof(DType) == 2" in v["assert_source_line"]
    assert v["pv_source_has_call"]
    assert "mma.cuh" not in (v["claim_line_text"] or "")
    assert v["timeline_cells"] == len(load_result("wall_timeline").table("timeline"))
    assert {u["experiment"] for u in rec["recorded_used"]} >= {"wall_timeline"}


@background_job
def chapter_2_without_nvcc(tmp_path: Path) -> dict:
    """Chapter 2 under papermill with no nvcc on PATH and an empty build cache (a background job): its record."""
    if not releases.is_installed(WALL):
        pytest.skip(f"FlashInfer {WALL} is not installed here, so its sources cannot be read to check the line")
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run_chapter_2_without_nvcc(tmp_path, monkeypatch)


def _run_chapter_2_without_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").symlink_to(sys.executable)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{bin_dir}:/usr/bin:/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    # An empty build cache (the release itself stays readable from the default cache for the sources).
    empty = tmp_path / "cache"
    empty.mkdir()
    (empty / f"flashinfer-{WALL}").symlink_to(releases.release_dir(WALL, releases.default_cache_root()))
    monkeypatch.setenv("KVWALL_CACHE", str(empty))
    if shutil.which("nvcc") is not None:
        pytest.skip(f"nvcc is still on PATH at {shutil.which('nvcc')}")
    return run_chapter(BOOK / "02_the_wall.md", tmp_path, mode="cpu")


@pytest.mark.slow
def test_chapter_2_without_nvcc_shows_the_recorded_build(background):
    v = background(chapter_2_without_nvcc)["values"]
    assert v["build_live"] is False
    assert "NvccNotFoundError" in v["build_caption"] and "Recorded on" in v["build_caption"]
    _check_wall_builds(v["builds"])


@background_job
def chapter_2_offline(tmp_path: Path) -> tuple[dict, Path]:
    """Chapter 2 under papermill offline, its release cache empty (a background job): its record, and the folder
    holding the run (``run/``) and the cache (``empty-cache/``)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        go_offline(monkeypatch, tmp_path / "empty-cache")
        return run_chapter(BOOK / "02_the_wall.md", tmp_path / "run", mode="cpu"), tmp_path


@pytest.mark.slow
def test_chapter_2_offline_with_an_empty_cache_shows_recorded_evidence(background):
    """A fresh machine without network: no FlashInfer release in the cache and none installable. The
    chapter runs its live path (the build, the source lookups), each fails for want of the release, and
    it falls back to the recorded build with a visible note instead of failing."""
    rec, tmp_path = background(chapter_2_offline)
    cache = tmp_path / "empty-cache"
    v = rec["values"]
    assert v["build_live"] is False and v["sources_live"] is False
    why = "NvccNotFoundError" if toolchain.find_nvcc() is None else "NetworkUnavailableError"
    assert why in v["build_caption"] and "Recorded on" in v["build_caption"]
    recorded = {(r["release"], r["backend"], r["arch"]): r for r in load_result("wall_timeline").table("timeline")}
    for b in v["builds"]:
        r = recorded[(b["release"], b["backend"], b["arch"])]
        assert (b["outcome"], b["assert_file"], b["assert_line"], b["chain"]) == (
            r["outcome"],
            r["assert_file"],
            r["assert_line"],
            r["chain"],
        )
    assert {b["arch"] for b in v["builds"]} == {"sm_120a", "sm_90a"}
    assert v["assert_source_line"] is None and v["claim_line_text"] is None
    # What the page's sentences say about it: the values the chapter glued into them (myst-nb's glue outputs).
    notebook = json.loads(next((tmp_path / "run").glob("*.ipynb")).read_text())
    glued = {
        o["metadata"]["scrapbook"]["name"]: "".join(o["data"].get("application/papermill.record/text/plain", ""))
        for c in notebook["cells"]
        for o in c.get("outputs", [])
        if "scrapbook" in o.get("metadata", {})
    }
    assert glued["build_status"].startswith("'recorded")  # not built live; the build's caption says why (above)
    assert glued["sources_status"].startswith("'not")
    assert not any(cache.iterdir()), "nothing may be left in the cache by failed installs"


def test_instantiation_note_without_a_file_is_in_the_error_file():
    """EDG leaves out "of FILE" when the instantiation is in the file of the error itself (seen in
    the fa3 builds: mla_hopper.cuh errors instantiated from mla_hopper.cuh)."""
    inc = "/r/flashinfer/data/include/"
    out = (
        f'{inc}flashinfer/attention/mla_hopper.cuh(339): error: class "W<DTypeKV, 16>" has no member "op"\n'
        "      wgmma::op< false>(desc_p, desc_ckv, o_frag);\n"
        "          detected during:\n"
        '            instantiation of "void flashinfer::mla::hopper::compute_mla_pv<KTraits>(float *) [with K=1]" '
        "at line 762\n"
        '            instantiation of "cudaError_t flashinfer::mla::BatchMLAPageAttentionHopper<M>(P) [with M=0]" '
        "at line 62 of /g/batch_mla_sm90_run.cu\n"
    )
    e = nvcc_errors.parse_nvcc_output(out, [(inc, "")])[0]
    # quoted: nvcc's instantiation chain
    assert e.chain == [
        "flashinfer::mla::hopper::compute_mla_pv / flashinfer/attention/mla_hopper.cuh(762)",
        "flashinfer::mla::BatchMLAPageAttentionHopper / /g/batch_mla_sm90_run.cu(62)",
    ]

"""Our fused kernel on architectures we have no GPU for: Triton's offline compile of every launch shape we ship or
try -- the launcher's fallback per architecture, every tuned shape, every tuner candidate -- for sm_90, sm_100 and
sm_120, held against each architecture's limits, must agree with what the launcher picks and what the cost model
(and chapter 6) says runs where. Compiled with the GPU machines' Triton (requirements-triton-gpu.txt, installed by
`make setup` apart from the environment's own): registers and spills differ between Triton versions.

The fused kernel's two wgmma paths are compiled by nvcc for their only target, sm_90a -- the wgmma path
(mla_decode_wgmma.cu, one row) and the tokens-on-M wgmma path (mla_decode_wgmma_tokens.cu, one row per shipped
instantiation: 16 and 32 heads per CTA): each must compile, never spill nor keep a stack frame, and fit an H100 / H200
block's shared memory; chapter 6's table and text show them."""

import re
import shutil
from pathlib import Path

import pytest

from kvwall.kernels.mla_decode import launch_shape as mla
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig
from kvwall.model.cost import FUSED_MAX_HEADS
from kvwall.tuning import arch_check_cuda
from kvwall.tuning import arch_check
from kvwall.tuning.arch_check import (
    ARCHS,
    CANDIDATE_HEADS,
    FUSED,
    PINNED_TRITON_ENV,
    PinnedTritonMissing,
    check_architectures,
    fallback_config,
    format_rows,
    pinned_triton_dir,
    pinned_triton_requirement,
    pinned_triton_version,
    tmem_columns,
    tuned_arch,
    tuned_shapes,
    wgmma_builds,
)
from kvwall.reports import original_gpu_report
from kvwall.tuning.arch_check_cuda import TOKENS_KERNEL, WGMMA_KERNEL, WGMMA_ROLES
from kvwall.tuning.fused import candidates

pytestmark = pytest.mark.slow

HEADS = (16, 32, 64, 128)
#: The Triton of the GPU machines where we tune and record (requirements-triton-gpu.txt).
GPU_TRITON = "3.6.0"
REQUIREMENTS = Path(__file__).resolve().parents[1] / "requirements-triton-gpu.txt"


@pytest.fixture(scope="module")
def builds():
    if pinned_triton_version() is None:
        pytest.skip(
            f"the GPU machines' Triton is not installed in {pinned_triton_dir()}: `make setup` installs it "
            "(requirements-triton-gpu.txt)"
        )
    return check_architectures(HEADS, cast_kernels=True, every_shape=True, wgmma=True)


def _fused(builds, role):
    return [b for b in builds if b["kernel"] == FUSED and b["role"] == role]


def _says(b) -> str:
    """One row in words, for failure messages."""
    return (
        f"{b['role']} {b['arch']}, {b['heads']} heads ({b['shape']}): shared {b['shared_bytes']} of "
        f"{b['shared_limit']} B, tensor memory {b['tmem_columns']} of {b['tmem_limit']} columns, trap-only "
        f"{b['trap_only']}, {b['regs']} regs, spills {b['spills']} B/thread"
        + (f", error {b['error']}" if b["error"] else "")
    )


def test_the_pinned_triton_is_the_gpu_machines(builds):
    assert f"triton=={GPU_TRITON}" in REQUIREMENTS.read_text().split()
    assert pinned_triton_version() == GPU_TRITON, f"{pinned_triton_dir()}: rerun `make setup`"
    by_triton = {b["triton"] for b in builds if "CUDA" not in b["kernel"]}
    assert by_triton == {GPU_TRITON}, f"compiled with Triton {by_triton}, not the GPU machines' {GPU_TRITON}"


def test_a_missing_pinned_triton_is_an_error_naming_make_setup(tmp_path, monkeypatch):
    monkeypatch.setenv(PINNED_TRITON_ENV, str(tmp_path))
    assert pinned_triton_dir() == tmp_path and pinned_triton_version() is None
    with pytest.raises(PinnedTritonMissing, match="make setup"):
        check_architectures((16,))


def test_the_pin_is_read_from_the_requirements_file(tmp_path):
    assert pinned_triton_requirement() == GPU_TRITON
    (tmp_path / "req.txt").write_text("# a comment\n  triton == 9.8.7\n")
    assert pinned_triton_requirement(tmp_path / "req.txt") == "9.8.7"
    assert pinned_triton_requirement(tmp_path / "none.txt") is None


def test_without_the_folder_the_running_triton_is_used_when_it_is_the_pin(tmp_path, monkeypatch):
    """Issue 24, finding 13: on the H200 the running Triton is the pinned 3.6.0 itself, with no triton-gpu folder;
    chapter 6 in GPU mode must compile with it, not stop with PinnedTritonMissing."""
    monkeypatch.setenv(PINNED_TRITON_ENV, str(tmp_path))
    here = []
    monkeypatch.setattr(arch_check, "_check_here", lambda *args: here.append(args) or [{"triton": "running"}])
    monkeypatch.setattr(arch_check, "pinned_triton_requirement", lambda: arch_check.triton.__version__)
    assert check_architectures((16,)) == [{"triton": "running"}] and here == [((16,), False, False)]
    monkeypatch.setattr(arch_check, "pinned_triton_requirement", lambda: "0.0.1")
    running = re.escape(arch_check.triton.__version__)
    with pytest.raises(PinnedTritonMissing, match=rf"{running}\b.*\b0\.0\.1\b"):  # the running Triton, the pin
        check_architectures((16,))
    assert len(here) == 1


def test_every_role_is_compiled_for_every_architecture(builds):
    fallback = _fused(builds, "fallback")
    assert sorted((b["heads"], b["cap"]) for b in fallback) == sorted((h, a.cap) for h in HEADS for a in ARCHS)
    tuned = _fused(builds, "tuned")
    assert {(b["heads"], MLADecodeConfig(**b["config"]), b["cap"]) for b in tuned} == {
        (h, cfg, a.cap) for h, cfg, _ in tuned_shapes() for a in ARCHS
    }
    cands = _fused(builds, "candidate")
    assert {(b["heads"], MLADecodeConfig(**b["config"]), b["cap"]) for b in cands} == {
        (h, cfg, a.cap) for h in CANDIDATE_HEADS for cfg in candidates(h) for a in ARCHS
    }


def test_tuned_shapes_are_shipped_on_the_tuned_gpus_architecture_only(builds):
    assert tuned_arch("NVIDIA H200") == 90 and tuned_arch("NVIDIA B200") == 100 and tuned_arch("NVIDIA-unknown") is None
    tuned = _fused(builds, "tuned")
    assert tuned and all(b["shipped"] == (b["cap"] == 90) for b in tuned), [_says(b) for b in tuned]
    assert all(b["shipped"] for b in _fused(builds, "fallback"))
    assert not any(b["shipped"] for b in _fused(builds, "candidate"))


def test_every_shipped_shape_fits(builds):
    bad = [_says(b) for b in builds if b["kernel"] == FUSED and b["shipped"] and not b["fits"]]
    assert not bad, "shipped launch shapes that would not launch:\n" + "\n".join(bad)


def test_no_shipped_shape_spills(builds):
    """Local memory per thread (the stack frame ptxas gives spilled registers) of every shipped shape is zero."""
    bad = [_says(b) for b in builds if b["kernel"] == FUSED and b["shipped"] and b["spills"] != 0]
    assert not bad, f"shipped launch shapes that spill registers (Triton {GPU_TRITON}):\n" + "\n".join(bad)


def test_fallback_rows_are_the_launchers_pick_on_that_architecture(builds):
    """The row (the launcher's own pick, asked in the pinned Triton's process) is, by this module's compiles, the
    first of the launcher's preferences that fits and does not spill (of those compiled here as rows too); the last
    one where none does."""
    for b in _fused(builds, "fallback"):
        preferences, picked = mla.fallback_shapes(b["heads"]), MLADecodeConfig(**b["config"])
        assert picked in preferences, _says(b)
        assert picked == preferences[-1] or (b["fits"] and not b["spills"]), _says(b)
        rows = {MLADecodeConfig(**r["config"]): r for r in builds if r["kernel"] == FUSED and r["cap"] == b["cap"]}
        better = [
            cfg
            for cfg in preferences[: preferences.index(picked)]
            if cfg in rows and rows[cfg]["fits"] and not rows[cfg]["spills"]
        ]
        assert not better, f"{_says(b)}: an earlier preference fits without spilling: {better}"


def test_every_head_count_has_a_fitting_fallback_on_every_architecture(builds):
    """The launcher never fails to launch: each head count's pick fits every architecture."""
    bad = [_says(b) for b in _fused(builds, "fallback") if not b["fits"]]
    assert not bad, "no fitting fallback shape:\n" + "\n".join(bad)


def test_every_candidate_compiled_or_explained(builds):
    cands = _fused(builds, "candidate")
    assert all((b["shared_bytes"] is not None) != (b["error"] is not None) for b in cands), [
        _says(b) for b in cands if (b["shared_bytes"] is None) == (b["error"] is None)
    ]
    misfits = [b for b in cands if not b["fits"]]
    print("\ncandidates that do not fit (allowed: the tuner tries them, nothing ships them):")
    print(format_rows(misfits) if misfits else "none")


def test_tensor_memory_is_read_and_held_against_sm100(builds):
    fused = [b for b in builds if b["kernel"] == FUSED and b["error"] is None]
    assert all(b["tmem_columns"] is not None for b in fused), [_says(b) for b in fused if b["tmem_columns"] is None]
    assert all(b["tmem_columns"] == 0 for b in fused if b["cap"] != 100)
    on_sm100 = [b for b in fused if b["cap"] == 100]
    assert any(b["tmem_columns"] for b in on_sm100), "no shape allocates tensor memory on SM100: parsing broke?"
    assert all(not b["fits"] for b in on_sm100 if b["tmem_columns"] > 512)
    assert all(b["tmem_columns"] > 512 for b in on_sm100 if b["trap_only"]), (
        "a trap-only SM100 kernel with its tensor memory within 512 columns: some other limit was hit"
    )


def test_tmem_columns_reads_the_ptx_allocation_then_the_metadata():
    class Compiled:
        def __init__(self, ptx, tmem_size):
            self.asm = {"ptx": ptx}
            self.metadata = type("Meta", (), {"tmem_size": tmem_size})()

    alloc = "\t@%p18 tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%r287], 128;\n"
    assert tmem_columns(Compiled(alloc, 0)) == 128
    assert tmem_columns(Compiled(alloc + alloc.replace("128", "64"), 0)) == 192
    assert tmem_columns(Compiled("\ttrap;\n", 576)) == 576  # a trap-only kernel: no allocation left in its PTX
    assert tmem_columns(Compiled(alloc.replace("128", "%r9"), 256)) == 256  # a count in a register


def test_cast_kernels_fit_every_architecture(builds):
    gathers = [b for b in builds if b["kernel"].startswith("gather_cast")]
    triton_ones = [b for b in gathers if "Triton" in b["kernel"]]
    assert len(triton_ones) == len(ARCHS) and all(b["fits"] and b["spills"] == 0 for b in triton_ones), [
        _says(b) for b in triton_ones
    ]
    cuda = [b for b in gathers if "CUDA" in b["kernel"]]
    if cuda and cuda[0]["error"] and "nvcc is not on PATH" in cuda[0]["error"]:
        pytest.skip("no nvcc on this machine: the CUDA C++ twin was not compiled")
    assert len(cuda) == len(ARCHS) and all(b["fits"] and b["regs"] for b in cuda), cuda


def test_what_fits_is_what_the_cost_model_offers(builds):
    """The cost model offers the fused path on an architecture up to FUSED_MAX_HEADS heads: exactly the head counts
    whose fallback shape fits there."""
    says = {}  # per architecture: the most heads up to which every head count's fallback fits (None: all of them)
    for a in ARCHS:
        rows = sorted((b for b in _fused(builds, "fallback") if b["cap"] == a.cap), key=lambda b: b["heads"])
        misfit = next((i for i, b in enumerate(rows) if not b["fits"]), None)
        says[f"sm_{a.cap}"] = None if misfit is None else (rows[misfit - 1]["heads"] if misfit else 0)
    wrong = {}
    for b in _fused(builds, "fallback"):
        arch = f"sm_{b['cap']}"
        offered = b["heads"] <= FUSED_MAX_HEADS.get(arch, 10**6)
        if b["fits"] != offered:
            wrong.setdefault(arch, []).append(
                f"{b['heads']} heads: compile says {'fits' if b['fits'] else 'no'}, "
                f"the cost model {'offers' if offered else 'leaves out'} the fused path"
            )
    assert not wrong, (
        f"FUSED_MAX_HEADS = {FUSED_MAX_HEADS} disagrees with the compile (largest fitting head count "
        f"of {HEADS} per architecture, None = all: {says}): {wrong}"
    )


def test_fallback_shape_is_the_launchers_own():
    assert fallback_config(16).block_h == 16 and fallback_config(128) == mla.fallback_shapes(128)[0]


# ----------------------------------------------------------------------------------------------
# The fused kernel's wgmma paths (nvcc for sm_90a; no Triton involved)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wgmma_rows_here():
    """Their rows: nvcc once per source for sm_90a (cached for the session), ~20-30 s."""
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc on this machine: the wgmma paths (mla_decode_wgmma*.cu) were not compiled")
    return wgmma_builds()


def wgmma_problems(rows) -> list[str]:
    """What fails a wgmma path's check: it did not compile, reports no registers, spills, keeps a stack frame, or
    its shared memory is past an H100 / H200 block's."""
    bad = []
    for r in rows:
        where = f"{r['kernel']}, {r['heads_per_cta']} heads per CTA, {r['arch']}"
        if r["error"]:
            bad.append(f"{where}: did not compile: {r['error']}")
            continue
        if not r["regs"]:
            bad.append(f"{where}: no registers reported")
        if r["spills"] or r["stack_bytes"]:
            bad.append(f"{where}: {r['spills']} B spilled (stores + loads), {r['stack_bytes']} B stack frame")
        if not r["fits"] or r["shared_bytes"] > r["shared_limit"]:
            bad.append(
                f"{where}: needs {r['shared_bytes']:,} B of shared memory per block, the architecture "
                f"allows {r['shared_limit']:,} B"
            )
    return bad


def test_the_wgmma_rows_are_one_per_shipped_build(wgmma_rows_here):
    """The heads-on-M kernel's row, then one per instantiation of the tokens-on-M kernel, each named by role (the
    dispatcher's path) and heads per CTA."""
    assert [(r["kernel"], r["role"], r["heads_per_cta"]) for r in wgmma_rows_here] == (
        [(WGMMA_KERNEL, "wgmma", wgmma_path.HEADS_PER_CTA)]
        + [(TOKENS_KERNEL, "wgmma_tokens", hn) for hn in tokens_path.HEADS_PER_CTA]
    )
    assert tokens_path.HEADS_PER_CTA == (16, 32)
    assert {r["role"]: r["kernel"] for r in wgmma_rows_here} == WGMMA_ROLES
    for r in wgmma_rows_here:
        assert r["cap"] == 90 and r["arch"].startswith("sm_90a") and r["shipped"] and r["heads"] == 0
        assert 0 < r["regs"] <= 255 and r["blocks_per_sm_by_regs"] >= 1, r


def test_the_wgmma_row_is_sm90a_only_and_compiles_clean(wgmma_rows_here):
    (row,) = [r for r in wgmma_rows_here if r["role"] == "wgmma"]
    assert row["kernel"] == WGMMA_KERNEL
    assert row["shared_bytes"] == wgmma_path.SMEM_BYTES and row["threads"] == wgmma_path.THREADS
    assert not wgmma_problems([row]), wgmma_problems([row])


def test_the_tokens_rows_compile_clean_for_both_instantiations(wgmma_rows_here):
    """16 and 32 heads per CTA: ptxas's registers at launch (168: setmaxnreg moves them between the warpgroups), no
    spill, no stack, and the host's shared memory per instantiation (the source's Layout, checked against the
    compiled library at load) within an H100 / H200 block."""
    rows = {r["heads_per_cta"]: r for r in wgmma_rows_here if r["role"] == "wgmma_tokens"}
    assert sorted(rows) == [16, 32]
    for hn, r in rows.items():
        assert r["kernel"] == TOKENS_KERNEL and (r["shared_bytes"], r["threads"]) == (
            tokens_path.smem_bytes(hn),
            tokens_path.THREADS,
        )
        assert r["regs"] <= 168 and r["spills"] == 0 and r["stack_bytes"] == 0, r
        assert r["shared_bytes"] <= r["shared_limit"] == ARCHS[0].shared_per_block and r["fits"], r
    assert rows[16]["shared_bytes"] < rows[32]["shared_bytes"]
    assert not wgmma_problems(list(rows.values())), wgmma_problems(list(rows.values()))


def test_the_wgmma_rows_are_in_the_architecture_check(builds, wgmma_rows_here):
    assert [r for r in builds if r["kernel"] in WGMMA_ROLES.values()] == wgmma_rows_here
    assert not [r for r in builds if "mma.sync" in r["kernel"] or r.get("variant") is not None]


def test_chapter_6_shows_every_wgmma_build(wgmma_rows_here):
    """The table has a row per wgmma build, in the sm_90 column (sm_90a: the same GPUs), not built elsewhere; the
    values the text quotes are each build's, in the dispatcher's order."""
    triton_rows = [
        dict(
            kernel=FUSED,
            heads=16,
            shape="16 heads × 64 tokens",
            arch=a.name,
            cap=a.cap,
            shared_bytes=1024,
            shared_limit=a.shared_per_block,
            regs=128,
            spills=0,
            trap_only=False,
            fits=True,
            error=None,
            triton=GPU_TRITON,
            role="fallback",
            shipped=True,
        )
        for a in ARCHS
    ]
    table = original_gpu_report.arch_table(triton_rows + wgmma_rows_here, "caption")
    assert list(table.columns)[1:] == [a.name for a in ARCHS]
    labels = table.column("kernel")  # each wgmma row: its kernel, and its heads per CTA
    named = [(kernel, int(per_cta.split()[0])) for kernel, per_cta in (label.rsplit(", ", 1) for label in labels[1:])]
    assert named == [(WGMMA_KERNEL, wgmma_path.HEADS_PER_CTA)] + [(TOKENS_KERNEL, h) for h in tokens_path.HEADS_PER_CTA]
    sm90 = table.column(ARCHS[0].name)[1:]
    assert all(c.startswith("sm_90a: ") and "— yes: " in c for c in sm90), sm90
    assert all(c == original_gpu_report.NOT_BUILT for a in ARCHS[1:] for c in table.column(a.name)[1:])
    assert original_gpu_report.wgmma_build_rows(triton_rows + wgmma_rows_here) == wgmma_rows_here
    values = original_gpu_report.wgmma_build_values(triton_rows + wgmma_rows_here)
    assert list(values) == ["wgmma:64", "wgmma_tokens:16", "wgmma_tokens:32"] and all(
        v["clean"] for v in values.values()
    )
    assert all(values[f"wgmma_tokens:{hn}"]["regs"] == r["regs"] for hn, r in zip((16, 32), wgmma_rows_here[1:]))


def test_chapter_6_says_which_wgmma_build_fails(wgmma_rows_here):
    broken = (
        [dict(wgmma_rows_here[0])]
        + [dict(wgmma_rows_here[1], spills=8)]
        + [dict(wgmma_rows_here[2], error="nvcc failed for sm_90a: boom", fits=False)]
    )
    values = original_gpu_report.wgmma_build_values(broken)
    assert [v["clean"] for v in values.values()] == [True, False, False]
    assert values["wgmma_tokens:16"]["spills"] == 8 and values["wgmma_tokens:32"]["fits"] is False
    assert original_gpu_report.wgmma_build_values([r for r in broken if r["role"] is None]) == {}


def _report(*, ok=True, spill=0, stack=0, registers=255) -> wgmma_path.NvccReport:
    return wgmma_path.NvccReport(
        ok,
        "sm_90a",
        1.0,
        "nvcc (made up)",
        registers if ok else None,
        spill if ok else None,
        stack if ok else None,
        "" if ok else "error: no",
    )


@pytest.mark.parametrize(
    "report,words",
    [
        (_report(), None),
        (_report(ok=False), "did not compile"),
        (_report(spill=8), "8 B spilled"),
        (_report(stack=16), "16 B stack frame"),
        (_report(registers=None), "no resources"),
        ("nvcc is not on PATH: install it", "nvcc is not on PATH"),
    ],
    ids=["clean", "fails", "spills", "stack", "unparsed", "no_nvcc"],
)
def test_the_wgmma_check_fails_on_each_problem(monkeypatch, report, words):
    monkeypatch.setattr(arch_check_cuda, "wgmma_report", lambda: report)
    bad = wgmma_problems(arch_check_cuda.wgmma_rows())
    assert (bad == []) if words is None else (len(bad) == 1 and words in bad[0]), bad


def _tokens_report(hn, **kw) -> tokens_path.TokensNvccReport:
    base = _report(**kw)
    return tokens_path.TokensNvccReport(**{**base.__dict__, "heads_per_cta": hn})


@pytest.mark.parametrize(
    "which,report,words",
    [
        (None, None, None),
        (32, dict(ok=False), "did not compile"),
        (16, dict(spill=8), "8 B spilled"),
        (32, dict(stack=16), "16 B stack frame"),
        (16, dict(registers=None), "no resources"),
        ("all", "nvcc is not on PATH: install it", "nvcc is not on PATH"),
    ],
    ids=["clean", "fails", "spills", "stack", "unparsed", "no_nvcc"],
)
def test_the_tokens_check_fails_on_each_problem_of_each_instantiation(monkeypatch, which, report, words):
    """A problem of one instantiation fails its row alone; no nvcc fails both."""
    if which == "all":
        reports = report
    else:
        reports = {
            hn: _tokens_report(hn, **{"registers": 168, **(report if hn == which else {})})
            for hn in tokens_path.HEADS_PER_CTA
        }
    monkeypatch.setattr(arch_check_cuda, "tokens_reports", lambda: reports)
    rows = arch_check_cuda.tokens_rows()
    assert [r["heads_per_cta"] for r in rows] == list(tokens_path.HEADS_PER_CTA)
    bad = wgmma_problems(rows)
    if words is None:
        assert bad == [] and all(r["regs"] == 168 and r["fits"] for r in rows)
    elif which == "all":
        assert len(bad) == 2 and all(words in b for b in bad), bad
    else:
        failing = [r["heads_per_cta"] for r in rows if wgmma_problems([r])]
        assert failing == [which] and len(bad) == 1 and words in bad[0], bad


def test_a_tokens_instantiation_past_the_shared_memory_limit_does_not_fit(monkeypatch):
    reports = {hn: _tokens_report(hn, registers=168) for hn in tokens_path.HEADS_PER_CTA}
    monkeypatch.setattr(arch_check_cuda, "tokens_reports", lambda: reports)
    monkeypatch.setattr(arch_check_cuda, "WGMMA_SHARED_LIMIT", tokens_path.smem_bytes(32) - 1)
    rows = arch_check_cuda.tokens_rows()
    bad = wgmma_problems(rows)
    over = [r["heads_per_cta"] for r in rows if not r["fits"] and r["shared_bytes"] > r["shared_limit"]]
    assert over == [32] and len(bad) == 1, bad

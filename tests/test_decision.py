"""The book's answer is computed: the front page and chapter 6 show the same decision rows, every "do this" follows
the numbers beside it (flip the numbers and the advice flips), and the SM100 / SM120 rows agree with chapter 3's
door matrix.

The rows are built from the recorded results. Recordings made before ours was named ``ours`` (``fused_fp8``) are
read with the old names mapped to the new ones, so the tests run on either side of a re-record."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kvwall.experiments  # noqa: F401  (registers the row schemas)
from kvwall.notebook import answer_report, decision, heads_report, patch_report
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY
from kvwall.results import RESULTS_DIR, Result, ResultFileError, load_result
from kvwall.results.provenance import Provenance

ROOT = Path(__file__).resolve().parents[1]
#: Names recorded before the rename (the old rows), mapped to today's.
RENAMED = {"fused_fp8": "ours", "fused_fp8_triton": "triton", "fused_fp8_page64": "ours_page64"}


def _renamed(name: str, rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        r = dict(r)
        if not name.startswith("doors"):
            for key in ("path", "strategy"):
                if r.get(key) in RENAMED:
                    r[key] = RENAMED[r[key]]
            if r.get("path") == "ours" or r.get("strategy") in ("ours", "ours_page64"):
                r.setdefault("kernel_path", "triton" if r.get("kernel") == "triton" else "wgmma")
                r.setdefault("path_why", r.get("why"))
        out.append(r)
    return out


def _recorded(name: str) -> Result | None:
    """The recorded result, its old names (a recording made before the rename) mapped to today's."""
    try:
        res = load_result(name)
        return Result(name, res.params, _renamed(name, res.rows), res.provenance, res.path)
    except ResultFileError:  # missing, or recorded before the schema changed: read as stored
        path = RESULTS_DIR / f"{name}.json"
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return Result(name, data["params"], _renamed(name, data["rows"]), Provenance(**data["provenance"]), path)


@pytest.fixture(scope="module")
def evidence() -> decision.Evidence:
    ev = decision.Evidence.load(_recorded)
    if not any(r.get("path") == "ours" for r in ev.step.rows):
        pytest.skip("the recorded decode step has no `ours` row")
    return ev


@pytest.fixture(scope="module")
def rows(evidence):
    return decision.decide(evidence)


def _with(ev: decision.Evidence, **changes) -> decision.Evidence:
    return decision.Evidence(**{**{k: getattr(ev, k) for k in ("step", "sweep", "bench", "validation",
                                                                "doors_checks", "doors_sm90", "fit")}, **changes})


def _scaled(result: Result, pick, factor: float, field: str) -> Result:
    """A copy of ``result`` with ``field`` multiplied by ``factor`` in the rows ``pick`` selects."""
    rows = [dict(r, **{field: r[field] * factor}) if pick(r) and r.get(field) else dict(r) for r in result.rows]
    return Result(result.experiment, copy.deepcopy(result.params), rows, result.provenance, result.path)


# ---------------------------------------------------------------------------------------------------------
# One answer, two pages
# ---------------------------------------------------------------------------------------------------------

def test_front_page_and_chapter_6_show_the_same_rows_and_the_same_do_this(evidence, rows):
    front = decision.decision_table(rows, "c", compact=True)
    ch6 = decision.decision_table(rows, "c")
    assert front.column("your setup") == ch6.column("your setup")
    assert front.column("do this") == ch6.column("do this")
    assert [r.key for r in rows] == ["sm120", "sm90-no-patch", "sm90-patch-one", "sm90-patch-batch", "sm100"]
    # Both pages compute them with the same calls, from the same recorded results.
    index, chapter = (ROOT / "book" / "index.md").read_text(), (ROOT / "book" / "06_the_answer.md").read_text()
    for src in (index, chapter):
        assert "decision.decide(" in src and "decision.decision_table(" in src and "decision.Evidence.load(" in src
    assert "compact=True" in index
    # No typed advice left on the front page: the old bullets are gone.
    assert "removes the cast" not in index and "- **Hopper" not in index


def test_every_row_names_where_its_numbers_come_from(evidence, rows):
    caption = decision.decision_caption(evidence, rows)
    for r in rows:
        assert r.sources and set(r.sources) <= set(decision.SOURCES)
        for name in r.sources:
            assert name in caption, f"{r.key}: {name} is quoted but not in the provenance line"
    assert "predictions" in caption


def test_no_retired_names_in_the_answer(rows):
    text = " ".join(f"{r.do} {r.figure} {r.because}" for r in rows)
    for banned in ("fused_fp8", "fused kernel", "mma.sync", "generation", "issue 12", "target 6"):
        assert banned not in text


# ---------------------------------------------------------------------------------------------------------
# SM120 and SM100 agree with chapter 3's matrix
# ---------------------------------------------------------------------------------------------------------

def test_sm120_row_starts_with_sglangs_dsa_default(evidence, rows):
    sm120 = next(r for r in rows if r.key == "sm120")
    cells = decision.door_cells(evidence.doors_checks, evidence.doors_sm90)
    sparse = decision.open_doors(cells, "SM120", dense=False)
    assert sparse, "chapter 3's matrix has the SM120 sparse MLA kernel open for GLM-5"
    assert sm120.do.startswith("GLM-5: **drop `--attention-backend flashinfer_mla`**")
    assert "`dsa`" in sm120.do and "flashinfer_sparse_mla" in sm120.do
    assert "ours" in sm120.do and "gather_cast" in sm120.do
    assert sparse[0]["status"] in sm120.because and "predicted" in sm120.because
    # With the sparse door refused, the advice is no longer to drop the backend.
    refused = [dict(c, status="refused") if c["door"] == decision.SPARSE_DOOR else c for c in cells]
    assert "drop" not in decision._sm120(evidence, refused).do


def test_sm100_row_agrees_with_the_door_matrix(evidence, rows):
    sm100 = next(r for r in rows if r.key == "sm100")
    cells = decision.door_cells(evidence.doors_checks, evidence.doors_sm90)
    sm100_cells = {c["door"]: c for c in cells if c["family"] == "SM100"}
    for door, c in sm100_cells.items():
        if door == decision.SPARSE_DOOR:
            continue
        label = DOOR_BY_KEY[door].label
        if c["status"] == "refused":
            assert label not in sm100.do, f"{label} is refused on SM100 in chapter 3 but recommended"
            assert label.split(" (")[0] in sm100.because
        else:
            assert decision.SGLANG_BACKEND.get(door, door) in sm100.do and c["status"] in sm100.do
    assert sm100_cells["cutlass"]["status"] == "refused" and "cutlass" not in sm100.do.lower()


# ---------------------------------------------------------------------------------------------------------
# Every "do this" follows its numbers
# ---------------------------------------------------------------------------------------------------------

def test_batch_row_follows_the_sweep(evidence, rows):
    batch = next(r for r in rows if r.key == "sm90-patch-batch")
    cmp = decision.batch_comparison(evidence.sweep, "ours", "gather_cast", min_batch=decision.BIG_BATCH)
    assert cmp["batches"] and min(cmp["batches"]) >= decision.BIG_BATCH
    if not cmp["slower_at"]:
        assert batch.do.startswith("Our `fused` patch")
    # Make ours four times slower in batches: the row must now recommend gather_cast.
    slow = _scaled(evidence.sweep, lambda r: r.get("path") == "ours" and r.get("axis") == "batch", 4.0, "us")
    flipped = decision._sm90_patch_batch(_with(evidence, sweep=slow))
    assert flipped.do.startswith("The `gather_cast` patch")


def test_one_request_row_follows_the_step(evidence, rows):
    one = next(r for r in rows if r.key == "sm90-patch-one")
    s = {r["path"]: r for r in answer_report.step_rows(evidence.step)}
    best = min(("ours", "gather_cast"), key=lambda p: s[p]["step_ms"])
    assert one.do.startswith(decision._cap(decision.PATCH_NAMES[best]))
    assert f"{s['full_pool_cast']['step_ms']:.1f}" in one.figure
    other = "gather_cast" if best == "ours" else "ours"
    flip = _scaled(evidence.step, lambda r: r.get("path") == best, 1.5, "step_ms")
    assert decision._sm90_patch_one(_with(evidence, step=flip)).do.startswith(
        decision._cap(decision.PATCH_NAMES[other]))


def test_hopper_patch_rows_do_not_credit_flashinfer_with_removing_the_cast(evidence, rows):
    """SGLang 0.5.23 casts the whole pool in flashinfer_mla with any FlashInfer: said once, in the caption both pages
    show, and in chapter 6's reasons; never "FlashInfer 0.6.14 removes the cast"."""
    assert decision.PATCH_NOTE in decision.decision_caption(evidence, rows)
    assert "any FlashInfer" in decision.PATCH_NOTE and "#35322" in decision.PATCH_NOTE
    assert decision.PATCH_NOTE_SHORT in decision.decision_caption(evidence, rows, compact=True)
    for r in rows:
        assert "removes the cast" not in f"{r.do} {r.figure} {r.because}"


def test_no_patch_row_quotes_flashmla_fp8_speed_and_error(evidence, rows):
    row = next(r for r in rows if r.key == "sm90-no-patch")
    s = {r["path"]: r for r in answer_report.step_rows(evidence.step)}
    if "flashmla_fp8" not in s:
        assert row.do.startswith("No faster path")
        return
    assert "--attention-backend flashmla --page-size 64" in row.do and "FP8" in row.do
    assert f"{s['flashmla_fp8']['step_ms']:.1f}" in row.figure
    err_fp8, err_ours, where = decision.flashmla_fp8_error(evidence)
    if err_fp8:
        assert f"{err_fp8:.1e}" in row.because and where in row.sources
        assert "not measured" in row.because  # the accuracy caveat: attention-level only


# ---------------------------------------------------------------------------------------------------------
# Chapter 6's texts
# ---------------------------------------------------------------------------------------------------------

def test_lead_says_where_ours_loses_in_batches_from_the_sweep(evidence):
    text = answer_report.lead_text(evidence.step, evidence.sweep)
    cmp = decision.batch_comparison(evidence.sweep, "ours", "gather_cast")
    assert "from batch —" not in text
    if cmp["slower_at"]:
        assert "slower than gather_cast" in text
    else:
        assert "faster than gather_cast + FlashInfer at every batch measured" in text
    slow = _scaled(evidence.sweep, lambda r: r.get("path") == "ours" and r.get("axis") == "batch"
                   and r.get("batch") == max(cmp["batches"]), 4.0, "us")
    assert f"slower than gather_cast + FlashInfer at batch {max(cmp['batches'])}" in answer_report.lead_text(
        evidence.step, slow)


def test_one_megabyte_and_one_name_for_the_step_with_the_cast(evidence):
    s = {r["path"]: r for r in answer_report.step_rows(evidence.step)}
    cast = s["full_pool_cast"]
    assert cast["transient_mb"] == pytest.approx(cast["transient_bytes"] / 1e6)
    text = answer_report.memory_text(evidence.step)
    assert text.count("10^6") == 1 and f"{cast['transient_mb']:,.1f} MB" in text
    name = answer_report.cast_step_name(evidence.step)
    assert name.startswith(f"{cast['step_ms']:.1f} ms") and "CUDA-graph" in name
    assert name in answer_report.lead_text(evidence.step, evidence.sweep)
    assert "chapter 1's step (" not in answer_report.lead_text(evidence.step, evidence.sweep)


def test_front_page_figure_draws_every_recorded_step_path(evidence):
    fig = answer_report.front_page_figure(evidence.step)
    drawn = list(fig.data[0].y)
    for r in answer_report.step_rows(evidence.step):
        assert r["name"] in drawn
    assert drawn[0].startswith("the original")


def test_kernel_table_reads_chapter_5s_benchmark(evidence):
    if evidence.bench is None:
        pytest.skip("no recorded fused_decode_bench")
    table = heads_report.kernel_table(evidence)
    rows = heads_report.kernel_rows(evidence)
    assert table is not None and len(table.rows) == len(rows) > 0
    for r in rows:
        assert r["best"] in heads_report.ACCURATE_FP8.values()
        assert r["other_us"] is None or r["best_us"] <= r["other_us"]
    assert "fused_decode_bench" in table.caption


def test_patch_check_table_shows_its_result_columns(evidence):
    check = _recorded("sglang_patch_check")
    if check is None:
        pytest.skip("no recorded sglang_patch_check")
    table = patch_report.patch_check_table(check, "c")
    assert len(table.columns) <= 6 and {"vs unpatched (max abs.)", "error vs float64", "ok"} <= set(table.columns)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("variant", ["gather_cast", "fused"])
def test_the_shipped_diffs_apply_with_git_apply(tmp_path, variant):
    """Chapter 6 says `git apply --check`, then `git apply`: both work on the shipped upstream file."""
    patch_dir = ROOT / "lib" / "kvwall" / "peers" / "sglang_patch"
    target = tmp_path / "python" / "sglang" / "srt" / "layers" / "attention" / "flashinfer_mla_backend.py"
    target.parent.mkdir(parents=True)
    shutil.copy(patch_dir / "flashinfer_mla_backend.py.orig", target)
    diff = patch_dir / f"{variant}.diff"
    for args in (["--check"], []):
        proc = subprocess.run(["git", "apply", *args, str(diff)], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert target.read_text() != (patch_dir / "flashinfer_mla_backend.py.orig").read_text()
    assert re.search(r"git apply --check", (ROOT / "book" / "06_the_answer.md").read_text())

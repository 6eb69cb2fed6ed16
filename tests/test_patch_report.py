"""Chapter 6's SGLang patch section (kvwall.reports.patch_report): every figure it states comes from the rows, a
failing row shows as failing, and a run that did not get inside SGLang's real modules says so."""

from __future__ import annotations

import copy
import dataclasses
import re

import pytest

import kvwall.experiments  # noqa: F401  (registers the row schemas)
from kvwall.reports import patch_report as pr
from kvwall.reports.tables import markdown_table
from kvwall.results import Result, load_result


@pytest.fixture(scope="module")
def recorded() -> Result:
    return load_result("sglang_patch_check")


def _with_rows(result: Result, rows: list[dict]) -> Result:
    return dataclasses.replace(result, rows=rows)


def _render(table) -> str:
    return markdown_table(table.rows, table.columns)


def test_the_run_text_states_what_the_rows_hold(recorded):
    meta = pr.real_meta(recorded)
    assert meta is not None and meta["ran"]
    text = pr.real_run_text(recorded)
    assert f"{meta['sglang_files']} files" in text and "`RECORD`" in text
    for name, where in meta["standins"].items():  # every stand-in, with the file that imported it
        assert f"`{name}` (imported by `{where.rsplit('/', 1)[-1]}`)" in text
    for entry in meta["minimal_objects"]:
        assert entry.partition(": ")[0] in text
    rows = pr.real_check_rows(recorded)
    assert f"{sum(r['ok'] for r in rows)} of {len(rows)} rows passed" in text
    assert "target-verify" in text and "decode" in text and "CUDA graph" in text
    layers = rows[0]["layers"]
    assert f"{layers} layers" in text and f"{rows[0]['pool_slots']:,} FP8 slots" in text
    for t in pr.real_timing_rows(recorded):
        assert f"`{t['variant']}` {t['ms_per_step']:.3f} ms" in text
        if t["speedup_vs_unpatched"]:
            assert f"{t['speedup_vs_unpatched']:.1f}× faster" in text
    patched = [r for r in rows if r["variant"] != "unpatched"]
    if all(r["whole_pool_casts"] == 0 for r in patched):
        assert f"Every patched row: 0 whole-pool casts a step ({len(patched)} rows)" in text
    not_run = pr.real_not_run_text(recorded)
    assert "no SGLang server" in not_run and "no model weights" in not_run
    assert f"{layers} layers, not GLM-5's 78" in not_run
    driven = {"verify" if r["mode"].startswith("verify") else r["mode"] for r in rows}
    for mode, words in pr.FORWARD_MODES.items():  # a mode the diffs change is named as not run exactly when it was not
        if mode != "decode":
            assert (words in not_run) == (mode not in driven), (mode, not_run)


def test_the_tables_hold_every_row(recorded):
    rows = pr.real_check_rows(recorded)
    table = pr.real_check_table(recorded, "c")
    steps = {(r["mode"], r["phase"]) for r in rows}
    assert len(table.rows) == len(steps) and list(table.columns) == [
        "mode", "phase", "tokens", "casts a step (unpatched / gather_cast / fused)",
        "error vs float64 (unpatched / gather_cast / fused)", "vs unpatched, max abs. (gather_cast / fused)", "all ok"]
    md = _render(table)
    failed = {(r["mode"], r["phase"]) for r in rows if not r["ok"]}
    assert md.count("| yes |") == len(steps - failed) and md.count("**no**") == len(failed)
    # one line per step in the rows' order, every variant's casts and error in the columns' order
    keys = list(dict.fromkeys((r["mode"], r["phase"]) for r in rows))
    for line, key in zip(table.rows, keys):
        assert line["phase_text"].replace("\u00a0", " ") == key[1]
        by = {r["variant"]: r for r in rows if (r["mode"], r["phase"]) == key}
        assert line["casts"] == " / ".join(str(by[v]["whole_pool_casts"]) for v in ("unpatched", "gather_cast", "fused"))
        assert line["errors"].count(" / ") == 2
    timing = pr.real_timing_table(recorded, "t")
    assert [r["variant"] for r in timing.rows] == [r["variant"] for r in pr.real_timing_rows(recorded)]
    assert "speed-up: unpatched ms / this ms" in timing.columns and "error" not in timing.columns


def _good_rows(recorded: Result) -> list[dict]:
    """The recorded rows with the real check's rows all passing (as a re-record after the cast fix records them)."""
    rows = copy.deepcopy(recorded.rows)
    for r in rows:
        if r["section"] == "real_check":
            want = r["layers"] if r["variant"] == "unpatched" else 0
            r.update(whole_pool_casts=want, ok=True, problems=[])
    return rows


def test_a_failing_row_shows_as_failing(recorded):
    rows = _good_rows(recorded)
    good = _with_rows(recorded, rows)
    text = pr.real_run_text(good)
    n = len(pr.real_check_rows(good))
    assert f"{n} of {n} rows passed" in text and "**Failed:**" not in text
    # a patched graph row that casts the pool, and is judged so
    bad = copy.deepcopy(rows)
    row = next(r for r in bad if r["section"] == "real_check" and r["variant"] == "fused"
               and r["phase"] == "replay 2" and r["mode"] == "verify_2")
    row.update(whole_pool_casts=6, ok=False, problems=["the captured graph, replayed every step: 6 whole-pool casts, "
                                                       "expected 0 (a patch makes none)"])
    res = _with_rows(recorded, bad)
    text = pr.real_run_text(res)
    assert f"{n - 1} of {n} rows passed" in text
    assert "1 patched rows cast the whole pool: verify_2/replay 2/fused 6" in text
    assert "Every patched row" not in text
    assert re.search(r"\*\*Failed:\*\* verify_2/replay 2/fused: the captured graph, replayed every step: 6", text)
    md = _render(pr.real_check_table(res, "c"))
    assert md.count("**no**") == 1 and "expected 0 (a patch makes none)" in md


def test_an_output_off_tolerance_is_said(recorded):
    rows = _good_rows(recorded)
    row = next(r for r in rows if r["section"] == "real_check" and r["variant"] == "gather_cast"
               and r["mode"] == "decode" and r["phase"] == "eager")
    row.update(bit_identical_vs_unpatched=False, within_tol_vs_unpatched=False, max_abs_diff_vs_unpatched=0.5)
    text = pr.real_run_text(_with_rows(recorded, rows))
    assert "decode" in text and "**not** within BF16 tolerance of unpatched on every row (max abs. 5.0e-01)" in text


def test_a_run_that_did_not_get_inside_sglang_says_so(recorded):
    meta = dict(pr.real_meta(recorded), ran=False, error="StandInUsed: dill.dumps(...) called")
    rows = [r for r in recorded.rows if not r["section"].startswith("real_")] + [meta]
    text = pr.real_run_text(_with_rows(recorded, rows))
    assert text.startswith("**Inside SGLang's real modules:** the run did not complete") and "dill.dumps" in text
    assert "what ran is the check with stand-ins" in pr.real_not_run_text(_with_rows(recorded, rows))
    none = _with_rows(recorded, [r for r in recorded.rows if not r["section"].startswith("real_")])
    assert pr.real_run_text(none) == "**Inside SGLang's real modules:** not part of this run."
    assert pr.real_check_rows(none) == [] and pr.real_timing_table(none, "c").rows == []


def test_a_timing_that_failed_shows_its_error(recorded):
    rows = copy.deepcopy(recorded.rows)
    t = next(r for r in rows if r["section"] == "real_timing" and r["variant"] == "fused")
    t.update(ms_per_step=None, ms_min=None, ms_max=None, speedup_vs_unpatched=None, error="RuntimeError: boom")
    res = _with_rows(recorded, rows)
    assert "`fused` not timed (RuntimeError: boom)" in pr.real_run_text(res)
    table = pr.real_timing_table(res, "c")
    assert "error" in table.columns and "RuntimeError: boom" in _render(table)


def test_the_stand_in_check_text(recorded):
    checks = [r for r in recorded.rows if r["section"] == "checks"]
    text = pr.patch_run_text(recorded)
    assert f"{sum(r['ok'] for r in checks)} of {len(checks)} rows passed" in text
    assert text.startswith("**With stand-ins for SGLang's imports**")

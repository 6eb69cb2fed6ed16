"""Chapter 6's SGLang patch section (kvwall.reports.patch_report): every figure it states comes from the rows, a
failing row shows as failing, and a run that did not get inside SGLang's real modules has no findings."""

from __future__ import annotations

import copy
import dataclasses

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


def _keys(table) -> list[str]:
    """The row keys a table's columns show, in order (its headers are answer.yml's words)."""
    return [spec if isinstance(spec, str) else spec[0] for spec in table.columns.values()]


def test_the_findings_are_the_rows(recorded):
    meta = pr.real_meta(recorded)
    assert meta is not None and meta["ran"]
    rows = pr.real_check_rows(recorded)
    found = pr.real_findings(recorded)
    assert (found.layers, found.pool_slots, found.batch) == (rows[0]["layers"], rows[0]["pool_slots"], rows[0]["batch"])
    driven = {"verify" if r["mode"].startswith("verify") else r["mode"] for r in rows}
    assert set(found.modes) == driven and set(found.not_driven) == set(pr.FORWARD_MODES) - driven
    assert found.draft_tokens == sorted({r["draft_tokens"] for r in rows if r["draft_tokens"]})
    assert sum(s.passed for s in found.variants.values()) == sum(bool(r["ok"]) for r in rows)
    assert sum(s.rows for s in found.variants.values()) == len(rows)
    patched = [r for r in rows if r["variant"] != "unpatched"]
    assert found.patched_rows == len(patched)
    assert found.patched_casting == sum(r["whole_pool_casts"] != 0 for r in patched)
    assert found.variants["unpatched"].casts == tuple(
        sorted({r["whole_pool_casts"] for r in rows if r["variant"] == "unpatched"})
    )
    first = [r for r in rows if r["variant"] == rows[0]["variant"] and r["mode"] == rows[0]["mode"]]
    assert found.replay_tokens == [r["tokens"] for r in first if r["phase"].startswith("replay")]
    assert found.eager_tokens == next(r["tokens"] for r in first if r["phase"] == "eager")
    for v, s in found.variants.items():
        mine = [r for r in rows if r["variant"] == v]
        assert s.max_err == max(r["rel_err_vs_f64"] for r in mine)
        assert s.identical == sum(bool(r.get("bit_identical_vs_unpatched")) for r in mine)


def test_the_tables_hold_every_row(recorded):
    rows = pr.real_check_rows(recorded)
    table = pr.real_check_table(recorded, "c")
    steps = {(r["mode"], r["phase"]) for r in rows}
    assert len(table.rows) == len(steps)
    assert _keys(table) == ["mode", "phase", "tokens", "casts", "errors", "vs_unpatched", "verdict"]
    # the side-by-side columns' headers name the variants in the order their cells join them
    headers = list(table.columns)
    assert all(" / ".join(pr.VARIANTS) in h for h in headers[3:5]) and " / ".join(pr.VARIANTS[1:]) in headers[5]
    md = _render(table)
    failed = {(r["mode"], r["phase"]) for r in rows if not r["ok"]}
    # one line per step in the rows' order, every variant's casts and error in the columns' order
    keys = list(dict.fromkeys((r["mode"], r["phase"]) for r in rows))
    verdict = {key: line["verdict"] for line, key in zip(table.rows, keys)}
    passed = {v for k, v in verdict.items() if k not in failed}  # one word for every passing step, never a failure's
    assert len(passed) <= 1 and not passed & {v for k, v in verdict.items() if k in failed}
    assert sum(md.count(f"| {v} |") for v in passed) == len(steps - failed) and md.count("**no**") == len(failed)
    for line, key in zip(table.rows, keys):
        assert line["phase"].replace("\u00a0", " ") == key[1]
        by = {r["variant"]: r for r in rows if (r["mode"], r["phase"]) == key}
        assert line["casts"] == " / ".join(
            str(by[v]["whole_pool_casts"]) for v in ("unpatched", "gather_cast", "fused")
        )
        assert line["errors"].count(" / ") == 2
    timing = pr.real_timing_table(recorded, "t")
    assert [r["variant"] for r in timing.rows] == [r["variant"] for r in pr.real_timing_rows(recorded)]
    assert "speedup_vs_unpatched" in _keys(timing) and "error" not in _keys(timing)


def test_what_each_patch_holds_beyond_unpatched(recorded):
    memory = {r["variant"]: r for r in pr.real_memory_rows(recorded)}
    extra = pr.extra_bytes(recorded)
    assert set(extra) == set(memory) - {"unpatched"}
    for v, b in extra.items():
        assert b == memory[v]["total_bytes"] - memory["unpatched"]["total_bytes"]
    assert pr.extra_bytes(_with_rows(recorded, [r for r in recorded.rows if r["section"] != "real_memory"])) == {}


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
    good = pr.real_findings(_with_rows(recorded, rows))
    n = sum(s.rows for s in good.variants.values())
    assert sum(s.passed for s in good.variants.values()) == n and good.patched_casting == 0
    # a patched graph row that casts the pool, and is judged so
    bad = copy.deepcopy(rows)
    row = next(
        r
        for r in bad
        if r["section"] == "real_check"
        and r["variant"] == "fused"
        and r["phase"] == "replay 2"
        and r["mode"] == "verify_2"
    )
    problem = "the captured graph, replayed every step: 6 whole-pool casts, expected 0 (a patch makes none)"
    row.update(whole_pool_casts=6, ok=False, problems=[problem])
    res = _with_rows(recorded, bad)
    found = pr.real_findings(res)
    assert sum(s.passed for s in found.variants.values()) == n - 1 and found.patched_casting == 1
    assert found.variants["fused"].casts == (0, 6)
    table = pr.real_check_table(res, "c")
    failing = [r for r in table.rows if r["verdict"] != "yes"]
    assert len(failing) == 1 and problem in failing[0]["verdict"] and failing[0]["phase"] == "replay\u00a02"


def test_an_output_off_tolerance_is_counted(recorded):
    rows = _good_rows(recorded)
    before = pr.real_findings(_with_rows(recorded, rows)).variants["gather_cast"]
    row = next(
        r
        for r in rows
        if r["section"] == "real_check"
        and r["variant"] == "gather_cast"
        and r["mode"] == "decode"
        and r["phase"] == "eager"
    )
    row.update(bit_identical_vs_unpatched=False, within_tol_vs_unpatched=False, max_abs_diff_vs_unpatched=0.5)
    after = pr.real_findings(_with_rows(recorded, rows)).variants["gather_cast"]
    assert (after.identical, after.within_tol) == (before.identical - 1, before.within_tol - 1)
    assert after.max_abs_diff == 0.5


def test_a_run_that_did_not_get_inside_sglang_has_no_findings(recorded):
    meta = dict(pr.real_meta(recorded), ran=False, error="StandInUsed: dill.dumps(...) called")
    rows = [r for r in recorded.rows if not r["section"].startswith("real_")] + [meta]
    res = _with_rows(recorded, rows)
    assert pr.real_meta(res)["ran"] is False and "dill.dumps" in pr.real_meta(res)["error"]
    assert pr.real_findings(res) is None
    none = _with_rows(recorded, [r for r in recorded.rows if not r["section"].startswith("real_")])
    assert pr.real_meta(none) is None and pr.real_findings(none) is None
    assert pr.real_check_rows(none) == [] and pr.real_timing_table(none, "c").rows == []


def test_a_timing_that_failed_shows_its_error(recorded):
    rows = copy.deepcopy(recorded.rows)
    t = next(r for r in rows if r["section"] == "real_timing" and r["variant"] == "fused")
    t.update(ms_per_step=None, ms_min=None, ms_max=None, speedup_vs_unpatched=None, error="RuntimeError: boom")
    table = pr.real_timing_table(_with_rows(recorded, rows), "c")
    assert "error" in table.columns and table.column("error") == ["—", "—", "RuntimeError: boom"]


def test_the_stand_in_summary(recorded):
    checks = [r for r in recorded.rows if r["section"] == "checks"]
    summary = pr.stand_in_summary(recorded)
    assert summary.cases == len({r["case"] for r in checks})
    assert summary.layers == sorted({r["layers"] for r in checks})
    by = summary.variants
    assert sum(s.passed for s in by.values()) == sum(r["ok"] for r in checks)
    for v, s in by.items():
        mine = [r for r in checks if r["variant"] == v]
        assert s.casts == tuple(sorted({r["whole_pool_casts"] for r in mine}))
        assert s.max_err == max(r["rel_err_vs_f64"] for r in mine)
        assert (s.identical == s.rows) == all(r["bit_identical_vs_unpatched"] for r in mine)
    assert pr.stand_in_summary(_with_rows(recorded, [r for r in recorded.rows if r["section"] != "checks"])) is None

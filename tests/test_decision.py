"""The book's answer is computed: the front page and chapter 6 show the same decision rows, every "do this" follows
the numbers beside it (flip the numbers and the advice flips), and the SM100 / SM120 rows agree with chapter 3's
door matrix.

The rows are built from the recorded results. Recordings made before ours was named ``ours`` (``fused_fp8``) are
read with the old names mapped to the new ones, so the tests run on either side of a re-record."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import kvwall.experiments  # noqa: F401  (registers the row schemas)
from kvwall.reports import answer_report, decision, heads_report, patch_report
from kvwall.model.original import ORIGINAL
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY
from kvwall.experiments.fused_decode.strategies import STRATEGIES
from kvwall.reports.accuracy_regimes import fp8_query_multipliers
from kvwall.reports.evidence import SOURCES, SPARSE_DOOR
from kvwall.peers.sglang_patch import upstream_source
from kvwall.peers.sglang_source import SGLangSourceUnavailable
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
    return dataclasses.replace(ev, **changes)


def _scaled(result: Result, pick, factor: float, field: str) -> Result:
    """A copy of ``result`` with ``field`` multiplied by ``factor`` in the rows ``pick`` selects."""
    rows = [dict(r, **{field: r[field] * factor}) if pick(r) and r.get(field) else dict(r) for r in result.rows]
    return Result(result.experiment, copy.deepcopy(result.params), rows, result.provenance, result.path)


# ---------------------------------------------------------------------------------------------------------
# One answer, two pages
# ---------------------------------------------------------------------------------------------------------


def test_front_page_and_chapter_6_show_the_same_rows_and_the_same_do_this(evidence, rows):
    front = decision.decision_table(rows, "c", compact=True)
    reasons = decision.decision_table(rows, "c")
    assert front.column("your setup") == reasons.column("your setup") and reasons.fold  # folded: long text
    assert "<details>" in reasons.markdown() and "<details>" not in front.markdown()
    assert [r.key for r in rows] == [
        "dsa-sm90",
        "dsa-sm90-spec",
        "dsa-sm100",
        "dsa-sm120",
        "dense-sm90-no-patch",
        "dense-sm90-patch",
        "dense-sm90-spec",
        "dense-sm100",
        "dense-sm120",
    ]
    # Both pages compute them with the same calls, from the same recorded results.
    index, chapter = (ROOT / "book" / "index.md").read_text(), (ROOT / "book" / "06_the_answer.md").read_text()
    for src in (index, chapter):
        assert "decision.decide(" in src and "decision.decision_table(" in src and "decision.Evidence.load(" in src
    assert "compact=True" in index and "compact=True" in chapter  # chapter 6 shows the same table, then the reasons


def test_the_readme_shows_the_same_answer(evidence, rows):
    """The README's answer is the decision table as `python -m kvwall answer` prints it, between its markers."""
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(decision.README_START), readme.index(decision.README_END)
    assert readme[start + len(decision.README_START) : end].strip() == decision.readme_answer(evidence).strip()


def test_every_row_names_where_its_numbers_come_from(evidence, rows):
    caption = decision.decision_caption(evidence, rows)
    for r in rows:
        assert set(r.sources) <= set(SOURCES)
        for name in r.sources:
            assert name in caption, f"{r.key}: {name} is quoted but not in the provenance line"
        assert r.evidence in (decision.MEASURED, decision.COMPOSED, decision.PREDICTED, decision.NOT_MEASURED)
        if r.evidence != decision.NOT_MEASURED:
            assert r.sources, f"{r.key}: a figure with no recorded source"


def test_every_command_is_one_sglang_0_5_23_accepts(rows):
    from kvwall.peers.sglang_flags import check_command

    assert decision.commands(rows)
    for command in decision.commands(rows):
        assert check_command(command) == [], command
    assert check_command("--attention-backend flashinfer_mla")  # the flag the book used to print: rejected


def test_every_template_is_filled(rows):
    """No row shows a placeholder of book/answer.yml unfilled (a value the row's function forgot to pass)."""
    for r in rows:
        for text in (r.do, r.step, r.because, r.command, r.accuracy, r.setup, r.run, r.step_cell):
            assert not re.search(r"\{[a-z_]+[^}]*\}", text), f"{r.key}: {text}"


# ---------------------------------------------------------------------------------------------------------
# DSA models: SGLang's own backend, never a forced dense one
# ---------------------------------------------------------------------------------------------------------


def test_dsa_rows_never_force_a_dense_backend(evidence, rows):
    for r in rows:
        if r.key.startswith("dsa"):
            assert "--attention-backend" not in r.command
    sm90 = next(r for r in rows if r.key == "dsa-sm90")
    assert sm90.command == "--kv-cache-dtype fp8_e4m3"  # on SM90 an unset cache dtype is BF16 for a DSA model
    if evidence.dsa_forced is not None:
        f = next(x for x in evidence.dsa_forced.rows if x["section"] == "forced_dense")
        assert f["dense_output_rel_err"] != f["dense_output_rel_err"]  # NaN: the recorded finding the rows state
        assert sm90.cases["forced"] is True and "dsa_forced_dense" in sm90.sources  # the rows quote that run
        assert f"{f['dsa_row_bytes']}-byte" in sm90.because


def test_dsa_step_is_composed_from_the_recorded_parts(evidence, rows):
    from kvwall.reports import dsa_report

    sm90 = next(r for r in rows if r.key == "dsa-sm90")
    if evidence.dsa is None or dsa_report.dsa_step(evidence.step, evidence.dsa) is None:
        assert sm90.evidence == decision.NOT_MEASURED
        return
    composed = dsa_report.dsa_step(evidence.step, evidence.dsa)
    assert sm90.cases["row"] == "composed" and sm90.evidence == decision.COMPOSED
    assert sm90.step == f"{composed.step_ms:.1f} ms" and f"{composed.attention_ms:.2f} ms" in sm90.because
    ours = next(r for r in evidence.step.rows if r.get("path") == "ours")
    assert composed.step_ms == pytest.approx(ours["write_kv_ms"] + ours["rest_ms"] + composed.attention_ms)


def test_dsa_sm120_row_agrees_with_chapter_3(evidence, rows):
    sm120 = next(r for r in rows if r.key == "dsa-sm120")
    cells = decision.door_cells(evidence.doors_checks, evidence.doors_sm90)
    sparse = decision.open_doors(cells, "SM120", dense=False)
    assert sparse and sm120.cases["door"] is True and sparse[0]["status"] in sm120.because
    assert "flashinfer_sparse_mla" in sm120.do and sm120.cases["built"] is True  # its module compiled for sm_120a


# ---------------------------------------------------------------------------------------------------------
# SM100 agrees with chapter 3's matrix
# ---------------------------------------------------------------------------------------------------------


def test_sm100_row_agrees_with_the_door_matrix(evidence, rows):
    sm100 = next(r for r in rows if r.key == "dense-sm100")
    cells = decision.door_cells(evidence.doors_checks, evidence.doors_sm90)
    sm100_cells = {c["door"]: c for c in cells if c["family"] == "SM100"}
    for door, c in sm100_cells.items():
        if door == SPARSE_DOOR:
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


def test_patch_row_follows_the_steps_at_every_batch(evidence, rows):
    patch = next(r for r in rows if r.key == "dense-sm90-patch")
    ours, gc = decision.step_at(evidence, "ours"), decision.step_at(evidence, "gather_cast")
    assert set(ours) == set(gc) and len(ours) >= 1
    if all(ours[b] <= gc[b] for b in ours):
        assert patch.cases["row"] == "ours" and patch.step == decision.steps_text(evidence, "ours")
    # Make ours slower than gather_cast at the largest batch: the row must name gather_cast there.
    big = max(ours)
    if big > 1 and evidence.step_batches is not None:
        slow = _scaled(
            evidence.step_batches,
            lambda r: r.get("path") == "ours" and r.get("batch") == big,
            gc[big] / ours[big] * 1.5,
            "step_ms",
        )
        flipped = decision._dense_sm90_patch(_with(evidence, step_batches=slow), [], patch.key)
        assert flipped.cases["row"] == "mixed" and f"at batch {big}" in flipped.do
    # Make ours slower everywhere: the row recommends gather_cast.
    slow1 = _scaled(evidence.step, lambda r: r.get("path") == "ours", 10.0, "step_ms")
    slow_all = (
        _scaled(evidence.step_batches, lambda r: r.get("path") == "ours", 10.0, "step_ms")
        if evidence.step_batches is not None
        else None
    )
    gather = decision._dense_sm90_patch(_with(evidence, step=slow1, step_batches=slow_all), [], patch.key)
    assert gather.cases["row"] == "gather_cast"
    assert gather.step == decision.steps_text(_with(evidence, step=slow1, step_batches=slow_all), "gather_cast")


def test_hopper_patch_rows_do_not_credit_flashinfer_with_removing_the_cast(evidence, rows):
    """SGLang 0.5.23 casts the whole pool in its FlashInfer MLA backend with any FlashInfer: said once, in the
    caption both pages show; never "FlashInfer 0.6.14 removes the cast"."""
    assert decision.PATCH_NOTE in decision.decision_caption(evidence, rows)
    assert decision.PATCH_NOTE_SHORT in decision.decision_caption(evidence, rows, compact=True)


def test_no_patch_row_quotes_flashmla_fp8_speed_and_accuracy_per_regime(evidence, rows):
    row = next(r for r in rows if r.key == "dense-sm90-no-patch")
    fm = decision.step_at(evidence, "flashmla_fp8")
    flags = row.command.split()  # SGLang's FlashMLA backend, on FlashMLA's pages (the page size it was measured on)
    assert flags[flags.index("--attention-backend") + 1] == "flashmla"
    assert flags[flags.index("--page-size") + 1] == str(STRATEGIES["flashmla_dense_fp8"].page_size)
    assert f"{fm[1]:.1f}" in row.step and row.evidence == decision.MEASURED
    if evidence.accuracy is not None:  # the lowest and the highest multiplier, each with its regime named
        regimes = [
            m
            for m in fp8_query_multipliers(evidence.accuracy, evidence.bench, computed=False)
            if m.strategy == "flashmla_dense_fp8"
        ]
        lo, hi = min(regimes, key=lambda m: m.over_ours[0]), max(regimes, key=lambda m: m.over_ours[1])
        assert row.cases["fp8_accuracy"] is True and f"{lo.over_ours[0]:.1f}×" in row.accuracy
        assert f"'{lo.regime}'" in row.accuracy and f"'{hi.regime}'" in row.accuracy


# ---------------------------------------------------------------------------------------------------------
# Chapter 6's texts
# ---------------------------------------------------------------------------------------------------------


def test_lead_says_where_ours_loses_in_batches_from_the_sweep(evidence):
    lead = answer_report.lead(evidence.step, evidence.sweep)
    cmp = decision.batch_comparison(evidence.sweep, "ours", "gather_cast")
    assert lead.batches == cmp["batches"] and lead.ours_slower == cmp["slower_at"]
    slow = _scaled(
        evidence.sweep,
        lambda r: r.get("path") == "ours" and r.get("axis") == "batch" and r.get("batch") == max(cmp["batches"]),
        4.0,
        "us",
    )
    assert max(cmp["batches"]) in answer_report.lead(evidence.step, slow).ours_slower


def test_one_megabyte_and_one_name_for_the_step_with_the_cast(evidence):
    s = {r["path"]: r for r in answer_report.step_rows(evidence.step)}
    cast = s["full_pool_cast"]
    assert cast["transient_mb"] == pytest.approx(cast["transient_bytes"] / 1e6)
    memory = answer_report.memory(evidence.step)
    assert memory["cast_mb"] == cast["transient_mb"] and memory["fp8_bytes"] == s["ours"]["kv_bytes_per_token"]
    assert memory["pool_gb"] == pytest.approx(evidence.step.params["pool_tokens"] * memory["fp8_bytes"] / 1e9)
    name = answer_report.cast_step(evidence.step)
    assert (name.ms, name.timing) == (cast["step_ms"], "cuda_graph")
    assert answer_report.lead(evidence.step, evidence.sweep).cast == name


def test_front_page_figure_draws_every_recorded_step_path(evidence):
    fig = answer_report.front_page_figure(evidence.step, ["c"])
    drawn = list(fig.data[0].y)
    rows = answer_report.step_rows(evidence.step)
    assert drawn[1:] == [r["name"] for r in rows]  # the original's own figure first
    assert list(fig.data[0].x) == [ORIGINAL.step_ms] + [r["step_ms"] for r in rows]


def test_kernel_table_reads_chapter_5s_benchmark(evidence):
    if evidence.bench is None:
        pytest.skip("no recorded fused_decode_bench")
    table = heads_report.kernel_table(evidence, "c")
    rows = heads_report.kernel_rows(evidence)
    assert table is not None and len(table.rows) == len(rows) > 0
    for r in rows:
        assert r["best"] in heads_report.ACCURATE_FP8.values()
        assert r["other_us"] is None or r["best_us"] <= r["other_us"]


def test_patch_check_table_shows_its_result_columns(evidence):
    check = _recorded("sglang_patch_check")
    if check is None:
        pytest.skip("no recorded sglang_patch_check")
    table = patch_report.patch_check_table(check, "c")
    shown = {spec if isinstance(spec, str) else spec[0] for spec in table.columns.values()}  # the rows' keys
    assert len(table.columns) <= 6 and {"vs_unpatched", "rel_err_vs_f64", "verdict"} <= shown


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
@pytest.mark.parametrize("variant", ["gather_cast", "fused"])
def test_the_shipped_diffs_apply_with_git_apply(tmp_path, variant):
    """Chapter 6 says `git apply --check`, then `git apply`: both work on SGLang 0.5.23's file, taken from the pinned
    wheel (sha256-checked; skipped, saying why, offline with an empty cache)."""
    try:
        upstream = upstream_source()
    except SGLangSourceUnavailable as exc:
        pytest.skip(str(exc))
    patch_dir = ROOT / "lib" / "kvwall" / "peers" / "sglang_patch"
    target = tmp_path / "python" / "sglang" / "srt" / "layers" / "attention" / "flashinfer_mla_backend.py"
    target.parent.mkdir(parents=True)
    target.write_text(upstream)
    diff = patch_dir / f"{variant}.diff"
    for args in (["--check"], []):
        proc = subprocess.run(["git", "apply", *args, str(diff)], cwd=tmp_path, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    assert target.read_text() != upstream
    assert re.search(r"git apply --check", (ROOT / "book" / "06_the_answer.md").read_text())

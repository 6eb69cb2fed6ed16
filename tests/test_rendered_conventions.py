"""What a reader sees, by class of defect, on the reports' own outputs (fast: no chapter is executed here; the same
checks run on every chapter a test executes, through ``conftest.run_chapter`` and tests/rendered_checks.py):

- no unformatted ``{placeholder}`` (a string that lost its ``f``);
- every ratio column names its direction as ``A / B``; chapters 5 and 6 divide FlashMLA BF16's time by the other's;
- no table of more than MAX_INLINE_ROWS rows inline (chapter 3's replays: a summary, the full table folded);
- the front page lists every chapter of ``_toc.yml``;
- a figure measured live on a CPU says so in its title;
- sentences that must follow the numbers do (chapter 6's kernel choice, its spill statement; chapter 4's reading of
  the original's 29 % and of the host);
- a CUDA graph is never captured around a phase that launches nothing.

Each check is shown failing on a deliberately broken input first."""

from __future__ import annotations

import io
import math
import re
import tokenize
from pathlib import Path
from typing import Any

import pytest
import torch

import kvwall.experiments  # noqa: F401  (registers the row schemas)
from conftest import BOOK, ROOT
from kvwall.reports import doors_report, fused_bench_report, gather_step_report, heads_report, plots, profile_report
from kvwall.reports import original_gpu_report
from kvwall.reports.chapter import start_chapter
from kvwall.reports.tables import MAX_INLINE_ROWS, Table, times
from kvwall.results import Provenance, Result, ResultMissingError, load_result
from rendered_checks import (
    cpu_figure_problems,
    long_table_problems,
    markdown_tables,
    placeholders,
    ratio_direction_problems,
)

NOTEBOOK_LAYER = ROOT / "lib" / "kvwall" / "notebook"


def _result(experiment: str, rows: list[dict[str, Any]], **params: Any) -> Result:
    provenance = Provenance(
        date="2026-11-30T00:00:00+00:00",
        device="cuda",
        gpu="NVIDIA H200",
        driver=None,
        cuda="13.0",
        torch="2.11.0",
        triton="3.6.0",
        flashinfer=None,
        python="3.11",
        git_commit="0" * 40,
        git_dirty=False,
        sources={},
    )
    return Result(experiment, params, rows, provenance)


def _recorded(name: str) -> Result:
    try:
        return load_result(name)
    except ResultMissingError:
        pytest.skip(f"no recorded {name}")


_EVIDENCE: list[Any] = []


def evidence():
    """Chapter 6's evidence, from the recorded results (loaded once)."""
    from kvwall.reports import decision

    if not _EVIDENCE:
        _EVIDENCE.append(decision.Evidence.load())
    return _EVIDENCE[0]


def _table_problems(table: Table) -> list[str]:
    return [p for t in markdown_tables(table.markdown()) for p in ratio_direction_problems(t["headers"], t["rows"])]


# ---------------------------------------------------------------------------------------------- placeholders


def test_the_placeholder_check_finds_a_lost_f_and_nothing_else():
    lost = "Attention over an {context:,}-token request reads {attention / 1e6:,.1f} MB"
    names = "{x['k']} and {a.b!r} and {n}"
    not_placeholders = "`{n}` in code, $x^{n}$, \\frac{a}{b}, a set {} and {1, 2}\n```\n{n}\n```"
    # (an expression with spaces is not read as a name; the first is enough to fail)
    assert placeholders(lost) == ["{context:,}"]
    assert placeholders(names) == ["{x['k']}", "{a.b!r}", "{n}"]
    assert placeholders(not_placeholders) == []


def _string_runs(source: str) -> list[list[tokenize.TokenInfo]]:
    """Runs of adjacent string literals (implicit concatenation, across lines and comments)."""
    runs, run = [], []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.STRING:
            run.append(tok)
        elif tok.type in (tokenize.NL, tokenize.COMMENT):
            continue
        else:
            if run:
                runs.append(run)
            run = []
    return runs


def _lost_f_strings(source: str) -> list[str]:
    """Plain pieces of an f-string concatenation that hold a ``{name}`` placeholder: the piece lost its ``f``."""
    found = []
    for run in _string_runs(source):
        prefixes = [re.match(r"[A-Za-z]*", t.string).group(0).lower() for t in run]
        if len(run) < 2 or not any("f" in p for p in prefixes):
            continue
        for tok, prefix in zip(run, prefixes):
            if "f" not in prefix and placeholders(tok.string):
                found.append(f"line {tok.start[0]}: {tok.string[:70]}")
    return found


def test_no_piece_of_an_f_string_lost_its_f():
    """Chapter 1 showed "an {context:,}-token request": one line of an f-string concatenation had no ``f``."""
    lost, kept = 'x = (f"a {n:,} b "\n     "c {context:,} d")\n', 'x = (f"a {n:,} b "\n     f"c {context:,} d")\n'
    found = _lost_f_strings(lost)  # the second line's piece, by its line number and its placeholder
    assert len(found) == 1 and found[0].startswith("line 2:") and placeholders(found[0]) == ["{context:,}"]
    assert _lost_f_strings(kept) == []
    found = {p.name: _lost_f_strings(p.read_text()) for p in sorted(NOTEBOOK_LAYER.glob("*.py"))}
    assert not {k: v for k, v in found.items() if v}, found


def test_chapter_1s_bytes_follow_the_roofline():
    """Chapter 1's bytes paragraph (its Markdown, numbers glued) shows these, in decimal MB and GB."""
    from kvwall.model.geometry import GLM5
    from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes

    b, cast = profile_report.cast_bytes(8192), full_pool_cast_bytes(GLM5, 495_000)
    assert (b.read_mb, b.written_mb, b.total_mb) == (cast["read"] / 1e6, cast["written"] / 1e6, cast["total"] / 1e6)
    assert b.step_gb == pytest.approx(cast["total"] * GLM5.num_layers / 1e9)
    assert b.attention_mb == attention_read_bytes(GLM5, 8192) / 1e6 == 8192 * 576 * 2 / 1e6
    assert b.over_attention == pytest.approx(cast["total"] / attention_read_bytes(GLM5, 8192))


# ---------------------------------------------------------------------------------------------- ratios


def test_the_ratio_check_wants_a_direction():
    ratio, error = "vs FlashMLA BF16", "error vs float64"
    broken = Table([{"x": 1.5, "e": 1e-3}], {ratio: ("x", times(2)), error: "e"}, "c")
    problems = _table_problems(broken)  # one: the ratio column, named, not the error column
    assert len(problems) == 1 and repr(ratio) in problems[0] and repr(error) not in problems[0]
    vs = Table([{"x": 1.5}], {"ours / FlashMLA vs before": ("x", times(2))}, "c")
    assert "says 'vs'" in _table_problems(vs)[0]
    assert ratio_direction_problems(["error ratio"], [["3.1"]])  # "ratio" in the header: a ratio column
    headers, row = ["preparation fitted", "heads × tokens"], ["1,040 GB/s", "16 × 64"]
    assert not ratio_direction_problems(headers, [row])  # a rate and a shape are not ratios
    fine = Table([{"x": 1.5}], {"FlashMLA BF16 µs / ours' µs (>1: ours faster)": ("x", times(2))}, "c")
    assert _table_problems(fine) == []


def test_chapters_5_and_6_divide_flashmla_bf16s_time_by_the_others():
    """Chapter 5 showed a speed ratio and chapter 6 a time ratio under the same words ("vs FlashMLA BF16"): both
    are now FlashMLA BF16's µs over the other path's (>1: the other is faster), and say so."""
    fb = fused_bench_report
    bench = _recorded("fused_decode_bench")
    grid = fused_bench_report.Grid(bench)
    advice = fused_bench_report.what_to_run(grid, grid.caption)
    lead = fused_bench_report.lead(grid, grid.caption).table
    for table in (advice, lead):
        assert _table_problems(table) == []
    header = next(h for h in advice.columns if h.startswith("FlashMLA BF16 µs / ours"))
    assert re.search(r"\(>1: (\w+)", header).group(1) == "ours"  # which side a ratio over 1 favours
    for (
        r
    ) in advice.rows:  # the number under it is FlashMLA BF16's time over ours' (geometric mean over the row's points)
        batches = {1} if r["batch"] == "1" else {8, 32, 64}
        points = [p for p in grid.points if p[0] == r["heads"] and p[2] in batches and grid.us(fb.OURS, p)]
        over = [grid.us(fb.FM_BF16, p) / grid.us(fb.OURS, p) for p in points if grid.us(fb.FM_BF16, p)]
        assert over and r["vs"] == pytest.approx(math.prod(over) ** (1 / len(over)))
    ev = evidence()
    table = heads_report.kernel_table(ev, "c")
    if table is None:
        pytest.skip("no recorded benchmark for chapter 6's kernel table")
    assert _table_problems(table) == []
    bf16 = next(h for h in table.columns if h.startswith("FlashMLA BF16 µs / "))
    assert re.search(r"\(>1: (\w+)", bf16).group(1) == "it"
    shown = dict(zip(table.column("heads, batch"), table.column(bf16)))
    for r in heads_report.kernel_rows(ev):
        if r["fm_bf16"]:
            assert r["bf16_x"] == r["fm_bf16"] / r["best_us"]
            assert shown[f"{r['heads']} heads, batch {r['batch']}"] == f"{r['bf16_x']:.2f}×"


def test_chapter_6s_kernel_choice_follows_its_table():
    """Under a table where ours is the faster accurate path everywhere, chapter 6 said "runs ours where it wins and
    gather_cast where it does not"; the counts its sentence quotes are the rows', and flip with them."""
    from kvwall.reports import decision

    ev = evidence()
    rows = heads_report.kernel_rows(ev)
    if not rows:
        pytest.skip("no recorded benchmark for chapter 6's kernel table")
    for h, (ours, batches, bf16) in heads_report.fastest_by_heads(ev).items():
        mine = [r for r in rows if r["heads"] == h]
        assert ours == [r["batch"] for r in mine if r["best"] == "ours"] and batches == [r["batch"] for r in mine]
        assert bf16 == sum(bool(r["fm_bf16"]) and r["fm_bf16"] < r["best_us"] for r in mine)
    slow = [
        dict(r, us=r["us"] * 100) if r.get("strategy") == "ours" and r.get("batch", 1) > 1 else r for r in ev.bench.rows
    ]
    slowed = decision.Evidence(
        **{
            **{k: getattr(ev, k) for k in ("step", "sweep", "validation", "doors_checks", "doors_sm90", "fit")},
            "bench": Result(ev.bench.experiment, ev.bench.params, slow, ev.bench.provenance),
        }
    )
    flipped = heads_report.kernel_rows(slowed)
    n = sum(r["best"] == "ours" for r in flipped)
    assert 0 < n < len(flipped), "slowing ours at batch > 1 should hand those points to gather_cast"
    by_heads = heads_report.fastest_by_heads(slowed)
    assert sum(len(ours) for ours, _, _ in by_heads.values()) == n
    assert all(b == 1 for ours, _, _ in by_heads.values() for b in ours)  # ours only where it was not slowed


# ---------------------------------------------------------------------------------------------- long tables


def test_a_long_table_is_folded_and_its_caption_stays_in_view():
    long = Table([{"n": i} for i in range(MAX_INLINE_ROWS + 1)], {"n": "n"}, "the caption")
    text = long.markdown()
    assert text.startswith("<details>") and text.endswith("*the caption*") and "</details>" in text
    assert long_table_problems(text) == []
    unfolded = text.replace("<details>", "").replace("</details>", "")
    assert long_table_problems(unfolded)  # the check fails on the same table shown inline
    assert long_table_problems(unfolded, hidden=True) == []  # ... unless the cell's output is hidden
    short = Table([{"n": i} for i in range(MAX_INLINE_ROWS)], {"n": "n"}, "c").markdown()
    assert "<details>" not in short and long_table_problems(short) == []


def test_chapter_3s_replays_are_counted_in_view_and_listed_folded():
    checks = _recorded("doors_checks")
    replays = checks.table("replays")
    counts = doors_report.replay_counts(replays)  # the summary's rows: one per path
    assert len(counts) <= MAX_INLINE_ROWS < len(replays)
    counted = 0
    for door, by_family in counts.items():
        for family, (reached, n) in by_family.items():
            sel = [r for r in replays if r["door"] == door and r["family"] == family]
            assert n == len(sel) > 0 and reached == sum(r["outcome"] == "kernel_reached" for r in sel)
            counted += n
    assert counted == len(replays)
    chapter = (BOOK / "03_the_other_doors.md").read_text()
    assert "doors_report.replay_counts(" in chapter


# ---------------------------------------------------------------------------------------------- front page


def _toc_files() -> list[str]:
    import yaml

    def walk(node: Any) -> list[str]:
        if isinstance(node, dict):
            return ([node["file"]] if "file" in node else []) + [f for v in node.values() for f in walk(v)]
        if isinstance(node, list):
            return [f for v in node for f in walk(v)]
        return []

    return walk(yaml.safe_load((ROOT / "_toc.yml").read_text()))


def _front_page_chapters(index: str) -> list[str]:
    section = index.split("## The chapters", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\|\s*\{doc\}`([^`]+)`", section, re.M)


def test_the_front_page_lists_every_chapter_of_the_toc():
    """Every page of ``_toc.yml`` but the front page and the reproducibility page is a row of index.md's
    "The chapters" table, in the table of contents' order (read from _toc.yml, not typed here)."""
    chapters = [Path(f).name for f in _toc_files() if Path(f).name not in ("index", "reproducibility")]
    listed = _front_page_chapters((BOOK / "index.md").read_text())
    assert chapters and listed == chapters, f"the front page lists {listed}; _toc.yml has {chapters}"
    one = "## The chapters\n\n| a | b |\n| {doc}`01_x` | q |\n"
    assert _front_page_chapters(one) == ["01_x"]


# ---------------------------------------------------------------------------------------------- CPU figures


def test_a_figure_measured_live_on_a_cpu_says_so_in_its_title():
    run = start_chapter("x", mode="cpu", record=False, defaults={"gpu": {}, "cpu": {}})
    caption = run.live_caption("4 layers")
    assert caption.startswith(plots.CPU_LIVE_CAPTION)  # the caption the figure recognises is the chapter's own
    title = "One decode step"
    fig = plots.bar(["ours", "full cast"], {"ms": [860.9, 1086.6]}, title=title, yaxis="ms", caption=[caption])
    assert fig.layout.title.text.startswith(f"<b>{plots.CPU_LIVE_TITLE}</b>") and title in fig.layout.title.text
    assert cpu_figure_problems(fig.to_plotly_json()) == []
    broken = fig.to_plotly_json()
    broken["layout"]["title"]["text"] = title
    assert cpu_figure_problems(broken)  # the check fails on the same figure untitled
    recorded = plots.bar(
        ["ours"], {"ms": [1.0]}, title=title, yaxis="ms", caption=["Recorded on NVIDIA H200, 2026-12-02."]
    )
    assert plots.CPU_LIVE_TITLE not in recorded.layout.title.text
    checks = plots.with_caption(plots.go.Figure(plots.go.Heatmap(z=[[1]])), [caption], measured=False)
    assert plots.CPU_LIVE_TITLE not in (checks.layout.title.text or "") and not cpu_figure_problems(
        checks.to_plotly_json()
    )


# ---------------------------------------------------------------------------------------------- computed sentences


def _build(arch: str, spills: int, **extra: Any) -> dict[str, Any]:
    return {
        "kernel": "ours (Triton path)",
        "heads": 16,
        "heads_per_cta": None,
        "arch": arch,
        "cap": 100,
        "shape": "",
        "error": "",
        "spills": spills,
        "fits": True,
        "trap_only": False,
        **extra,
    }


def test_chapter_6s_spill_statement_follows_the_builds():
    """Chapter 6 said "no spills" above an sm_100 row with 8 B spilled: its caption now quotes the builds that
    spilled."""
    builds = [_build("sm_90", 0), _build("sm_100a:tmem", 8), _build("sm_120", 0, error="no ptxas")]
    spilled, compiled = original_gpu_report.spilled_builds(builds)
    assert spilled == [builds[1]] and compiled == 2
    assert original_gpu_report.spilled_builds(builds[:1]) == ([], 1)
    chapter = (BOOK / "06_the_answer.md").read_text()
    assert 'no spills."' not in chapter and "sm120_report.spilled_builds(builds)" in chapter


def _strategy(name: str, host: float, graph: float, unmarked: float) -> dict[str, Any]:
    return {
        "section": "strategies",
        "strategy": name,
        "name": name,
        "layers": 2,
        "step_ms": graph,
        "kv_strategy_ms_per_step": 1.0,
        "graph_step_ms": graph,
        "graph_kv_ms_per_step": 1.0,
        "host_enqueue_ms": host,
        "unmarked_step_ms": unmarked,
        "graph_phase_sum_ms": graph,
        "rel_err_vs_float64": 1e-3,
    }


def test_chapter_4s_host_sentence_follows_the_recorded_times():
    """Chapter 4 called eager steps host-bound where its own table and figure said no strategy was."""
    calm = _result("gather_cast_profile", [_strategy("a", 10.0, 25.0, 25.1), _strategy("b", 20.0, 25.0, 25.2)])
    host = gather_step_report.host_summary(calm)
    assert host["bound"] == [] and host["strategies"] == 2 and host["share"] == pytest.approx(0.8)
    busy = _result("gather_cast_profile", [_strategy("a", 30.0, 25.0, 31.0), _strategy("b", 20.0, 25.0, 25.2)])
    host = gather_step_report.host_summary(busy)
    assert [s["strategy"] for s in host["bound"]] == ["a"] and host["share"] == pytest.approx(0.8)
    chapter = (BOOK / "04_gather_then_cast.md").read_text()
    # the strategies it calls host-bound are the computed ones, glued (never a typed list)
    assert "gather_step_report.host_summary(rec_profile)" in chapter and "{glue:text}`host_bound`" in chapter
    recorded = _recorded("gather_cast_profile")
    assert gather_step_report.host_summary(recorded)["bound"] == gather_step_report.host_bound(recorded)


def test_chapter_4s_capacity_reading_lands_on_the_originals_figure():
    """The capacity the text names (rounded to thousands, as chapter 4 glues it), put back through the recorded rows,
    saves the original's figure (within one point), instead of the nearest measured capacity 9 points away."""
    from kvwall.model.original import ORIGINAL

    gain = gather_step_report.capacity_gain(_recorded("gather_cast_profile"))
    readings = gather_step_report.capacity_readings(gain)
    assert 'round(r["capacity"], -3)' in (BOOK / "04_gather_then_cast.md").read_text()
    for key, reading in (("time_saved", ORIGINAL.gain_as_time_saved), ("speedup", ORIGINAL.gain_as_speedup)):
        saved = reading["time_saved"]
        if readings[key]["capacity"] is None:
            continue
        capacity, a, b = readings[key]["capacity"], readings[key]["a"], readings[key]["b"]
        assert readings[key]["saved"] == saved
        # the step is linear in the capacity between two measured points: saving at the named capacity
        t = (round(capacity, -3) - a["capacity"]) / (b["capacity"] - a["capacity"])
        assert abs(a["time_saved"] + t * (b["time_saved"] - a["time_saved"]) - saved) < 0.01


# ---------------------------------------------------------------------------------------------- empty graphs


def test_no_cuda_graph_is_captured_around_a_phase_without_kernels(monkeypatch):
    """Chapter 6's GPU run printed torch's "The CUDA Graph is empty" warning: the KV phase of a path that reads the
    cache as it is (views, no copy) launches nothing. That phase is now 0 ms and never captured."""
    from kvwall.experiments.answer import step
    from kvwall.model.decode_step import PHASES
    from kvwall.model.step_paths import CacheViews

    captured: list[str] = []

    def fake_graph_ms(calls, device, **kw):
        captured.append(calls[0].__name__ if hasattr(calls[0], "__name__") else "?")
        calls[0]()
        return 1.0

    class Pool:
        num_layers = 2
        geometry = type("G", (), {"kv_lora_rank": 4})()

        def key_buffer(self, layer):
            return torch.zeros(8, 1, 6)

        def write_new_tokens(self, *a):
            captured.append("write")

    class Cast:  # a strategy that copies: its KV phase launches work
        name = "cast"

        def prepare_kv(self, pool, layer, dtype):
            return CacheViews("views").prepare_kv(pool, layer, dtype)

    def model(strategy):
        return type(
            "M",
            (),
            {
                "pool": Pool(),
                "strategy": strategy,
                "q_dtype": torch.bfloat16,
                "batch": type("B", (), {"new_token_slots": None})(),
                "new_kv": None,
                "attention": staticmethod(lambda *a: None),
                "q_nope": None,
                "q_pe": None,
                "rest_of_layer": staticmethod(lambda: None),
            },
        )()

    monkeypatch.setattr(step, "graph_ms", fake_graph_ms)
    views = step._graph_phase_ms(model(CacheViews("views")), torch.device("cpu"), 1)
    assert views[PHASES[1]] == 0.0 and len([c for c in captured if c == "<lambda>"]) == 3
    captured.clear()
    cast = step._graph_phase_ms(model(Cast()), torch.device("cpu"), 1)
    assert cast[PHASES[1]] == 1.0 and len([c for c in captured if c == "<lambda>"]) == 4


def test_a_glued_value_with_a_lost_f_is_found(tmp_path):
    """A value glued for the Markdown (myst-nb ``glue(..., display=False)``: its bundle under the papermill prefix)
    is checked like any rendered text."""
    import nbformat

    from rendered_checks import notebook_problems

    prefix = "application/papermill.record/"
    nb = nbformat.v4.new_notebook()
    for name, text in (("fine", "'16 heads'"), ("lost_f", "'{heads} heads'")):
        cell = nbformat.v4.new_code_cell("glue(...)")
        cell.outputs = [
            nbformat.v4.new_output(
                "display_data",
                data={prefix + "text/plain": text},
                metadata={"scrapbook": {"name": name, "mime_prefix": prefix}},
            )
        ]
        nb.cells.append(cell)
    nbformat.write(nb, tmp_path / "ch.ipynb")
    problems = notebook_problems(tmp_path / "ch.ipynb")
    assert len(problems) == 1 and "'lost_f'" in problems[0] and "{heads}" in problems[0]

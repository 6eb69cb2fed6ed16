"""The layout checker itself: it must flag what a reader would see wrong, and pass what is right.

A deliberately broken figure (caption drawn over the axis title, legend over the title, a title wider than the
figure) and a wide table with nothing to scroll it must be reported; the book's own figure helpers and a table in
a scrolling container must not be. Without this the browser check of the built book could pass by seeing nothing.
"""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import plotly.io as pio
import pytest
from plotly.offline import get_plotlyjs

from kvwall.reports import plots
from kvwall.reports.tables import markdown_table
from layout_check import MAX_TABLE_PX, check_page, chromium, problems

#: About the width of the book's content column at a 1300 px window.
COLUMN_PX = 692


def _page(tmp_path, figures: list[go.Figure], tables_html: str = "") -> Path:
    divs = "\n".join(pio.to_html(f, include_plotlyjs=False, full_html=False) for f in figures)
    html = (
        f"<html><head><script>{get_plotlyjs()}</script></head><body><main><article style='width:{COLUMN_PX}px'>"
        f"{divs}{tables_html}</article></main></body></html>"
    )
    page = tmp_path / "page.html"
    page.write_text(html)
    return page


def _broken_figure() -> go.Figure:
    fig = go.Figure(go.Bar(x=["a", "b"], y=[1, 2], name="first series"))
    fig.add_bar(x=["a", "b"], y=[2, 1], name="second series")
    fig.update_layout(
        title=dict(text="A title the legend sits on", y=0.97),
        xaxis_title="the x axis",
        legend=dict(orientation="h", x=0, y=1.25, yanchor="bottom"),
        margin=dict(t=60, b=120),
    )
    # The caption where the old helper put it for two-line tick labels: over the axis title.
    fig.add_annotation(
        text="Recorded on NVIDIA H200, provenance",
        xref="paper",
        yref="paper",
        x=0.5,
        y=0,
        yshift=-40,
        showarrow=False,
        yanchor="top",
    )
    return fig


def _clipped_title_figure() -> go.Figure:
    fig = go.Figure(go.Scatter(x=[1, 2], y=[1, 2]))
    fig.update_layout(title="a title much too long for any figure in a book column " * 3)
    return fig


@pytest.fixture(scope="module")
def browser():
    found = chromium()
    if not found:
        pytest.skip("no Chromium on this machine: the layout checker cannot run")
    return found


def test_checker_flags_overlaps_clipped_text_and_wide_tables(browser, tmp_path):
    rows = [{f"column {i}": "`a_long_unbreakable_identifier_of_the_kind_tables_hold`" for i in range(6)}]
    wide = (
        "<table><thead><tr>"
        + "".join(f"<th>column {i}</th>" for i in range(6))
        + "</tr></thead><tbody><tr>"
        + "".join(
            "<td style='white-space:nowrap'>a_long_unbreakable_identifier_of_the_kind_tables_hold</td>"
            for _ in range(6)
        )
        + "</tr></tbody></table>"
    )
    assert markdown_table(rows, {k: k for k in rows[0]})  # the same shape of table a chapter prints
    broken, clipped = _broken_figure(), _clipped_title_figure()
    report = check_page(_page(tmp_path, [broken, clipped], f"<div>{wide}</div>"), browser)
    # the boxes that overlap, by their text ("kind: text"): the legend (its series' names) over the title, and the
    # caption over the x axis title
    overlaps = [{box.split(": ", 1)[1] for box in pair} for pair in report["figures"][0]["overlaps"]]
    legend = "".join(trace.name for trace in broken.data)
    assert {broken.layout.title.text, legend} in overlaps, overlaps
    assert {broken.layout.xaxis.title.text, broken.layout.annotations[0].text} in overlaps, overlaps
    # the second figure's title drawn outside it (the report keeps the text's start)
    (outside,) = report["figures"][1]["outside"]
    assert clipped.layout.title.text.startswith(outside.split(": ", 1)[1]), outside
    # the wide table, clipped with nothing to scroll it, its last column out of view
    (table,) = report["tables"]
    assert table["clipped"] and not table["scrolls"] and table["width"] > table["column_width"], table
    assert [h["visible"] for h in table["headers"] if h["text"] == "column 5"] == [False]
    # one problem a finding, each naming its figure or table
    found = problems(report, visible_headers={"column 5": "the last column"})
    assert [p.split(" (")[0] for p in found] == ["figure 1", "figure 1", "figure 2", "table 1", "table 1"], found


def test_checker_flags_a_long_table_inline_and_passes_it_folded(browser, tmp_path):
    """Chapter 3's 72-row table ran the page about 10,000 px long: a table taller than MAX_TABLE_PX is flagged, the
    same table folded by Table.markdown (a closed <details>) is not."""
    import markdown_it

    from kvwall.reports.tables import MAX_INLINE_ROWS, Table

    rows = [{"family": "SM90", "path": f"path {i}", "answer": "ValueError: refused " * 16} for i in range(72)]
    table = Table(rows, {k: k for k in rows[0]}, "caption")
    render = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render
    inline = render(
        table.markdown()
        .replace("<details>", "")
        .replace("</details>", "")
        .replace(f"<summary>The full table: {len(rows)} rows (click to open)</summary>", "")
    )
    report = check_page(_page(tmp_path, [], inline), browser)
    (drawn,) = report["tables"]
    assert drawn["rows"] == len(rows) and not drawn["folded"] and drawn["height"] > MAX_TABLE_PX, drawn
    found = problems(report)
    assert len(found) == 1 and "tall" in found[0] and str(len(rows)) in found[0], found
    assert len(rows) > MAX_INLINE_ROWS and "<details>" in table.markdown()
    folded = problems(check_page(_page(tmp_path, [], render(table.markdown())), browser))
    assert not [p for p in folded if "tall" in p], folded


def test_checker_passes_the_books_figures_and_a_scrolling_table(browser, tmp_path):
    caption = [
        "Recorded on NVIDIA H200 (SM90), 2026-11-30, torch 2.11.0, triton 3.6.0, FlashInfer 0.6.18.post1, "
        "commit 0123456789ab, full scale; the fingerprint of the code it depends on matches.",
        "Each phase: its 78 layers captured in a CUDA graph and replayed (device time).",
    ]
    step = plots.step_breakdown(
        {
            "whole-pool cast<br>(before)": {"write_kv": 0.5, "kv_strategy": 60.0, "attention": 8.0},
            "gather_cast<br>(after)": {"write_kv": 0.5, "kv_strategy": 2.0, "attention": 8.0},
            "original, RTX PRO 6000<br>(as reported)": {"original_cast": 64.6, "original_rest": 21.4},
        },
        "One decode step with each KV strategy (CUDA graphs)",
        caption,
    )
    many = plots.lines(
        {f"a series with a long legend name {i}": ([1, 10, 100], [i + 1, i + 2, i + 3]) for i in range(6)},
        "Step time saved against the graph's capacity",
        "capacity of the index buffer (rows)",
        "% of the step saved",
        caption,
        log_y=False,
    )
    top = plots.lines(
        {f"strategy {i}": ([1, 10, 100], [i + 1, i + 2, i + 3]) for i in range(9)},
        "A legend laid out on top",
        "context",
        "µs",
        caption,
        legend="top",
    )
    cells = "".join("<td style='white-space:nowrap'>" + "x" * 60 + "</td>" for _ in range(6))
    wide = (
        "<div style='overflow-x:auto'><table><thead><tr>"
        + "".join(f"<th>c{i}</th>" for i in range(6))
        + f"</tr></thead><tbody><tr>{cells}</tr></tbody></table></div>"
    )
    report = check_page(_page(tmp_path, [step, many, top], wide), browser)
    assert len(report["figures"]) == 3 and all(f["boxes"] for f in report["figures"]), report["figures"]
    kinds = {b["kind"].split()[0] for f in report["figures"] for b in f["boxes"]}
    assert {"title", "legend", "x", "y", "annotation"} <= kinds, kinds
    assert problems(report) == []
    assert report["tables"][0]["scrolls"]

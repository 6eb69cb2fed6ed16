// The book's layout check, run inside a page by headless Chromium (tests/layout_check.py injects it).
// It waits for every plotly figure to draw, then writes a JSON report into <pre id="kvwall-layout-report">:
//   figures: per figure, its text boxes (title, legend, axis titles, paper-placed annotations such as the
//            provenance caption), the pairs that overlap, the boxes that stick out of the figure, and heatmap
//            cell text smaller than 11 px;
//   tables:  per table, its width against the content column, whether a scrolling container holds it, and
//            its header cells' positions (which of them a reader sees without scrolling).
(function () {
  "use strict";
  const MIN_HEATMAP_PX = 11;
  const SLACK = 1; // px: boxes that merely touch do not overlap

  function rect(el) {
    const r = el.getBoundingClientRect();
    return { left: r.left, top: r.top, right: r.right, bottom: r.bottom, width: r.width, height: r.height };
  }

  function overlap(a, b) {
    return a.left < b.right - SLACK && b.left < a.right - SLACK && a.top < b.bottom - SLACK && b.top < a.bottom - SLACK;
  }

  function textBoxes(gd) {
    const boxes = [];
    const add = (kind, el, textOf) => {
      if (!el) return;
      const r = rect(el);
      const text = ((textOf || el).textContent || "").slice(0, 80);
      if (r.width > 0 && r.height > 0) boxes.push({ kind, text, ...r });
    };
    gd.querySelectorAll(".g-gtitle text.gtitle").forEach((el) => add("title", el));
    gd.querySelectorAll("g.legend").forEach((el) => add("legend", el.querySelector("rect.bg") || el, el));
    gd.querySelectorAll("text").forEach((el) => {
      const cls = el.getAttribute("class") || "";
      if (/^[xy]\d*title$/.test(cls)) add(cls.startsWith("x") ? "x axis title" : "y axis title", el);
    });
    const annotations = (gd._fullLayout && gd._fullLayout.annotations) || [];
    gd.querySelectorAll("g.annotation").forEach((el) => {
      const i = Number(el.getAttribute("data-index"));
      const a = annotations[i];
      if (a && a.xref === "paper" && a.yref === "paper") add(`annotation ${i}`, el.querySelector(".annotation-text-g") || el);
    });
    return boxes;
  }

  function checkFigure(gd, index) {
    const svg = gd.querySelector("svg.main-svg");
    const frame = svg ? rect(svg) : rect(gd);
    const boxes = textBoxes(gd);
    const overlaps = [];
    for (let i = 0; i < boxes.length; i++)
      for (let j = i + 1; j < boxes.length; j++)
        if (overlap(boxes[i], boxes[j])) overlaps.push([boxes[i].kind + ": " + boxes[i].text, boxes[j].kind + ": " + boxes[j].text]);
    const outside = boxes.filter((b) => b.left < frame.left - SLACK || b.right > frame.right + SLACK
      || b.top < frame.top - SLACK || b.bottom > frame.bottom + SLACK).map((b) => b.kind + ": " + b.text);
    const small = [];
    gd.querySelectorAll(".heatmaplayer text, g.hm text, text.heatmap-text").forEach((el) => {
      const px = parseFloat(getComputedStyle(el).fontSize);
      if (px < MIN_HEATMAP_PX && (el.textContent || "").trim()) small.push(`${px.toFixed(1)} px: ${el.textContent.slice(0, 40)}`);
    });
    const title = boxes.find((b) => b.kind === "title");
    return { index, title: title ? title.text : "", width: frame.width, height: frame.height, boxes, overlaps,
             outside, small_heatmap_text: small };
  }

  function scrollingAncestor(el, stop) {
    for (let p = el.parentElement; p && p !== stop && p !== document.body; p = p.parentElement) {
      const ox = getComputedStyle(p).overflowX;
      if (ox === "auto" || ox === "scroll") return p;
    }
    return null;
  }

  function checkTable(table, column, index) {
    const t = rect(table);
    const scroller = scrollingAncestor(table, column);
    const view = scroller ? rect(scroller) : rect(column);
    const headers = [...table.querySelectorAll("thead th, tr:first-child th")].map((th) => {
      const r = rect(th);
      return { text: (th.textContent || "").trim().slice(0, 60), left: r.left, right: r.right,
               visible: r.right <= view.right + SLACK && r.left >= view.left - SLACK };
    });
    const col = rect(column);
    // Height as drawn: 0 inside a closed <details> (Chromium still lays such content out when asked for its box);
    // a table in a box that scrolls vertically counts as that box.
    const oy = scroller ? getComputedStyle(scroller).overflowY : "";
    const folded = !!table.closest("details:not([open])");
    const height = folded ? 0 : (oy === "auto" || oy === "scroll") ? Math.min(t.height, rect(scroller).height) : t.height;
    return { index, width: t.width, height, folded, rows: table.querySelectorAll("tbody tr").length,
             column_width: col.width, right: t.right, column_right: col.right,
             scrolls: !!scroller, scroller_right: scroller ? view.right : null,
             clipped: t.right > col.right + SLACK && !(scroller && view.right <= col.right + SLACK),
             headers, caption: ((table.parentElement && table.parentElement.nextElementSibling
               && table.parentElement.nextElementSibling.textContent) || "").trim().slice(0, 80) };
  }

  function report() {
    try { write(build()); } catch (e) { write({ error: String(e && e.stack || e) }); }
  }

  function write(obj) {
    const out = document.createElement("pre");
    out.id = "kvwall-layout-report";
    out.textContent = JSON.stringify(obj);
    document.body.appendChild(out);
  }

  function build() {
    const column = ["article.bd-article", "#main-content article", "main article", "article", "main", "body"]
      .map((sel) => document.querySelector(sel)).find((el) => el);
    const figures = [...document.querySelectorAll(".plotly-graph-div, .js-plotly-plot")]
      .filter((gd, i, all) => all.indexOf(gd) === i && !(gd.parentElement && gd.parentElement.closest(".js-plotly-plot")))
      .map(checkFigure);
    const tables = [...column.querySelectorAll("table")].map((t, i) => checkTable(t, column, i));
    return { url: location.href, viewport: [innerWidth, innerHeight], page_height: document.documentElement.scrollHeight,
             column_width: rect(column).width, figures,
             tables };
  }

  function drawn() {
    const divs = document.querySelectorAll(".plotly-graph-div");
    return [...divs].every((d) => d.querySelector("svg.main-svg"));
  }

  let tries = 0;
  function wait() {
    if (drawn() || tries++ > 100) setTimeout(report, 500);
    else setTimeout(wait, 200);
  }
  if (document.readyState === "complete") wait();
  else window.addEventListener("load", wait);
})();

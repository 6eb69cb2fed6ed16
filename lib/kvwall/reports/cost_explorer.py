"""Chapter 6's interactive cost explorer, and the table behind it (``python -m kvwall cost`` prints the same rows).

The cost model (:mod:`kvwall.model.cost`, fitted on the recorded H200 sweep) is the one source of truth: every
state the explorer can show is computed here, in Python, and embedded in the page as a compact grid; the page's
JavaScript only looks values up and draws them with plotly.js (the copy the chapter's other figures bring: offline,
no CDN). The initial state comes from ``location.hash`` (``#explorer:model=glm-5&gpu=h200&tp=4&context=8192&
batch=1&pool=495000``), and every draw writes what it drew into the container's ``data-drawn`` attribute (JSON), so
a headless browser's DOM shows it.
"""

from __future__ import annotations

import html
import itertools
import json
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from IPython.display import HTML

from kvwall.experiments import EXPERIMENTS
from kvwall.model.paths import kv_bytes_per_token as paths_kv_bytes
from kvwall.model.cost import GPUS, MODEL_PRESETS, PATHS, TRANSFER_RULES, CostModel, GPUSpec, Point, paths_on
from kvwall.model.geometry import MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.reports.answer_report import SWEEP_COLORS

__all__ = ["TENSOR_PARALLEL", "CONTEXTS", "BATCHES", "POOLS", "State", "ORIGINAL_STATE", "CostRow", "cost_rows",
           "kv_bytes_per_token", "memory_note", "rates_note", "explorer_states", "explorer_grid", "grid_values",
           "explorer_html", "cost_explorer"]

#: The explorer's choices (any other value still works in :func:`cost_rows` and the CLI).
TENSOR_PARALLEL = (1, 2, 4, 8)
CONTEXTS = (1024, 8192, 32768, 131072)
BATCHES = (1, 8, 32, 64)
POOLS = (ORIGINAL.pool_tokens, 1_048_576)


@dataclass(frozen=True)
class State:
    """One choice of every control: model preset, GPU, tensor parallel degree, context per request, requests, pool;
    ``layers`` / ``heads`` (the model's attention heads, all GPUs) override the preset for a user's own MLA shape
    (the CLI's ``--layers`` / ``--heads``; the explorer's grid holds the presets only)."""

    model: str
    gpu: str
    tp: int
    context: int
    batch: int
    pool: int
    layers: int | None = None
    heads: int | None = None

    def problem(self) -> str | None:
        """Why this state cannot be predicted (None when it can)."""
        if self.model not in MODEL_PRESETS:
            return f"unknown model {self.model!r}; choose from {', '.join(MODEL_PRESETS)}"
        if self.gpu not in GPUS:
            return f"unknown GPU {self.gpu!r}; choose from {', '.join(GPUS)}"
        if any(v is not None and v < 1 for v in (self.layers, self.heads)):
            return "layers and heads must be positive"
        heads = self.heads if self.heads is not None else MODEL_PRESETS[self.model].num_heads
        if self.tp < 1 or heads % self.tp:
            return f"tensor parallel {self.tp} does not divide {self.model}'s {heads} heads"
        if min(self.context, self.batch, self.pool) < 1:
            return "context, batch and pool must be positive"
        if not self.fits:
            return (f"batch {self.batch} × context {self.context:,} = {self.tokens:,} tokens do not fit in a pool of "
                    f"{self.pool:,} tokens")
        return None

    @property
    def key(self) -> str:
        return f"{self.model}|{self.gpu}|{self.tp}|{self.context}|{self.batch}|{self.pool}"

    @property
    def tokens(self) -> int:
        return self.batch * self.context

    @property
    def fits(self) -> bool:
        return self.tokens <= self.pool

    @property
    def geometry(self) -> MLAGeometry:
        preset = MODEL_PRESETS[self.model]
        if self.layers is None and self.heads is None:
            return preset.with_tensor_parallel(self.tp)
        return replace(preset, name=f"{preset.name} (user shape)",
                       num_layers=preset.num_layers if self.layers is None else self.layers,
                       num_heads=preset.num_heads if self.heads is None else self.heads, tensor_parallel=self.tp)

    @property
    def point(self) -> Point:
        geometry = self.geometry
        return Point(geometry.heads_per_gpu, self.batch, self.tokens, self.pool, geometry)


def _original_state() -> State:
    """GLM-5 as the original served it, on its GPU: the book's decode step (``decode_step_paths``, full scale)."""
    full = EXPERIMENTS["decode_step_paths"].full
    return State("glm-5", "rtx-pro-6000", full["tensor_parallel"], full["context_lens"][0], len(full["context_lens"]),
                 full["pool_tokens"])


#: The original's settings (the explorer's default state).
ORIGINAL_STATE = _original_state()


@dataclass(frozen=True)
class CostRow:
    """One path at one state: µs per layer and ms of KV work per step (low, high over the transfer rules)."""

    path: str
    label: str
    cache: str  # "FP8" or "BF16": the dtype the cache is stored in
    kv_bytes_per_token: int  # all layers
    layer_lo_us: float
    layer_hi_us: float
    step_lo_ms: float  # layers × per-layer µs / 1000: KV work only (preparation + attention)
    step_hi_ms: float


def kv_bytes_per_token(geometry: MLAGeometry, cache: str) -> int:
    """Bytes one token takes over every layer in an FP8 or a BF16 cache, its slot index included (chapter 6's one
    definition, :func:`kvwall.model.paths.kv_bytes_per_token`)."""
    return paths_kv_bytes(geometry, torch.bfloat16 if cache.lower() == "bf16" else torch.float8_e4m3fn)


def cost_rows(model: CostModel, state: State, rule: str | None = None) -> list[CostRow]:
    """One row per path that exists on ``state``'s GPU at its heads per GPU. ``rule`` None: the range over
    :data:`~kvwall.model.cost.TRANSFER_RULES`; else that rule alone (low = high)."""
    problem = state.problem()
    if problem:
        raise ValueError(problem)
    if rule is not None and rule not in TRANSFER_RULES:
        raise ValueError(f"unknown transfer rule {rule!r}; use one of {TRANSFER_RULES}")
    gpu, p = GPUS[state.gpu], state.point
    rows = []
    for path in paths_on(gpu.arch, p.heads):
        if rule is None:
            lo, hi = model.layer_range_us(path, p, gpu)
        else:
            lo = hi = model.layer_us(path, p, gpu, rule)
        cache = PATHS[path].cache_dtype.upper()
        layers = p.geometry.num_layers
        rows.append(CostRow(path, PATHS[path].label, cache, kv_bytes_per_token(p.geometry, cache), lo, hi,
                            layers * lo / 1e3, layers * hi / 1e3))
    return rows


def _reference_short(model: CostModel) -> str:
    return model.reference.name.removeprefix("NVIDIA ").removesuffix(" SXM")


def rates_note(model: CostModel, gpu: GPUSpec) -> str:
    """Where a GPU's predictions come from: fitted on the reference GPU, or its datasheet with rates transferred."""
    ref = _reference_short(model)
    if gpu.key == model.reference.key:
        return f"fitted on the {ref} sweep"
    return f"predicted from datasheet ceilings (rates transferred from the {ref})"


def memory_note(model_key: str) -> str:
    """KV bytes per token in an FP8 and a BF16 cache, and the tokens each holds in the original's pool memory."""
    geometry = MODEL_PRESETS[model_key]
    fp8, bf16 = kv_bytes_per_token(geometry, "fp8"), kv_bytes_per_token(geometry, "bf16")
    memory = ORIGINAL.pool_tokens * fp8
    return (f"{geometry.name}: KV bytes per token ({geometry.num_layers} layers × {geometry.kv_dim} values, plus a "
            f"4-byte slot index): "
            f"FP8 cache {fp8:,} B, BF16 cache {bf16:,} B. In the original's pool memory ({ORIGINAL.pool_tokens:,} "
            f"tokens × {fp8:,} B = {memory / 1e9:.1f} GB) an FP8 cache holds {memory // fp8:,} tokens, a BF16 cache "
            f"{memory // bf16:,}.")


def _round3(x: float) -> float | int:
    v = float(f"{x:.3g}")
    return int(v) if v.is_integer() else v


def explorer_states() -> list[State]:
    return [State(*s) for s in itertools.product(MODEL_PRESETS, GPUS, TENSOR_PARALLEL, CONTEXTS, BATCHES, POOLS)]


def explorer_grid(model: CostModel) -> dict[str, Any]:
    """Every explorer state's ms of KV work per step, rounded to 3 significant digits.

    ``{"paths": [path, ...], "states": {State.key: {"<index into paths>": [lo_ms, hi_ms]} or 0 (does not fit)}}``:
    paths by index keep the grid small (full names would repeat ~10,000 times); :func:`grid_values` decodes it."""
    names = list(PATHS)
    states: dict[str, Any] = {}
    for state in explorer_states():
        if not state.fits:
            states[state.key] = 0
            continue
        states[state.key] = {str(names.index(r.path)): [_round3(r.step_lo_ms), _round3(r.step_hi_ms)]
                             for r in cost_rows(model, state)}
    return {"paths": names, "states": states}


def grid_values(grid: dict[str, Any], state: State) -> dict[str, list[float]] | None:
    """A state's ``{path: [lo_ms, hi_ms]}`` from :func:`explorer_grid` (None: it does not fit in its pool)."""
    cell = grid["states"][state.key]
    return None if cell == 0 else {grid["paths"][int(i)]: v for i, v in cell.items()}


def _page_data(model: CostModel) -> dict[str, Any]:
    """Everything the page's script needs: the grid, labels, colours, notes, choices and the default state."""
    return {
        **explorer_grid(model),
        "labels": {p: c.label for p, c in PATHS.items()},
        "colors": {p: SWEEP_COLORS.get(p.removesuffix("_fa2"), "#7f7f7f") for p in PATHS},
        "models": {k: {"name": g.name, "heads": g.num_heads, "layers": g.num_layers, "note": memory_note(k)}
                   for k, g in MODEL_PRESETS.items()},
        "gpus": {k: {"name": g.name, "arch": g.arch, "rates": rates_note(model, g)} for k, g in GPUS.items()},
        "default": {k: str(v) for k, v in asdict(ORIGINAL_STATE).items()},
    }


def _select(uid: str, field: str, label: str, options: list[tuple[str, str]]) -> str:
    opts = "".join(f'<option value="{html.escape(v)}">{html.escape(t)}</option>' for v, t in options)
    return (f'<label style="margin-right:1em">{html.escape(label)} '
            f'<select id="{uid}-{field}" data-field="{field}">{opts}</select></label>')


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


_SCRIPT = r"""
(function () {
  var ID = "__ID__", DATA = __DATA__;
  var FIELDS = ["model", "gpu", "tp", "context", "batch", "pool"];
  var root = document.getElementById(ID), plot = document.getElementById(ID + "-plot");
  var msg = document.getElementById(ID + "-msg"), note = document.getElementById(ID + "-note");
  function sel(f) { return document.getElementById(ID + "-" + f); }
  function fromHash() {
    var h = decodeURIComponent((window.location.hash || "").replace(/^#/, "")), out = {};
    if (h.indexOf("explorer:") !== 0) return out;
    h.slice(9).split("&").forEach(function (kv) {
      var i = kv.indexOf("=");
      if (i > 0) out[kv.slice(0, i)] = kv.slice(i + 1);
    });
    return out;
  }
  function apply(s) {
    FIELDS.forEach(function (f) {
      var el = sel(f), v = s[f];
      var ok = Array.prototype.some.call(el.options, function (o) { return o.value === v; });
      el.value = ok ? v : DATA["default"][f];
    });
  }
  function state() { var s = {}; FIELDS.forEach(function (f) { s[f] = sel(f).value; }); return s; }
  function fmt(v) { return Number(v).toLocaleString("en-US", {maximumSignificantDigits: 3}); }
  function draw() {
    var s = state(), key = FIELDS.map(function (f) { return s[f]; }).join("|");
    var cell = DATA.states[key], m = DATA.models[s.model], g = DATA.gpus[s.gpu];
    var heads = m.heads / Number(s.tp), ctx = Number(s.context);
    var ctxText = ctx % 1024 === 0 ? (ctx / 1024) + "K" : ctx.toLocaleString("en-US");
    note.textContent = m.note;
    var drawn = {state: s, key: key, gpu_rates: g.rates, fits: cell !== 0, values: {}};
    if (cell === 0 || cell === undefined) {
      msg.textContent = s.batch + " requests × " + ctxText + " tokens = " +
        (Number(s.batch) * ctx).toLocaleString("en-US") + " tokens do not fit in a pool of " +
        Number(s.pool).toLocaleString("en-US") + " tokens: nothing to draw. Lower the batch or the context, " +
        "or pick the larger pool.";
      msg.style.display = "block"; plot.style.display = "none";
      root.setAttribute("data-drawn", JSON.stringify(drawn));
      return;
    }
    msg.style.display = "none"; plot.style.display = "block";
    var names = [], y = [], mid = [], lo = [], hi = [], hiEnd = [], text = [], colors = [];
    Object.keys(cell).forEach(function (i) {
      var p = DATA.paths[Number(i)], v = cell[i];
      drawn.values[p] = v; names.push(p); y.push(DATA.labels[p]); colors.push(DATA.colors[p]);
      mid.push((v[0] + v[1]) / 2); lo.push((v[0] + v[1]) / 2 - v[0]); hi.push(v[1] - (v[0] + v[1]) / 2);
      hiEnd.push(v[1]);
      text.push(v[0] === v[1] ? fmt(v[0]) + " ms" : fmt(v[0]) + "–" + fmt(v[1]) + " ms");
    });
    var title = m.name + " on " + g.name + ": " + heads + " heads per GPU (TP " + s.tp + "), " + s.batch +
      " × " + ctxText + " tokens, pool " + Number(s.pool).toLocaleString("en-US") + " tokens" +
      "<br><sub>ms of KV work per decode step, " + g.rates + "</sub>";
    drawn.title = title;
    var log = document.getElementById(ID + "-log").checked;
    Plotly.react(plot, [{
      type: "bar", orientation: "h", x: mid, y: y, customdata: names, marker: {color: colors},
      error_x: {type: "data", symmetric: false, array: hi, arrayminus: lo, color: "#333", thickness: 1.2},
      text: text, textposition: "none", hovertemplate: "%{y}<br>%{text} of KV work per step<extra></extra>"
    }, {
      type: "scatter", mode: "text", x: hiEnd, y: y, textposition: "middle right", cliponaxis: false,
      text: text.map(function (t) { return "  " + t; }), hoverinfo: "skip", textfont: {size: 12}
    }], {
      title: {text: title, font: {size: 14}}, template: "plotly_white", height: 170 + 34 * y.length,
      margin: {l: 10, r: 130, t: 80, b: 50}, bargap: 0.25, showlegend: false,
      xaxis: {title: {text: "ms per decode step (" + m.layers + " layers × predicted µs per layer)"},
              type: log ? "log" : "linear", rangemode: "tozero", automargin: true},
      yaxis: {autorange: "reversed", automargin: true}
    }, {responsive: true, displaylogo: false});
    root.setAttribute("data-drawn", JSON.stringify(drawn));
  }
  var tries = 0;
  function start() {
    if (!window.Plotly) {
      if (++tries > 600) { msg.textContent = "plotly.js did not load: the explorer cannot draw."; return; }
      return setTimeout(start, 100);
    }
    FIELDS.concat(["log"]).forEach(function (f) { sel(f).addEventListener("change", draw); });
    window.addEventListener("hashchange", function () { if (fromHash().model) { apply(fromHash()); draw(); } });
    draw();
  }
  apply(fromHash());
  start();
})();
"""


def explorer_html(model: CostModel, caption: str) -> str:
    """The explorer as one self-contained HTML block (needs plotly.js on the page; waits for ``window.Plotly``)."""
    uid = f"kvx-{uuid.uuid4().hex[:10]}"
    data = json.dumps(_page_data(model), separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
    controls = "".join((
        _select(uid, "model", "model", [(k, g.name) for k, g in MODEL_PRESETS.items()]),
        _select(uid, "gpu", "GPU", [(k, g.name) for k, g in GPUS.items()]),
        _select(uid, "tp", "tensor parallel", [(str(t), str(t)) for t in TENSOR_PARALLEL]),
        _select(uid, "context", "context per request", [(str(c), _tokens(c)) for c in CONTEXTS]),
        _select(uid, "batch", "batch (requests)", [(str(b), str(b)) for b in BATCHES]),
        _select(uid, "pool", "pool tokens", [(str(p), f"{p:,}") for p in POOLS]),
        f'<label><input type="checkbox" id="{uid}-log"> log scale</label>',
    ))
    rules = " and ".join(f"“{r}”" for r in TRANSFER_RULES)
    return (
        f'<div id="{uid}" class="kvwall-cost-explorer" style="margin:1em 0">'
        f'<div style="line-height:2.2">{controls}</div>'
        f'<p id="{uid}-note" style="margin:0.3em 0;font-size:90%"></p>'
        f'<p id="{uid}-msg" style="padding:0.6em;border-left:4px solid #e0a800">Waiting for plotly.js …</p>'
        f'<div id="{uid}-plot" style="width:100%;min-height:300px"></div>'
        f'<p style="font-size:80%;color:#555;margin-top:0.3em">Predicted by the cost model fitted on the H200 sweep. '
        f"Bars: the path's KV work per decode step (preparation + attention, all layers), not the whole step. "
        f"Error bars on datasheet GPUs: the range between the transfer rules {rules}. "
        f"{html.escape(caption)}</p>"
        f"<script>{_SCRIPT.replace('__ID__', uid).replace('__DATA__', data)}</script></div>"
    )


def cost_explorer(model: CostModel, caption: str) -> HTML:
    """:func:`explorer_html` for a notebook cell (chapter 6: ``cost_explorer(fit.model, sweep.caption())``)."""
    return HTML(explorer_html(model, caption))

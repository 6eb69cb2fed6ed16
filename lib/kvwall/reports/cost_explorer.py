"""Chapter 6's interactive cost explorer, and the table behind it (``python -m kvwall cost`` prints the same rows).

The cost model (:mod:`kvwall.model.cost`, fitted on the recorded H200 sweep) is the one source of truth: every
state the explorer can show is computed here, in Python, and embedded in the page as a compact grid; the page's
JavaScript only looks values up and draws them with plotly.js (the copy the chapter's other figures bring: offline,
no CDN). The page -- its controls, notes and script -- is ``cost_explorer.html`` beside this module; its words
about the model (where a GPU's rates come from, what a cache costs) are in ``book/answer.yml``. The initial state
comes from ``location.hash`` (``#explorer:model=glm-5&gpu=h200&tp=4&context=8192&
batch=1&pool=495000``), and every draw writes what it drew into the container's ``data-drawn`` attribute (JSON), so
a headless browser's DOM shows it.
"""

from __future__ import annotations

import html
import itertools
import json
import re
import string
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from IPython.display import HTML

from kvwall.experiments import EXPERIMENTS
from kvwall.model.step_paths import kv_bytes_per_token as paths_kv_bytes
from kvwall.model.cost import GPUS, MODEL_PRESETS, PATHS, TRANSFER_RULES, CostModel, GPUSpec, Point, paths_on
from kvwall.model.geometry import MLAGeometry
from kvwall.model.original import ORIGINAL
from kvwall.reports.answer_report import SWEEP_COLORS, WORDS, fill
from kvwall.reports.rows import Row

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
            return (
                f"batch {self.batch} × context {self.context:,} = {self.tokens:,} tokens do not fit in a pool of "
                f"{self.pool:,} tokens"
            )
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
        return replace(
            preset,
            name=f"{preset.name} (user shape)",
            num_layers=preset.num_layers if self.layers is None else self.layers,
            num_heads=preset.num_heads if self.heads is None else self.heads,
            tensor_parallel=self.tp,
        )

    @property
    def point(self) -> Point:
        geometry = self.geometry
        return Point(geometry.heads_per_gpu, self.batch, self.tokens, self.pool, geometry)


def _original_state() -> State:
    """GLM-5 as the original served it, on its GPU: the book's decode step (``decode_step_paths``, full scale)."""
    full = Row(EXPERIMENTS["decode_step_paths"].full)
    return State(
        "glm-5", "rtx-pro-6000", full.tensor_parallel, full.context_lens[0], len(full.context_lens), full.pool_tokens
    )


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
    definition, :func:`kvwall.model.step_paths.kv_bytes_per_token`)."""
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
        rows.append(
            CostRow(
                path,
                PATHS[path].label,
                cache,
                kv_bytes_per_token(p.geometry, cache),
                lo,
                hi,
                layers * lo / 1e3,
                layers * hi / 1e3,
            )
        )
    return rows


def _reference_short(model: CostModel) -> str:
    return model.reference.name.removeprefix("NVIDIA ").removesuffix(" SXM")


def rates_note(model: CostModel, gpu: GPUSpec) -> str:
    """Where a GPU's predictions come from: fitted on the reference GPU, or its datasheet with rates transferred."""
    return fill(WORDS.explorer.rates, gpu.key == model.reference.key, reference=_reference_short(model))


def memory(model_key: str) -> dict[str, Any]:
    """KV bytes per token in an FP8 and a BF16 cache, and the tokens each holds in the original's pool memory."""
    geometry = MODEL_PRESETS[model_key]
    fp8, bf16, pool = kv_bytes_per_token(geometry, "fp8"), kv_bytes_per_token(geometry, "bf16"), ORIGINAL.pool_tokens
    return dict(
        g=geometry,
        fp8=fp8,
        bf16=bf16,
        pool=pool,
        gb=pool * fp8 / 1e9,
        fp8_tokens=pool * fp8 // fp8,
        bf16_tokens=pool * fp8 // bf16,
    )


def memory_note(model_key: str) -> str:
    """:func:`memory` in a sentence (the explorer shows it under its controls)."""
    return fill(WORDS.explorer.memory_note, **memory(model_key))


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
        states[state.key] = {
            str(names.index(r.path)): [_round3(r.step_lo_ms), _round3(r.step_hi_ms)] for r in cost_rows(model, state)
        }
    return dict(paths=names, states=states)


def grid_values(grid: dict[str, Any], state: State) -> dict[str, list[float]] | None:
    """A state's ``{path: [lo_ms, hi_ms]}`` from :func:`explorer_grid` (None: it does not fit in its pool)."""
    cell = grid["states"][state.key]
    return None if cell == 0 else {grid["paths"][int(i)]: v for i, v in cell.items()}


def _page_data(model: CostModel) -> dict[str, Any]:
    """Everything the page's script needs: the grid, labels, colours, notes, choices and the default state."""
    return dict(
        explorer_grid(model),
        labels={p: c.label for p, c in PATHS.items()},
        colors={p: SWEEP_COLORS.get(p.removesuffix("_fa2"), "#7f7f7f") for p in PATHS},
        models={
            k: dict(name=g.name, heads=g.num_heads, layers=g.num_layers, note=memory_note(k))
            for k, g in MODEL_PRESETS.items()
        },
        gpus={k: dict(name=g.name, arch=g.arch, rates=rates_note(model, g)) for k, g in GPUS.items()},
        default={k: str(v) for k, v in asdict(ORIGINAL_STATE).items()},
    )


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _options(choices: list[tuple[Any, str]]) -> str:
    return "".join(f'<option value="{html.escape(str(v))}">{html.escape(t)}</option>' for v, t in choices)


#: The explorer's page: its controls, notes and script (``$``-placeholders filled by :func:`explorer_html`).
PAGE = string.Template(Path(__file__).with_name("cost_explorer.html").read_text(encoding="utf-8").rstrip())


def explorer_html(model: CostModel, caption: str) -> str:
    """The explorer as one self-contained HTML block (needs plotly.js on the page; waits for ``window.Plotly``)."""
    data = json.dumps(_page_data(model), separators=(",", ":"), ensure_ascii=False).replace("</", "<\\/")
    page = PAGE.substitute(
        uid=f"kvx-{uuid.uuid4().hex[:10]}",
        data=data,
        caption=html.escape(caption),
        rules=" and ".join(f"“{r}”" for r in TRANSFER_RULES),
        model=_options([(k, g.name) for k, g in MODEL_PRESETS.items()]),
        gpu=_options([(k, g.name) for k, g in GPUS.items()]),
        tp=_options([(t, str(t)) for t in TENSOR_PARALLEL]),
        context=_options([(c, _tokens(c)) for c in CONTEXTS]),
        batch=_options([(b, str(b)) for b in BATCHES]),
        pool=_options([(p, f"{p:,}") for p in POOLS]),
    )
    return re.sub(r">\n<", "><", page.split("-->\n", 1)[1])


def cost_explorer(model: CostModel, caption: str) -> HTML:
    """:func:`explorer_html` for a notebook cell (chapter 6: ``cost_explorer(fit.model, sweep.caption())``)."""
    return HTML(explorer_html(model, caption))

"""The book's answer, computed: what to run, per GPU family, SGLang / FlashInfer version and batch.

:func:`decide` turns the recorded results into :class:`Decision` rows; the front page (``book/index.md``) and chapter
6's "What to do" show the same rows (:func:`decision_table`). Every "do this" cell is chosen from numbers:

- **SM90** (measured on the H200): the decode step (``decode_step_paths``) and the sweep (``path_sweep``) say which
  path is faster at one request and at batches; chapter 5's benchmark (``fused_decode_bench``) and validation
  (``fused_decode_validation``) give FlashMLA FP8's speed over the grid and its error;
- **accuracy**: every row's path on sharp and long attention (``fp8_accuracy``, :mod:`kvwall.notebook.accuracy_report`):
  the "accuracy" column, and whether FlashMLA FP8 is advised without a caveat;
- **SM100 / SM120**: chapter 3's door matrix (``doors_checks`` + ``doors_sm90``, folded by
  :func:`kvwall.peers.flashinfer.doors.door_matrix` exactly as chapter 3 does) says which FlashInfer path takes
  GLM-5's FP8 cache there; the cost model fitted on the sweep predicts our paths there (a prediction, labelled).

What SGLang 0.5.23 does with each backend was read from its wheel (chapter 3, :func:`kvwall.notebook.doors_report.
dsa_text`; chapter 6's patch): those facts are constants here, each named where it is used.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from kvwall.model.cost import GPUS
from kvwall.model.original import ORIGINAL
from kvwall.notebook import accuracy_report, fused_bench_report
from kvwall.notebook.answer_report import SweepFit, fit_sweep, headline_point, step_rows, sweep_rows
from kvwall.notebook.doors_report import calls_for_matrix
from kvwall.notebook.original_gpu_report import original_gpu_rows
from kvwall.notebook.tables import Table
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY, door_matrix
from kvwall.results import Result, ResultMissingError, load_result

__all__ = ["Evidence", "Decision", "decide", "decision_table", "decision_caption", "door_cells", "open_doors",
           "flashmla_fp8_error", "batch_comparison", "SOURCES",
           "PATCH_NOTE", "PATCH_NOTE_SHORT"]

#: The recorded results the decision reads (all of them GPU recordings but ``doors_checks``, a CPU replay).
SOURCES = ("decode_step_paths", "path_sweep", "fused_decode_bench", "fused_decode_validation", "doors_checks",
           "doors_sm90", "fp8_accuracy")
#: The batch regime the "batches" rows speak for: mixed batches of at least this many requests.
BIG_BATCH = 16
#: SGLang 0.5.23's backend for a FlashInfer door (its ``attention_registry.py``; chapter 3).
SGLANG_BACKEND = {"fa2": "flashinfer_mla", "fa3": "flashinfer_mla", "trtllm-gen": "trtllm_mla"}
#: Dense doors: every door of the matrix but the DSA (sparse) kernel.
SPARSE_DOOR = "sm120-sparse"


def _link(doc: str, text: str) -> str:
    """A link to a chapter: MyST resolves it to the page in the built site; JupyterLab opens the file."""
    return f"[{text}]({doc}.md)"


CH3, CH4, CH5, CH6 = (_link("03_the_other_doors", "ch. 3"), _link("04_gather_then_cast", "ch. 4"),
                      _link("05_fused_fp8_decode", "ch. 5"), _link("06_the_answer", "ch. 6"))
CH5B = _link("05b_fp8_accuracy", "accuracy")


# ---------------------------------------------------------------------------------------------------------
# The evidence
# ---------------------------------------------------------------------------------------------------------

@dataclass
class Evidence:
    """The recorded results the decision reads (``bench``, ``validation`` and the doors may be missing: the rows
    that need them say so), and the cost model fitted on the sweep."""

    step: Result
    sweep: Result
    bench: Result | None = None
    validation: Result | None = None
    doors_checks: Result | None = None
    doors_sm90: Result | None = None
    accuracy: Result | None = None
    fit: SweepFit | None = None

    def __post_init__(self) -> None:
        if self.fit is None:
            self.fit = fit_sweep(self.sweep)

    @classmethod
    def load(cls, loader: Callable[[str], Result | None] | None = None, fit: SweepFit | None = None,
             **known: Result | None) -> "Evidence":
        """Every result of :data:`SOURCES` through ``loader`` (a chapter's ``recorded_or_none``; default: the
        recorded files, a missing optional one as None); ``known``: results already loaded, by field name
        (``step=``, ``sweep=``)."""
        def default(name: str) -> Result | None:
            try:
                return load_result(name)
            except ResultMissingError:
                if name in ("decode_step_paths", "path_sweep"):
                    raise
                return None
        get = loader or default
        fields = ("step", "sweep", "bench", "validation", "doors_checks", "doors_sm90", "accuracy")
        return cls(*(known[f] if f in known else get(n) for f, n in zip(fields, SOURCES)), fit=fit)

    def results(self) -> list[Result]:
        return [r for r in (self.step, self.sweep, self.bench, self.validation, self.doors_checks, self.doors_sm90,
                            self.accuracy) if r is not None]


def door_cells(checks: Result | None, sm90: Result | None) -> list[dict[str, Any]]:
    """Chapter 3's matrix from its recorded evidence: the release's cited lines and replayed checks
    (``doors_checks``) and the H200's calls (``doors_sm90``, missing downloads set aside as chapter 3 does)."""
    if checks is None:
        return []
    calls = calls_for_matrix(sm90.table("calls")) if sm90 is not None else []
    return door_matrix(checks.table("citations"), checks.table("replays"), calls)


def open_doors(cells: Sequence[dict[str, Any]], family: str, *, dense: bool | None = None) -> list[dict[str, Any]]:
    """The cells of ``family`` that are not refused (``dense``: True only dense doors, False only the sparse one)."""
    return [c for c in cells if c["family"] == family and c["status"] != "refused"
            and (dense is None or (c["door"] != SPARSE_DOOR) == dense)]


def _refused(cells: Sequence[dict[str, Any]], family: str) -> list[str]:
    return [DOOR_BY_KEY[c["door"]].label.split(" (")[0] for c in cells
            if c["family"] == family and c["status"] == "refused" and c["door"] != SPARSE_DOOR]


def flashmla_fp8_error(ev: Evidence) -> tuple[float | None, float | None, str]:
    """FlashMLA dense FP8's worst relative error against float64 and ours' worst, and where they come from:
    ``fused_decode_bench`` (every output of the grid checked against float64 first) where it has both, else
    ``fused_decode_validation`` (its case table: ours' rows, or, in a recording made before ours was validated as
    such, the rows it has)."""
    if ev.bench is not None:
        rows = [r for r in ev.bench.rows if r.get("section") == "bench" and r.get("rel_err_f64") is not None]
        fp8 = [r["rel_err_f64"] for r in rows if r["strategy"] == "flashmla_dense_fp8"]
        ours = [r["rel_err_f64"] for r in rows if r["strategy"] in ("ours", "ours_page64")]
        if fp8 and ours:
            return max(fp8), max(ours), "fused_decode_bench"
    fp8, ours = fused_bench_report.flashmla_fp8_error(ev.validation)  # chapter 5's reading of the case table
    if fp8 is not None and ours is not None:
        return fp8, ours, "fused_decode_validation"
    return None, None, ""


def _bench_us(bench: Result | None) -> dict[tuple[str, int, int, int], float]:
    """``(strategy, heads, context, batch) -> µs`` of every timed row of ``fused_decode_bench``."""
    if bench is None:
        return {}
    return {(r["strategy"], r["heads"], r["context"], r["batch"]): r["us"] for r in bench.rows
            if r.get("section") == "bench" and r.get("us")}


def _sweep_batch(sweep: Result, heads: int = 16) -> dict[str, dict[int, float]]:
    """The sweep's batch axis: ``path -> {batch: µs per layer}``."""
    out: dict[str, dict[int, float]] = {}
    for r in sweep_rows(sweep):
        if r["axis"] == "batch" and r["heads"] == heads and r.get("us"):
            out.setdefault(r["path"], {})[r["batch"]] = r["us"]
    return out


def batch_comparison(sweep: Result, a: str, b: str, *, min_batch: int = 2) -> dict[str, Any]:
    """``a`` against ``b`` on the sweep's batch axis (16 heads, mixed lengths) from ``min_batch`` requests up:
    the batches, where ``a`` is slower, and the range of ``b / a``."""
    us = _sweep_batch(sweep)
    batches = sorted(set(us.get(a, {})) & set(us.get(b, {})))
    batches = [n for n in batches if n >= min_batch]
    ratios = [us[b][n] / us[a][n] for n in batches]
    return {"batches": batches, "slower_at": [n for n in batches if us[a][n] > us[b][n]],
            "ratio_lo": min(ratios, default=None), "ratio_hi": max(ratios, default=None),
            "a_us": {n: us[a][n] for n in batches}, "b_us": {n: us[b][n] for n in batches}}


def _fmt_batches(batches: Sequence[int]) -> str:
    return f"{batches[0]}–{batches[-1]}" if len(batches) > 1 else str(batches[0])


def _span(values: Sequence[float], d: int = 0) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.{d}f}" if round(lo, d) == round(hi, d) else f"{lo:.{d}f}–{hi:.{d}f}"


# ---------------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Decision:
    """One row of the answer: a setup (GPU family, software, batch), what to do (``do``, short: the front page and
    chapter 6 show the same words), the figure that says so in a few words (``figure``, the front page) and in full
    (``because``, chapter 6), the recorded results the numbers come from and the chapters that show them."""

    key: str
    gpu: str
    software: str
    batch: str
    do: str
    figure: str
    because: str
    sources: tuple[str, ...]
    chapters: str
    accuracy: str = "not measured"

    @property
    def setup(self) -> str:
        return ", ".join([f"**{self.gpu}**", *(x for x in (self.software, self.batch) if x)])

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "setup": self.setup}


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _sm120(ev: Evidence, cells: Sequence[dict[str, Any]]) -> Decision:
    sparse = open_doors(cells, "SM120", dense=False)
    dense = open_doors(cells, "SM120", dense=True)
    p = headline_point(ev.step)
    pred = {r["path"]: r for r in original_gpu_rows(ev.fit.model, p)}
    cast = pred["full_pool_cast_fa2"]
    patches = sorted(((name, pred[path]) for name, path in (("ours", "ours"), ("gather_cast", "gather_cast_fa2"))
                      if path in pred), key=lambda r: r[1]["step_lo"])
    patch_names = {"ours": "our `fused` patch (ours, Triton path)", "gather_cast": "`gather_cast`"}
    dense_do = " or ".join(patch_names[n] for n, _ in patches)
    if sparse:
        do = ("GLM-5: **drop `--attention-backend flashinfer_mla`**: the default `dsa` backend "
              f"(`flashinfer_sparse_mla`) reads FP8. Dense: {dense_do}.")
    else:
        do = f"{_cap(dense_do)}: no FlashInfer path takes the FP8 cache here."
    steps = "; ".join(f"{r['step_lo']:.0f}–{r['step_hi']:.0f} ms {n}" for n, r in patches)
    first = patches[0]
    figure = (f"dense, predicted: {first[1]['step_lo']:.0f}–{first[1]['step_hi']:.0f} ms ({first[0]}) vs "
              f"{ORIGINAL.step_ms:g} ms")
    door_says = "Chapter 3's matrix, SM120: " + (
        f"the sparse (DSA) MLA kernel **{sparse[0]['status']}** ({sparse[0]['conditions']}); " if sparse else
        "the sparse kernel refused; ")
    door_says += ("no dense FlashInfer path takes the FP8 cache" if not dense else
                  "dense: " + ", ".join(DOOR_BY_KEY[c["door"]].label for c in dense))
    because = (f"{door_says}. SGLang 0.5.23 picks the `dsa` backend for GLM-5 (a DSA model) unless "
               "`--attention-backend` overrides it (read from its wheel, ch. 3). The dense paths, predicted by the "
               f"cost model at the original's geometry: {cast['step_lo']:.0f}–{cast['step_hi']:.0f} ms with the "
               f"whole-pool cast (the original measured {ORIGINAL.step_ms:g} ms) → {steps}.")
    accuracy = _accuracy(ev, ["triton", "ours"], "dense, ours' Triton path: ")
    if sparse:
        accuracy = "DSA: not measured here; " + accuracy
    return Decision("sm120", "SM120 (RTX PRO 6000)", "", "", do, figure, because,
                    ("doors_checks", "doors_sm90", "path_sweep", "decode_step_paths", *_acc_source(ev)),
                    f"{CH3}, {CH6}", accuracy)


def _sm90_no_patch(ev: Evidence) -> Decision:
    s = {r["path"]: r for r in step_rows(ev.step)}
    cast, fm = s["full_pool_cast"], s.get("flashmla_fp8")
    err_fp8, err_ours, err_from = flashmla_fp8_error(ev)
    us = _bench_us(ev.bench)
    pts16 = sorted({(h, c, b) for (_, h, c, b) in us if h == 16})
    wins = [pt for pt in pts16 if ("flashmla_dense_fp8", *pt) in us
            and us[("flashmla_dense_fp8", *pt)] == min(v for (_, *q), v in us.items() if tuple(q) == pt)]
    sources = ("decode_step_paths",) + (("fused_decode_bench",) if us else ()) + ((err_from,) if err_from else ())
    key, gpu, sw, batch = "sm90-no-patch", "SM90 (H100, H200)", "no patch", ""
    if fm is None or fm["step_ms"] >= cast["step_ms"]:
        return Decision(key, gpu, sw, batch, "No faster path without a patch was measured.",
                        f"step {cast['step_ms']:.1f} ms with the cast", f"Step with the whole-pool cast "
                        f"{cast['step_ms']:.1f} ms (H200); FlashMLA FP8 not recorded in the step.", sources,
                        f"{CH5}, {CH6}")
    do = ("`--attention-backend flashmla --page-size 64`: FlashMLA FP8, the fastest no-patch path on an FP8 cache "
          "(FP8 query).")
    acc = accuracy_report.path_summary(ev.accuracy, "flashmla_dense_fp8") if ev.accuracy is not None else None
    if acc and acc["failing_profiles"]:
        do = ("`--attention-backend flashmla --page-size 64` (FlashMLA FP8, the fastest no-patch path) only if the "
              f"model was evaluated with its FP8 query: BF16-accurate on {acc['keeps']} of {acc['cases']} attention "
              f"cases ({CH5B}). Otherwise a BF16 cache, or a patch.")
    figure = f"{cast['step_ms']:.1f} → {fm['step_ms']:.1f} ms a step"
    because = f"Step {cast['step_ms']:.1f} → {fm['step_ms']:.1f} ms on the H200"
    if pts16:
        because += (f"; the fastest of every path at {len(wins)} of {len(pts16)} 16-head points of chapter 5's grid")
    if err_fp8 and err_ours:
        figure += f", {err_fp8 / err_ours:.0f}× ours' error"
        where = "chapter 5's grid" if err_from == "fused_decode_bench" else "chapter 5's validation"
        on_step = (f"; on this step {fm['rel_err_vs_float64']:.1e} against {s['ours']['rel_err_vs_float64']:.1e}"
                   if fm.get("rel_err_vs_float64") and s.get("ours", {}).get("rel_err_vs_float64") else "")
        because += (f". Its attention output's worst error against float64 over {where} is {err_fp8:.1e} against "
                    f"ours' {err_ours:.1e} ({err_fp8 / err_ours:.0f}×){on_step}. That is measured here on the "
                    "attention alone; what it does to a model's long-context answers is not measured in this book")
    bf16 = [f"{s[p]['step_ms']:.1f} ms ({n})" for p, n in (("bf16_cache", "FlashInfer"), ("flashmla_bf16", "FlashMLA"))
            if p in s]
    if bf16:
        because += (". Without a patch, the other way past the cast is a BF16 cache (half the tokens in the same "
                    f"memory): {' / '.join(bf16)} a step")
    because += (". GLM-5 without an explicit backend runs SGLang's `dsa` default (FlashMLA's sparse FP8 kernel), not "
                "measured here.")
    verdict = accuracy_report.fp8_verdict(ev.accuracy)
    if verdict:
        because += f" On sharp and long attention ({CH5B}): {verdict}"
    return Decision(key, gpu, sw, batch, do, figure, because, sources + _acc_source(ev), f"{CH5}, {CH5B}, {CH6}",
                    _accuracy(ev, ["flashmla_dense_fp8"]))


#: The ``fp8_accuracy`` strategy whose arithmetic a step path runs.
ACCURACY_OF = {"ours": "ours", "gather_cast": "gather_cast_bf16"}


def _acc_source(ev: Evidence) -> tuple[str, ...]:
    return ("fp8_accuracy",) if ev.accuracy is not None else ()


def _accuracy(ev: Evidence, strategies: Sequence[str], prefix: str = "") -> str:
    return prefix + accuracy_report.accuracy_cell(ev.accuracy, strategies)  # the first of strategies recorded


#: What SGLang 0.5.23's flashinfer_mla backend does with an FP8 cache, whatever the FlashInfer (read from its wheel).
PATCH_SOFTWARE = "patched"
PATCH_NOTE = ("Its `flashinfer_mla` casts the whole pool with any FlashInfer, 0.6.14+ (FP8 MLA on SM90) included: "
              "PR #35322, which would call that, is open.")
PATCH_NOTE_SHORT = "its `flashinfer_mla` casts the whole pool with any FlashInfer (PR #35322 open)."
#: The patches by the step path they run (the `fused` patch calls ours with its per-step plan).
PATCH_NAMES = {"ours": "our `fused` patch (ours)", "gather_cast": "the `gather_cast` patch"}


def _sm90_patch_one(ev: Evidence) -> Decision:
    s = {r["path"]: r for r in step_rows(ev.step)}
    cands = sorted((s[p] for p in ("ours", "gather_cast") if p in s), key=lambda r: r["step_ms"])
    best, rest = cands[0], cands[1:]
    do = _cap(PATCH_NAMES[best["path"]]) + (f"; {PATCH_NAMES[rest[0]['path']]}: "
                                            f"+{rest[0]['step_ms'] - best['step_ms']:.1f} ms." if rest else ".")
    figure = f"{s['full_pool_cast']['step_ms']:.1f} → " + " / ".join(
        f"{r['step_ms']:.1f}" for r in cands) + " ms a step"
    because = (f"Step {s['full_pool_cast']['step_ms']:.1f} ms with the cast → " + ", ".join(
        f"{r['step_ms']:.1f} ms ({r['path']})" for r in cands) + " on the H200, one request of "
        f"{ev.step.params['context_lens'][0]:,} tokens.")
    if "flashinfer_fp8" in s:
        because += (" FlashInfer's FP8 MLA, which SGLang PR #35322 would call: "
                    f"{s['flashinfer_fp8']['step_ms']:.1f} ms "
                    "on this step.")
    return Decision("sm90-patch-one", "SM90", PATCH_SOFTWARE, "1 request", do, figure,
                    because, ("decode_step_paths", *_acc_source(ev)), f"{CH4}, {CH5}, {CH6}",
                    _accuracy(ev, [ACCURACY_OF[best["path"]]]))


def _sm90_patch_batch(ev: Evidence) -> Decision:
    cmp = batch_comparison(ev.sweep, "ours", "gather_cast", min_batch=BIG_BATCH)
    fm = batch_comparison(ev.sweep, "ours", "flashmla_bf16", min_batch=BIG_BATCH)
    bs = cmp["batches"]
    key, gpu, batch = "sm90-patch-batch", "SM90", f"batch ≥ {BIG_BATCH}"
    if not bs:
        return Decision(key, gpu, PATCH_SOFTWARE, batch, "Not measured.", "—", "The sweep has no batch this large.",
                        ("path_sweep",), CH6)
    if not cmp["slower_at"]:
        do = f"{_cap(PATCH_NAMES['ours'])}, {cmp['ratio_lo']:.1f}–{cmp['ratio_hi']:.1f}× faster than `gather_cast`"
    elif len(cmp["slower_at"]) == len(bs):
        do = f"{_cap(PATCH_NAMES['gather_cast'])}: faster than ours at every batch measured"
    else:
        do = (f"{_cap(PATCH_NAMES['ours'])} up to batch {max(n for n in bs if n not in cmp['slower_at'])}, "
              f"{PATCH_NAMES['gather_cast']} at batch {_fmt_batches(cmp['slower_at'])}")
    bf16_faster = bool(fm["batches"]) and len(fm["slower_at"]) == len(fm["batches"])
    do += "; FlashMLA BF16 faster at 2× the memory." if bf16_faster else "."
    figure = f"{_span(list(cmp['a_us'].values()))} vs {_span(list(cmp['b_us'].values()))} µs a layer"
    because = (f"µs per layer at batch {_fmt_batches(bs)} (mixed lengths, H200 sweep): ours "
               f"{_span(list(cmp['a_us'].values()))}, gather_cast {_span(list(cmp['b_us'].values()))}")
    if fm["batches"]:
        because += f", FlashMLA BF16 {_span(list(fm['b_us'].values()))}"
    because += ". More heads per GPU: the table below."
    best = "gather_cast" if len(cmp["slower_at"]) == len(bs) else "ours"
    return Decision(key, gpu, PATCH_SOFTWARE, batch, do, figure, because, ("path_sweep", *_acc_source(ev)),
                    f"{CH5}, {CH6}", _accuracy(ev, [ACCURACY_OF[best]]))


def _sm100(ev: Evidence, cells: Sequence[dict[str, Any]]) -> Decision:
    dense = open_doors(cells, "SM100", dense=True)
    refused = _refused(cells, "SM100")
    gpu = GPUS["b200"]
    p = headline_point(ev.step)
    layers = p.geometry.num_layers
    kv = {path: [layers * v / 1e3 for v in ev.fit.model.layer_range_us(path, p, gpu)]
          for path in ("ours", "gather_cast_fa2", "full_pool_cast_fa2")}
    if dense:
        do = (" or ".join(f"`--attention-backend {SGLANG_BACKEND.get(c['door'], c['door'])}`" for c in dense)
              + f" ({dense[0]['status']} by FlashInfer's checks, not run here), or our patch.")
        where = "; ".join(f"{DOOR_BY_KEY[c['door']].label} {c['status']} ({c['conditions']})" for c in dense)
    else:
        do = "A patch (ours, Triton path, or gather_cast): no FlashInfer path takes the FP8 cache here."
        where = "no dense path open"
    figure = (f"KV work, predicted: {kv['ours'][0]:.1f}–{kv['ours'][1]:.1f} vs "
              f"{kv['full_pool_cast_fa2'][0]:.0f}–{kv['full_pool_cast_fa2'][1]:.0f} ms a step")
    because = (f"Chapter 3's matrix, SM100: {where}; refused: {', '.join(refused)}. Predicted by the cost model "
               f"(B200 datasheet, GLM-5 step geometry), KV work a step: "
               f"{kv['full_pool_cast_fa2'][0]:.1f}–{kv['full_pool_cast_fa2'][1]:.1f} ms with the whole-pool cast, "
               f"{kv['ours'][0]:.1f}–{kv['ours'][1]:.1f} ms ours (Triton path), "
               f"{kv['gather_cast_fa2'][0]:.1f}–{kv['gather_cast_fa2'][1]:.1f} ms gather_cast.")
    return Decision("sm100", "SM100 (B200)", "", "", do, figure, because,
                    ("doors_checks", "doors_sm90", "path_sweep", "decode_step_paths", *_acc_source(ev)),
                    f"{CH3}, {CH6}", ("FlashInfer's path: not measured here; " if dense else "")
                    + _accuracy(ev, ["triton", "ours"], "ours' Triton path: "))


def decide(ev: Evidence) -> list[Decision]:
    """The answer's rows, the original's GPU first: SM120, then SM90 without and with a patch (one request,
    batches), then SM100."""
    cells = door_cells(ev.doors_checks, ev.doors_sm90)
    return [_sm120(ev, cells), _sm90_no_patch(ev), _sm90_patch_one(ev), _sm90_patch_batch(ev), _sm100(ev, cells)]


def _recorded_where(prov: Any) -> str:
    """A recording in a few words: the GPU (or a CPU), the date, the commit."""
    where = (prov.gpu or "").removeprefix("NVIDIA ") or ("a CPU" if prov.device == "cpu" else prov.device)
    return f"{where}, {prov.date[:10]}, commit {prov.git_commit[:10]}"


def decision_caption(ev: Evidence, rows: Sequence[Decision], *, compact: bool = False) -> str:
    """Where the rows' numbers come from: each result the rows quote, grouped by recording (``compact``: GPU, date
    and commit; else with the versions), what SGLang does that the rows assume, and what is predicted rather than
    measured."""
    used = {s for r in rows for s in r.sources}
    groups: dict[str, list[str]] = {}
    for res in ev.results():
        if res.experiment in used:
            key = _recorded_where(res.provenance) if compact else res.provenance.short()
            groups.setdefault(key, []).append(res.experiment)
    stale = sorted(res.experiment for res in ev.results() if res.experiment in used and res.stale)
    if compact:
        text = (f"SGLang 0.5.23, GLM-5, 16 heads/GPU; {PATCH_NOTE_SHORT} SM120, SM100: predicted by the cost model. "
                "Recorded on ")
    else:
        text = (f"SGLang 0.5.23, GLM-5 at 16 heads per GPU. {PATCH_NOTE} SM120 and SM100: the cost model's "
                "predictions from the H200 sweep, not measurements. Recorded on ")
    text += "; ".join(f"{k} ({', '.join(v)})" for k, v in groups.items()) + "."
    if stale:
        text += f" STALE: {', '.join(stale)} (the code changed since the recording; re-record with `make record`)."
    return text


def decision_table(rows: Sequence[Decision], caption: str, *, compact: bool = False) -> Table:
    """The rows as a table: the front page's (``compact``: the short figure) or chapter 6's (the full reason and
    the chapters that show it). Both have the same setups and the same "do this"."""
    columns: dict[str, Any] = {"your setup": "setup", "do this": "do"}
    if compact:
        columns.update({"why": "figure", "accuracy": "accuracy"})
    else:
        columns.update({"because": "because", "accuracy": "accuracy", "shown in": "chapters"})
    return Table([r.as_dict() for r in rows], columns, caption)

"""The book's answer, computed: what to run, per model kind (DSA or dense MLA), GPU family and speculative decoding.

:func:`decide` turns the recorded results into :class:`Decision` rows; the front page (``book/index.md``), chapter 6's
"What to do" and the README show the same rows (:func:`decision_table`). Each row says the SGLang 0.5.23 command
(every flag and value checked against its source: :mod:`kvwall.peers.sglang_flags`), the decode step it gives and how
that figure was obtained (measured, composed from measured parts, predicted, or not measured), its accuracy class and
where the numbers come from:

- **DSA models** (GLM-5, DeepSeek-V3.2): SGLang's own ``dsa`` backend, measured on the H200 (``dsa_decode``) and
  composed into the decode step (:func:`kvwall.reports.dsa_report.dsa_step`); what a forced dense backend does to the
  DSA pool (``dsa_forced_dense``, SGLang's own pools on a CPU); SGLang's defaults per GPU read from its source
  (:data:`kvwall.peers.sglang_dsa.DSA_DEFAULTS`);
- **dense MLA models** (DeepSeek-V3/R1, Kimi-K2): the decode step at batch 1 and 64 (``decode_step_batches``) and the
  sweep (``path_sweep``) say which path is faster; chapter 5's benchmark and validation give FlashMLA FP8's error;
  chapter 5b (``fp8_accuracy``) and :mod:`kvwall.reports.accuracy_regimes` its multiplier per input regime;
- **SM100 / SM120**: chapter 3's door matrix (``doors_checks`` + ``doors_sm90``) says which FlashInfer path takes the
  FP8 cache there; the cost model fitted on the sweep predicts our paths there (a prediction, labelled).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Sequence

from kvwall.model.cost import GPUS
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.reports import accuracy_report, dsa_report
from kvwall.reports.accuracy_regimes import RANDOM_INPUTS, fp8_query_multipliers
from kvwall.reports.answer_report import headline_point
from kvwall.reports.multi_token_report import verify_rows
from kvwall.reports.evidence import (SOURCES, SPARSE_DOOR, Evidence, batch_comparison, door_cells, open_doors,
                                     refused_doors, span, step_at, steps_text)
from kvwall.reports.original_gpu_report import original_gpu_rows, rest_without_attention_ms
from kvwall.reports.tables import Table
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY
from kvwall.peers.sglang_dsa import DSA_DEFAULTS

__all__ = ["Evidence", "Decision", "SPARSE_DOOR", "decide", "decision_table", "decision_caption", "door_cells", "open_doors",
           "batch_comparison", "step_at", "commands", "readme_answer", "write_readme_answer",
           "README_START", "README_END", "SOURCES", "MODELS",
           "PATCH_NOTE", "PATCH_NOTE_SHORT"]

#: The batch regime the "batches" rows speak for: mixed batches of at least this many requests.
BIG_BATCH = 16
#: SGLang 0.5.23's ``--attention-backend`` value for a FlashInfer door (``attention_registry.py``: ``flashinfer``
#: builds the FlashInfer MLA backend for an MLA model; ``flashinfer_mla`` is not a value it accepts).
SGLANG_BACKEND = {"fa2": "flashinfer", "fa3": "flashinfer", "trtllm-gen": "trtllm_mla"}
#: The two kinds of MLA model the answer forks on.
MODELS = {"dsa": "DSA (GLM-5, DeepSeek-V3.2)", "dense": "dense MLA (DeepSeek-V3/R1, Kimi-K2)"}
FP8_CACHE = "--kv-cache-dtype fp8_e4m3"


def _link(doc: str, text: str) -> str:
    """A link to a chapter: MyST resolves it to the page in the built site; JupyterLab opens the file."""
    return f"[{text}]({doc}.md)"


CH3, CH4, CH5, CH6 = (_link("03_the_other_doors", "ch. 3"), _link("04_gather_then_cast", "ch. 4"),
                      _link("05_fused_fp8_decode", "ch. 5"), _link("06_the_answer", "ch. 6"))
CH5B = _link("05b_fp8_accuracy", "ch. 5b")


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


# ---------------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------------

#: How a row's step figure was obtained.
MEASURED, COMPOSED, PREDICTED, NOT_MEASURED = ("measured (H200)", "composed from measured parts (H200)",
                                               "predicted (cost model)", "not measured")


@dataclass(frozen=True)
class Decision:
    """One row of the answer: the setup (model kind, GPU family, speculative decoding, batch), the SGLang 0.5.23
    flags to run (``command``; '' where nothing needs setting), what to do in a few words (``do``), the decode step it
    gives (``step``) and how that was obtained (``evidence``), its accuracy class, the full reason (``because``, chapter
    6), the recorded results the numbers come from and the chapters that show them."""

    key: str
    model: str
    gpu: str
    spec: str
    command: str
    do: str
    step: str
    evidence: str
    because: str
    sources: tuple[str, ...]
    chapters: str
    accuracy: str = "not measured"
    batch: str = ""

    @property
    def setup(self) -> str:
        return ", ".join([f"**{self.model}**", self.gpu, *(x for x in (self.spec, self.batch) if x)])

    def as_dict(self) -> dict[str, Any]:
        step = self.step if self.evidence == NOT_MEASURED else f"{self.step}; {self.evidence}"
        return {**asdict(self), "setup": self.setup, "run": f"`{self.command}`" if self.command else "nothing to set",
                "step_cell": step}


def _acc_source(ev: Evidence) -> tuple[str, ...]:
    return ("fp8_accuracy",) if ev.accuracy is not None else ()


def _default(sm: str, model: str = "GLM-5") -> Any:
    """SGLang 0.5.23's DSA default for an FP8 cache on ``sm`` (read from its source)."""
    return next(d for d in DSA_DEFAULTS if d.sm == sm and d.kv_cache_dtype == "fp8_e4m3" and model in d.model)


def _forced(ev: Evidence) -> str:
    """What forcing a dense backend does to a DSA model's FP8 pool, in a few words (from ``dsa_forced_dense``)."""
    if ev.dsa_forced is None:
        return "a forced dense backend reads the DSA pool's scaled rows as plain ones (read from source, not run)"
    f = dsa_report.forced_dense(ev.dsa_forced)
    return (f"forcing `--attention-backend flashinfer` makes SGLang read the {f['dsa_row_bytes']}-byte DSA rows as "
            f"plain ones: NaN in what it attends over, no error (SGLang's own pools, {CH6}); `flashmla` or `triton` "
            "stop with an AssertionError")


def _dsa_sm90(ev: Evidence) -> Decision:
    d = _default("SM90")
    key, gpu = "dsa-sm90", "SM90 (H100, H200)"
    sources = tuple(s for s, r in (("dsa_decode", ev.dsa), ("decode_step_paths", ev.step),
                                   ("dsa_forced_dense", ev.dsa_forced)) if r is not None)
    do = (f"Leave `--attention-backend` unset: SGLang picks `dsa` (decode `{d.decode}`: FlashMLA's sparse FP8 "
          "kernel, BF16 query). On SM90 ask for the FP8 cache. Never force a dense backend.")
    if ev.dsa is None:
        return Decision(key, MODELS["dsa"], gpu, "no speculative decoding", FP8_CACHE, do, "not measured",
                        NOT_MEASURED, _cap(_forced(ev)) + ".", sources, CH6)
    composed = dsa_report.dsa_step(ev.step, ev.dsa)
    acc = dsa_report.accuracy(ev.dsa)
    pts = dsa_report.points(ev.dsa)
    big = max((p for p in pts if p["heads"] == 16 and p.get("dsa")), key=lambda p: (p["batch"], p["context"]))
    if composed is not None:
        step, how = f"{composed.step_ms:.1f} ms", COMPOSED
        because = (f"{composed.step_ms:.1f} ms a step at one request of {composed.context:,} tokens: the step's own "
                   f"write and rest-of-layer phases plus {composed.attention_ms:.2f} ms of DSA attention over "
                   f"{GLM5.num_layers} layers (FlashMLA's sparse decode + the indexer's scores, measured), against "
                   f"{step_at(ev, 'ours')[1]:.1f} ms for ours and {step_at(ev, 'flashmla_fp8').get(1, float('nan')):.1f}"
                   f" ms for FlashMLA dense FP8 over every token. Not in it: the top-k (SGLang's kernel not run; "
                   f"torch.topk would add {composed.topk_ms:.1f} ms). ")
    else:
        step, how, because = "not composed", NOT_MEASURED, "dsa_decode has no point at the step's request. "
    because += (f"Per layer at batch {big['batch']} and {big['context'] // 1024}K tokens a request: {big['dsa']:.0f} "
                f"µs against ours' {big['ours_page64']:.0f} µs and FlashMLA dense FP8's "
                f"{big['flashmla_dense_fp8']:.0f} µs ({CH6}). Do not force a dense backend: {_forced(ev)}; and dense "
                "attention over every token is not the model GLM-5 was trained to be (it attends to 2,048).")
    accuracy = (f"BF16 query: {acc.sparse[1]:.1e} vs float64 ({acc.sparse[1] / acc.ours[1]:.1f}× ours', "
                f"{RANDOM_INPUTS}); the model's own sparse attention")
    return Decision(key, MODELS["dsa"], gpu, "no speculative decoding", FP8_CACHE, do, step, how, because, sources,
                    CH6, accuracy)


def _dsa_sm90_spec(ev: Evidence) -> Decision:
    d = _default("SM90")
    return Decision(
        "dsa-sm90-spec", MODELS["dsa"], "SM90 (H100, H200)", "MTP (EAGLE)",
        f"{FP8_CACHE} --speculative-algorithm EAGLE",
        f"Leave `--attention-backend` unset: target-verify runs in `dsa` too (`{d.decode}`). GLM-5's MTP is "
        "SGLang's `EAGLE` (`MTP` is rejected).",
        "not measured", NOT_MEASURED,
        "Read from SGLang 0.5.23's source (`dsa_backend.py`'s target-verify branches; `speculative_hook.py`), not run "
        "here. Forcing a dense backend for speculative decoding is wrong for the same reason as without it: "
        + _forced(ev) + ".", tuple(s for s, r in (("dsa_forced_dense", ev.dsa_forced),) if r is not None), CH6,
        "as without speculative decoding (the same kernel; not measured with draft tokens)")


def _dsa_other(ev: Evidence, cells: Sequence[dict[str, Any]], sm: str) -> Decision:
    glm, ds = _default(sm, "GLM-5"), _default(sm, "DeepSeek-V3.2")
    gpu = {"SM100": "SM100 (B200)", "SM120": "SM120 (RTX PRO 6000)"}[sm]
    decode = (f"`{glm.decode}`" if glm.decode == ds.decode else
              f"`{glm.decode}` for GLM-5, `{ds.decode}` for DeepSeek-V3.2")
    rows = f"{glm.pool_row_bytes}-byte" if glm.pool_row_bytes == ds.pool_row_bytes else \
        f"{glm.pool_row_bytes}-byte (GLM-5) / {ds.pool_row_bytes}-byte (DeepSeek-V3.2)"
    do = f"Leave `--attention-backend` unset: SGLang picks `dsa` (decode {decode}); the cache is FP8 by default here."
    command = ""
    sources: tuple[str, ...] = ("dsa_forced_dense",) if ev.dsa_forced is not None else ()
    step, how = "not measured", NOT_MEASURED
    because = f"SGLang 0.5.23's defaults, read from its source: decode {decode}, {rows} FP8 rows. "
    if sm == "SM120":
        sparse = open_doors(cells, "SM120", dense=False)
        built = _sparse_build(ev)
        because += (("Chapter 3: FlashInfer's SM120 sparse (DSA) MLA kernel is "
                     f"{sparse[0]['status']} ({sparse[0]['conditions']})" if sparse else
                     "Chapter 3: FlashInfer's SM120 sparse kernel refused") + (
                    f"; its module compiled offline for sm_120a with nvcc {built['nvcc']} in {built['seconds']} s. "
                    if built else ". "))
        pred = _dsa_sm120_prediction(ev)
        if pred is not None:
            step, how = f"{pred[0]:.0f}–{pred[1]:.0f} ms (GLM-5)", PREDICTED
            because += (f"Predicted step {pred[0]:.0f}–{pred[1]:.0f} ms: the original's step without its cast and "
                        "attention, plus every layer's DSA attention measured on the H200 and carried over by the two "
                        "transfer rules (assuming FlashInfer's SM120 kernel as efficient as FlashMLA's on Hopper). ")
            sources += ("dsa_decode", "path_sweep", "doors_checks")
        because += ("The original's configuration -- `--attention-backend flashinfer` with an FP8 cache on GLM-5 -- "
                    "gets the same DSA pool here (read from source): " + _forced(ev) + ".")
    else:
        because += "No SM100 GPU here: not measured, not predicted (the `trtllm` kernels are not modelled)."
    accuracy = ("GLM-5: BF16 query (FlashInfer's SM120 sparse kernel takes one, by its checks); not measured"
                if sm == "SM120" else "not measured")
    return Decision(f"dsa-{sm.lower()}", MODELS["dsa"], gpu, "with or without MTP", command, do, step, how,
                    because, sources, f"{CH3}, {CH6}", accuracy)


def _sparse_build(ev: Evidence) -> dict[str, Any] | None:
    if ev.doors_checks is None:
        return None
    return next((r for r in ev.doors_checks.rows if r.get("section") == "builds"
                 and r.get("build") == "sparse_mla_sm120" and r.get("status") == "compiled"), None)


def _dsa_sm120_prediction(ev: Evidence) -> tuple[float, float] | None:
    """The DSA step on the original's GPU: its rest without cast and attention (predicted) plus every layer's DSA
    attention measured on the H200 at the headline point, scaled by the two transfer rules."""
    if ev.dsa is None:
        return None
    composed = dsa_report.dsa_step(ev.step, ev.dsa)
    if composed is None:
        return None
    p = headline_point(ev.step)
    h200, rtx = GPUS["h200"], GPUS["rtx-pro-6000"]
    rest_lo, rest_hi = rest_without_attention_ms(ev.fit.model, p, rtx)
    per_layer = composed.attention_ms / p.geometry.num_layers
    scaled = (per_layer * h200.sms / rtx.sms, per_layer * h200.hbm_gbps / rtx.hbm_gbps)
    return rest_lo + p.geometry.num_layers * min(scaled), rest_hi + p.geometry.num_layers * max(scaled)


def _fp8_accuracy_cell(ev: Evidence) -> str:
    """FlashMLA dense FP8's error multiplier over ours', per regime, lowest and highest (accuracy_regimes)."""
    rows = [m for m in fp8_query_multipliers(ev.accuracy, ev.bench, computed=False)
            if m.strategy == "flashmla_dense_fp8"]
    if not rows:
        return "FP8 query: not measured"
    lo, hi = min(rows, key=lambda m: m.over_ours[0]), max(rows, key=lambda m: m.over_ours[1])
    return (f"FP8 query: {lo.over_ours[0]:.1f}× ours' error ('{lo.regime}') to {hi.over_ours[1]:.0f}× "
            f"('{hi.regime}'), {CH5B}")


def _dense_sm90_no_patch(ev: Evidence) -> Decision:
    fm = step_at(ev, "flashmla_fp8")
    key, gpu = "dense-sm90-no-patch", "SM90 (H100, H200)"
    sources = ("decode_step_paths",) + (("decode_step_batches",) if ev.step_batches else ()) + _acc_source(ev) + (
        ("fused_decode_bench",) if ev.bench else ())
    if not fm:
        return Decision(key, MODELS["dense"], gpu, "no speculative decoding, no patch",
                        f"--attention-backend flashmla --page-size 64 {FP8_CACHE}", "FlashMLA FP8 (not measured).",
                        "not measured", NOT_MEASURED, "FlashMLA FP8 not recorded in the step.", sources, CH6)
    acc = accuracy_report.path_summary(ev.accuracy, "flashmla_dense_fp8") if ev.accuracy is not None else None
    do = "FlashMLA FP8: the fastest without a patch, with an FP8 query"
    do += ("; only if the model was evaluated so. Else a BF16 cache (no `--kv-cache-dtype`, twice the memory) or "
           "our patch." if acc and acc["failing_profiles"] else ".")
    because = (f"Step with the whole-pool cast {steps_text(ev, 'full_pool_cast')}; with FlashMLA FP8 {steps_text(ev, 'flashmla_fp8')}; "
               f"with a BF16 cache and FlashMLA BF16 {steps_text(ev, 'flashmla_bf16')} (half the tokens in the same "
               "memory). Its error is measured on attention alone; what it does to a model's answers is not measured "
               "in this book. SGLang issue #35291 ships this command as its workaround.")
    return Decision(key, MODELS["dense"], gpu, "no speculative decoding, no patch",
                    f"--attention-backend flashmla --page-size 64 {FP8_CACHE}", do, steps_text(ev, "flashmla_fp8"),
                    MEASURED, because, sources, f"{CH5}, {CH5B}, {CH6}", _fp8_accuracy_cell(ev))


#: The patches by the step path they run (the `fused` patch calls ours with its per-step plan).
PATCH_NAMES = {"ours": "our `fused` patch (ours)", "gather_cast": "the `gather_cast` patch"}
#: What SGLang 0.5.23's FlashInfer MLA backend does with an FP8 cache, whatever the FlashInfer (read from its wheel).
PATCH_NOTE = ("Its FlashInfer MLA backend (`--attention-backend flashinfer`) casts the whole pool with any FlashInfer, "
              "0.6.14+ (FP8 MLA on SM90) included: PR #35322, which would call that, is open.")
PATCH_NOTE_SHORT = "its FlashInfer MLA backend casts the whole pool with any FlashInfer (PR #35322 open)."


def _dense_sm90_patch(ev: Evidence) -> Decision:
    ours, gc = step_at(ev, "ours"), step_at(ev, "gather_cast")
    cmp = batch_comparison(ev.sweep, "ours", "gather_cast", min_batch=BIG_BATCH)
    both = sorted(set(ours) & set(gc))
    slower = [b for b in both if ours[b] > gc[b]]
    if not slower:
        do = f"Apply `fused.diff`: {PATCH_NAMES['ours']} on the FP8 cache (`gather_cast` slower at every batch)."
        best = "ours"
    elif len(slower) == len(both):
        do, best = f"{_cap(PATCH_NAMES['gather_cast'])}: faster than ours at every batch measured.", "gather_cast"
    else:
        do, best = (f"{_cap(PATCH_NAMES['ours'])}; {PATCH_NAMES['gather_cast']} at batch "
                    f"{', '.join(map(str, slower))}.", "ours")
    because = (f"Step on the H200: ours {steps_text(ev, 'ours')}, gather_cast {steps_text(ev, 'gather_cast')}, the whole-pool "
               f"cast {steps_text(ev, 'full_pool_cast')}, FlashMLA BF16 on a BF16 cache {steps_text(ev, 'flashmla_bf16')}. ")
    if cmp["batches"]:
        because += (f"One layer at batch {cmp['batches'][0]}–{cmp['batches'][-1]} (mixed lengths, the sweep): ours "
                    f"{span(list(cmp['a_us'].values()))} µs, gather_cast {span(list(cmp['b_us'].values()))} µs. ")
    because += (f"Apply `fused.diff` to SGLang 0.5.23 ({CH6}). What its check in SGLang's own modules ran, and how "
                "fresh that check is, is under \"A patch for SGLang\". Not for a DSA model: its pool's rows are not "
                "the rows this backend reads.")
    acc = accuracy_report.accuracy_cell(ev.accuracy, ["ours" if best == "ours" else "gather_cast_bf16"])
    sources = ("decode_step_paths",) + (("decode_step_batches",) if ev.step_batches else ()) + ("path_sweep",) + \
        _acc_source(ev)
    return Decision("dense-sm90-patch", MODELS["dense"], "SM90 (H100, H200)", "no speculative decoding, patched",
                    f"--attention-backend flashinfer {FP8_CACHE}", do, steps_text(ev, best), MEASURED, because, sources,
                    f"{CH4}, {CH5}, {CH6}", "BF16 query: " + acc)


def _verify_reading(ev: Evidence) -> tuple[str, str, tuple[str, ...]]:
    """(what the step column says, the reason's measured sentence, the sources) for speculative decoding's verify:
    ours' µs at q_len 2 and 4 against its q_len-1 µs and FlashMLA's, at the answer's head count, from
    ``multi_token_decode`` where it was recorded."""
    if ev.multi_token is None:
        return "not measured", "The verify kernel was not timed here.", ()
    heads = headline_point(ev.step).geometry.heads_per_gpu
    rows = [r for r in verify_rows(ev.multi_token) if r["heads"] == heads and r.get("ours")]
    if not rows:
        return "not measured", f"The verify kernel was not timed at {heads} heads.", ()
    parts = []
    for q in (2, 4):
        at = [r for r in rows if r["q_len"] == q and r.get("ours_vs_q1")]
        if at:
            peer = [r["flashmla_dense_bf16"] / r["ours"] for r in at if r.get("flashmla_dense_bf16")]
            parts.append(f"q_len {q}: {span([r['ours_vs_q1'] for r in at], 2)}× its decode" + (
                f", FlashMLA BF16 {span(peer, 2)}× ours' time" if peer else ""))
    kernel = "; ".join(parts)
    return (f"verify kernel {kernel}; whole step not measured",
            f"Measured ({heads} heads, multi_token_decode): {kernel}.", ("multi_token_decode",))


def _dense_sm90_spec(ev: Evidence) -> Decision:
    step, measured, sources = _verify_reading(ev)
    return Decision(
        "dense-sm90-spec", MODELS["dense"], "SM90 (H100, H200)", "MTP / EAGLE, patched",
        f"--attention-backend flashinfer {FP8_CACHE} --speculative-algorithm EAGLE",
        "Our `fused` patch: decode, target-verify and draft-extend run ours on the FP8 pool (2–8 query tokens a "
        "request, causal over the draft); no BF16 copy of the pool is reserved.",
        step, MEASURED if sources else NOT_MEASURED,
        "With speculative decoding, target-verify is the decode step (2–8 query tokens a request). Ours folds a "
        "request's query tokens into its rows, so they read the KV once. " + measured + " The patched server was "
        "checked in SGLang's own modules (chapter 6's patch check), not timed end to end.",
        ("decode_step_paths",) + sources, f"{CH5}, {CH6}", "BF16 query (ours, every q_len)")


def _dense_sm100(ev: Evidence, cells: Sequence[dict[str, Any]]) -> Decision:
    dense = open_doors(cells, "SM100", dense=True)
    refused = refused_doors(cells, "SM100")
    gpu = GPUS["b200"]
    p = headline_point(ev.step)
    layers = p.geometry.num_layers
    kv = {path: [layers * v / 1e3 for v in ev.fit.model.layer_range_us(path, p, gpu)]
          for path in ("ours", "gather_cast_fa2", "full_pool_cast_fa2")}
    backends = sorted({SGLANG_BACKEND.get(c["door"], c["door"]) for c in dense})
    if dense:
        command = f"--attention-backend {backends[0]} {FP8_CACHE}"
        do = (" or ".join(f"`--attention-backend {b}`" for b in backends)
              + f" ({dense[0]['status']} by FlashInfer's checks, not run here), or our patch (ours' Triton path).")
        where = "; ".join(f"{DOOR_BY_KEY[c['door']].label} {c['status']} ({c['conditions']})" for c in dense)
    else:
        command = f"--attention-backend flashinfer {FP8_CACHE}"
        do = "A patch (ours' Triton path, or gather_cast): no FlashInfer path takes the FP8 cache here."
        where = "no dense path open"
    because = (f"Chapter 3's matrix, SM100: {where}; refused: {', '.join(refused)}. Predicted by the cost model "
               f"(B200 datasheet, GLM-5 step geometry), KV work a step: "
               f"{kv['full_pool_cast_fa2'][0]:.1f}–{kv['full_pool_cast_fa2'][1]:.1f} ms with the whole-pool cast, "
               f"{kv['ours'][0]:.1f}–{kv['ours'][1]:.1f} ms ours (Triton path), "
               f"{kv['gather_cast_fa2'][0]:.1f}–{kv['gather_cast_fa2'][1]:.1f} ms gather_cast.")
    return Decision("dense-sm100", MODELS["dense"], "SM100 (B200)", "with or without MTP", command, do,
                    f"KV work {kv['ours'][0]:.1f}–{kv['ours'][1]:.1f} ms (ours)", PREDICTED, because,
                    ("doors_checks", "doors_sm90", "path_sweep", "decode_step_paths", *_acc_source(ev)),
                    f"{CH3}, {CH6}", ("FlashInfer's path: not measured here; " if dense else "")
                    + "ours' Triton path: " + accuracy_report.accuracy_cell(ev.accuracy, ["triton", "ours"]))


def _dense_sm120(ev: Evidence, cells: Sequence[dict[str, Any]]) -> Decision:
    dense = open_doors(cells, "SM120", dense=True)
    p = headline_point(ev.step)
    pred = {r["path"]: r for r in original_gpu_rows(ev.fit.model, p)}
    cast = pred["full_pool_cast_fa2"]
    patches = sorted(((name, pred[path]) for name, path in (("ours", "ours"), ("gather_cast", "gather_cast_fa2"))
                      if path in pred), key=lambda r: r[1]["step_lo"])
    names = {"ours": "our `fused` patch (ours' Triton path)", "gather_cast": "`gather_cast`"}
    do = " or ".join(names[n] for n, _ in patches) + ": " + (
        "no dense FlashInfer path takes the FP8 cache here." if not dense else
        "FlashInfer: " + ", ".join(DOOR_BY_KEY[c["door"]].label for c in dense) + ".")
    first = patches[0]
    steps = "; ".join(f"{r['step_lo']:.0f}–{r['step_hi']:.0f} ms {n}" for n, r in patches)
    because = (f"The cost model at the original's geometry: {cast['step_lo']:.0f}–{cast['step_hi']:.0f} ms with the "
               f"whole-pool cast (the original measured {ORIGINAL.step_ms:g} ms) → {steps}. Ours' Triton path "
               f"compiles for sm_120 with a launch shape that fits its shared memory ({CH6}).")
    return Decision("dense-sm120", MODELS["dense"], "SM120 (RTX PRO 6000)", "no speculative decoding, patched",
                    f"--attention-backend flashinfer {FP8_CACHE}", _cap(do),
                    f"{first[1]['step_lo']:.0f}–{first[1]['step_hi']:.0f} ms ({first[0]}) vs {ORIGINAL.step_ms:g} ms",
                    PREDICTED, because, ("doors_checks", "doors_sm90", "path_sweep", "decode_step_paths",
                                         *_acc_source(ev)), f"{CH3}, {CH6}",
                    "ours' Triton path: " + accuracy_report.accuracy_cell(ev.accuracy, ["triton", "ours"]))


def decide(ev: Evidence) -> list[Decision]:
    """The answer's rows: DSA models first (the book's own GLM-5: SM90 without and with MTP, SM100, SM120), then dense
    MLA models (SM90 without a patch, patched, with speculative decoding; SM100; SM120)."""
    cells = door_cells(ev.doors_checks, ev.doors_sm90)
    return [_dsa_sm90(ev), _dsa_sm90_spec(ev), _dsa_other(ev, cells, "SM100"), _dsa_other(ev, cells, "SM120"),
            _dense_sm90_no_patch(ev), _dense_sm90_patch(ev), _dense_sm90_spec(ev), _dense_sm100(ev, cells),
            _dense_sm120(ev, cells)]


def commands(rows: Sequence[Decision]) -> list[str]:
    """Every SGLang command line the rows print (what ``tests/test_sglang_dsa.py`` checks against 0.5.23)."""
    return [r.command for r in rows if r.command]


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
        text = (f"SGLang 0.5.23 (flags read from its source), GLM-5 geometry, 16 heads/GPU, 78 layers; "
                f"{PATCH_NOTE_SHORT} SM100, SM120: predictions. Recorded on ")
    else:
        text = (f"SGLang 0.5.23: every flag and value read from its source and checked by the tests. GLM-5's geometry "
                f"(16 heads per GPU, 78 layers, a 495,000-token pool) for every row. {PATCH_NOTE} SM120 and SM100: the "
                "cost model's predictions from the H200's measurements, not measurements. Recorded on ")
    text += "; ".join(f"{k} ({', '.join(v)})" for k, v in groups.items()) + "."
    if stale:
        text += f" STALE: {', '.join(stale)} (the code changed since the recording; re-record with `make record`)."
    return text


def decision_table(rows: Sequence[Decision], caption: str, *, compact: bool = False) -> Table:
    """The rows as a table: the answer (``compact``: what the front page, chapter 6 and the README show), or each
    row's full reason and the chapters that show it (folded: a few rows of long text), for chapter 6 under the
    answer. Both have the same setups."""
    if compact:
        return Table([r.as_dict() for r in rows], {"your setup": "setup", "run (SGLang 0.5.23)": "run",
                                                   "do this": "do", "decode step": "step_cell",
                                                   "accuracy": "accuracy"}, caption)
    return Table([r.as_dict() for r in rows], {"your setup": "setup", "because": "because", "shown in": "chapters"},
                 caption, fold="Why each row says what it says, with its figures")


#: The README's answer sits between these markers (``python -m kvwall answer --readme`` writes it; a test compares).
README_START = "<!-- kvwall answer: written by `python -m kvwall answer --readme` from the recorded results -->"
README_END = "<!-- end of kvwall answer -->"


def readme_answer(ev: Evidence | None = None) -> str:
    """The front page's table as Markdown for the README, its chapter links pointing into ``book/``."""
    ev = ev or Evidence.load()
    rows = decide(ev)
    text = decision_table(rows, decision_caption(ev, rows, compact=True), compact=True).markdown()
    return re.sub(r"\]\(([0-9a-z_]+\.md)\)", r"](book/\1)", text)


def write_readme_answer(path: Any, ev: Evidence | None = None) -> bool:
    """Put :func:`readme_answer` between the markers of the README at ``path``; True when the file changed."""
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    p = Path(path)
    text = p.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    new = text[:start] + "\n\n" + readme_answer(ev).strip() + "\n\n" + text[end:]
    if new != text:
        p.write_text(new)
    return new != text

"""The book's answer, computed: what to run, per model kind (DSA or dense MLA), GPU family and speculative decoding.

:func:`decide` turns the recorded results into :class:`Decision` rows; the front page (``book/index.md``), chapter 6's
"What to do" and the README show the same rows (:func:`decision_table`). Each row's words are templates in
``book/answer.yml`` (its ``rows``, one per setup); this module computes the numbers they quote from the recorded
results, picks each row's case (which of a template's variants applies) and fills them. Each row says the SGLang 0.5.23
command (every flag and value checked against its source: :mod:`kvwall.peers.sglang_flags`), the decode step it gives
and how that figure was obtained (measured, composed from measured parts, predicted, or not measured), its accuracy
class and where the numbers come from:

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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from kvwall.model.cost import GPUS
from kvwall.model.geometry import GLM5
from kvwall.model.original import ORIGINAL
from kvwall.reports import accuracy_report, dsa_report
from kvwall.reports.accuracy_regimes import RANDOM_INPUTS, fp8_query_multipliers
from kvwall.reports.accuracy_report import TAIL_KEPT
from kvwall.reports.answer_report import FLASHMLA_FP8, GATHER_CAST, OURS, TRITON, WORDS, Filler, fill, headline_point
from kvwall.reports.evidence import (
    Evidence,
    batch_comparison,
    door_cells,
    open_doors,
    refused_doors,
    span,
    step_at,
    steps_text,
)
from kvwall.reports.fused_bench_report import FM_FP8
from kvwall.reports.multi_token_report import verify_rows
from kvwall.reports.original_gpu_report import original_gpu_rows, rest_without_attention_ms
from kvwall.reports.rows import Row, rows_of
from kvwall.reports.tables import Table
from kvwall.peers.flashinfer.doors import DOOR_BY_KEY, FAMILIES
from kvwall.peers.sglang_dsa import DSA_DEFAULTS

#: The GPU families the answer's rows are for (``kvwall.peers.flashinfer.doors``).
SM90, SM100, SM120 = FAMILIES
#: The batch regime the patch row's sweep figures speak for: mixed batches of at least this many requests.
BIG_BATCH = 16
#: SGLang 0.5.23's ``--attention-backend`` value for a FlashInfer door (``attention_registry.py``: ``flashinfer``
#: builds the FlashInfer MLA backend for an MLA model; ``flashinfer_mla`` is not a value it accepts).
SGLANG_BACKEND = {"fa2": "flashinfer", "fa3": "flashinfer", "trtllm-gen": "trtllm_mla"}
#: The answer's words (``book/answer.yml``): the two kinds of MLA model the answer forks on, how a step figure was
#: obtained, and SGLang 0.5.23's FlashInfer MLA backend with an FP8 cache (it casts the whole pool, whatever the
#: FlashInfer), in full and short.
_ROWS, MODELS = WORDS.rows, WORDS.models
_EVIDENCE = WORDS.evidence
MEASURED, COMPOSED, PREDICTED, NOT_MEASURED = (
    _EVIDENCE.measured,
    _EVIDENCE.composed,
    _EVIDENCE.predicted,
    _EVIDENCE.not_measured,
)
PATCH_NOTE, PATCH_NOTE_SHORT = WORDS.patch_note, WORDS.patch_note_short


class _Lazy(dict):
    """A mapping computed on lookup (``{steps[ours]}`` in a template calls ``steps_text(ev, "ours")``)."""

    def __init__(self, compute: Callable[[Any], Any]) -> None:
        super().__init__()
        self.compute = compute

    def __missing__(self, key: Any) -> Any:
        return self.setdefault(key, self.compute(key))


@dataclass(frozen=True)
class Decision:
    """One row of the answer: the setup (model kind, GPU family, speculative decoding), the SGLang 0.5.23 flags to
    run (``command``; '' where nothing needs setting), what to do in a few words (``do``), the decode step it gives
    (``step``) and how that was obtained (``evidence``), its accuracy class, the full reason (``because``, chapter 6),
    the recorded results the numbers come from and the chapters that show them; the cells the table shows (``setup``,
    ``run``, ``step_cell``); and the cases its words were picked by (``cases``: ``row`` the row's, the others its
    pieces')."""

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
    accuracy: str
    setup: str
    run: str
    step_cell: str
    cases: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _row(key: str, ev: Evidence, values: Mapping[str, Any], **cases: Any) -> Decision:
    """The row ``key`` of ``book/answer.yml``, filled with ``values``; ``cases``: ``row`` picks its fields' variants,
    the others their pieces'."""
    spec = _ROWS[key]
    cases.setdefault("forced", ev.dsa_forced is not None)
    values = dict(
        values,
        steps=_Lazy(lambda path: steps_text(ev, path)),
        forced_dense=ev.dsa_forced and dsa_report.forced_dense(ev.dsa_forced),
    )
    filler = Filler(values, {**WORDS.pieces, **spec.get("pieces", {})}, cases)
    text = Row(
        {name: filler.fill(spec[name], cases.get("row")) for name in Decision.__dataclass_fields__ if name in spec}
    )
    recorded = {r.experiment for r in ev.results()}
    text.update(
        key=key,
        model=MODELS[text.model],
        evidence=_EVIDENCE[text.evidence],
        sources=tuple(s for s in text.sources if s in recorded),
        cases=cases,
    )
    # The cells the table shows: the setup, the command (or that nothing needs setting), the step with its evidence.
    shown = {
        name: Filler(text, {}, {}).fill(t, case)
        for (name, t), case in zip(WORDS.cells.items(), (None, bool(text.command), text.evidence == NOT_MEASURED))
    }
    return Decision(**text, **shown)


def _default(sm: str, model: str = GLM5.name) -> Any:
    """SGLang 0.5.23's DSA default for an FP8 cache on ``sm`` (read from its source)."""
    return next(d for d in DSA_DEFAULTS if d.sm == sm and d.kv_cache_dtype == "fp8_e4m3" and model in d.model)


def _bf16_accuracy(ev: Evidence, strategies: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The values and cases of the ``bf16_accuracy`` piece: chapter 5b's verdict on the first of ``strategies`` that
    ran (:func:`kvwall.reports.accuracy_report.path_summary`)."""
    summaries = [accuracy_report.path_summary(ev.accuracy, s) for s in strategies] if ev.accuracy is not None else []
    acc = next((s for s in summaries if s is not None), None)
    if acc is None:
        return {}, dict(bf16_accuracy="none")
    failing, passing, tail = acc.failing_profiles, acc.passing_profiles, acc.tail_kept_min
    return (
        dict(acc=acc, failing=len(failing), profiles=len(failing) + len(passing)),
        dict(bf16_accuracy="fails" if failing else "keeps", tail=tail is not None and tail < TAIL_KEPT),
    )


def _dsa_sm90(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    values: dict[str, Any] = dict(sm90=_default(SM90))
    if ev.dsa is None:
        return _row(key, ev, values, row="no_result")
    composed = dsa_report.dsa_step(ev.step, ev.dsa)
    acc = dsa_report.accuracy(ev.dsa)
    big = max(
        (p for p in dsa_report.points(ev.dsa) if p.heads == 16 and p.dsa),
        key=lambda p: (p.batch, p.context),
    )
    values.update(
        composed=composed,
        acc=acc,
        big=big,
        big_k=big.context // 1024,
        layers=headline_point(ev.step).geometry.num_layers,
        ours_ms=step_at(ev, OURS)[1],
        flashmla_fp8_ms=step_at(ev, FLASHMLA_FP8).get(1, float("nan")),
        sparse_over_ours=acc.sparse[1] / acc.ours[1],
        random_inputs=RANDOM_INPUTS,
    )
    return _row(key, ev, values, row="composed" if composed else "not_composed")


def _dsa_sm90_spec(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    return _row(key, ev, dict(sm90=_default(SM90)))


def _dsa_other(ev: Evidence, key: str, sm: str, cases: Mapping[str, Any], **values: Any) -> Decision:
    glm, ds = _default(sm, "GLM-5"), _default(sm, "DeepSeek-V3.2")
    return _row(
        key,
        ev,
        dict(values, glm=glm, ds=ds),
        dsa_decode=glm.decode == ds.decode,
        dsa_rows=glm.pool_row_bytes == ds.pool_row_bytes,
        **cases,
    )


def _dsa_sm100(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    return _dsa_other(ev, key, SM100, {})


def _dsa_sm120(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    sparse = open_doors(cells, SM120, dense=False)
    built = _sparse_build(ev)
    pred = _dsa_sm120_prediction(ev)
    cases = dict(row=pred is not None, door=bool(sparse), built=built is not None, prediction=pred is not None)
    return _dsa_other(ev, key, SM120, cases, sparse=sparse[0] if sparse else None, build=built, pred=pred)


def _sparse_build(ev: Evidence) -> Row | None:
    if ev.doors_checks is None:
        return None
    builds = rows_of(ev.doors_checks, "builds")
    return next((r for r in builds if r.build == "sparse_mla_sm120" and r.status == "compiled"), None)


def _dsa_sm120_prediction(ev: Evidence) -> tuple[float, float] | None:
    """The DSA step on the original's GPU: its rest without cast and attention (predicted) plus every layer's DSA
    attention measured on the H200 at the headline point, scaled by the two transfer rules."""
    composed = dsa_report.dsa_step(ev.step, ev.dsa) if ev.dsa is not None else None
    if composed is None:
        return None
    p = headline_point(ev.step)
    h200, rtx = GPUS["h200"], GPUS["rtx-pro-6000"]
    rest_lo, rest_hi = rest_without_attention_ms(ev.fit.model, p, rtx)
    per_layer = composed.attention_ms / p.geometry.num_layers
    scaled = (per_layer * h200.sms / rtx.sms, per_layer * h200.hbm_gbps / rtx.hbm_gbps)
    return rest_lo + p.geometry.num_layers * min(scaled), rest_hi + p.geometry.num_layers * max(scaled)


def _dense_sm90_no_patch(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    if not step_at(ev, FLASHMLA_FP8):
        return _row(key, ev, {}, row=False)
    acc = accuracy_report.path_summary(ev.accuracy, FM_FP8) if ev.accuracy is not None else None
    regimes = [m for m in fp8_query_multipliers(ev.accuracy, ev.bench, computed=False) if m.strategy == FM_FP8]
    lo = min(regimes, key=lambda m: m.over_ours[0], default=None)
    hi = max(regimes, key=lambda m: m.over_ours[1], default=None)
    return _row(
        key, ev, dict(lo=lo, hi=hi), row=True, caveat=bool(acc and acc.failing_profiles), fp8_accuracy=bool(regimes)
    )


def _dense_sm90_patch(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    ours, gc = step_at(ev, OURS), step_at(ev, GATHER_CAST)
    cmp = batch_comparison(ev.sweep, OURS, GATHER_CAST, min_batch=BIG_BATCH)
    both = sorted(set(ours) & set(gc))
    slower = [b for b in both if ours[b] > gc[b]]
    best = OURS if len(slower) < len(both) or not both else GATHER_CAST
    accuracy, cases = _bf16_accuracy(ev, [OURS if best == OURS else "gather_cast_bf16"])
    values = dict(accuracy, slower=", ".join(map(str, slower)), cmp=cmp)
    if cmp.batches:
        values.update(
            last_batch=cmp.batches[-1],
            ours_us=span(list(cmp.a_us.values())),
            gather_us=span(list(cmp.b_us.values())),
        )
    return _row(
        key,
        ev,
        values,
        row="mixed" if 0 < len(slower) < len(both) else best,
        sweep_batches=bool(cmp.batches),
        **cases,
    )


def _verify(ev: Evidence, pieces: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The case and values of the verify reading: ours' µs at q_len 2 and 4 against its q_len-1 µs and FlashMLA's,
    at the answer's head count, from ``multi_token_decode`` where it was recorded."""
    heads = headline_point(ev.step).geometry.heads_per_gpu
    rows = [r for r in verify_rows(ev.multi_token) if r.heads == heads and r.ours] if ev.multi_token else []
    parts = []
    for q in (2, 4):
        at = [r for r in rows if r.q_len == q and r.ours_vs_q1]
        peer = [r.flashmla_dense_bf16 / r.ours for r in at if r.flashmla_dense_bf16]
        if at:
            parts.append(
                fill(
                    pieces.verify_q,
                    q=q,
                    over_q1=span([r.ours_vs_q1 for r in at], 2),
                    peer=fill(pieces.peer, bool(peer), peer_over_ours=peer and span(peer, 2)),
                )
            )
    case = "measured" if rows else "not_at_heads" if ev.multi_token else "no_result"
    return case, dict(heads=heads, kernel="; ".join(parts))


def _dense_sm90_spec(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    case, values = _verify(ev, _ROWS[key].pieces)
    return _row(key, ev, values, row=case, verify=case)


def _dense_sm100(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    dense = open_doors(cells, SM100, dense=True)
    pieces, p = _ROWS[key].pieces, headline_point(ev.step)
    backends = sorted({SGLANG_BACKEND.get(c.door, c.door) for c in dense})
    b200, layers = GPUS["b200"], p.geometry.num_layers
    kv = _Lazy(lambda path: [layers * v / 1e3 for v in ev.fit.model.layer_range_us(path, p, b200)])
    accuracy, cases = _bf16_accuracy(ev, [TRITON, OURS])
    values = dict(
        accuracy,
        dense=dense,
        backends=backends,
        kv=kv,
        refused=", ".join(refused_doors(cells, SM100)),
        backend_flags=" or ".join(fill(pieces.backend_flag, backend=b) for b in backends),
        open_doors="; ".join(fill(pieces.open_door, label=DOOR_BY_KEY[c.door].label, door=c) for c in dense),
    )
    return _row(key, ev, values, row=bool(dense), where=bool(dense), **cases)


def _dense_sm120(ev: Evidence, cells: Sequence[dict[str, Any]], key: str) -> Decision:
    dense = open_doors(cells, SM120, dense=True)
    spec = _ROWS[key]
    pred = {r.path: r for r in original_gpu_rows(ev.fit.model, headline_point(ev.step))}
    patches = sorted(
        ((name, pred[path]) for name, path in (("ours", "ours"), ("gather_cast", "gather_cast_fa2")) if path in pred),
        key=lambda r: r[1].step_lo,
    )
    accuracy, cases = _bf16_accuracy(ev, [TRITON, OURS])
    values = dict(
        accuracy,
        cast=pred["full_pool_cast_fa2"],
        first=patches[0][1],
        first_name=patches[0][0],
        original=ORIGINAL,
        patches=" or ".join(spec.patch_names[n] for n, _ in patches),
        open_labels=", ".join(DOOR_BY_KEY[c.door].label for c in dense),
        patch_steps="; ".join(fill(spec.pieces.patch_step, r=r, name=n) for n, r in patches),
    )
    return _row(key, ev, values, row=bool(dense), **cases)


#: The rows of ``book/answer.yml``, each computed by its function here.
_BUILD = dict(
    zip(
        _ROWS,
        (
            _dsa_sm90,
            _dsa_sm90_spec,
            _dsa_sm100,
            _dsa_sm120,
            _dense_sm90_no_patch,
            _dense_sm90_patch,
            _dense_sm90_spec,
            _dense_sm100,
            _dense_sm120,
        ),
    )
)


def decide(ev: Evidence) -> list[Decision]:
    """The answer's rows, in ``book/answer.yml``'s order: DSA models first (the book's own GLM-5: SM90 without and with
    MTP, SM100, SM120), then dense MLA models (SM90 without a patch, patched, with speculative decoding; SM100;
    SM120)."""
    cells = door_cells(ev.doors_checks, ev.doors_sm90)
    return [build(ev, cells, key) for key, build in _BUILD.items()]


def commands(rows: Sequence[Decision]) -> list[str]:
    """Every SGLang command line the rows print (what ``tests/test_sglang_dsa.py`` checks against 0.5.23)."""
    return [r.command for r in rows if r.command]


def _recorded_where(prov: Any) -> str:
    """A recording in a few words: the GPU (or a CPU), the date, the commit."""
    where = (prov.gpu or "").removeprefix("NVIDIA ") or (WORDS.caption.a_cpu if prov.device == "cpu" else prov.device)
    return fill(WORDS.caption.recording, where=where, prov=prov)


def decision_caption(ev: Evidence, rows: Sequence[Decision], *, compact: bool = False) -> str:
    """Where the rows' numbers come from: each result the rows quote, grouped by recording (``compact``: GPU, date
    and commit; else with the versions), what SGLang does that the rows assume, and what is predicted rather than
    measured."""
    used = {s for r in rows for s in r.sources}
    groups: dict[str, list[str]] = {}
    for res in ev.results():
        if res.experiment in used:
            groups.setdefault(_recorded_where(res.provenance) if compact else res.provenance.short(), []).append(
                res.experiment
            )
    stale = sorted(res.experiment for res in ev.results() if res.experiment in used and res.stale)
    caption = WORDS.caption
    return fill(
        caption.compact if compact else caption.full,
        point=headline_point(ev.step),
        patch_note=PATCH_NOTE,
        patch_note_short=PATCH_NOTE_SHORT,
        recorded="; ".join(f"{k} ({', '.join(v)})" for k, v in groups.items()),
        stale=fill(caption.stale, bool(stale), stale_results=", ".join(stale)),
    )


def decision_table(rows: Sequence[Decision], caption: str, *, compact: bool = False) -> Table:
    """The rows as a table: the answer (``compact``: what the front page, chapter 6 and the README show), or each
    row's full reason and the chapters that show it (folded: a few rows of long text), for chapter 6 under the
    answer. Both have the same setups."""
    rows_ = [r.as_dict() for r in rows]
    if compact:
        return Table(rows_, WORDS.columns.compact, caption)
    return Table(rows_, WORDS.columns.reasons, caption, fold=WORDS.reasons_fold)


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
    p = Path(path)
    text = p.read_text()
    start, end = text.index(README_START) + len(README_START), text.index(README_END)
    new = text[:start] + "\n\n" + readme_answer(ev).strip() + "\n\n" + text[end:]
    if new != text:
        p.write_text(new)
    return new != text

"""Chapter 6's section for DSA models (GLM-5, DeepSeek-V3.2): SGLang's own decode path on Hopper measured beside the
dense paths (``dsa_decode``), what a dense backend forced on such a model does to its FP8 pool (``dsa_forced_dense``),
and the DSA decode step composed from measured parts (``decode_step_paths`` + ``dsa_decode``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvwall.model.geometry import GLM5
from kvwall.reports.plots import arrange
from kvwall.reports.tables import Table, number, scientific
from kvwall.peers.sglang_dsa import DSA_DEFAULTS
from kvwall.results import Result

__all__ = ["DSA_LABEL", "DENSE", "defaults_table", "citations_table", "dsa_step_text", "points", "dsa_table", "dsa_figure", "accuracy", "accuracy_text", "forced_dense",
           "forced_dense_text", "DSAStep", "dsa_step", "speed_text"]

#: The DSA path, as SGLang 0.5.23 runs it on Hopper with an FP8 cache.
DSA_LABEL = "DSA: indexer + FlashMLA sparse FP8 (2,048 tokens)"
#: The dense paths timed at the same points, with their labels.
DENSE = {"ours_page64": "ours (every token)", "flashmla_dense_fp8": "FlashMLA dense FP8 (every token, FP8 query)",
         "flashmla_dense_bf16": "FlashMLA dense BF16 (every token, BF16 cache)"}
_COLORS = {"dsa": "#2ca02c", "sparse": "#98df8a", "ours_page64": "#d62728", "flashmla_dense_fp8": "#1f77b4",
           "flashmla_dense_bf16": "#9467bd"}


def points(result: Result) -> list[dict[str, Any]]:
    """One dict per (heads, context, batch): each DSA part's µs (``sparse_decode``, ``indexer_logits``, ``topk``),
    ``dsa`` (sparse decode + indexer scores: the DSA attention without the top-k, whose kernel here is a stand-in),
    each dense path's µs, and the accuracy fields."""
    out: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in result.rows:
        if r["section"] not in ("dsa", "bench"):
            continue
        key = (r["heads"], r["context"], r["batch"])
        pt = out.setdefault(key, {"heads": key[0], "context": key[1], "batch": key[2], "tokens": r["tokens"]})
        if r["section"] == "dsa":
            pt[r["part"]] = r.get("us")
            pt["selected"], pt["padded_heads"] = r["selected"], r["padded_heads"]
            if r["part"] == "sparse_decode":
                pt.update({k: r[k] for k in ("rel_err_f64", "rel_err_vs_bf16", "storage_rel_err",
                                             "plain_storage_rel_err", "dense_storage_rel_err") if r.get(k) is not None})
            elif r["part"] == "indexer_logits":
                pt.update(logits_rel_err_f64=r.get("logits_rel_err_f64"), indexer_floor_us=r.get("floor_us"))
            elif r["part"] == "topk":
                pt["topk_recall"] = r.get("topk_recall")
        else:
            pt[r["strategy"]] = r.get("us")
            pt[f"{r['strategy']}_err"] = r.get("rel_err_f64")
    for pt in out.values():
        if pt.get("sparse_decode") is not None and pt.get("indexer_logits") is not None:
            pt["dsa"] = pt["sparse_decode"] + pt["indexer_logits"]
        if pt.get("dsa") and pt.get("ours_page64"):
            pt["ours_over_dsa"] = pt["ours_page64"] / pt["dsa"]
    return sorted(out.values(), key=lambda p: (p["heads"], p["batch"], p["context"]))


def dsa_table(result: Result, heads: int = 16) -> Table:
    """µs per layer at each context and batch, ``heads`` query heads per GPU: the DSA parts and the dense paths."""
    rows = [{**p, "ctx": f"{p['context'] // 1024}K"} for p in points(result) if p["heads"] == heads]
    us = number(1)
    return Table(rows, {"batch": "batch", "context": "ctx", "DSA decode": ("sparse_decode", us),
                        "DSA indexer": ("indexer_logits", us), "DSA top-k (stand-in)": ("topk", us),
                        "ours": ("ours_page64", us), "FlashMLA FP8": ("flashmla_dense_fp8", us),
                        "FlashMLA BF16": ("flashmla_dense_bf16", us),
                        "ours / DSA (>1: DSA faster)": ("ours_over_dsa", lambda v: "—" if v is None else f"{v:.2f}×")},
                 f"µs per layer, {heads} query heads per GPU (FlashMLA's sparse kernel runs them padded to "
                 f"{rows[0]['padded_heads'] if rows else '?'}), CUDA graphs, L2 flushed. Batch 1: one request of the "
                 "context; larger batches: mixed lengths summing to context × batch / 4 (chapter 5's grid). DSA "
                 "decode: FlashMLA's sparse FP8 kernel over 2,048 tokens a request (fewer when the request is shorter); "
                 "ours and FlashMLA dense read every token. DSA indexer: its scores of every token, a Triton stand-in "
                 "for DeepGEMM's fp8_paged_mqa_logits (the same bytes and FP8 products); top-k: torch.topk, a stand-in "
                 "for SGLang's kernel, left out of ours / DSA (which is ours' µs over decode + indexer µs). "
                 + result.caption())


def dsa_figure(result: Result, heads: int = 16, title: str = "") -> go.Figure:
    """µs per layer against context, one panel per batch: the DSA (decode + indexer, and the sparse decode alone)
    against ours and FlashMLA dense."""
    pts = [p for p in points(result) if p["heads"] == heads]
    batches = sorted({p["batch"] for p in pts})
    fig = make_subplots(rows=1, cols=len(batches), shared_yaxes=True, horizontal_spacing=0.03)
    series = {"dsa": "DSA: decode + indexer (2,048 tokens)", "sparse": "DSA: decode alone",
              "ours_page64": "ours (every token)", "flashmla_dense_fp8": "FlashMLA FP8 (every token)",
              "flashmla_dense_bf16": "FlashMLA BF16 (every token)"}
    for i, b in enumerate(batches, start=1):
        sel = sorted((p for p in pts if p["batch"] == b), key=lambda p: p["context"])
        for key, name in series.items():
            field = "sparse_decode" if key == "sparse" else key
            xs = [p["context"] for p in sel if p.get(field)]
            ys = [p[field] for p in sel if p.get(field)]
            fig.add_trace(go.Scatter(x=xs, y=ys, name=name, legendgroup=key, showlegend=i == 1, mode="lines+markers",
                                     line=dict(color=_COLORS[key], dash="dot" if key == "sparse" else "solid")),
                          row=1, col=i)
        fig.update_xaxes(type="log", title_text=f"batch {b}: tokens a request" if i == 1 else f"batch {b}", row=1,
                         col=i, tickvals=[4096, 32_768, 131_072], ticktext=["4K", "32K", "128K"])
    fig.update_yaxes(type="log", title_text="µs per layer", row=1, col=1)
    fig.update_layout(title=title or f"GLM-5's DSA decode against dense attention, {heads} heads per GPU")
    return arrange(fig, [result.caption(), "Top-k (torch.topk stand-in) left out; the table has it."], height=480)


@dataclass(frozen=True)
class Accuracy:
    """Relative errors against float64 over the points that were checked (batches up to 8): each kernel on the values
    its cache holds, and what storing the keys alone costs each cache (no kernel)."""

    sparse: tuple[float, float]
    ours: tuple[float, float]
    flashmla_fp8: tuple[float, float]
    flashmla_bf16: tuple[float, float]
    storage_dsa: tuple[float, float]
    storage_plain: tuple[float, float]
    storage_plain_all: tuple[float, float]
    logits: float
    recall: float


def _span(xs: list[float]) -> tuple[float, float]:
    return (min(xs), max(xs)) if xs else (float("nan"), float("nan"))


def accuracy(result: Result) -> Accuracy:
    pts = points(result)
    return Accuracy(_span([p["rel_err_f64"] for p in pts if p.get("rel_err_f64") is not None]),
                    _span([p["ours_page64_err"] for p in pts if p.get("ours_page64_err") is not None]),
                    _span([p["flashmla_dense_fp8_err"] for p in pts if p.get("flashmla_dense_fp8_err") is not None]),
                    _span([p["flashmla_dense_bf16_err"] for p in pts if p.get("flashmla_dense_bf16_err") is not None]),
                    _span([p["storage_rel_err"] for p in pts if p.get("storage_rel_err") is not None]),
                    _span([p["plain_storage_rel_err"] for p in pts if p.get("plain_storage_rel_err") is not None]),
                    _span([p["dense_storage_rel_err"] for p in pts if p.get("dense_storage_rel_err") is not None]),
                    max((p["logits_rel_err_f64"] for p in pts if p.get("logits_rel_err_f64") is not None),
                        default=float("nan")),
                    min((p["topk_recall"] for p in pts if p.get("topk_recall") is not None), default=float("nan")))


def _r(span: tuple[float, float]) -> str:
    lo, hi = scientific(span[0]), scientific(span[1])
    return lo if lo == hi else f"{lo}–{hi}"


def accuracy_text(result: Result) -> str:
    """The DSA kernel's error beside the dense paths', on chapter 5's random Gaussian inputs, and the storage error."""
    a = accuracy(result)
    return (f"On the values each cache holds (random Gaussian q and latent, chapter 5's regime), FlashMLA's sparse "
            f"FP8 decode is {_r(a.sparse)} from float64 over the 2,048 tokens it reads: a BF16-class error "
            f"({a.sparse[1] / a.ours[1]:.1f}× ours' {_r(a.ours)} and {a.sparse[1] / a.flashmla_bf16[1]:.1f}× "
            f"FlashMLA BF16's {_r(a.flashmla_bf16)}; it keeps the query in BF16 and dequantizes the tokens it reads), "
            f"where FlashMLA dense FP8, which quantizes the query, is {_r(a.flashmla_fp8)}. Before any kernel runs, "
            f"storing the keys in FP8 moves the output from the BF16 keys' (float64 attention on both sides): "
            f"{_r(a.storage_dsa)} with SGLang's scaled DSA rows"
            + ("" if math.isnan(a.storage_plain[0]) else
               f" and {_r(a.storage_plain)} with plain e4m3 rows, over the same 2,048 tokens")
            + f"; {_r(a.storage_plain_all)} with plain e4m3 rows over every token. The indexer stand-in's scores are "
            f"{scientific(a.logits)} from float64's and its top 2,048 hold {a.recall:.0%} of float64's.")


def speed_text(result: Result, heads: int = 16) -> str:
    """Where the DSA decode wins and by how much, read from the recorded points at ``heads``."""
    pts = [p for p in points(result) if p["heads"] == heads and p.get("dsa") and p.get("ours_page64")]
    one = [p for p in pts if p["batch"] == 1]
    sparse1 = [p["sparse_decode"] for p in one]
    wins = [p for p in pts if p["dsa"] < p["ours_page64"]]
    big = max(pts, key=lambda p: (p["batch"], p["context"]))
    return (f"At one request FlashMLA's sparse decode takes {min(sparse1):.1f}–{max(sparse1):.1f} µs a layer "
            f"whatever the context ({heads} heads run as {one[0]['padded_heads']}), and the indexer's scores "
            f"{min(p['indexer_logits'] for p in one):.1f}–{max(p['indexer_logits'] for p in one):.1f} µs, growing with "
            f"the context: it reads every token's 132-byte index key. Decode and indexer together beat ours at "
            f"{len(wins)} of {len(pts)} points; at batch {big['batch']} and {big['context']:,} tokens a request they "
            f"take {big['dsa']:.0f} µs against ours' {big['ours_page64']:.0f} and FlashMLA FP8's "
            f"{big['flashmla_dense_fp8']:.0f}. They lose where ours reads few tokens: "
            + ", ".join(f"{p['context'] // 1024}K × {p['batch']}" for p in pts if p not in wins)
            + f" (context × batch; ours at those points: {min(p['ours_page64'] for p in pts if p not in wins):.0f}–"
            f"{max(p['ours_page64'] for p in pts if p not in wins):.0f} µs). The top-k, here "
            f"torch.topk at {min(p['topk'] for p in one):.0f}–{max(p['topk'] for p in one):.0f} µs at one request, is "
            f"a stand-in: SGLang's own top-k kernel was not run (it ships in sgl-kernel, which the GPU machine lacks), "
            f"so the DSA figures above leave it out: they are SGLang's DSA layer without its top-k.")


def forced_dense(result: Result) -> dict[str, Any]:
    """The ``forced_dense`` row of ``dsa_forced_dense``."""
    return next(r for r in result.rows if r["section"] == "forced_dense")


def forced_dense_text(result: Result) -> str:
    f = forced_dense(result)
    return (f"In SGLang {f['sglang']}'s own pool classes (run on a CPU, torch {f['torch_version']}), a DSA model's FP8 "
            f"pool holds {f['dsa_row_bytes']}-byte rows (512 e4m3 values, four float32 scales, 64 BF16 rotary "
            f"values; {f['dsa_row_bytes_trtllm']} bytes only when `trtllm` is a DSA backend), and forcing a dense "
            f"backend does not change it. The dense FlashInfer backend (`--attention-backend flashinfer`) casts those "
            f"rows as if they were plain {f['dsa_row_bytes_trtllm']}-value rows: the latent comes back "
            f"{f['dense_latent_rel_err']:.0f}× off in relative error (its per-tile scales are never applied), "
            f"{f['dense_rope_nan_tokens']:.0%} of tokens read a NaN in their rotary values, and attention over exactly "
            f"what the backend hands FlashInfer is NaN (a reference decode on those values; FlashInfer's kernel itself "
            f"was not run on them), with no error raised anywhere on the way. `--attention-backend flashmla` or `triton` stop at the first cache "
            f"write instead ({f['set_kv_buffer_error'].split(':')[0]}). The same keys in a plain MLA pool read back "
            f"to an output {f['mla_pool_output_rel_err']:.1e} from float64's.")


@dataclass(frozen=True)
class DSAStep:
    """The DSA decode step at the step's point, composed from measured parts: the step's own write and rest-of-layer
    phases (``decode_step_paths``, ours' row) plus every layer's DSA attention (``dsa_decode`` at the same heads,
    context and batch); ``topk_ms``: what the torch.topk stand-in would add (SGLang's kernel not measured)."""

    step_ms: float
    attention_ms: float
    topk_ms: float
    context: int
    heads: int
    batch: int


def dsa_step(step: Result, dsa: Result) -> DSAStep | None:
    """:class:`DSAStep` at the step's request (one request of its context, its heads per GPU), or None when
    ``dsa_decode`` has no such point."""
    setup = next(r for r in step.rows if r["section"] == "setup")
    ours = next((r for r in step.rows if r.get("path") == "ours" and r.get("step_ms")), None)
    lens = step.params["context_lens"]
    pt = next((p for p in points(dsa) if p["heads"] == setup["heads_per_gpu"] and p["batch"] == len(lens)
               and p["context"] == lens[0] and p.get("dsa")), None)
    if ours is None or pt is None or len(lens) != 1:
        return None
    layers = GLM5.num_layers
    attention = layers * pt["dsa"] / 1e3
    return DSAStep(ours["write_kv_ms"] + ours["rest_ms"] + attention, attention, layers * (pt.get("topk") or 0) / 1e3,
                   lens[0], setup["heads_per_gpu"], len(lens))


#: The facts of :data:`kvwall.peers.sglang_dsa.FACTS` in a reader's words, in the order the chapter tells them.
FACT_WORDS = {
    "attention_backend_choices": "`--attention-backend` takes `flashinfer`, `flashmla`, `dsa`, ... (not `flashinfer_mla`)",
    "flashinfer_is_flashinfer_mla_for_mla_models": "`flashinfer` builds the FlashInfer MLA backend for an MLA model",
    "dsa_backend_flags": "`--dsa-decode-backend` and `--dsa-prefill-backend` name the DSA kernels",
    "kv_cache_dtype_choices": "`--kv-cache-dtype` takes `fp8_e4m3` (not `fp8`)",
    "speculative_algorithm": "`--speculative-algorithm` takes `EAGLE` (alias `NEXTN`), not `MTP`",
    "dsa_model_detection": "a DSA model is recognised",
    "dsa_backend_only_when_unforced": "`dsa` is chosen only when no backend is forced",
    "unset_kv_dtype": "an unset cache dtype is FP8 on SM100 and SM120, BF16 on SM90",
    "dsa_split_defaults": "the DSA decode and prefill kernels per GPU (the table above)",
    "flashmla_kv_head_padding": "FlashMLA's sparse decode pads the query heads to 64 or 128",
    "dsa_page_size": "pages of 64 tokens",
    "dsa_pool_class": "the DSA pool, whatever the attention backend",
    "dsa_fp8_row": "its FP8 row: 656 bytes, or 576 when `trtllm` is a DSA backend",
    "indexer_row": "the indexer's own cache: 132 bytes a token a layer",
    "forced_dense_allowed": "forcing a dense backend is not refused",
    "dsa_resolution_ignores_forced_backend": "a forced backend still gets the DSA pool's layout",
    "indexer_skipped_on_dense": "with a dense backend the indexer is skipped: every token is attended",
    "absorbed_backends_write_mla": "flashinfer and fa3 write the scaled rows",
    "key_buffer_on_dsa_pool": "and read the pool as 656 e4m3 columns",
    "flashinfer_dense_read": "FlashInfer's backend casts them and splits them as 512 + rest",
    "fa3_dense_read": "so does fa3's",
    "flashmla_triton_write_raises": "flashmla and triton assert at the first cache write",
    "dense_prefill_is_dsa_aware": "prefill dequantizes the DSA rows itself (only decode misreads)",
}


def defaults_table(forced: Result) -> Table:
    """SGLang 0.5.23's DSA kernels per GPU and cache dtype when no DSA backend is named (read from its source)."""
    rows = [{"gpu": d.sm, "kv": d.kv_cache_dtype, "model": d.model, "decode": f"`{d.decode}`",
             "prefill": f"`{d.prefill}`", "bytes": d.pool_row_bytes} for d in DSA_DEFAULTS]
    return Table(rows, {"GPU": "gpu", "cache dtype": "kv", "model": "model", "decode": "decode", "prefill": "prefill",
                        "pool bytes a token a layer": "bytes"},
                 "SGLang 0.5.23's `dsa` backend with no DSA backend named (`_dsa_split_backend_resolution`), read from "
                 "its wheel; the cited lines are below. " + forced.caption())


def citations_table(forced: Result) -> Table:
    """Each fact the chapter states about SGLang, with the wheel's lines it rests on, checked."""
    rows = [{"fact": FACT_WORDS.get(r["fact"], r["fact"]), "where": ", ".join(x.removeprefix("sglang/srt/")
                                                                              for x in r["lines"]),
             "ok": "found" if r["ok"] else "NOT FOUND"} for r in forced.rows if r["section"] == "citations"]
    return Table(rows, {"what SGLang 0.5.23 does": "fact", "its lines (under sglang/srt/)": "where",
                        "checked": "ok"},
                 "Every line was matched against the pinned wheel (sha256-checked) when this was recorded, and is again "
                 "by the tests. " + forced.caption())


def dsa_step_text(composed: DSAStep, step: Result) -> str:
    """The composed DSA step beside the dense paths' recorded steps at the same request."""
    s = {r["path"]: r["step_ms"] for r in step.rows if r.get("section") == "path" and r.get("step_ms")}
    return (f"**{composed.step_ms:.1f} ms** a step at one request of {composed.context:,} tokens, {composed.heads} "
            f"heads per GPU: {composed.attention_ms:.2f} ms of it the DSA attention of {GLM5.num_layers} layers "
            f"(FlashMLA's sparse decode and the indexer's scores), the rest the step's own KV write and the stand-in "
            f"for the rest of each layer. On the dense paths the same step takes {s.get('ours', float('nan')):.1f} ms "
            f"with ours, {s.get('flashmla_fp8', float('nan')):.1f} ms with FlashMLA dense FP8 and "
            f"{s.get('full_pool_cast', float('nan')):.1f} ms with the whole-pool cast. Not in the DSA figure: the "
            f"top-k, whose SGLang kernel was not run here (torch.topk, its stand-in, would add "
            f"{composed.topk_ms:.1f} ms). At one request of this length the DSA's fixed cost matters more than the "
            "tokens it skips; at long contexts and batches (the table above) it reads a fraction of what dense "
            "attention reads.")

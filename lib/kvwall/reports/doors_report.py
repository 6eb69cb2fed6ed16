"""Chapter 3's reading of the door matrix: which library each reason belongs to (FlashInfer or SGLang /
sgl-kernel), what XQA would need on SM120, calls that stopped on a missing download rather than a check, and
what GLM-5's sparse attention (DSA) means for the kernel the original could use.

The upstream facts here were read from sources, not run: SGLang 0.5.23 from its wheel
(``sglang-0.5.23-cp311``), SGLang's ``cutlass_mla_backend.py`` from its repository, FlashInfer from the
installed release. Each text names the file it rests on.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from kvwall.model.geometry import GLM5
from kvwall.reports.tables import Table
from kvwall.peers.flashinfer.doors import DoorCase
from kvwall.peers.flashinfer.replay import replay_cases

__all__ = ["MISSING_DOWNLOAD", "is_missing_download", "gpu_call_rows", "calls_for_matrix", "note_missing_downloads",
           "outcome_label", "replay_summary_table", "xqa_padded_replays", "attribution_text", "xqa_text", "dsa_text"]

#: Messages FlashInfer gives when a trtllm-gen artifact (cubin, checksums, header) could not be loaded or fetched:
#: ``jit/attention/modules.py`` asserts on an empty ``get_artifact`` result, ``jit/cubin_loader.py`` raises under
#: ``FLASHINFER_NO_DOWNLOAD``.
MISSING_DOWNLOAD = ("Failed to get checksums.txt", "Artifact not found locally", "FLASHINFER_NO_DOWNLOAD")


def is_missing_download(row: Mapping[str, Any]) -> bool:
    """A call that stopped because FlashInfer could not fetch a run-time artifact (no network), not on a check."""
    return row.get("outcome") == "refused" and any(m in (row.get("message") or "") for m in MISSING_DOWNLOAD)


def outcome_label(row: Mapping[str, Any]) -> str:
    return "cubin not available (download failed offline)" if is_missing_download(row) else row["outcome"]


def replay_summary_table(replays: Sequence[Mapping[str, Any]], caption: str) -> Table:
    """The replays counted, one row per path and one column per GPU family: how many of the path's calls (head
    counts, page sizes, query dtypes) reached the kernel module, of how many replayed; the calls themselves are the
    full table."""
    families = list(dict.fromkeys(r["family"] for r in replays))
    rows = []
    for door in dict.fromkeys(r["door"] for r in replays):
        row: dict[str, Any] = {"door": door}
        for family in families:
            sel = [r for r in replays if r["door"] == door and r["family"] == family]
            reached = sum(1 for r in sel if r["outcome"] == "kernel_reached")
            row[family] = f"{reached} of {len(sel)} reach the kernel" if sel else "—"
        rows.append(row)
    return Table(rows, {"path": "door", **{f: f for f in families}}, caption)


def gpu_call_rows(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The GPU calls as the chapter's table shows them: a missing download is named, not called a refusal."""
    out = []
    for r in calls:
        if is_missing_download(r):
            answer = (f"stopped before any check of the call: FlashInfer downloads trtllm-gen's cubins at run time, and "
                      f"the recording machine had no network ({r.get('exc_type')}: {r.get('message', '')[:120]})")
        elif r["outcome"] == "runs" and r.get("ms") is not None:
            answer = f"relative error {r['rel_err_vs_float64']:.1e}, {r['ms']:.3f} ms"
        elif r["outcome"] in ("runs", "wrong_output"):
            answer = f"relative error {r.get('rel_err_vs_float64', float('nan')):.1e}"
        else:
            answer = f"{r.get('exc_type', '')}: {r.get('message', '')[:160]}"
        out.append({**r, "outcome_md": outcome_label(r), "answer": answer,
                    "where_md": f"`{r['where']}`" if r.get("where") else ""})
    return out


def calls_for_matrix(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """GPU calls for :func:`~kvwall.peers.flashinfer.doors.door_matrix`, with the missing downloads set aside
    (``skipped``): such a call says nothing about the path, so its cell rests on the next evidence (a cited check,
    or the replay)."""
    return [{**r, "outcome": "skipped"} if is_missing_download(r) else dict(r) for r in calls]


def note_missing_downloads(cells: list[dict[str, Any]], calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Add, to each cell whose GPU calls stopped on a missing download, evidence saying so."""
    for c in cells:
        missing = [r for r in calls if r["door"] == c["door"] and r.get("family") == c["family"] and is_missing_download(r)]
        if missing:
            pages = ", ".join(sorted({f"{r['heads']} heads / page {r['page_size']}" for r in missing}))
            c["evidence"].append({"kind": "gpu", "where": missing[0].get("where", ""),
                                  "text": f"the H200 call ({pages}) stopped before the kernel because FlashInfer could "
                                          "not download its trtllm-gen cubins offline: not an answer about this path"})
    return cells


def xqa_padded_replays() -> list[dict[str, Any]]:
    """XQA on SM120 asked the way it would have to be used for GLM-5: the query padded to 128 heads, in FP8 (and,
    for contrast, padded but BF16), at SGLang's FP8 page size 64. A replay of the release's checks (kernel stubbed)."""
    cases = [DoorCase("xqa", 128, 64, q_dtype="float8_e4m3fn", family="SM120"),
             DoorCase("xqa", 128, 64, q_dtype="bfloat16", family="SM120")]
    return replay_cases(cases)["rows"]


def attribution_text(citation_where: Mapping[str, str]) -> str:
    """Which reason is FlashInfer's, which SGLang's / sgl-kernel's (``citation_where``: claim prefix -> file:line)."""
    return (
        "**Whose reason is it?** The matrix asks *FlashInfer's* entry points. SGLang's Option C backends did not all go "
        "through them, so a FlashInfer check is not automatically a reason SGLang could not serve GLM-5:\n\n"
        f"- **cutlass MLA, 128 heads.** FlashInfer's `cutlass` backend requires exactly 128 query heads "
        f"(`{citation_where.get('exactly 128', '_check_cutlass_shape')}`). SGLang's `cutlass_mla` backend does not "
        "call FlashInfer: it calls sgl-kernel's `cutlass_mla_decode` with the layer's FP8 pool in 128-token pages "
        "(checked in SGLang's `python/sglang/srt/layers/attention/cutlass_mla_backend.py`), and sgl-kernel's wrapper "
        f"pads a query of fewer than 128 heads up to 128 and slices the output back. So GLM-5's {GLM5.heads_per_gpu} "
        "heads per GPU are not what stopped SGLang's `cutlass_mla`; the 128-head reason is FlashInfer's only. (The "
        "padding is recorded in the project's upstream facts; the book does not install or run sgl-kernel.)\n"
        f"- **cutlass MLA, SM10x only.** This reason stands for both libraries: FlashInfer builds the kernel only for "
        f"compute capability 10.x/11.x (`{citation_where.get('the kernel is built only', 'flashinfer/jit/mla.py')}`), "
        "and sgl-kernel's CUTLASS MLA kernel is SM100-only as well. On the original's SM120 neither library has it.\n"
        "- **SGLang 0.5.23**, the release this book reads, no longer registers a `cutlass_mla` backend at all (its "
        "`attention_registry.py` registers `trtllm_mla`, `cutedsl_mla`, `dsa`, `flashmla`, `flashinfer`, … ), and "
        "still casts the whole pool in `flashinfer_mla_backend.py` (`get_key_buffer(layer.layer_id).to(q.dtype)` in "
        "`forward_decode`).")


def xqa_text(padded: Sequence[Mapping[str, Any]], build: Mapping[str, Any] | None,
             fp8_error: tuple[float | None, float | None]) -> str:
    """What XQA would need on SM120, what was checked offline, and what was not."""
    fp8q = next((r for r in padded if r["q_dtype"] == "float8_e4m3fn"), None)
    bf16q = next((r for r in padded if r["q_dtype"] == "bfloat16"), None)
    lines = [
        "**XQA on SM120, tried the way it would have to be used.** XQA is FlashInfer's dense MLA kernel for SM120 "
        "with an FP8 cache; the matrix marks it refused for GLM-5 because it takes exactly 128 query heads and an FP8 "
        f"cache only with an FP8 query. Neither is a wall in principle. Using it would take two changes in SGLang:\n",
        f"1. **pad the heads**: {GLM5.heads_per_gpu} heads per GPU (or {GLM5.num_heads}) to 128, zero queries in the "
        "padding, padded outputs dropped (what sgl-kernel does for CUTLASS MLA). The cache bytes read, which bound "
        f"decode, do not change; the query, output and arithmetic grow {128 // GLM5.heads_per_gpu}×.",
        "2. **quantize the query to FP8** every step (XQA has no bf16-query / FP8-cache pairing).",
    ]
    err_fp8, err_bf16 = fp8_error
    if err_fp8 and err_bf16:
        lines.append(f"\nThe second change costs accuracy. FlashMLA's dense FP8 path on the H200 also takes an FP8 "
                     f"query; in chapter 5's recorded validation (random Gaussian q and latent) its worst relative "
                     f"error against float64 is {err_fp8:.1e}, **{err_fp8 / err_bf16:.0f}×** that of a kernel that "
                     f"keeps the query in BF16 ({err_bf16:.1e}); on chapter 5b's sharper and longer attention the "
                     "multiplier moves with the regime. XQA would be expected in that range, not at the BF16 path's "
                     "level.")
    checked = []
    if fp8q:
        checked.append(f"with the query padded to 128 heads in FP8 at page 64, FlashInfer's checks on SM120 give "
                       f"**{fp8q['outcome']}**" + (f" (`{fp8q.get('kernel')}`)" if fp8q.get("kernel") else
                                                  f": {fp8q.get('message', '')}"))
    if bf16q:
        checked.append(f"padded but left in BF16: **{bf16q['outcome']}** ({bf16q.get('message') or bf16q.get('kernel')})")
    if build:
        checked.append(f"the 128-head FP8 kernel's sources for sm_120a compiled with nvcc {build.get('nvcc')} to "
                       f"{', '.join(build.get('built') or []) or 'nothing'}"
                       + (f" ({', '.join(build.get('failed'))} stopped on the recording machine's partial CUDA toolkit)"
                          if build.get("failed") else ""))
    lines.append("\nChecked offline, without an SM120 GPU (replay live on this machine; build recorded): "
                 + "; ".join(checked) + ".")
    lines.append("\nNot checked, and not checkable here: whether the padded FP8-query call runs and is correct on "
                 "an SM120 GPU, its speed against the whole-pool cast or the gather-cast, and its actual error. "
                 "The matrix keeps XQA *refused* for GLM-5 as SGLang calls it (bf16 query, 16 or 64 heads); the "
                 "padded FP8-query path is a change to SGLang that nobody has measured.")
    return "\n".join(lines)


def dsa_text(topk: int = 2048) -> str:
    """GLM-5 is a DeepSeek-sparse-attention model: which kernel SGLang picks for it, and what the dense path reads."""
    return (
        f"**GLM-5 is a sparse-attention (DSA) model.** Its config has a DSA indexer with `index_topk` {topk:,}: each "
        f"query attends to the {topk:,} context tokens the indexer selects, not to the whole context. The original "
        "served it with `flashinfer_mla`, a *dense* backend: its `forward_decode` takes no top-k list and attends to "
        "every token of the request (and, before that, casts the whole pool). A DSA-aware backend reads at most "
        f"{topk:,} tokens per query, whatever the context.\n\n"
        "What SGLang 0.5.23 does for such models (read from its wheel, not run): `configs/model_config.py` "
        "`is_deepseek_dsa` is true for `GlmMoeDsaForCausalLM` (and DeepSeek-V3.2) with an `index_topk`; "
        "`arg_groups/model_overrides/deepseek_v2.py` then sets `attention_backend='dsa'` when none is given (`nsa`, "
        "the earlier name, is kept as a deprecated alias in `attention_registry.py`), and "
        "`arg_groups/overrides.py` (`_dsa_split_backend_resolution`) picks the DSA kernels: for GLM with an FP8 KV "
        "cache on SM12x, `flashinfer_sparse_mla` for prefill and decode, which is FlashInfer's SM120 sparse MLA, the "
        "last row of the matrix (FP8 on Hopper: `flashmla_kv`; FP8 on Blackwell SM10x: `trtllm`). An explicit "
        "`--attention-backend` overrides that choice, which is how the dense, whole-pool-casting path runs GLM-5.\n\n"
        "So the kernel a GLM-5 deployment on SM120 is meant to use exists and reads the FP8 cache natively; it is "
        "not a drop-in for the dense path the original measured (a different cache layout, the indexer's top-k "
        "list), and whether the original's SGLang version already routed GLM-5 there by default is not something "
        "this book can tell from the original's figures.")

"""FlashInfer's MLA decode paths ("doors") that could read an FP8 KV cache, and the matrix of answers.

Chapter 3 asks which of FlashInfer's MLA decode paths could read GLM-5's FP8 KV cache without the
whole-pool cast, on which GPU family. This module names the paths (:data:`DOORS`), the families
(:data:`FAMILIES`) and the questions (:class:`DoorCase`, :func:`glm5_cases`), and folds the
evidence into one cell per (path, family) (:func:`door_matrix`). The evidence comes from three
sibling modules: :mod:`~kvwall.peers.flashinfer.citations` (the release's own source lines),
:mod:`~kvwall.peers.flashinfer.replay` (its Python checks, replayed as on another GPU family) and
:mod:`~kvwall.peers.flashinfer.calls` (a real call on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

__all__ = ["FAMILIES", "STATUSES", "Door", "DOORS", "DOOR_BY_KEY", "DoorCase", "glm5_cases", "door_matrix"]

#: GPU families of the matrix: name -> (compute capability, example GPUs).
FAMILIES: dict[str, tuple[tuple[int, int], str]] = {
    "SM90": ((9, 0), "H100 / H200"),
    "SM100": ((10, 0), "B200 / GB200"),
    "SM120": ((12, 0), "RTX PRO 6000 Blackwell / RTX 50xx"),
}
#: What a cell of the matrix can say.
STATUSES = ("runs", "accepted", "refused")


@dataclass(frozen=True)
class Door:
    """One MLA decode path: its key, how it is called, and the page sizes it is asked with."""

    key: str
    label: str
    api: str  # the public call
    page_sizes: tuple[int, ...]  # SGLang's page size 1, and the size the path itself requires
    note: str = ""


DOORS: tuple[Door, ...] = (
    Door(
        "fa2",
        "fa2 (BatchMLAPagedAttentionWrapper)",
        "BatchMLAPagedAttentionWrapper(backend='fa2').plan/run",
        (1,),
        "what SGLang's flashinfer_mla backend calls",
    ),
    Door("fa3", "fa3 (BatchMLAPagedAttentionWrapper)", "BatchMLAPagedAttentionWrapper(backend='fa3').plan/run", (1,)),
    Door(
        "cutlass",
        "cutlass MLA",
        "BatchMLAPagedAttentionWrapper(backend='cutlass').run(kv_len=, page_table=)",
        (1, 128),
        "SGLang's cutlass_mla backend uses 128-token pages",
    ),
    Door(
        "trtllm-gen",
        "trtllm-gen MLA",
        "trtllm_batch_decode_with_kv_cache_mla(backend='trtllm-gen')",
        (1, 64),
        "SGLang's trtllm_mla backend uses 32- or 64-token pages",
    ),
    Door("xqa", "XQA MLA", "xqa_batch_decode_with_kv_cache_mla", (1, 64)),
    Door(
        "sm120-sparse",
        "SM120 sparse MLA (DSA, top-k 2048)",
        "trtllm_batch_decode_with_kv_cache_mla(backend='sparse', sparse_mla_top_k=2048)",
        (1, 64),
        "DeepSeek-sparse-attention decode: a packed 656-byte FP8 cache and the indexer's top-k slots",
    ),
)
#: The doors by key.
DOOR_BY_KEY: dict[str, Door] = {d.key: d for d in DOORS}


@dataclass(frozen=True)
class DoorCase:
    """One call: a path, GLM-5's heads per GPU, a page size, the dtypes, a target family (replays)."""

    door: str
    heads: int
    page_size: int
    q_dtype: str = "bfloat16"
    kv_dtype: str = "float8_e4m3fn"
    family: str = "SM90"

    def __post_init__(self) -> None:
        if self.door not in DOOR_BY_KEY:
            raise ValueError(f"Unknown path {self.door!r}; one of {', '.join(DOOR_BY_KEY)}.")
        if self.family not in FAMILIES:
            raise ValueError(f"Unknown GPU family {self.family!r}; one of {', '.join(FAMILIES)}.")
        if self.heads < 1 or self.page_size < 1:
            raise ValueError(f"heads ({self.heads}) and page_size ({self.page_size}) must be positive.")


def glm5_cases(families: Iterable[str] = tuple(FAMILIES), heads: Sequence[int] = (16, 64)) -> list[DoorCase]:
    """Every path × family × GLM-5 head count × the path's page sizes, bf16 query, FP8 KV; XQA also
    with an FP8 query (the only FP8 pairing it accepts)."""
    cases = []
    for fam in families:
        for door in DOORS:
            for h in heads:
                for ps in door.page_sizes:
                    cases.append(DoorCase(door.key, h, ps, family=fam))
                    if door.key == "xqa":
                        cases.append(DoorCase(door.key, h, ps, q_dtype="float8_e4m3fn", family=fam))
    return cases


def door_matrix(
    citations: Sequence[dict], replays: Sequence[dict], gpu_calls: Sequence[dict] = ()
) -> list[dict[str, Any]]:
    """One cell per (path, family): can GLM-5's decode (16 or 64 heads, 512 + 64 latent, bf16 query,
    FP8 KV) run there? Evidence, strongest first:

    1. a real call on a GPU of that family (``gpu_calls``: rows of ``doors_sm90``): ``runs`` if some
       call's output matched the reference, else ``refused`` with the library's words;
    2. a *decisive* citation (a check after the Python layer, such as trtllm-gen's C++ runner) that
       refuses this family: ``refused``;
    3. the replay of the release's checks: ``accepted`` if some bf16-query call reached the kernel
       (``conditions`` says which heads / page sizes), else ``refused`` with the first refusal.

    Every cell carries ``evidence`` (a list of ``{"kind", "where", "text"}``) and the citations of
    the checks that speak for it."""
    cells = []
    for door in DOORS:
        for fam in FAMILIES:
            cites = [c for c in citations if c["door"] == door.key and fam in c["families"] and c.get("line")]
            gpu = [
                r
                for r in gpu_calls
                if r["door"] == door.key and r.get("family") == fam and r.get("outcome") != "skipped"
            ]
            rep = [r for r in replays if r["door"] == door.key and r["family"] == fam]
            rep_q = [r for r in rep if r["q_dtype"] == "bfloat16"]
            decisive = [c for c in cites if c.get("decisive")]
            evidence: list[dict[str, str]] = []
            conditions = ""
            if gpu:
                ran = [r for r in gpu if r["outcome"] == "runs"]
                if ran:
                    status = "runs"
                    for r in ran:
                        evidence.append(
                            {
                                "kind": "gpu",
                                "where": f"{r['heads']} heads, page {r['page_size']}",
                                "text": f"ran on the GPU; relative error {r['rel_err_vs_float64']:.2e} against float64"
                                + (f"; {r['ms']:.3f} ms" if r.get("ms") is not None else ""),
                            }
                        )
                    conditions = ", ".join(sorted({f"{r['heads']} heads / page {r['page_size']}" for r in ran}))
                else:
                    status = "refused"
                    for r in gpu:
                        evidence.append(
                            {
                                "kind": "gpu",
                                "where": r.get("where", ""),
                                "text": f"{r['heads']} heads, page {r['page_size']}, Q {r['q_dtype']}: "
                                f"{r.get('exc_type', r['outcome'])}: {r.get('message', '')}",
                            }
                        )
            elif decisive:
                status = "refused"
                for c in decisive:
                    evidence.append({"kind": "source", "where": c["where"], "text": f"{c['claim']}: {c['text']}"})
                reached = [r for r in rep_q if r["outcome"] == "kernel_reached"]
                if reached:
                    evidence.append(
                        {
                            "kind": "replay",
                            "where": reached[0]["kernel"],
                            "text": "the Python checks pass (replayed); the refusal comes after them, in C++",
                        }
                    )
            else:
                reached = [r for r in rep_q if r["outcome"] == "kernel_reached"]
                if reached:
                    status = "accepted"
                    conditions = ", ".join(sorted({f"{r['heads']} heads / page {r['page_size']}" for r in reached}))
                    evidence.append(
                        {
                            "kind": "replay",
                            "where": reached[0]["kernel"],
                            "text": f"the release's checks accept it ({conditions}); the kernel was not run here",
                        }
                    )
                    for r in rep_q:
                        if r["outcome"] == "refused":
                            evidence.append(
                                {
                                    "kind": "replay",
                                    "where": r.get("where", ""),
                                    "text": f"{r['heads']} heads, page {r['page_size']}: "
                                    f"{r.get('exc_type')}: {r.get('message', '')}",
                                }
                            )
                else:
                    status = "refused"
                    seen = set()
                    for r in rep:
                        key = (r.get("where"), r.get("message"))
                        if key in seen:
                            continue
                        seen.add(key)
                        evidence.append(
                            {
                                "kind": "replay",
                                "where": r.get("where", ""),
                                "text": f"{r['heads']} heads, page {r['page_size']}, Q {r['q_dtype']}: "
                                f"{r.get('exc_type', r['outcome'])}: {r.get('message', '')}",
                            }
                        )
            cells.append(
                {
                    "door": door.key,
                    "label": door.label,
                    "family": fam,
                    "status": status,
                    "conditions": conditions,
                    "evidence": evidence,
                    "citations": [{"where": c["where"], "claim": c["claim"], "text": c["text"]} for c in cites],
                }
            )
    return cells

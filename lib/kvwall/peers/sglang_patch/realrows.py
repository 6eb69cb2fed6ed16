"""The rows of ``sglang_patch_check``'s check inside SGLang's real modules (:mod:`.realcheck` drives the backend)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvwall.peers.sglang_patch.realcheck import RealCheck
from kvwall.peers.sglang_patch.verdicts import cast_problems, casts_per_step, compare, guarded

__all__ = ["real_rows", "VARIANTS", "MINIMAL"]


VARIANTS = ("unpatched", "gather_cast", "fused")
#: What the driver builds as minimal objects instead of SGLang's (the fields the backend reads), said in the rows.
MINIMAL = (
    "ModelRunner: SimpleNamespace(model_config, device, req_to_token_pool, token_to_kv_pool, "
    "kv_index_translator, page_size, dtype)",
    "ModelConfig: SimpleNamespace(context_len, num_attention_heads, kv_lora_rank, qk_nope_head_dim, "
    "qk_rope_head_dim, v_head_dim, scaling)",
    "ForwardBatch: SimpleNamespace(forward_mode, batch_size, seq_lens, seq_lens_cpu, seq_lens_sum, "
    "req_pool_indices, positions, spec_info, kv_loc_plan=None, attn_dcp_metadata=None, ...)",
    "RadixAttention layer: SimpleNamespace(layer_id, tp_q_head_num, head_dim, v_head_dim, scaling, logit_cap)",
    "KV writes: none (save_kv_cache=False); the pool is filled with seeded FP8 values before the steps",
)


def _expect(variant: str, cmp: dict[str, Any], casts: list[str]) -> list[str]:
    """A row's problems: ``casts`` (:func:`~kvwall.peers.sglang_patch.verdicts.cast_problems`'s), then its output's."""
    problems = list(casts)
    if not cmp.get("finite", False):
        problems.append("non-finite output")
    if not cmp.get("within_tol_vs_f64", False):
        problems.append("not within BF16 tolerance of float64")
    if variant != "unpatched" and not cmp.get("within_tol_vs_unpatched", False):
        problems.append("not within BF16 tolerance of the unpatched output")
    return problems


def real_rows(
    device: torch.device,
    *,
    pool_slots: int,
    layers: int,
    context_len: int,
    graph_bs: int,
    draft_tokens: int | list[int],
    eager_lens: list[int],
    replays: list[list[int]],
    timing_lens: list[int],
    timing_iters: int,
    seed: int = 0,
    source: str | None = None,
    prefill_extend: list[int] | None = None,
    log: Callable[[str], None] = print,
) -> list[dict[str, Any]]:
    """The rows of the check inside SGLang's real modules (module docstring): ``real_meta`` (what was imported,
    stand-ins, variants), ``real_check`` per (mode, phase, variant), ``real_timing`` per variant. Every stage that
    fails says so in its row (``error``) and the others run on. ``source``: the SGLang source folder (default
    ``$KVWALL_SGLANG_SOURCE``); without one, a single ``real_meta`` row saying it was not run.

    Modes: ``decode`` and ``verify`` (each of ``draft_tokens``: target-verify with that many draft tokens a request)
    eager and captured; ``draft_extend`` (SGLang's DRAFT_EXTEND_V2, the first of ``draft_tokens`` tokens a request,
    uniform) and, with ``prefill_extend``, ``prefill`` (EXTEND with a cached prefix of ``eager_lens`` tokens and
    ``prefill_extend`` new ones: not uniform, so every patch gathers the referenced rows per call) eager only, as
    SGLang 0.5.23 runs them with this backend (its draft-extend graph runner does not take ``flashinfer_mla``).
    ``real_memory``: per variant, the bytes measured on a GPU (``torch.cuda.memory_allocated``) around the backend's
    construction + ``init_cuda_graph_state`` and around each capture."""
    import os  # pylint: disable=import-outside-toplevel

    from kvwall.peers.sglang_patch.real import import_sglang  # pylint: disable=import-outside-toplevel

    source = source or os.environ.get("KVWALL_SGLANG_SOURCE")
    meta: dict[str, Any] = {
        "section": "real_meta",
        "sglang_source": source,
        "ran": False,
        "error": None,
        "sglang_files": 0,
        "files_checked_against_record": 0,
        "files_mismatched": [],
        "standins": {},
        "guarded_missing": {},
        "standin_calls": [],
        "variants": {},
        "minimal_objects": list(MINIMAL),
        "import_s": None,
        "device": str(device),
        "cuda_graphs": torch.device(device).type == "cuda",
    }
    rows: list[dict[str, Any]] = [meta]
    if not source or not os.path.isdir(os.path.join(source, "sglang")):
        meta["error"] = f"no SGLang source folder (KVWALL_SGLANG_SOURCE={source!r}): not run"
        return rows
    imp, err = guarded(log, "import sglang", lambda: import_sglang(source))
    if imp is None:
        meta["error"] = err
        return rows
    finder = imp["finder"]
    meta.update(
        sglang_files=imp["sglang_files"],
        files_checked_against_record=imp["files_checked_against_record"],
        files_mismatched=imp["files_mismatched"][:20],
        standins=dict(finder.standins),
        guarded_missing=dict(finder.guarded_missing),
        import_s=round(imp["import_s"], 2),
    )
    log(
        f"== sglang imported: {imp['sglang_files']} files ({imp['files_checked_against_record']} checked against "
        f"RECORD, {len(imp['files_mismatched'])} differ), stand-ins {finder.standins}"
    )
    rc, err = guarded(
        log,
        "pool + pools",
        lambda: RealCheck(
            imp,
            device=device,
            pool_slots=pool_slots,
            layers=layers,
            context_len=context_len,
            max_bs=graph_bs,
            seed=seed,
            log=log,
        ),
    )
    if rc is None:
        meta["error"] = err
        return rows
    meta["ran"] = True
    for v in VARIANTS:
        _, err = guarded(log, f"load {v}", lambda v=v: rc.module(v))
        meta["variants"][v] = {k: x for k, x in rc.variant_info.get(v, {}).items() if k != "path"} or {"error": err}

    def check(
        mode: str,
        phase: str,
        v: str,
        lens: list[int],
        res: dict[str, Any] | None,
        err: str | None,
        base: list[torch.Tensor] | None,
        ref: list[torch.Tensor] | None,
        cap: dict[str, Any] | None = None,
    ):
        """One row; ``cap``: the capture a graph row replayed (None: an eager row)."""
        graph = cap is not None and cap.get("graph") is not None
        row = {
            "section": "real_check",
            "mode": mode,
            "phase": phase,
            "variant": v,
            "batch": len(lens),
            "lens": list(lens),
            "tokens": int(sum(lens)),
            "draft_tokens": ndt_of.get(mode, 0),
            "layers": layers,
            "pool_slots": pool_slots,
            "whole_pool_casts": None,
            "warmup_casts": cap["warmup_casts"] if cap else None,
            "capture_casts": cap["capture_casts"] if cap else None,
            "replay_casts": None,
            "cuda_graph": graph if cap else None,
            "error": err,
            "ok": False,
            "problems": [],
        }
        if res is not None and ref is not None:
            cmp, cerr = guarded(log, f"compare {mode}/{phase}/{v}", lambda: compare(res["outputs"], base, ref))
            row.update(cmp or {})
            if cap is None:
                counts = {"eager": res["casts"]}
            else:
                row["replay_casts"] = res["casts"]
                counts = {"warmup": cap["warmup_casts"], "captured": cap["capture_casts"], "replay": res["casts"]}
            row["whole_pool_casts"] = casts_per_step(**{k: n for k, n in counts.items() if k != "warmup"})
            row["problems"] = _expect(v, cmp or {}, cast_problems(v, layers, graph=graph, **counts)) + (
                [cerr] if cerr else []
            )
            row["ok"] = not row["problems"]
        else:
            row["problems"] = [err or "not run"]
        log(
            f"-- {mode}/{phase}/{v}: casts/step={row['whole_pool_casts']} (warm-up {row['warmup_casts']}, captured "
            f"{row['capture_casts']}, replay {row['replay_casts']}) ok={row['ok']} {row['problems']} "
            f"f64={row.get('rel_err_vs_f64')} unp={row.get('max_abs_diff_vs_unpatched')}"
        )
        rows.append(row)

    drafts = [draft_tokens] if isinstance(draft_tokens, int) else list(draft_tokens)
    ndt_of: dict[str, int] = {"draft_extend": drafts[0]}
    modes: list[tuple[str, int, bool]] = [("decode", 0, True)] + [(_verify(n, drafts), n, True) for n in drafts]
    modes.append(("draft_extend", drafts[0], False))
    if prefill_extend:
        modes.append(("prefill", 0, False))
    for mode, ndt, graphs in modes:
        ndt_of[mode] = ndt
        # eager
        extend = list(prefill_extend) if mode == "prefill" else None
        rc.fill_requests(eager_lens, extra=ndt) if extend is None else _fill(rc, eager_lens, extend)
        qs = rc.queries(len(eager_lens) * max(ndt, 1) if extend is None else sum(extend))
        ref, err = guarded(log, f"reference {mode}/eager", lambda: rc.reference(eager_lens, qs, ndt, extend))
        base = None
        kind = mode if mode in ("draft_extend", "prefill") else None
        for v in VARIANTS:
            res, err = guarded(
                log, f"{mode}/eager/{v}", lambda v=v: rc.eager(v, eager_lens, qs, ndt, mode=kind, extend=extend)
            )
            if v == "unpatched" and res is not None:
                base = res["outputs"]
            check(mode, "eager", v, eager_lens, res, err, None if v == "unpatched" else base, ref)
        if not graphs:
            continue
        # graphs: capture once per variant, replays with growing requests
        caps = {}
        for v in VARIANTS:
            caps[v], err = guarded(log, f"{mode}/capture/{v}", lambda v=v: rc.capture(v, graph_bs, ndt))
            if caps[v] is None:
                check(mode, "capture", v, [1] * graph_bs, None, err, None, None)
        for k, lens in enumerate(replays):
            rc.fill_requests(lens, extra=ndt)
            qs = rc.queries(len(lens) * max(ndt, 1))
            ref, err = guarded(log, f"reference {mode}/replay {k}", lambda: rc.reference(lens, qs, ndt))
            base = None
            for v in VARIANTS:
                if caps.get(v) is None:
                    continue
                res, err = guarded(log, f"{mode}/replay {k}/{v}", lambda v=v: rc.replay(caps[v], lens, qs))
                if v == "unpatched" and res is not None:
                    base = res["outputs"]
                check(mode, f"replay {k + 1}", v, lens, res, err, None if v == "unpatched" else base, ref, cap=caps[v])
        if mode == "decode":
            rc.fill_requests(timing_lens)
            qs = rc.queries(len(timing_lens))
            base_ms = None
            for v in VARIANTS:
                if caps.get(v) is None:
                    continue
                t, err = guarded(log, f"timing {v}", lambda v=v: rc.time_graph(caps[v], timing_lens, qs, timing_iters))
                row = {
                    "section": "real_timing",
                    "variant": v,
                    "batch": len(timing_lens),
                    "lens": list(timing_lens),
                    "layers": layers,
                    "pool_slots": pool_slots,
                    "ms_per_step": None,
                    "ms_min": None,
                    "ms_max": None,
                    "iters": 0,
                    "speedup_vs_unpatched": None,
                    "error": err,
                    "us_per_layer": None,
                    "kernel_us_per_layer": None,
                    "kernel_path": None,
                }
                row.update(t or {})
                if v == "unpatched":
                    base_ms = row["ms_per_step"]
                elif base_ms and row["ms_per_step"]:
                    row["speedup_vs_unpatched"] = base_ms / row["ms_per_step"]
                log(f"-- timing {v}: {row['ms_per_step']} ms/step ({layers} layers) x{row['speedup_vs_unpatched']}")
                rows.append(row)
        for cap in caps.values():  # free the graphs (and their memory) before the next mode
            if cap is not None:
                cap["graph"] = None
        caps.clear()
        if rc.cuda:
            torch.cuda.empty_cache()
    meta["standin_calls"] = sorted(set(finder.calls))[:50]
    for v in VARIANTS:
        mem = getattr(rc, "memory", {}).get(v, {})
        cap = mem.get("capture_bytes") or {}
        setup = mem.get("setup_bytes")
        rows.append(
            {
                "section": "real_memory",
                "variant": v,
                "measured": setup is not None,
                "setup_bytes": setup,
                "capture_bytes": dict(cap),
                "compact_rows_reserved": mem.get("compact_rows_reserved"),
                "total_bytes": None if setup is None else setup + sum(cap.values()),
                "graph_bs": graph_bs,
                "context_len": context_len,
                "pool_slots": pool_slots,
                "layers": layers,
            }
        )
    return rows


def _verify(n: int, drafts: list[int]) -> str:
    """The mode name of target-verify with ``n`` draft tokens: ``verify`` when only one count is checked (the rows
    recorded before several were), else ``verify_<n>``."""
    return "verify" if len(drafts) == 1 else f"verify_{n}"


def _fill(rc: RealCheck, prefix: list[int], extend: list[int]) -> None:
    """Request rows for a prefill with a cached prefix: ``prefix[b] + extend[b]`` slots a request."""
    total = [p + e for p, e in zip(prefix, extend)]
    rc.fill_requests(total)

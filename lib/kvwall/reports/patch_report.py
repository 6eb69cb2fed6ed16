"""Chapter 6's SGLang patch section: what ``sglang_patch_check`` ran and found, every figure from its rows.

Two checks share the result. ``checks`` (+ ``meta``): the backend's source executed with stand-ins for its sglang
imports, eagerly, on SGLang-shaped inputs (:func:`patch_check_table`, :func:`patch_run_text`). ``real_*``: inside
SGLang 0.5.23's real modules, decode and target-verify, eager and CUDA-graph capture/replay, timed in a graph
(:func:`real_run_text`, :func:`real_check_table`, :func:`real_timing_table`, :func:`real_not_run_text`). A row that
failed shows as failing, with its problems in words; a result without the real rows says so."""

from __future__ import annotations

from typing import Any

from kvwall.model.geometry import GLM5
from kvwall.peers.sglang_source import SGLangSourceUnavailable, sglang_source
from kvwall.reports.tables import Table, number, scientific, times
from kvwall.results import Result

__all__ = ["real_memory_text", "patch_check_table", "patch_meta", "patch_run_text", "real_meta", "real_check_rows", "real_timing_rows",
           "real_check_table", "real_timing_table", "real_run_text", "real_not_run_text", "FORWARD_MODES",
           "real_memory_rows", "real_memory_table"]

#: The forward modes whose whole-pool casts the diffs remove (UPSTREAM.md), by the real check's ``mode`` name.
FORWARD_MODES = {"decode": "decode", "verify": "target-verify", "draft_extend": "draft-extend",
                 "prefill": "paged prefill with a cached prefix"}
VARIANTS = ("unpatched", "gather_cast", "fused")


def _rows(result: Result, section: str) -> list[dict[str, Any]]:
    return [r for r in result.rows if r.get("section") == section]


def _verdict(r: dict[str, Any]) -> str:
    return "yes" if r.get("ok") else "**no**: " + "; ".join(r.get("problems") or ["not run"])


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return scientific(lo) if scientific(lo) == scientific(hi) else f"{scientific(lo)}–{scientific(hi)}"


# ---------------------------------------------------------------------------------------------------------
# The check with stand-ins for SGLang's imports (``checks``)
# ---------------------------------------------------------------------------------------------------------

def patch_check_table(result: Result, caption: str) -> Table:
    """``checks``: per case and variant, the backend's own decode code run unpatched and patched (stand-ins for its
    sglang imports): how many whole-pool casts it made, how far its output is from the unpatched one's, its error
    against float64."""
    rows = [{**r, "what": f"{r['case']}: {r['batch']} req., {r['tokens']:,} tok.",
             "vs_unpatched": "—" if r["variant"] == "unpatched" else "bit-identical"
             if r.get("bit_identical_vs_unpatched") else scientific(r.get("max_abs_diff_vs_unpatched")),
             "verdict": _verdict(r)}
            for r in _rows(result, "checks")]
    return Table(rows, {"case": "what", "variant": "variant", "whole-pool casts": "whole_pool_casts",
                        "vs unpatched (max abs.)": "vs_unpatched", "error vs float64": ("rel_err_vs_f64", scientific),
                        "ok": "verdict"}, caption)


def patch_meta(result: Result) -> dict[str, Any]:
    return _rows(result, "meta")[0]


def patch_run_text(result: Result) -> str:
    """What the ``checks`` rows ran and found: cases, layers, per variant its whole-pool casts and worst errors vs
    unpatched and float64, and how many rows passed."""
    checks = _rows(result, "checks")
    if not checks:
        return "**With stand-ins for SGLang's imports:** not part of this run."
    by: dict[str, list[dict[str, Any]]] = {}
    for r in checks:
        by.setdefault(r["variant"], []).append(r)
    parts = []
    for v, rs in by.items():
        casts = sorted({r["whole_pool_casts"] for r in rs})
        unp = ("the baseline" if v == "unpatched" else "bit-identical to unpatched"
               if all(r.get("bit_identical_vs_unpatched") for r in rs) else
               f"at most {scientific(max(r['max_abs_diff_vs_unpatched'] for r in rs))} from unpatched (max abs.)")
        parts.append(f"`{v}` {'/'.join(map(str, casts))} whole-pool casts per step, {unp}, relative error vs float64 "
                     f"at most {scientific(max(r['rel_err_vs_f64'] for r in rs))}")
    ok = sum(bool(r.get("ok")) for r in checks)
    layers = sorted({r["layers"] for r in checks})
    return (f"**With stand-ins for SGLang's imports** (the backend's source executed as a module of its own, "
            f"eagerly, {len({r['case'] for r in checks})} cases, {'/'.join(map(str, layers))} layers, on "
            f"{result.provenance.gpu or 'a CPU'}): {ok} of {len(checks)} rows passed; " + "; ".join(parts) + ".")


# ---------------------------------------------------------------------------------------------------------
# The check inside SGLang's real modules (``real_meta``, ``real_check``, ``real_timing``)
# ---------------------------------------------------------------------------------------------------------

def real_meta(result: Result) -> dict[str, Any] | None:
    rows = _rows(result, "real_meta")
    return rows[0] if rows else None


def real_check_rows(result: Result) -> list[dict[str, Any]]:
    return _rows(result, "real_check")


def real_timing_rows(result: Result) -> list[dict[str, Any]]:
    return _rows(result, "real_timing")


def _mode(r: dict[str, Any]) -> str:
    return FORWARD_MODES.get(r["mode"], r["mode"])


def _graph(r: dict[str, Any]) -> bool:
    return str(r.get("phase", "")).startswith(("replay", "capture"))


def real_check_table(result: Result, caption: str) -> Table:
    """``real_check``, one row per (mode, phase) with the variants side by side, in the rows' order: whole-pool casts
    per step (a graph's: the casts it holds, replayed every step, plus those at replay), errors vs float64, each
    patch's difference from unpatched, and whether every variant's row passed (the problems of any that did not).
    ``verify``: target-verify; ``replay k``: of a CUDA graph."""
    groups: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in real_check_rows(result):
        groups.setdefault((r["mode"], str(r["phase"])), {})[r["variant"]] = r
    variants = list(dict.fromkeys(r["variant"] for r in real_check_rows(result)))
    patches = [v for v in variants if v != "unpatched"]

    def each(by: dict[str, dict[str, Any]], names: list[str], cell) -> str:
        return " / ".join(cell(by[v]) if v in by else "—" for v in names)

    rows = []
    for (mode, phase), by in groups.items():
        first = next(iter(by.values()))
        failed = [f"{v}: " + "; ".join(r.get("problems") or ["not run"]) for v, r in by.items() if not r.get("ok")]
        rows.append({"mode_text": "verify" if mode == "verify" else _mode(first),
                     "phase_text": phase.replace(" ", "\u00a0"),  # "replay 1" on one line
                     "tokens": first.get("tokens"),
                     "casts": each(by, variants, lambda r: str(r.get("whole_pool_casts"))),
                     "errors": each(by, variants, lambda r: scientific(r.get("rel_err_vs_f64"))),
                     "vs_unpatched": each(by, patches, lambda r: "bit-identical" if r.get("bit_identical_vs_unpatched")
                                          else scientific(r.get("max_abs_diff_vs_unpatched"))),
                     "verdict": "yes" if not failed else "**no**: " + "; ".join(failed)})
    order, patched = " / ".join(variants), " / ".join(patches)
    return Table(rows, {"mode": "mode_text", "phase": "phase_text", "tokens": ("tokens", number(0)),
                        f"casts a step ({order})": "casts", f"error vs float64 ({order})": "errors",
                        f"vs unpatched, max abs. ({patched})": "vs_unpatched", "all ok": "verdict"}, caption)


def real_timing_table(result: Result, caption: str) -> Table:
    """``real_timing``: each variant's decode step (every layer) replayed in a CUDA graph: median, min–max, speed-up
    over unpatched; for the fused patch, its µs a layer beside ours alone on the same plan and inputs, in a graph."""
    rows = [{**r, "span": "—" if r.get("ms_min") is None else f"{r['ms_min']:.3f}–{r['ms_max']:.3f}",
             "what": f"{r['batch']} × {r['lens'][0]:,}" if len(set(r["lens"])) == 1 else
             f"{r['batch']} req., {sum(r['lens']):,} tok.",
             "err": r.get("error") or ""}
            for r in real_timing_rows(result)]
    cols: dict[str, Any] = {"variant": "variant", "batch × tokens": "what", "layers": "layers",
                            "ms per step (median)": ("ms_per_step", number(3)), "min–max": "span",
                            "speed-up: unpatched ms / this ms": ("speedup_vs_unpatched", times(1))}
    if any(r.get("kernel_us_per_layer") for r in rows):  # ours inside SGLang's backend against ours alone
        cols |= {"µs a layer": ("us_per_layer", number(1)),
                 "ours alone, µs a layer": ("kernel_us_per_layer", number(1)), "ours' path": "kernel_path"}
    if any(r["err"] for r in rows):
        cols["error"] = "err"
    return Table(rows, cols, caption)


def _identical(info: dict[str, Any]) -> bool:
    """The unpatched module was the pinned wheel's file (``identical_to_orig``: rows recorded while a copy of it was
    shipped)."""
    return bool(info.get("identical_to_wheel", info.get("identical_to_orig")))


def real_memory_rows(result: Result) -> list[dict[str, Any]]:
    """``real_memory``: per variant, the bytes its backend holds per GPU, measured (empty for results recorded before
    they were, or off a GPU: ``measured`` False)."""
    return [r for r in _rows(result, "real_memory") if r.get("measured")]


def real_memory_table(result: Result, caption: str) -> Table:
    """What each variant reserves per GPU, measured with ``torch.cuda.memory_allocated``: at set-up (construction +
    ``init_cuda_graph_state``) and at each capture (metadata buffers, the graph's pool), in MB (10^6 bytes)."""
    mb = 1e6
    rows = [{**r, "setup_mb": r["setup_bytes"] / mb,
             "capture": ", ".join(f"{k} {v / mb:,.1f}" for k, v in r["capture_bytes"].items()) or "—",
             "total_mb": r["total_bytes"] / mb, "compact": f"{r['compact_rows_reserved']:,}"
             if r.get("compact_rows_reserved") else "none"}
            for r in real_memory_rows(result)]
    return Table(rows, {"variant": "variant", "set-up MB": ("setup_mb", number(1)), "captures, MB": "capture",
                        "total MB": ("total_mb", number(1)), "compact BF16 rows reserved": "compact"}, caption)


def sglang_pins(names: tuple[str, ...] = ("torch", "flashinfer_python")) -> dict[str, str]:
    """The versions SGLang 0.5.23 pins for ``names``, read from its wheel's ``METADATA`` (``Requires-Dist: torch==...``);
    empty where the wheel cannot be had (offline, empty cache)."""
    try:
        root = sglang_source()
    except SGLangSourceUnavailable:
        return {}
    meta = next(root.glob("sglang-*.dist-info/METADATA"), None)
    if meta is None:
        return {}
    pins = {}
    for line in meta.read_text().splitlines():
        name, _, pin = line.removeprefix("Requires-Dist: ").partition("==")
        name = name.split("[")[0].strip()
        if line.startswith("Requires-Dist: ") and name in names and pin:
            pins[name] = pin.split(";")[0].strip()
    return pins


def real_memory_text(result: Result) -> str:
    """What each patch reserves beyond the unpatched backend, from the measured ``real_memory`` rows, and at what
    configuration (empty where they were not measured)."""
    rows = {r["variant"]: r for r in real_memory_rows(result)}
    base = rows.get("unpatched")
    if not base:
        return ""
    mb = 1e6
    parts = [f"`{v}` {(r['total_bytes'] - base['total_bytes']) / mb:+,.1f} MB"
             + (f" ({r['compact_rows_reserved']:,} compact BF16 rows)" if r.get("compact_rows_reserved") else "")
             for v, r in rows.items() if v != "unpatched"]
    return (f"Measured inside SGLang's modules (`torch.cuda.memory_allocated` around the backend's set-up and its "
            f"CUDA-graph captures; {base['layers']} layers, a pool of {base['pool_slots']:,} slots, graphs of batch "
            f"{base['graph_bs']} at a {base['context_len']:,}-token context limit), each patch holds beyond the "
            f"unpatched backend's {base['total_bytes'] / mb:,.1f} MB: " + ", ".join(parts) + ".")


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _minimal(entry: str) -> str:
    """``"ModelRunner: SimpleNamespace(a, b)"`` as ``"`ModelRunner` (`a, b`)"``; "" for an entry of another form."""
    name, _, what = entry.partition(": ")
    if what.startswith("SimpleNamespace(") and what.endswith(")"):
        return f"{name if ' ' in name else f'`{name}`'} (`{what[len('SimpleNamespace('):-1]}`)"
    return ""


def real_run_text(result: Result) -> str:
    """What ran inside SGLang's real modules and what it found, from the rows: the modules imported (checked
    against the wheel's RECORD), each stand-in, what the minimal objects stood for, the variants, modes and phases
    driven, the casts, the errors, and the in-graph timing. A run that did not complete says where it stopped."""
    m = real_meta(result)
    if m is None:
        return "**Inside SGLang's real modules:** not part of this run."
    if not m.get("ran"):
        err = str(m.get("error") or "no error recorded").replace("`", "'")
        return f"**Inside SGLang's real modules:** the run did not complete: `{err}`."
    rows = real_check_rows(result)
    where = result.provenance.gpu or "a CPU"
    bullets = []
    mism = m.get("files_mismatched") or []
    bullets.append(
        f"**SGLang's own code.** {m['sglang_files']} files of sglang 0.5.23 imported from the wheel's files, "
        f"{m['files_checked_against_record']} of them checked against the sha256 the wheel's `RECORD` lists: "
        + (f"{len(mism)} differ ({', '.join(f'`{f}`' for f in mism)})" if mism else "none differs")
        + ". The unpatched backend is SGLang's `flashinfer_mla_backend` module itself"
        + (" (byte-identical to the pinned wheel's file the diffs are made against)"
           if _identical(m["variants"].get("unpatched", {})) else "")
        + "; each patch was applied to that file with `git apply --check` and `git apply` ("
        + ", ".join(f"`{v}`: exit codes {i.get('check_rc')} and {i.get('apply_rc')}" for v, i in m["variants"].items()
                    if v != "unpatched") + ") and imported as a module of its own.")
    pins = sglang_pins()
    prov = result.provenance
    bullets.append(f"**Versions.** This run: torch {prov.torch}, FlashInfer {prov.flashinfer}, Triton {prov.triton}. "
                   + (f"SGLang 0.5.23 pins torch=={pins['torch']} and flashinfer-python=={pins['flashinfer_python']} "
                      "(its wheel's METADATA): the check ran SGLang's Python modules on other versions of both, and "
                      "FlashInfer's kernels for the unpatched path are those of this run's FlashInfer."
                      if {"torch", "flashinfer_python"} <= set(pins) else
                      "SGLang 0.5.23's pins were not read here (its wheel could not be had)."))
    standins = m.get("standins") or {}
    calls = m.get("standin_calls") or []
    text = ("**Stand-ins** only for the modules that cannot import on that machine, where SGLang imports them "
            "outside a `try`: " + (_join([f"`{k}` (imported by `{v.rsplit('/', 1)[-1]}`)"
                                          for k, v in standins.items()])
                                   if standins else "none") + "; ")
    text += (f"{len(calls)} calls reached a stand-in during the steps ({', '.join(f'`{c}`' for c in calls)})."
             if calls else "no call reached one during the steps.")
    missing = m.get("guarded_missing") or {}
    if missing:
        text += (f" {len(missing)} other missing modules SGLang imports inside a `try` took SGLang's own fallback: "
                 + _join([f"`{k}`" for k in missing]) + ".")
    bullets.append(text)
    objects = [e for e in m.get("minimal_objects") or [] if _minimal(e)]
    others = [e for e in m.get("minimal_objects") or [] if not _minimal(e)]
    if objects or others:
        bullets.append(("**Minimal objects** (`SimpleNamespace`, with only the fields the backend reads) stood for "
                        + "; ".join(_minimal(e) for e in objects) + "." if objects else "")
                       + "".join(f" {e.partition(': ')[0]}: {e.partition(': ')[2]}." for e in others))
    if rows:
        modes = list(dict.fromkeys("verify" if r["mode"].startswith("verify") else r["mode"] for r in rows))
        drafts = sorted({r["draft_tokens"] for r in rows if r["mode"].startswith("verify") and r.get("draft_tokens")})
        replays = [r for r in rows if r["variant"] == rows[0]["variant"] and r["mode"] == modes[0]
                   and str(r["phase"]).startswith("replay")]
        eager = next((r for r in rows if r["phase"] == "eager"), None)
        said = {"decode": "decode (`forward_decode`)",
                "verify": "target-verify (`forward_extend` with SGLang's `EagleVerifyInput`, "
                          f"{'/'.join(map(str, drafts))} draft tokens per request)",
                "draft_extend": "draft-extend (`forward_extend`, eagerly: SGLang 0.5.23 captures no draft-extend "
                                "graph for this backend)",
                "prefill": "paged prefill with a cached prefix (`forward_extend`, eagerly)"}
        graph = ("as SGLang's CUDA-graph runner does it: `init_cuda_graph_state`, the capture-time metadata, a "
                 "warm-up forward, the capture of every layer's forward in one CUDA graph, then "
                 f"{len(replays)} replays, each after `init_forward_metadata_out_graph` with longer requests ("
                 + ", ".join(f"{r['tokens']:,}" for r in replays) + " tokens)")
        if not m.get("cuda_graphs"):
            graph += "; without a GPU the graph phases ran their metadata calls and the forward without capture"
        phases = ([f"eager (`init_forward_metadata`, {eager['tokens']:,} tokens)"] if eager else []) + [graph]
        bullets.append(
            f"**Driven** on {where}: " + _join([said.get(x, x) for x in modes])
            + f", {rows[0]['layers']} layers over one real `MLATokenToKVPool` of {rows[0]['pool_slots']:,} FP8 slots "
            f"(with SGLang's `ReqToTokenPool` and `KVIndexTranslator`), batch {rows[0]['batch']}: "
            + ", and ".join(phases)
            + ". Each variant on the same inputs, compared with the unpatched backend and with float64 attention "
            "over the dequantized pool; whole-pool casts counted in torch's dispatcher (a graph's: what its capture "
            "recorded, replayed every step).")
        bullets.append(_findings(rows))
    timing = real_timing_rows(result)
    if timing:
        bullets.append(_timing_text(timing))
    return "\n".join(f"- {b}" for b in bullets)


def _findings(rows: list[dict[str, Any]]) -> str:
    ok = sum(bool(r.get("ok")) for r in rows)
    by = {v: [r for r in rows if r["variant"] == v] for v in dict.fromkeys(r["variant"] for r in rows)}
    patched = [r for r in rows if r["variant"] != "unpatched"]
    casts = [r["whole_pool_casts"] for r in patched]
    parts = [f"**Found:** {ok} of {len(rows)} rows passed."]
    if patched:
        if all(c == 0 for c in casts):
            parts.append(f"Every patched row: 0 whole-pool casts a step ({len(patched)} rows).")
        else:
            bad = [r for r in patched if r["whole_pool_casts"] != 0]
            parts.append(f"{len(bad)} patched rows cast the whole pool: "
                         + "; ".join(f"{r['mode']}/{r['phase']}/{r['variant']} {r['whole_pool_casts']}" for r in bad)
                         + ".")
    unp = by.get("unpatched", [])
    if unp:
        n = sorted({r["whole_pool_casts"] for r in unp if r["whole_pool_casts"] is not None})
        parts.append(f"Unpatched: {'/'.join(map(str, n))} a step ({unp[0]['layers']} layers).")
    for v, rs in by.items():
        done = [r for r in rs if r.get("rel_err_vs_f64") is not None]
        per_mode = []
        for mode in dict.fromkeys(r["mode"] for r in done):
            mr = [r for r in done if r["mode"] == mode]
            text = f"{FORWARD_MODES.get(mode, mode)} {_span([r['rel_err_vs_f64'] for r in mr])}"
            if v != "unpatched":
                if all(r.get("bit_identical_vs_unpatched") for r in mr):
                    text += ", bit-identical to unpatched"
                else:
                    within = all(r.get("within_tol_vs_unpatched") for r in mr)
                    text += (", " + ("within BF16 tolerance of unpatched" if within else
                                     "**not** within BF16 tolerance of unpatched on every row")
                             + f" (max abs. {scientific(max(r['max_abs_diff_vs_unpatched'] for r in mr))})")
            per_mode.append(text)
        if per_mode:
            note = ""
            if v == "fused" and any(r["mode"] == "verify" for r in done) and all(
                    r.get("bit_identical_vs_unpatched") for r in done if r["mode"] == "verify"):
                note = " (with several query tokens a request, `fused.diff` takes the compact rows and FlashInfer)"
            parts.append(f"`{v}`, relative error vs float64: " + "; ".join(per_mode) + note + ".")
    failed = [r for r in rows if not r.get("ok")]
    if failed:
        groups: dict[str, list[str]] = {}
        for r in failed:
            groups.setdefault("; ".join(r.get("problems") or ["not run"]), []).append(
                f"{r['mode']}/{r['phase']}/{r['variant']}")
        parts.append("**Failed:** " + " ".join(f"{', '.join(w)}: {p}." for p, w in groups.items()))
    return " ".join(parts)


def _timing_text(timing: list[dict[str, Any]]) -> str:
    t0 = timing[0]
    by = {r["variant"]: r for r in timing}
    base = by.get("unpatched")
    lens = t0["lens"]
    shape = (f"{t0['batch']} requests of {lens[0]:,} tokens" if len(set(lens)) == 1
             else f"{t0['batch']} requests, {sum(lens):,} tokens")
    parts = []
    for v, r in by.items():
        if r.get("ms_per_step") is None:
            parts.append(f"`{v}` not timed" + (f" ({r['error']})" if r.get("error") else ""))
            continue
        s = f"`{v}` {r['ms_per_step']:.3f} ms"
        if r is not base and r.get("speedup_vs_unpatched"):
            s += f" ({r['speedup_vs_unpatched']:.1f}× faster)"
        parts.append(s)
    iters = max(r.get("iters") or 0 for r in timing)
    return (f"**Timed** inside a CUDA graph: the decode step of every layer ({t0['layers']}), {shape}, median of "
            f"{iters} replays: " + ", ".join(parts) + "."
            + ("" if base is None or base.get("ms_per_step") is None else
               " This is the attention backend's share of a step, in SGLang's own code; the rest of the model did "
               "not run."))


def real_not_run_text(result: Result) -> str:
    """What the check inside SGLang's real modules did not run, from its rows: no server (the minimal objects stood
    for SGLang's runner and batch), no weights, how many layers of GLM-5's, which of the modes the diffs change were
    not driven."""
    m = real_meta(result)
    rows = real_check_rows(result)
    if m is None or not m.get("ran") or not rows:
        return ("**Not run:** SGLang's real modules (see above), a server, model weights; what ran is the check with "
                "stand-ins below.")
    layers = sorted({r["layers"] for r in rows})
    modes = {r["mode"].split("_")[0] if r["mode"].startswith("verify_") else r["mode"] for r in rows}
    left = [w for k, w in FORWARD_MODES.items() if k not in modes]
    writes = next((e.partition(": ")[2] for e in m.get("minimal_objects") or [] if e.startswith("KV writes")), "")
    return ("**Not run:** no SGLang server, scheduler or `ModelRunner` (the minimal objects above stood for them); no "
            "model weights and no layer but attention (random queries over a pool of seeded random FP8 values"
            + (", no KV writes" if writes.startswith("none") else "")
            + f"); {'/'.join(map(str, layers))} layers, not GLM-5's {GLM5.num_layers}; one GPU, no tensor or "
            "decode-context parallelism (so no DCP buffer)"
            + (f"; of the forward modes whose casts the diffs remove, {_join(left)} were not driven here (the test "
               "suite checks their casts are gone from the patched source)" if left else "") + ".")

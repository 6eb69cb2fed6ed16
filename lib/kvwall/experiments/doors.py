"""Chapter 3's experiments: FlashInfer's other MLA doors, asked for GLM-5's shape with an FP8 KV cache.

* ``doors_checks`` (any machine): the release's own source lines that decide each path (file:line),
  a replay of every path's Python checks as on SM90 / SM100 / SM120 (see :mod:`kvwall.peers.flashinfer.doors`),
  the kernel generators' answers for GLM-5's head counts, and, where nvcc is present (full scale),
  nvcc builds of the SM120 kernels for ``sm_120a``.
* ``doors_sm90`` (a CUDA GPU): every path called for real, 16 and 64 heads, page size 1 and the
  path's own; each call's answer recorded as the library gives it (exception type and message), or,
  when it runs, its output checked against the float64 torch reference and timed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from kvwall.kernels import mla_decode_reference

from kvwall.peers.flashinfer import doors as backends
from kvwall.peers.flashinfer.doors import DOORS, DoorCase, call_door, cite_all, glm5_cases, make_inputs, outcome_of, replay_cases
from kvwall.results import Result, collect_provenance
from kvwall.measure.timing import bench_ms
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_doors_checks", "run_doors_sm90", "build_generated_module", "GENERATOR_BUILDS"]

SOURCES = ("lib/kvwall/peers/flashinfer/doors.py", "lib/kvwall/experiments/doors.py", "kernels/mla_decode/reference.py")

#: nvcc builds: name -> (python expression giving the JitSpec, FLASHINFER arch, what it shows).
GENERATOR_BUILDS: dict[str, tuple[str, str, str]] = {
    "xqa_mla_fp8_h128_p64_sm120a": (
        "__import__('flashinfer.jit.xqa', fromlist=['x']).gen_xqa_module_mla(torch.float8_e4m3fn, torch.float8_e4m3fn, 64, 576, 128)",
        "12.0a", "XQA MLA, FP8 Q and KV, 128 heads (the only head count it generates), page 64, for sm_120a"),
    "xqa_mla_fp8_h16_p64_sm120a": (
        "__import__('flashinfer.jit.xqa', fromlist=['x']).gen_xqa_module_mla(torch.float8_e4m3fn, torch.float8_e4m3fn, 64, 576, 16)",
        "12.0a", "XQA MLA for GLM-5's 16 heads per GPU"),
    "xqa_mla_fp8_h64_p64_sm120a": (
        "__import__('flashinfer.jit.xqa', fromlist=['x']).gen_xqa_module_mla(torch.float8_e4m3fn, torch.float8_e4m3fn, 64, 576, 64)",
        "12.0a", "XQA MLA for GLM-5's 64 heads"),
    "xqa_mla_bf16q_fp8kv_h128_p64_sm120a": (
        "__import__('flashinfer.jit.xqa', fromlist=['x']).gen_xqa_module_mla(torch.bfloat16, torch.float8_e4m3fn, 64, 576, 128)",
        "12.0a", "XQA MLA with SGLang's bf16 query over an FP8 cache"),
    "sparse_mla_sm120": (
        "__import__('flashinfer.jit.mla', fromlist=['x']).gen_sparse_mla_sm120_module()",
        "12.0a", "the SM120 sparse (DSA) MLA module, GLM and DeepSeek decode kernels, for sm_120a"),
}

_BUILD_DRIVER = r'''
import json, re, subprocess, sys, time, traceback
args = json.loads(sys.argv[1])
out = {}
try:
    import torch
    spec = eval(args["expr"])
except BaseException as e:
    tb = traceback.extract_tb(e.__traceback__)
    fr = next((f for f in reversed(tb) if "flashinfer" in f.filename), tb[-1] if tb else None)
    where = (re.sub(r".*?(flashinfer/)", r"\1", fr.filename) + ":" + str(fr.lineno)) if fr else ""
    out.update(status="generator_refused", exc_type=type(e).__name__, message=str(e)[:600], where=where)
    json.dump(out, open(args["out"], "w")); sys.exit(0)
try:
    from flashinfer.jit import env as jit_env
    out["include_dir"] = str(jit_env.FLASHINFER_INCLUDE_DIR)
    out["csrc_dir"] = str(getattr(jit_env, "FLASHINFER_CSRC_DIR", ""))
    out["sources"] = [str(s) for s in spec.sources]
    spec.write_ninja()
    text = open(spec.ninja_path).read()
    objs = re.findall(r"^build (\S+?\.o)\s*:", text, re.M)
    t0 = time.perf_counter()
    p = subprocess.run([args["ninja"], "-k", "0", "-j", str(args["jobs"]), "-C", str(spec.build_dir), "-f",
                        str(spec.ninja_path)] + objs, capture_output=True, text=True, timeout=args["timeout_s"])
    out.update(status="compiled" if p.returncode == 0 else "nvcc_failed", returncode=p.returncode,
               output=(p.stdout + p.stderr)[-60000:], compile_seconds=time.perf_counter() - t0, objects=len(objs),
               built=[o.rsplit("/", 1)[-1] for o in objs if __import__("os").path.exists(o)],
               failed=[o.rsplit("/", 1)[-1] for o in objs if not __import__("os").path.exists(o)])
except subprocess.TimeoutExpired:
    out.update(status="timeout")
except BaseException as e:
    out.update(status="driver_error", exc_type=type(e).__name__, message=str(e)[:600])
json.dump(out, open(args["out"], "w"))
'''


def build_generated_module(name: str, *, timeout_s: float = 400, jobs: int | None = None) -> dict[str, Any]:
    """Run one of :data:`GENERATOR_BUILDS` with the importable FlashInfer: its own JIT generator, its
    own ninja file and nvcc flags, object files only (no link, no GPU). ``generator_refused``: the
    generator raised before any compiler ran (type, message, file:line); ``compiled`` / ``nvcc_failed``
    with the compiler errors parsed; ``no_nvcc`` when there is no CUDA compiler here."""
    from kvwall.peers.flashinfer import releases as fr

    if name not in GENERATOR_BUILDS:
        raise ValueError(f"Unknown build {name!r}; one of {', '.join(GENERATOR_BUILDS)}.")
    expr, arch, about = GENERATOR_BUILDS[name]
    row: dict[str, Any] = {"build": name, "arch": arch, "about": about}
    nvcc = fr.find_nvcc()
    ninja = shutil.which("ninja") or str(Path(sys.executable).parent / "ninja")
    with tempfile.TemporaryDirectory(prefix=f"kvwall-door-build-{name}-") as tmp:
        env = dict(os.environ, FLASHINFER_CUDA_ARCH_LIST=arch, TORCH_CUDA_ARCH_LIST=arch, FLASHINFER_WORKSPACE_BASE=tmp,
                   CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore",
                   PATH=os.pathsep.join(([str(nvcc.parent)] if nvcc else []) + [str(Path(sys.executable).parent),
                                                                               os.environ.get("PATH", "")]))
        out = Path(tmp) / "build.json"
        payload = {"expr": expr, "out": str(out), "ninja": ninja, "jobs": jobs or os.cpu_count() or 2,
                   "timeout_s": timeout_s}
        t0 = time.perf_counter()
        if nvcc is None:  # the generator's own checks still run; the compiler does not
            payload["expr"] = expr + " and None"
        subprocess.run([sys.executable, "-c", _BUILD_DRIVER, json.dumps(payload)], capture_output=True, text=True,
                       env=env, cwd=tmp, timeout=timeout_s + 120)
        d = json.loads(out.read_text()) if out.exists() else {"status": "driver_error", "message": "no result"}
        row["seconds"] = round(time.perf_counter() - t0, 1)
    if nvcc is None and d.get("status") != "generator_refused":
        d = {"status": "no_nvcc", "message": "the generator accepted the configuration; no nvcc here to compile it"}
    row["nvcc"] = fr.nvcc_version(nvcc) if nvcc else None
    row["status"] = d.get("status")
    for k in ("exc_type", "message", "where", "compile_seconds", "objects", "returncode", "built", "failed"):
        if k in d:
            row[k] = d[k]
    if d.get("status") in ("compiled", "nvcc_failed"):
        roots = [(d["include_dir"].rstrip("/") + "/", "")] if d.get("include_dir") else []
        if d.get("csrc_dir"):
            roots.append((d["csrc_dir"].rstrip("/") + "/", "csrc/"))
        errors = fr.parse_nvcc_output(d.get("output", ""), roots)
        row["errors"] = [{"file": e.file, "line": e.line, "message": e.message} for e in errors][:20]
        row["sources"] = [re.sub(r".*/flashinfer/data/", "", s) for s in d.get("sources", [])]
    return row


def run_doors_checks(device: torch.device, *, builds: list[str], families: list[str], heads: list[int]) -> Result:
    """Citations + replays (+ builds) for the pinned FlashInfer; ``device`` is not used (CPU work)."""
    version, _ = backends.release_root(None)
    rows: list[dict[str, Any]] = []
    for c in cite_all(None):
        rows.append({"section": "citations", **c})
    replays = replay_cases(glm5_cases(families, heads))
    for r in replays["rows"]:
        rows.append({"section": "replays", "release": replays["flashinfer"], **r})
    for name in builds:
        rows.append({"section": "builds", "release": version, **build_generated_module(name)})
    rows.append({"section": "meta", "release": version, "python": sys.version.split()[0],
                 "doors": [asdict(d) for d in DOORS], "families": {k: list(v[0]) + [v[1]] for k, v in backends.FAMILIES.items()}})
    params = {"builds": list(builds), "families": list(families), "heads": list(heads)}
    return Result("doors_checks", params, rows, collect_provenance(torch.device("cpu"), SOURCES))


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------


def _guarded(fn, timeout_s: float) -> tuple[str, Any]:
    """Run ``fn`` in a daemon thread; ``("ok", value)``, ``("raised", exc)`` or ``("timeout", None)``."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - every failure becomes a row
            box["exc"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        return "timeout", None
    return ("raised", box["exc"]) if "exc" in box else ("ok", box.get("value"))


def _reference(case: DoorCase, inputs: dict[str, Any]) -> torch.Tensor:
    pool = inputs["pool"]
    rank = pool.shape[-1] - 64
    flat = pool.reshape(-1, 1, pool.shape[-1])
    q = inputs["q"]
    slots = inputs["slots"]
    indptr = torch.tensor([0] + [sum(len(s) for s in slots[: b + 1]) for b in range(len(slots))], dtype=torch.int32,
                          device=q.device)
    indices = torch.tensor([x for s in slots for x in s], dtype=torch.int32, device=q.device)
    return mla_decode_reference(q[..., :rank], q[..., rank:], flat[..., :rank], flat[..., rank:], indptr, indices,
                                inputs["sm_scale"], compute_dtype=torch.float64)


def run_doors_sm90(device: torch.device, *, heads: list[int], context_lens: list[int], call_timeout_s: float,
                   budget_s: float, seed: int = 0) -> Result:
    """Every path, GLM-5's head counts, page 1 and the path's own page size, called for real."""
    import flashinfer

    rows: list[dict[str, Any]] = []
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    family = {9: "SM90", 10: "SM100", 12: "SM120"}.get(cap[0], f"SM{cap[0]}{cap[1]}") if cap else "CPU"
    cases = [c for c in glm5_cases([family] if family in backends.FAMILIES else ["SM90"], heads)]
    t_start = time.perf_counter()
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    for case in cases:
        row: dict[str, Any] = {"section": "calls", **asdict(case), "family": family, "flashinfer": flashinfer.__version__}
        if time.perf_counter() - t_start > budget_s:
            rows.append({**row, "outcome": "skipped", "message": f"time budget of {budget_s:.0f} s spent"})
            continue
        inputs = make_inputs(case, device, context_lens, seed=seed)
        workspace.zero_()
        t0 = time.perf_counter()

        def call(case=case, inputs=inputs):
            out = call_door(case, inputs, workspace)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            return out

        status, value = _guarded(call, call_timeout_s)
        row["call_seconds"] = round(time.perf_counter() - t0, 2)
        if status == "timeout":
            rows.append({**row, "outcome": "timeout", "message": f"no answer within {call_timeout_s:.0f} s"})
            continue
        if status == "raised":
            rows.append({**row, "outcome": "refused", **outcome_of(value)})
            continue
        out = value
        try:
            ref = _reference(case, inputs)
            rel = float((out.double() - ref).norm() / ref.norm())
            row.update(rel_err_vs_float64=rel, output_shape=list(out.shape), output_dtype=str(out.dtype).replace("torch.", ""))
            st, ms = _guarded(lambda: bench_ms(lambda: call_door(case, inputs, workspace), device), call_timeout_s)
            if st == "ok":
                row["ms_with_plan"] = ms
            # the decode alone: plan once, run many times, as a serving loop does (fa2/fa3)
            if case.door in ("fa2", "fa3"):
                st2, ms2 = _guarded(lambda: _run_only_ms(case, inputs, workspace, device), call_timeout_s)
                if st2 == "ok":
                    row["ms"] = ms2
                else:
                    row["timing_error"] = outcome_of(ms2)["message"] if st2 == "raised" else "timeout"
            row["outcome"] = "runs" if rel < 5e-2 else "wrong_output"
        except BaseException as exc:  # noqa: BLE001
            row.update(outcome="check_failed", **outcome_of(exc))
        rows.append(row)
        del inputs
    params = {"heads": list(heads), "context_lens": list(context_lens), "call_timeout_s": call_timeout_s,
              "budget_s": budget_s, "seed": seed}
    return Result("doors_sm90", params, rows, collect_provenance(device, SOURCES))


def _run_only_ms(case: DoorCase, inputs: dict[str, Any], workspace: torch.Tensor, device: torch.device) -> float:
    from flashinfer import mla as fmla

    rank = inputs["pool"].shape[-1] - 64
    q, pool, table, lens = inputs["q"], inputs["pool"], inputs["table"], inputs["lens"]
    w = fmla.BatchMLAPagedAttentionWrapper(workspace, backend=case.door)
    batch = q.shape[0]
    pages = [table[b, : int(lens[b])] for b in range(batch)]
    kv_indptr = torch.tensor([0] + [sum(len(p) for p in pages[: b + 1]) for b in range(batch)], dtype=torch.int32)
    w.plan(torch.arange(batch + 1, dtype=torch.int32).to(device), kv_indptr.to(device), torch.cat(pages), lens,
           case.heads, rank, 64, 1, False, inputs["sm_scale"], q.dtype, pool.dtype)
    q_nope, q_pe = q[..., :rank].contiguous(), q[..., rank:].contiguous()
    ckv, kpe = pool[..., :rank], pool[..., rank:]
    return bench_ms(lambda: w.run(q_nope, q_pe, ckv, kpe, ckv_scale=1.0, kpe_scale=1.0), device)


EXPERIMENTS = [
    Experiment(
        "doors_checks", run_doors_checks,
        full={"builds": list(GENERATOR_BUILDS), "families": ["SM90", "SM100", "SM120"], "heads": [16, 64]},
        small={"builds": ["xqa_mla_fp8_h16_p64_sm120a", "xqa_mla_fp8_h64_p64_sm120a"],
               "families": ["SM90", "SM100", "SM120"], "heads": [16, 64]},
        about="FlashInfer's MLA paths with FP8 KV: source citations, replayed checks per GPU family, nvcc builds",
        needs="any"),
    Experiment(
        "doors_sm90", run_doors_sm90,
        full={"heads": [16, 64], "context_lens": [4096, 1000], "call_timeout_s": 150.0, "budget_s": 420.0},
        small={"heads": [16], "context_lens": [300, 77], "call_timeout_s": 60.0, "budget_s": 60.0},
        about="every FlashInfer MLA path called on this GPU with GLM-5's shape and an FP8 KV cache",
        needs="cuda"),
]

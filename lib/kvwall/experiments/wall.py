"""Chapter 2's experiments: the compile-time wall, release by release, and the patch on a GPU.

* ``wall_timeline`` (nvcc, and the network or a filled release cache; no GPU): for each FlashInfer release and each
  (backend, arch) of FP8-KV MLA (BF16 Q, ``float8_e4m3fn`` KV, ckv 512 / kpe 64), the release's own plan() checks and
  JIT build, via :func:`kvwall.peers.flashinfer.build.build_mla`, classified as compiled / static_assert /
  failed elsewhere / refused by a Python-level check / unavailable (the release could not be used).
* ``wall_on_gpu`` (needs a CUDA GPU): the original patch, live. Each release runs in its own
  subprocess (``python -m`` :mod:`kvwall.peers.flashinfer.patch_driver`) with that release first
  on ``sys.path`` (installed by
  :func:`kvwall.peers.flashinfer.releases.install_release`, offline from ``$KVWALL_WHEELHOUSE`` when set):
  0.6.12's ``BatchMLAPagedAttentionWrapper.plan(kv_data_type=float8_e4m3fn)`` and ``run`` with the
  FP8 pool (the exception and its compiler errors, parsed), then the releases that accept FP8 KV:
  their output against the BF16 path (same inputs, the cast done outside) and the float64 torch
  reference, and both timed. Every failure becomes a result row, never a crash.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvwall.experiments.registry import Experiment
from kvwall.peers.flashinfer import patch_driver
from kvwall.peers.flashinfer.build import BuildResult, arch_capability, build_mla, validate_config
from kvwall.peers.flashinfer.errors import FlashInferReleaseError, InvalidConfigError, NvccNotFoundError
from kvwall.peers.flashinfer.jit_driver import run_jit_driver
from kvwall.peers.flashinfer.nvcc_errors import parse_nvcc_output, path_roots
from kvwall.peers.flashinfer.releases import install_record, install_release, validate_release
from kvwall.peers.flashinfer.toolchain import find_nvcc, nvcc_version
from kvwall.results import Result, collect_provenance

__all__ = [
    "EXPERIMENTS",
    "OUTCOMES",
    "ORIGINAL_ASSERT_CLAIM",
    "compiler_excerpt",
    "TIMELINE_RELEASES",
    "TIMELINE_CONFIGS",
    "classify",
    "timeline_row",
    "replay_fa_plan_checks",
    "run_wall_timeline",
    "run_wall_on_gpu",
]

#: The releases of the timeline: before MLA FP8 work, the wall (0.6.12), the first SM90 FP8 (0.6.14),
#: the first FA2 FP8 (0.6.18.post1), and the newest.
TIMELINE_RELEASES = ["0.4.1", "0.5.3", "0.6.0", "0.6.12", "0.6.13", "0.6.14", "0.6.17", "0.6.18.post1", "0.7.4"]
#: (backend, arch): fa2 for the original GPU (SM120), fa2 and fa3 for Hopper.
TIMELINE_CONFIGS = [["fa2", "sm_120a"], ["fa2", "sm_90a"], ["fa3", "sm_90a"]]
#: How a cell can end, in the order of the figure.
OUTCOMES = ("compiled", "static_assert", "failed_elsewhere", "refused", "unavailable")


def classify(result: BuildResult) -> dict[str, Any]:
    """The outcome of one build, with the first static_assert's location and whether the
    instantiation chain that reached it passes through ``attention/mla.cuh``."""
    out: dict[str, Any] = {
        "outcome": "",
        "assert_file": "",
        "assert_line": 0,
        "assert_source": "",
        "assert_message": "",
        "reached_from_mla": False,
        "chain": [],
        "first_error": "",
    }
    if result.status == "compiled":
        out["outcome"] = "compiled"
    elif result.status == "python_refused":
        out["outcome"] = "refused"
    else:
        errors = result.unique_errors()
        asserts = [e for e in errors if e.message.startswith("static assertion failed")]
        out["first_error"] = str(errors[0]) if errors else ""
        out["first_error_chain"] = errors[0].chain if errors else []
        if asserts:
            a = asserts[0]
            out.update(
                outcome="static_assert",
                assert_file=a.file,
                assert_line=a.line,
                assert_source=a.source_line,
                assert_message=a.message,
                chain=a.chain,
                reached_from_mla=any(f.file.endswith("attention/mla.cuh") for f in a.instantiation_chain),
            )
            out["other_asserts"] = [f"{e.file}({e.line}): {e.source_line}" for e in asserts[1:]]
        else:
            out["outcome"] = "failed_elsewhere"
    return out


def compiler_excerpt(output: str, lines: int = 12) -> str:
    """The compiler's own words from the first error on: ``lines`` lines, paths already shortened."""
    text = output.splitlines()
    first = next((i for i, ln in enumerate(text) if ": error" in ln or "error:" in ln), None)
    return "" if first is None else "\n".join(text[first : first + lines])


#: The original investigation's words for where the build failed (a claim the chapter checks).
ORIGINAL_ASSERT_CLAIM = "mla.cuh:523"


def replay_fa_plan_checks(release: str, backend: str, arch: str) -> dict[str, Any]:
    """0.7.x moved ``BatchMLAPagedAttentionWrapper.plan()`` into per-backend planners, which the
    release builder's replay of the 0.6.x plan() does not know: here the FA backends' own plan
    validation for FP8 KV runs instead, with ``arch``'s compute capability, in a subprocess with the
    release (the ``"fa_plan"`` task of :mod:`kvwall.peers.flashinfer.jit_driver`).
    ``{"result": "passed" | "refused" | "unavailable", ...}``."""
    request = {
        "task": "fa_plan",
        "release_dir": str(install_release(release)),
        "backend": backend,
        "capability": list(arch_capability(arch)),
    }
    with tempfile.TemporaryDirectory(prefix="kvwall-fa-plan-") as tmp:
        run = run_jit_driver(
            request,
            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
            cwd=Path(tmp),
            timeout_s=300,
            description=f"FlashInfer {release} {backend} plan checks for {arch}",
        )
    return run.report if run.report is not None else {"result": "unavailable", "message": run.output_tail[-1000:]}


def timeline_row(release: str, backend: str, arch: str, *, jobs: int | None = None) -> dict[str, Any]:
    """One cell of the timeline: build (or load from the cache) and classify; a release that cannot
    be installed or driven is an ``unavailable`` row saying why."""
    row: dict[str, Any] = {
        "section": "timeline",
        "release": release,
        "backend": backend,
        "arch": arch,
        "q_dtype": "bfloat16",
        "kv_dtype": "float8_e4m3fn",
    }
    try:
        r = build_mla(release, backend, "bfloat16", "float8_e4m3fn", arch, jobs=jobs)
    except (InvalidConfigError, NvccNotFoundError):
        raise
    except FlashInferReleaseError as exc:
        return {**row, "status": "error", "outcome": "unavailable", "reason": f"{type(exc).__name__}: {exc}"[:2000]}
    row.update(
        status=r.status,
        duration_s=r.duration_s,
        from_cache=r.from_cache,
        nvcc_version=r.nvcc_version,
        python_checks=r.python_checks,
        built=r.created,
        **classify(r),
    )
    row["compiler_excerpt"] = compiler_excerpt(r.compiler_output)
    if r.python_checks.startswith("skipped"):  # 0.7.x: replay its FA backends' own plan validation
        check = replay_fa_plan_checks(release, backend, arch)
        row["plan_check_replay"] = check
        if check.get("result") == "refused":
            row.update(
                outcome="refused",
                refusal_type=check["exc_type"],
                refusal_message=check["message"],
                refusal_where=check["where"],
                refusal_phase="FA backend plan validation",
                compiled_if_forced=r.status == "compiled",
            )
        elif check.get("result") == "passed":
            row["python_checks"] = (
                f"ran (FA backend plan validation, up to its device query at {check.get('where') or 'the end'})"
            )
    if r.refusal is not None:
        row.update(
            refusal_type=r.refusal.exc_type,
            refusal_message=r.refusal.message,
            refusal_where=r.refusal.where,
            refusal_phase=r.refusal.phase,
        )
    return row


def run_wall_timeline(
    device: torch.device, *, releases: list[str], configs: list[list[str]], jobs: int | None = None
) -> Result:
    """FP8-KV MLA across FlashInfer releases: compiled, static_assert, failed elsewhere or refused."""
    for backend, arch in configs:
        validate_config(backend, "bfloat16", "float8_e4m3fn", arch)
    for release in releases:
        validate_release(release)
    nvcc = find_nvcc()
    rows: list[dict[str, Any]] = [
        {
            "section": "toolchain",
            "nvcc_version": nvcc_version() if nvcc else None,
            "nvcc": str(nvcc) if nvcc else None,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
        }
    ]
    for release in releases:
        for backend, arch in configs:
            rows.append(timeline_row(release, backend, arch, jobs=jobs))
        rec = install_record(release)
        rows.append(
            {
                "section": "release",
                "release": release,
                "installed_from": rec.get("source", {}).get("from", ""),
                "source": rec.get("source", {}),
                "substituted": rec.get("substituted", {}),
                "pinned_headers": rec.get("pinned_headers", {}),
                "dependencies": rec.get("dependencies", []),
            }
        )
    params = {"releases": list(releases), "configs": [list(c) for c in configs], "jobs": jobs}
    return Result("wall_timeline", params, rows, collect_provenance(device, __name__))


# ---------------------------------------------------------------------------------------------
# The patch on a GPU: one subprocess per release
# ---------------------------------------------------------------------------------------------


def _warm_cases(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Plan once per (backend, KV dtype): that is where FlashInfer JIT-builds (and caches) the kernel.
    For the wall release the FP8 case is the whole patch (plan, then run), with a small batch."""
    cases = []
    for backend in spec["backends"]:
        cases.append(
            {
                "backend": backend,
                "kv": "float8_e4m3fn",
                "context_len": 1024,
                "run_in_warm": bool(spec.get("expect_wall")),
            }
        )
        if not spec.get("expect_wall"):
            cases.append({"backend": backend, "kv": "bfloat16", "context_len": 1024})
    return cases


def _measure_cases(spec: dict[str, Any], warm: dict[str, Any], context_lens: list[int]) -> list[dict[str, Any]]:
    """Every (backend, KV dtype) whose plan() succeeded while warming, at every context length."""
    planned = {(c["backend"], c["kv"]) for c in warm.get("cases", []) if c.get("status") == "planned"}
    cases = []
    for backend in spec["backends"]:
        for ctx in context_lens:
            for kv in ("float8_e4m3fn", "bfloat16"):
                if (backend, kv) in planned:
                    cases.append(
                        {
                            "backend": backend,
                            "kv": kv,
                            "context_len": ctx,
                            "compare_bf16": kv == "float8_e4m3fn" and (backend, "bfloat16") in planned,
                        }
                    )
    return cases


def _start_release(
    release: str,
    mode: str,
    cases: list[dict[str, Any]],
    *,
    pool_tokens: int,
    tensor_parallel: int,
    seed: int,
    workdir: Path,
    device: str = "cuda",
) -> tuple[subprocess.Popen | None, dict[str, Any]]:
    """Install ``release`` and start the driver on ``cases`` in a subprocess with it first on sys.path."""
    try:
        rdir = install_release(release)
    except FlashInferReleaseError as exc:
        return None, {"error": "install", "exc_type": type(exc).__name__, "message": str(exc)[-4000:], "cases": []}
    result_path = workdir / f"gpu-{release}-{mode}.json"
    log_path = workdir / f"gpu-{release}-{mode}.log"
    payload = {
        "release_dir": str(rdir),
        "cases": cases,
        "pool_tokens": pool_tokens,
        "mode": mode,
        "device": device,
        "tensor_parallel": tensor_parallel,
        "seed": seed,
        "result_path": str(result_path),
    }
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(rdir)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        FLASHINFER_WORKSPACE_BASE=str(workdir / f"fi-{release}"),
        PATH=os.pathsep.join([str(rdir / "bin"), env.get("PATH", "")]),
    )
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", patch_driver.__name__, json.dumps(payload)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=str(workdir),
        )
    return proc, {"result_path": str(result_path), "log_path": str(log_path), "started": time.perf_counter()}


def _finish_release(proc: subprocess.Popen | None, info: dict[str, Any], deadline: float) -> dict[str, Any]:
    """Wait for a driver until ``deadline`` (a perf_counter time): its result, or why there is none."""
    if proc is None:
        return info
    try:
        code: int | str = proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = "timeout"
    path, log = Path(info["result_path"]), Path(info["log_path"])
    try:
        d = json.loads(path.read_text()) if path.exists() else {"cases": []}
    except ValueError:
        d = {"cases": []}
    if code != 0 or d.get("phase") != "done":
        d.setdefault("error", "timeout" if code == "timeout" else "driver")
        d.update(returncode=code, output_tail=log.read_text(errors="replace")[-3000:] if log.exists() else "")
    d["seconds"] = round(time.perf_counter() - info["started"], 1)
    return d


def _parse_compiler_errors(case: dict[str, Any], d: dict[str, Any]) -> list[dict[str, Any]]:
    """The nvcc errors inside a JIT-build exception's message, located in the release's sources."""
    if "Ninja build failed" not in case.get("message", "") and "error" not in case.get("message", ""):
        return []
    errs = parse_nvcc_output(case["message"], path_roots(d))
    seen, out = set(), []
    for e in errs:
        key = (e.file, e.line, e.message)
        if key in seen:
            continue
        seen.add(key)
        out.append(
            {
                "file": e.file,
                "line": e.line,
                "message": e.message,
                "source_line": e.source_line,
                "chain": e.chain,
                "translation_unit": e.translation_unit,
            }
        )
    return out


def _release_row(release: str, phase: str, d: dict[str, Any], planned: int) -> dict[str, Any]:
    return {
        "section": "release",
        "release": release,
        "phase": phase,
        "error": d.get("error"),
        "flashinfer_version": d.get("flashinfer_version"),
        "flashinfer_file": d.get("flashinfer_file"),
        "gpu": d.get("gpu"),
        "capability": d.get("capability"),
        "seconds": d.get("seconds"),
        "installed_from": install_record(release).get("source", {}).get("from"),
        "exc_type": d.get("exc_type"),
        "message": (d.get("message") or "")[-2000:],
        "output_tail": d.get("output_tail", "")[-2000:],
        "cases_planned": planned,
        "cases_done": len(d.get("cases", [])),
    }


def _case_rows(release: str, d: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for case in d.get("cases", []):
        row = {"section": "case", "release": release, **{k: v for k, v in case.items() if k != "traceback"}}
        if case.get("status") == "failed":
            row["compiler_errors"] = _parse_compiler_errors(case, d)
            row["message"] = case.get("message", "")[-6000:]
            row["traceback_tail"] = case.get("traceback", "")[-1500:]
        rows.append(row)
    return rows


def run_wall_on_gpu(
    device: torch.device,
    *,
    releases: list[dict[str, Any]],
    context_lens: list[int],
    pool_tokens: int,
    tensor_parallel: int = 4,
    seed: int = 0,
    budget_s: float = 540.0,
) -> Result:
    """The patch on a GPU, one subprocess per release (see the module docstring).

    Two phases: all releases *warm* in parallel (plan() once per backend and KV dtype: the JIT
    builds, CPU-bound; the wall release also runs its patch here), then, one release at a time so
    the timings do not share the GPU, *measure* what planned. ``budget_s`` bounds the whole run;
    whatever did not finish is a row saying so."""
    if device.type != "cuda":
        raise RuntimeError(
            "wall_on_gpu drives FlashInfer's MLA kernels: it needs a CUDA device. On a CPU, the "
            "chapter shows the recorded run and builds the kernel with nvcc instead (wall_timeline)."
        )
    t_end = time.perf_counter() + budget_s
    rows: list[dict[str, Any]] = []
    specs = [{**s, "release": validate_release(s["release"])} for s in releases]
    with tempfile.TemporaryDirectory(prefix="kvwall-wall-") as tmp:
        work = Path(tmp)
        started = []
        for spec in specs:
            cases = _warm_cases(spec)
            proc, info = _start_release(
                spec["release"],
                "warm",
                cases,
                pool_tokens=pool_tokens,
                tensor_parallel=tensor_parallel,
                seed=seed,
                workdir=work,
            )
            started.append((spec, cases, proc, info))
        warm_deadline = t_end - 60.0 * sum(not s.get("expect_wall") for s in specs)  # leave time to measure
        warmed = {}
        for spec, cases, proc, info in started:
            d = _finish_release(proc, info, warm_deadline)
            warmed[spec["release"]] = d
            rows.append(_release_row(spec["release"], "warm", d, len(cases)))
            rows += _case_rows(spec["release"], d)
        for spec in specs:
            if spec.get("expect_wall"):
                continue
            cases = _measure_cases(spec, warmed[spec["release"]], context_lens)
            if not cases:
                continue
            proc, info = _start_release(
                spec["release"],
                "measure",
                cases,
                pool_tokens=pool_tokens,
                tensor_parallel=tensor_parallel,
                seed=seed,
                workdir=work,
            )
            d = _finish_release(proc, info, t_end)
            rows.append(_release_row(spec["release"], "measure", d, len(cases)))
            rows += _case_rows(spec["release"], d)
    params = {
        "releases": releases,
        "context_lens": list(context_lens),
        "pool_tokens": pool_tokens,
        "tensor_parallel": tensor_parallel,
        "seed": seed,
        "budget_s": budget_s,
    }
    return Result("wall_on_gpu", params, rows, collect_provenance(device, __name__))


_GPU_RELEASES = [
    {"release": "0.6.12", "backends": ["fa2"], "expect_wall": True},
    {"release": "0.6.14", "backends": ["fa3", "fa2"]},
    {"release": "0.6.18.post1", "backends": ["fa2", "fa3"]},
]

EXPERIMENTS: list[Experiment] = [
    Experiment(
        "wall_timeline",
        run_wall_timeline,
        full=dict(releases=TIMELINE_RELEASES, configs=TIMELINE_CONFIGS, jobs=None),
        small=dict(releases=["0.6.12"], configs=[["fa2", "sm_120a"], ["fa2", "sm_90a"]], jobs=None),
        about="FP8-KV MLA across FlashInfer releases: compiled, static_assert, or refused (nvcc, no GPU)",
        requires=("nvcc", "network"),
    ),
    Experiment(
        "wall_on_gpu",
        run_wall_on_gpu,
        full=dict(
            releases=_GPU_RELEASES,
            context_lens=[4096, 32768, 131072],
            pool_tokens=495_000,
            tensor_parallel=4,
            seed=0,
            budget_s=540.0,
        ),
        small=dict(
            releases=_GPU_RELEASES, context_lens=[1024], pool_tokens=8192, tensor_parallel=4, seed=0, budget_s=540.0
        ),
        about="the patch on a GPU: 0.6.12 fails in plan(); 0.6.14 / 0.6.18.post1 FP8 against BF16, timed",
        requires=("cuda", "network"),
    ),
]

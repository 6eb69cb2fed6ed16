"""Chapter 3's experiments: FlashInfer's other MLA doors, asked for GLM-5's shape with an FP8 KV cache.

* ``doors_checks`` (any machine with FlashInfer; recording it needs nvcc, so the builds are real):
  the release's own source lines that decide each path (file:line),
  a replay of every path's Python checks as on SM90 / SM100 / SM120 (see :mod:`kvwall.peers.flashinfer.replay`),
  the kernel generators' answers for GLM-5's head counts, and, where nvcc is present (full scale),
  nvcc builds of the SM120 kernels for ``sm_120a``.
* ``doors_sm90`` (a CUDA GPU): every path called for real, 16 and 64 heads, page size 1 and the
  path's own; each call's answer recorded as the library gives it (exception type and message), or,
  when it runs, its output checked against the float64 torch reference and timed.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from kvwall.experiments.registry import Experiment
from kvwall.kernels import mla_decode_reference
from kvwall.measure.timing import bench_ms
from kvwall.peers.flashinfer.calls import call_door, make_inputs, outcome_of
from kvwall.peers.flashinfer.citations import cite_all
from kvwall.peers.flashinfer.doors import DOORS, FAMILIES, DoorCase, glm5_cases
from kvwall.peers.flashinfer.generator_build import GeneratorBuild, build_generator
from kvwall.peers.flashinfer.releases import release_root
from kvwall.peers.flashinfer.replay import replay_cases
from kvwall.results import Result, collect_provenance

__all__ = ["EXPERIMENTS", "run_doors_checks", "run_doors_sm90", "build_generated_module", "GENERATOR_BUILDS"]


def _xqa_mla(q_dtype: str, heads: int, about: str) -> GeneratorBuild:
    """XQA MLA for an FP8 cache, page 64, the 576-wide latent, ``heads`` query heads, for sm_120a."""
    return GeneratorBuild(
        "flashinfer.jit.xqa", "gen_xqa_module_mla", (q_dtype, "float8_e4m3fn", 64, 576, heads), "12.0a", about
    )


#: nvcc builds of the kernels an SM120 door would need, by name.
GENERATOR_BUILDS: dict[str, GeneratorBuild] = {
    "xqa_mla_fp8_h128_p64_sm120a": _xqa_mla(
        "float8_e4m3fn",
        128,
        "XQA MLA, FP8 Q and KV, 128 heads (the only head count it generates), page 64, for sm_120a",
    ),
    "xqa_mla_fp8_h16_p64_sm120a": _xqa_mla("float8_e4m3fn", 16, "XQA MLA for GLM-5's 16 heads per GPU"),
    "xqa_mla_fp8_h64_p64_sm120a": _xqa_mla("float8_e4m3fn", 64, "XQA MLA for GLM-5's 64 heads"),
    "xqa_mla_bf16q_fp8kv_h128_p64_sm120a": _xqa_mla(
        "bfloat16", 128, "XQA MLA with SGLang's bf16 query over an FP8 cache"
    ),
    "sparse_mla_sm120": GeneratorBuild(
        "flashinfer.jit.mla",
        "gen_sparse_mla_sm120_module",
        (),
        "12.0a",
        "the SM120 sparse (DSA) MLA module, GLM and DeepSeek decode kernels, for sm_120a",
    ),
}


def build_generated_module(name: str, *, timeout_s: float = 400, jobs: int | None = None) -> dict[str, Any]:
    """One of :data:`GENERATOR_BUILDS`, built by :func:`kvwall.peers.flashinfer.generator_build.build_generator`:
    a row ``{"build", "arch", "about", "status", ...}``."""
    if name not in GENERATOR_BUILDS:
        raise ValueError(f"Unknown build {name!r}; one of {', '.join(GENERATOR_BUILDS)}.")
    build = GENERATOR_BUILDS[name]
    return {
        "build": name,
        "arch": build.arch,
        "about": build.about,
        **build_generator(build, timeout_s=timeout_s, jobs=jobs),
    }


def run_doors_checks(device: torch.device, *, builds: list[str], families: list[str], heads: list[int]) -> Result:
    """Citations + replays (+ builds) for the pinned FlashInfer; ``device`` is not used (CPU work)."""
    version, _ = release_root(None)
    rows: list[dict[str, Any]] = []
    for c in cite_all(None):
        rows.append({"section": "citations", **c})
    replays = replay_cases(glm5_cases(families, heads))
    for r in replays["rows"]:
        rows.append({"section": "replays", "release": replays["flashinfer"], **r})
    for name in builds:
        rows.append({"section": "builds", "release": version, **build_generated_module(name)})
    rows.append(
        {
            "section": "meta",
            "release": version,
            "python": sys.version.split()[0],
            "doors": [asdict(d) for d in DOORS],
            "families": {k: list(v[0]) + [v[1]] for k, v in FAMILIES.items()},
        }
    )
    params = {"builds": list(builds), "families": list(families), "heads": list(heads)}
    return Result("doors_checks", params, rows, collect_provenance(torch.device("cpu"), __name__))


# ------------------------------------------------------------------------------------------------
# On the GPU
# ------------------------------------------------------------------------------------------------


def _guarded(fn: Callable[[], Any], timeout_s: float) -> tuple[str, Any]:
    """Run ``fn`` in a daemon thread; ``("ok", value)``, ``("raised", exc)`` or ``("timeout", None)``."""
    box: dict[str, Any] = {}

    def target() -> None:
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


def _reference(inputs: dict[str, Any]) -> torch.Tensor:
    """The float64 torch reference for :func:`kvwall.peers.flashinfer.calls.make_inputs`' inputs."""
    pool = inputs["pool"]
    rank = pool.shape[-1] - 64
    flat = pool.reshape(-1, 1, pool.shape[-1])
    q = inputs["q"]
    slots = inputs["slots"]
    indptr = torch.tensor(
        [0] + [sum(len(s) for s in slots[: b + 1]) for b in range(len(slots))], dtype=torch.int32, device=q.device
    )
    indices = torch.tensor([x for s in slots for x in s], dtype=torch.int32, device=q.device)
    return mla_decode_reference(
        q[..., :rank],
        q[..., rank:],
        flat[..., :rank],
        flat[..., rank:],
        indptr,
        indices,
        inputs["sm_scale"],
        compute_dtype=torch.float64,
    )


def run_doors_sm90(
    device: torch.device,
    *,
    heads: list[int],
    context_lens: list[int],
    call_timeout_s: float,
    budget_s: float,
    seed: int = 0,
) -> Result:
    """Every path, GLM-5's head counts, page 1 and the path's own page size, called for real."""
    version, _ = release_root(None)
    rows: list[dict[str, Any]] = []
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    family = {9: "SM90", 10: "SM100", 12: "SM120"}.get(cap[0], f"SM{cap[0]}{cap[1]}") if cap else "CPU"
    cases = glm5_cases([family] if family in FAMILIES else ["SM90"], heads)
    t_start = time.perf_counter()
    workspace = torch.zeros(128 << 20, dtype=torch.uint8, device=device)
    for case in cases:
        row: dict[str, Any] = {"section": "calls", **asdict(case), "family": family, "flashinfer": version}
        if time.perf_counter() - t_start > budget_s:
            rows.append({**row, "outcome": "skipped", "message": f"time budget of {budget_s:.0f} s spent"})
            continue
        inputs = make_inputs(case, device, context_lens, seed=seed)
        workspace.zero_()
        t0 = time.perf_counter()

        status, value = _guarded(functools.partial(_call_and_wait, case, inputs, workspace), call_timeout_s)
        row["call_seconds"] = round(time.perf_counter() - t0, 2)
        if status == "timeout":
            rows.append({**row, "outcome": "timeout", "message": f"no answer within {call_timeout_s:.0f} s"})
            continue
        if status == "raised":
            rows.append({**row, "outcome": "refused", **outcome_of(value)})
            continue
        out = value
        try:
            ref = _reference(inputs)
            rel = float((out.double() - ref).norm() / ref.norm())
            row.update(
                rel_err_vs_float64=rel, output_shape=list(out.shape), output_dtype=str(out.dtype).replace("torch.", "")
            )
            # partials bind this case's inputs: a call that timed out keeps running in its thread with its own
            st, ms = _guarded(
                functools.partial(bench_ms, functools.partial(call_door, case, inputs, workspace), device),
                call_timeout_s,
            )
            if st == "ok":
                row["ms_with_plan"] = ms
            # the decode alone: plan once, run many times, as a serving loop does (fa2/fa3)
            if case.door in ("fa2", "fa3"):
                st2, ms2 = _guarded(functools.partial(_run_only_ms, case, inputs, workspace, device), call_timeout_s)
                if st2 == "ok":
                    row["ms"] = ms2
                else:
                    row["timing_error"] = outcome_of(ms2)["message"] if st2 == "raised" else "timeout"
            row["outcome"] = "runs" if rel < 5e-2 else "wrong_output"
        except BaseException as exc:  # noqa: BLE001
            row.update(outcome="check_failed", **outcome_of(exc))
        rows.append(row)
        del inputs
    params = {
        "heads": list(heads),
        "context_lens": list(context_lens),
        "call_timeout_s": call_timeout_s,
        "budget_s": budget_s,
        "seed": seed,
    }
    return Result("doors_sm90", params, rows, collect_provenance(device, __name__))


def _call_and_wait(case: DoorCase, inputs: dict[str, Any], workspace: torch.Tensor) -> torch.Tensor:
    """:func:`call_door`, then wait for the GPU to finish it (so a hang is caught by the caller's timeout)."""
    out = call_door(case, inputs, workspace)
    if workspace.device.type == "cuda":
        torch.cuda.synchronize(workspace.device)
    return out


def _run_only_ms(case: DoorCase, inputs: dict[str, Any], workspace: torch.Tensor, device: torch.device) -> float:
    """The decode alone (fa2/fa3): plan once, then time ``run`` as a serving loop calls it."""
    from flashinfer import mla as fmla  # optional: kvwall.experiments imports without it

    rank = inputs["pool"].shape[-1] - 64
    q, pool, table, lens = inputs["q"], inputs["pool"], inputs["table"], inputs["lens"]
    w = fmla.BatchMLAPagedAttentionWrapper(workspace, backend=case.door)
    batch = q.shape[0]
    pages = [table[b, : int(lens[b])] for b in range(batch)]
    kv_indptr = torch.tensor([0] + [sum(len(p) for p in pages[: b + 1]) for b in range(batch)], dtype=torch.int32)
    w.plan(
        torch.arange(batch + 1, dtype=torch.int32).to(device),
        kv_indptr.to(device),
        torch.cat(pages),
        lens,
        case.heads,
        rank,
        64,
        1,
        False,
        inputs["sm_scale"],
        q.dtype,
        pool.dtype,
    )
    q_nope, q_pe = q[..., :rank].contiguous(), q[..., rank:].contiguous()
    ckv, kpe = pool[..., :rank], pool[..., rank:]
    return bench_ms(lambda: w.run(q_nope, q_pe, ckv, kpe, ckv_scale=1.0, kpe_scale=1.0), device)


EXPERIMENTS = [
    Experiment(
        "doors_checks",
        run_doors_checks,
        full={"builds": list(GENERATOR_BUILDS), "families": ["SM90", "SM100", "SM120"], "heads": [16, 64]},
        small={
            "builds": ["xqa_mla_fp8_h16_p64_sm120a", "xqa_mla_fp8_h64_p64_sm120a"],
            "families": ["SM90", "SM100", "SM120"],
            "heads": [16, 64],
        },
        about="FlashInfer's MLA paths with FP8 KV: source citations, replayed checks per GPU family, nvcc builds",
        requires=("flashinfer", "nvcc"),
    ),
    Experiment(
        "doors_sm90",
        run_doors_sm90,
        full={"heads": [16, 64], "context_lens": [4096, 1000], "call_timeout_s": 150.0, "budget_s": 420.0},
        small={"heads": [16], "context_lens": [300, 77], "call_timeout_s": 60.0, "budget_s": 60.0},
        about="every FlashInfer MLA path called on this GPU with GLM-5's shape and an FP8 KV cache",
        requires=("cuda", "flashinfer"),
    ),
]

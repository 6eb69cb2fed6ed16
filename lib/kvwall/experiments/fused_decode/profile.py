"""``fused_decode_profile`` (GPU, Nsight Compute; appendix material): where each path of ours spends its time.

- ``profile``: Nsight Compute on each path's split kernel, one launch per ``[heads, tokens, path]`` point, batch 1,
  one request on random slots / pages of the 495K pool -- DRAM and L2 bytes, occupancy, issue, stall reasons (the
  programs profiled: ``python -m kvwall.tuning.fused --profile-one`` for the Triton path, ``python -m
  kvwall.kernels.mla_decode.wgmma --profile-one`` for the wgmma path, ``python -m
  kvwall.kernels.mla_decode.wgmma_tokens --profile-one`` for the tokens-on-M wgmma path; three warm-up calls, then the
  profiled one).
  ncu locks clocks to base, so its durations are longer than the benchmark's.
- ``peers``: ours beside FlashMLA dense BF16 and FP8 at the ``peer_points`` (``[heads, context, batch]``, the bench's
  points where ours falls short of issue 35's targets), each strategy built as ``fused_decode_bench`` builds it: one
  call under Nsight Compute, every kernel it launches (``python -m kvwall.experiments.fused_decode.profile_point``,
  ``ncu --profile-from-start off``); per launch the same metrics, so each miss reads against the peer that sets its
  target on the same counters (tensor pipe, shared-memory and L1 traffic, global-load sectors, stall reasons).
- ``phases``: where the wgmma kernel's cycles go at ``trace_points`` (``[heads, context, batch]``, page 64): per
  warpgroup, the cycles per tile of each phase between two ``clock64`` marks, and each CTA's fixed phases
  (:func:`kvwall.kernels.mla_decode.wgmma.trace_wgmma_phases`, the ``KVWALL_TRACE`` build), beside both builds' µs.

Device time at full scale: **255 s** on the H200 (the recording at a5148ba: 6 ncu runs, 18 peer calls of the
``peers`` section, 5 traced points); 62-73 s before the ``peers`` section (the recordings at ba26777 and a67e272).
The tokens-on-M kernel has no phase trace build (the trace marks were exploration switches, ``NOTES.md``).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.measure.failures import error_text, traceback_tail
from kvwall.measure.ncu import ncu_path, profile_kernel, profile_window
from kvwall.measure.timing import release_memory
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import decode_flops, kv_read_bytes
from kvwall.peers.flashmla import PAGE_SIZE
from kvwall.results import Result, collect_provenance
from kvwall.tuning import fused as triton_profiled
from kvwall.experiments.fused_decode import profile_point
from kvwall.experiments.fused_decode.bench import time_call
from kvwall.experiments.fused_decode.strategies import BuildContext, build_strategy, make_point
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "PEERS_PROFILED", "PROFILED", "run_fused_decode_profile"]

D = GLM5.kv_dim
FP8 = torch.float8_e4m3fn
#: Path -> (the program ncu runs, the split kernel's name pattern). Imported, not only named, so that each program
#: and the kernel it launches are in this experiment's provenance.
PROFILED: dict[str, tuple[str, str]] = {
    "triton": (triton_profiled.__name__, "_mla_split_kernel"),
    "wgmma": (wgmma_path.__name__, "mla_wgmma_split_kernel"),
    "wgmma_tokens": (tokens_path.__name__, "mla_wgmma_tokens_kernel"),
}

#: The strategies the ``peers`` section profiles at each peer point: ours (the dispatcher's path, page size 1, as the
#: bench runs it) and the two FlashMLA kernels that set issue 35's targets (pages of 64).
PEERS_PROFILED: tuple[str, ...] = ("ours", "flashmla_dense_bf16", "flashmla_dense_fp8")


def _peer_rows(
    points: list[list[int]], *, pool_slots: int, max_total: int, seed: int, timeout_s: int
) -> list[dict[str, Any]]:
    """One ``peers`` row per (point, strategy of :data:`PEERS_PROFILED`): every kernel of one call (``launches``: name
    and duration), the call's summed kernel time, and the metrics of its longest kernel (``main_kernel``), or the
    ``error``."""
    rows = []
    for h, c, b in points:
        for strategy in PEERS_PROFILED:
            row: dict[str, Any] = {"section": "peers", "heads": h, "context": c, "batch": b, "strategy": strategy}
            if ncu_path() is None:
                rows.append({**row, "error": "ncu (Nsight Compute) is not installed here"})
                continue
            try:
                launches, missing = profile_window(
                    profile_point.__name__,
                    [strategy, str(h), str(c), str(b), str(pool_slots), str(max_total), str(seed)],
                    timeout_s=timeout_s,
                )
                main = max(launches, key=lambda k: float(k.get("duration_ns") or 0.0))
                row.update(
                    {k: v for k, v in main.items() if k != "kernel"},
                    main_kernel=main["kernel"],
                    launches=[{"kernel": k["kernel"], "duration_ns": k.get("duration_ns")} for k in launches],
                    total_duration_ns=sum(float(k.get("duration_ns") or 0.0) for k in launches),
                )
                if missing:
                    row["ncu_missing"] = missing
            except Exception as exc:  # noqa: BLE001 - a failed profile is a row, not a crash
                row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
            rows.append(row)
    return rows


def _profile_row(heads: int, tokens: int, path: str, timeout_s: int) -> dict[str, Any]:
    row: dict[str, Any] = {
        "section": "profile",
        "heads": heads,
        "tokens": tokens,
        "path": path,
        "min_bytes": kv_read_bytes(tokens),
        "flops": decode_flops(heads, tokens),
    }
    if ncu_path() is None:
        row["error"] = "ncu (Nsight Compute) is not installed here"
        return row
    try:
        module, regex = PROFILED[path]
        row.update(
            profile_kernel(
                module,
                ["--profile-one", str(heads), str(tokens)],
                kernel_regex=regex,
                launch_skip=3,
                timeout_s=timeout_s,
            )
        )
    except Exception as exc:  # noqa: BLE001 - a failed profile is a row, not a crash
        row["error"] = f"{type(exc).__name__}: {str(exc)[-600:]}"
    return row


def _phase_rows(
    points: list[list[int]],
    device: torch.device,
    *,
    pool_slots: int,
    max_total: int,
    seed: int,
    reps: int,
    rounds: int,
    flush_mb: int,
) -> list[dict]:
    """The wgmma kernel's per-phase cycles (the ``KVWALL_TRACE`` build) at each ``[heads, context, batch]``, beside the
    shipped and the traced build's µs (what the clock reads cost)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, D, generator=gen, device=device) * 0.7).to(FP8)
    flush = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device).zero_
    ctx = BuildContext(page_size=PAGE_SIZE)
    rows = []
    for h, c, b in points:
        pt = make_point(h, c, b, pool_slots=pool_slots, max_total=max_total, gen=gen, seed=seed, device=device)
        row: dict[str, Any] = {
            "section": "phases",
            "heads": h,
            "context": c,
            "batch": b,
            "tokens": pt.tokens,
            "page_size": PAGE_SIZE,
        }
        call = None
        try:
            call, info = build_strategy("wgmma", pt, pool, ctx)
            call()
            row["us"] = time_call(call, flush, device, reps, rounds)[0]
            trace = wgmma_path.trace_wgmma_phases(call)
            with wgmma_path.traced_build():
                row["us_traced"] = time_call(call, flush, device, reps, rounds)[0]
            row.update(
                work_items=info["work_items"],
                ctas=trace.ctas,
                tiles=trace.tiles,
                per_tile={str(wg): v for wg, v in trace.per_tile.items()},
                per_cta={str(wg): v for wg, v in trace.per_cta.items()},
            )
        except Exception as exc:  # noqa: BLE001 - a failed trace is a row
            row.update(error=error_text(exc, 500), traceback_tail=traceback_tail())
        finally:
            call = None
            release_memory(device)
        rows.append(row)
    return rows


def run_fused_decode_profile(
    device: torch.device,
    *,
    profile_points: list[list[Any]],
    trace_points: list[list[int]],
    peer_points: list[list[int]] | None = None,
    pool_slots: int = 495_000,
    max_total_tokens: int = 2_000_000,
    reps: int = 10,
    rounds: int = 3,
    flush_mb: int = 256,
    timeout_s: int = 120,
    seed: int = 0,
) -> Result:
    """See the module docstring. ``profile_points``: ``[heads, tokens, path]`` (path a key of :data:`PROFILED`);
    ``trace_points``: ``[heads, context, batch]`` of the wgmma phase trace; ``peer_points``: ``[heads, context,
    batch]`` where ours and FlashMLA are profiled side by side. Rows: ``profile`` (one per point, the metrics of
    :data:`kvwall.measure.ncu.NCU_METRICS` or the ``error``; a wgmma path's row says why where it cannot run),
    ``peers`` (one per peer point and strategy of :data:`PEERS_PROFILED`), ``phases`` (one per trace point; none where
    the wgmma path cannot run)."""
    if device.type != "cuda":
        raise RuntimeError(
            "fused_decode_profile profiles GPU kernels (Nsight Compute, a clock64 trace): it needs an "
            "NVIDIA GPU. On a CPU the appendix shows the recorded run."
        )
    unknown = {p[2] for p in profile_points} - set(PROFILED)
    if unknown:
        raise ValueError(f"profile_points name paths {sorted(unknown)}; known: {sorted(PROFILED)}.")
    t0 = time.perf_counter()
    why = wgmma_path.wgmma_refusal(device)
    rows: list[dict[str, Any]] = []
    for h, tokens, path in profile_points:
        if path in ("wgmma", "wgmma_tokens") and why:  # both refuse what the wgmma path refuses
            rows.append(
                {
                    "section": "profile",
                    "heads": h,
                    "tokens": tokens,
                    "path": path,
                    "min_bytes": kv_read_bytes(tokens),
                    "flops": decode_flops(h, tokens),
                    "error": why,
                }
            )
            continue
        rows.append(_profile_row(h, tokens, path, timeout_s))
    rows += _peer_rows(
        [list(p) for p in peer_points or []],
        pool_slots=pool_slots,
        max_total=max_total_tokens,
        seed=seed,
        timeout_s=timeout_s,
    )
    if not why:
        rows += _phase_rows(
            trace_points,
            device,
            pool_slots=pool_slots,
            max_total=max_total_tokens,
            seed=seed,
            reps=reps,
            rounds=rounds,
            flush_mb=flush_mb,
        )
    params = dict(
        profile_points=[list(p) for p in profile_points],
        trace_points=[list(p) for p in trace_points],
        peer_points=[list(p) for p in peer_points or []],
        pool_slots=pool_slots,
        max_total_tokens=max_total_tokens,
        reps=reps,
        rounds=rounds,
        flush_mb=flush_mb,
        timeout_s=timeout_s,
        seed=seed,
        seconds=round(time.perf_counter() - t0, 1),
    )
    return Result("fused_decode_profile", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "fused_decode_profile",
        run_fused_decode_profile,
        full=dict(
            profile_points=[
                [16, 131_072, "triton"],
                [128, 131_072, "triton"],
                [16, 131_072, "wgmma"],
                [128, 131_072, "wgmma"],
                [16, 131_072, "wgmma_tokens"],
                [32, 131_072, "wgmma_tokens"],
            ],
            trace_points=[[16, 131_072, 1], [64, 131_072, 1], [64, 131_072, 8], [128, 131_072, 8], [128, 4096, 64]],
            # Issue 35's misses in the bench: 16 heads at batch 1 (<= 35 us) and batch 64 (80 % of the roofline, FP8's
            # speed) of 128K, 16 heads with a batch at 32K, 64 heads' and 128 heads' worst points against FlashMLA BF16,
            # and 128 heads at batch 1.
            peer_points=[
                [16, 131_072, 1],
                [16, 131_072, 64],
                [16, 32_768, 32],
                [64, 4096, 32],
                [128, 32_768, 64],
                [128, 131_072, 1],
            ],
            pool_slots=495_000,
            max_total_tokens=2_000_000,
            reps=10,
            rounds=3,
            flush_mb=256,
            timeout_s=120,
            seed=0,
        ),
        small=dict(
            profile_points=[[16, 4096, "triton"], [16, 4096, "wgmma"], [16, 4096, "wgmma_tokens"]],
            trace_points=[[16, 4096, 1]],
            peer_points=[[16, 4096, 8]],
            pool_slots=50_000,
            max_total_tokens=2_000_000,
            reps=3,
            rounds=2,
            flush_mb=256,
            timeout_s=120,
            seed=0,
        ),
        about="Nsight Compute on each path's split kernel (DRAM/L2 bytes, occupancy, stalls) and the wgmma phase trace",
        requires=("cuda", "ncu", "nvcc"),
    ),
]

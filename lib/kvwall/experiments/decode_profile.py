"""Chapter 1's experiments: the 86 ms step, the cast kernel, and the two sweeps.

Each ``run_*`` function measures on the given device and returns a :class:`~kvwall.results.Result`
(not yet saved).
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable

import torch

from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache
from kvwall.measure.accuracy import relative_error
from kvwall.measure.profiler import CAST_OP, kernel_names, profile_ops
from kvwall.measure.timing import bench_ms, copy_bandwidth_gbps
from kvwall.model.attention import make_mla_decode
from kvwall.model.decode_step import PHASES, DecodeStepModel, RestOfLayerStandIn
from kvwall.model.geometry import GLM5
from kvwall.model.pool import TokenPool, make_decode_batch, random_kv
from kvwall.model.roofline import attention_read_bytes, full_pool_cast_bytes
from kvwall.model.strategies import FullPoolCast
from kvwall.results import Result, collect_provenance
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "short_kernel_name"]


def _result(name: str, device: torch.device, params: dict[str, Any], rows: list[dict]) -> Result:
    """The result, stamped with this module's provenance (its import closure is what the numbers depend on)."""
    return Result(name, params, rows, collect_provenance(device, __name__))


def run_decode_profile(
    device: torch.device,
    *,
    pool_tokens: int,
    layers: int,
    tensor_parallel: int,
    context_lens: list[int],
    timed_steps: int,
    profile_steps: int,
    seed: int = 0,
) -> Result:
    """The 86 ms step: whole-pool cast + MLA decode + stand-in, per layer, timed and profiled."""
    geometry = GLM5.with_tensor_parallel(tensor_parallel)
    pool = TokenPool.random(geometry, pool_tokens + 1, layers, device=device, seed=seed)
    batch = make_decode_batch(context_lens, pool.num_slots, seed=seed, device=device)
    attention = make_mla_decode("auto", geometry, batch)
    standin = RestOfLayerStandIn.from_original(GLM5.num_layers, device)
    model = DecodeStepModel(pool, batch, FullPoolCast(), attention, standin, seed=seed)
    rows: list[dict] = []

    model.step()  # warm-up: JIT, allocator, first-touch
    ckv, kpe = FullPoolCast().prepare_kv(pool, 0, torch.bfloat16)
    out = attention(model.q_nope, model.q_pe, ckv, kpe).double()
    ref = mla_decode_reference(
        model.q_nope,
        model.q_pe,
        *split_latent_cache(pool.key_buffer(0), geometry.kv_lora_rank),
        batch.kv_indptr,
        batch.kv_indices,
        geometry.sm_scale,
        compute_dtype=torch.float64,
    )
    rel_err = relative_error(out, ref)
    if not rel_err < 2e-2:
        raise RuntimeError(f"{attention.name} disagrees with the float64 reference: relative error {rel_err:.3g}.")
    rows.append({"section": "check", "attention": attention.name, "rel_err_vs_float64": rel_err})

    steps = [model.timed_step() for _ in range(timed_steps)]
    totals = [sum(r["ms"] for r in s) for s in steps]
    median = sorted(range(len(totals)), key=totals.__getitem__)[len(totals) // 2]
    for i, t in enumerate(totals):
        rows.append({"section": "step", "step": i, "ms": t})
    for r in steps[median]:
        rows.append({"section": "timeline", **r})
    for phase in PHASES:
        per_step = sorted(sum(r["ms"] for r in s if r["phase"] == phase) for s in steps)
        rows.append({"section": "breakdown", "phase": phase, "ms_per_step": per_step[len(per_step) // 2]})

    # The profiled steps carry their own wall clock, so that an op's share of the step divides two numbers
    # from the same steps (with the profiler's overhead in both), not the profiler's total by another run's step.
    profiled_ms: list[float] = []

    def profiled_step() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiled_ms.append((time.perf_counter() - start) * 1e3)

    prof = profile_ops(profiled_step, device, steps=profile_steps, labels=PHASES)
    profiled_ms = profiled_ms[1:]  # profile_ops runs one warm-up step before the profiler starts
    profiled_step_ms = sum(profiled_ms) / len(profiled_ms)  # a mean, as the profiler's per-step times are
    rows += [{"section": "ops", **r} for r in prof["ops"]]
    rows += [{"section": "kernels", "kernel": short_kernel_name(r["name"]), **r} for r in prof["kernels"]]
    step_ms = totals[median]
    cast_ms = next((r["ms_per_step"] for r in prof["ops"] if r["name"] == CAST_OP), 0.0)
    cast_bytes = full_pool_cast_bytes(geometry, pool.num_slots)
    rows.append(
        {
            "section": "summary",
            "step_ms": step_ms,
            "cast_op_ms_per_step": cast_ms,
            "profiled_step_ms": profiled_step_ms,
            "cast_share": cast_ms / profiled_step_ms,
            "layers": layers,
            "heads_per_gpu": geometry.heads_per_gpu,
            "pool_slots": pool.num_slots,
            "cast_bytes_per_layer": cast_bytes["total"],
            "standin_ms_per_layer": standin.ms_per_layer,
            "attention": attention.name,
            "device_kind": "cuda" if device.type == "cuda" else "cpu",
        }
    )
    params = dict(
        pool_tokens=pool_tokens,
        layers=layers,
        tensor_parallel=tensor_parallel,
        context_lens=list(context_lens),
        timed_steps=timed_steps,
        profile_steps=profile_steps,
        seed=seed,
    )
    return _result("decode_profile", device, params, rows)


def short_kernel_name(name: str) -> str:
    """``void at::native::unrolled_elementwise_kernel<...>(...)`` -> ``unrolled_elementwise_kernel``."""
    head = re.split(r"[<(]", name.replace("(anonymous namespace)::", ""), maxsplit=1)[0]
    return head.replace("void ", "").split("::")[-1].strip() or name[:60]


#: Copies with the cast's shape, to show which kernel each dtype pair gets.
_COPIES: dict[str, tuple[torch.dtype, Callable[[torch.Tensor], torch.Tensor]]] = {
    "fp8 -> bf16 (the cast)": (torch.float8_e4m3fn, lambda t: t.to(torch.bfloat16)),
    "uint8 -> int16 (same widths, integers)": (torch.uint8, lambda t: t.to(torch.int16)),
    "fp16 -> fp32": (torch.float16, lambda t: t.to(torch.float32)),
    "bf16 -> bf16 (same-dtype copy)": (torch.bfloat16, lambda t: t.clone()),
    "fp8 -> fp8 (same-dtype copy)": (torch.float8_e4m3fn, lambda t: t.clone()),
}


def run_cast_kernels(device: torch.device, *, pool_tokens: int, seed: int = 0) -> Result:
    """Which kernel PyTorch picks for each copy, and the bandwidth it reaches."""
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict] = []
    values = pool_tokens * GLM5.kv_dim
    for label, (dtype, fn) in _COPIES.items():
        if dtype == torch.uint8:
            src = torch.randint(0, 256, (pool_tokens, 1, GLM5.kv_dim), generator=gen, dtype=torch.uint8).to(device)
        else:
            src = random_kv((pool_tokens, 1, GLM5.kv_dim), generator=gen, device=device, dtype=dtype)
        out = fn(src)
        nbytes = values * (src.element_size() + out.element_size())
        ms = bench_ms(lambda: fn(src), device)  # noqa: F821
        kernel = "(CPU: no device kernels)"
        if device.type == "cuda":
            names = kernel_names(lambda: fn(src), device)  # noqa: F821
            kernel = short_kernel_name(names[0]) if names else "(none seen)"
        rows.append(
            {
                "section": "copies",
                "copy": label,
                "kernel": kernel,
                "bytes": nbytes,
                "ms": ms,
                "gbps": nbytes / (ms * 1e-3) / 1e9,
            }
        )
        del src, out
    copy_ms, copy_gbps = copy_bandwidth_gbps(device, values * 3 // 2)
    rows.append({"section": "device_copy", "bytes": values * 3, "ms": copy_ms, "gbps": copy_gbps})
    return _result("cast_kernels", device, {"pool_tokens": pool_tokens, "seed": seed}, rows)


def run_cast_sweep(device: torch.device, *, pool_tokens: list[int], seed: int = 0) -> Result:
    """Whole-pool cast time against pool size (one layer)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for n in pool_tokens:
        pool = random_kv((n + 1, 1, GLM5.kv_dim), generator=gen, device=device)
        ms = bench_ms(lambda: pool.to(torch.bfloat16), device)  # noqa: F821
        nbytes = full_pool_cast_bytes(GLM5, n + 1)["total"]
        rows.append(
            {"section": "sweep", "pool_tokens": n, "ms": ms, "bytes": nbytes, "gbps": nbytes / (ms * 1e-3) / 1e9}
        )
        del pool
    return _result("cast_sweep", device, {"pool_tokens": list(pool_tokens), "seed": seed}, rows)


def run_attention_sweep(
    device: torch.device, *, context_lens: list[int], tensor_parallel: int, pool_tokens: int, seed: int = 0
) -> Result:
    """BF16 MLA decode time (one request) against context length, on an already-cast pool."""
    geometry = GLM5.with_tensor_parallel(tensor_parallel)
    gen = torch.Generator().manual_seed(seed)
    pool = random_kv((pool_tokens + 1, 1, geometry.kv_dim), generator=gen, device=device, dtype=torch.bfloat16)
    ckv, kpe = split_latent_cache(pool, geometry.kv_lora_rank)
    rows = []
    for ctx in context_lens:
        batch = make_decode_batch([ctx], pool.shape[0], seed=seed, device=device)
        attention = make_mla_decode("auto", geometry, batch)
        q_nope = random_kv(
            (1, geometry.heads_per_gpu, geometry.kv_lora_rank), generator=gen, device=device, dtype=torch.bfloat16
        )
        q_pe = random_kv(
            (1, geometry.heads_per_gpu, geometry.qk_rope_head_dim), generator=gen, device=device, dtype=torch.bfloat16
        )
        ms = bench_ms(lambda: attention(q_nope, q_pe, ckv, kpe), device)
        nbytes = attention_read_bytes(geometry, ctx)
        rows.append(
            {
                "section": "sweep",
                "context_len": ctx,
                "ms": ms,
                "bytes": nbytes,
                "gbps": nbytes / (ms * 1e-3) / 1e9,
                "attention": attention.name,
            }
        )
    params = {
        "context_lens": list(context_lens),
        "tensor_parallel": tensor_parallel,
        "pool_tokens": pool_tokens,
        "seed": seed,
    }
    return _result("attention_sweep", device, params, rows)


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "decode_profile",
        run_decode_profile,
        full=dict(
            pool_tokens=495_000, layers=78, tensor_parallel=4, context_lens=[8192], timed_steps=5, profile_steps=3
        ),
        small=dict(
            pool_tokens=50_000, layers=4, tensor_parallel=4, context_lens=[2048], timed_steps=3, profile_steps=2
        ),
        about="one decode step, layer by layer: whole-pool cast, MLA decode, stand-in",
        requires=("cuda", "flashinfer"),
    ),
    Experiment(
        "cast_kernels",
        run_cast_kernels,
        full=dict(pool_tokens=495_000),
        small=dict(pool_tokens=50_000),
        about="which kernel each copy gets, and its GB/s against a plain device copy",
        requires=("cuda",),
    ),
    Experiment(
        "cast_sweep",
        run_cast_sweep,
        full=dict(pool_tokens=[65_536, 131_072, 262_144, 495_000, 1_048_576]),
        small=dict(pool_tokens=[8_192, 16_384, 32_768, 65_536]),
        about="whole-pool cast time against pool size",
        requires=("cuda",),
    ),
    Experiment(
        "attention_sweep",
        run_attention_sweep,
        full=dict(
            context_lens=[1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072], tensor_parallel=4, pool_tokens=495_000
        ),
        small=dict(context_lens=[256, 1024, 4096], tensor_parallel=4, pool_tokens=16_384),
        about="MLA decode time against context length, 16 heads per GPU",
        requires=("cuda", "flashinfer"),
    ),
]

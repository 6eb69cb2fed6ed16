"""Tune the fused FP8 MLA decode kernel on the GPU at hand: ``python -m kvwall.tuning.fused``.

One run, one GPU. Every candidate launch shape of the Triton path (:mod:`kvwall.kernels.mla_decode.kernel`: heads
and tokens per program step, warps, software-pipeline stages, 16-bit pairs) is first
checked against a float32 reference on a mixed-length batch, then timed at batch 1, 128K tokens of a 495K-slot
FP8 pool for 16, 64 and 128 heads, inside CUDA graphs (so no host launch overhead), with a 256 MB buffer
zeroed before every call so the pool rows are not left in L2. The best few per head count are then timed
across splits per request and contexts 4K / 32K / 128K. Registers, spills and shared memory come from the
compiled kernel. Beside them, in the same run: the device-to-device copy bandwidth and the BF16 matmul rate
(the roofline's two ceilings).

``--write`` stores the winners in ``kernels/mla_decode/tuned.json`` (keyed by GPU name and head count),
which :func:`kvwall.kernels.mla_decode.launch_shape.default_config` reads. Full numbers go to ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime as _dt
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import triton

from kvwall.kernels import mla_decode_reference
from kvwall.kernels.mla_decode.combine import LAST_COMPILED
from kvwall.kernels.mla_decode.launch_shape import (
    MLADecodeConfig,
    TUNED_CONFIG_FILE,
    compile_offline,
    default_config,
    split_constexprs,
    tuned_entry,
)
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8, plan_mla_decode_triton
from kvwall.measure.accuracy import relative_error
from kvwall.measure.failures import error_text
from kvwall.measure.profiler import profile_ops
from kvwall.measure.timing import copy_bandwidth_gbps, graph_ms, matmul_tflops
from kvwall.model.geometry import GLM5
from kvwall.model.roofline import roofline_us

__all__ = [
    "candidates",
    "graph_us",
    "kernel_times_us",
    "loop_instruction_mix",
    "main",
    "tune",
    "write_table",
    "TUNING_GPU",
]

POOL_TOKENS = 495_000
DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
D = DC + DR
#: The GPU whose tuned shapes :func:`loop_instruction_mix` compiles when given no config (the book's GPU).
TUNING_GPU = "NVIDIA H200"


def candidates(heads: int) -> list[MLADecodeConfig]:
    """Launch shapes tried for a head count: every one a shape the kernel has (its options are the ones some tuned
    entry selected; the others are retired, their measurements in ``kernels/mla_decode/NOTES.md``)."""
    out = []
    if heads <= 16:
        out += [
            MLADecodeConfig(16, bn, w, st)
            for bn, w, st in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2))
        ]
        # the tile as 16-bit pairs of FP8 values (no byte loads from shared memory, one cvt per pair)
        out += [
            MLADecodeConfig(16, bn, w, st, pairs=True)
            for bn, w, st in ((64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (32, 4, 2), (32, 4, 3), (128, 8, 2))
        ]
    else:
        out += [
            MLADecodeConfig(64, 64, 8, 2),
            MLADecodeConfig(64, 64, 8, 3),
            MLADecodeConfig(32, 64, 4, 3),
            MLADecodeConfig(64, 32, 8, 3),
            MLADecodeConfig(64, 32, 8, 2),
            MLADecodeConfig(32, 64, 8, 2),
            MLADecodeConfig(32, 64, 8, 3),
            MLADecodeConfig(32, 64, 8, 3, pairs=True),
            MLADecodeConfig(64, 64, 8, 3, pairs=True),
            MLADecodeConfig(32, 64, 4, 2, pairs=True),
        ]
    return list(dict.fromkeys(out))


def graph_us(
    fn: Callable[[], object], flush: Callable[[], object] | None = None, reps: int = 10, rounds: int = 3
) -> float:
    """Device µs per call as chapter 5 times it: :func:`kvwall.measure.timing.graph_ms` over a graph of ``reps`` x
    [flush, call] minus one of ``reps`` x [flush] (``flush=None``: calls back to back), best of ``rounds``
    replays, after two warm-up calls."""
    device = torch.device("cuda", torch.cuda.current_device())
    return graph_ms([fn], device, repeat=reps, flush=flush, replays=rounds, reduce="min", warmup=2) * 1e3


def kernel_times_us(fn: Callable[[], object], calls: int = 20) -> dict[str, float]:
    """Device µs per call of each kernel ``fn`` launches (torch.profiler over ``calls`` calls, L2 warm)."""
    device = torch.device("cuda", torch.cuda.current_device())
    kernels = profile_ops(fn, device, steps=calls, top=64)["kernels"]
    return {k["name"][:60]: k["ms_per_step"] * 1e3 for k in kernels if k["ms_per_step"] > 0}


def loop_instruction_mix(
    heads: int = 16, tokens: int = 131072, config: MLADecodeConfig | None = None, gpu: str = TUNING_GPU
) -> dict:
    """Compile the split kernel for ``sm_90`` (no GPU needed: Triton's bundled ptxas) with the launch shape the
    launcher picks on ``gpu`` for (heads, tokens) (or ``config``) and count the PTX instructions of its main loop,
    per thread."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (silences its notice)
    if config is None:
        entry = tuned_entry(heads, tokens, gpu)
        if entry is None:
            raise LookupError(f"the tuned table has no entry for {gpu!r}; pass a config.")
        config = MLADecodeConfig(**entry["config"])
    ptx = (
        compile_offline("split", split_constexprs(config), config.num_warps, config.num_stages, 90)
        .asm["ptx"]
        .splitlines()
    )
    labels = {l.split(":")[0].strip(): i for i, l in enumerate(ptx) if re.match(r"^\$L__BB\d+_\d+:", l.strip())}  # noqa: E741
    loop = (0, 0)
    for i, l in enumerate(ptx):  # the longest backward branch is the token loop  # noqa: E741
        m = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+);", l)
        if m and m.group(1) in labels and labels[m.group(1)] < i and i - labels[m.group(1)] > loop[1] - loop[0]:
            loop = (labels[m.group(1)], i)
    counts: collections.Counter = collections.Counter()
    byte_loads = 0
    for l in ptx[loop[0] : loop[1]]:  # noqa: E741
        m = re.match(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_]*)((?:\.[a-z0-9_]+)*)", l)
        if m:
            mods = m.group(2).split(".")
            op = m.group(1) + (
                f".{mods[1]}" if m.group(1) in ("ld", "st", "cp", "mma", "wgmma") and len(mods) > 1 else ""
            )
            counts[op] += 1
            byte_loads += m.group(0).strip().startswith("ld.shared") and m.group(2).endswith(".b8")
    shape = (
        f"{config.block_h} heads x {config.block_n} tokens, {config.num_warps} warps, {config.num_stages} stages"
        + (", pairs" if config.pairs else "")
    )
    return {
        "counts": counts,
        "total": sum(counts.values()),
        "byte_loads": byte_loads,
        "shape": shape,
        "triton": triton.__version__,
    }


def _resources() -> dict:
    k = LAST_COMPILED.get("split")
    md = getattr(k, "metadata", None)
    return {
        "regs": getattr(k, "n_regs", None),
        "spills": getattr(k, "n_spills", None),
        "shared_bytes": getattr(md, "shared", None),
    }


class Case:
    """One decode batch on the shared pool: requests of given lengths over random slots."""

    def __init__(self, pool: torch.Tensor, lens: list[int], heads: int, gen: torch.Generator) -> None:
        dev = pool.device
        self.lens = list(lens)
        self.heads = heads
        b = len(lens)
        self.q_nope = (torch.randn(b, heads, DC, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        self.q_pe = (torch.randn(b, heads, DR, device=dev, generator=gen) * 0.5).to(torch.bfloat16)
        self.indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        self.idx = torch.randint(0, pool.shape[0], (sum(lens),), device=dev, generator=gen, dtype=torch.int32)
        self.ckv, self.kpe = pool[:, 0, :DC], pool[:, 0, DC:]
        self.out = torch.empty(b, heads, DC, dtype=torch.bfloat16, device=dev)
        self.sm_scale = GLM5.sm_scale

    def run(self, config: MLADecodeConfig | None = None, num_splits: int | None = None) -> Callable[[], torch.Tensor]:
        """The planned call (:func:`plan_mla_decode_triton`) with ``config``; ``num_splits``: chunks per request at
        batch 1 (programs = that x head blocks), None: the launcher's default."""
        dev = self.q_nope.device
        cfg = config or default_config(self.heads, DC, dev, max(self.lens))
        programs = num_splits * triton.cdiv(self.heads, cfg.block_h) if num_splits else None
        plan = plan_mla_decode_triton(self.indptr, heads=self.heads, config=cfg, programs=programs)
        return lambda: mla_decode_fp8(
            self.q_nope,
            self.q_pe,
            self.ckv,
            self.kpe,
            self.indptr,
            self.idx,
            self.sm_scale,
            out=self.out,
            check_range=False,
            config=cfg,
            plan=plan,
        )

    def reference(self) -> torch.Tensor:
        return mla_decode_reference(
            self.q_nope,
            self.q_pe,
            self.ckv.float(),
            self.kpe.float(),
            self.indptr,
            self.idx,
            self.sm_scale,
            compute_dtype=torch.float32,
        )


def tune(
    heads_list=(16, 64, 128),
    *,
    screen_tokens: int = 131072,
    contexts=(4096, 32768, 131072),
    splits=(0, 16, 33, 66, 132, 264, 396),
    keep: int = 4,
    log: Callable[[str], object] = print,
) -> dict[str, Any]:
    """Screen every candidate at ``screen_tokens`` (batch 1), then time the best ``keep`` that do not spill registers
    per head count across ``contexts`` x ``splits`` (chunks per request at batch 1; 0: the launcher's default). Returns
    the report (see the module docstring); its ``roofline_us`` is :func:`kvwall.model.roofline.roofline_us` with the
    ceilings measured at the start."""
    t0 = time.perf_counter()
    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    _, copy_gbps = copy_bandwidth_gbps(dev, 1 << 30)
    tflops = matmul_tflops(dev)
    log(f"{gpu}: copy {copy_gbps:.0f} GB/s, bf16 matmul {tflops:.0f} TFLOP/s; triton {triton.__version__}")
    gen = torch.Generator(device=dev).manual_seed(0)
    pool = (torch.randn(POOL_TOKENS, 1, D, device=dev, generator=gen) * 0.7).to(torch.float8_e4m3fn)
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flush = scratch.zero_
    report = {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy_gbps,
        "bf16_tflops": tflops,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(),
        "screen": [],
        "sweep": [],
        "winners": {},
    }

    for heads in heads_list:
        check = Case(pool, [1, 777, 64, 4097, 33], heads, gen)
        want = check.reference()
        case = Case(pool, [screen_tokens], heads, gen)
        rows = []
        for cfg in candidates(heads):
            row = {"heads": heads, "tokens": screen_tokens, "config": dataclasses.asdict(cfg)}
            try:
                check.run(cfg)()
                got = check.out.float()
                row["rel_err"] = relative_error(got, want)
                row.update(_resources())
                if not row["rel_err"] <= 1e-2:
                    raise RuntimeError(f"rel. error {row['rel_err']:.2e}")
                row["us"] = graph_us(case.run(cfg), flush)
                row["roofline_us"] = roofline_us(heads, screen_tokens, copy_gbps, tflops)
            except Exception as exc:  # noqa: BLE001 - a failing candidate is a result, not a crash
                row["error"] = error_text(exc, 300)
            rows.append(row)
            log(json.dumps(row))
        report["screen"] += rows
        # Only shapes that do not spill registers are shipped (the architecture check's rule); the fastest of all is
        # kept in the report, so what the rule costs is on record.
        timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
        report.setdefault("fastest_any", {})[str(heads)] = timed[0] if timed else None
        good = [r for r in timed if r.get("spills") == 0][:keep]
        best_by_ctx = {}
        for r in good:
            cfg = MLADecodeConfig(**r["config"])
            for n in contexts:
                c = Case(pool, [n], heads, gen)
                for s in splits:
                    us = graph_us(c.run(cfg, s or None), flush)
                    row = {
                        "heads": heads,
                        "tokens": n,
                        "splits": s,
                        "config": r["config"],
                        "us": us,
                        "roofline_us": roofline_us(heads, n, copy_gbps, tflops),
                    }
                    report["sweep"].append(row)
                    if n not in best_by_ctx or us < best_by_ctx[n]["us"]:
                        best_by_ctx[n] = row
        for n, row in sorted(best_by_ctx.items()):
            row["kernels_us"] = kernel_times_us(
                Case(pool, [n], heads, gen).run(MLADecodeConfig(**row["config"]), row["splits"] or None)
            )
            log(
                f"heads {heads:4d} ctx {n:7d}: best {row['us']:8.1f} us (roofline {row['roofline_us']:.1f}) "
                f"splits {row['splits']} {row['config']} kernels {row['kernels_us']}"
            )
        report["winners"][str(heads)] = {str(n): row for n, row in best_by_ctx.items()}
    report["seconds"] = time.perf_counter() - t0
    return report


def write_table(report: dict) -> Path:
    """Store a report's winners (split-kernel shape and splits) in the launcher's tuned table."""
    path = TUNED_CONFIG_FILE
    table = json.loads(path.read_text()) if path.exists() else {}
    table[report["gpu"]] = {
        "by": "python -m kvwall.tuning.fused --write (combine shape: sized at launch, not tuned)",
        **{
            h: {
                n: {
                    "config": {k: v for k, v in r["config"].items() if not k.startswith("combine_")},
                    "splits": r["splits"],
                }
                for n, r in w.items()
            }
            for h, w in report["winners"].items()
        },
    }
    path.write_text(json.dumps(table, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvwall.tuning.fused", description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--screen-tokens", type=int, default=131072)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument(
        "--splits",
        type=int,
        nargs="+",
        default=[0, 16, 33, 66, 132, 264, 396],
        help="splits per request in the second stage (0: the launcher's default)",
    )
    ap.add_argument("--keep", type=int, default=4, help="configs per head count kept for the second stage")
    ap.add_argument("--out", default="fused_tune.json")
    ap.add_argument("--write", action="store_true", help="write the winners to kernels/mla_decode/tuned.json")
    ap.add_argument(
        "--profile-one",
        type=int,
        nargs=2,
        metavar=("HEADS", "TOKENS"),
        default=None,
        help="no tuning: 3 warm-up calls then one more of the default (tuned) launch, batch 1, for "
        "a profiler such as ncu (--launch-skip 3 --launch-count 1)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_tune: needs an NVIDIA GPU.", file=sys.stderr)
        return 2
    if args.profile_one:
        heads, n = args.profile_one
        pool = (torch.randn(POOL_TOKENS, 1, D, device="cuda") * 0.7).to(torch.float8_e4m3fn)
        fn = Case(pool, [n], heads, torch.Generator(device="cuda").manual_seed(0)).run()
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        print(_resources())
        return 0
    report = tune(
        args.heads,
        screen_tokens=args.screen_tokens,
        contexts=args.contexts,
        splits=args.splits,
        keep=args.keep,
        log=lambda m: print(m, flush=True),
    )
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")
    if args.write:
        print(f"wrote {write_table(report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Probe of the fused FP8 MLA decode kernel on a GPU: correctness against float64, then timing.

    python -m kvwall.fp8_mla_probe [--contexts 4096 32768 131072] [--heads 16] [--pool-tokens 495000]

Batch 1 (by default), 16 heads, each context a random set of slots of a 495K-token FP8 ``[slots, 1, 576]`` pool
(the kernel reads the strided views ``pool[:, 0, :512]`` / ``pool[:, 0, 512:]``). For each context:

- relative error of the kernel's BF16 output against :func:`mla_decode_reference` in float64 on the
  dequantized cache (pass: <= 1e-2), and the LSE's largest absolute error;
- ``triton.testing.do_bench`` (L2 flushed before each run; includes host launch overhead where the GPU
  waits for the host);
- CUDA-graph replay, L2 flushed before each call (a graph of [flush, call] x R minus a graph of [flush] x R),
  and with a hot L2 (calls back to back): device time without host launch overhead;
- achieved GB/s = active FP8 bytes (n x 576) / time, and the roofline n x 576 B / the copy bandwidth measured in
  the same run (a plain device-to-device copy, counting bytes read + written);
- a short sweep of ``num_splits`` (do_bench) and the compiled kernels' registers, spills and shared memory.

Finishes in well under 90 s on an H200. No FlashInfer needed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

__all__ = ["main"]

KV_BYTES_PER_TOKEN = 576
DC, DR = 512, 64


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def _graph_us(fn, flush, reps: int = 20, rounds: int = 5) -> tuple[float, float]:
    """(µs per call with L2 flushed before each, µs per call hot) from CUDA-graph replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as graph capture wants
        for _ in range(3):
            fn()
            flush()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = {}
    for name, body in (("flush+call", lambda: (flush(), fn())), ("flush", flush), ("call", fn)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                body()
        graphs[name] = g
    times = {}
    for name, g in graphs.items():
        g.replay()
        torch.cuda.synchronize()
        best = math.inf
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) * 1e3 / reps)
        times[name] = best
    return max(times["flush+call"] - times["flush"], 0.0), times["call"]


def _resources() -> str:
    from kvwall.kernels.mla_decode_fp8 import LAST_COMPILED

    parts = []
    for name, k in LAST_COMPILED.items():
        md = getattr(k, "metadata", None)
        shared = getattr(md, "shared", None) if md is not None else None
        parts.append(f"{name}: regs {getattr(k, 'n_regs', '?')}, spills {getattr(k, 'n_spills', '?')}, "
                     f"shared {shared} B, warps {getattr(md, 'num_warps', '?')}, stages {getattr(md, 'num_stages', '?')}")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvwall.fp8_mla_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--pool-tokens", type=int, default=495_000)
    ap.add_argument("--splits", type=int, nargs="*", default=[8, 16, 32, 64, 128, 256],
                    help="num_splits values of the sweep (empty: no sweep)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    ap.add_argument("--device", default="cuda", help="'cpu': a dry run of the checks in Triton's interpreter "
                    "(use small --contexts/--pool-tokens), no timing")
    args = ap.parse_args(argv)

    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("fp8_mla_probe: needs an NVIDIA GPU (CUDA); nothing to measure here.", file=sys.stderr)
        return 2
    import triton
    import triton.testing

    from kvwall.kernels import mla_decode_reference
    from kvwall.kernels.mla_decode_fp8 import MLADecodeConfig, default_config, default_num_splits, mla_decode_fp8
    from kvwall.timing import bench_ms, copy_bandwidth_gbps

    t_start = time.perf_counter()
    dev = torch.device(args.device)
    name = "CPU (Triton interpreter, dry run)" if cpu else torch.cuda.get_device_name(dev)
    print(f"device: {name}; torch {torch.__version__}, triton {triton.__version__}")
    copy_bytes = 1 << (20 if cpu else 30)
    _, copy_gbps = copy_bandwidth_gbps(dev, copy_bytes)
    print(f"copy bandwidth (read + write, a {copy_bytes >> 20} MiB copy): {copy_gbps:.0f} GB/s")

    g = torch.Generator(device=dev).manual_seed(args.seed)
    pool = (torch.randn(args.pool_tokens, 1, DC + DR, device=dev, generator=g) * 0.7).to(torch.float8_e4m3fn)
    ckv, kpe = pool[:, 0, :DC], pool[:, 0, DC:]
    ckv_scale, kpe_scale = 1.25, 0.5
    sm_scale = 1.0 / math.sqrt(192 + 64)
    flush_buf = torch.empty(1 << (10 if cpu else 28), dtype=torch.uint8, device=dev)

    def flush():
        flush_buf.zero_()

    rows = []
    for n in args.contexts:
        b, h = args.batch, args.heads
        q_nope = (torch.randn(b, h, DC, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        q_pe = (torch.randn(b, h, DR, device=dev, generator=g) * 0.5).to(torch.bfloat16)
        idx = torch.randperm(args.pool_tokens, device=dev, generator=g)[: b * n].to(torch.int32)
        indptr = torch.arange(0, b * n + 1, n, device=dev, dtype=torch.int32)
        row = {"batch": b, "heads": h, "context": n}

        # Launch shape: the default; should it fail to compile (resources), smaller ones, reported.
        config = None
        tried = []
        for cfg in (None, MLADecodeConfig(16, 16, 4, 1), MLADecodeConfig(16, 16, 4, 1, combine_block_d=64, combine_block_s=16)):
            try:
                out, lse = mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, ckv_scale=ckv_scale,
                                          kpe_scale=kpe_scale, return_lse=True, config=cfg)
                if not cpu:
                    torch.cuda.synchronize()
                config = cfg or default_config(h, DC, dev)
                break
            except Exception as exc:  # noqa: BLE001 - reported, then the next shape
                tried.append(f"{cfg or 'default'}: {type(exc).__name__}: {str(exc)[:300]}")
        for t in tried:
            print(f"  [context {n}] launch failed: {t}")
        if config is None:
            row["error"] = tried[-1] if tried else "no launch"
            rows.append(row)
            continue
        splits = default_num_splits(b, h, n, dev, config)
        row.update(config=str(config), num_splits=splits, resources=_resources())

        # The reference on the gathered, dequantized rows (float64), not on the whole pool.
        rows_idx = idx.long()
        want, want_lse = mla_decode_reference(
            q_nope, q_pe, ckv.index_select(0, rows_idx).double() * ckv_scale,
            kpe.index_select(0, rows_idx).double() * kpe_scale, indptr,
            torch.arange(b * n, device=dev, dtype=torch.int32), sm_scale, compute_dtype=torch.float64, return_lse=True)
        row["rel_err"] = _rel(out, want)
        row["lse_abs_err"] = float((lse.double() - want_lse).abs().max())
        row["ok"] = bool(torch.isfinite(out).all()) and row["rel_err"] <= 1e-2
        del want, want_lse

        kw = dict(ckv_scale=ckv_scale, kpe_scale=kpe_scale, out=out, num_splits=splits, check_range=False,
                  config=config)

        def call():
            mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, **kw)

        if cpu:
            row["do_bench_us"] = bench_ms(call, dev, rep_ms=1, min_reps=1) * 1e3
        else:
            row["do_bench_us"] = float(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")) * 1e3
        try:
            if cpu:
                raise RuntimeError("no CUDA graphs on CPU")
            row["graph_us"], row["graph_hot_l2_us"] = _graph_us(call, flush)
        except Exception as exc:  # noqa: BLE001
            row["graph_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        nbytes = b * n * KV_BYTES_PER_TOKEN
        row["active_bytes"] = nbytes
        row["roofline_us"] = nbytes / (copy_gbps * 1e9) * 1e6
        t_best = row.get("graph_us") or row["do_bench_us"]
        row["achieved_gbps"] = nbytes / (t_best * 1e-6) / 1e9
        row["pct_roofline"] = 100 * row["roofline_us"] / t_best
        row["launch_overhead_us"] = row["do_bench_us"] - row["graph_us"] if "graph_us" in row else None

        sweep = {}
        for s in ([] if cpu else args.splits):
            kw_s = {**kw, "num_splits": s}
            try:
                sweep[s] = float(triton.testing.do_bench(
                    lambda: mla_decode_fp8(q_nope, q_pe, ckv, kpe, indptr, idx, sm_scale, **kw_s),
                    warmup=10, rep=40, return_mode="median")) * 1e3
            except Exception as exc:  # noqa: BLE001
                sweep[s] = f"{type(exc).__name__}"
        row["splits_sweep_do_bench_us"] = sweep
        rows.append(row)
        print(f"  context {n}: rel err {row['rel_err']:.2e}, lse err {row['lse_abs_err']:.1e}, splits {splits}, "
              f"{row['resources']}  ({time.perf_counter() - t_start:.0f} s)")

    print()
    print(f"FP8 MLA decode, batch {args.batch}, {args.heads} heads, pool {args.pool_tokens} tokens, random slots; "
          f"roofline = n x 576 B / {copy_gbps:.0f} GB/s")
    head = (f"{'context':>8} {'ok':>3} {'rel err':>8} {'splits':>6} {'do_bench µs':>11} {'graph µs':>9} "
            f"{'hot-L2 µs':>9} {'GB/s':>6} {'roofline µs':>11} {'% roof':>6} {'launch µs':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['context']:>8}  launch failed: {r['error']}")
            continue
        fmt = lambda v, f: (format(v, f) if isinstance(v, (int, float)) else "-")  # noqa: E731
        print(f"{r['context']:>8} {'yes' if r['ok'] else 'NO':>3} {r['rel_err']:>8.1e} {r['num_splits']:>6} "
              f"{r['do_bench_us']:>11.1f} {fmt(r.get('graph_us'), '>9.1f'):>9} {fmt(r.get('graph_hot_l2_us'), '>9.1f'):>9} "
              f"{r['achieved_gbps']:>6.0f} {r['roofline_us']:>11.1f} {r['pct_roofline']:>5.0f}% "
              f"{fmt(r.get('launch_overhead_us'), '>9.1f'):>9}")
    if args.splits:
        print()
        print("num_splits sweep (do_bench µs): " + "; ".join(
            f"{r['context']}: " + ", ".join(f"{s}={v:.1f}" if isinstance(v, float) else f"{s}={v}"
                                             for s, v in r.get("splits_sweep_do_bench_us", {}).items())
            for r in rows))
    for r in rows:
        if "graph_error" in r:
            print(f"graph timing failed at {r['context']}: {r['graph_error']}")
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "copy_gbps": copy_gbps, "rows": rows}, fh, indent=1)
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

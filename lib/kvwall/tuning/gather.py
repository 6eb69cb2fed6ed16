"""Tune the chunked gather-cast kernel on the GPU at hand: ``python -m kvwall.tuning.gather``.

In one run, on one GPU, against the device-to-device copy measured in the same run: every candidate
launch shape of :func:`kvwall.kernels.gather.kernel` (chunks per program step, warps, grid, eviction
hints, load width) is first checked bit for bit against the torch reference on fresh random inputs,
then timed at n = 4K, 32K, 131K and 524K random slots of a 495K-slot pool (``triton.testing.do_bench``
medians; do_bench zeroes a 256 MB buffer between runs, so neither the pool rows nor the output are
left in the 60 MB L2), and at small n inside CUDA graphs of 16 calls, each on its own indices and
output (rotated, so L2 does not flatter). Beside them: the first version's tile kernel, the CUDA C++
twin and PyTorch's ``index_select().to()``. For the winner, other index layouts (sorted, allocator
runs) separate the cost of random rows from the rest.

The winners ("small": the best CUDA-graph time at n = 4K; "large": the best geometric mean over
n >= 32K) are written with ``--write`` to the tuned table the launcher reads
(``kernels/gather/tuned.json``), keyed by the GPU's name. A short table is printed last; the
full numbers go to ``--out``/gather_tune.json.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

from kvwall.kernels import gather_cast_reference
from kvwall.kernels.gather.cuda import launch_gather_cuda
from kvwall.kernels.gather.kernel import GatherConfig, launch_gather, plan_gather
from kvwall.kernels.gather.reference import bits
from kvwall.measure.timing import bench_ms, copy_bandwidth_gbps, graph_ms
from kvwall.model.geometry import GLM5
from kvwall.model.pool import make_decode_batch, random_kv
from kvwall.model.roofline import gather_cast_bytes

__all__ = ["candidates", "main"]

SIZES = (4096, 32768, 131072, 524288)
GRAPH_SIZES = (4096, 16384)
POOL_TOKENS = 495_000
D = GLM5.kv_dim


def candidates() -> list[GatherConfig]:
    """The launch shapes tried: (compiled variant) x (grid)."""
    out = []
    for block, warps in ((64, 2), (128, 4), (256, 4), (512, 8), (512, 4), (1024, 8)):
        for pps in (0, 2, 4, 8, 16):
            out.append(GatherConfig(block, warps, pps))
    for pps in (0, 8):
        out.append(GatherConfig(256, 4, pps, evict_loads=False))
        out.append(GatherConfig(256, 4, pps, evict_stores=True))
        out.append(GatherConfig(256, 4, pps, load_vec=16))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvwall.tuning.gather", description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="merge the winners into this tuned table (JSON)")
    ap.add_argument("--out", type=Path, help="folder for gather_tune.json (all numbers)")
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="run the script's logic on a CPU at toy sizes (interpreter; numbers mean nothing)",
    )
    ap.add_argument("--summary", type=Path, help="print the recorded gather_cast_* results in this folder, then exit")
    args = ap.parse_args(argv)
    if args.summary:
        return summarize(args.summary)
    smoke = args.cpu_smoke
    if not smoke and not torch.cuda.is_available():
        print(
            "gather_tune needs an NVIDIA GPU (it times compiled kernels); --cpu-smoke checks the script.",
            file=sys.stderr,
        )
        return 2
    t_start = time.time()
    dev = torch.device("cpu" if smoke else "cuda")
    name = "cpu-smoke" if smoke else torch.cuda.get_device_name(dev)
    pool_tokens = 3000 if smoke else POOL_TOKENS
    sizes, graph_sizes = ((64, 256, 512, 1024), (64,)) if smoke else (SIZES, GRAPH_SIZES)
    gen = torch.Generator().manual_seed(0)
    pool = random_kv((pool_tokens + 1, 1, D), generator=gen, device=dev)
    copy_ms, copy_gbps = copy_bandwidth_gbps(dev, pool_tokens * D * 3 // 2)

    def bench(fn) -> float:  # do_bench medians (10 ms warm-up); a smoke run times a call or two on the host
        return bench_ms(fn, dev, warmup_ms=10, rep_ms=0 if smoke else args.rep_ms, min_reps=1)

    def graph_ms_per_call(calls) -> float:  # one graph of all calls, do_bench over its replays
        if smoke:
            return bench(lambda: [c() for c in calls]) / len(calls)
        return graph_ms(calls, dev, reduce="do_bench", warmup_ms=10, rep_ms=args.rep_ms)

    def rand_idx(n: int) -> torch.Tensor:
        return torch.randint(1, pool_tokens + 1, (n,), generator=gen, dtype=torch.int32).to(dev)

    # Implementations: (label, launcher(plan)). Every tuned shape is checked first.
    impls: dict[str, object] = {}
    check_idx = rand_idx(301 if smoke else 70_001)
    check_idx[::97] = pool_tokens + 5  # out of range: NaN rows (unchecked launch)
    in_pool = check_idx <= pool_tokens
    want = gather_cast_reference(pool, torch.where(in_pool, check_idx, 0))
    want[~in_pool] = float("nan")
    failures = []
    for cfg in (candidates()[:3] + candidates()[-3:]) if smoke else candidates():
        out = torch.empty((check_idx.numel(), 1, D), dtype=torch.bfloat16, device=dev)
        plan = plan_gather(pool, check_idx, out=out, check_range=False)
        launch_gather(plan, config=cfg, variant="chunks")
        same = (bits(out) == bits(want)) | (torch.isnan(out) & torch.isnan(want))
        if not bool(same.all()):
            failures.append(cfg.label())
            continue
        impls[cfg.label()] = (cfg, lambda plan, cfg=cfg: launch_gather(plan, config=cfg, variant="chunks"))
    impls["v0: first version (tiles)"] = (None, lambda plan: launch_gather(plan, variant="tiles"))
    if not smoke:
        impls["CUDA C++ twin"] = (None, launch_gather_cuda)
    torch_label = "PyTorch index_select().to(bf16)"

    rows = []
    for n in sizes:
        idx = rand_idx(n)
        idx_long = idx.long()
        out = torch.empty((n, 1, D), dtype=torch.bfloat16, device=dev)
        plan = plan_gather(pool, idx, out=out, check_range=False)
        for label, (cfg, launch) in impls.items():
            ms = bench(lambda: launch(plan))  # noqa: F821
            rows.append(
                {
                    "kind": "events",
                    "impl": label,
                    "n": n,
                    "ms": ms,
                    "gbps": gather_cast_bytes(n) / ms / 1e6,
                    "of_copy": gather_cast_bytes(n) / ms / 1e6 / copy_gbps,
                }
            )
        ms = bench(lambda: pool.index_select(0, idx_long).to(torch.bfloat16))
        rows.append(
            {
                "kind": "events",
                "impl": torch_label,
                "n": n,
                "ms": ms,
                "gbps": gather_cast_bytes(n) / ms / 1e6,
                "of_copy": gather_cast_bytes(n) / ms / 1e6 / copy_gbps,
            }
        )
        del out, plan
    for n in graph_sizes:
        plans = [
            plan_gather(
                pool, rand_idx(n), out=torch.empty((n, 1, D), dtype=torch.bfloat16, device=dev), check_range=False
            )
            for _ in range(2 if smoke else 16)
        ]
        for label, (cfg, launch) in impls.items():
            ms = graph_ms_per_call([lambda p=p, launch=launch: launch(p) for p in plans])
            rows.append(
                {
                    "kind": "graph",
                    "impl": label,
                    "n": n,
                    "ms": ms,
                    "gbps": gather_cast_bytes(n) / ms / 1e6,
                    "of_copy": gather_cast_bytes(n) / ms / 1e6 / copy_gbps,
                }
            )
        del plans

    def pick(kind: str, ns) -> str:
        tuned = [label for label, (cfg, _) in impls.items() if cfg is not None]
        score = {}
        for label in tuned:
            ms = [r["ms"] for r in rows if r["kind"] == kind and r["impl"] == label and r["n"] in ns]
            score[label] = math.exp(statistics.fmean(math.log(m) for m in ms))
        return min(score, key=score.get)

    large = pick("events", [n for n in sizes if n >= (256 if smoke else 32768)])
    small = pick("graph", [graph_sizes[0]])
    winners = {"small": impls[small][0], "large": impls[large][0]}

    # Index layouts for the large winner: what random rows cost against sorted rows and allocator runs.
    layouts = []
    cfg_large = winners["large"]
    for n in (512,) if smoke else (131072, 524288):
        runs = make_decode_batch([min(n, pool_tokens)], pool_tokens + 1, seed=n).kv_indices
        for layout, idx in (
            ("random", rand_idx(n)),
            ("sorted (sequential rows)", torch.arange(n, dtype=torch.int32).remainder(pool_tokens).add(1).to(dev)),
            ("allocator runs of 1-256", runs.repeat(-(-n // runs.numel()))[:n].to(dev)),
        ):
            out = torch.empty((n, 1, D), dtype=torch.bfloat16, device=dev)
            plan = plan_gather(pool, idx, out=out, check_range=False)
            pair = [(large, lambda p: launch_gather(p, config=cfg_large, variant="chunks"))]
            if not smoke:
                pair.append(("CUDA C++ twin", launch_gather_cuda))
            for label, launch in pair:
                ms = bench(lambda: launch(plan))  # noqa: F821
                layouts.append(
                    {
                        "layout": layout,
                        "impl": label,
                        "n": n,
                        "ms": ms,
                        "gbps": gather_cast_bytes(n) / ms / 1e6,
                        "of_copy": gather_cast_bytes(n) / ms / 1e6 / copy_gbps,
                    }
                )
            del out, plan

    result = {
        "device": name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy_gbps,
        "copy_ms": copy_ms,
        "failed_checks": failures,
        "rows": rows,
        "layouts": layouts,
        "winners": {k: v.as_dict() for k, v in winners.items()},
        "winner_labels": {"small": small, "large": large},
        "seconds": time.time() - t_start,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gather_tune.json").write_text(json.dumps(result, indent=1))
    if args.write:
        try:
            table = json.loads(args.write.read_text())
        except (OSError, ValueError):
            table = {}
        table[name] = {
            **{k: v.as_dict() for k, v in winners.items()},
            "small_rows": 16384,
            "tuned": result["date"],
            "by": "python -m kvwall.tuning.gather",
            "torch": torch.__version__,
            "triton": triton.__version__,
        }
        args.write.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")

    # The short table: every implementation's % of copy per n (events), and graph µs at 4K.
    print(f"\n{name}: copy {copy_gbps:,.0f} GB/s; checks failed: {failures or 'none'}; {time.time() - t_start:.0f} s")
    labels = list(impls) + [torch_label]
    print(f"{'implementation':42s}" + "".join(f"{n:>8d}" for n in sizes) + "".join(f"  g{n} µs" for n in graph_sizes))
    for label in labels:
        line = f"{label[:42]:42s}"
        for n in sizes:
            r = next((r for r in rows if r["kind"] == "events" and r["impl"] == label and r["n"] == n), None)
            line += f"{r['of_copy']:>7.0%} " if r else "      - "
        for n in graph_sizes:
            r = next((r for r in rows if r["kind"] == "graph" and r["impl"] == label and r["n"] == n), None)
            line += f"{r['ms'] * 1e3:>8.2f} " if r else "       - "
        print(line)
    print("layouts (" + large + "):")
    for r in layouts:
        print(f"  {r['impl'][:28]:28s} {r['layout']:26s} n={r['n']:>7,}  {r['gbps']:7,.0f} GB/s  {r['of_copy']:.0%}")
    print(f"winners: small = {small}; large = {large}")
    return 0


def summarize(folder: Path) -> int:
    """A few lines from recorded gather_cast_bench / gather_cast_profile results."""

    def load(name):
        try:
            return json.loads((folder / f"{name}.json").read_text())
        except (OSError, ValueError) as exc:
            print(f"{name}: {exc}")
            return None

    bench, prof, val = load("gather_cast_bench"), load("gather_cast_profile"), load("gather_cast_validation")
    if val:
        bad = [r for r in val["rows"] if r.get("ok") is False]
        print(
            f"validation: {len(val['rows'])} rows, {len(bad)} not ok: "
            f"{[r.get('case', r.get('input')) for r in bad][:5]}"
        )
    if bench:
        rows = bench["rows"]
        cfg = [r for r in rows if r["section"] == "config"]
        if cfg:
            print("config:", cfg[0].get("small_label"), "|", cfg[0].get("large_label"), "| tuned:", cfg[0].get("tuned"))
        copy = next(r for r in rows if r["section"] == "copy")["gbps"]
        print(f"copy {copy:,.0f} GB/s")
        for r in rows:
            if (
                r["section"] == "sweep"
                and r["n"] in (4096, 32768, 131072, 524288)
                and r["layout"].startswith("batch 1,")
            ):
                print(
                    f"  {r['layout'][:8]} {r['impl'][:24]:24s} n={r['n']:>7,} {r['ms'] * 1e3:8.1f} us "
                    f"{r['gbps']:6,.0f} GB/s"
                    f" {r['of_copy']:.0%}"
                )
            if r["section"] == "graph" and r["n"] in (4096, 16384):
                print(f"  graph {r['impl'][:24]:24s} n={r['n']:>7,} {r['ms'] * 1e3:8.2f} us")
    if prof:
        for r in prof["rows"]:
            if r["section"] == "strategies":
                f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
                print(
                    f"  {r['strategy'][:26]:26s} marked {f(r['step_ms'])} unmarked {f(r.get('unmarked_step_ms'))} "
                    f"host {f(r.get('host_enqueue_ms'))} graph {f(r.get('graph_step_ms'))} "
                    f"(phases {f(r.get('graph_phase_sum_ms'))}, kv {f(r.get('graph_kv_ms_per_step'))}) "
                    f"syncs {r.get('syncs_per_step')} prep {f(r.get('host_us_prepare_kv'))}us "
                    f"attn {f(r.get('host_us_attention'))}us {r.get('graph_error') or ''}"
                )
            if r["section"] == "capacity":
                g = r.get("ms_per_layer_graph")
                print(
                    f"  cap {r['strategy'][:24]:24s} {r['capacity']:>7,} graph {(g or 0) * 1e3:.1f} us "
                    f"events {r.get('ms_per_layer_events', 0) * 1e3:.1f} us host {r.get('host_us_per_call', 0):.1f} us"
                )
        marked = [r for r in prof["rows"] if r["section"] == "marked_steps"]
        for strategy in dict.fromkeys(r["strategy"] for r in marked):
            for gc_off in (False, True):
                sel = [r for r in marked if r["strategy"] == strategy and r["gc_off"] == gc_off]
                med = lambda k: statistics.median(r[k] for r in sel)  # noqa: E731
                print(
                    f"  marked {strategy[:24]:24s} gc_off={gc_off!s:5s} step {med('step_ms'):.2f} "
                    f"host {med('host_ms'):.2f} "
                    f"kv_free {med('kv_free_ms'):.2f} maxgap {max(r['max_host_gap_ms'] for r in sel):.2f} "
                    f"gaps>1ms {sum(r['host_gaps_over_1ms'] for r in sel)} gc {sum(r['gc_passes'] for r in sel)} "
                    f"gen2 {sum(r['gc_gen2'] for r in sel)} gc_ms {sum(r['gc_ms'] for r in sel):.1f} "
                    f"steps {[round(r['step_ms'], 1) for r in sel]}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Exploration (not recorded): the Triton combine's launch shape after the wgmma paths' split kernels, at chapter 5's
batch points (page 64, mixed lengths as the bench makes them). Times launch_combine alone (triton.testing.do_bench,
L2 flushed) per (combine_block_d, combine_block_s, combine_warps), checks each output equals the default's."""
import dataclasses, itertools, json, os, sys, time
import torch, triton
from kvwall.experiments.fused_decode.strategies import bench_lengths
from kvwall.kernels.mla_decode.kernel import launch_combine
from kvwall.kernels.mla_decode import wgmma as W, wgmma_tokens as T
dev = torch.device("cuda")
out_f = open(os.path.join(os.environ.get("OUT", "/tmp"), "combine_explore.jsonl"), "a")
gen = torch.Generator(device=dev).manual_seed(0)
slots = 495_000 // 64 * 64
pool = (torch.randn(slots, 576, generator=gen, device=dev) * 0.7).to(torch.float8_e4m3fn).view(slots // 64, 64, 576)
POINTS = [(128, 32768, 32, "wgmma"), (128, 131072, 8, "wgmma"), (128, 4096, 64, "wgmma"), (64, 131072, 8, "wgmma"),
          (64, 32768, 32, "wgmma"), (16, 131072, 32, "tokens"), (16, 32768, 8, "tokens"), (16, 131072, 1, "tokens"),
          (32, 131072, 32, "tokens")]
for h, c, b, path in POINTS:
    lens = bench_lengths(c, b, max_total=2_000_000, seed=1000 * b + c)
    pages = [-(-n // 64) for n in lens]
    perm = torch.randperm(slots // 64, generator=gen, device=dev)
    idx = torch.cat([perm[torch.randint(0, slots // 64 - p, (1,), generator=gen, device=dev).item():][:p] for p in pages]).to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    kv_len = torch.tensor(lens, dtype=torch.int32, device=dev)
    qn = (torch.randn(b, h, 512, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
    qp = (torch.randn(b, h, 64, generator=gen, device=dev) * 0.5).to(torch.bfloat16)
    planf, callf = ((W.plan_mla_decode_wgmma, W.mla_decode_fp8_wgmma) if path == "wgmma" else
                    (T.plan_mla_decode_wgmma_tokens, T.mla_decode_fp8_wgmma_tokens))
    plan = planf(indptr, kv_len, heads=h, page_size=64)
    args = (qn, qp, pool[:, :, :512], pool[:, :, 512:], indptr, idx, 1 / 16)
    out = callf(*args, kv_len=kv_len, check_range=False, plan=plan)
    ref = out.clone()
    whole = triton.testing.do_bench(lambda: callf(*args, kv_len=kv_len, check_range=False, plan=plan, out=out), warmup=20, rep=100)
    row = {"heads": h, "context": c, "batch": b, "path": path, "tokens": sum(lens), "items": plan.items,
           "combined": len(plan.work_list.combine), "max_chunks": plan.work_list.max_chunks,
           "part_rows": plan.part_o.shape[0], "part_mb": plan.part_o.numel() * 4 / 2**20, "whole_us": whole * 1e3, "cfg": {}}
    for bd, bs, w in itertools.product((32, 128, 512), (0, 16), (0, 4, 8)):
        cfg = dataclasses.replace(plan.config, combine_block_d=bd, combine_block_s=bs, combine_warps=w)
        p2 = dataclasses.replace(plan, config=cfg)
        try:
            o2 = torch.full_like(out, float("nan"))
            launch_combine(p2, o2, None)
            torch.cuda.synchronize()
            same = bool(torch.equal(o2.view(torch.int16), ref.view(torch.int16)))
            us = triton.testing.do_bench(lambda: launch_combine(p2, o2, None), warmup=10, rep=50) * 1e3
            row["cfg"][f"d{bd}_s{bs}_w{w}"] = [round(us, 1), same]
        except Exception as exc:
            row["cfg"][f"d{bd}_s{bs}_w{w}"] = str(exc)[:120]
    best = min((v[0], k) for k, v in row["cfg"].items() if isinstance(v, list))
    row["best"] = best
    line = json.dumps(row); print(line[:400], flush=True); out_f.write(line + "\n"); out_f.flush()

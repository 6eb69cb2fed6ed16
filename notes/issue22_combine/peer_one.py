"""Exploration: one strategy at one [heads, context, batch] point (chapter 5's grid point), called 4 times, for ncu.
python .dev/peer_one.py STRATEGY HEADS CONTEXT BATCH"""
import sys, torch
from kvwall.experiments.fused_decode.strategies import BuildContext, build_strategy, make_point
from kvwall.peers.flashmla import PAGE_SIZE
name, h, c, b = sys.argv[1], *map(int, sys.argv[2:5])
dev = torch.device("cuda")
gen = torch.Generator(device=dev).manual_seed(0)
pool = (torch.randn(495_000, 1, 576, generator=gen, device=dev) * 0.7).to(torch.float8_e4m3fn)
pt = make_point(h, c, b, pool_slots=495_000, max_total=2_000_000, gen=gen, seed=0, device=dev)
call, info = build_strategy(name, pt, pool, BuildContext(page_size=PAGE_SIZE))
for _ in range(4):
    call()
torch.cuda.synchronize()
print("tokens", sum(pt.lens), info.get("work_items"), file=sys.stderr)

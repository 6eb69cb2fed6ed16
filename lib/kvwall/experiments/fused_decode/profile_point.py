"""One call of one strategy at one bench point, inside a CUDA profiler window: what ``fused_decode_profile`` runs
under Nsight Compute (``ncu --profile-from-start off``) to profile ours and FlashMLA the same way, every kernel a
call launches included (a plan's fill, a query's quantization, the split kernel, the combine).

``python -m kvwall.experiments.fused_decode.profile_point STRATEGY HEADS CONTEXT BATCH [POOL_SLOTS MAX_TOTAL SEED]``:
the bench's pool (``POOL_SLOTS`` FP8 slots), its point (:func:`~kvwall.experiments.fused_decode.strategies.make_point`:
the same request lengths as ``fused_decode_bench`` at that point), the strategy built as the bench builds it, three
calls to warm up, then one call between ``cudaProfilerStart`` and ``cudaProfilerStop``. Exit status 0, or 2 with the
usage.
"""

from __future__ import annotations

import sys

import torch

from kvwall.experiments.fused_decode.strategies import BuildContext, build_strategy, make_point
from kvwall.model.geometry import GLM5

__all__ = ["main", "profiled_call"]

FP8 = torch.float8_e4m3fn
USAGE = (
    "usage: python -m kvwall.experiments.fused_decode.profile_point STRATEGY HEADS CONTEXT BATCH "
    "[POOL_SLOTS MAX_TOTAL SEED]"
)


def profiled_call(
    strategy: str, heads: int, context: int, batch: int, *, pool_slots: int, max_total: int, seed: int
) -> int:
    """Build ``strategy`` at the bench point (heads, context, batch) on a fresh pool, warm it up, and run one call in
    the profiler window; returns the point's tokens."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(seed)
    pool = (torch.randn(pool_slots, 1, GLM5.kv_dim, generator=gen, device=device) * 0.7).to(FP8)
    pt = make_point(
        heads, context, batch, pool_slots=pool_slots, max_total=max_total, gen=gen, seed=seed, device=device
    )
    call, _ = build_strategy(strategy, pt, pool, BuildContext())
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return pt.tokens


def main(argv: list[str]) -> int:
    """The command line (the module docstring)."""
    if len(argv) not in (4, 7):
        print(USAGE)
        return 2
    strategy, numbers = argv[0], [int(a) for a in argv[1:]]
    pool_slots, max_total, seed = numbers[3:] if len(numbers) == 6 else (495_000, 2_000_000, 0)
    tokens = profiled_call(strategy, *numbers[:3], pool_slots=pool_slots, max_total=max_total, seed=seed)
    print(f"profiled {strategy} at {numbers[0]} heads, context {numbers[1]}, batch {numbers[2]}: {tokens} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

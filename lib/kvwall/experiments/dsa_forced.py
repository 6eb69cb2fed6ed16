"""``dsa_forced_dense``: what SGLang 0.5.23 does when a dense MLA backend is forced on a DSA model (GLM-5,
DeepSeek-V3.2) with an FP8 cache -- established in SGLang's own modules, on a CPU.

Two sections:

- ``citations``: every fact of :data:`kvwall.peers.sglang_dsa.FACTS` (the accepted flags, the DSA defaults per GPU
  and cache dtype, the pool row, the head padding, the forced-dense code path) with the lines of the 0.5.23 wheel it
  rests on, each anchor checked against the wheel (:func:`kvwall.peers.sglang_source.sglang_source`, sha256-pinned);
- ``forced_dense``: :func:`kvwall.peers.sglang_dsa.reproduce_forced_dense` -- SGLang's own ``DSATokenToKVPool`` and
  ``MLATokenToKVPool`` given the same keys through their own ``set_mla_kv_buffer``, then read the way the dense
  FlashInfer backend's ``forward_decode`` reads them, and the flashmla/triton write path tried on the DSA pool.

Needs the network once (the wheel and three packages the import needs are downloaded into a cache); no GPU. About
45-60 s on a 2-core machine.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from kvwall.peers.sglang_dsa import FACTS, check_citations, cite_lines, reproduce_forced_dense
from kvwall.peers.sglang_source import VERSION, sglang_source
from kvwall.results import Result, collect_provenance
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS", "run_dsa_forced_dense"]


def run_dsa_forced_dense(device: torch.device, *, tokens: int, heads: int, seed: int) -> Result:
    """See the module docstring. ``device`` is where this runs (a CPU: SGLang's pools are built there)."""
    t0 = time.perf_counter()
    root = sglang_source()
    failing = set(line.split(":", 1)[0] for line in check_citations(root))
    lines = cite_lines(root)
    rows: list[dict] = [
        {
            "section": "citations",
            "fact": f.key,
            "value": f.value if isinstance(f.value, str) else repr(f.value),
            "lines": lines[f.key],
            "ok": f.key not in failing,
        }
        for f in FACTS
    ]
    forced = reproduce_forced_dense(tokens=tokens, heads=heads, seed=seed, source=root)
    rows.append(
        {
            "section": "forced_dense",
            "sglang": VERSION,
            **dataclasses.asdict(forced),
            "seconds_total": round(time.perf_counter() - t0, 1),
        }
    )
    return Result(
        "dsa_forced_dense", dict(tokens=tokens, heads=heads, seed=seed), rows, collect_provenance(device, __name__)
    )


EXPERIMENTS: list[Experiment] = [
    Experiment(
        "dsa_forced_dense",
        run_dsa_forced_dense,
        full=dict(tokens=64, heads=16, seed=0),
        small=dict(tokens=64, heads=16, seed=0),
        about="SGLang 0.5.23's own pools: a dense backend forced on a DSA model's FP8 pool (CPU)",
        requires=("network",),
    ),
]

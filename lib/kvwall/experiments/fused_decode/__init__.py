"""Chapter 5's experiments: ours (:func:`kvwall.kernels.mla_decode`, planned by :func:`kvwall.kernels.plan_mla_decode`)
and its paths -- the Triton path, the wgmma path and the tokens-on-M wgmma path -- tuned, timed, checked and profiled,
one module each, in recording order (each reads what the one before it wrote):

- :mod:`.tuning`: ``fused_decode_tuning`` (the Triton path's launch shapes screened and swept; writes tuned.json);
- :mod:`.kernel_paths`: ``fused_decode_paths`` (each path forced over the grid; ``record`` writes the dispatcher's
  kernel_paths.json from it);
- :mod:`.validation` (with :mod:`.contracts`): ``fused_decode_validation`` (each path and ours against float64 beside
  the BF16 path and the peers; every path's contracts; errors, CUDA graphs, memcheck);
- :mod:`.bench` (with :mod:`.strategies`, the one peer table): ``fused_decode_bench`` (ours and every peer timed
  against the roofline);
- :mod:`.profile`: ``fused_decode_profile`` (Nsight Compute on each path's split kernel, the wgmma phase trace).

Each module's provenance is its own import closure: the benchmark does not go stale when the validation changes.
"""

from kvwall.experiments.fused_decode import bench, kernel_paths, profile, tuning, validation
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS"]

#: In recording order: the tuning writes the table the Triton path reads, the paths experiment the table the
#: dispatcher reads; the validation and the bench run ours with both.
EXPERIMENTS: list[Experiment] = (
    tuning.EXPERIMENTS + kernel_paths.EXPERIMENTS + validation.EXPERIMENTS + bench.EXPERIMENTS + profile.EXPERIMENTS
)

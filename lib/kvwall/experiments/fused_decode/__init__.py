"""Chapter 5's experiments: the fused FP8 MLA decode kernel (:mod:`kvwall.kernels.mla_decode`), tuned, profiled,
checked and timed -- one module each:

- :mod:`.tuning`: ``fused_decode_tuning`` (launch shapes screened and swept; writes the tuned table);
- :mod:`.ncu`: ``fused_decode_ncu`` (Nsight Compute on the split launch);
- :mod:`.validation` (with :mod:`.contracts`): ``fused_decode_validation`` (accuracy against float64 beside the
  BF16 path and the peers; errors, CUDA graphs, memcheck);
- :mod:`.bench` (with :mod:`.bench_strategies`): ``fused_decode_bench`` (every strategy timed against the
  roofline);
- :mod:`.cuda_path`: ``fused_decode_cuda`` (the CUDA C++ path: validated, timed against the Triton path and
  FlashMLA, profiled).

Each module's provenance is its own import closure: the benchmark does not go stale when the validation changes.
"""

from kvwall.experiments.fused_decode import bench, cuda_path, ncu, tuning, validation
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS"]

#: In recording order: the tuning writes the table the others read.
EXPERIMENTS: list[Experiment] = (tuning.EXPERIMENTS + ncu.EXPERIMENTS + validation.EXPERIMENTS + bench.EXPERIMENTS
                                 + cuda_path.EXPERIMENTS)

"""Chapter 6's experiments: every way past the wall on the same decode step, and where each one wins.

- :mod:`.step`: ``decode_step_paths`` (chapter 1's decode step with every path, CUDA-graph replayed);
- :mod:`.sweep`: ``path_sweep`` (one layer of every path and FlashMLA along context, pool, batch and heads: what the
  cost model, :mod:`kvwall.model.cost`, is fitted on and validated against).

Each module's provenance is its own import closure.
"""

from kvwall.experiments.answer import step, sweep
from kvwall.experiments.registry import Experiment

__all__ = ["EXPERIMENTS"]

EXPERIMENTS: list[Experiment] = step.EXPERIMENTS + sweep.EXPERIMENTS

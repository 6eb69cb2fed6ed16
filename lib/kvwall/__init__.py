"""kvwall: the library the chapters of *The FP8 KV Cache Wall* call.

One concern per module: ``geometry`` (model shape, bytes arithmetic), ``pool`` (FP8 token pool and
page tables), ``attention`` (MLA decode back-ends), ``strategies`` (how a layer gets from the FP8
pool to attention), ``decode_step`` (the per-step model), ``timing``/``profiling`` (measurement),
``results`` (recorded runs with provenance), ``experiments`` (what ``python -m kvwall record`` runs),
``plots`` and ``chapter`` (what notebooks use). Kernels live in ``kvwall.kernels``.
"""

__version__ = "0.1.0"

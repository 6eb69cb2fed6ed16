"""Fused FP8 MLA decode (chapter 5): attention straight from the FP8 pool, never materializing BF16.

What a user calls -- "ours" -- is :mod:`.dispatch` (exported as ``kvwall.kernels.plan_mla_decode`` and
``kvwall.kernels.mla_decode``): a plan per decode step, a call per layer; the plan picks one of three paths and says
why (``choose_path``: from ``kernel_paths.json`` (:mod:`.path_table`), the measured crossovers per GPU model, else those
of a GPU of the same compute capability, else by capability and shape):

- the **Triton path** (``"triton"``), :mod:`.triton_path`: the split-KV kernel, its launcher (``mla_decode_fp8``) and
  its per-step plan (``plan_mla_decode_triton``: a balanced work list reused by every layer), the
  tuned launch shapes' lookup (``tuned_entry``, ``tuned.json``, written by ``python -m kvwall.tuning.fused --write``)
  and the fallback shapes filtered by what the device fits (``fallback_config``). Portable: every GPU Triton
  supports (SM100 and SM120 included) and the CPU interpreter;
- the **wgmma path** (``"wgmma"``), :mod:`.wgmma`: the CUDA C++ warpgroup-MMA split kernel for H100 / H200
  (``mla_decode_fp8_wgmma`` + ``plan_mla_decode_wgmma``; ``mla_decode_wgmma.cu`` with ``mla_decode_common.cuh``,
  sm_90a only), its build, ``ctypes`` binding and offline ptxas check;
- the **tokens-on-M wgmma path** (``"wgmma_tokens"``), :mod:`.wgmma_tokens`: the CUDA C++ kernel for few heads per
  GPU, a tile's 64 tokens as wgmma's M and 16 or 32 heads per CTA as its N (``mla_decode_fp8_wgmma_tokens`` +
  ``plan_mla_decode_wgmma_tokens``; ``mla_decode_wgmma_tokens.cu``, sm_90a only), with the wgmma path's checks,
  refusals, partials and combine (``NOTES.md``, generation 6).

What every path shares: :mod:`.checks` (the call's checks, before any launch); :mod:`.plan` (``MLADecodePlan``: the
work list on the device and the partial buffers, made once per step); :mod:`.work_list` (its host arithmetic,
``build_work_list``); :mod:`.combine` (the Triton combine kernel that merges the partials of every path).
Beside them: :mod:`.reference` (the torch
reference ``mla_decode_reference``, the seeded input generator ``make_mla_inputs`` and the float64 reference on the
dequantized cache ``reference64``); :mod:`.cases` (the validation case table every check uses: tests, recorded run,
sanitizer); :mod:`.sanitize` (what ``compute-sanitizer`` runs: ``python -m kvwall.kernels.mla_decode.sanitize``).
``NOTES.md``: what each design was predicted to do and did, and the retired mma.sync path and kernel options.
"""

import inspect
import sys
import types

from kvwall.kernels.mla_decode.dispatch import DecodePlan, plan_mla_decode
from kvwall.kernels.mla_decode.dispatch import mla_decode as _ours

__all__ = ["plan_mla_decode", "DecodePlan"]


class _Ours(types.ModuleType):
    """This package, callable as ours: ``from kvwall.kernels import mla_decode`` gives the package and
    ``mla_decode(q_nope, q_pe, ckv_cache, kpe_cache, plan, ...)`` runs :func:`.dispatch.mla_decode`, while
    ``import kvwall.kernels.mla_decode.wgmma`` still finds the package's modules (a function of the same name bound in
    ``kvwall.kernels`` would hide them)."""

    def __call__(self, q_nope, q_pe, ckv_cache, kpe_cache, plan, **run):
        return _ours(q_nope, q_pe, ckv_cache, kpe_cache, plan, **run)


sys.modules[__name__].__class__ = _Ours
__signature__ = inspect.signature(_ours)

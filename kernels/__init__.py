"""Kernels of the book, installed as ``kvwall.kernels`` (sources live in the top-level ``kernels/``).

One folder per kernel, each with its torch reference, seeded input generator, validation case table and
sanitizer program beside it:

- ``gather/`` (chapter 4): :func:`gather_cast` (Triton) and :func:`gather_cast_cuda` (its CUDA C++ twin) cast
  only the KV rows a page table references, FP8 -> BF16, into a compact buffer (:func:`plan_gather` validates a
  call once, :func:`compact_kv_indices` is the compact buffer's page table); :func:`full_cast` casts the whole
  pool in one vectorized pass; :func:`nvcc_compile_check` compiles the twin without a GPU. Reference and inputs:
  :func:`gather_cast_reference`, :func:`make_gather_inputs`.
- ``mla_decode/`` (chapter 5): **ours** -- :func:`plan_mla_decode` once per decode step, :func:`mla_decode` once per
  layer (FlashInfer's plan/run shape): MLA decode attention straight from the FP8 cache, one to eight query tokens a
  request (speculative decoding's verify, causal over the draft), on the path its plan chose (Triton anywhere; two
  warpgroup-MMA kernels on Hopper). :func:`mla_decode_fp8` is its Triton path by name (tests, benchmarks);
  :func:`mla_decode_reference`, MLA paged decode attention in torch, the correctness reference every attention path
  in the book is checked against (:func:`split_latent_cache` cuts an SGLang ``[slots, 1, 576]`` cache into its
  ``ckv``/``kpe`` views).
- ``_common.py``: what both kernels share (interpreter builds, host checks, tuned-table reading).
"""

from kvwall.kernels.gather.cuda import gather_cast_cuda, nvcc_compile_check
from kvwall.kernels.gather.kernel import compact_kv_indices, full_cast, gather_cast, plan_gather
from kvwall.kernels.gather.reference import gather_cast_reference, make_gather_inputs
from kvwall.kernels import mla_decode  # the package, callable as ours (kvwall.kernels.mla_decode's docstring)
from kvwall.kernels.mla_decode import DecodePlan, plan_mla_decode
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8
from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache

__all__ = [
    "gather_cast",
    "gather_cast_cuda",
    "full_cast",
    "plan_gather",
    "compact_kv_indices",
    "nvcc_compile_check",
    "gather_cast_reference",
    "make_gather_inputs",
    "plan_mla_decode",
    "mla_decode",
    "DecodePlan",
    "mla_decode_fp8",
    "mla_decode_reference",
    "split_latent_cache",
]

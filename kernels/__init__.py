"""Kernels of the book, installed as ``kvwall.kernels`` (sources live in the top-level ``kernels/``).

Each fast kernel has its torch reference beside it:

- :func:`mla_decode_reference` — MLA paged decode attention in torch, the correctness reference
  every attention path in the book is checked against.
- :func:`gather_cast` (Triton) and :func:`gather_cast_cuda` (its CUDA C++ twin) — cast only the KV
  rows a page table references, FP8 -> BF16, into a compact buffer; :func:`full_cast` — the whole
  pool in one vectorized pass. References and a seeded input generator: :mod:`kvwall.kernels.gather.reference`.
"""

from kvwall.kernels.gather.kernel import compact_kv_indices, full_cast, gather_cast, plan_gather
from kvwall.kernels.gather.cuda import gather_cast_cuda, nvcc_compile_check
from kvwall.kernels.mla_decode.kernel import mla_decode_fp8
from kvwall.kernels.mla_decode.reference import mla_decode_reference, split_latent_cache
from kvwall.kernels.gather.reference import full_cast_reference, gather_cast_reference, make_gather_inputs

__all__ = ["mla_decode_fp8", "mla_decode_reference", "split_latent_cache", "gather_cast", "gather_cast_cuda", "full_cast",
           "plan_gather", "compact_kv_indices", "nvcc_compile_check", "gather_cast_reference",
           "full_cast_reference", "make_gather_inputs"]

"""Kernels of the book, installed as ``kvwall.kernels`` (sources live in the top-level ``kernels/``).

Each fast kernel has its torch reference beside it. So far:

- :func:`mla_decode_reference` — MLA paged decode attention in torch, the correctness reference
  every attention path in the book is checked against.
"""

from .mla_reference import mla_decode_reference, split_latent_cache

__all__ = ["mla_decode_reference", "split_latent_cache"]

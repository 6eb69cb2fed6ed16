"""How a layer gets from the FP8 pool to something the attention kernel accepts.

A strategy's ``prepare_kv`` returns the ``(ckv, kpe)`` views attention reads for one layer.
Chapter 1's strategy is the original one; later chapters add theirs beside it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvwall.kernels import split_latent_cache

from .pool import TokenPool

__all__ = ["KVStrategy", "FullPoolCast", "STRATEGIES"]


class KVStrategy(Protocol):
    name: str

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...


class FullPoolCast:
    """SGLang ``flashinfer_mla`` with an FP8 KV cache, before the fix.

    ``forward_decode`` did ``k_buffer = token_to_kv_pool.get_key_buffer(layer_id).to(q.dtype)``:
    the *whole* layer's pool, every slot, cast to BF16 on every layer of every step, because the
    attention kernel only compiled for 16-bit KV. The cast is an ``aten::copy_``.
    """

    name = "full-pool cast (SGLang flashinfer_mla, FP8 KV)"

    def prepare_kv(self, pool: TokenPool, layer: int, dtype: torch.dtype):
        k_buffer = pool.key_buffer(layer).to(dtype)
        return split_latent_cache(k_buffer, pool.geometry.kv_lora_rank)


STRATEGIES: dict[str, type] = {"full_pool_cast": FullPoolCast}

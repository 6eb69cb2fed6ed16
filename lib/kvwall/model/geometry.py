"""The MLA geometry of GLM-5 (the bytes arithmetic built on it: :mod:`kvwall.model.roofline`).

Every number the book derives from the model's shape comes from here, so the text cannot drift
from the arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "MLAGeometry",
    "GLM5",
    "dtype_bytes",
]


@dataclass(frozen=True)
class MLAGeometry:
    """Shape of one model's multi-head latent attention (MLA), as the KV cache sees it.

    With MLA each token stores one compressed latent per layer: ``kv_lora_rank`` values (the
    "ckv" part, shared by all heads) plus ``qk_rope_head_dim`` rotary values (the "kpe" part).
    Decode absorbs the up-projections into the query, so attention runs in the latent space:
    query and key are ``kv_lora_rank + qk_rope_head_dim`` wide, values ``kv_lora_rank`` wide.
    """

    name: str
    num_layers: int
    num_dense_layers: int
    num_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel < 1 or self.num_heads % self.tensor_parallel:
            raise ValueError(
                f"tensor_parallel={self.tensor_parallel} must be a positive divisor of "
                f"num_heads={self.num_heads} (each GPU holds num_heads / tensor_parallel heads)."
            )

    @property
    def heads_per_gpu(self) -> int:
        return self.num_heads // self.tensor_parallel

    @property
    def kv_dim(self) -> int:
        """Values stored per token per layer: latent (ckv) + rotary (kpe)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the un-absorbed attention, 1/sqrt(qk_nope + qk_rope)."""
        return 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)

    def with_tensor_parallel(self, tensor_parallel: int) -> "MLAGeometry":
        return MLAGeometry(**{**self.__dict__, "tensor_parallel": tensor_parallel})


#: GLM-5 (zai-org config): 78 layers (3 dense), 64 heads, kv_lora_rank 512, rope 64.
#: Served at tensor parallel degree 4 in the original investigation: 16 heads per GPU.
GLM5 = MLAGeometry(
    name="GLM-5",
    num_layers=78,
    num_dense_layers=3,
    num_heads=64,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=192,
    v_head_dim=256,
    tensor_parallel=4,
)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

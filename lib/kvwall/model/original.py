"""The original investigation's figures, as its author reported them.

These are the only typed-in numbers of the book, and every page that shows one labels it as the
original's: GLM-5-NVFP4 on SGLang's ``flashinfer_mla`` backend, FP8 KV cache, on an RTX PRO 6000
Blackwell (SM120, about 1.8 TB/s GDDR7). Our own numbers are measured beside them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OriginalProfile", "ORIGINAL"]


@dataclass(frozen=True)
class OriginalProfile:
    gpu: str
    pool_tokens: int
    step_ms: float  # single-stream decode, one step
    cast_ms: float  # aten::copy_ / unrolled_elementwise_kernel per step
    cast_share: float  # as reported (64.6 / 86)
    cast_mb_per_layer: float  # "about 857 MB per layer per step"
    gather_cast_gain: float  # Option B (gather-then-cast), reported speed-up

    @property
    def non_cast_ms(self) -> float:
        """Everything in the step that was not the cast: MoE, all-reduce, attention, ..."""
        return self.step_ms - self.cast_ms


ORIGINAL = OriginalProfile(
    gpu="RTX PRO 6000 Blackwell (SM120)",
    pool_tokens=495_000,
    step_ms=86.0,
    cast_ms=64.6,
    cast_share=0.69,
    cast_mb_per_layer=857.0,
    gather_cast_gain=0.29,
)

"""SGLang's Triton MLA decode (``decode_attention_fwd``), loaded and called the way SGLang 0.5.23 calls it.

The kernel is imported from ``$KVWALL_SGLANG_PATH`` when that is set (a folder holding the kernel module's
unmodified import closure, e.g. the git-ignored ``.whl-sglang-min/``; its ``deps/`` subfolder, if any, is appended
to ``sys.path``), else from an installed ``sglang``. :func:`load_sglang` never raises: an import that fails is
returned as ``{"error", "source"}`` so a benchmark records it as a row.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvwall.measure.failures import error_text

__all__ = ["load_sglang", "sglang_max_kv_splits", "SGLangTritonMLA"]

_SGLANG: dict[str, Any] = {}


def load_sglang() -> dict[str, Any]:
    """SGLang's ``decode_attention_fwd`` and ``get_num_kv_splits_triton`` (loaded once): from
    ``$KVWALL_SGLANG_PATH`` (put first on ``sys.path``; its ``deps/``, if present, appended last) or an installed
    ``sglang``. Returns ``{"decode_attention_fwd", "get_num_kv_splits_triton", "source", "file"}`` or
    ``{"error", "source"}``."""
    if _SGLANG:
        return _SGLANG
    path = os.environ.get("KVWALL_SGLANG_PATH")
    info: dict[str, Any] = {"source": f"KVWALL_SGLANG_PATH={path}" if path else "installed sglang"}
    try:
        if path:
            if not os.path.isdir(os.path.join(path, "sglang")):
                raise FileNotFoundError(f"KVWALL_SGLANG_PATH={path} has no sglang/ folder")
            if path not in sys.path:
                sys.path.insert(0, path)
            deps = os.path.join(path, "deps")
            if os.path.isdir(deps) and deps not in sys.path:
                sys.path.append(deps)  # last: packages the machine already has win
        # pylint: disable=import-outside-toplevel  # optional peer, found at run time
        import sglang.kernels.ops.attention.decode_attention as decode_module
        from sglang.kernels.ops.attention.metadata import get_num_kv_splits_triton

        info.update(
            decode_attention_fwd=decode_module.decode_attention_fwd,
            get_num_kv_splits_triton=get_num_kv_splits_triton,
            file=decode_module.__file__,
        )
    except BaseException as exc:  # noqa: BLE001 - an import that fails is the strategy's error row
        info["error"] = f"sglang import failed: {error_text(exc, 600)}"
    _SGLANG.update(info)
    return _SGLANG


def sglang_max_kv_splits(sm_count: int, max_context_len: int, base: int = 8) -> int:
    """SGLang 0.5.23's ``max_kv_splits`` for MLA on CUDA (``_mla_decode_kv_splits_cap`` in
    ``sglang/srt/layers/attention/triton_backend.py``): ``max(base, min(next_pow2(SMs), next_pow2(ceil(max_context
    / 32))))`` with ``base`` = ``--triton-attention-num-kv-splits`` (default 8). It sizes ``attn_logits``; the
    per-request counts come from SGLang's own ``get_num_kv_splits_triton``."""

    def next_pow2(n: int) -> int:
        return 1 << (n - 1).bit_length() if n > 0 else 1

    if sm_count <= 0:
        return base
    return max(base, min(next_pow2(sm_count), next_pow2(-(-max_context_len // 32))))


@dataclass
class SGLangTritonMLA:
    """One page-size-1 decode batch for SGLang's Triton MLA kernel over an FP8 pool ``[slots, 1, 576]``: BF16 query
    ``[B, H, 576]``, int32 ``kv_indptr``/``kv_indices``/lengths. ``use_pdl``: programmatic dependent launch, as
    sgl_kernel enables it on SM90+ (:meth:`call` falls back without it when the launch is refused)."""

    q: torch.Tensor
    pool: torch.Tensor
    out: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    sm_scale: float
    kv_lora_rank: int = 512
    use_pdl: bool = False
    kernels: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(
        cls,
        q: torch.Tensor,
        pool: torch.Tensor,
        out: torch.Tensor,
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_lens: torch.Tensor,
        sm_scale: float,
        **kw: Any,
    ) -> "SGLangTritonMLA":
        """Loads SGLang (:func:`load_sglang`); raises RuntimeError with the import's error when it cannot."""
        kernels = load_sglang()
        if "error" in kernels:
            raise RuntimeError(kernels["error"])
        use_pdl = torch.cuda.get_device_capability(q.device)[0] >= 9  # sgl_kernel's is_arch_support_pdl on CUDA
        return cls(q, pool, out, kv_indptr, kv_indices, kv_lens, sm_scale, use_pdl=use_pdl, kernels=kernels, **kw)

    def own_splits(self, max_kv_splits: int, sm_count: int) -> torch.Tensor:
        """SGLang's own split policy (``triton_backend.get_num_kv_splits``): one kernel over the batch's lengths;
        returns the per-request split counts (int32, on the device)."""
        b, h = self.q.shape[0], self.q.shape[1]
        splits = torch.empty(b, dtype=torch.int32, device=self.q.device)
        self.kernels["get_num_kv_splits_triton"][(1,)](
            splits,
            self.kv_lens,
            b,
            1,
            h,
            1,
            max_kv_splits,
            sm_count,
            MAX_NUM_SEQ=256 if b < 256 else 1 << (b - 1).bit_length(),
        )
        return splits

    def call(self, num_kv_splits: torch.Tensor, max_kv_splits: int) -> Callable[[], torch.Tensor]:
        """The decode call with its scratch (``attn_logits``, ``attn_lse`` sized by ``max_kv_splits``) allocated
        here, outside whatever times the call."""
        b, h = self.q.shape[0], self.q.shape[1]
        logits = torch.empty(b, h, max_kv_splits, self.kv_lora_rank, dtype=torch.float32, device=self.q.device)
        lse = torch.empty(b, h, max_kv_splits, dtype=torch.float32, device=self.q.device)
        forward = self.kernels["decode_attention_fwd"]
        v_buffer = self.pool[:, :, : self.kv_lora_rank]

        def decode() -> torch.Tensor:
            forward(
                self.q,
                self.pool,
                v_buffer,
                self.out,
                self.kv_indptr,
                self.kv_indices,
                logits,
                lse,
                num_kv_splits,
                max_kv_splits,
                self.sm_scale,
                1.0,
                1.0,
                has_mla=True,
                use_pdl=self.use_pdl,
            )
            return self.out

        return decode

    def fixed_splits(self, splits: int) -> Callable[[], torch.Tensor]:
        """The call with every request on ``splits`` splits (``max_kv_splits = splits``)."""
        counts = torch.full((self.q.shape[0],), splits, dtype=torch.int32, device=self.q.device)
        return self.call(counts, splits)

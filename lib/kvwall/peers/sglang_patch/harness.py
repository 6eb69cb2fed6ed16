"""Drive SGLang 0.5.23's ``flashinfer_mla`` decode path (unpatched or patched) through its own code, outside SGLang.

:func:`run_decode` builds the backend object (``FlashInferMLAAttnBackend``, ``skip_prefill=True`` as SGLang's
draft backends do) from :func:`kvwall.peers.sglang_patch.load_patched_backend`, with the fewest fake SGLang
objects its decode path reads: a model runner, an FP8 MLA token pool per layer ``[slots + 1, 1, 576]`` (slot 0
reserved, as SGLang pads it), a request-to-token table, an index translator that packs ``kv_indices`` from it, a
decode ``forward_batch`` and a ``RadixAttention``-shaped layer. It then calls ``init_forward_metadata`` (where the
step's wrapper is planned) and ``forward_decode`` for every layer, eagerly (no CUDA graph).

The decode wrapper is :func:`recording_wrapper`'s class: it records what the backend plans and hands to ``run``
(the indices, the KV rows the planned indices reach), then runs real FlashInfer (given its class) or, on a CPU,
the torch reference (:func:`kvwall.kernels.mla_decode_reference`), since FlashInfer's kernels need a GPU.
:class:`WholePoolCastCounter` counts tensor ops that turn a whole FP8 pool into BF16.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvwall.kernels import mla_decode_reference
from kvwall.model.geometry import MLAGeometry
from kvwall.peers.sglang_patch import load_patched_backend
from kvwall.peers.sglang_patch.stubs import ForwardMode

__all__ = [
    "SGLangDecodeInputs",
    "make_decode_inputs",
    "recording_wrapper",
    "WholePoolCastCounter",
    "DecodeRun",
    "run_decode",
    "REFERENCE_ATTENTION",
]

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16
REFERENCE_ATTENTION = "recording fake wrapper + kvwall mla_decode_reference (torch, float32)"


@dataclass
class SGLangDecodeInputs:
    """One decode step as SGLang holds it: per-layer FP8 pools, the request table, lengths, per-layer queries."""

    geometry: MLAGeometry
    pools: list[torch.Tensor]  # per layer [slots + 1, 1, kv_dim] FP8; row 0 is SGLang's reserved padding slot
    req_to_token: torch.Tensor  # [requests, max_len] int32 pool slots
    lens: list[int]
    queries: list[torch.Tensor]  # per layer [B, H, kv_dim] BF16

    @property
    def slots(self) -> torch.Tensor:
        """The step's ``kv_indices`` (int64): each request's slots, in request order."""
        return torch.cat([self.req_to_token[b, :n] for b, n in enumerate(self.lens)]).long()

    @property
    def kv_indptr(self) -> torch.Tensor:
        ptr = [0]
        for n in self.lens:
            ptr.append(ptr[-1] + n)
        return torch.tensor(ptr, dtype=torch.int32, device=self.req_to_token.device)


def make_decode_inputs(
    geometry: MLAGeometry,
    lens: list[int],
    *,
    pool_slots: int,
    layers: int,
    seed: int,
    shared_prefix: int = 0,
    device: torch.device | str = "cpu",
) -> SGLangDecodeInputs:
    """Seeded inputs (generated on the CPU, so every device sees the same numbers): pools ~ N(0, 0.7^2) in FP8,
    queries ~ N(0, 0.5^2) in BF16, each request's slots distinct and random; with ``shared_prefix`` = k, every
    request after the first starts with the first request's first k slots (a radix-cache prefix)."""
    if sum(lens) > pool_slots:
        raise ValueError(f"{sum(lens)} tokens do not fit a pool of {pool_slots} slots.")
    g = torch.Generator().manual_seed(seed)
    d = geometry.kv_dim
    heads = geometry.heads_per_gpu
    pools = [(torch.randn(pool_slots + 1, 1, d, generator=g) * 0.7).to(FP8) for _ in range(layers)]
    free = torch.randperm(pool_slots, generator=g)[: sum(lens)] + 1  # slot 0 stays reserved
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    at = 0
    for b, n in enumerate(lens):
        table[b, :n] = free[at : at + n].to(torch.int32)
        at += n
        if b and shared_prefix:
            k = min(shared_prefix, n, lens[0])
            table[b, :k] = table[0, :k]
    queries = [(torch.randn(len(lens), heads, d, generator=g) * 0.5).to(BF16) for _ in range(layers)]
    dev = torch.device(device)
    return SGLangDecodeInputs(
        geometry, [p.to(dev) for p in pools], table.to(dev), list(lens), [q.to(dev) for q in queries]
    )


@dataclass
class _Plan:
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_lens: torch.Tensor
    sm_scale: float
    kv_dtype: torch.dtype


def recording_wrapper(inner: type | None = None) -> type:
    """A stand-in class for FlashInfer's ``BatchMLAPagedAttentionWrapper`` that records each ``plan`` and what each
    ``run`` reads, and computes with ``inner`` (FlashInfer's class) or, when None, the torch reference."""

    class RecordingMLAWrapper:
        def __init__(self, workspace: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            self.inner = inner(workspace, *args, **kwargs) if inner is not None else None
            self.plans: list[_Plan] = []
            self.reads: list[torch.Tensor] = []  # per run: the BF16 rows the planned indices reach [n, kv_dim]
            self.kv_rows: list[int] = []  # per run: rows of the KV buffer handed to run
            self.kv_dtypes: list[torch.dtype] = []

        def plan(
            self,
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_len_arr,
            num_heads,
            head_dim_ckv,
            head_dim_kpe,
            page_size,
            causal,
            sm_scale,
            q_data_type,
            kv_data_type,
            *args: Any,
            **kwargs: Any,
        ) -> None:
            n = int(kv_indptr[-1])
            self.plans.append(
                _Plan(kv_indptr.clone(), kv_indices[:n].clone(), kv_len_arr.clone(), float(sm_scale), kv_data_type)
            )
            if self.inner is not None:
                self.inner.plan(
                    qo_indptr,
                    kv_indptr,
                    kv_indices,
                    kv_len_arr,
                    num_heads,
                    head_dim_ckv,
                    head_dim_kpe,
                    page_size,
                    causal,
                    sm_scale,
                    q_data_type,
                    kv_data_type,
                    *args,
                    **kwargs,
                )

        def run(
            self,
            q_nope: torch.Tensor,
            q_pe: torch.Tensor,
            ckv: torch.Tensor,
            kpe: torch.Tensor,
            out: torch.Tensor | None = None,
            return_lse: bool = False,
            **kwargs: Any,
        ) -> Any:
            plan = self.plans[-1]
            rows = torch.cat([ckv.reshape(ckv.shape[0], -1), kpe.reshape(kpe.shape[0], -1)], dim=-1)
            self.reads.append(rows.index_select(0, plan.kv_indices.long()).clone())
            self.kv_rows.append(int(ckv.shape[0]))
            self.kv_dtypes.append(ckv.dtype)
            if self.inner is not None:
                return self.inner.run(q_nope, q_pe, ckv, kpe, out=out, return_lse=return_lse, **kwargs)
            if return_lse:
                raise NotImplementedError("the recording wrapper's reference path returns no LSE")
            res = mla_decode_reference(q_nope, q_pe, ckv, kpe, plan.kv_indptr, plan.kv_indices, plan.sm_scale)
            if out is None:
                return res.to(q_nope.dtype)
            out.copy_(res)
            return out

    return RecordingMLAWrapper


class _RaggedWrapper:
    """The prefill ragged wrapper the backend constructs and decode never uses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class WholePoolCastCounter(TorchDispatchMode):
    """Counts tensor ops that read an FP8 tensor of at least ``pool_numel`` values and produce a BF16 tensor that
    large: the whole-pool cast (``aten._to_copy``), however it is spelled. Triton and FlashInfer kernels do not go
    through torch's dispatcher, so a gather (or a fused kernel) is never counted."""

    def __init__(self, pool_numel: int) -> None:
        super().__init__()
        self.pool_numel = pool_numel
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # torch's protocol
        out = func(*args, **(kwargs or {}))
        if any(
            isinstance(t, torch.Tensor) and t.dtype == FP8 and t.numel() >= self.pool_numel
            for t in tree_leaves((args, kwargs or {}))
        ):
            if any(
                isinstance(t, torch.Tensor) and t.dtype == BF16 and t.numel() >= self.pool_numel
                for t in tree_leaves(out)
            ):
                self.count += 1
        return out


class _Pool:
    """SGLang's ``MLATokenToKVPool`` as decode reads it: ``dtype``, ``size``, ``page_size``, ``kv_lora_rank``,
    ``qk_rope_head_dim`` and ``get_key_buffer`` (every layer of the same layout)."""

    def __init__(self, pools: list[torch.Tensor], geometry: MLAGeometry) -> None:
        self.pools = pools
        self.dtype = pools[0].dtype
        self.page_size = 1
        self.size = pools[0].shape[0] - self.page_size
        self.kv_lora_rank = geometry.kv_lora_rank
        self.qk_rope_head_dim = geometry.qk_rope_head_dim
        self.calls = 0

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self.calls += 1
        return self.pools[layer_id]


class _Translator:
    """SGLang's ``kv_index_translator``: packs each request's slots from the request table into ``out``."""

    needs_read_translate = False

    def __init__(self, req_to_token: torch.Tensor) -> None:
        self.req_to_token = req_to_token

    def pack_read_stream(
        self,
        plan: Any,
        *,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        indptr: torch.Tensor,
        out: torch.Tensor,
    ) -> bool:
        at = 0
        for r, n in zip(req_pool_indices.tolist(), seq_lens.tolist()):
            out[at : at + n] = self.req_to_token[r, :n]
            at += n
        return True


@dataclass
class DecodeRun:
    """What one variant's decode step produced and what its wrapper saw."""

    variant: str
    outputs: list[torch.Tensor]  # per layer [B, H * kv_lora_rank] BF16
    whole_pool_casts: int
    plans: list[_Plan] = field(default_factory=list)
    reads: list[torch.Tensor] = field(default_factory=list)
    kv_rows: list[int] = field(default_factory=list)
    kv_dtypes: list[torch.dtype] = field(default_factory=list)
    gather_out_rows: int | None = None


def run_decode(variant: str, inp: SGLangDecodeInputs, *, flashinfer: bool, module: Any = None) -> DecodeRun:
    """One eager decode step, every layer, through the backend of ``variant`` (or ``module``, an already loaded
    backend module, e.g. one a test altered): FlashInfer when ``flashinfer`` (GPU), else the recording wrapper's
    torch reference."""
    device = inp.req_to_token.device
    inner = None
    ragged: type = _RaggedWrapper
    if flashinfer:
        import flashinfer as fi  # pylint: disable=import-outside-toplevel  # GPU machines only

        inner = fi.BatchMLAPagedAttentionWrapper
    wrapper_cls = recording_wrapper(inner)
    if module is None:
        module = load_patched_backend(
            variant,
            device=device,
            wrappers={"BatchMLAPagedAttentionWrapper": wrapper_cls, "BatchPrefillWithRaggedKVCacheWrapper": ragged},
        )
    else:
        module.__dict__.update(BatchMLAPagedAttentionWrapper=wrapper_cls, BatchPrefillWithRaggedKVCacheWrapper=ragged)
    geo = inp.geometry
    heads = geo.heads_per_gpu
    pool = _Pool(inp.pools, geo)
    req_pool = SimpleNamespace(size=inp.req_to_token.shape[0], req_to_token=inp.req_to_token)
    config = SimpleNamespace(
        context_len=inp.req_to_token.shape[1],
        num_attention_heads=heads,
        kv_lora_rank=geo.kv_lora_rank,
        qk_nope_head_dim=geo.kv_lora_rank,
        qk_rope_head_dim=geo.qk_rope_head_dim,
        v_head_dim=geo.kv_lora_rank,
        scaling=geo.sm_scale,
    )
    runner = SimpleNamespace(
        model_config=config,
        device=device,
        req_to_token_pool=req_pool,
        token_to_kv_pool=pool,
        kv_index_translator=_Translator(inp.req_to_token),
        page_size=1,
        dtype=BF16,
    )
    backend = module.FlashInferMLAAttnBackend(runner, skip_prefill=True)
    b = len(inp.lens)
    seq_lens = torch.tensor(inp.lens, dtype=torch.int32, device=device)
    batch = SimpleNamespace(
        forward_mode=ForwardMode(decode=True),
        batch_size=b,
        seq_lens=seq_lens,
        seq_lens_sum=sum(inp.lens),
        seq_lens_cpu=seq_lens.cpu(),
        req_pool_indices=torch.arange(b, dtype=torch.int64, device=device),
        kv_loc_plan=None,
        spec_info=None,
        out_cache_loc=None,
    )
    backend.init_forward_metadata(batch)
    counter = WholePoolCastCounter(inp.pools[0].numel())
    outputs = []
    with counter:
        for layer_id, q in enumerate(inp.queries):
            layer = SimpleNamespace(
                layer_id=layer_id,
                tp_q_head_num=heads,
                tp_k_head_num=1,
                tp_v_head_num=1,
                head_dim=geo.kv_dim,
                v_head_dim=geo.kv_lora_rank,
                scaling=geo.sm_scale,
                logit_cap=0.0,
            )
            outputs.append(backend.forward_decode(q.reshape(b, -1), None, None, layer, batch, save_kv_cache=False))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    w = backend.decode_wrapper
    gather_out = getattr(backend, "kvwall_out", None)
    return DecodeRun(
        variant,
        [o.clone() for o in outputs],
        counter.count,
        w.plans,
        w.reads,
        w.kv_rows,
        w.kv_dtypes,
        None if gather_out is None else int(gather_out.shape[0]),
    )

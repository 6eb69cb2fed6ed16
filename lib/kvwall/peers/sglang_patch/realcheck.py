"""Drive SGLang 0.5.23's real ``flashinfer_mla`` backend (:mod:`.real`), unpatched and patched, as SGLang's runners do.

One real ``MLATokenToKVPool`` (FP8 e4m3, ``layers`` layers), one real ``ReqToTokenPool`` and one real
``KVIndexTranslator`` serve every variant; each variant's ``FlashInferMLAAttnBackend`` is built over them with
``skip_prefill=False``. Minimal objects (``SimpleNamespace``) stand for what a ``ModelRunner`` holds (``model_config``,
``device``, the pools, ``page_size``, ``dtype``), for the ``ForwardBatch`` fields the backend reads and for the
``RadixAttention`` layer; the target-verify ``spec_info`` is SGLang's own ``EagleVerifyInput`` (chain, topk 1).

Phases (each compared with the unpatched backend and a float64 reference, whole-pool casts counted in torch's
dispatcher, :class:`~kvwall.peers.sglang_patch.harness.WholePoolCastCounter`, and judged by :func:`cast_problems`):

- ``decode/eager``: ``init_forward_metadata`` then ``forward_decode`` per layer;
- ``verify/eager``: ``init_forward_metadata`` (TARGET_VERIFY) then ``forward_extend`` per layer;
- ``decode/graph`` and ``verify/graph``: ``init_cuda_graph_state``; at capture
  ``init_forward_metadata_out_graph(in_capture=True)``, a warm-up forward, then ``torch.cuda.CUDAGraph`` capture of the
  forward of every layer; at each replay ``init_forward_metadata_out_graph(fb)`` (outside the graph) with longer
  requests than the replay before, then ``graph.replay()``.
- ``timing``: the decode graph of every layer replayed ``iters`` times, timed with CUDA events, per variant.

Casts in a graph: torch's dispatcher sees the ops recorded while a graph is captured, never the kernels a replay
launches. So the capture counts apart what the warm-up made (``warmup_casts``: the capture-time metadata call and the
warm-up forward) and what the captured graph holds (``capture_casts``: replayed every step); a replay counts what runs
outside the graph (``replay_casts``: its metadata call). A graph row's casts per step are the captured ones plus
those at replay.

On a CPU (``cuda=False``) FlashInfer cannot run: :class:`CpuMLAWrapper` (torch reference, FlashInfer's cuda-graph
buffer semantics: ``use_cuda_graph`` buffers, ``plan`` fills them, ``_cached_module.plan``) stands in for
``BatchMLAPagedAttentionWrapper``; the graph phases run their metadata calls and the forward without capture.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, Callable

import torch

from kvwall.kernels import mla_decode_reference
from kvwall.peers.sglang_patch.harness import WholePoolCastCounter
from kvwall.peers.sglang_patch.real import load_variant
from kvwall.peers.sglang_patch.stubs import device_torch
from kvwall.peers.sglang_patch.verdicts import TOL

__all__ = ["RealCheck", "CpuMLAWrapper", "TOL"]

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16


class _CpuModule:
    def __init__(self, owner: "CpuMLAWrapper") -> None:
        self.owner = owner

    def plan(self, *args: Any) -> None:  # FlashInfer's compiled plan: the fast plans call it with host arrays
        qo, kv, lens = args[3], args[4], args[5]
        self.owner.host = (qo.clone(), kv.clone(), lens.clone())


class CpuMLAWrapper:
    """CPU stand-in for FlashInfer's ``BatchMLAPagedAttentionWrapper`` (the torch reference, causal bottom-right as
    FlashInfer's), with its cuda-graph buffers: with ``use_cuda_graph`` the planned indptrs/indices are copied into
    the buffers given at construction, and ``run`` reads them (what a replayed FlashInfer kernel reads)."""

    def __init__(
        self,
        workspace,
        use_cuda_graph=False,
        qo_indptr=None,
        kv_indptr=None,
        kv_indices=None,
        kv_len_arr=None,
        backend="auto",
    ):
        self.graph = use_cuda_graph
        self._qo_indptr_buf, self._kv_indptr_buf, self._kv_indices_buf = qo_indptr, kv_indptr, kv_indices
        self._kv_len_arr_buf = kv_len_arr
        self._float_workspace_buffer = self._int_workspace_buffer = self._pin_memory_int_workspace_buffer = None
        self._cached_module = None
        self.state = None  # (qo_indptr, kv_indptr, kv_indices) of an eager plan
        self.host = None
        self._causal = False
        self._sm_scale = 1.0

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
        *a,
        **k,
    ):
        self._causal, self._sm_scale = causal, float(sm_scale)
        self._cached_module = _CpuModule(self)
        n = int(kv_indptr[-1])
        if self.graph:
            self._qo_indptr_buf[: len(qo_indptr)].copy_(qo_indptr)
            self._kv_indptr_buf[: len(kv_indptr)].copy_(kv_indptr)
            self._kv_indices_buf[:n].copy_(kv_indices[:n])
            self.state = None
        else:
            self.state = (qo_indptr.clone(), kv_indptr.clone(), kv_indices[:n].clone())

    def run(self, q_nope, q_pe, ckv, kpe, out=None, return_lse=False, **kwargs):
        if self.state is not None:
            qo, kv, idx = self.state
        else:
            qo_h, kv_h, _ = self.host if self.host is not None else (None, None, None)
            qo = self._qo_indptr_buf if qo_h is None else qo_h
            kv = self._kv_indptr_buf if kv_h is None else kv_h
            idx = self._kv_indices_buf
        res = _causal_reference(
            q_nope,
            q_pe,
            ckv[:, 0],
            kpe[:, 0],
            qo.long().cpu(),
            kv.long().cpu(),
            idx.long(),
            self._sm_scale,
            self._causal,
            torch.float32,
        )
        out.copy_(res)
        return out


def _causal_reference(q_nope, q_pe, ckv, kpe, qo_indptr, kv_indptr, kv_indices, sm_scale, causal, dtype):
    """MLA attention of ``qo`` rows per request over its ``kv`` rows, causal bottom-right aligned when ``causal``."""
    ptr, idx = [0], []
    bs = qo_indptr.numel() - 1
    for b in range(bs):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k0, k1 = int(kv_indptr[b]), int(kv_indptr[b + 1])
        for j in range(q1 - q0):
            n = (k1 - k0) - (q1 - q0) + j + 1 if causal else k1 - k0
            idx.append(kv_indices[k0 : k0 + n])
            ptr.append(ptr[-1] + n)
    dev = q_nope.device
    return mla_decode_reference(
        q_nope[: ptr.__len__() - 1].to(dtype),
        q_pe[: len(ptr) - 1].to(dtype),
        ckv.to(dtype),
        kpe.to(dtype),
        torch.tensor(ptr, device=dev, dtype=torch.int32),
        torch.cat(idx).to(dev),
        sm_scale,
        compute_dtype=dtype,
    )


class _Ragged:
    def __init__(self, *a, **k):
        pass


class RealCheck:
    """See the module docstring. ``imported``: :func:`kvwall.peers.sglang_patch.real.import_sglang`'s result."""

    def __init__(
        self,
        imported: dict[str, Any],
        *,
        device: torch.device,
        pool_slots: int,
        layers: int,
        context_len: int,
        max_bs: int,
        heads: int = 16,
        seed: int = 0,
        log: Callable[[str], None] = print,
    ):
        self.imp, self.dev, self.log = imported, torch.device(device), log
        self.cuda = self.dev.type == "cuda"
        self.layers, self.heads, self.ctx, self.max_bs = layers, heads, context_len, max_bs
        self.rank, self.rope = 512, 64
        self.dim = self.rank + self.rope
        self.sm_scale = 1.0 / (192**0.5)
        m = imported["modules"]
        self.ForwardMode = m["forward_batch_info"].ForwardMode
        self.gen = torch.Generator(device="cpu").manual_seed(seed)
        t0 = time.perf_counter()
        self.pool = m["memory_pool"].MLATokenToKVPool(
            size=pool_slots,
            page_size=1,
            dtype=FP8,
            kv_lora_rank=self.rank,
            qk_rope_head_dim=self.rope,
            layer_num=layers,
            device=str(self.dev),
            enable_memory_saver=False,
        )
        g = torch.Generator(device=self.dev).manual_seed(seed)
        for buf in self.pool.kv_buffer:  # FP8 values ~ N(0, 0.7^2), stored as SGLang stores FP8 (uint8 bytes)
            vals = torch.randn(buf.shape, generator=g, device=self.dev) * 0.7
            buf.copy_(vals.to(FP8).view(buf.dtype))
            del vals
        self.req_pool = m["memory_pool"].ReqToTokenPool(
            size=max_bs, max_context_len=context_len, device=str(self.dev), enable_memory_saver=False
        )
        self.translator = m["translator"].KVIndexTranslator(
            req_to_token=self.req_pool.req_to_token,
            token_to_kv_pool_allocator=None,
            token_to_kv_pool=self.pool,
            page_size=1,
            device=str(self.dev),
        )
        self.pool_numel = self.pool.get_key_buffer(0).numel()
        self.setup_s = time.perf_counter() - t0
        self.modules: dict[str, Any] = {}
        self.backends: dict[str, Any] = {}
        self.memory: dict[str, dict[str, Any]] = {}  # variant -> measured bytes (GPU only)
        self.variant_info: dict[str, Any] = {}

    # -- construction ------------------------------------------------------------------------------------------
    def runner(self) -> SimpleNamespace:
        cfg = SimpleNamespace(
            context_len=self.ctx,
            num_attention_heads=self.heads,
            kv_lora_rank=self.rank,
            qk_nope_head_dim=self.rank,
            qk_rope_head_dim=self.rope,
            v_head_dim=self.rank,
            scaling=self.sm_scale,
        )
        return SimpleNamespace(
            model_config=cfg,
            device=str(self.dev),
            req_to_token_pool=self.req_pool,
            token_to_kv_pool=self.pool,
            kv_index_translator=self.translator,
            page_size=1,
            dtype=BF16,
        )

    def module(self, variant: str):
        if variant not in self.modules:
            mod, info = load_variant(variant, self.imp)
            if not self.cuda:  # off the GPU: see the module docstring (a copy: SGLang's own module stays intact)
                import types  # pylint: disable=import-outside-toplevel

                copy = types.ModuleType(mod.__name__ + "__cpu")
                copy.__dict__.update(mod.__dict__)
                copy.torch = device_torch(self.dev)
                copy.BatchMLAPagedAttentionWrapper = CpuMLAWrapper
                copy.BatchPrefillWithRaggedKVCacheWrapper = _Ragged
                for name in (
                    "FlashInferMLAAttnBackend",
                    "FlashInferMLAIndicesUpdaterDecode",
                    "FlashInferMLAIndicesUpdaterPrefill",
                    "FlashInferMhaChunkKVRunner",
                ):
                    cls = getattr(mod, name)
                    new = type(name, (cls,), {})
                    for k, v in list(cls.__dict__.items()):
                        if callable(v) and hasattr(v, "__code__"):
                            fn = types.FunctionType(v.__code__, copy.__dict__, k, v.__defaults__, v.__closure__)
                            fn.__kwdefaults__ = v.__kwdefaults__
                            setattr(new, k, fn)
                    setattr(copy, name, new)
                for name in ("fast_mla_decode_plan", "fast_mla_prefill_plan"):
                    f = getattr(mod, name)
                    fn = types.FunctionType(f.__code__, copy.__dict__, name, f.__defaults__)
                    fn.__kwdefaults__ = f.__kwdefaults__
                    setattr(copy, name, fn)
                mod = copy
            self.modules[variant], self.variant_info[variant] = mod, info
        return self.modules[variant]

    def _allocated(self) -> int | None:
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.dev)
        return int(torch.cuda.memory_allocated(self.dev))

    def backend(self, variant: str, *, graph_state: bool):
        """The variant's backend (one eager, one with CUDA-graph state). On a GPU, the bytes the graph-state one's
        construction and ``init_cuda_graph_state`` left allocated are measured (``self.memory[variant]``)."""
        key = (variant, graph_state)
        if key not in self.backends:
            before = self._allocated()
            be = self.module(variant).FlashInferMLAAttnBackend(self.runner(), skip_prefill=False)
            if graph_state:
                be.init_cuda_graph_state(self.max_bs, self.max_bs * 8)
                after = self._allocated()
                mem = self.memory.setdefault(variant, {"setup_bytes": None, "capture_bytes": {}})
                mem["setup_bytes"] = None if before is None else after - before
                kv = getattr(be, "kvwall_kv", None)
                mem["compact_rows_reserved"] = int(getattr(kv, "capacity", 0) or 0) if kv is not None else None
            self.backends[key] = be
        return self.backends[key]

    # -- inputs ------------------------------------------------------------------------------------------------
    def fill_requests(self, lens: list[int], extra: int = 0) -> torch.Tensor:
        """Distinct random slots for each request's ``len + extra`` positions into rows 1.. of ``req_to_token``;
        returns those rows' slots (CPU, int64) per request, concatenated."""
        need = sum(n + extra for n in lens)
        slots = torch.randperm(self.pool.size, generator=self.gen)[:need] + 1  # slot 0: SGLang's padding slot
        at = 0
        for b, n in enumerate(lens):
            self.req_pool.req_to_token[1 + b, : n + extra] = slots[at : at + n + extra].to(self.dev, torch.int32)
            at += n + extra
        return slots

    def queries(self, rows: int) -> list[torch.Tensor]:
        return [
            (torch.randn(rows, self.heads, self.dim, generator=self.gen) * 0.5).to(BF16).to(self.dev)
            for _ in range(self.layers)
        ]

    def layer(self, i: int) -> SimpleNamespace:
        return SimpleNamespace(
            layer_id=i,
            tp_q_head_num=self.heads,
            tp_k_head_num=1,
            tp_v_head_num=1,
            head_dim=self.dim,
            v_head_dim=self.rank,
            scaling=self.sm_scale,
            logit_cap=0.0,
        )

    def batch(
        self, lens: list[int], *, verify: int = 0, mode: str | None = None, extend: list[int] | None = None
    ) -> SimpleNamespace:
        """The ``ForwardBatch`` fields the backend reads. ``mode``: ``decode``, ``verify`` (``verify`` draft tokens
        a request after its ``lens`` tokens), ``draft_extend`` (SGLang's DRAFT_EXTEND_V2: ``verify`` tokens a
        request, uniform, after ``lens`` prefix tokens; ``seq_lens`` include them) or ``prefill`` (EXTEND with a
        cached prefix: ``extend[b]`` new tokens after ``lens[b]`` prefix tokens)."""
        mode = mode or ("verify" if verify else "decode")
        bs = len(lens)
        fm = self.ForwardMode
        if mode in ("draft_extend", "prefill"):
            new = [verify] * bs if mode == "draft_extend" else list(extend or [])
            total = [n + e for n, e in zip(lens, new)]
            seq = torch.tensor(total, dtype=torch.int64, device=self.dev)
            fb = SimpleNamespace(
                forward_mode=fm.DRAFT_EXTEND_V2 if mode == "draft_extend" else fm.EXTEND,
                batch_size=bs,
                seq_lens=seq,
                seq_lens_cpu=seq.cpu(),
                seq_lens_sum=int(sum(total)),
                req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64, device=self.dev),
                positions=torch.zeros(sum(new), dtype=torch.int64, device=self.dev),
                kv_loc_plan=None,
                spec_info=None,
                out_cache_loc=None,
                attn_dcp_metadata=None,
                attn_attend_prefix_cache=None,
                extend_prefix_lens=torch.tensor(lens, dtype=torch.int32, device=self.dev),
                extend_prefix_lens_cpu=list(lens),
                extend_seq_lens_cpu=list(new),
            )
            if mode == "draft_extend":  # what the backend reads of SGLang's EagleDraftExtendInput
                fb.spec_info = SimpleNamespace(num_tokens_per_req=verify)
            return fb
        seq = torch.tensor(lens, dtype=torch.int64, device=self.dev)
        fb = SimpleNamespace(
            forward_mode=fm.TARGET_VERIFY if verify else fm.DECODE,
            batch_size=bs,
            seq_lens=seq,
            seq_lens_cpu=seq.cpu(),
            seq_lens_sum=int(sum(lens)),
            req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64, device=self.dev),
            positions=torch.zeros(bs * max(verify, 1), dtype=torch.int64, device=self.dev),
            kv_loc_plan=None,
            spec_info=None,
            out_cache_loc=None,
            attn_dcp_metadata=None,
            attn_attend_prefix_cache=None,
            extend_prefix_lens=None,
            extend_prefix_lens_cpu=None,
        )
        if verify:
            fb.spec_info = self.verify_input(lens, verify)
        return fb

    def verify_input(self, lens: list[int], ndt: int):
        """SGLang's ``EagleVerifyInput`` for a chain of ``ndt`` tokens per request (the fields verify reads)."""
        m = self.imp["modules"]
        bs = len(lens)
        i64 = dict(dtype=torch.int64, device=self.dev)
        n_mask = sum(lens) * ndt + ndt * ndt * bs
        return m["eagle_info"].EagleVerifyInput(
            draft_token=torch.zeros(bs * ndt, **i64),
            custom_mask=torch.ones(n_mask, dtype=torch.bool, device=self.dev),
            positions=torch.zeros(bs * ndt, **i64),
            retrieve_index=torch.arange(bs * ndt, **i64).view(bs, ndt),
            retrieve_next_token=torch.full((bs, ndt), -1, **i64),
            retrieve_next_sibling=torch.full((bs, ndt), -1, **i64),
            retrieve_cum_len=None,
            spec_steps=ndt - 1,
            topk=1,
            draft_token_num=ndt,
            capture_hidden_mode=m["forward_batch_info"].CaptureHiddenMode.FULL,
            seq_lens_sum=int(sum(lens)),
            seq_lens_cpu=torch.tensor(lens, dtype=torch.int64),
        )

    # -- reference ---------------------------------------------------------------------------------------------
    def reference(
        self, lens: list[int], qs: list[torch.Tensor], ndt: int = 0, extend: list[int] | None = None
    ) -> list[torch.Tensor]:
        """float64 attention over the dequantized pool: decode (every position), verify / draft-extend (``ndt``
        tokens a request, causal over them) or prefill (``extend[b]`` tokens after ``lens[b]``, causal)."""
        q_lens = list(extend) if extend is not None else [max(ndt, 1)] * len(lens)
        kv_lens = [n + (e if extend is not None else ndt) for n, e in zip(lens, q_lens)]
        ndt = ndt or (1 if extend is not None else 0)  # causal whenever a request has several query tokens
        qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist())
        kv = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0).tolist()))
        idx = torch.cat([self.req_pool.req_to_token[1 + b, :n].long() for b, n in enumerate(kv_lens)])
        outs = []
        for i, q in enumerate(qs):
            buf = self.pool.get_key_buffer(i)[:, 0]
            rows = buf.index_select(0, idx.to(self.dev)).double()
            compact = torch.arange(idx.numel(), device=self.dev)
            o = _causal_reference(
                q[..., : self.rank],
                q[..., self.rank :],
                rows[:, : self.rank],
                rows[:, self.rank :],
                qo,
                kv,
                compact,
                self.sm_scale,
                bool(ndt),
                torch.float64,
            )
            outs.append(o.reshape(q.shape[0], -1))
        return outs

    # -- steps -------------------------------------------------------------------------------------------------
    def _forward(self, be, fb, qs, ndt: int) -> list[torch.Tensor]:
        outs = []
        for i, q in enumerate(qs):
            flat = q.reshape(q.shape[0], -1)
            if ndt or not fb.forward_mode.is_decode_or_idle():
                outs.append(be.forward_extend(flat, None, None, self.layer(i), fb, save_kv_cache=False))
            else:
                outs.append(be.forward_decode(flat, None, None, self.layer(i), fb, save_kv_cache=False))
        return outs

    def eager(
        self,
        variant: str,
        lens: list[int],
        qs: list[torch.Tensor],
        ndt: int,
        *,
        mode: str | None = None,
        extend: list[int] | None = None,
    ) -> dict[str, Any]:
        be = self.backend(variant, graph_state=False)
        fb = self.batch(lens, verify=ndt, mode=mode, extend=extend)
        counter = WholePoolCastCounter(self.pool_numel)
        with counter:
            be.init_forward_metadata(fb)
            outs = self._forward(be, fb, qs, ndt)
        self._sync()
        return {"outputs": [o.clone() for o in outs], "casts": counter.count}

    def capture(self, variant: str, bs: int, ndt: int) -> dict[str, Any]:
        """A graph of every layer's forward for batch ``bs`` as SGLang's runner captures it (lengths at the fill
        value); its static query buffers and outputs."""
        be = self.backend(variant, graph_state=True)
        fill = be.get_cuda_graph_seq_len_fill_value()
        self.fill_requests([fill] * bs, extra=ndt)
        fb = self.batch([fill] * bs, verify=ndt)
        qs = [
            torch.zeros(bs * max(ndt, 1), self.heads, self.dim, dtype=BF16, device=self.dev) for _ in range(self.layers)
        ]
        before = self._allocated()  # after the model's query buffers: what follows is the backend's
        warm = WholePoolCastCounter(self.pool_numel)
        with warm:
            be.init_forward_metadata_out_graph(fb, in_capture=True)
            outs = self._forward(be, fb, qs, ndt)  # warm-up (SGLang runs the forward before capturing)
        graph, captured = None, None
        if self.cuda:
            self._sync()
            graph = torch.cuda.CUDAGraph()
            held = WholePoolCastCounter(self.pool_numel)
            with held:  # what the graph holds: a cast recorded here runs at every replay, unseen by the dispatcher
                with torch.cuda.graph(graph):
                    outs = self._forward(be, fb, qs, ndt)
            captured = held.count
        self._sync()
        if before is not None:  # what this capture left allocated: its metadata's buffers and the graph's pool
            self.memory[variant]["capture_bytes"][f"verify_{ndt}" if ndt else "decode"] = self._allocated() - before
        return {
            "backend": be,
            "graph": graph,
            "qs": qs,
            "outs": outs,
            "warmup_casts": warm.count,
            "capture_casts": captured,
            "bs": bs,
            "ndt": ndt,
            "variant": variant,
        }

    def replay(self, cap: dict[str, Any], lens: list[int], qs: list[torch.Tensor]) -> dict[str, Any]:
        be, ndt = cap["backend"], cap["ndt"]
        fb = self.batch(lens, verify=ndt)
        for dst, src in zip(cap["qs"], qs):
            dst.copy_(src)
        counter = WholePoolCastCounter(self.pool_numel)
        with counter:
            be.init_forward_metadata_out_graph(fb)
            if cap["graph"] is not None:
                cap["graph"].replay()
                outs = cap["outs"]
            else:  # CPU: the forward the graph holds, run without capture
                outs = self._forward(be, fb, cap["qs"], ndt)
        self._sync()
        return {"outputs": [o.clone() for o in outs], "casts": counter.count}

    def time_graph(self, cap: dict[str, Any], lens: list[int], qs: list[torch.Tensor], iters: int) -> dict[str, Any]:
        self.replay(cap, lens, qs)
        if cap["graph"] is None:
            return {"ms_per_step": None, "iters": 0}
        for _ in range(3):
            cap["graph"].replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            cap["graph"].replay()
            b.record()
        torch.cuda.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in ev)
        res = {
            "ms_per_step": ms[len(ms) // 2],
            "ms_min": ms[0],
            "ms_max": ms[-1],
            "iters": iters,
            "us_per_layer": ms[len(ms) // 2] * 1000 / self.layers,
        }
        if cap["variant"] == "fused":
            res.update(self.time_kernel_alone(cap, iters))
        return res

    def time_kernel_alone(self, cap: dict[str, Any], iters: int) -> dict[str, Any]:
        """Ours alone, every layer, in a CUDA graph, on what the captured backend's layers read (the same plan, the
        same query buffers, the same pool layers): median µs a layer, and the path the plan runs."""
        from kvwall.peers.sglang_patch.graph_plan import ours, plan_path  # pylint: disable=import-outside-toplevel

        be = cap["backend"]
        plan = next((p for w, p in be.kvwall_steps.items() if w is be.decode_cuda_graph_metadata.get(cap["bs"])), None)
        if plan is None:
            return {"kernel_error": "no plan of ours for the captured decode wrapper"}
        outs = [torch.empty(q.shape[0], self.heads, self.rank, dtype=BF16, device=self.dev) for q in cap["qs"]]

        def run():
            for i, q in enumerate(cap["qs"]):
                k = self.pool.get_key_buffer(i)
                ours(
                    q[..., : self.rank],
                    q[..., self.rank :],
                    k[:, :, : self.rank],
                    k[:, :, self.rank :],
                    plan,
                    out=outs[i],
                )

        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(3):
            graph.replay()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        ms = sorted(a.elapsed_time(b) for a, b in ev)
        return {"kernel_us_per_layer": ms[len(ms) // 2] * 1000 / self.layers, "kernel_path": plan_path(plan)}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.dev)

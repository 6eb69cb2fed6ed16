"""The one peer table: every way of computing one MLA decode that chapters 5 and 6 time, one :class:`Strategy` each.

A strategy is a name, a label for tables, what it reads (cache and query dtype, page size), what it needs
(prerequisites beyond a CUDA GPU) and one build function ``build(point, pool, context) -> (call, info)``: everything
outside the call -- plans, buffers, FlashInfer's ``plan()``, SGLang's split choice, one-off BF16 pools, FlashMLA's
metadata -- is done while building it; ``call()`` runs one decode into its own output and returns it; ``info`` holds
the row's fields (backend, plan ms, work items, the path ours ran, ...). Adding a peer is one entry of
:data:`STRATEGIES` and one build function. ``fused_decode_bench`` times them (chapter 5), ``path_sweep`` and
``decode_step_paths`` run them (chapter 6), the reports label them with :attr:`Strategy.label`.

- ``ours``: what a user calls -- :func:`kvwall.kernels.mla_decode` with the step's plan
  (:func:`kvwall.kernels.plan_mla_decode` on the host lengths, made once while building), on the path the plan
  picks (rows: ``kernel_path``, ``path_why``), page size 1;
- ``ours_page64``: the same on FlashMLA's layout (pages of 64, the same page table as the FlashMLA rows);
- ``triton`` / ``wgmma`` / ``wgmma_tokens``: one of ours' paths forced (the Triton path, the wgmma path, the
  tokens-on-M wgmma path; page size 1, or 64 with :attr:`BuildContext.page_size`);
- ``full_cast_bf16``: the original -- the whole pool cast to BF16 every call, then FlashInfer BF16 attention;
- ``index_then_cast``: PyTorch's ``pool.index_select(0, idx).to(bf16)`` of the rows the batch reads, then FlashInfer;
- ``gather_cast_bf16``: chapter 4 -- only the rows the batch reads, cast into a compact BF16 buffer, then FlashInfer;
- ``flashinfer_fp8_fa2`` / ``flashinfer_fp8_fa3``: FlashInfer's native FP8 MLA;
- ``flashinfer_bf16_precast``: FlashInfer BF16 attention alone, on a pool cast once outside the timing;
- ``sglang_triton_fp8``: SGLang's Triton MLA decode (:mod:`kvwall.peers.sglang`) with SGLang's own split policy;
- ``flashmla_dense_bf16`` / ``flashmla_dense_fp8``: FlashMLA (:mod:`kvwall.peers.flashmla`) on the same number of
  tokens per request laid out on random pages of 64 of the same pool (page 64 is the only size it takes; BF16 on a
  copy of the pool cast once outside the timing; FP8 with the query quantized inside the timing, as SGLang's
  ``flashmla`` backend does it: :func:`kvwall.peers.flashmla.quantize_query_static`).

Every FlashInfer BF16 strategy runs :attr:`BuildContext.cast_backend` (fa3 on Hopper; ``"fa2"`` gives the fa2 twin
chapter 6's sweep times), falling back to fa2 where fa3 refuses, saying why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal

import torch

from kvwall.kernels.gather.kernel import gather_cast
from kvwall.kernels.mla_decode.dispatch import mla_decode, plan_mla_decode
from kvwall.kernels.mla_decode.reference import mla_decode_reference
from kvwall.measure.failures import error_text
from kvwall.measure.timing import synchronize
from kvwall.model.attention import FlashInferMLADecode
from kvwall.model.geometry import GLM5
from kvwall.model.step_paths import KERNEL_NAMES
from kvwall.model.pool import mixed_lengths
from kvwall.peers.flashmla import PAGE_SIZE, FlashMLADecode, random_page_table
from kvwall.peers.sglang import SGLangTritonMLA, sglang_max_kv_splits

__all__ = [
    "STRATEGIES",
    "Strategy",
    "BuildContext",
    "BenchPoint",
    "Call",
    "bench_lengths",
    "make_point",
    "build_strategy",
    "paged_layout",
    "paged_pool",
    "reference_f64",
    "OURS",
    "FORCED_PATHS",
]

DC, DR = GLM5.kv_lora_rank, GLM5.qk_rope_head_dim
D = DC + DR
BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
SM_SCALE = GLM5.sm_scale

Call = Callable[[], torch.Tensor]


@dataclass
class BenchPoint:
    """One (heads, context, batch) point: request lengths, BF16 queries, and page-size-1 slots of the pool."""

    heads: int
    context: int
    batch: int
    lens: list[int]
    q_nope: torch.Tensor
    q_pe: torch.Tensor
    indptr: torch.Tensor
    idx: torch.Tensor
    lens_t: torch.Tensor
    seed: int = 0

    @property
    def tokens(self) -> int:
        return sum(self.lens)


@dataclass(frozen=True)
class BuildContext:
    """What a build needs besides the point and the pool: the FlashInfer backend of the BF16 strategies
    (``cast_backend``), SGLang's split cap inputs (``sglang_max_context``, ``sm_count``), and, for a strategy that
    takes several layouts (:attr:`Strategy.page_sizes`), the page size to run (None: its own)."""

    cast_backend: str = "fa3"
    sglang_max_context: int = 131_072
    sm_count: int = 132
    page_size: int | None = None


Build = Callable[[BenchPoint, torch.Tensor, BuildContext], tuple[Call, dict[str, Any]]]


@dataclass(frozen=True)
class Strategy:
    """One entry of the peer table. ``page_size``: the layout it runs by default (1: page-size-1 slots; 64: pages
    of 64 of the same pool); ``page_sizes``: every layout it takes (:attr:`BuildContext.page_size`); ``needs``:
    prerequisites beyond a CUDA GPU ("flashinfer", "sglang", "flash_mla", "sm90")."""

    name: str
    label: str
    cache: Literal["fp8", "bf16"]
    query: Literal["bf16", "fp8"]
    page_size: int
    needs: tuple[str, ...]
    build: Build
    page_sizes: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.page_sizes:
            object.__setattr__(self, "page_sizes", (self.page_size,))
        if self.page_size not in self.page_sizes:
            raise ValueError(f"strategy {self.name}: page_size {self.page_size} not among {self.page_sizes}.")


def bench_lengths(context: int, batch: int, *, max_total: int, seed: int) -> list[int]:
    """Batch 1: ``[context]``; larger batches: :func:`kvwall.model.pool.mixed_lengths` summing to
    ``min(context * batch // 4, max_total)``."""
    if batch == 1:
        return [int(context)]
    total = min(context * batch // 4, max_total)
    return mixed_lengths(total, batch, seed=seed)


def make_point(
    heads: int,
    context: int,
    batch: int,
    *,
    pool_slots: int,
    max_total: int,
    gen: torch.Generator,
    seed: int,
    device: torch.device,
) -> BenchPoint:
    """One bench point: :func:`bench_lengths`, random slots (repeats allowed) of a ``pool_slots`` pool, BF16 queries."""
    point_seed = seed + 1000 * batch + context
    lens = bench_lengths(context, batch, max_total=max_total, seed=point_seed)
    n = sum(lens)
    return BenchPoint(
        heads,
        context,
        batch,
        lens,
        (torch.randn(batch, heads, DC, generator=gen, device=device) * 0.5).to(BF16),
        (torch.randn(batch, heads, DR, generator=gen, device=device) * 0.5).to(BF16),
        torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device),
        torch.randint(0, pool_slots, (n,), generator=gen, device=device, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32, device=device),
        seed=point_seed,
    )


def paged_layout(pt: BenchPoint, pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA's layout of the point (the same for every paged strategy, seeded by the point): ``(block_table
    [B, max pages], cache_seqlens [B], token slots of the pool, request by request)``, pages of 64."""
    device = pool.device
    gen = torch.Generator(device=device).manual_seed(pt.seed)
    table, seqlens = random_page_table(pt.lens, pool.shape[0] // PAGE_SIZE, gen, device)
    offsets = torch.arange(PAGE_SIZE, device=device)
    slots = torch.cat(
        [
            (table[i, : -(-n // PAGE_SIZE)].long()[:, None] * PAGE_SIZE + offsets).flatten()[:n]
            for i, n in enumerate(pt.lens)
        ]
    )
    return table, seqlens, slots


def paged_pool(pool: torch.Tensor) -> torch.Tensor:
    """The ``[slots, 1, 576]`` pool seen as ``[pages, 64, 576]`` (its whole pages; no copy)."""
    pages = pool.shape[0] // PAGE_SIZE
    return pool[: pages * PAGE_SIZE].view(pages, PAGE_SIZE, D)


def reference_f64(pt: BenchPoint, pool: torch.Tensor, paged: bool) -> torch.Tensor:
    """Float64 MLA decode of the point on the FP8 pool's exact values: page-size-1 slots (``pt.idx``), or FlashMLA's
    paged layout (:func:`paged_layout`)."""
    slots = paged_layout(pt, pool)[2] if paged else pt.idx.long()
    indptr = torch.tensor([0, *torch.tensor(pt.lens).cumsum(0).tolist()], dtype=torch.int64, device=pool.device)
    return mla_decode_reference(
        pt.q_nope, pt.q_pe, pool[:, 0, :DC], pool[:, 0, DC:], indptr, slots, SM_SCALE, compute_dtype=torch.float64
    )


def _out(pt: BenchPoint, pool: torch.Tensor) -> torch.Tensor:
    return torch.empty(pt.batch, pt.heads, DC, dtype=BF16, device=pool.device)


# ---------------------------------------------------------------------------------------------------------
# Ours and its paths
# ---------------------------------------------------------------------------------------------------------


def _our_kernel(path: str) -> Build:
    """Ours (``path="auto"``: the dispatcher's choice) or one path forced, on the page size the context asks for: the
    plan made here (as a decode step makes it once for all its layers), the timed call unchecked."""

    def build(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
        device, out = pool.device, _out(pt, pool)
        page = ctx.page_size or 1
        if page == 1:
            c, k = pool[:, 0, :DC], pool[:, 0, DC:]
            indptr, indices, kv_len = pt.indptr, pt.idx, None
        else:
            paged = paged_pool(pool)
            c, k = paged[:, :, :DC], paged[:, :, DC:]
            table, kv_len, _ = paged_layout(pt, pool)
            n_pages = [-(-n // PAGE_SIZE) for n in pt.lens]
            indptr = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32, device=device)
            indices = torch.cat([table[i, :n] for i, n in enumerate(n_pages)]).contiguous()
        plan = plan_mla_decode(
            indptr,
            indices,
            heads=pt.heads,
            sm_scale=SM_SCALE,
            kv_len=kv_len,
            page_size=page,
            lengths=pt.lens,
            path=path,
            ckv_cache=c,
            kpe_cache=k,
        )
        info: dict[str, Any] = dict(
            kernel_path=plan.path,
            work_items=plan.work.items,
            chunk_tokens=plan.work.work_list.chunk_tokens,
            imbalance=plan.work.work_list.imbalance(),
        )
        if path == "auto":
            info["path_why"] = plan.why
        if plan.path == "triton":
            info["config"] = dataclasses.asdict(plan.work.config)
        return (lambda: mla_decode(pt.q_nope, pt.q_pe, c, k, plan, out=out)), info

    return build


# ---------------------------------------------------------------------------------------------------------
# FlashInfer: the casts before its BF16 attention, and its native FP8
# ---------------------------------------------------------------------------------------------------------


def _bf16_wrapper(
    backend: str,
    pt: BenchPoint,
    indices: torch.Tensor,
    info: dict[str, Any],
    check: Callable[[FlashInferMLADecode], object],
) -> FlashInferMLADecode:
    """FlashInfer BF16 planned with ``backend`` (its first run ``check``-ed), else with fa2; ``info`` gets the
    backend that ran, plan ms, and ``<backend>_error`` when the first refused."""
    tried: dict[str, str] = {}
    for name in dict.fromkeys((backend, "fa2")):
        try:
            wrapper = FlashInferMLADecode(
                pt.heads, pt.indptr, indices, pt.lens_t, SM_SCALE, kv_dtype=BF16, backend=name
            )
            check(wrapper)
            synchronize(pt.idx.device)
        except Exception as exc:  # noqa: BLE001 - fa3 may not run a shape: fall back to fa2, say so
            tried[name] = error_text(exc)
            continue
        info.update(backend=wrapper.backend, plan_ms=wrapper.plan_ms, **{f"{k}_error": v for k, v in tried.items()})
        return wrapper
    raise RuntimeError(f"no FlashInfer BF16 backend ran: {tried}")


def _full_cast(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
    out, info = _out(pt, pool), {}

    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        p = pool.to(BF16)
        return wrapper.run(pt.q_nope, pt.q_pe, p[:, :, :DC], p[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(ctx.cast_backend, pt, pt.idx, info, call_on)
    return lambda: call_on(wrapper), info


def _index_then_cast(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
    out, info = _out(pt, pool), {}
    idx = pt.idx.long()
    compact = torch.arange(pt.tokens, dtype=torch.int32, device=pool.device)

    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        rows = pool.index_select(0, idx).to(BF16)
        return wrapper.run(pt.q_nope, pt.q_pe, rows[:, :, :DC], rows[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(ctx.cast_backend, pt, compact, info, call_on)
    return lambda: call_on(wrapper), info


def _gather_cast(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
    out, info = _out(pt, pool), {}
    buf = torch.empty(pt.tokens, 1, D, dtype=BF16, device=pool.device)
    compact = torch.arange(pt.tokens, dtype=torch.int32, device=pool.device)

    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        gather_cast(pool, pt.idx, None, out=buf, check_range=False)
        return wrapper.run(pt.q_nope, pt.q_pe, buf[:, :, :DC], buf[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(ctx.cast_backend, pt, compact, info, call_on)
    info["buffer_bytes"] = buf.numel() * 2
    return lambda: call_on(wrapper), info


def _precast(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
    out, info = _out(pt, pool), {}
    pb = pool.to(BF16)

    def call_on(wrapper: FlashInferMLADecode) -> torch.Tensor:
        return wrapper.run(pt.q_nope, pt.q_pe, pb[:, :, :DC], pb[:, :, DC:], out=out)

    wrapper = _bf16_wrapper(ctx.cast_backend, pt, pt.idx, info, call_on)
    info["pool_bf16_bytes"] = pb.numel() * 2
    return lambda: call_on(wrapper), info


def _flashinfer_fp8(backend: str) -> Build:
    def build(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
        del ctx  # its backend is its name's
        out = _out(pt, pool)
        wrapper = FlashInferMLADecode(pt.heads, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, kv_dtype=FP8, backend=backend)
        ckv8, kpe8 = pool[:, :, :DC], pool[:, :, DC:]
        return (
            lambda: wrapper.run(pt.q_nope, pt.q_pe, ckv8, kpe8, out, fp8_scales=(1.0, 1.0)),
            {"backend": wrapper.backend, "plan_ms": wrapper.plan_ms},
        )

    return build


# ---------------------------------------------------------------------------------------------------------
# SGLang and FlashMLA
# ---------------------------------------------------------------------------------------------------------


def _sglang(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
    """SGLang's kernel with its own split policy. ``info["_fixed_splits"]``: ``S -> call`` with every request on
    ``S`` splits (the bench's optional split sweep; keys starting with ``_`` never reach a row)."""
    out, info = _out(pt, pool), {}
    q = torch.cat([pt.q_nope, pt.q_pe], dim=-1).contiguous()  # SGLang's q: [B, H, 576], BF16
    sg = SGLangTritonMLA.load(q, pool, out, pt.indptr, pt.idx, pt.lens_t, SM_SCALE, kv_lora_rank=DC)
    max_splits = sglang_max_kv_splits(ctx.sm_count, ctx.sglang_max_context)
    num_kv_splits = sg.own_splits(max_splits, ctx.sm_count)
    chosen = num_kv_splits.tolist()
    call = sg.call(num_kv_splits, max_splits)
    try:
        call()
        synchronize(pool.device)
    except Exception as exc:  # noqa: BLE001 - PDL launch refused: SGLang without PDL, recorded
        info["pdl_error"] = error_text(exc)
        sg.use_pdl = False
    info.update(
        max_kv_splits=max_splits,
        num_kv_splits_min=min(chosen),
        num_kv_splits_max=max(chosen),
        use_pdl=sg.use_pdl,
        sglang_file=sg.kernels.get("file"),
        sglang_source=sg.kernels.get("source"),
        _fixed_splits=sg.fixed_splits,
    )
    return call, info


def _flashmla(fp8: bool) -> Build:
    def build(pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext) -> tuple[Call, dict[str, Any]]:
        del ctx
        pages = pool.shape[0] // PAGE_SIZE
        paged = pool[: pages * PAGE_SIZE].view(pages, PAGE_SIZE, 1, D)
        table, seqlens, _ = paged_layout(pt, pool)
        cache = paged if fp8 else paged.to(BF16)
        decode = FlashMLADecode(pt.q_nope, pt.q_pe, cache, table, seqlens, SM_SCALE, fp8=fp8)
        info: dict[str, Any] = {"flash_mla": decode.version, "name": decode.name}
        if not fp8:
            info["pool_bf16_bytes"] = cache.numel() * 2
        return decode, info

    return build


def _entries(*entries: Strategy) -> dict[str, Strategy]:
    return {s.name: s for s in entries}


#: The peer table, in the order tables show it. Ours first, then each of its paths forced, then everyone else.
STRATEGIES: dict[str, Strategy] = _entries(
    Strategy("ours", "ours (dispatcher's path)", "fp8", "bf16", 1, (), _our_kernel("auto")),
    Strategy(
        "ours_page64", "ours, pages of 64", "fp8", "bf16", PAGE_SIZE, (), _our_kernel("auto"), page_sizes=(PAGE_SIZE,)
    ),
    Strategy("triton", KERNEL_NAMES["triton"], "fp8", "bf16", 1, (), _our_kernel("triton"), page_sizes=(1, PAGE_SIZE)),
    Strategy(
        "wgmma", KERNEL_NAMES["wgmma"], "fp8", "bf16", 1, ("sm90",), _our_kernel("wgmma"), page_sizes=(1, PAGE_SIZE)
    ),
    Strategy(
        "wgmma_tokens",
        KERNEL_NAMES["wgmma_tokens"],
        "fp8",
        "bf16",
        1,
        ("sm90",),
        _our_kernel("wgmma_tokens"),
        page_sizes=(1, PAGE_SIZE),
    ),
    Strategy(
        "full_cast_bf16",
        "whole-pool cast + FlashInfer BF16 (the original)",
        "fp8",
        "bf16",
        1,
        ("flashinfer",),
        _full_cast,
    ),
    Strategy(
        "index_then_cast",
        "index_select().to(bf16) + FlashInfer BF16",
        "fp8",
        "bf16",
        1,
        ("flashinfer",),
        _index_then_cast,
    ),
    Strategy(
        "gather_cast_bf16", "gather_cast + FlashInfer BF16 (chapter 4)", "fp8", "bf16", 1, ("flashinfer",), _gather_cast
    ),
    Strategy(
        "flashinfer_fp8_fa2", "FlashInfer native FP8 (fa2)", "fp8", "bf16", 1, ("flashinfer",), _flashinfer_fp8("fa2")
    ),
    Strategy(
        "flashinfer_fp8_fa3",
        "FlashInfer native FP8 (fa3)",
        "fp8",
        "bf16",
        1,
        ("flashinfer", "sm90"),
        _flashinfer_fp8("fa3"),
    ),
    Strategy(
        "flashinfer_bf16_precast",
        "FlashInfer BF16 on a BF16 copy of the pool",
        "bf16",
        "bf16",
        1,
        ("flashinfer",),
        _precast,
    ),
    Strategy("sglang_triton_fp8", "SGLang Triton MLA (FP8 query)", "fp8", "fp8", 1, ("sglang",), _sglang),
    Strategy(
        "flashmla_dense_bf16", "FlashMLA dense BF16", "bf16", "bf16", PAGE_SIZE, ("flash_mla", "sm90"), _flashmla(False)
    ),
    Strategy(
        "flashmla_dense_fp8",
        "FlashMLA dense FP8 (FP8 query)",
        "fp8",
        "fp8",
        PAGE_SIZE,
        ("flash_mla", "sm90"),
        _flashmla(True),
    ),
)
#: The strategy that is ours (the dispatcher's path), per page size.
OURS: dict[int, str] = {1: "ours", PAGE_SIZE: "ours_page64"}
#: The entries that force one of ours' paths (timed by ``fused_decode_paths``), in the dispatcher's order.
FORCED_PATHS: tuple[str, ...] = tuple(KERNEL_NAMES)


def build_strategy(
    name: str, pt: BenchPoint, pool: torch.Tensor, ctx: BuildContext = BuildContext()
) -> tuple[Call, dict[str, Any]]:
    """(the call to time, the row's fields) for strategy ``name`` at one point; ``info["page_size"]`` always says the
    layout it ran on (the context's page size, where the strategy takes it, else its own)."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; known: {list(STRATEGIES)}")
    strategy = STRATEGIES[name]
    page = ctx.page_size or strategy.page_size
    if page not in strategy.page_sizes:
        raise ValueError(f"strategy {name!r} runs on page sizes {strategy.page_sizes}, not {page}.")
    call, info = strategy.build(pt, pool, dataclasses.replace(ctx, page_size=page))
    return call, {"page_size": page, **info}

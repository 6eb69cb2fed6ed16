"""The Hopper split kernels' one host house: what the heads-on-M path (:mod:`.wgmma`, ``mla_decode_wgmma.cu``) and
the tokens-on-M path (:mod:`.wgmma_tokens`, ``mla_decode_wgmma_tokens.cu``) share; a *kind* names one of them.

- the build, as a library builds: :func:`build_key` (the ``.cu`` and every header it includes, the flags,
  ``nvcc --version``, the architecture), :func:`build_library` (cached in ``$KVWALL_BUILD_CACHE``, default
  ``~/.cache/kvwall``; built once under a file lock however many processes ask, renamed into place whole),
  :func:`build_refusal` (why a kind cannot be had: the dispatcher's fall-back reason), :func:`load_library`,
  :func:`ptxas_check` (ptxas's resource report without a GPU);
- the launch: :class:`Params` (the mirror of ``mla_decode_common.cuh``'s ``kvwall_mla::Params``),
  :func:`launch_planned` (a validated call's split kernel and Triton combine, ``Params`` prepared once per plan),
  :func:`run_checked` (a path's checked public call on top of it);
- the checks and the plan: :func:`wgmma_refusal`, :func:`rows_refusal`, :func:`checked_inputs`; :class:`HopperPlan`,
  :func:`plan_hopper`, :func:`whole_wave_items`.

Multi-token queries (``q_len`` > 1): the calls take ``[batch, q_len * heads, D]`` tensors (the front door folds them),
the plan has ``q_len * heads`` rows, and the kernels mask row ``r`` (token ``r // heads``) at its causal limit."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import importlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator, Literal

import torch

from kvwall.kernels._args import MAX_PROGRAMS, bounded_int, check_plan_args
from kvwall.kernels._common import Fail, check_output, fail, sm_count
from kvwall.kernels.mla_decode.checks import LOG2E, parse_scale, validate_call
from kvwall.kernels.mla_decode.combine import launch_combine
from kvwall.kernels.mla_decode.launch_shape import MLADecodeConfig
from kvwall.kernels.mla_decode.plan import MLADecodePlan
from kvwall.kernels.mla_decode.triton_path import plan_mla_decode_triton
from kvwall.kernels.mla_decode.work_list import work_list_size

__all__ = [
    "Kind",
    "KINDS",
    "SOURCES",
    "NVCC_FLAGS",
    "ARCH",
    "DC",
    "DR",
    "Params",
    "find_nvcc",
    "build_key",
    "build_library",
    "build_refusal",
    "load_library",
    "ptxas_check",
    "wgmma_refusal",
    "rows_refusal",
    "HopperPlan",
    "plan_hopper",
    "whole_wave_items",
    "ITEM_OVERHEAD_TOKENS",
    "Inputs",
    "checked_inputs",
    "launch_planned",
    "run_checked",
    "traced_build",
]

Kind = Literal["wgmma", "wgmma_tokens"]
KINDS: tuple[Kind, ...] = ("wgmma", "wgmma_tokens")
_HERE = Path(__file__).parent
SOURCES: dict[Kind, Path] = {
    "wgmma": _HERE / "mla_decode_wgmma.cu",
    "wgmma_tokens": _HERE / "mla_decode_wgmma_tokens.cu",
}
#: Each kind's public call (errors are named after it) and its offline compile check.
_PUBLIC: dict[Kind, tuple[str, str]] = {
    "wgmma": ("mla_decode_fp8_wgmma", "nvcc_compile_check_wgmma"),
    "wgmma_tokens": ("mla_decode_fp8_wgmma_tokens", "nvcc_compile_check_wgmma_tokens"),
}
NVCC_FLAGS = ["-O3", "-std=c++17"]
#: The only architecture the kernels are built for: wgmma needs the sm_90a target, whose code runs on 9.0 alone.
ARCH = "sm_90a"
#: The latent (ckv) and rope (kpe) widths the kernels are built for (DeepSeek / GLM MLA).
DC, DR = 512, 64


class Params(ctypes.Structure):
    """Mirror of ``kvwall_mla::Params`` (``mla_decode_common.cuh``); its size is checked against the library's at
    load."""

    _fields_ = (
        [
            (name, ctypes.c_void_p)
            for name in (
                "qn",
                "qp",
                "ckv",
                "kpe",
                "indptr",
                "indices",
                "kvlen",
                "ckv_scale_ptr",
                "kpe_scale_ptr",
                "part_o",
                "part_lse",
                "out",
                "lse",
                "work",
            )
        ]
        + [
            (name, ctypes.c_int64)
            for name in (
                "stride_qn_b",
                "stride_qn_h",
                "stride_qp_b",
                "stride_qp_h",
                "stride_ckv",
                "stride_kpe",
                "stride_o_b",
                "stride_o_h",
            )
        ]
        + [(name, ctypes.c_float) for name in ("ckv_scale_val", "kpe_scale_val", "qk_scale")]
        + [
            (name, ctypes.c_int)
            for name in (
                "H",
                "num_indices",
                "num_units",
                "page",
                "indptr64",
                "indices64",
                "kvlen64",
                "scale_from_ptr",
                "write_lse",
                "q_vec",
                "out_vec",
                "q_len",
                "heads_per_token",
            )
        ]
    )


# ---------------------------------------------------------------------------------------------- refusals


def wgmma_refusal(device: torch.device) -> str | None:
    """Why the wgmma paths cannot run on ``device`` (None when they can): they need a GPU of compute capability
    9.0."""
    if device.type != "cuda":
        return f"tensors are on {device}; the wgmma path needs an H100 / H200 (use mla_decode_fp8, the Triton path)"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return (
            f"compute capability {cap[0]}.{cap[1]}: the wgmma path is built for sm_90a (9.0) only; use "
            "mla_decode_fp8 (the Triton path)"
        )
    return None


def rows_refusal(dims: tuple[int, int], rows: dict[str, torch.Tensor | None]) -> str | None:
    """Why the wgmma paths cannot read these caches (None when they can): ``dims`` (latent, rope widths) must be
    (512, 64), and each of ``rows`` (name -> a cache, ``[slots, width]``, ``[slots, 1, width]`` or ``[pages, page_size,
    width]``; None: not known) must start 16-byte aligned with a token row stride that is a multiple of 16 bytes
    (the kernels load 16-byte pieces of each row)."""
    if tuple(dims) != (DC, DR):
        return (
            f"the wgmma path is built for latent width {DC} and rope width {DR}; got {dims[0]} and {dims[1]} "
            "(mla_decode_fp8, the Triton path, takes any powers of two)"
        )
    for name, t in rows.items():
        if t is None:
            continue
        # a token's row stride: [slots, D] and [slots, 1, D] step by dim 0, [pages, page_size, D] by dim 1
        stride = (t.stride(0) if t.dim() == 2 or t.shape[-2] == 1 else t.stride(-2)) * t.element_size()
        if t.data_ptr() % 16 or stride % 16:
            return (
                f"{name}: the wgmma path loads 16-byte pieces of each row, so rows must start 16-byte aligned "
                f"(data_ptr % 16 = {t.data_ptr() % 16}, row stride {stride} bytes); use mla_decode_fp8 (the "
                "Triton path), which takes any row stride"
            )
    return None


# ---------------------------------------------------------------------------------------------- the build


def find_nvcc() -> str | None:
    """nvcc on ``PATH``, else ``$CUDA_HOME/bin/nvcc``; None when neither exists."""
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if "CUDA_HOME" in os.environ else None
    )
    return nvcc if nvcc is not None and os.path.exists(nvcc) else None


def _nvcc() -> str:
    if (nvcc := find_nvcc()) is None:
        raise FileNotFoundError("nvcc is not on PATH (nor in $CUDA_HOME/bin): the wgmma paths are built at first use.")
    return nvcc


@functools.cache
def nvcc_version(nvcc: str) -> str:
    """``nvcc --version``'s text (part of the build key: another toolkit builds another library)."""
    proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return proc.stdout.strip()


def _sources(path: Path) -> list[Path]:
    """The source and every header it includes by quotes (relative to the including file), each once."""
    seen = [path]
    for p in seen:  # grows while it is walked
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', p.read_text(), re.MULTILINE):
            seen += [] if p.parent / name in seen else [p.parent / name]
    return seen


def _flags(trace: bool, shared: bool = True) -> list[str]:
    """nvcc's flags for the kind's library (``shared``) or an object file; ``trace``: the ``KVWALL_TRACE`` build."""
    return [
        *NVCC_FLAGS,
        *(["-DKVWALL_TRACE"] if trace else []),
        f"-gencode=arch=compute_90a,code={ARCH}",
        *(["-shared", "-Xcompiler", "-fPIC"] if shared else []),
    ]


def build_key(kind: Kind, nvcc: str, flags: list[str]) -> str:
    """What a built library depends on, hashed (16 hex digits): the kind's source and every header it includes, the
    flags, ``nvcc --version`` and the architecture."""
    h = hashlib.sha256()
    for path in _sources(SOURCES[kind]):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update("\0".join([*flags, nvcc_version(nvcc), ARCH]).encode())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    root = Path(os.environ.get("KVWALL_BUILD_CACHE", Path.home() / ".cache" / "kvwall"))
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock`` (across processes, and threads that open it apart)."""
    with open(lock, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_library(kind: Kind, trace: bool = False) -> Path:
    """The kind's shared library (``trace``: the ``KVWALL_TRACE`` build), built by nvcc if the cache has none for
    its :func:`build_key`. Concurrent callers build once: the first takes the lock beside the library, the others
    wait and find it; the library appears whole (a temporary file renamed). Raises FileNotFoundError without nvcc,
    RuntimeError with nvcc's output when it fails."""
    nvcc, flags = _nvcc(), _flags(trace)
    so = _cache_dir() / f"kvwall_mla_{kind}{'_trace' if trace else ''}_{build_key(kind, nvcc, flags)}.so"
    if so.exists():
        return so
    with _locked(so.with_suffix(".lock")):
        if so.exists():  # built by whoever held the lock before us
            return so
        tmp = so.with_name(f".{so.name}.{os.getpid()}.tmp")
        proc = subprocess.run(
            [nvcc, *flags, str(SOURCES[kind]), "-o", str(tmp)], capture_output=True, text=True, timeout=600
        )
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"nvcc failed to build {SOURCES[kind].name}:\n{proc.stdout}{proc.stderr}")
        os.replace(tmp, so)
    return so


def _bind(kind: Kind, lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the entry points every Hopper library has and check its ``Params`` against the mirror."""
    lib.kvwall_mla_error_string.restype = ctypes.c_char_p
    lib.kvwall_mla_error_string.argtypes = [ctypes.c_int]
    lib.kvwall_mla_params_size.restype = ctypes.c_int
    if lib.kvwall_mla_params_size() != ctypes.sizeof(Params):
        raise RuntimeError(
            f"{SOURCES[kind].name}'s Params is {lib.kvwall_mla_params_size()} bytes, the ctypes mirror "
            f"{ctypes.sizeof(Params)}: they disagree."
        )
    return lib


_REFUSALS: dict[Kind, str | None] = {}


def build_refusal(kind: Kind) -> str | None:
    """Why the kind's library cannot be had here, in one line (None when it is built and loads with the host's
    ``Params``): no nvcc, nvcc's first error lines, a library that does not load. Answered once per process; never
    raises (the dispatcher falls back to the Triton path with this as its warning)."""
    if kind not in _REFUSALS:
        try:
            _bind(kind, ctypes.CDLL(str(build_library(kind))))
            _REFUSALS[kind] = None
        except Exception as exc:  # noqa: BLE001 - every failure is a reason to fall back
            lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
            errors = [ln for ln in lines[1:] if "error" in ln.lower()] or lines[1:]
            _REFUSALS[kind] = f"{kind} library unavailable: " + " | ".join(lines[:1] + errors[:2])[:400]
    return _REFUSALS[kind]


@functools.cache
def load_library(kind: Kind, trace: bool = False) -> ctypes.CDLL:
    """Build (once per :func:`build_key`) and load the kind's library, its ``Params`` and the path's own shape
    checked (the path module's ``check_library``)."""
    if not torch.cuda.is_available():
        public, check = _PUBLIC[kind]
        raise RuntimeError(
            f"{public} needs an H100 / H200; on this machine use mla_decode_fp8 (Triton) or {check}() "
            "to compile-check the source."
        )
    lib = _bind(kind, ctypes.CDLL(str(build_library(kind, trace))))
    importlib.import_module(f"{__package__}.{kind}").check_library(lib)
    return lib


def ptxas_check(
    kind: Kind, nvcc: str | None = None, *, trace: bool = False
) -> tuple[bool, float, str, str, dict[str, dict[str, int | None]]]:
    """Compile the kind's source for sm_90a (no GPU needed) with ptxas's report: (nvcc succeeded, seconds, nvcc's
    version line, the log, per kernel entry (mangled name) its registers, spilled bytes (stores + loads) and stack
    bytes)."""
    nvcc = nvcc or _nvcc()
    version = (nvcc_version(nvcc).splitlines() or [""])[-1]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [
                nvcc,
                *_flags(trace, shared=False),
                "-Xptxas",
                "-v",
                "-c",
                str(SOURCES[kind]),
                "-o",
                str(Path(tmp) / "k.o"),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    entries: dict[str, dict[str, int | None]] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = entries.setdefault(m.group(1), {"registers": None, "spill_bytes": None, "stack_bytes": None})
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current is not None:
            current.update(stack_bytes=int(m.group(1)), spill_bytes=int(m.group(2)) + int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m and current is not None:
            current["registers"] = int(m.group(1))
    return proc.returncode == 0, seconds, version, log, entries


# ---------------------------------------------------------------------------------------------- the plan

_TRACED: set[Kind] = set()


@contextlib.contextmanager
def traced_build(kind: Kind) -> Iterator[None]:
    """Within it, the kind's launches run its ``KVWALL_TRACE`` build (plans prepare again for it, and after)."""
    _TRACED.add(kind)
    try:
        yield
    finally:
        _TRACED.discard(kind)


@dataclass
class _Prepared:
    """A plan's launch state, made at its first launch (:func:`launch_planned`): the ``Params`` whose per-plan
    fields are set, the split entry point and grid, and what the layout-dependent fields were computed from."""

    owner: int = 0  # id() of the plan it was prepared for (a dataclasses.replace copy prepares its own)
    traced: bool = False  # for the KVWALL_TRACE build's library
    params: Params = field(default_factory=Params)
    ref: object = None
    split: Callable[..., int] | None = None
    grid: tuple[int, ...] = ()
    layout: tuple = ()
    rows_16b: tuple[bool, bool] = (False, False)  # q_nope and q_pe's, out's row strides are multiples of 16 bytes
    index: tuple = (None, None, None)
    dummy_indices: torch.Tensor | None = None


@dataclass(frozen=True)
class HopperPlan(MLADecodePlan):
    """A work list cut for a Hopper kernel; ``heads`` counts its rows, ``q_len`` x the heads of one token."""

    q_len: int = 1
    prepared: _Prepared = field(default_factory=_Prepared, compare=False, repr=False)


#: Per-CTA fixed work in tokens' worth, for choosing how many waves a work list fills (query load, first tiles'
#: latency, partial write): about five tiles.
ITEM_OVERHEAD_TOKENS = 5 * 64


def whole_wave_items(lengths: list[int], head_blocks: int, slots: int, max_waves: int = 4) -> int:
    """Items per head block to ask the work list for so that ``head_blocks`` x items fills whole waves of ``slots``
    CTAs (one per SM): for each wave count ``k`` the largest request that yields at most ``k * slots / head_blocks``
    items, then the ``k`` with the least estimated time, ``k`` x (largest chunk + :data:`ITEM_OVERHEAD_TOKENS`).
    (Asking for ``slots / head_blocks`` items directly can yield a few more -- each request's chunks round up --
    and a second wave of a handful of CTAs doubles the time.)"""
    best: tuple[float, int] | None = None
    for k in range(1, max_waves + 1):
        limit = max(1, k * slots // head_blocks)
        want = limit
        while want >= 1:
            items, chunk = work_list_size(lengths, block_n=64, items_wanted=want)
            if items <= limit:
                cost = k * (chunk + ITEM_OVERHEAD_TOKENS)
                if best is None or cost < best[0]:
                    best = (cost, want)
                break
            want -= max(1, want // 32)
    return best[1] if best else 1


def plan_hopper(
    cls: type[HopperPlan],
    public: str,
    kv_indptr: torch.Tensor,
    kv_len: torch.Tensor | None,
    *,
    heads: int,
    heads_per_cta: Callable[[int], int],
    warps: int,
    page_size: int,
    device: torch.device | None,
    programs: int | None,
    waves: int,
    min_chunk: int | None,
    q_len: int,
) -> HopperPlan:
    """The batch's work list (:func:`.triton_path.plan_mla_decode_triton`) for 64-token tiles and ``heads_per_cta(q_len
    * heads)`` rows per CTA: items filling whole waves of one CTA per SM (:func:`whole_wave_items`), or ``programs``."""
    fail_: Fail = functools.partial(fail, public)  # every argument checked before a device is touched
    bounded_int("q_len", q_len, fail_, most=8, hint="query tokens per request")
    device = check_plan_args(
        fail_,
        kv_indptr,
        kv_len,
        heads=heads,
        page_size=page_size,
        device=device,
        programs=programs,
        min_chunk=min_chunk,
    )
    bounded_int("waves", waves, fail_, most=MAX_PROGRAMS, hint="waves of CTAs to fill")
    rows = q_len * heads
    hn = heads_per_cta(rows)
    head_blocks = -(-rows // hn)
    if programs is None:
        if device.type != "cuda" or min_chunk is not None:
            programs = sm_count(device) if device.type == "cuda" else 1
        else:  # whole waves of one CTA per SM, at the lengths the step has now
            ptr = [int(x) for x in kv_indptr.tolist()]
            lengths = (
                [int(x) for x in kv_len.tolist()]
                if page_size != 1 and kv_len is not None
                else [b - a for a, b in zip(ptr, ptr[1:])]
            )
            programs, waves = head_blocks * whole_wave_items(lengths, head_blocks, sm_count(device) * max(1, waves)), 1
    cfg = MLADecodeConfig(block_h=hn, block_n=64, num_warps=warps, num_stages=2)
    plan = plan_mla_decode_triton(
        kv_indptr,
        kv_len,
        heads=rows,
        kv_lora_rank=DC,
        page_size=page_size,
        device=device,
        config=cfg,
        programs=programs * max(1, waves),
        min_chunk=min_chunk,
    )
    return cls(**{f.name: getattr(plan, f.name) for f in fields(plan)}, q_len=q_len)


# ---------------------------------------------------------------------------------------------- checks and launch


def _rows_16b(t: torch.Tensor) -> bool:
    """The row strides of a 3-D tensor are multiples of 16 bytes (its data pointer is checked per call)."""
    return all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1])


@dataclass(frozen=True)
class Inputs:
    """A validated call's cache row views, page size and scales (``(tensor or None, value)`` for ckv, kpe)."""

    ckv: torch.Tensor
    kpe: torch.Tensor
    page_size: int
    scales: tuple[tuple[torch.Tensor | None, float], tuple[torch.Tensor | None, float]]


def checked_inputs(
    public: str,
    q_nope,
    q_pe,
    ckv_cache,
    kpe_cache,
    kv_indptr,
    kv_indices,
    sm_scale,
    out,
    check_range,
    kv_len,
    ckv_scale,
    kpe_scale,
) -> Inputs:
    """The Triton path's validation (:func:`~kvwall.kernels.mla_decode.checks.validate_call`) plus what the Hopper
    kernels need (an H100 / H200, widths 512 / 64, 16-byte aligned cache rows), each failure raised before any
    launch, named ``public`` (the call's name) where the Hopper checks find it."""
    fail_: Fail = functools.partial(fail, public)
    ckv, kpe, page_size, _ = validate_call(
        q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale, out, check_range, kv_len
    )
    device = q_nope.device
    why = wgmma_refusal(device) or rows_refusal(
        (q_nope.shape[-1], q_pe.shape[-1]), {"ckv_cache": ckv, "kpe_cache": kpe}
    )
    if why:
        fail_(ValueError, f"the wgmma path cannot run here: {why}.")
    parsed = [parse_scale(name, s, device) for name, s in (("ckv_scale", ckv_scale), ("kpe_scale", kpe_scale))]
    if any(t is not None for t, _ in parsed):  # one mode for both: a tensor (read in the kernel) for the number
        parsed = [
            (t if t is not None else torch.full((1,), v, dtype=torch.float32, device=device), v) for t, v in parsed
        ]
    if out is not None:
        check_output(
            out,
            {
                "q_nope": q_nope,
                "q_pe": q_pe,
                "ckv_cache": ckv_cache,
                "kpe_cache": kpe_cache,
                "kv_indptr": kv_indptr,
                "kv_indices": kv_indices,
                "kv_len": kv_len,
                "ckv_scale": parsed[0][0],
                "kpe_scale": parsed[1][0],
            },
            fail_,
        )
    return Inputs(ckv, kpe, page_size, (parsed[0], parsed[1]))


def _prepare(kind: Kind, plan: HopperPlan) -> _Prepared:
    """The plan's launch state: its fixed ``Params`` fields (work list, partials, rows), entry point and grid."""
    prep = _Prepared(owner=id(plan), traced=kind in _TRACED)
    object.__setattr__(plan, "prepared", prep)  # the plan's own launch state (frozen fields: its identity)
    lib = load_library(kind, prep.traced)
    p = prep.params
    p.work, p.part_o, p.part_lse = plan.work.data_ptr(), plan.part_o.data_ptr(), plan.part_lse.data_ptr()
    p.H = plan.heads
    hn = plan.config.block_h
    if kind == "wgmma":
        prep.split, prep.grid = lib.kvwall_mla_wgmma_split, (-(-plan.heads // hn), plan.items)
    else:
        prep.split, prep.grid = lib.kvwall_mla_wgmma_tokens_split, (hn, -(-plan.heads // hn), plan.items)
    prep.ref = ctypes.byref(p)
    prep.dummy_indices = torch.zeros(1, dtype=torch.int32, device=plan.device)  # for a call without indices
    return prep


def launch_planned(
    kind: Kind,
    plan: HopperPlan,
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_rows: torch.Tensor,
    kpe_rows: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_len: torch.Tensor | None,
    scales: tuple[tuple[torch.Tensor | None, float], ...],
    sm_scale: float,
    q_len: int,
    heads_per_token: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    stream_handle: int,
) -> None:
    """Launch the kind's split kernel and the Triton combine for a call its caller has validated (nothing is checked
    here): ``q_nope`` / ``q_pe`` / ``out`` ``[batch, q_len * heads_per_token, D]`` (folded), ``ckv_rows`` /
    ``kpe_rows`` the caches' ``[slots, D]`` row views, ``scales`` as :class:`Inputs` holds them, ``lse`` float32
    ``[batch, rows]`` or None, on the CUDA stream ``stream_handle``. The plan's ``Params`` are reused: per call only
    the pointers, scales and flags are written, the strides only when they change."""
    prep = plan.prepared
    if prep.owner != id(plan) or prep.traced != (kind in _TRACED):
        prep = _prepare(kind, plan)
    p = prep.params
    layout = (q_nope.stride(), q_pe.stride(), out.stride(), ckv_rows.stride(0), kpe_rows.stride(0), ckv_rows.shape[0])
    if layout != prep.layout:
        prep.layout = layout
        (p.stride_qn_b, p.stride_qn_h, _), (p.stride_qp_b, p.stride_qp_h, _) = layout[:2]
        p.stride_o_b, p.stride_o_h, _ = layout[2]
        p.stride_ckv, p.stride_kpe, p.page = ckv_rows.stride(0), kpe_rows.stride(0), plan.page_size
        p.num_units = ckv_rows.shape[0] // plan.page_size
        prep.rows_16b = (_rows_16b(q_nope) and _rows_16b(q_pe), _rows_16b(out))
    if prep.index[0] is not kv_indptr or prep.index[1] is not kv_indices or prep.index[2] is not kv_len:
        prep.index = (kv_indptr, kv_indices, kv_len)
        num_indices = kv_indices.numel()
        indices = kv_indices if num_indices else prep.dummy_indices  # a valid pointer for never-executed loads
        p.indptr, p.indices, p.num_indices = kv_indptr.data_ptr(), indices.data_ptr(), num_indices
        p.kvlen = (kv_len if kv_len is not None else kv_indptr).data_ptr()
        p.indptr64, p.indices64 = kv_indptr.dtype == torch.int64, indices.dtype == torch.int64
        p.kvlen64 = kv_len is not None and kv_len.dtype == torch.int64
    qn, qp, o = q_nope.data_ptr(), q_pe.data_ptr(), out.data_ptr()
    p.qn, p.qp, p.out, p.ckv, p.kpe = qn, qp, o, ckv_rows.data_ptr(), kpe_rows.data_ptr()
    p.q_vec, p.out_vec = prep.rows_16b[0] and not (qn | qp) & 15, prep.rows_16b[1] and not o & 15
    (c_t, p.ckv_scale_val), (k_t, p.kpe_scale_val) = scales
    p.scale_from_ptr = c_t is not None
    p.ckv_scale_ptr = c_t.data_ptr() if c_t is not None else None
    p.kpe_scale_ptr = k_t.data_ptr() if k_t is not None else None
    p.lse, p.write_lse = (lse.data_ptr(), 1) if lse is not None else (None, 0)
    p.qk_scale, p.q_len, p.heads_per_token = sm_scale * LOG2E, q_len, heads_per_token
    code = prep.split(prep.ref, *prep.grid, stream_handle)
    if code != 0:
        why = load_library(kind).kvwall_mla_error_string(code).decode()
        raise RuntimeError(f"{_PUBLIC[kind][0]}: launch failed: {why} (code {code}).")
    launch_combine(plan, out, lse)


def run_checked(
    kind: Kind,
    cls: type[HopperPlan],
    plan_fn: Callable[..., HopperPlan],
    args: tuple,
    *,
    ckv_scale,
    kpe_scale,
    out,
    return_lse: bool,
    kv_len,
    check_range: bool,
    plan,
    q_len: int,
):
    """A path's public call: every check (:func:`checked_inputs`; the plan's kind and shape against the call's), a
    plan made with ``plan_fn`` when none is given (checked calls only), ``out`` / ``lse`` allocated, then
    :func:`launch_planned` on the current stream. ``args``: the call's seven positional arguments."""
    public = _PUBLIC[kind][0]
    q_nope, q_pe, ckv_cache, kpe_cache, kv_indptr, kv_indices, sm_scale = args
    inputs = checked_inputs(public, *args[:6], sm_scale, out, check_range, kv_len, ckv_scale, kpe_scale)
    batch, rows, dc = q_nope.shape
    device = q_nope.device
    if isinstance(q_len, bool) or not isinstance(q_len, int) or q_len < 1 or rows % q_len:
        fail(
            public,
            ValueError,
            f"q_len={q_len!r} must be a positive int dividing the folded rows "
            f"(q_nope's dim 1 = q_len x heads = {rows}).",
        )
    if plan is None:
        if not check_range:
            fail(
                public,
                ValueError,
                f"an unchecked call (check_range=False) of the {kind} path needs plan= from "
                f"{plan_fn.__name__} (made once per step, outside CUDA-graph capture).",
            )
        plan = plan_fn(kv_indptr, kv_len, heads=rows // q_len, page_size=inputs.page_size, device=device, q_len=q_len)
    if not isinstance(plan, cls):
        fail(public, TypeError, f"plan must come from {plan_fn.__name__}, got {type(plan).__name__}.")
    want = (batch, rows, dc, inputs.page_size, device, q_len)
    have = (plan.batch, plan.heads, plan.kv_lora_rank, plan.page_size, plan.device, plan.q_len)
    if have != want:
        fail(
            public,
            ValueError,
            f"the plan was made for (batch, rows, kv_lora_rank, page_size, device, q_len) = "
            f"{have}; this call has {want}.",
        )
    out = out if out is not None else torch.empty(batch, rows, dc, dtype=torch.bfloat16, device=device)
    lse = torch.empty(batch, rows, dtype=torch.float32, device=device) if return_lse else None
    launch_planned(
        kind,
        plan,
        q_nope,
        q_pe,
        inputs.ckv,
        inputs.kpe,
        kv_indptr,
        kv_indices,
        kv_len,
        inputs.scales,
        float(sm_scale),
        q_len,
        rows // q_len,
        out,
        lse,
        torch.cuda.current_stream(device).cuda_stream,
    )
    return (out, lse) if return_lse else out

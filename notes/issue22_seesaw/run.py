#!/usr/bin/env python3
"""EXPLORATORY (issue 22, Generation 5): build, check and time the seesaw draft (mla_decode_wgmma_seesaw.cu) on an
H100 / H200 in one device call. Not part of the library; prints JSON lines (also to $OUT/seesaw.jsonl).

    bash notes/issue22_seesaw/device.sh            # on the device machine (wheels from .whl/, editable install)
    python3 notes/issue22_seesaw/run.py [--skip-time] [--points h,c,b;...]

Parent (no torch): nvcc builds every variant in parallel (the default build, the early-loads and ordered
variants, the KVWALL_TRACE build) and reads ptxas's report; then each device phase runs in a child process that is
killed after 60 s without a line of output (or past its cap), so a deadlocked kernel (a named-barrier or setmaxnreg
mistake) costs about a minute, not the device budget:
  check (cap 240 s): a 1,000-token smoke launch first, then items of exactly 0 to 5 tiles (_tile_cases), then the
    validation table on fresh inputs (heads 64, 128, 20,
    3, 192; one-token, odd, empty and 131K-token requests; page 1 layouts and pages of 64 and 48; int32 / int64
    indices; every scale pair plus a non-power-of-two ratio both ways; scales as tensors), each against float64 and
    beside the shipped wgmma path's error; a 6x sharper softmax; an out-of-range index (NaN in its request only);
    CUDA-graph replay and a second run bitwise equal. A seesaw error above RATIO_MAX x the shipped path's on the same
    case counts as a failure too (the library's 1e-2 tolerance is ~6x the shipped error: it would hide a wrong
    rescale of a rare tile).
  smoke (cap 90 s each): every other build (early loads, ordered, trace) launched alone on small cases (0 to 5 tiles
    per item, odd and even) against float64 and the shipped path; a build that hangs is dropped from the timing (a
    hang there would otherwise kill the whole time phase and every point after it), a wrong one is flagged.
  time (cap 330 s): the shipped wgmma path, the three seesaw builds, FlashMLA dense FP8 and BF16
    (kvwall.experiments.fused_decode.bench.bench_point_rows: CUDA graphs, L2 flushed, best of 3 x 10) and the
    combine alone, at 64 and 128 heads; then one launch of the KVWALL_TRACE build at two points: cycles per tile per
    warpgroup and phase.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SRC = HERE / "mla_decode_wgmma_seesaw.cu"
BUILD = Path(os.environ.get("SS_BUILD", "/tmp/ss_build"))
OUT = Path(os.environ.get("OUT", "/tmp"))
FLAGS = ["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"]  # wgmma.py's NVCC_FLAGS + its target
VARIANTS = {"seesaw": [], "seesaw_early": ["-DKVWALL_SS_EARLY_LOADS=1"], "seesaw_order": ["-DKVWALL_SS_ORDER=1"],
            "seesaw_trace": ["-DKVWALL_TRACE"]}
SHAPE = (222_976, 64, 64, 384)  # the seesaw's (smem, heads per CTA, tokens per tile, threads)
# (heads, context, batch): bench_lengths gives batch 1 = [context], else batch requests summing to context*batch/4.
# The brief's points first: 128 h 128K b1 (94.9 vs FlashMLA BF16 80.5), 128 h b8 (131K tokens: 119.5 vs 78.7),
# 64 h b32 (524K tokens: 199.3 vs 172.5); then the other compute-bound shapes and two short ones (fixed cost).
POINTS = [(128, 131072, 1), (128, 65536, 8), (64, 65536, 32), (64, 131072, 1), (64, 131072, 8), (128, 131072, 8),
          (128, 32768, 32), (128, 4096, 1), (64, 64, 1)]
T0 = time.time()
_LOG = None
RATIO_MAX = 1.5  # a seesaw build's error over the shipped path's on the same inputs, above which it is a failure
SMOKE_VARIANTS = ("seesaw_early", "seesaw_order", "seesaw_trace")


def emit(**row) -> None:
    global _LOG
    row.setdefault("t", round(time.time() - T0, 1))
    line = json.dumps(row, default=str)
    print(line, flush=True)
    try:
        if _LOG is None:
            OUT.mkdir(parents=True, exist_ok=True)
            _LOG = open(OUT / "seesaw.jsonl", "a")
        _LOG.write(line + "\n")
        _LOG.flush()
    except OSError:
        pass


# ------------------------------------------------------------------------------------------------------------------
# Parent: builds and ptxas figures, then the device phases as children with timeouts.
# ------------------------------------------------------------------------------------------------------------------

def _nvcc() -> str:
    return shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")


def build_all() -> bool:
    BUILD.mkdir(parents=True, exist_ok=True)
    procs = {}
    for name, extra in VARIANTS.items():
        procs[name + ".so"] = subprocess.Popen(
            [_nvcc(), *FLAGS, *extra, "-shared", "-Xcompiler", "-fPIC", str(SRC), "-o", str(BUILD / f"{name}.so")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs[name + ".ptxas"] = subprocess.Popen(
            [_nvcc(), *FLAGS, *extra, "-Xptxas", "-v", "-c", str(SRC), "-o", str(BUILD / f"{name}.o")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ok = True
    for key, proc in procs.items():
        log = proc.communicate(timeout=300)[0]
        name, kind = key.rsplit(".", 1)
        if proc.returncode:
            ok = ok and name != "seesaw"  # only the default build is required
            emit(what="build_fail", variant=name, kind=kind, log=log[-1500:])
            continue
        if kind == "ptxas":
            regs = re.search(r"Used (\d+) registers", log)
            spill = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
            emit(what="ptxas", variant=name, registers=int(regs.group(1)) if regs else None,
                 stack=int(spill.group(1)) if spill else None,
                 spill_bytes=int(spill.group(2)) + int(spill.group(3)) if spill else None,
                 serialized_wgmma="C7512" in log, injected_wait="C7517" in log)
    emit(what="built", ok=ok, s=round(time.time() - T0, 1))
    return ok


def run_child(phase: str, timeout: int, argv: list[str], quiet_s: int = 60) -> int | None:
    """Run a device phase in a child process, its lines passed through. Killed (None) when it prints nothing for
    ``quiet_s`` seconds (every case / point prints a line: silence that long is a hung kernel) or runs past
    ``timeout``."""
    import queue
    import threading

    emit(what="phase_start", phase=phase, timeout_s=timeout, quiet_s=quiet_s)
    t = time.time()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", phase, *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout] and None, daemon=True)
    reader.start()
    last = time.time()
    while True:
        try:
            line = lines.get(timeout=1.0)
            print(line, end="", flush=True)  # the child also appends its JSON lines to seesaw.jsonl
            last = time.time()
            continue
        except queue.Empty:
            pass
        if proc.poll() is not None:
            reader.join(timeout=5)  # the pipe is at EOF: its last lines are queued before the loop ends
            while not lines.empty():
                print(lines.get(), end="", flush=True)
            break
        now = time.time()
        if now - last > quiet_s or now - t > timeout:
            proc.kill()
            try:
                proc.wait(timeout=30)  # a process stuck in the driver may take a moment to go
            except subprocess.TimeoutExpired:
                pass
            emit(what="HANG", phase=phase, after_s=round(now - t, 1), silent_s=round(now - last, 1),
                 note="killed: no output for quiet_s or past the timeout: a deadlock (named barrier / setmaxnreg) or "
                      "a very slow kernel; the last 'case' / 'time' line before this one names what ran before it")
            return None
    emit(what="phase_end", phase=phase, rc=proc.returncode, s=round(time.time() - t, 1))
    return proc.returncode


def parent(argv: list[str]) -> int:
    emit(what="start", source=str(SRC.relative_to(ROOT)), nvcc=_nvcc(), flags=FLAGS)
    reuse = "--reuse-build" in argv and all((BUILD / f"{v}.so").exists() for v in VARIANTS)
    if not reuse and not build_all():
        return 1
    if "--build-only" in argv:
        return 0
    rc = run_child("check", 240, argv)
    if rc is None:
        emit(what="stop", why="the check phase hung: no timing (a hung kernel would hang again)")
        return 1
    if rc != 0:
        emit(what="warning", why="the check phase failed (see its 'case' lines); timing anyway, errors beside")
    if "--skip-time" not in argv:
        drop = []
        for name in SMOKE_VARIANTS:
            if not (BUILD / f"{name}.so").exists():
                continue
            src = run_child("smoke", 90, [*argv, "--variant", name], quiet_s=45)
            if src is None:
                drop.append(name)
                emit(what="dropped", variant=name, why="hung in its smoke launch: not timed")
            elif src != 0:
                emit(what="warning", variant=name, why="wrong in its smoke cases: timed, but its figures are suspect")
        run_child("time", 330, [*argv, *(["--drop", ",".join(drop)] if drop else [])])
    emit(what="done", s=round(time.time() - T0, 1))
    return 0


# ------------------------------------------------------------------------------------------------------------------
# Children (torch, the GPU).
# ------------------------------------------------------------------------------------------------------------------

def _libs(only: tuple[str, ...] | None = None, drop: tuple[str, ...] = ()):
    import kvwall.kernels.mla_decode.wgmma as wg

    def bind(path: Path) -> ctypes.CDLL:
        lib = ctypes.CDLL(str(path))
        lib.kvwall_mla_wgmma_split.restype = ctypes.c_int
        lib.kvwall_mla_wgmma_split.argtypes = [ctypes.POINTER(wg.Params), ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.kvwall_mla_error_string.restype = ctypes.c_char_p
        lib.kvwall_mla_error_string.argtypes = [ctypes.c_int]
        lib.kvwall_mla_params_size.restype = ctypes.c_int
        if lib.kvwall_mla_params_size() != ctypes.sizeof(wg.Params):
            raise RuntimeError(f"{path.name}: Params size {lib.kvwall_mla_params_size()} != {ctypes.sizeof(wg.Params)}")
        shape = (ctypes.c_int * 4)()
        lib.kvwall_mla_wgmma_shape(*(ctypes.byref(shape, 4 * i) for i in range(4)))
        if tuple(shape) != SHAPE:
            raise RuntimeError(f"{path.name}: shape {tuple(shape)} != {SHAPE}")
        return lib

    libs = {"shipped": None}  # None: wgmma.py's own build of kernels/mla_decode/mla_decode_wgmma.cu
    for name in ("seesaw", "seesaw_early", "seesaw_order"):
        if (BUILD / f"{name}.so").exists() and name not in drop and (only is None or name in only):
            libs[name] = bind(BUILD / f"{name}.so")
    trace = None
    if (BUILD / "seesaw_trace.so").exists() and "seesaw_trace" not in drop and (only is None or "seesaw_trace" in only):
        trace = bind(BUILD / "seesaw_trace.so")
        trace.kvwall_mla_trace.restype = ctypes.c_int
        trace.kvwall_mla_trace.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_int]
    wg.load_mla_decode_wgmma()  # the shipped build (cached in $KVWALL_BUILD_CACHE)
    return wg, libs, trace


@contextlib.contextmanager
def _using(wg, lib):
    """wgmma.py's call (checks, plan, launch, Triton combine) on another build of the split kernel."""
    orig = wg.load_mla_decode_wgmma
    if lib is not None:
        wg.load_mla_decode_wgmma = lambda trace=False: lib
    try:
        yield
    finally:
        wg.load_mla_decode_wgmma = orig


def _impl(wg, lib):
    def fn(*a, num_splits=None, **k):  # check_case passes num_splits (the Triton path's); the wgmma path plans itself
        with _using(wg, lib):
            return wg.mla_decode_fp8_wgmma(*a, **k)
    return fn


def child_check() -> int:
    import dataclasses
    import torch
    from kvwall.kernels.mla_decode.cases import SM_SCALE, DecodeCase, check_case, validation_cases
    from kvwall.kernels.mla_decode.reference import make_mla_inputs, reference64
    from kvwall.measure.accuracy import relative_error

    dev = torch.device("cuda")
    wg, libs, _ = _libs()
    emit(what="device", name=torch.cuda.get_device_name(dev), capability=torch.cuda.get_device_capability(dev),
         torch=torch.__version__, variants=list(libs))
    ss = _impl(wg, libs["seesaw"])
    # The table runs the shipped path and the default seesaw build; the early-loads variant's error is measured at
    # every timing point instead (the budget).
    impls = {name: _impl(wg, libs[name]) for name in ("shipped", "seesaw")}

    # Smoke: one launch, synchronized (a deadlock shows here, after ~1 s, not in the middle of the table).
    inp = make_mla_inputs([1000], 64, seed=1, pool_slots=4000, device=dev)
    t = time.time()
    got = ss(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    torch.cuda.synchronize()
    want = reference64(inp, [0], 1.0, 1.0, SM_SCALE)
    emit(what="smoke", s=round(time.time() - t, 2), err=relative_error(got, want))
    bad = _tile_cases(wg, impls, dev, "seesaw")

    cases = validation_cases(heads=[64, 128, 20, 3, 192],
                             length_sets=[[1], [7], [4097], [0, 1, 777, 4096, 33, 20_000, 130, 5], [65, 0, 129, 2],
                                          [0, 0], [131_072]],
                             paged_length_sets=[[1, 0, 4097, 30_000, 64, 65]], page_size=64)
    cases += [DecodeCase("h64 paged48 (non-power-of-two pages)", 64, (1, 0, 95, 96, 97, 5000), "paged", 1.5, 0.75,
                         "int32", None, 901, 48),
              DecodeCase("h128 paged48 int64", 128, (47, 48, 49, 3000), "paged", 1.0, 1.0, "int64", None, 902, 48),
              DecodeCase("h128 scales (1.0, 0.3): ratio folded into q_pe", 128, (3000, 17), "pool_view", 1.0, 0.3,
                         "int32", None, 903),
              DecodeCase("h64 scales (0.3, 1.0): ratio folded into q_nope", 64, (2999, 64, 1), "contiguous", 0.3, 1.0,
                         "int64", None, 904)]
    worst = 0.0
    for case in cases:
        rows = {}
        for name, fn in impls.items():
            try:
                rows[name] = check_case(fn, case, dev, pool_slots=200_000)
            except Exception as exc:  # noqa: BLE001 - a failing case is a row
                rows[name] = {"ok": False, "error": repr(exc)[:300]}
        r, rs = rows["seesaw"], rows["shipped"]
        ratio = (r["rel_err"] / rs["rel_err"]) if r.get("rel_err") and rs.get("rel_err") else None
        worst = max(worst, ratio or 0.0)
        bad += not r["ok"] or any(not v["ok"] for v in rows.values()) or (ratio is not None and ratio > RATIO_MAX)
        emit(what="case", case=case.name, ok={k: v["ok"] for k, v in rows.items()},
             err={k: v.get("rel_err") for k, v in rows.items()}, ratio_vs_shipped=ratio,
             lse_err={k: v.get("lse_max_err") for k, v in rows.items()}, finite=r.get("finite"),
             empty=r.get("empty_out_zero"), error={k: v["error"] for k, v in rows.items() if "error" in v} or None)

    # Scales as tensors (scale_from_ptr): bitwise equal to the same values as floats.
    inp = make_mla_inputs([5000, 3], 128, seed=21, pool_slots=20_000, device=dev)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE)
    a = ss(*args, ckv_scale=0.37, kpe_scale=0.74)
    b = ss(*args, ckv_scale=torch.tensor([0.37], device=dev), kpe_scale=torch.tensor([0.74], device=dev))
    same = bool(torch.equal(a, b))
    bad += not same
    emit(what="scale_tensors", bitwise=same)

    # A softmax 6x sharper (the lazy rescale moves more often), 64 and 128 heads.
    for h in (64, 128):
        inp = make_mla_inputs([9000, 300, 1], h, seed=11, pool_slots=50_000, device=dev)
        qn, qp = (inp.q_nope.float() * 6).bfloat16(), (inp.q_pe.float() * 6).bfloat16()
        inp2 = dataclasses.replace(inp, q_nope=qn, q_pe=qp)
        want = reference64(inp2, [0, 1, 2], 1.0, 1.0, SM_SCALE)
        errs = {}
        for name, fn in impls.items():
            errs[name] = relative_error(fn(qn, qp, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices,
                                           SM_SCALE, kv_len=inp.kv_len), want)
        bad += not (errs["seesaw"] <= 1e-2 and errs["seesaw"] <= RATIO_MAX * errs["shipped"])
        emit(what="sharp", heads=h, err=errs, ratio_vs_shipped=errs["seesaw"] / errs["shipped"])

    # An out-of-range index: NaN in that request only.
    inp = make_mla_inputs([100, 200, 64], 64, seed=5, pool_slots=5000, device=dev)
    idx = inp.kv_indices.clone()
    idx[150] = 10 ** 7
    plan = wg.plan_mla_decode_wgmma(inp.kv_indptr, heads=64)
    got = ss(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, idx, SM_SCALE, check_range=False,
             plan=plan)
    nan_ok = bool(torch.isfinite(got[0]).all() and torch.isnan(got[1]).all() and torch.isfinite(got[2]).all())
    bad += not nan_ok
    emit(what="bad_index", ok=nan_ok)

    # CUDA-graph replay == eager, and a second eager run bitwise equal (no races).
    inp = make_mla_inputs([5000, 17, 70_000, 0, 64], 128, seed=7, pool_slots=100_000, device=dev)
    plan = wg.plan_mla_decode_wgmma(inp.kv_indptr, heads=128)
    out = torch.empty(5, 128, 512, dtype=torch.bfloat16, device=dev)
    call = lambda: ss(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices,  # noqa
                      SM_SCALE, out=out, check_range=False, plan=plan)
    eager = call().clone()
    again = call().clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out, eager)) and bool(torch.equal(again, eager))
    bad += not same
    emit(what="graph", bitwise=same, items=plan.items)
    emit(what="check_done", bad=bad, cases=len(cases), worst_err_ratio_vs_shipped=worst, ratio_max=RATIO_MAX)
    return 1 if bad else 0


def _tile_cases(wg, impls: dict, dev, label: str) -> int:
    """Items of exactly 0 to 5 tiles (each request one item: min_chunk above every length), odd and even counts,
    one token, partial and whole last tiles, an empty request; page 1 and page 64, both fold directions. The
    whole-wave plan of the validation table cuts short requests into one-tile items, so it reaches the seesaw's
    odd / even tails and the FREE phases (3+ tiles) mostly by chance. Each impl against float64; returns failures
    (an error above 1e-2, non-finite, a non-zero empty row, or above RATIO_MAX x the shipped error)."""
    import torch
    from kvwall.kernels.mla_decode.cases import SM_SCALE
    from kvwall.kernels.mla_decode.reference import make_mla_inputs, nonempty_requests, reference64
    from kvwall.measure.accuracy import relative_error

    # (heads, lengths, page, scales, index dtype, layout, min_chunk: None = each request one item, direct path;
    # 192 = items of 3 tiles and shorter tails (1, 2 tiles), the partials and the combine)
    specs = [(64, (1, 64, 65, 128, 129, 0, 192, 256, 257, 320), 1, (0.37, 0.74), torch.int32, "pool_view", None),
             (128, (300, 17, 0, 4097, 129), 64, (2.5, 0.625), torch.int64, "paged", None),
             (64, (1000, 450), 1, (1.0, 0.3), torch.int64, "contiguous", 192)]
    bad = 0
    for h, lens, page, (cs, ks), idt, layout, min_chunk in specs:
        inp = make_mla_inputs(lens, h, seed=31 + h, layout=layout, page_size=page, index_dtype=idt, pool_slots=20_000,
                              device=dev)
        keep = nonempty_requests(lens)
        want = reference64(inp, keep, cs, ks, SM_SCALE)
        plan = wg.plan_mla_decode_wgmma(inp.kv_indptr, inp.kv_len, heads=h, page_size=page,
                                        min_chunk=min_chunk or 64 * -(-max(lens) // 64))
        errs, ok = {}, {}
        for name, fn in impls.items():
            got = fn(inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr, inp.kv_indices, SM_SCALE,
                     ckv_scale=cs, kpe_scale=ks, kv_len=inp.kv_len, plan=plan)
            torch.cuda.synchronize()
            empties = [i for i in range(len(lens)) if i not in keep]
            errs[name] = relative_error(got[keep], want)
            ok[name] = bool(torch.isfinite(got).all() and (got[empties] == 0).all() and errs[name] <= 1e-2)
        ratios = {k: errs[k] / errs["shipped"] for k in errs if k != "shipped" and errs["shipped"]}
        fail = [k for k in impls if not ok[k]] + [k for k, r in ratios.items() if not r <= RATIO_MAX]
        bad += bool(fail)
        emit(what="tile_case", label=label, heads=h, page=page, items=plan.items, lens=list(lens), err=errs, ok=ok,
             ratio_vs_shipped=ratios, fail=fail or None)
    return bad


def child_smoke(argv: list[str]) -> int:
    """One other build alone (its first launches: a hang shows here, not in the middle of the timing) on the
    tile-count cases, beside the shipped path's error on the same inputs."""
    import torch

    name = argv[argv.index("--variant") + 1]
    dev = torch.device("cuda")
    wg, libs, trace = _libs(only=(name,))
    lib = trace if name == "seesaw_trace" else libs[name]
    emit(what="smoke_start", variant=name)
    bad = _tile_cases(wg, {"shipped": _impl(wg, None), name: _impl(wg, lib)}, dev, name)
    if name == "seesaw_trace":
        trace.kvwall_mla_trace((ctypes.c_ulonglong * 48)(), 1)  # zero what these launches added
    torch.cuda.synchronize()
    emit(what="smoke_done", variant=name, bad=bad)
    return 1 if bad else 0


def _points(argv: list[str]):
    if "--points" in argv:
        spec = argv[argv.index("--points") + 1]
        return [tuple(int(x) for x in p.split(",")) for p in spec.split(";") if p]
    return POINTS


def child_time(argv: list[str]) -> int:
    import torch
    from kvwall.experiments.fused_decode.bench import bench_point_rows, time_call
    from kvwall.experiments.fused_decode.strategies import (DC, SM_SCALE, BuildContext, make_point, paged_layout,
                                                            paged_pool, reference_f64)
    from kvwall.kernels.mla_decode.kernel import launch_combine
    from kvwall.measure.accuracy import relative_error

    dev = torch.device("cuda")
    drop = tuple(argv[argv.index("--drop") + 1].split(",")) if "--drop" in argv else ()
    wg, libs, trace = _libs(drop=drop)
    gen = torch.Generator(device=dev).manual_seed(0)
    pool_slots = 495_000  # the bench's pool (a ~285 MB FP8 cache)
    pool = (torch.randn(pool_slots, 1, 576, generator=gen, device=dev) * 0.7).to(torch.float8_e4m3fn)
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device=dev)  # the L2 flush
    ctx = BuildContext(sm_count=torch.cuda.get_device_properties(dev).multi_processor_count)
    peers = ["wgmma", "flashmla_dense_fp8", "flashmla_dense_bf16"]
    for h, c, b in _points(argv):
        pt = make_point(h, c, b, pool_slots=pool_slots, max_total=2_000_000, gen=gen, seed=0, device=dev)
        # copy GB/s and BF16 TFLOP/s only feed the rows' roofline fields: the recorded H200 figures
        rows = bench_point_rows(pt, pool, dev, peers, scratch.zero_, copy_gbps=4244.0, bf16_tflops=686.0, reps=10,
                                rounds=3, host_calls=0, ctx=ctx, sglang_split_sweep=[])
        us = {r["strategy"]: (round(r["us"], 1) if r.get("us") else str(r.get("error", ""))[:120]) for r in rows}
        err = {r["strategy"]: r.get("rel_err_f64") for r in rows}
        out = torch.empty(pt.batch, h, DC, dtype=torch.bfloat16, device=dev)
        layouts = [1] + ([64] if (h, c, b) == tuple(_points(argv)[0]) else [])
        for page in layouts:
            if page == 1:
                cc, kk, indptr, indices, kv_len = pool[:, 0, :DC], pool[:, 0, DC:], pt.indptr, pt.idx, None
            else:
                paged = paged_pool(pool)
                cc, kk = paged[:, :, :DC], paged[:, :, DC:]
                table, kv_len, _ = paged_layout(pt, pool)
                n_pages = [-(-n // 64) for n in pt.lens]
                indptr = torch.tensor([0, *torch.tensor(n_pages).cumsum(0).tolist()], dtype=torch.int32, device=dev)
                indices = torch.cat([table[i, :n] for i, n in enumerate(n_pages)]).contiguous()
            want = reference_f64(pt, pool, page != 1)
            plan = wg.plan_mla_decode_wgmma(indptr, kv_len, heads=h, page_size=page)
            if page == 1:
                items = plan.items
            kw = {} if kv_len is None else {"kv_len": kv_len}
            for name, lib in libs.items():
                fn = _impl(wg, lib)
                call = lambda fn=fn: fn(pt.q_nope, pt.q_pe, cc, kk, indptr, indices, SM_SCALE,  # noqa: E731
                                        plan=plan, out=out, check_range=False, **kw)
                key = f"{name}_p{page}"
                try:
                    got = call()
                    torch.cuda.synchronize()
                    err[key] = relative_error(got, want)
                    us[key] = round(time_call(call, scratch.zero_, dev, 10, 3)[0], 1)
                except Exception as exc:  # noqa: BLE001
                    us[key] = repr(exc)[:200]
            if page == 1:  # the Triton combine alone (its partials written by the calls above): split = total - this
                try:
                    us["combine_only_p1"] = round(time_call(lambda: launch_combine(plan, out, None), scratch.zero_,
                                                            dev, 10, 3)[0], 1)
                except Exception as exc:  # noqa: BLE001
                    us["combine_only_p1"] = repr(exc)[:200]
        bf = us.get("flashmla_dense_bf16")
        vs = {k: round(v / bf, 3) for k, v in us.items()
              if isinstance(v, float) and isinstance(bf, float) and not k.startswith("combine")}
        # A build whose error is off the shipped path's on the same layout: its time is not a result.
        suspect = [k for k, v in err.items() if k.startswith("seesaw") and isinstance(v, float)
                   and isinstance(err.get("shipped" + k[k.rindex("_"):]), float)
                   and not v <= RATIO_MAX * err["shipped" + k[k.rindex("_"):]]]
        emit(what="time", heads=h, context=c, batch=b, tokens=pt.tokens, items=items, us=us, vs_flashmla_bf16=vs,
             err={k: (f"{v:.3e}" if isinstance(v, float) else v) for k, v in err.items()}, suspect=suspect or None)
        del pt, rows
        torch.cuda.empty_cache()

    # One launch of the KVWALL_TRACE build: cycles per tile, per warpgroup and phase (the marks in the source).
    if trace is not None:
        # Per tile of the CTA (sums / all its tiles): phases 0-3 happen on a consumer's own tiles only (every other
        # tile: about twice these per own tile), 4-5 on the other consumer's.
        names = {0: "wait READY (own tile converted)", 1: "scores (36 wgmma)", 2: "softmax + publish P, m, alpha",
                 3: "own P V (64 x 256 x 64)", 4: "wait SMD (the other's softmax)", 5: "the other's P V"}
        pnames = {0: "wait FREE (buffer released)", 1: "wait for the rows + convert + publish + issue the next loads",
                  2: "fetch the next page-table entries"}
        for h, c, b in [(128, 65536, 8), (64, 131072, 1)]:
            pt = make_point(h, c, b, pool_slots=pool_slots, max_total=2_000_000, gen=gen, seed=0, device=dev)
            cc, kk = pool[:, 0, :DC], pool[:, 0, DC:]
            plan = wg.plan_mla_decode_wgmma(pt.indptr, heads=h)
            counters = (ctypes.c_ulonglong * 48)()
            trace.kvwall_mla_trace(counters, 1)  # zero
            with _using(wg, trace):
                wg.mla_decode_fp8_wgmma(pt.q_nope, pt.q_pe, cc, kk, pt.indptr, pt.idx, SM_SCALE, plan=plan,
                                        check_range=False)
            torch.cuda.synchronize()
            trace.kvwall_mla_trace(counters, 1)
            v = list(counters)
            res = {}
            for wgi, label in enumerate(("consumer0", "consumer1", "producer")):
                row = v[16 * wgi:16 * wgi + 16]
                ctas, tiles = row[14], row[15]
                nm = pnames if wgi == 2 else names
                res[label] = {"per_tile": {nm[k]: round(row[k] / max(tiles, 1)) for k in nm},
                              "per_cta": {**({"query prologue": round(row[8] / max(ctas, 1)),
                                              "normalize + write": round(row[9] / max(ctas, 1))} if wgi < 2 else
                                             {"first tile's loads": round(row[10] / max(ctas, 1))})},
                              "ctas": ctas, "tiles": tiles}
            emit(what="trace", heads=h, context=c, batch=b, tokens=pt.tokens, cycles=res)
            del pt
    emit(what="time_done")
    return 0


def main(argv: list[str]) -> int:
    if "--child" in argv:
        phase = argv[argv.index("--child") + 1]
        rest = [a for a in argv if a not in ("--child", phase)]
        if phase == "check":
            return child_check()
        return child_smoke(rest) if phase == "smoke" else child_time(rest)
    return parent(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

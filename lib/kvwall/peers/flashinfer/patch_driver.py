"""The original patch on a GPU, run inside one FlashInfer release: ``plan(kv_data_type=float8_e4m3fn)``.

Run as ``python -m kvwall.peers.flashinfer.patch_driver '<json>'`` with the release's folder first
on ``PYTHONPATH`` (torch and kvwall come from the calling environment; chapter 2's ``wall_on_gpu``
starts it, :mod:`kvwall.experiments.wall`). For each case (backend, KV dtype, context length) it
plans FlashInfer's ``BatchMLAPagedAttentionWrapper`` with GLM-5's shape (16 heads at TP 4, 512 +
64 latent, page size 1) over an FP8 pool, runs it, checks the output against the float64 torch
reference (and, for FP8, against the BF16 path: the same inputs, the cast done outside), and
times it. Mode ``"warm"`` only plans (that is where FlashInfer JIT-builds the kernel), except
cases marked ``run_in_warm``; ``"measure"`` runs everything. After every case the report so far
is written to ``result_path``, so a crash or a kill loses only the case in flight; every failure
is a case with its stage, exception and message, never a crash.

FlashInfer is imported inside :func:`main`, never at module level: the caller imports this module
only to name it, and FlashInfer must come from the release put first on ``sys.path``.
"""

from __future__ import annotations

import inspect
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from kvwall.kernels import mla_decode_reference, split_latent_cache
from kvwall.measure.timing import bench_ms
from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.model.pool import make_decode_batch, random_kv

__all__ = ["main", "run_case"]

Report = dict[str, Any]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


class _Session:
    """What every case of one driver run shares: the release, the geometry, the FP8 pool."""

    def __init__(self, flashinfer: Any, args: dict[str, Any]) -> None:
        self.flashinfer = flashinfer
        self.args = args
        self.g: MLAGeometry = GLM5.with_tensor_parallel(args["tensor_parallel"])
        self.dev = torch.device(args["device"])  # "cpu" only for a dry run of this driver
        self.gen = torch.Generator().manual_seed(args["seed"])
        pool_tokens = args["pool_tokens"] if args["mode"] == "measure" else 4096
        self.pool = random_kv((pool_tokens + 1, 1, self.g.kv_dim), generator=self.gen, device=self.dev)  # FP8
        self.ckv8, self.kpe8 = split_latent_cache(self.pool, self.g.kv_lora_rank)
        self.workspace = torch.empty(128 << 20, dtype=torch.uint8, device=self.dev)

    def wrapper(self, backend: str, kv_dtype: torch.dtype, batch: Any) -> Any:
        """``BatchMLAPagedAttentionWrapper`` planned for ``batch`` (page size 1, bf16 query)."""
        g = self.g
        w = self.flashinfer.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=backend)
        qo = torch.arange(batch.batch_size + 1, dtype=torch.int32, device=self.dev)
        w.plan(
            qo,
            batch.kv_indptr,
            batch.kv_indices,
            batch.context_lens,
            g.heads_per_gpu,
            g.kv_lora_rank,
            g.qk_rope_head_dim,
            1,
            False,
            g.sm_scale,
            torch.bfloat16,
            kv_dtype,
        )
        return w


def run_case(session: _Session, case: dict[str, Any], row: Report) -> None:
    """Plan, run, check and time one case, filling ``row``; raises what the release raises, with
    ``row["stage"]`` saying where."""
    s, g, dev = session, session.g, session.dev
    t0 = time.perf_counter()
    row["stage"] = "setup"
    batch = make_decode_batch([case["context_len"]], s.pool.shape[0], seed=s.args["seed"], device=dev)
    q_nope = random_kv((1, g.heads_per_gpu, g.kv_lora_rank), generator=s.gen, device=dev, dtype=torch.bfloat16)
    q_pe = random_kv((1, g.heads_per_gpu, g.qk_rope_head_dim), generator=s.gen, device=dev, dtype=torch.bfloat16)
    fp8 = case["kv"] == "float8_e4m3fn"
    # the BF16 path: the cast done outside, once, not timed
    ckv, kpe = (s.ckv8, s.kpe8) if fp8 else split_latent_cache(s.pool.to(torch.bfloat16), g.kv_lora_rank)
    row["stage"] = "plan"
    w = s.wrapper(case["backend"], getattr(torch, case["kv"]), batch)
    row["plan_s"] = round(time.perf_counter() - t0, 2)
    if s.args["mode"] == "warm" and not case.get("run_in_warm"):
        row["status"] = "planned"
        return
    row["stage"] = "run"
    scales = {}
    if fp8 and "ckv_scale" in inspect.signature(w.run).parameters:
        scales = {"ckv_scale": 1.0, "kpe_scale": 1.0}  # random_kv quantizes with scale 1
    row["run_kwargs"] = sorted(scales)
    out = w.run(q_nope, q_pe, ckv, kpe, **scales)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    row["stage"] = "check"
    ref = mla_decode_reference(
        q_nope, q_pe, s.ckv8, s.kpe8, batch.kv_indptr, batch.kv_indices, g.sm_scale, compute_dtype=torch.float64
    )
    row["rel_err_vs_float64"] = _relative_error(out, ref)
    row["finite"] = bool(torch.isfinite(out).all())
    if case.get("compare_bf16") and fp8:
        ckv16, kpe16 = split_latent_cache(s.pool.to(torch.bfloat16), g.kv_lora_rank)
        out16 = s.wrapper(case["backend"], torch.bfloat16, batch).run(q_nope, q_pe, ckv16, kpe16)
        row["rel_diff_vs_bf16_path"] = _relative_error(out, out16)
        row["bf16_rel_err_vs_float64"] = _relative_error(out16, ref)
        del ckv16, kpe16
    row["stage"] = "time"
    row["ms"] = bench_ms(lambda: w.run(q_nope, q_pe, ckv, kpe, **scales), dev)
    row["status"] = "ran"


def main(argv: list[str]) -> int:
    """``argv[1]``: the JSON request (see the module docstring)."""
    args = json.loads(argv[1])
    sys.path.insert(0, args["release_dir"])
    result_path = Path(args["result_path"])
    out: Report = {"cases": [], "phase": "import"}

    def emit() -> None:
        result_path.write_text(json.dumps(out))

    try:
        import flashinfer  # the release first on sys.path, not this environment's
        from flashinfer.jit import env as jit_env

        out.update(
            flashinfer_version=flashinfer.__version__,
            flashinfer_file=flashinfer.__file__,
            include_dir=str(jit_env.FLASHINFER_INCLUDE_DIR),
            gen_dir=str(getattr(jit_env, "FLASHINFER_GEN_SRC_DIR", "")),
            csrc_dir=str(getattr(jit_env, "FLASHINFER_CSRC_DIR", "")),
            device=args["device"],
        )
        if args["device"] == "cuda":
            out.update(gpu=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)))
        session = _Session(flashinfer, args)
    except Exception as e:  # noqa: BLE001 - an unusable release is a report, not a crash
        out.update(error="import", exc_type=type(e).__name__, message=str(e), traceback=traceback.format_exc()[-3000:])
        emit()
        return 0
    out["phase"] = "cases"
    for case in args["cases"]:
        row: Report = {
            "backend": case["backend"],
            "kv": case["kv"],
            "context_len": case["context_len"],
            "mode": args["mode"],
        }
        out["cases"].append(row)
        t0 = time.perf_counter()
        try:
            run_case(session, case, row)
            del row["stage"]
        except Exception as e:  # noqa: BLE001 - every failure is a case row
            row.update(
                status="failed",
                exc_type=type(e).__module__ + "." + type(e).__name__,
                message=str(e)[-60000:],
                traceback=traceback.format_exc()[-3000:],
            )
        row["seconds"] = round(time.perf_counter() - t0, 2)
        emit()
    out["phase"] = "done"
    emit()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

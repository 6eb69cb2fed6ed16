"""The SGLang patches, checked through SGLang's own backend code: ``sglang_patch_check``.

For each case (batch 1, a mixed batch, requests sharing a prefix; odd token counts) it builds one SGLang-shaped
decode step (FP8 pools ``[slots + 1, 1, 576]`` per layer, GLM-5 at tensor parallel 4: 16 BF16 query heads) and
runs the decode data path of SGLang 0.5.23's ``flashinfer_mla_backend.py`` unpatched and with each patch of
:mod:`kvwall.peers.sglang_patch` applied: the backend object, ``init_forward_metadata`` (the step's plan) and
``forward_decode`` for every layer (:func:`kvwall.peers.sglang_patch.harness.run_decode`). On a GPU the attention
is FlashInfer's; on a CPU (``small``) a recording fake wrapper computes it with the torch reference.

Per (variant, case) a row says how the KV reached the attention (whole-pool casts counted in torch's dispatcher;
what the wrapper was planned with; whether the rows it read are ``pool[kv_indices].to(bfloat16)`` bit for bit),
and the error vs the unpatched output and vs the float64 reference. What each variant must show (``ok``):

- ``unpatched``: one whole-pool cast per layer, planned with the pool's slots, rows exact (the baseline works);
- ``gather_cast``: no whole-pool cast, planned with ``0..n-1``, rows exact, output bit-identical to unpatched;
- ``fused``: no whole-pool cast, no plan, within BF16 tolerance of unpatched.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from kvwall.experiments.registry import Experiment
from kvwall.kernels import mla_decode_reference
from kvwall.model.attention import flashinfer_version, prebuild_flashinfer_mla
from kvwall.model.geometry import GLM5, MLAGeometry
from kvwall.peers.sglang_patch import (
    BLOCKER,
    PATCHES,
    UPSTREAM_VERSION,
    VARIANTS,
    graph_plan,
    patch_text,
    upstream_source,
)
from kvwall.peers.sglang_patch.harness import (
    REFERENCE_ATTENTION,
    DecodeRun,
    SGLangDecodeInputs,
    make_decode_inputs,
    run_decode,
)
from kvwall.peers.sglang_patch.realrows import real_rows
from kvwall.results import Result, collect_provenance

__all__ = ["EXPERIMENTS", "run_sglang_patch_check", "check_variant", "TOLERANCE"]

#: BF16 tolerance of a patched output vs the unpatched one (elementwise: |a - b| <= atol + rtol * |b|).
TOLERANCE = {"rtol": 1.6e-2, "atol": 1e-2}
GEOMETRY = GLM5.with_tensor_parallel(4)
#: What the fused patch calls inside SGLang's backend (the diff's text imports it there): imported here, not only
#: named, so that it, the dispatcher and the kernels it runs are in this experiment's provenance (issue 22: the
#: dispatcher's choice decides which path the fused rows ran).
FUSED_CALLS = graph_plan.__name__


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    den = float(torch.linalg.vector_norm(b.double()))
    return float(torch.linalg.vector_norm(a.double() - b.double())) / den if den else float("inf")


def _reference64(inp: SGLangDecodeInputs) -> list[torch.Tensor]:
    """float64 MLA decode over the dequantized FP8 pool, per layer, shaped like the backend's output."""
    slots = inp.slots
    ptr = inp.kv_indptr
    compact = torch.arange(slots.numel(), device=slots.device)
    rank = inp.geometry.kv_lora_rank
    outs = []
    for pool, q in zip(inp.pools, inp.queries):
        rows = pool[:, 0, :].index_select(0, slots).double()
        ref = mla_decode_reference(
            q[..., :rank],
            q[..., rank:],
            rows[:, :rank],
            rows[:, rank:],
            ptr,
            compact,
            inp.geometry.sm_scale,
            compute_dtype=torch.float64,
        )
        outs.append(ref.reshape(q.shape[0], -1))
    return outs


def _planned(run: DecodeRun, inp: SGLangDecodeInputs) -> str:
    if not run.plans:
        return "not planned"
    idx = run.plans[-1].kv_indices.long()
    if torch.equal(idx, inp.slots):
        return "pool slots"
    if torch.equal(idx, torch.arange(idx.numel(), device=idx.device)) and idx.numel() == inp.slots.numel():
        return "0..n-1"
    return "other"


def _rows_exact(run: DecodeRun, inp: SGLangDecodeInputs) -> bool | None:
    if not run.reads:
        return None
    slots = inp.slots
    return len(run.reads) == len(inp.pools) and all(
        torch.equal(read.view(torch.int16), pool[:, 0, :].index_select(0, slots).to(torch.bfloat16).view(torch.int16))
        for read, pool in zip(run.reads, inp.pools)
    )


def check_variant(
    run: DecodeRun, base: DecodeRun, inp: SGLangDecodeInputs, ref64: list[torch.Tensor], *, case: str, attention: str
) -> dict[str, Any]:
    """One ``checks`` row: ``run`` (a variant's decode step) against ``base`` (the unpatched one) and ``ref64``."""
    out = torch.cat([o.float() for o in run.outputs])
    unp = torch.cat([o.float() for o in base.outputs])
    ref = torch.cat(ref64)
    planned = _planned(run, inp)
    exact = _rows_exact(run, inp)
    bit = len(run.outputs) == len(base.outputs) and all(
        torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(run.outputs, base.outputs)
    )
    finite = bool(torch.isfinite(out).all())
    close = finite and bool(torch.allclose(out, unp, **TOLERANCE))
    layers = len(inp.pools)
    problems: list[str] = []
    if run.variant == "unpatched":
        expect = {"whole_pool_casts": layers, "planned_indices": "pool slots", "rows_read_exact": True}
    elif run.variant == "gather_cast":
        expect = {
            "whole_pool_casts": 0,
            "planned_indices": "0..n-1",
            "rows_read_exact": True,
            "bit_identical_vs_unpatched": True,
        }
    else:
        expect = {"whole_pool_casts": 0, "planned_indices": "not planned", "within_bf16_tolerance": True}
    seen = {
        "whole_pool_casts": run.whole_pool_casts,
        "planned_indices": planned,
        "rows_read_exact": exact,
        "bit_identical_vs_unpatched": bit,
        "within_bf16_tolerance": close,
    }
    for key, want in expect.items():
        if seen[key] != want:
            problems.append(f"{key} is {seen[key]!r}, expected {want!r}")
    if not close:
        problems.append(
            "output not within BF16 tolerance of the unpatched output" + ("" if finite else " (non-finite)")
        )
    kv_path = {
        "unpatched": "whole-pool cast .to(bfloat16) per layer",
        "gather_cast": "kvwall gather_cast (Triton) into a compact BF16 buffer per layer",
        "fused": "none: ours (dispatch.mla_decode) reads the FP8 pool",
    }.get(run.variant, run.variant)
    return {
        "section": "checks",
        "variant": run.variant,
        "case": case,
        "batch": len(inp.lens),
        "tokens": int(sum(inp.lens)),
        "pool_slots": int(inp.pools[0].shape[0] - 1),
        "layers": layers,
        "heads": inp.geometry.heads_per_gpu,
        "attention": attention,
        "kv_path": kv_path,
        "whole_pool_casts": run.whole_pool_casts,
        "planned_indices": planned,
        "kv_buffer_rows": run.kv_rows[-1] if run.kv_rows else None,
        "rows_read_exact": exact,
        "max_abs_diff_vs_unpatched": float((out - unp).abs().max()),
        "rel_err_vs_unpatched": _rel(out, unp),
        "bit_identical_vs_unpatched": bit,
        "within_bf16_tolerance": close,
        "max_abs_err_vs_f64": float((out.double() - ref).abs().max()),
        "rel_err_vs_f64": _rel(out, ref),
        "ok": not problems,
        "problems": problems,
    }


def _attention_label(variant: str, flashinfer: bool, version: str | None) -> str:
    if variant == "fused":
        return "ours: kvwall dispatch.mla_decode with the step's plan" + ("" if flashinfer else " (Triton interpreter)")
    if flashinfer:
        return f"FlashInfer {version} BatchMLAPagedAttentionWrapper (backend='auto', as SGLang plans it)"
    return REFERENCE_ATTENTION


def _git_apply_checks() -> dict[str, int]:
    """``git apply --check`` of each diff on a copy of the upstream file: its exit code (0: applies), or -1 where git
    is missing."""
    import shutil  # pylint: disable=import-outside-toplevel
    import tempfile  # pylint: disable=import-outside-toplevel

    from kvwall.peers.sglang_patch.real import git_apply  # pylint: disable=import-outside-toplevel

    if shutil.which("git") is None:
        return {p: -1 for p in PATCHES}
    out = {}
    for p in PATCHES:
        with tempfile.TemporaryDirectory() as work:
            out[p] = int(git_apply(p, work)["check_rc"])
    return out


def _real_source(device: torch.device) -> str | None:
    """Where the real check takes SGLang's files from (see :func:`run_sglang_patch_check`); None: nowhere (the
    ``real_meta`` row then says why)."""
    import os  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    from kvwall.peers.sglang_source import (
        SGLangSourceUnavailable,
        cache_root,  # pylint: disable=import-outside-toplevel
        sglang_source,
    )

    source = os.environ.get("KVWALL_SGLANG_SOURCE")
    if not source:
        try:
            source = str(sglang_source())
        except SGLangSourceUnavailable as e:
            print(f"sglang_patch_check: SGLang's real modules not checked: {e}", file=sys.stderr)
            return None
    deps = [d for d in os.environ.get("KVWALL_SGLANG_DEPS", "").split(os.pathsep) if d]
    cached = cache_root() / "sglang-0.5.23-import-deps"
    if cached.is_dir():
        deps.append(str(cached))
    for d in deps:
        if d not in sys.path:
            sys.path.append(d)
    return source


def _real_rows(device: torch.device, real: dict[str, Any]) -> list[dict[str, Any]]:
    """:func:`real_rows` here, or, on a CPU in a process started without ``TRITON_INTERPRET=1`` (Triton decides at
    import whether it interprets, and SGLang's kernels need it to), in a child Python process that has it."""
    import json  # pylint: disable=import-outside-toplevel
    import os  # pylint: disable=import-outside-toplevel
    import subprocess  # pylint: disable=import-outside-toplevel
    import sys  # pylint: disable=import-outside-toplevel

    source = _real_source(device)
    if torch.device(device).type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1" or source is None:
        return real_rows(device, source=source, **real)
    code = (
        "import json, sys, torch\n"
        "from kvwall.peers.sglang_patch.realrows import real_rows\n"
        "a = json.loads(sys.argv[1])\n"
        "sys.path.extend(a['path'])\n"
        "rows = real_rows(torch.device('cpu'), source=a['source'], log=lambda s: print(s, file=sys.stderr), "
        "**a['real'])\n"
        "print('KVWALL_ROWS ' + json.dumps(rows))\n"
    )
    arg = json.dumps({"source": source, "real": real, "path": [p for p in sys.path if "import-deps" in p]})
    p = subprocess.run(
        [sys.executable, "-c", code, arg],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    line = next((x for x in p.stdout.splitlines() if x.startswith("KVWALL_ROWS ")), None)
    if line is None:
        raise RuntimeError(f"the real check's CPU process failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return json.loads(line[len("KVWALL_ROWS ") :])


def run_sglang_patch_check(
    device: torch.device,
    *,
    cases: dict[str, dict[str, Any]],
    pool_slots: int,
    layers: int,
    seed: int = 0,
    geometry: MLAGeometry = GEOMETRY,
    real: dict[str, Any] | None = None,
) -> Result:
    """Every variant of :data:`kvwall.peers.sglang_patch.VARIANTS` on every case ``{name: {"lens": [...],
    "shared_prefix": k}}``; FlashInfer runs the attention on a CUDA device, the torch reference elsewhere.

    ``real``: parameters of the check inside SGLang's real backend modules
    (:func:`kvwall.peers.sglang_patch.realrows.real_rows`), run on SGLang 0.5.23's files from ``$KVWALL_SGLANG_SOURCE``
    if set, else from the pinned wheel (:func:`kvwall.peers.sglang_source.sglang_source`: the cache, downloaded once
    where PyPI is reachable, ``$KVWALL_SGLANG_SRC`` offline); its rows say why when neither is there. The packages
    SGLang's import chain needs beyond the venv are put on ``sys.path`` last where
    :func:`~kvwall.peers.sglang_source.sglang_import_deps` has them (or ``$KVWALL_SGLANG_DEPS`` names them). On a CPU
    SGLang's own Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before SGLang is
    imported)."""
    flashinfer = device.type == "cuda"
    version = flashinfer_version() if flashinfer else None
    if flashinfer:  # FlashInfer's MLA modules JIT-built in one parallel run, before the first plan() needs one
        prebuild_flashinfer_mla(device, geometry)
    rows: list[dict[str, Any]] = []
    for i, (case, spec) in enumerate(cases.items()):
        inp = make_decode_inputs(
            geometry,
            list(spec["lens"]),
            pool_slots=pool_slots,
            layers=layers,
            seed=seed + i,
            shared_prefix=int(spec.get("shared_prefix", 0)),
            device=device,
        )
        ref64 = _reference64(inp)
        runs = {v: run_decode(v, inp, flashinfer=flashinfer) for v in VARIANTS}
        for v in VARIANTS:
            rows.append(
                check_variant(
                    runs[v],
                    runs["unpatched"],
                    inp,
                    ref64,
                    case=case,
                    attention=_attention_label(v, flashinfer, version),
                )
            )
    rows.append(
        {
            "section": "meta",
            "upstream": UPSTREAM_VERSION,
            "upstream_sha256": _sha(upstream_source()),
            "patch_sha256": {p: _sha(patch_text(p)) for p in PATCHES},
            "flashinfer": version,
            "import_blocker": BLOCKER,
            "tolerance": dict(TOLERANCE),
            "git_apply_check": _git_apply_checks(),
        }
    )
    if real is not None:
        rows.extend(_real_rows(device, real))
    params = {"cases": cases, "pool_slots": pool_slots, "layers": layers, "seed": seed, "real": real}
    return Result("sglang_patch_check", params, rows, collect_provenance(device, __name__))


EXPERIMENTS: list[Experiment] = [
    Experiment(
        name="sglang_patch_check",
        run=run_sglang_patch_check,
        full={
            "cases": {
                "batch1": {"lens": [4097]},
                "mixed": {"lens": [1, 517, 8191, 33, 2049]},
                "shared_prefix": {"lens": [3001, 2500, 1200], "shared_prefix": 1024},
            },
            "pool_slots": 131_072,
            "layers": 3,
            "seed": 0,
            "real": {
                "pool_slots": 495_000,
                "layers": 6,
                "context_len": 32_768,
                "graph_bs": 8,
                "draft_tokens": [2, 4],
                "prefill_extend": [700, 1, 33, 2048, 5, 300, 64, 9],
                "eager_lens": [4097, 1, 517, 8191, 33, 2049, 16384, 77],
                "replays": [
                    [1, 2, 3, 4, 5, 6, 7, 8],
                    [17, 900, 1, 4097, 33, 2, 16384, 77],
                    [3000, 12000, 5, 9000, 1, 1, 16000, 700],
                    [32_000] * 4 + [16_000] * 4,
                ],
                "timing_lens": [4096] * 8,
                "timing_iters": 30,
                "seed": 0,
            },
        },
        small={
            "cases": {
                "batch1": {"lens": [37]},
                "mixed": {"lens": [1, 13, 40, 7]},
                "shared_prefix": {"lens": [21, 20], "shared_prefix": 12},
            },
            "pool_slots": 256,
            "layers": 2,
            "seed": 0,
            "real": {
                "pool_slots": 512,
                "layers": 2,
                "context_len": 64,
                "graph_bs": 4,
                "draft_tokens": [2, 4],
                "eager_lens": [5, 17, 1, 30],
                "replays": [[3, 9, 2, 20], [10, 40, 7, 50]],
                "prefill_extend": [3, 1, 12, 6],
                "timing_lens": [8, 8, 8, 8],
                "timing_iters": 2,
                "seed": 0,
            },
        },
        about="SGLang 0.5.23's flashinfer_mla decode path, unpatched vs the gather_cast and fused patches, run "
        "through the backend's own code (FlashInfer on the GPU): whole-pool casts, planned indices, rows read, "
        "errors vs unpatched and float64",
        requires=("cuda", "flashinfer"),
    ),
]

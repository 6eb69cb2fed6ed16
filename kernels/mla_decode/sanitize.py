"""What ``compute-sanitizer --tool memcheck`` runs for the fused FP8 MLA decode kernel: each of its paths.

``python -m kvwall.kernels.mla_decode.sanitize`` (on a GPU) runs, for each path of ``--paths`` (the dispatcher's
names; default: every path this device runs -- on an H100 / H200 all three, elsewhere the Triton path, saying
why the others are left out):

- ``triton``: the table's sanitized cases (:data:`kvwall.kernels.mla_decode.cases.SANITIZED_CASES`: empty
  requests, one token, tile and split boundaries, garbage past ``kv_indptr[-1]``, the direct path, many empty
  splits, a partial last page, 128 heads);
- ``wgmma`` (64 heads per CTA) and ``wgmma_tokens`` (16 and 32 heads per CTA): their own small cases at those
  head counts (:data:`~kvwall.kernels.mla_decode.cases.WGMMA_SANITIZED_CASES`: odd lengths, one token, an empty
  request, page 1 and page 64 with a partial last page);

each case against the float64 reference into a NaN-poisoned output, then, per path, unchecked calls
(``check_range=False``; a wgmma path with its plan) with out-of-range indices, which must give NaN rows without a
read outside the cache. It exits 1 if any result is wrong. ``--cases NAME ...`` chooses cases (their paths run;
``--paths`` too narrows them); ``--device cpu`` runs the Triton path's checks in Triton's interpreter. A wgmma path
asked for on a device it cannot run on (anything but an H100 / H200) stops the program with its reason (exit 2).
Run it with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` so that every tensor is its own allocation.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Callable, Sequence

import torch

from kvwall.kernels._common import report_checks, sanitizer_args
from kvwall.kernels.mla_decode import wgmma as wgmma_path
from kvwall.kernels.mla_decode import wgmma_tokens as tokens_path
from kvwall.kernels.mla_decode.cases import SANITIZED_CASES, WGMMA_SANITIZED_CASES, DecodeCase, check_case
from kvwall.kernels.mla_decode.triton_path import mla_decode_fp8
from kvwall.kernels.mla_decode.reference import make_mla_inputs

__all__ = [
    "POOL_SLOTS",
    "PATHS",
    "PROG",
    "path_cases",
    "path_refusal",
    "runnable_paths",
    "parse_args",
    "unchecked_out_of_range_gives_nan",
    "checks",
    "main",
]

#: The pool each sanitized case reads: small, so an out-of-bounds read lands outside the allocation.
POOL_SLOTS = 2_000
#: The paths the program runs (the dispatcher's names), in its order.
PATHS = ("triton", "wgmma", "wgmma_tokens")
PROG = "python -m kvwall.kernels.mla_decode.sanitize"
#: Each wgmma path's call and planner (both refuse an unchecked call without a plan).
_WGMMA_CALLS = {
    "wgmma": (wgmma_path.mla_decode_fp8_wgmma, wgmma_path.plan_mla_decode_wgmma),
    "wgmma_tokens": (tokens_path.mla_decode_fp8_wgmma_tokens, tokens_path.plan_mla_decode_wgmma_tokens),
}
#: (heads, page size) of each path's unchecked out-of-range calls.
_UNCHECKED = {
    "triton": ((16, 1), (16, 16)),
    "wgmma": ((64, 1), (64, 64)),
    "wgmma_tokens": ((16, 1), (16, 64), (32, 1), (32, 64)),
}


def path_cases(path: str) -> tuple[DecodeCase, ...]:
    """The sanitized cases of ``path``."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; the sanitizer runs {PATHS}.")
    return SANITIZED_CASES if path == "triton" else WGMMA_SANITIZED_CASES[path]


def path_refusal(path: str, device: torch.device) -> str | None:
    """Why ``path`` cannot run on ``device`` (None: it can): the wgmma paths run on an H100 / H200 alone."""
    if path not in PATHS:
        raise ValueError(f"unknown path {path!r}; the sanitizer runs {PATHS}.")
    return None if path == "triton" else wgmma_path.wgmma_refusal(device)


def runnable_paths(device: torch.device) -> list[str]:
    """The paths that run on ``device``: what the program runs by default."""
    return [p for p in PATHS if path_refusal(p, device) is None]


def _fn(path: str) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``path``'s call with :func:`~kvwall.kernels.mla_decode.cases.check_case`'s signature (``mla_decode_fp8``'s):
    a wgmma path plans its own splits, so a forced split count is an error, not silently dropped."""
    if path == "triton":
        return mla_decode_fp8
    call = _WGMMA_CALLS[path][0]

    def run(*args, num_splits: int | None = None, **kwargs):
        if num_splits is not None:
            raise ValueError(f"the {path} path plans its own splits: a case for it forces none (got {num_splits}).")
        return call(*args, **kwargs)

    return run


def _case_ok(fn: Callable[..., tuple[torch.Tensor, torch.Tensor]], case: DecodeCase, device: torch.device) -> bool:
    return check_case(fn, case, device, POOL_SLOTS)["ok"]


def unchecked_out_of_range_gives_nan(
    device: torch.device, layout: str, path: str = "triton", heads: int = 16, page_size: int | None = None
) -> bool:
    """An unchecked call whose request 1 holds out-of-range indices (huge and negative): that request's output
    is NaN, the others' are the checked call's, bit for bit. ``page_size``: the paged layout's (default 16); a
    wgmma path is called with one plan for both calls."""
    page = (page_size or 16) if layout == "paged" else 1
    lens = [30, 50, 9] if page < 64 else [30, 150, 9]  # request 1 spans several pages
    inp = make_mla_inputs(lens, heads, seed=41, layout=layout, page_size=page, pool_slots=POOL_SLOTS, device=device)
    args = (inp.q_nope, inp.q_pe, inp.ckv_cache, inp.kpe_cache, inp.kv_indptr)
    if path == "triton":
        call, kw = mla_decode_fp8, dict(kv_len=inp.kv_len, num_splits=3)
    else:
        call, planner = _WGMMA_CALLS[path]
        kw = dict(
            kv_len=inp.kv_len, plan=planner(inp.kv_indptr, inp.kv_len, heads=heads, page_size=page, device=device)
        )
    good = call(*args, inp.kv_indices, 0.1, **kw)
    ptr = inp.kv_indptr.tolist()
    bad = inp.kv_indices.clone()
    bad[ptr[1]] = 10**9
    bad[ptr[2] - 1] = -7
    out = call(*args, bad, 0.1, check_range=False, **kw)
    return bool(torch.isnan(out[1]).all()) and torch.equal(out[[0, 2]], good[[0, 2]])


def checks(
    device: torch.device, names: Sequence[str], paths: Sequence[str] = ("triton",)
) -> list[tuple[str, Callable[[], bool]]]:
    """The named checks :func:`main` runs, path by path (in :data:`PATHS` order): the chosen cases of the path,
    then its unchecked calls. A wgmma path's check names start with the path's name."""
    out: list[tuple[str, Callable[[], bool]]] = []
    for path in (p for p in PATHS if p in paths):
        fn = _fn(path)
        out += [(c.name, functools.partial(_case_ok, fn, c, device)) for c in path_cases(path) if c.name in names]
        for heads, page in _UNCHECKED[path]:
            layout = "paged" if page > 1 else "pool_view"
            name = (
                f"unchecked out-of-range -> NaN rows ({layout})"
                if path == "triton"
                else f"{path} h{heads} unchecked out-of-range -> NaN rows ({layout}{page if page > 1 else ''})"
            )
            out.append((name, functools.partial(unchecked_out_of_range_gives_nan, device, layout, path, heads, page)))
    return out


def parse_args(argv: Sequence[str] | None) -> tuple[torch.device, list[str], list[str]]:
    """The command line: ``--device`` and ``--cases`` (:func:`kvwall.kernels._common.sanitizer_args`) and
    ``--paths``. Returns (device, paths, case names); a usage error -- a wgmma path the device cannot run among
    those asked for, a case of a path not asked for -- exits 2 saying why."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(
        prog=PROG, add_help=False, usage=f"{PROG} [--paths PATH ...] [--device DEVICE] [--cases NAME ...]"
    )
    pre.add_argument("--paths", nargs="+", choices=PATHS, default=None)
    known, rest = pre.parse_known_args(argv)
    owner = {c.name: p for p in PATHS for c in path_cases(p)}
    description = (
        __doc__.splitlines()[0] + f" --paths {' '.join(PATHS)}: the paths to run (default: every path "
        "this device runs)."
    )
    device, names = sanitizer_args(rest, PROG, description, list(owner), list(owner))
    explicit = any(a == "--cases" or a.startswith("--cases=") for a in rest)
    if known.paths is not None:
        paths = list(dict.fromkeys(known.paths))
        stray = [n for n in names if owner[n] not in paths] if explicit else []
        if stray:
            pre.error(f"--cases {', '.join(map(repr, stray))}: not a case of --paths {' '.join(paths)}")
    elif explicit:
        paths = list(dict.fromkeys(owner[n] for n in names))
    else:
        paths = runnable_paths(device)
        left = {p: why for p in PATHS if p not in paths and (why := path_refusal(p, device))}
        for p, why in left.items():
            print(f"{p}: not run on {device}: {why}", flush=True)
    for p in paths:
        why = path_refusal(p, device)
        if why:
            pre.error(
                f"--paths {p}: it cannot run on {device} ({why}). The paths that run here: --paths "
                f"{' '.join(runnable_paths(device))} (what no --paths runs)."
            )
    return device, paths, [n for n in names if owner[n] in paths]


def main(argv: Sequence[str] | None = None) -> int:
    device, paths, names = parse_args(argv)
    return report_checks(checks(device, names, paths))


if __name__ == "__main__":
    sys.exit(main())

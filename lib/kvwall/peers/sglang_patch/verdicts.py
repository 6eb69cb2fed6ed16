"""What the real check judges its rows by: the whole-pool casts a step makes (:func:`casts_per_step`) and what is wrong
with them (:func:`cast_problems`), the outputs' errors (:func:`compare`), and one stage run so that its failure leaves
the others running (:func:`guarded`)."""

from __future__ import annotations

import traceback
from typing import Any, Callable

import torch

__all__ = ["TOL", "casts_per_step", "cast_problems", "compare", "guarded"]

#: BF16 tolerance of a patched output (elementwise: |a - b| <= atol + rtol * |b|).
TOL = {"rtol": 1.6e-2, "atol": 1e-2}


def casts_per_step(*, eager: int | None = None, captured: int | None = None, replay: int | None = None) -> int | None:
    """Whole-pool casts one step makes: an eager step's; a graph step's, the captured ones (replayed every step) plus
    those at replay outside the graph; without a CUDA graph (CPU), those of the forward run at replay."""
    if eager is not None:
        return eager
    if replay is None:
        return None
    return replay + (captured or 0)


def cast_problems(
    variant: str,
    layers: int,
    *,
    eager: int | None = None,
    warmup: int | None = None,
    captured: int | None = None,
    replay: int | None = None,
    graph: bool = False,
) -> list[str]:
    """What is wrong with a row's whole-pool casts, in words (empty: nothing). The unpatched backend casts the whole
    pool once per layer wherever it runs a forward; a patch never does. An eager row: ``eager`` (metadata + forward).
    A graph row: ``warmup`` (capture-time metadata + warm-up forward), ``captured`` (what the graph holds) and
    ``replay`` (at replay, what torch's dispatcher sees: the metadata call outside the graph; on a CPU, ``graph``
    False and ``captured`` None, also the forward, run there without capture)."""
    want = layers if variant == "unpatched" else 0
    why = f"one per layer of {layers}" if want else "a patch makes none"
    problems: list[str] = []

    def check(n: int | None, what: str, expect: int, reason: str) -> None:
        if n is not None and n != expect:
            problems.append(f"{what}: {n} whole-pool casts, expected {expect} ({reason})")

    if eager is not None:
        check(eager, "the eager step", want, why)
        return problems
    check(warmup, "the warm-up forward before capture", want, why)
    if graph:
        if captured is None:
            problems.append("the captured graph's casts were not counted")
        check(captured, "the captured graph, replayed every step", want, why)
        check(replay, "the replay, outside the graph (its metadata)", 0, "metadata never casts the pool")
    else:
        if captured is not None:
            problems.append(f"{captured} captured casts counted, but no CUDA graph was captured")
        check(replay, "the forward at replay (no CUDA graph: run without capture)", want, why)
    return problems


def compare(outs: list[torch.Tensor], base: list[torch.Tensor] | None, ref: list[torch.Tensor]) -> dict[str, Any]:
    """Errors of ``outs`` vs the unpatched outputs ``base`` and the float64 reference ``ref`` (all layers)."""
    o = torch.cat([x.float().reshape(-1) for x in outs]).double()
    r = torch.cat([x.reshape(-1) for x in ref]).double().to(o.device)
    res = {
        "finite": bool(torch.isfinite(o).all()),
        "max_abs_err_vs_f64": float((o - r).abs().max()),
        "rel_err_vs_f64": float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r)),
        "within_tol_vs_f64": bool(torch.allclose(o, r, **TOL)),
    }
    if base is not None:
        u = torch.cat([x.float().reshape(-1) for x in base]).double()
        res.update(
            max_abs_diff_vs_unpatched=float((o - u).abs().max()),
            rel_err_vs_unpatched=float(torch.linalg.vector_norm(o - u) / torch.linalg.vector_norm(u)),
            within_tol_vs_unpatched=bool(torch.allclose(o, u, **TOL)),
            bit_identical_vs_unpatched=bool(torch.equal(o, u)),
        )
    return res


def guarded(log: Callable[[str], None], what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``fn()``, or its error (logged with its traceback): a stage that fails leaves the others running."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - reported in the result rows, never swallowed silently
        tb = traceback.format_exc()
        log(f"!! {what} failed: {type(e).__name__}: {e}\n{tb}")
        return None, f"{type(e).__name__}: {e}"[:400]

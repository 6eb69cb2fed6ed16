"""What ``fused.diff`` calls inside SGLang's backend: ours' front door (:func:`kvwall.kernels.plan_mla_decode` once per
step, :func:`kvwall.kernels.mla_decode` once per layer), through three names the diff imports, so that the diff
never names the kernels' internals.

- :func:`step_plan`: the step's plan -- eager (``graph_max_len=None``: a plan for this step's lengths, made from the
  host lengths SGLang has, no device read) or for a CUDA graph (``graph_max_len``: buffers that keep their size and
  address; :meth:`refill` re-cuts it in place from the replay's host lengths before each replay, outside capture);
  ``q_len`` query tokens per request (1: decode; 2..:data:`MAX_Q_LEN`: target-verify, draft-extend, causal over the
  draft: token ``j`` of a request of ``n`` KV tokens sees its first ``n - (q_len - 1 - j)``);
- :func:`ours`: one layer, on the plan: ``q_nope`` / ``q_pe`` views of SGLang's ``[tokens, heads, 576]`` query (the
  front door folds ``[batch x q_len, heads, D]`` into ``[batch, q_len x heads, D]`` as a free view for that layout),
  the output written into ``out``, the FP8 scales as Python floats (1.0: SGLang's ``flashinfer_mla`` path casts its
  FP8 pool to BF16 without a scale, so ours reads it the same way): no host read, no synchronization, capturable;
- :func:`uniform_q_len`: the query tokens per request when every request has the same number (else None).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["MAX_Q_LEN", "step_plan", "ours", "uniform_q_len", "plan_path", "front_door"]

#: The most query tokens a request ours takes (the front door's ``q_len`` limit, kernels/mla_decode/dispatch.py).
MAX_Q_LEN = 8


def front_door():
    """``(plan_mla_decode, mla_decode)`` of :mod:`kvwall.kernels`; a clear error where they are not exported."""
    import kvwall.kernels as k  # pylint: disable=import-outside-toplevel

    plan, run = getattr(k, "plan_mla_decode", None), getattr(k, "mla_decode", None)
    if plan is None or run is None:
        raise ImportError(
            "kvwall.kernels exports no plan_mla_decode / mla_decode (ours' front door, issue 34): "
            "fused.diff needs them; install a kvwall that has them"
        )
    return plan, run


def uniform_q_len(qo_indptr: torch.Tensor | Sequence[int] | None, batch: int) -> int | None:
    """Query tokens per request from the query indptr (a host or device tensor or a list; a device tensor is read
    to the host once, as FlashInfer's ``plan()`` reads it), when all ``batch`` requests have the same number and at
    least one; None otherwise. ``qo_indptr`` None: one token per request (decode)."""
    if qo_indptr is None:
        return 1
    ptr = qo_indptr.tolist() if isinstance(qo_indptr, torch.Tensor) else list(qo_indptr)
    ptr = [int(x) for x in ptr[: batch + 1]]
    if batch < 1 or len(ptr) != batch + 1:
        return None
    lens = {b - a for a, b in zip(ptr, ptr[1:])}
    if len(lens) != 1:
        return None
    (n,) = lens
    return n if n >= 1 else None


def step_plan(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    *,
    heads: int,
    sm_scale: float,
    lengths: Sequence[int],
    q_len: int = 1,
    graph_max_len: int | None = None,
    ckv_cache: torch.Tensor | None = None,
    kpe_cache: torch.Tensor | None = None,
    path: str = "auto",
):
    """The step's plan (see the module docstring); ``kv_indptr`` / ``kv_indices`` are kept by reference (a CUDA
    graph's must be its capture-stable buffers), ``lengths`` the host KV token counts per request (KV of the draft
    tokens included)."""
    plan_mla_decode, _ = front_door()
    return plan_mla_decode(
        kv_indptr,
        kv_indices,
        heads=heads,
        sm_scale=float(sm_scale),
        q_len=int(q_len),
        lengths=[int(n) for n in lengths],
        graph_max_len=graph_max_len,
        path=path,
        ckv_cache=ckv_cache,
        kpe_cache=kpe_cache,
    )


def ours(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    plan,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer of ours on ``plan`` (module docstring): ``[tokens, heads, 512]`` BF16 into ``out``."""
    _, mla_decode = front_door()
    return mla_decode(q_nope, q_pe, ckv, kpe, plan, out=out)


def plan_path(plan) -> str:
    """The path a plan runs (``"triton"``, ``"wgmma"`` or ``"wgmma_tokens"``)."""
    return str(getattr(plan, "path", "?"))

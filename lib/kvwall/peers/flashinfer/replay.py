"""Replays: a FlashInfer release's own checks of an MLA door, on the CPU, as if on another GPU family.

:func:`replay` calls a door through the importable FlashInfer with its compute-capability query
answering SM90, SM100 or SM120 and its JIT module generators replaced by stubs that stop the call
at the moment the library asks for a kernel (:class:`KernelReached`). Everything in between (every
Python check the release runs) is the release's own code. :func:`replay_cases` runs the replays
in a fresh Python, ``python -m kvwall.peers.flashinfer.replay``, with the release first on
``sys.path``, so any installed release can be asked.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from kvwall.peers.flashinfer.calls import call_door, make_inputs, outcome_of
from kvwall.peers.flashinfer.doors import FAMILIES, DoorCase
from kvwall.peers.flashinfer.releases import release_root

__all__ = ["KernelReached", "replay", "replay_cases", "main"]


class KernelReached(Exception):
    """Raised by the stub that replaces a JIT module: the release's checks accepted the call."""


#: Generators of JIT modules, by the module that imports them; each is replaced by a stub in a replay.
_GENERATORS = {
    "flashinfer.mla._core": ("gen_batch_mla_module", "gen_mla_module", "gen_trtllm_gen_fmha_module"),
    "flashinfer.xqa": ("gen_xqa_module_mla",),
    "flashinfer.mla._sparse_mla_sm120": ("gen_sparse_mla_sm120_module",),
}
_CAPABILITY_USERS = ("flashinfer.utils", "flashinfer.mla._core", "flashinfer.xqa", "flashinfer.mla._sparse_mla_sm120")


class _KernelStub:
    """What a stubbed generator returns: any use of the module it stands for raises KernelReached."""

    def __init__(self, generator: str) -> None:
        self._name = generator

    def build_and_load(self) -> "_KernelStub":
        return self

    def get_library_path(self) -> str:
        raise KernelReached(f"{self._name}().get_library_path")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*_args: Any, **_kwargs: Any) -> Any:
            raise KernelReached(f"{self._name}().{name}")

        return call


def _dtype_arg(a: Any) -> str:
    s = str(a)
    return s.replace("torch.", "") if s.startswith("torch.") else (s if len(s) < 40 else s[:40])


def replay(case: DoorCase) -> dict[str, Any]:
    """Run ``case`` on the CPU through the importable FlashInfer, with its compute-capability query
    answering ``case.family`` and its JIT module generators stubbed. Outcome ``kernel_reached``:
    every check the release runs accepted the call (``kernel``: which module and function it asked
    for); ``refused``: it raised (type, message, where); ``error``: the replay itself could not
    drive this release (an API it does not know)."""
    cap = FAMILIES[case.family][0]
    saved: list[tuple[Any, str, Any]] = []

    def patch(mod: Any, name: str, value: Any) -> None:
        if hasattr(mod, name):
            saved.append((mod, name, getattr(mod, name)))
            setattr(mod, name, value)

    def make_gen(name: str) -> Callable[..., _KernelStub]:
        def gen(*args: Any, **_kwargs: Any) -> _KernelStub:
            return _KernelStub(f"{name}({', '.join(_dtype_arg(a) for a in args)})")

        return gen

    mods = {}
    for modname in set(_CAPABILITY_USERS) | set(_GENERATORS):
        try:
            mods[modname] = importlib.import_module(modname)
        except ImportError:
            continue
    try:
        for modname, mod in mods.items():
            patch(mod, "get_compute_capability", lambda device=None: cap)
            patch(mod, "get_device_sm_count", lambda device=None: 148 if cap[0] == 10 else 132 if cap[0] == 9 else 188)
            patch(mod, "device_support_pdl", lambda device=None: cap[0] >= 9)
            for g in _GENERATORS.get(modname, ()):
                patch(mod, g, make_gen(g))
            for cached in (
                "get_batch_mla_module",
                "get_mla_module",
                "get_trtllm_gen_fmha_module",
                "get_xqa_module_mla",
                "get_sparse_mla_sm120_module",
            ):
                fn = getattr(mod, cached, None)
                if hasattr(fn, "cache_clear"):
                    fn.cache_clear()
        saved.append((torch.version, "cuda", torch.version.cuda))
        torch.version.cuda = "13.0"  # the toolkit a real SM120 install would have
        inputs = make_inputs(case, "cpu", context_lens=(300, 77))
        try:
            call_door(case, inputs, workspace=torch.zeros(16 << 20, dtype=torch.uint8))
        except KernelReached as reached:
            return {"outcome": "kernel_reached", "kernel": str(reached)}
        except (TypeError, AttributeError, ImportError) as exc:
            o = outcome_of(exc)
            # a TypeError/AttributeError raised by FlashInfer's own checks is a refusal; one raised
            # while calling it (wrong signature for this release) is a replay error
            kind = "refused" if o["where"] and "Expected" in o["message"] else "error"
            return {"outcome": kind, **o}
        except BaseException as exc:  # noqa: BLE001 - every refusal is a result
            return {"outcome": "refused", **outcome_of(exc)}
        return {"outcome": "returned", "note": "the call returned without asking for a kernel"}
    finally:
        for mod, name, value in reversed(saved):
            setattr(mod, name, value)


def main(argv: list[str]) -> int:
    """The subprocess: replay ``argv[1]``'s cases, write ``{"flashinfer": version, "rows": [...]}``."""
    args = json.loads(argv[1])
    import flashinfer  # the release first on sys.path, after the caller set it

    rows = []
    for c in args["cases"]:
        case = DoorCase(**c)
        try:
            r = replay(case)
        except Exception as exc:  # noqa: BLE001 - a replay that cannot drive this release is a row
            r = {"outcome": "error", **outcome_of(exc)}
        rows.append({**asdict(case), **r})
    Path(args["out"]).write_text(json.dumps({"flashinfer": flashinfer.__version__, "rows": rows}))
    return 0


def replay_cases(cases: Sequence[DoorCase], release: Optional[str] = None, timeout_s: float = 600) -> dict[str, Any]:
    """:func:`replay` every case in a fresh Python with ``release`` first on ``sys.path`` (``None``:
    the FlashInfer importable here). Returns ``{"flashinfer": version, "rows": [...]}``."""
    version, root = release_root(release)
    with tempfile.TemporaryDirectory(prefix="kvwall-replay-") as tmp:
        out = Path(tmp) / "replay.json"
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(root)] + [p for p in sys.path if p and "site-packages" not in p]),
            CUDA_VISIBLE_DEVICES="",
            PYTHONWARNINGS="ignore",
            FLASHINFER_WORKSPACE_BASE=tmp,
            FLASHINFER_LOGLEVEL="0",
        )
        payload = {"cases": [asdict(c) for c in cases], "out": str(out)}
        proc = subprocess.run(
            [sys.executable, "-m", __name__, json.dumps(payload)],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            cwd=tmp,
        )
        if not out.exists():
            raise RuntimeError(
                f"Replaying FlashInfer {version}'s checks failed (exit {proc.returncode}):\n"
                f"{(proc.stdout + proc.stderr)[-3000:]}"
            )
        data = json.loads(out.read_text())
    if data["flashinfer"] != version:
        raise RuntimeError(
            f"Asked to replay FlashInfer {version} but the subprocess imported {data['flashinfer']} "
            f"(from {root}); is another copy first on sys.path?"
        )
    return data


if __name__ == "__main__":
    sys.exit(main(sys.argv))

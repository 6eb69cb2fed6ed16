"""Drive a FlashInfer release's own Python checks and JIT build, inside a subprocess.

Run as ``python -m kvwall.peers.flashinfer.jit_driver '<json>'`` with the release's folder first on
``PYTHONPATH`` (torch and kvwall come from the calling environment). The JSON names a ``task`` and
a ``result_path``; the task's report is written there as JSON, whatever happens (a refusal or a
failed compile is a report, not a crash):

* ``"mla"`` (:func:`kvwall.peers.flashinfer.build.build_mla`): the release's
  ``BatchMLAPagedAttentionWrapper.plan()`` checks replayed with the target's compute capability,
  then its ``gen_batch_mla_module`` generator, then its own ninja file compiled to object files.
* ``"generator"`` (chapter 3's builds): one named JIT generator of the importable FlashInfer, then
  the same compile (or, with ``compile`` false, only the generator's own checks).
* ``"fa_plan"`` (chapter 2's timeline, 0.7.x): the FA backends' plan validation for FP8 KV.

While ninja runs, its ``[k/N]`` status lines are echoed to stderr, so the caller can show
progress. torch and FlashInfer are imported inside the tasks, never at module level: the caller
imports this module only to name it, and FlashInfer must come from the release put first on
``sys.path``.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Optional

from kvwall.peers.flashinfer.progress import follow_ninja, progress

__all__ = ["TASKS", "DriverRun", "run_jit_driver", "run_streaming", "compile_objects", "main"]

Report = dict[str, Any]


def _where(tb: Optional[TracebackType], root: str) -> str:
    """Where an exception was raised, as ``file:line``: the innermost frame inside ``root`` (the
    folder holding ``flashinfer``), relative to it; without a root, the innermost frame of a
    ``flashinfer/`` folder other than this driver, from that folder on; else the last frame."""
    frames = traceback.extract_tb(tb)
    for fr in reversed(frames):
        if root and fr.filename.startswith(root):
            return f"{os.path.relpath(fr.filename, root)}:{fr.lineno}"
        if not root and fr.filename != __file__:
            m = re.search(r"(flashinfer/.*)$", fr.filename.replace(os.sep, "/"))
            if m:
                return f"{m.group(1)}:{fr.lineno}"
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _failure(exc: BaseException, root: str = "") -> Report:
    return {"exc_type": type(exc).__name__, "message": str(exc), "where": _where(exc.__traceback__, root)}


def run_streaming(cmd: list[str], on_line: Callable[[str], None], timeout_s: float, **popen: Any) -> tuple[int, bool]:
    """Run ``cmd`` (stderr into stdout), handing each output line to ``on_line`` as it comes; kill
    it after ``timeout_s``. Returns (exit code, whether it was killed for time)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    timed_out = threading.Event()

    def stop() -> None:
        timed_out.set()
        proc.kill()

    timer = threading.Timer(timeout_s, stop)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            on_line(line)
        return proc.wait(), timed_out.is_set()
    finally:
        timer.cancel()


def _ninja_objects(ninja_file: str) -> list[str]:
    """The object files a FlashInfer ninja file builds, with its top-level variables expanded."""
    text = Path(ninja_file).read_text()
    variables = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", text, re.M))
    return [
        re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), m.group(0)), o)
        for o in re.findall(r"^build (\S+?\.o)\s*:", text, re.M)
    ]


def compile_objects(spec: Any, build_dir: str, ninja: str, jobs: Optional[int], timeout_s: float) -> Report:
    """Write ``spec``'s ninja file and build its object files only (``-k 0``: every translation unit
    is tried). ``status`` is ``"compiled"``, ``"nvcc_failed"`` or ``"timeout"``; ``output`` holds
    ninja's and the compiler's words."""
    from flashinfer.jit import env as jit_env  # the release's own, from sys.path

    report: Report = {
        "include_dir": str(jit_env.FLASHINFER_INCLUDE_DIR),
        "csrc_dir": str(getattr(jit_env, "FLASHINFER_CSRC_DIR", "")),
        "gen_dir": str(getattr(jit_env, "FLASHINFER_GEN_SRC_DIR", "")),
        "sources": [str(s) for s in spec.sources],
    }
    spec.write_ninja()
    ninja_file = str(spec.ninja_path)
    objs = _ninja_objects(ninja_file)
    cmd = [ninja, "-v", "-k", "0", "-C", build_dir, "-f", ninja_file] + objs
    if jobs:
        cmd += ["-j", str(jobs)]
    output: list[str] = []

    def follow(line: str) -> None:
        output.append(line)
        status = re.match(r"^\[\d+/\d+\]", line)
        if status:  # progress for the caller, without the long command line
            print(status.group(0), file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    returncode, timed_out = run_streaming(cmd, follow, timeout_s)
    if timed_out:
        return {**report, "status": "timeout", "message": f"ninja ran past {timeout_s:.0f} s"}
    report.update(
        status="compiled" if returncode == 0 else "nvcc_failed",
        returncode=returncode,
        output="".join(output),
        compile_seconds=time.perf_counter() - t0,
        objects=len(objs),
        built=[Path(o).name for o in objs if os.path.exists(o)],
        failed=[Path(o).name for o in objs if not os.path.exists(o)],
    )
    return report


# ------------------------------------------------------------------------------------------------
# "mla": the release's own plan() checks, module generator and build
# ------------------------------------------------------------------------------------------------


class _Reached(Exception):
    """Raised by the stand-in for ``get_batch_mla_module``: plan() got past every check."""


_PLAN_PARAMETERS = {
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_len_arr",
    "num_heads",
    "head_dim_ckv",
    "head_dim_kpe",
    "page_size",
    "causal",
    "sm_scale",
    "q_data_type",
    "kv_data_type",
}


def _find_mla_generator() -> Callable[..., Any]:
    for modname in ("flashinfer.jit.attention.modules", "flashinfer.jit.attention", "flashinfer.jit"):
        try:
            mod = __import__(modname, fromlist=["gen_batch_mla_module"])
        except ImportError:
            continue
        gen = getattr(mod, "gen_batch_mla_module", None)
        if gen is not None:
            return gen
    raise ImportError("this release has no gen_batch_mla_module in flashinfer.jit")


def _replay_plan_checks(cfg: dict[str, Any], capability: tuple[int, int], root: str) -> Report:
    """0.6.x: ``BatchMLAPagedAttentionWrapper.plan()`` with the device capability of the target,
    stopped where it asks for the JIT module. ``{"python_checks": ...}``, plus the refusal if any."""
    import torch

    try:
        import flashinfer.mla as fmla

        wrapper_class = getattr(fmla, "BatchMLAPagedAttentionWrapper")
        core = sys.modules[wrapper_class.__module__]
        if not _PLAN_PARAMETERS <= set(inspect.signature(wrapper_class.plan).parameters) or not hasattr(
            core, "get_batch_mla_module"
        ):
            raise LookupError(
                f"this release's BatchMLAPagedAttentionWrapper.plan() (in {wrapper_class.__module__}) "
                "is not the 0.6.x shape whose checks this module can replay; only the JIT generator "
                "and nvcc were run"
            )
    except Exception as e:  # noqa: BLE001 - a release we cannot replay is reported, not fatal
        return {"python_checks": f"skipped: {type(e).__name__}: {e}"}

    def stop(*_args: Any, **_kwargs: Any) -> Any:
        raise _Reached()

    if hasattr(core, "get_compute_capability"):
        core.get_compute_capability = lambda *_a, **_k: capability
    core.get_batch_mla_module = stop
    wrapper = object.__new__(wrapper_class)
    wrapper._backend = cfg["backend"]
    wrapper.device = torch.device("cpu")
    wrapper._use_cuda_graph = False
    i32 = torch.int32
    try:
        wrapper_class.plan(
            wrapper,
            qo_indptr=torch.tensor([0, 1], dtype=i32),
            kv_indptr=torch.tensor([0, 1], dtype=i32),
            kv_indices=torch.tensor([0], dtype=i32),
            kv_len_arr=torch.tensor([1], dtype=i32),
            num_heads=16,
            head_dim_ckv=cfg["head_dim_ckv"],
            head_dim_kpe=cfg["head_dim_kpe"],
            page_size=1,
            causal=False,
            sm_scale=1.0 / (192**0.5),
            q_data_type=getattr(torch, cfg["q_dtype"]),
            kv_data_type=getattr(torch, cfg["kv_dtype"]),
        )
    except _Reached:
        return {"python_checks": "ran"}
    except Exception as e:  # noqa: BLE001 - the release's refusal is the result
        return {"python_checks": "ran", "error": "refused", "phase": "plan checks", **_failure(e, root)}
    return {"python_checks": "skipped: plan() returned without asking for the MLA module"}


def mla_task(args: dict[str, Any]) -> Report:
    """The ``"mla"`` task (see the module docstring)."""
    root = args["release_dir"]
    out: Report = {"phase": "import"}
    try:
        import torch
        import flashinfer

        gen = _find_mla_generator()
        out["flashinfer_version"] = getattr(flashinfer, "__version__", "")
    except Exception as e:  # noqa: BLE001 - reported to the caller as an unusable release
        return {**out, "error": "import", **_failure(e, root), "traceback": traceback.format_exc()[-4000:]}
    cfg = args["config"]
    out["phase"] = "plan checks"
    out["python_checks"] = "skipped"
    if args["python_checks"]:
        out.update(_replay_plan_checks(cfg, tuple(args["capability"]), root))
        if out.get("error"):
            return out
    out["phase"] = "module generator"
    dq, dkv = getattr(torch, cfg["q_dtype"]), getattr(torch, cfg["kv_dtype"])
    try:
        spec = gen(cfg["backend"], dq, dkv, dq, torch.int32, cfg["head_dim_ckv"], cfg["head_dim_kpe"], False)
    except Exception as e:  # noqa: BLE001 - the generator's refusal is the result
        return {**out, "error": "refused", **_failure(e, root)}
    out["phase"] = "compile"
    try:
        from flashinfer.jit import env as jit_env

        build_dir = str(getattr(spec, "build_dir", None) or jit_env.FLASHINFER_JIT_DIR)  # 0.4.x: the JIT dir
        out.update(compile_objects(spec, build_dir, args["ninja"], args.get("jobs"), args["timeout_s"]))
    except Exception as e:  # noqa: BLE001 - our driving failed, not the compiler
        out.update(error="driver", **_failure(e, root), traceback=traceback.format_exc()[-4000:])
    if out.get("status") == "timeout":
        out["error"] = "timeout"
    return out


# ------------------------------------------------------------------------------------------------
# "generator": one JIT generator of the importable FlashInfer
# ------------------------------------------------------------------------------------------------


def generator_task(args: dict[str, Any]) -> Report:
    """The ``"generator"`` task: ``args["module"].args["generator"](*args["args"])``, where an
    argument naming a torch dtype (``"float8_e4m3fn"``) becomes that dtype; then compile, unless
    ``args["compile"]`` is false (``status: "generator_accepted"``)."""
    import torch

    def value(a: Any) -> Any:
        return getattr(torch, a) if isinstance(a, str) and isinstance(getattr(torch, a, None), torch.dtype) else a

    try:
        import flashinfer

        root = str(Path(flashinfer.__file__).resolve().parents[1])
        generator = getattr(__import__(args["module"], fromlist=[args["generator"]]), args["generator"])
        spec = generator(*[value(a) for a in args["args"]])
    except Exception as e:  # noqa: BLE001 - the generator's refusal is the result
        failure = _failure(e, "")
        return {"status": "generator_refused", **failure, "message": failure["message"][:600]}
    if not args["compile"]:
        return {"status": "generator_accepted"}
    try:
        report = compile_objects(spec, str(spec.build_dir), args["ninja"], args["jobs"], args["timeout_s"])
    except Exception as e:  # noqa: BLE001 - our driving failed, not the compiler
        failure = _failure(e, root)
        return {"status": "driver_error", "exc_type": failure["exc_type"], "message": failure["message"][:600]}
    report["output"] = report.get("output", "")[-60000:]
    return report


# ------------------------------------------------------------------------------------------------
# "fa_plan": 0.7.x's FA backends' own plan validation
# ------------------------------------------------------------------------------------------------


def fa_plan_task(args: dict[str, Any]) -> Report:
    """0.7.x moved ``plan()`` into per-backend planners; their shared validation
    (``_validate_generated_fa_plan``) runs here with the target's compute capability. ``result``:
    ``"passed"`` (every dtype/arch check accepted; a CUDA query for the device's shared memory,
    which comes after them, counts as passed), ``"refused"`` or ``"unavailable"``."""
    root = args["release_dir"]
    try:
        import torch
        import flashinfer.mla._batch_mla._backends._fa_common as fa
    except Exception as e:  # noqa: BLE001 - a release without this module is reported as such
        return {"result": "unavailable", "message": f"{type(e).__name__}: {e}"}
    capability = tuple(args["capability"])
    fa.get_compute_capability = lambda device: capability
    fa.is_sm90a_supported = lambda device: capability[0] == 9
    i32 = torch.int32
    try:
        fa._validate_generated_fa_plan(  # the release's own check is the point
            backend=args["backend"],
            device=torch.device("cpu"),
            qo_indptr=torch.tensor([0, 1], dtype=i32),
            kv_indptr=torch.tensor([0, 1], dtype=i32),
            kv_indices=torch.tensor([0], dtype=i32),
            kv_len_arr=torch.tensor([1], dtype=i32),
            head_dim_ckv=512,
            head_dim_kpe=64,
            q_data_type=torch.bfloat16,
            kv_data_type=torch.float8_e4m3fn,
            output_dtype=torch.bfloat16,
            scale_mode="kv-per-tensor",
        )
    except Exception as e:  # noqa: BLE001 - the release's refusal is the result
        failure = _failure(e, root)
        on_device = failure["where"].startswith("flashinfer/utils.py") and "CUDA" in failure["message"]
        return {"result": "passed" if on_device else "refused", **failure}
    return {"result": "passed"}


# ------------------------------------------------------------------------------------------------
# The caller's side
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverRun:
    """How one run of :mod:`kvwall.peers.flashinfer.jit_driver` ended."""

    report: Optional[dict[str, Any]]  # the task's report; None when the driver wrote none
    returncode: Optional[int]
    output_tail: str  # the driver's last 3,000 characters of stdout and stderr
    timed_out: bool = False


def run_jit_driver(
    request: dict[str, Any], *, env: dict[str, str], cwd: Path, timeout_s: float, description: str
) -> DriverRun:
    """Run ``python -m kvwall.peers.flashinfer.jit_driver`` on ``request`` (its ``result_path`` is
    set here, inside ``cwd``), killing it after ``timeout_s``. On a terminal, a progress bar
    follows ninja's ``[k/N]`` while it compiles."""
    result_path = Path(cwd) / f"jit-driver-{request['task']}.json"
    request = {**request, "result_path": str(result_path)}
    cmd = [sys.executable, "-m", __name__, json.dumps(request)]
    tail: list[str] = []

    def follow(line: str) -> None:
        follow_ninja(bar, line)
        tail.append(line)
        del tail[:-200]

    with progress(description, unit="object") as bar:
        returncode, timed_out = run_streaming(cmd, follow, timeout_s, env=env, cwd=str(cwd))
    report = json.loads(result_path.read_text()) if result_path.exists() else None
    return DriverRun(report, returncode, "".join(tail)[-3000:], timed_out)


TASKS: dict[str, Callable[[dict[str, Any]], Report]] = {
    "mla": mla_task,
    "generator": generator_task,
    "fa_plan": fa_plan_task,
}


def main(argv: list[str]) -> int:
    """``argv[1]``: the JSON request. The release folder, when named, goes first on ``sys.path``."""
    args = json.loads(argv[1])
    if args.get("release_dir"):
        sys.path.insert(0, args["release_dir"])
    report = TASKS[args["task"]](args)
    Path(args["result_path"]).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

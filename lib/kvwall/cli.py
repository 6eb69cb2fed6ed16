"""``python -m kvwall``: record experiments, list them, check recorded results, execute a chapter, predict costs.

    python -m kvwall list
    python -m kvwall record decode_profile        # one experiment, full scale, into book/results/
    python -m kvwall record all                   # what `make record` runs
    python -m kvwall check                        # validate every file in book/results/ (exit 1: stale or refused)
    python -m kvwall execute book/01_the_86ms_profile.md --out /tmp/run -p mode=gpu
                                                  # run a chapter headless (papermill)
    python -m kvwall cost --gpu all --tp 8        # the cost model's prediction of every path (chapter 6)

``record`` checks everything before it runs anything: the experiment names, that ``--out`` is a
writable folder where each result file can be written, every experiment's prerequisites, and that no
full-scale result would be replaced by a small-scale one; it creates ``--out`` only once nothing stops
it. ``--force`` records anyway (a result then says what its run lacked). ``execute`` checks the chapter,
its parameters and both of its outputs (``<out>/<stem>.ipynb``, ``<out>/execution/<stem>.json``) before
it runs. Relative paths are taken against the current directory. ``check`` exits 0 only when every
result is valid and fresh (a gate for scripts): 1 when any is stale, refused or missing.

Exit status: 0 done; 2 refused before anything ran (a usage error, or something in the way: the message
names the argument and what to do); 1 a run that failed or a ``check`` that found problems; 3 ``record``
wrote results that are already stale; 130 interrupted; 141 the reader of the output went away (``| head``).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvwall.experiments import EXPERIMENTS, missing_prerequisites, run_experiment
from kvwall.model.cost import GPUS, MODEL_PRESETS, TRANSFER_RULES
from kvwall.model.original import ORIGINAL
from kvwall.results import (
    RESULTS_DIR,
    ResultFileError,
    ResultMissingError,
    check_writable_target,
    load_result,
    recorded_scale,
    save_result,
)

__all__ = ["main"]


class Refused(Exception):
    """Something stops a command before it runs anything: exit status 2, the message on standard error."""


# --- argument types: argparse names the argument in what they raise ------------------------------------------


def _path(text: str) -> Path:
    """A path, made absolute against the current directory (so messages say where it is)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a path: give a file or folder name")
    return Path(os.path.abspath(text))


def _out_dir(text: str) -> Path:
    """A folder files can be written into, as far as can be told without creating anything: it, or its nearest
    existing parent, is a folder this user may write in."""
    out = existing = _path(text)
    try:
        while not existing.exists() and existing.parent != existing:
            existing = existing.parent
        problem = (
            None
            if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
            else f"{existing} is not a folder"
            if not existing.is_dir()
            else f"{existing} is not writable"
        )
    except OSError as exc:  # a name too long, say
        problem = exc.strerror or str(exc)
    if problem:
        raise argparse.ArgumentTypeError(f"{out}: cannot write there ({problem}); give a folder you can write in")
    return out


def _positive(text: str) -> int:
    """A whole number of at least 1."""
    if not text.isdecimal() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number (1, 2, ...)")
    return int(text)


def _parameter(item: str) -> tuple[str, Any]:
    """``NAME=VALUE``, VALUE a Python literal where it is one, else the string itself."""
    name, sep, raw = item.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"{item!r} is not NAME=VALUE (for example -p mode=cpu)")
    try:
        return name, ast.literal_eval(raw)
    except Exception:  # noqa: BLE001 - not a literal ({[]: 1} raises TypeError): text
        return name, raw


class _Parameters(argparse.Action):
    """``-p NAME=VALUE`` into a dict; a name given twice is refused, naming it."""

    def __call__(self, parser, namespace, values, option_string=None):
        name, value = values
        given = dict(getattr(namespace, self.dest) or {})
        if name in given:
            raise argparse.ArgumentError(self, f"{name} given more than once; give each parameter once")
        setattr(namespace, self.dest, {**given, name: value})


# --- the commands ------------------------------------------------------------------------------------------


def _list(args: argparse.Namespace) -> int:
    for exp in EXPERIMENTS.values():
        print(f"{exp.name:24s} {exp.about} [requires {', '.join(exp.requires) or 'nothing'}]")
    return 0


def _record(args: argparse.Namespace) -> int:
    names = list(EXPERIMENTS) if "all" in args.experiments else args.experiments
    if "all" in args.experiments and len(set(args.experiments)) > 1:
        raise Refused("give 'all' alone (it is every experiment), or name experiments without it")
    experiments = [EXPERIMENTS[n] for n in EXPERIMENTS if n in names]  # dependency order: writers before readers
    out, scale = args.out, args.scale
    missing = missing_prerequisites(r for exp in experiments for r in exp.requires)
    lacking = {exp.name: sorted(set(exp.requires) & set(missing)) for exp in experiments}
    refusals = [
        f"missing {r} ({why}), needed by {', '.join(n for n, lacks in lacking.items() if r in lacks)}"
        for r, why in sorted(missing.items())
    ]
    full = [e.name for e in experiments if scale == "small" and recorded_scale(e.name, out) == "full"]
    if full:
        refusals.append(f"{', '.join(full)} in {out} are full-scale results; a small-scale run would replace them")
    in_the_way = []
    for exp in experiments:
        try:
            check_writable_target(out / f"{exp.name}.json")
        except ResultFileError as exc:
            in_the_way.append(
                f"{exc.path}: {exc.problem}; move it out of the way or record into another --out "
                "(--force does not lift this: only a result file is ever replaced)"
            )
    if in_the_way or (refusals and not args.force):
        hint = (
            "\nRun where nothing is missing (`python -m kvwall list` shows what each experiment requires), "
            "record into another --out, or pass --force (results note what their run lacked)."
            if refusals
            else ""
        )
        raise Refused("nothing was run:\n" + "\n".join(f"  - {line}" for line in in_the_way + refusals) + hint)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise Refused(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    print(f"kvwall record: {len(experiments)} experiment(s) at {scale} scale into {out}", file=sys.stderr)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interactive, started, saved = sys.stderr.isatty(), time.time(), []
    with tqdm(experiments, unit="experiment", file=sys.stderr, disable=not interactive) as bar:
        for i, exp in enumerate(bar):
            if not interactive:
                print(f"[{i + 1}/{len(experiments)}] {exp.name} ({scale} scale) ...", file=sys.stderr, flush=True)
            t0 = time.time()
            try:
                result = run_experiment(exp.name, device, scale)
            except Exception as exc:  # noqa: BLE001 - said in one line; the traceback goes to a file, named
                log = Path(tempfile.gettempdir()) / f"kvwall-record-{exp.name}-{os.getpid()}.txt"
                log.write_text(traceback.format_exc())
                done, rest = (
                    ", ".join(e.name for e in part) or "none" for part in (experiments[:i], experiments[i + 1 :])
                )
                tqdm.write(
                    f"kvwall record: {exp.name} failed after {time.time() - t0:.1f} s: {type(exc).__name__}: "
                    f"{str(exc)[:500]} (its traceback: {log}); recorded before it: {done}; not run: {rest}.",
                    file=sys.stderr,
                )
                return 1
            result.provenance.missing = lacking[exp.name]
            path = save_result(result, out)
            tqdm.write(f"recorded {exp.name} in {time.time() - t0:.1f} s -> {path}", file=sys.stdout)
            saved.append(result.experiment)
            derive = getattr(exp, "after_record", None)  # what the kernels read, derived before what reads it runs
            for written in derive(result) if derive and scale == "full" else []:
                tqdm.write(f"  {exp.name}: wrote {written}", file=sys.stdout)
    print(f"recorded {len(experiments)} experiment(s) in {time.time() - started:.1f} s", file=sys.stderr)
    return _stale_after_recording(saved, out)


def _stale_after_recording(saved: list[str], out: Path) -> int:
    """0 when every result this run wrote is fresh against the code as it is now; else name them and return 3 (a
    table derived after a result was recorded changed code it depends on: record in dependency order)."""
    stale, others = [], []
    for name in saved:
        try:
            result = load_result(name, out)
        except ResultFileError as exc:
            stale.append(f"{name}: {exc}")
            continue
        if result.stale:
            stale.append(f"{name}: changed since it was recorded: {', '.join(result.changed_sources())}")
    for name in (n for n in EXPERIMENTS if n not in saved):
        try:
            if (out / f"{name}.json").is_file() and load_result(name, out).stale:
                others.append(name)
        except ResultFileError:
            continue  # `check` reports unreadable files; this is about what the run changed
    if others:
        print(
            f"kvwall record: other results in {out} are stale now (the code or a table they read changed): "
            f"{', '.join(others)}; re-record them (`make record` records everything in dependency order).",
            file=sys.stderr,
        )
    if stale:
        print(
            "kvwall record: results of this run are already stale:\n" + "\n".join(f"  - {s}" for s in stale),
            file=sys.stderr,
        )
    return 3 if stale else 0


def _execute(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `record` must run on GPU machines that have no Jupyter (papermill,
    # jupytext, nbformat), and only `execute` needs the notebook layer's execution.
    # pylint: disable=import-outside-toplevel
    from papermill import PapermillExecutionError

    from kvwall.reports.execute import ChapterError, ChapterRunError, execute_chapter

    notebook = args.out / f"{args.chapter.stem}.ipynb"  # where execute_chapter puts it
    try:
        record = execute_chapter(args.chapter, args.out, progress_bar=sys.stderr.isatty(), **(args.param or {}))
    except ChapterError as exc:
        raise Refused(str(exc)) from None
    except ChapterRunError as exc:
        print(f"kvwall execute: {exc}", file=sys.stderr)
        return 1
    except PapermillExecutionError as exc:
        print(
            f"kvwall execute: {args.chapter.name} stopped in cell {exc.exec_count} (full traceback in {notebook}):"
            f"\n{exc.ename}: {exc.evalue}",
            file=sys.stderr,
        )
        return 1
    print(
        json.dumps(
            {
                **{k: record.get(k) for k in ("chapter", "mode", "device", "scale", "duration_s")},
                "notebook": str(notebook),
                "record": str(args.out / "execution" / f"{args.chapter.stem}.json"),
            }
        )
    )
    return 0


#: ``--rule`` values: both transfer rules (a range), or one of them.
_RULES: dict[str, str | None] = {"both": None, **{r.replace(" ", "-"): r for r in TRANSFER_RULES}}
#: ``cost``'s state: the options that change the original's (``ORIGINAL_STATE``).
_STATE = ("model", "tp", "context", "batch", "pool", "layers", "heads")


def _cost(args: argparse.Namespace) -> int:
    # The notebook layer (plotly, IPython) only for this command, as for `execute`.
    # pylint: disable=import-outside-toplevel
    from tabulate import tabulate

    from kvwall.reports.answer_report import fit_sweep
    from kvwall.reports.cost_explorer import ORIGINAL_STATE, cost_rows, rates_note
    from kvwall.reports.original_gpu_report import rest_without_attention_ms
    from kvwall.reports.tables import fmt_range

    base = replace(ORIGINAL_STATE, **{f: getattr(args, f) for f in _STATE if getattr(args, f) is not None})
    if problem := base.problem():
        heads = base.heads or MODEL_PRESETS[base.model].num_heads
        hint = (
            "; raise --pool or lower --batch / --context"
            if not base.fits
            else f"; give a --tp that divides {heads}"
            if heads % base.tp
            else ""
        )
        raise Refused(f"{problem}{hint}.")
    try:
        sweep = load_result("path_sweep")
    except ResultFileError as exc:
        raise Refused(f"the cost model is fitted on the recorded path_sweep, which cannot be read: {exc}") from None
    model, rule, g = fit_sweep(sweep).model, _RULES[args.rule], base.geometry
    spread = f"low–high over the rules {' / '.join(TRANSFER_RULES)}" if rule is None else f"rule: {rule}"
    print(
        f"Rates: {rates_note(model, model.reference)}. {sweep.caption()} Other GPUs: datasheet ceilings, "
        f"rates transferred from the {model.reference.name} ({spread})."
    )
    print(
        f"{g.name}: {g.heads_per_gpu} heads per GPU (TP {base.tp}), {base.batch} × {base.context:,} tokens, pool "
        f"{base.pool:,} tokens. KV work per step = preparation + attention, all {g.num_layers} layers."
    )
    for key in GPUS if args.gpu == "all" else [args.gpu or ORIGINAL_STATE.gpu]:
        state, gpu = replace(base, gpu=key), GPUS[key]
        rows = [
            (
                r.path,
                r.cache,
                f"{r.kv_bytes_per_token:,}",
                fmt_range(r.layer_lo_us, r.layer_hi_us),
                fmt_range(r.step_lo_ms, r.step_hi_ms, 2),
                r.label,
            )
            for r in cost_rows(model, state, rule)
        ]
        table = tabulate(
            rows,
            ("path", "cache", "KV B/token", "µs per layer", "ms KV work/step", "label"),
            colalign=("left", "left", "right", "right", "right", "left"),
            disable_numparse=True,
        )
        print(f"\n{gpu.name} ({gpu.arch}): {rates_note(model, gpu)}\n{textwrap.indent(table, '  ')}")
        if state == ORIGINAL_STATE:
            lo, hi = rest_without_attention_ms(model, state.point, gpu)
            print(
                f"  The original's step here: {ORIGINAL.step_ms} ms, {ORIGINAL.cast_ms} ms of it the cast. Without "
                f"the cast and its own attention (FlashInfer fa2 BF16, predicted), {fmt_range(lo, hi)} ms remain: "
                "a path's step is about that plus its KV work."
            )
    return 0


def _check(args: argparse.Namespace) -> int:
    """Every experiment's result in ``--dir``: 0 when all are valid and fresh, else 1 (a gate for scripts)."""
    if not args.dir.is_dir():
        raise Refused(f"{args.dir} is not a folder of results (the default is {RESULTS_DIR}).")
    counts = dict.fromkeys(("ok", "stale", "invalid", "missing"), 0)
    for name in EXPERIMENTS:
        try:
            result = load_result(name, args.dir)
            kind, line = ("stale" if result.stale else "ok"), result.caption()
        except ResultFileError as exc:
            kind, line = ("missing" if isinstance(exc, ResultMissingError) else "invalid"), str(exc)
        counts[kind] += 1
        print(f"{kind.upper() if kind != 'ok' else kind:7s} {line}")
    bad = len(EXPERIMENTS) - counts.pop("ok")
    if bad:
        print(
            f"kvwall check: {bad} of {len(EXPERIMENTS)} results are not valid and fresh ("
            + ", ".join(f"{n} {k}" for k, n in counts.items() if n)
            + "): re-record the stale and missing ones (`python -m kvwall record <experiment>`, on a GPU), restore "
            "or re-record the invalid ones.",
            file=sys.stderr,
        )
    return 1 if bad else 0


def _answer(args: argparse.Namespace) -> int:
    from kvwall.reports import decision  # pylint: disable=import-outside-toplevel

    if not args.readme:
        print(decision.readme_answer())
        return 0
    path = Path(__file__).resolve().parents[2] / "README.md"
    print(f"{path}: {'answer rewritten' if decision.write_readme_answer(path) else 'already current'}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvwall", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the experiments and what each requires").set_defaults(run=_list)
    rec = sub.add_parser("record", help="run experiments and write their results (full scale needs a GPU)")
    rec.add_argument(
        "experiments",
        nargs="+",
        choices=["all", *EXPERIMENTS],
        metavar="experiments",
        help=f"'all' or any of: {', '.join(EXPERIMENTS)}",
    )
    rec.add_argument("--scale", choices=("full", "small"), default="full")
    rec.add_argument(
        "--out", type=_out_dir, default=str(RESULTS_DIR), help=f"folder for the result files (default: {RESULTS_DIR})"
    )
    rec.add_argument(
        "--force",
        action="store_true",
        help="record even where prerequisites are missing or a full-scale result would be replaced",
    )
    rec.set_defaults(run=_record)
    chk = sub.add_parser("check", help="validate the recorded results and report stale ones")
    chk.add_argument("--dir", type=_path, default=str(RESULTS_DIR))
    chk.set_defaults(run=_check)
    exe = sub.add_parser("execute", help="run a chapter (book/NN_slug.md) headless with papermill")
    exe.add_argument("chapter", type=_path)
    exe.add_argument(
        "--out",
        type=_out_dir,
        required=True,
        help="folder (outside book/) for the executed <stem>.ipynb and its record, execution/<stem>.json",
    )
    exe.add_argument(
        "-p",
        "--param",
        action=_Parameters,
        metavar="NAME=VALUE",
        type=_parameter,
        help="a parameter, VALUE as a Python literal (strings may be bare): -p mode=gpu -p layers=8",
    )
    exe.set_defaults(run=_execute)
    cst = sub.add_parser("cost", help="predict every path's KV work per decode step (chapter 6's cost model)")
    cst.add_argument("--model", choices=list(MODEL_PRESETS), help="model preset (default: the original's, glm-5)")
    cst.add_argument("--gpu", choices=[*GPUS, "all"], help="GPU, or 'all' (default: the original's, rtx-pro-6000)")
    for option, what in (
        ("tp", "tensor parallel degree: heads per GPU = the model's heads / TP"),
        ("context", "tokens per request"),
        ("batch", "requests, each of --context tokens"),
        ("pool", "KV pool tokens"),
        ("layers", "your model's layers (overrides the preset's)"),
        ("heads", "your model's attention heads, all GPUs (overrides the preset's)"),
    ):
        cst.add_argument(f"--{option}", type=_positive, help=what)
    cst.add_argument(
        "--rule",
        choices=list(_RULES),
        default="both",
        help="how the H200's fitted rates transfer to other GPUs: both (a range) or one rule",
    )
    cst.set_defaults(run=_cost)
    ans = sub.add_parser("answer", help="print the book's answer (the front page's table) as Markdown")
    ans.add_argument("--readme", action="store_true", help="write it into README.md between its markers instead")
    ans.set_defaults(run=_answer)
    return parser


class _StdoutFailed(Exception):
    """Writing standard output failed (``args[0]``: the OSError), told apart from the files a command writes."""


class _Stdout:
    """``sys.stdout``, whose write and flush errors raise :class:`_StdoutFailed`."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)

    def write(self, text: str) -> int:
        return self._do(self.stream.write, text)

    def flush(self) -> None:
        self._do(self.stream.flush)

    @staticmethod
    def _do(call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as exc:
            raise _StdoutFailed(exc) from None


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None or sys.stderr is None:  # started with one closed (`>&-`, `2>&-`)
        closed = "output" if sys.stdout is None else "error"
        print(
            f"kvwall: standard {closed} is closed; run with it open (redirect it to /dev/null to discard it).",
            file=sys.stderr or sys.stdout,
        )
        return 2
    args = _parser().parse_args(argv)  # a usage error exits 2 here, naming the argument
    stream, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a reader that went away, or a full disk, shows up here at the latest
    except Refused as exc:
        print(f"kvwall {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nkvwall: interrupted; what was finished is kept (each result recorded so far).", file=sys.stderr)
        return 130
    except _StdoutFailed as failed:
        os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())  # so that the interpreter's last flush passes
        if isinstance(failed.args[0], BrokenPipeError):
            return 128 + 13  # the reader went away (`| head`): stop quietly, as a process killed by SIGPIPE
        print(
            f"kvwall: cannot write to standard output ({failed.args[0].strerror}); the output is lost.", file=sys.stderr
        )
        return 2
    finally:
        sys.stdout = stream
    return status


if __name__ == "__main__":
    raise SystemExit(main())

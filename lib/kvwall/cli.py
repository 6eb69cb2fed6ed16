"""``python -m kvwall``: record experiments, list them, check recorded results, execute a chapter.

    python -m kvwall list
    python -m kvwall record decode_profile        # one experiment, full scale, into book/results/
    python -m kvwall record all                   # what `make record` runs
    python -m kvwall check                        # validate every file in book/results/
    python -m kvwall execute book/01_the_86ms_profile.md --out /tmp/run -p mode=gpu
                                                  # run a chapter headless (papermill)

``record`` checks everything before it runs anything: the experiment names, that ``--out`` is a
writable folder, every experiment's prerequisites, and that no full-scale result would be replaced
by a small-scale one. ``--force`` records anyway (a result then says what its run lacked).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvwall.experiments import EXPERIMENTS, Experiment, missing_prerequisites, run_experiment
from kvwall.results import (
    RESULTS_DIR, ResultFileError, ResultMissingError, load_result, recorded_scale, save_result,
)

__all__ = ["main"]

#: Exit status when the reader of our output went away (``| head``): what tools killed by SIGPIPE return.
_EXIT_BROKEN_PIPE = 128 + 13


def _fail(message: str) -> int:
    print(f"kvwall: {message}", file=sys.stderr)
    return 2


def _out_problem(out: Path) -> str | None:
    """Why results cannot be written into ``out`` (None if they can); creates the folder if it is missing."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as exc:
        return f"--out {out}: cannot write results there ({exc.strerror or exc})"
    return None


def _missing_by_experiment(experiments: list[Experiment]) -> dict[str, dict[str, str]]:
    """``{experiment: {prerequisite: why missing}}`` for the experiments that lack something here."""
    missing = missing_prerequisites(r for exp in experiments for r in exp.requires)
    lacks = {exp.name: {r: missing[r] for r in exp.requires if r in missing} for exp in experiments}
    return {name: why for name, why in lacks.items() if why}


def _record_refusals(experiments: list[Experiment], lacking: dict[str, dict[str, str]], scale: str,
                     out: Path) -> list[str]:
    """Everything that stops ``record`` before it runs anything (without ``--force``)."""
    lines = []
    for prerequisite in sorted({r for why in lacking.values() for r in why}):
        names = [n for n, why in lacking.items() if prerequisite in why]
        reason = next(why[prerequisite] for why in lacking.values() if prerequisite in why)
        lines.append(f"missing {prerequisite} ({reason}), needed by {', '.join(names)}")
    if scale == "small":
        full = [e.name for e in experiments if recorded_scale(e.name, out) == "full"]
        if full:
            lines.append(f"{', '.join(full)} in {out} are full-scale results; a small-scale run would replace them")
    return lines


def _record(experiments: list[Experiment], scale: str, out: Path, force: bool) -> int:
    problem = _out_problem(out)
    if problem:
        return _fail(problem)
    lacking = _missing_by_experiment(experiments)
    refusals = _record_refusals(experiments, lacking, scale, out)
    if refusals and not force:
        print("kvwall record: nothing was run:\n" + "\n".join(f"  - {line}" for line in refusals)
              + "\nRun on a machine that has what is missing (`python -m kvwall list` shows what each experiment "
                "requires), record into another --out, or pass --force to record anyway (results note what "
                "their run lacked).", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    interactive = sys.stderr.isatty()
    started = time.time()
    with tqdm(total=len(experiments), unit="experiment", file=sys.stderr, disable=not interactive) as bar:
        for i, exp in enumerate(experiments, 1):
            bar.set_description(f"record {exp.name}")
            if not interactive:
                print(f"[{i}/{len(experiments)}] {exp.name} ({scale} scale) ...", file=sys.stderr, flush=True)
            t0 = time.time()
            try:
                result = run_experiment(exp.name, device, scale)
            except Exception:
                done = ", ".join(e.name for e in experiments[: i - 1]) or "none"
                tqdm.write(f"kvwall record: {exp.name} failed after {time.time() - t0:.1f} s (traceback below); "
                           f"recorded before it: {done}; not run: "
                           f"{', '.join(e.name for e in experiments[i:]) or 'none'}.", file=sys.stderr)
                raise
            result.provenance.missing = sorted(lacking.get(exp.name, {}))
            path = save_result(result, out)
            tqdm.write(f"recorded {exp.name} in {time.time() - t0:.1f} s -> {path}", file=sys.stdout)
            bar.update()
    print(f"recorded {len(experiments)} experiment(s) in {time.time() - started:.1f} s", file=sys.stderr)
    return 0


def _parameter_values(items: list[str], parser: argparse.ArgumentParser) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not name.isidentifier():
            parser.error(f"parameter {item!r} is not NAME=VALUE")
        try:
            values[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            values[name] = raw
    return values


def _execute(chapter: Path, out: Path, values: dict[str, Any]) -> int:
    # Imported here, not at the top: `record` must run on GPU machines that have no Jupyter (papermill,
    # jupytext, nbformat), and only `execute` needs the notebook layer's execution.
    import papermill  # pylint: disable=import-outside-toplevel
    from kvwall.notebook.execute import ChapterError, execute_chapter  # pylint: disable=import-outside-toplevel

    try:
        record = execute_chapter(chapter, out, progress_bar=sys.stderr.isatty(), **values)
    except ChapterError as exc:
        return _fail(f"execute: {exc}")
    except papermill.PapermillExecutionError as exc:
        notebook = out / f"{chapter.stem}.ipynb"
        print(f"kvwall execute: {chapter.name} stopped in cell {exc.exec_count} (full traceback in {notebook}):\n"
              f"{exc.ename}: {exc.evalue}", file=sys.stderr)
        return 1
    print(json.dumps({k: record[k] for k in ("chapter", "mode", "device", "scale", "duration_s")}))
    return 0


def _check(directory: Path) -> int:
    if not directory.is_dir():
        return _fail(f"check: {directory} is not a folder of results (the default is {RESULTS_DIR}).")
    status = 0
    for name in EXPERIMENTS:
        try:
            result = load_result(name, directory)
        except ResultFileError as exc:
            print(f"{'MISSING' if isinstance(exc, ResultMissingError) else 'INVALID'} {exc}")
            status = 1
            continue
        print(("STALE   " if result.stale else "ok      ") + result.caption())
    return status


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvwall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the experiments and what each requires")
    rec = sub.add_parser("record", help="run experiments and write their results (full scale needs a GPU)")
    rec.add_argument("experiments", nargs="+", help=f"'all' or any of: {', '.join(EXPERIMENTS)}")
    rec.add_argument("--scale", choices=("full", "small"), default="full")
    rec.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for the result files")
    rec.add_argument("--force", action="store_true",
                     help="record even where prerequisites are missing or a full-scale result would be replaced")
    chk = sub.add_parser("check", help="validate the recorded results and report stale ones")
    chk.add_argument("--dir", type=Path, default=RESULTS_DIR)
    exe = sub.add_parser("execute", help="run a chapter (book/NN_slug.md) headless with papermill")
    exe.add_argument("chapter", type=Path)
    exe.add_argument("--out", type=Path, required=True, help="folder for the executed .ipynb and its record")
    exe.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                     help="a parameter, VALUE as a Python literal (strings may be bare): -p mode=gpu -p layers=8")
    return parser


def _run(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        for exp in EXPERIMENTS.values():
            needs = ", ".join(exp.requires) or "nothing"
            print(f"{exp.name:24s} {exp.about} [requires {needs}]")
        return 0
    if args.command == "record":
        names = list(EXPERIMENTS) if args.experiments == ["all"] else args.experiments
        unknown = [n for n in names if n not in EXPERIMENTS]
        if unknown:
            parser.error(f"unknown experiment(s) {unknown}; choose 'all' or from {list(EXPERIMENTS)}")
        return _record([EXPERIMENTS[n] for n in names], args.scale, args.out, args.force)
    if args.command == "execute":
        return _execute(args.chapter, args.out, _parameter_values(args.param, parser))
    return _check(args.dir)


def main(argv: list[str] | None = None) -> int:
    try:
        status = _run(argv)
        sys.stdout.flush()  # inside the try: a closed pipe shows up here, not in the interpreter's exit
        return status
    except BrokenPipeError:
        # The reader went away (`python -m kvwall list | head`): stop quietly. Point stdout at /dev/null
        # so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _EXIT_BROKEN_PIPE


if __name__ == "__main__":
    raise SystemExit(main())

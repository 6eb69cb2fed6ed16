"""``python -m kvwall``: record experiments on a GPU, list them, check recorded results.

    python -m kvwall list
    python -m kvwall record decode_profile        # one experiment, full scale, into book/results/
    python -m kvwall record all                   # what `make record` runs
    python -m kvwall check                        # validate every file in book/results/
    python -m kvwall execute book/01_the_86ms_profile.md --out /tmp/run -p mode=gpu
                                                  # run a chapter headless (papermill)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from kvwall.experiments import EXPERIMENTS, run_experiment
from kvwall.results import RESULTS_DIR, ResultFileError, load_result, save_result


def _record(names: list[str], scale: str, out: Path) -> int:
    need_gpu = [n for n in names if EXPERIMENTS[n].needs == "cuda"]
    if need_gpu and not torch.cuda.is_available():
        print(f"kvwall record: no CUDA GPU here, and {', '.join(need_gpu)} are full-scale GPU measurements; "
              "run this on a machine with an NVIDIA GPU (chapters run live at small scale on a CPU).",
              file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for name in names:
        t0 = time.time()
        result = run_experiment(name, device, scale)
        path = save_result(result, out)
        print(f"recorded {name} in {time.time() - t0:.1f} s -> {path}", flush=True)
    return 0


def _execute(chapter: Path, out: Path, params: list[str], parser: argparse.ArgumentParser) -> int:
    import ast

    from kvwall.notebook.execute import execute_chapter

    values = {}
    for item in params:
        name, sep, raw = item.partition("=")
        if not sep or not name.isidentifier():
            parser.error(f"parameter {item!r} is not NAME=VALUE")
        try:
            values[name] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            values[name] = raw
    record = execute_chapter(chapter, out, **values)
    print(json.dumps({k: record[k] for k in ("chapter", "mode", "device", "scale", "duration_s")}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvwall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the experiments")
    rec = sub.add_parser("record", help="run experiments at full scale on a GPU and write their results")
    rec.add_argument("experiments", nargs="+", help=f"'all' or any of: {', '.join(EXPERIMENTS)}")
    rec.add_argument("--scale", choices=("full", "small"), default="full")
    rec.add_argument("--out", type=Path, default=RESULTS_DIR)
    chk = sub.add_parser("check", help="validate the recorded results and report stale ones")
    chk.add_argument("--dir", type=Path, default=RESULTS_DIR)
    exe = sub.add_parser("execute", help="run a chapter headless with papermill")
    exe.add_argument("chapter", type=Path)
    exe.add_argument("--out", type=Path, required=True, help="folder for the executed .ipynb and its record")
    exe.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                     help="a parameter, VALUE as a Python literal (strings may be bare): -p mode=gpu -p layers=8")
    args = parser.parse_args(argv)

    if args.command == "list":
        for exp in EXPERIMENTS.values():
            print(f"{exp.name:18s} {exp.about}")
        return 0
    if args.command == "record":
        names = list(EXPERIMENTS) if args.experiments == ["all"] else args.experiments
        unknown = [n for n in names if n not in EXPERIMENTS]
        if unknown:
            parser.error(f"unknown experiment(s) {unknown}; choose 'all' or from {list(EXPERIMENTS)}")
        return _record(names, args.scale, args.out)
    if args.command == "execute":
        return _execute(args.chapter, args.out, args.param, parser)
    status = 0
    for name in EXPERIMENTS:
        try:
            result = load_result(name, args.dir)
        except ResultFileError as exc:
            print(f"MISSING/INVALID {exc}")
            status = 1
            continue
        print(("STALE " if result.stale else "ok    ") + result.caption())
    return status


if __name__ == "__main__":
    raise SystemExit(main())

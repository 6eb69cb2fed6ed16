"""``python -m kvwall.gather_report [DIR]``: chapter 4's recorded results in a few lines (for a terminal).

Reads ``gather_cast_validation``, ``gather_cast_bench`` and ``gather_cast_profile`` from ``DIR``
(default: book/results) and prints what failed, the bandwidth table and the step gains.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .results import RESULTS_DIR, ResultFileError, load_result


def main(argv: list[str]) -> int:
    directory = Path(argv[0]) if argv else RESULTS_DIR
    for name in ("gather_cast_validation", "gather_cast_bench", "gather_cast_profile"):
        try:
            r = load_result(name, directory)
        except ResultFileError as exc:
            print(f"== {name}: {exc}")
            continue
        print(f"== {name}: {r.provenance.short()}")
        if name == "gather_cast_validation":
            for section in ("cases", "graph", "errors", "full_cast"):
                rows = [x for x in r.rows if x["section"] == section]
                bad = [x for x in rows if not x.get("ok")]
                print(f"  {section}: {len(rows) - len(bad)}/{len(rows)} ok" + (f"; FAILED: {bad[:3]}" if bad else ""))
            for x in r.rows:
                if x["section"] in ("nvcc", "sanitizer"):
                    print(f"  {x['section']}: {x['summary']} (rc {x.get('returncode')})")
        elif name == "gather_cast_bench":
            copy = r.table("copy")[0]["gbps"]
            print(f"  copy ceiling {copy:,.0f} GB/s")
            for x in r.table("sweep"):
                print(f"  {x['layout'][:8]:8s} n={x['n']:>7,} {x['impl'][:26]:26s} {x['ms'] * 1e3:9.1f} us "
                      f"{x['gbps']:7,.0f} GB/s {x['of_copy']:5.0%}")
            for section in ("graph", "launch", "full_pool"):
                for x in r.rows:
                    if x["section"] == section:
                        print(f"  {section}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                           for k, v in x.items() if k != "section"))
        else:
            for x in r.table("strategies"):
                print(f"  {x['strategy']:26s} step {x['step_ms']:7.2f} ms  kv {x['kv_strategy_ms_per_step']:7.2f} ms  "
                      f"err {x['rel_err_vs_float64']:.1e}")
            for x in r.table("gain"):
                print(f"  gain {x['strategy']:26s} saved {x['time_saved']:.1%}  speed-up {x['speedup']:.2f}x")
            for x in r.table("capacity"):
                print(f"  capacity {x['capacity']:>7,} {x['strategy']:26s} {x['ms_per_layer'] * 1e3:8.1f} us/layer")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

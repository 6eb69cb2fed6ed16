"""Summarize ncu_peers.sh's raw CSVs (one per strategy and point): per kernel name, the metrics of its last profiled
launch, in the profile experiment's names.  python notes/issue22_combine/ncu_peers_summary.py DIR > summary.json"""
import csv, glob, io, json, os, sys
from kvwall.measure.ncu import NCU_METRICS, NCU_OPTIONAL_METRICS

NAMES = {**NCU_METRICS, **NCU_OPTIONAL_METRICS}
out = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.csv"))):
    kernels: dict[str, dict] = {}
    lines = [line for line in open(f) if line.startswith('"')]
    for rec in csv.DictReader(io.StringIO("".join(lines))):
        name = rec["Kernel Name"].split("(")[0].split("<")[0].replace("void ", "")
        try:
            kernels.setdefault(name, {}).setdefault(rec["ID"], {})[NAMES[rec["Metric Name"]]] = float(
                rec["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            pass
    out[os.path.basename(f)[:-4]] = {k: v[max(v, key=int)] for k, v in kernels.items()}
json.dump(out, sys.stdout, indent=1)

"""Exploration (not recorded): Nsight Compute, with the profile experiment's metric set, on one long request
(480K tokens: as many CTAs as a batch), the tokens-on-M path at 16 heads and the heads-on-M path at 64 / 128."""
import json, os, time
from kvwall.measure.ncu import profile_kernel
from kvwall.experiments.fused_decode.profile import PROFILED
out = open(os.path.join(os.environ.get("OUT", "/tmp"), "ncu_heavy.jsonl"), "a")
for h, t, path in [(16, 491520, "wgmma_tokens"), (32, 491520, "wgmma_tokens"), (128, 491520, "wgmma"),
                   (64, 491520, "wgmma"), (16, 131072, "wgmma")]:
    t0 = time.time()
    try:
        module, regex = PROFILED[path]
        row = profile_kernel(module, ["--profile-one", str(h), str(t)], kernel_regex=regex, launch_skip=3,
                             timeout_s=150)
    except Exception as exc:
        row = {"error": f"{type(exc).__name__}: {str(exc)[-800:]}"}
    row.update(heads=h, tokens=t, path=path, s=round(time.time() - t0, 1))
    line = json.dumps(row)
    print(line, flush=True); out.write(line + "\n"); out.flush()

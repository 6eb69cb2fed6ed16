#!/bin/bash
# EXPLORATORY (issue 22, Generation 5). One device call: build, check and time the seesaw draft.
#   run(command="bash notes/issue22_seesaw/device.sh", carry=[".whl"], timeout_s=600)
# .whl/ (git-ignored; /work/main/.whl has it) holds the sgl_flash_mla wheel FlashMLA's rows need; without it those
# rows say why they are missing and the rest still runs. Same setup as .dev/setup.sh: wheels into /tmp/site, the
# project editable (kvwall.kernels is the kernels/ directory).
set -u
cd "$(dirname "$0")/../.."
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip-e.log 2>&1 || {
  echo "pip -e failed:"; tail -5 /tmp/pip-e.log; }
export PYTHONUNBUFFERED=1 KVWALL_BUILD_CACHE=/tmp/kvwall_cache OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader 2>/dev/null
timeout 540 python3 notes/issue22_seesaw/run.py "$@"
rc=$?
nvidia-smi --query-gpu=clocks.sm,temperature.gpu --format=csv,noheader 2>/dev/null
exit $rc

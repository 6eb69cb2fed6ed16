# EXPLORATION (issue 22): on the device, from the repository root:  bash notes/issue22_2c/run.sh
# Sets up the environment as the earlier exploration calls did (.dev/setup.sh: wheels, editable install), then runs
# wt2c_run.py (builds, checks with a hang guard, times, traces); JSON lines in $OUT/wt2c.jsonl.
set +e
if [ -f .dev/setup.sh ]; then source .dev/setup.sh || exit 1; else echo "no .dev/setup.sh: using the environment as is"; fi
export PYTHONUNBUFFERED=1
mkdir -p "${OUT:=/tmp/wt2c_out}"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.sm --format=csv,noheader 2>/dev/null
timeout -k 10 560 python3 notes/issue22_2c/wt2c_run.py
echo "== wt2c rc=$?"

#!/bin/bash
# One call on the lent GPU machine (no network): run(command="bash tools/device/device.sh STEP...", carry=[".whl", ".dev"])
#   tests        the GPU tests of ours' kernels (TESTS= to choose others; stops the call on a failure)
#   rec:NAME     python -m kvwall record NAME --out $OUT (fused_decode_paths: the path tables it writes copied to $OUT too)
#   py:FILE      a Python script, its output's last LINES_OUT lines
# What .whl and .dev must hold, and how to rebuild them: tools/device/README.md.
set -u
cd "$(dirname "$0")/../.."
wheels=".whl/*.whl"; [ -d .whlnb ] && wheels="$wheels .whlnb/*.whl"  # .whlnb: the chapters' notebook packages
want="$(ls $wheels | md5sum)"
if [ "$(cat /tmp/site/.done 2>/dev/null)" != "$want" ]; then
  rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $wheels && echo "$want" > /tmp/site/.done
fi
if [ -f .dev/sgsrc.tgz ]; then
  # SGLang 0.5.23's sources in /tmp/sgsrc, the packages its modules import and the machine lacks in /tmp/sgsrc/deps:
  # kvwall.peers.sglang appends $KVWALL_SGLANG_PATH/deps to sys.path (last), the patch check reads KVWALL_SGLANG_DEPS.
  sgsum="$(md5sum < .dev/sgsrc.tgz; ls .dev/sgdeps 2>/dev/null)"
  if [ "$(cat /tmp/sgsrc/.sum 2>/dev/null)" != "$sgsum" ]; then
    rm -rf /tmp/sgsrc
    mkdir -p /tmp/sgsrc && tar xzf .dev/sgsrc.tgz -C /tmp/sgsrc
    [ -d .dev/sgdeps ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgsrc/deps .dev/sgdeps/*.whl
    echo "$sgsum" > /tmp/sgsrc/.sum
  fi
  export KVWALL_SGLANG_SOURCE=/tmp/sgsrc KVWALL_SGLANG_SRC=/tmp/sgsrc KVWALL_SGLANG_PATH=/tmp/sgsrc
  export KVWALL_SGLANG_DEPS=/tmp/sgsrc/deps
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip-e.log 2>&1 || { echo "pip -e failed:"; tail -5 /tmp/pip-e.log; }
export PYTHONUNBUFFERED=1 KVWALL_BUILD_CACHE=/tmp/kvwall_cache FLASHINFER_WORKSPACE_BASE=/tmp/fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests)
      timeout ${TEST_TMO:-300} python3 -m pytest -q -m gpu -p no:cacheprovider -x ${TESTS:-tests/test_ours.py tests/test_mla_dispatch.py tests/test_mla_decode_wgmma.py tests/test_mla_decode_wgmma_tokens.py} > $OUT/tests.log 2>&1
      rc=$?; tail -25 $OUT/tests.log; echo "tests rc=$rc in $(( $(date +%s) - t0 )) s"
      [ $rc = 0 ] || exit 1 ;;
    py:*)
      timeout ${TMO:-560} python3 ${step#py:} 2>&1 | tail -${LINES_OUT:-200} ;;
    rec:*)
      name=${step#rec:}
      timeout ${TMO:-560} python3 -m kvwall record $name --out $OUT 2>&1 | grep -v "^\s*$" | tail -6
      [ $name = fused_decode_paths ] && cp kernels/mla_decode/*paths*.json $OUT/
      echo "$name in $(( $(date +%s) - t0 )) s" ;;
    *) echo "unknown step: $step (tests, rec:NAME, py:FILE)"; exit 2 ;;
  esac
done
ls $OUT

#!/bin/bash
# One device call: bash .dev/dev.sh STEP...   (carry [".whl", ".dev"])
#   tests        the GPU tests of ours' kernels (stops the call on a failure)
#   rec:NAME     python -m kvwall record NAME --out $OUT (fused_decode_paths: its tables copied to $OUT too)
set -u
cd "$(dirname "$0")/.."
want="$(ls .whl | md5sum)"
if [ "$(cat /tmp/site/.done 2>/dev/null)" != "$want" ]; then
  rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && echo "$want" > /tmp/site/.done
fi
sgsum="$(md5sum < .dev/sgsrc.tgz; ls .dev/sgdeps)"
if [ -f .dev/sgsrc.tgz ] && [ "$(cat /tmp/sgsrc/.sum 2>/dev/null)" != "$sgsum" ]; then
  rm -rf /tmp/sgsrc /tmp/sgdeps
  mkdir -p /tmp/sgsrc && tar xzf .dev/sgsrc.tgz -C /tmp/sgsrc && echo "$sgsum" > /tmp/sgsrc/.sum
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/sgdeps .dev/sgdeps/*.whl
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/tmp/pip-e.log 2>&1 || { echo "pip -e failed:"; tail -5 /tmp/pip-e.log; }
export PYTHONUNBUFFERED=1 KVWALL_BUILD_CACHE=/tmp/kvwall_cache FLASHINFER_WORKSPACE_BASE=/tmp/fi
export KVWALL_SGLANG_SOURCE=/tmp/sgsrc KVWALL_SGLANG_SRC=/tmp/sgsrc KVWALL_SGLANG_DEPS=/tmp/sgdeps KVWALL_SGLANG_PATH=/tmp/sgsrc
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
      [ $name = fused_decode_paths ] && cp kernels/mla_decode/paths.json kernels/mla_decode/paths_measured.json $OUT/
      echo "$name in $(( $(date +%s) - t0 )) s" ;;
  esac
done
ls $OUT

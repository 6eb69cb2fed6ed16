# EXPLORATION (issue 22), CPU only: compile each variant of mla_decode_wgmma_tokens_2c.cu for sm_90a with the host's
# flags, print ptxas's figures and, per SASS region (by control flow from the entry and from each USETMAXREG), the
# highest register used and the spills. Usage, from the repository root: bash notes/issue22_2c/compile_check.sh [NAME...]
set -e
here=$(cd "$(dirname "$0")" && pwd); root=$(cd "$here/../.." && pwd)
out=${WT2C_CC:-/tmp/wt2c_cc}; mkdir -p "$out"
py=${PYTHON:-python3}
cuo=$(command -v cuobjdump || true)
[ -n "$cuo" ] || cuo=$($py -c "import os, triton; print(os.path.join(os.path.dirname(triton.__file__), 'backends/nvidia/bin/cuobjdump'))" 2>/dev/null || true)
declare -A V=(
  [x1c2p]=""
  [2c1p]="-DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=1"
  [2c1p_slots]="-DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=1 -DKVWALL_SLOTS2=1"
  [2c2p]="-DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=2"
  [2c2p_r136]="-DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=2 -DKVWALL_RC16=136"
  [2c2p_pf2]="-DKVWALL_CONSUMERS16=2 -DKVWALL_PRODUCERS16=2 -DKVWALL_PF16=2"
)
names=${*:-x1c2p 2c1p 2c1p_slots 2c2p 2c2p_r136 2c2p_pf2}
for n in $names; do
  nice nvcc -O3 -std=c++17 ${V[$n]} -I"$root/kernels/mla_decode" -gencode=arch=compute_90a,code=sm_90a -Xptxas -v \
    -cubin -o "$out/$n.cubin" "$here/mla_decode_wgmma_tokens_2c.cu" > "$out/$n.log" 2>&1
  echo "== $n (${V[$n]:-no flags})"
  grep -i "warning" "$out/$n.log" || true
  awk '/Compiling entry/ {match($0, /kernelILi[0-9]+ELi[0-9]+ELi[0-9]+/); k=substr($0, RSTART+9, RLENGTH-9)}
       /spill stores/ {s=$5" B spill stores, "$9" B spill loads"} /Used [0-9]+ registers/ {print "  HN/NC/NP " k ": " $5 " registers, " s}' "$out/$n.log"
  if [ -x "$cuo" ]; then "$cuo" -sass "$out/$n.cubin" > "$out/$n.sass" && $py "$here/sass_regions.py" "$out/$n.sass" | cut -c1-110; fi
done

# Exploration: ncu (the profile experiment's metric set) on ours (page 64) and FlashMLA at chapter 5's batch points;
# raw CSV per run in $OUT/ncu_peers/ (one archive at the end). The first 6 matching kernel launches of the 4 calls are
# profiled (split, combine, ...: each a few times); ncu_peers_summary.py keeps the last launch of each kernel.
mkdir -p $OUT/ncu_peers
M=$(python3 -c "from kvwall.measure.ncu import NCU_METRICS as a, NCU_OPTIONAL_METRICS as b; print(','.join([*a, *b]))")
for spec in "ours_page64 16 131072 32" "flashmla_dense_fp8 16 131072 32" "ours_page64 16 32768 8" "flashmla_dense_fp8 16 32768 8" \
            "ours_page64 128 32768 32" "flashmla_dense_bf16 128 32768 32" "ours_page64 64 131072 8" "flashmla_dense_bf16 64 131072 8"; do
  set -- $spec; f=$OUT/ncu_peers/$1_$2h_$3_b$4.csv
  t0=$(date +%s)
  timeout 100 ncu --csv --print-units base --kernel-name "regex:mla|flash|splitkv|combine|attn|fwd" --launch-count 6 --metrics $M python3 notes/issue22_combine/peer_one.py $1 $2 $3 $4 > $f 2> $f.err
  echo "== $spec rc=$? $(( $(date +%s) - t0 )) s $(grep -c gpu__time_duration $f)"
done
# One archive: the device returns only so many files a call.
(cd $OUT && tar czf ncu_peers.tgz ncu_peers && rm -rf ncu_peers)

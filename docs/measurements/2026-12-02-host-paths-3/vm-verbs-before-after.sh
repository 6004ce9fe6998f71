#!/bin/bash
# Issue 16, third session: the host ring over verbs (soft-RoCE, rxe0/rxe1), the binary
# before this session (eea5548) and after, interleaved; then the write latency beside it.
cd "$(dirname "$0")/.."
run() { # label bin n
  echo "== $1 ranks=$3"
  timeout 300 scripts/launch-local.sh -n $3 -- $2 perf --transport verbs --devices $NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1 --sizes 8:1M --factor 8 --iters 10 2>&1 | grep -E "^\[rank 0\] +[0-9]+ +[0-9]+ +[0-9.]+ " | awk '{printf "%s:%s ", $3, $5} END {print ""}'
}
for round in 1 2 3; do
  run before target/old/release/nodetour 2
  run after target/release/nodetour 2
  run before target/old/release/nodetour 3
  run after target/release/nodetour 3
done
echo "== write latency (ours against ib_write_lat, same boot)"
COMPARE_RUNS=3 scripts/write-lat-compare.sh 2>&1 | grep -E "LAT_COMPARE|ratio" | head -8

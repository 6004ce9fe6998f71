#!/bin/bash
cd /work/main
for b in 1 2 3; do
  for which in before after; do
    echo "== batch $b: $which"
    scripts/launch-local.sh -n 2 --timeout 300 -- target/$which/nodetour perf --transport verbs \
      --devices "$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" --sizes 8:1M --factor 8 --iters 20 2>&1 | grep '^\[rank 0\] *[0-9]'
  done
done
echo "== write latency: ours against ib_write_lat"
RUNS=3 SIZES="8 4096" NODETOUR_BIN=target/after/nodetour scripts/write-lat-compare.sh 2>&1 | tail -8

#!/bin/bash
# Copied to target/ and run inside the VM: scripts/rdma-vm.sh --nodes 2 -- target/THIS.sh (target/old: the binary at eea5548).
cd "$(dirname "$0")/.."
export NODETOUR_REQUIRE_RDMA=1
echo "== host drills verbs 3 ranks"
NODETOUR_TIMEOUT_MS=3000 scripts/host-drills.sh verbs 3 3 /tmp/hd.log 2>&1 | tail -3
echo "== host drills verbs 4 ranks"
NODETOUR_TIMEOUT_MS=3000 scripts/host-drills.sh verbs 2 4 /tmp/hd4.log 2>&1 | tail -3
run() { echo "== $1 ranks=$3"; env $4 timeout 300 scripts/launch-local.sh -n $3 -- $2 perf --transport verbs --devices $NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1 --sizes 8:1M --factor 8 --iters 10 2>&1 | grep -E "^\[rank 0\] +[0-9]+ +[0-9]+ +[0-9.]+ " | awk '{printf "%s:%s ", $3, $5} END {print ""}'; }
for round in 1 2; do
  for n in 3 4; do
  run before target/old/release/nodetour $n X=1
  run after target/release/nodetour $n X=1
  run after-nospin target/release/nodetour $n NODETOUR_RING_SPIN_US=0
  done
done

#!/bin/bash
# Copied to target/ and run inside the VM: scripts/rdma-vm.sh --nodes 2 -- target/THIS.sh (target/old: the binary at eea5548).
cd "$(dirname "$0")/.."
export NODETOUR_REQUIRE_RDMA=1
echo "== verbs_rxe one_wait"
$(ls target/debug/deps/verbs_rxe-* | grep -v "\.d$" | head -n 1) --include-ignored --test-threads 1 one_wait_covers 2>&1 | tail -3
echo "== verbs_rxe all"
$(ls target/debug/deps/verbs_rxe-* | grep -v "\.d$" | head -n 1) --include-ignored --test-threads 1 --skip a_port_that_goes_down 2>&1 | grep -E "test result|FAILED|panicked"
echo "== host drills verbs 3 ranks"
NODETOUR_TIMEOUT_MS=3000 scripts/host-drills.sh verbs 3 3 /tmp/hd.log 2>&1 | tail -4
run() { echo "== $1 ranks=$3"; timeout 300 scripts/launch-local.sh -n $3 -- $2 perf --transport verbs --devices $NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1 --sizes 8:1M --factor 8 --iters 10 2>&1 | grep -E "^\[rank 0\] +[0-9]+ +[0-9]+ +[0-9.]+ " | awk '{printf "%s:%s ", $3, $5} END {print ""}'; }
for round in 1 2 3; do
  run before target/old/release/nodetour 3
  run after target/release/nodetour 3
  run before target/old/release/nodetour 4
  run after target/release/nodetour 4
done

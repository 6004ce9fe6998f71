#!/usr/bin/env bash
# vm-tier.sh: the real-verbs test tier. Runs INSIDE the soft-RoCE VM with two endpoints:
#   scripts/vm/rdma-vm.sh --nodes 2 -- scripts/tiers/vm-tier.sh TEST_EXE...
# 1. the hardware tests (TEST_EXE... --ignored: exactly the tests the host tier counted as
#    skipped; a missing device fails them), and the GPU ring's network link over verbs
#    (NODETOUR_VM_RING_TESTS: nodetour-ring's ignored unit tests); the port-down test runs
#    alone, last (it takes a link down), and is counted there only,
# 2. two_node_smoke between rxe0 and rxe1 (two processes, verified data),
# 3. 2, 4 and 8 processes connected pairwise over the verbs transport (transport_check),
# 4. (scripts/test.sh --full only) our write loop against ib_write_bw (scripts/compare/write-bw-compare.sh), our ping-pong against
#    ib_write_lat (scripts/compare/write-lat-compare.sh), cargo bench's verbs write bench once,
# and checks that the kernel's RDMA resource counts return to where they started (no leaked
# queue pair, completion queue, region or protection domain).
# Env: NODETOUR_BIN_DIR (default target/release), COMPARE_RUNS (default 5).
set -uo pipefail
: "${NODETOUR_VM_DEV1:?run inside scripts/vm/rdma-vm.sh --nodes 2}"
BIN_DIR=${NODETOUR_BIN_DIR:-target/release}
failed=0
say() { echo "vm-tier: $*"; }
resources() { rdma resource show 2>/dev/null | sed 's/  */ /g'; }

before=$(resources)
say "RDMA resources before: $(echo "$before" | tr '\n' ';')"

say "nodetour doctor"
doctor=$("$BIN_DIR/nodetour" doctor 2>&1)
echo "$doctor"
if grep -q "host memory: RDMA via $NODETOUR_VM_DEV0" <<<"$doctor" && grep -q "$NODETOUR_VM_DEV0: ACTIVE.*dma-buf: unsupported" <<<"$doctor"; then
    say "doctor sees soft-RoCE, and that it refuses dma-buf ... ok"
else
    say "doctor verdicts in the VM ... FAILED"
    failed=1
fi

export NODETOUR_REQUIRE_RDMA=1
# The two-node tools prove a job token on their out-of-band channel (one for this tier).
export NODETOUR_JOB_TOKEN=${NODETOUR_JOB_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}
for exe in "$@"; do
    say "running $(basename "$exe") --ignored (the port-down test runs last, alone)"
    "$exe" --ignored --test-threads 1 --skip a_port_that_goes_down_fails_waits_with_a_typed_event || failed=1
done
if [[ -n ${NODETOUR_VM_RING_TESTS:-} ]]; then
    say "the GPU ring's network link over verbs (CPU executor of the stream program, 2-3 ranks over $NODETOUR_VM_DEV0 and $NODETOUR_VM_DEV1)"
    "$NODETOUR_VM_RING_TESTS" --ignored --test-threads 1 --nocapture verbs_network || failed=1
fi

say "two_node_smoke --gpu (no GPU in the VM: it says so and uses host memory): rank 0 on $NODETOUR_VM_DEV0, rank 1 on $NODETOUR_VM_DEV1"
addr=$NODETOUR_VM_IP0:18517
NODETOUR_IB_DEVICE=$NODETOUR_VM_DEV0 timeout 120 "$BIN_DIR/examples/two_node_smoke" --gpu --rank 0 --addr "$addr" >/tmp/smoke0.log 2>&1 &
r0pid=$!
NODETOUR_IB_DEVICE=$NODETOUR_VM_DEV1 timeout 120 "$BIN_DIR/examples/two_node_smoke" --gpu --rank 1 --addr "$addr" >/tmp/smoke1.log 2>&1
r1=$?
wait "$r0pid"
r0=$?
grep -h -E '^(rank|SMOKE)' /tmp/smoke0.log /tmp/smoke1.log
if [[ $r0 == 0 && $r1 == 0 ]] && [[ $(cat /tmp/smoke0.log /tmp/smoke1.log | grep -c '^SMOKE OK') == 2 ]]; then
    say "two_node_smoke ... ok"
else
    say "two_node_smoke ... FAILED (rank 0 rc=$r0, rank 1 rc=$r1)"
    cat /tmp/smoke0.log /tmp/smoke1.log
    failed=1
fi

for n in 2 4 8; do
    say "transport_check over verbs: $n processes spread over $NODETOUR_VM_DEV0 and $NODETOUR_VM_DEV1"
    ok=$(scripts/launch-local.sh -n "$n" --timeout 180 -- "$BIN_DIR/examples/transport_check" --transport verbs \
        --devices "$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" --size 1048576 2>&1 | tee /tmp/tc.log | grep -c 'TRANSPORT OK')
    if [[ $ok == "$n" ]]; then
        say "transport_check verbs n=$n ... ok"
    else
        say "transport_check verbs n=$n ... FAILED"
        cat /tmp/tc.log
        failed=1
    fi
done

for n in 2 3; do
    say "formation over verbs with one rank's slot bytes doubled: an error naming the setting on every rank ($n processes)"
    ok=$(timeout 120 scripts/launch-local.sh -n "$n" --timeout 100 -- "$BIN_DIR/examples/allreduce_check" --transport verbs \
        --devices "$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" --differ-rank 1 2>&1 | tee /tmp/differ.log | grep -c 'SETTINGS_DIFFER rank=[0-9]* error=.*NODETOUR_SLOT_BYTES')
    if [[ $ok == "$n" ]]; then
        say "settings differ over verbs n=$n ... ok"
    else
        say "settings differ over verbs n=$n ... FAILED"
        cat /tmp/differ.log
        failed=1
    fi
done

say "examples/two_node_allreduce over verbs (no GPU here: host buffers), 2 processes on $NODETOUR_VM_DEV0 and $NODETOUR_VM_DEV1"
ok=$(NODETOUR_IB_DEVICES="$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" scripts/launch-local.sh -n 2 --timeout 300 -- \
    "$BIN_DIR/examples/two_node_allreduce" --sizes 4K:1M 2>&1 | tee /tmp/tn.log | grep -c 'TWO_NODE OK')
grep -E 'TWO_NODE|verbs' /tmp/tn.log | head -12
if [[ $ok == 2 ]] && grep -q 'verbs' /tmp/tn.log; then
    say "two_node_allreduce ... ok"
else
    say "two_node_allreduce ... FAILED"
    cat /tmp/tn.log
    failed=1
fi

for n in 2 3 4; do
    say "allreduce_check over verbs (host buffers, 78 type x op cases): $n processes"
    ok=$(scripts/launch-local.sh -n "$n" --timeout 300 -- "$BIN_DIR/examples/allreduce_check" --transport verbs \
        --devices "$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" --all --count 3001 --slot-bytes 4096 2>&1 | tee /tmp/ar.log | grep -c 'ALLREDUCE OK')
    if [[ $ok == "$n" ]]; then
        say "allreduce_check verbs n=$n ... ok"
    else
        say "allreduce_check verbs n=$n ... FAILED"
        cat /tmp/ar.log
        failed=1
    fi
done

# Comparisons that only print: with scripts/test.sh --full (NODETOUR_FULL=1) only.
if [[ ${NODETOUR_FULL:-0} == 1 ]]; then
    say "nodetour perf over verbs, 2 ranks on $NODETOUR_VM_DEV0 and $NODETOUR_VM_DEV1"
    scripts/launch-local.sh -n 2 --timeout 300 -- "$BIN_DIR/nodetour" perf --transport verbs \
        --devices "$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" --sizes 4K:4M --factor 8 --iters 3 2>&1 | grep '^\[rank 0\]' || failed=1
    if RUNS=${COMPARE_RUNS:-5} NODETOUR_BIN=$BIN_DIR/nodetour scripts/compare/write-bw-compare.sh; then
        say "write-bw-compare ... ok"
    else
        say "write-bw-compare ... FAILED"
        failed=1
    fi
    if RUNS=${COMPARE_RUNS:-5} NODETOUR_BIN=$BIN_DIR/nodetour scripts/compare/write-lat-compare.sh; then
        say "write-lat-compare ... ok"
    else
        say "write-lat-compare ... FAILED"
        failed=1
    fi
else
    say "SKIP perf over verbs, write-bw-compare and write-lat-compare: comparisons that only print (scripts/test.sh --full)"
fi

say "soak: 1000 allreduces across 4 processes over verbs (rxe0/rxe1), exact, memory and descriptors flat"
if NODETOUR_EXAMPLES=$BIN_DIR/examples scripts/drills/soak.sh verbs 1000 4; then
    say "soak verbs ... ok"
else
    say "soak verbs ... FAILED"
    failed=1
fi

say "a rank SIGKILLed mid-allreduce over verbs: the 3 others name it within 2x the timeout"
NODETOUR_TIMEOUT_MS=5000 scripts/launch-local.sh -n 4 --timeout 120 -- "$BIN_DIR/examples/allreduce_check" --transport verbs \
    --devices "$NODETOUR_VM_DEV0,$NODETOUR_VM_DEV1" --count 4099 --slot-bytes 4096 --repeat 1000 --kill-rank 2 >/tmp/drill.log 2>&1
grep -E 'DRILL' /tmp/drill.log
if [[ $(grep -cE 'HOST_RING_DRILL rank=[013] failed_at.*rank 2 (was )?lost' /tmp/drill.log) == 3 ]]; then
    say "kill drill verbs ... ok"
else
    say "kill drill verbs ... FAILED"; cat /tmp/drill.log; failed=1
fi

say "abort drills over verbs: a rank aborted mid-allreduce, the others fail at once, no wrong Ok (2 trials)"
if NODETOUR_EXAMPLES=$BIN_DIR/examples HOST_DRILL_KINDS=abort scripts/drills/host-drills.sh verbs 2 4 /tmp/host-drills-vm.log; then
    say "abort drill verbs ... ok"
else
    say "abort drill verbs ... FAILED"; tail -n 40 /tmp/host-drills-vm.log; failed=1
fi

say "deterministic drills over verbs: the others held 300 ms before collective 50, rank 2 dies or aborts 5 ms into it (1 trial each)"
if NODETOUR_EXAMPLES=$BIN_DIR/examples HOST_DRILL_ARGS="--hold-ms 300" scripts/drills/host-drills.sh verbs 1 4 /tmp/host-drills-held-vm.log; then
    say "held drills verbs ... ok"
else
    say "held drills verbs ... FAILED"; tail -n 40 /tmp/host-drills-held-vm.log; failed=1
fi

if [[ -n ${NODETOUR_BENCH_TRANSPORT:-} && -x $NODETOUR_BENCH_TRANSPORT ]]; then
    say "cargo bench's verbs write bench (criterion --test: each size once) on $NODETOUR_VM_DEV0"
    if NODETOUR_IB_DEVICE=$NODETOUR_VM_DEV0 NODETOUR_IB_GID_INDEX=${NODETOUR_VM_GID_INDEX:-1} \
        "$NODETOUR_BENCH_TRANSPORT" --bench --test write_verbs 2>&1 | tee /tmp/bench.log | grep -E '^(Testing|Success|SKIP)'; then
        grep -q Success /tmp/bench.log && say "verbs write bench ... ok" || { say "verbs write bench ... FAILED"; cat /tmp/bench.log; failed=1; }
    else
        say "verbs write bench ... FAILED"; cat /tmp/bench.log; failed=1
    fi
fi

after=$(resources)
say "RDMA resources after:  $(echo "$after" | tr '\n' ';')"
if [[ $before == "$after" ]]; then
    say "resource counts returned to their starting values ... ok"
else
    say "resource counts differ: leaked verbs objects ... FAILED"
    failed=1
fi
# Last, because it changes the VM's network: take the interface under the second device down
# (and up); a waiting queue pair must fail at once with the typed IBV_EVENT_PORT_ERR.
say "a port that goes down fails waits with a typed asynchronous event (takes ${NODETOUR_VM_DEV1}'s link down)"
for exe in "$@"; do
    # Only the binaries that hold it (the core's verbs tests, not the p2p one).
    "$exe" --list --ignored 2>/dev/null | grep -q '^a_port_that_goes_down_fails_waits_with_a_typed_event:' || continue
    NODETOUR_VM_PORT_DOWN_TEST=1 "$exe" --ignored --exact a_port_that_goes_down_fails_waits_with_a_typed_event --nocapture >/tmp/portdown.log 2>&1
    grep -E 'PORT_ERR|test result' /tmp/portdown.log
    if grep -q 'test result: ok. 1 passed' /tmp/portdown.log; then
        say "port-down event ... ok"
    else
        say "port-down event ... FAILED"; failed=1
    fi
done
exit $failed

#!/usr/bin/env bash
# host-drills.sh: repeated kill and abort drills of the host ring.
#   scripts/drills/host-drills.sh TRANSPORT [TRIALS] [RANKS] [LOG]   (tcp or verbs; 20 trials, 4 ranks)
# Each trial runs RANKS processes of allreduce_check (78 type x op cases round-robin, every
# result checked against the reference before it counts) and makes rank 2 die (SIGKILL) or abort
# from a watchdog thread after 50 collectives. A trial passes when every rank that must report
# does so in time with the right cause, and no rank returned Ok with a wrong result. verbs runs
# inside the soft-RoCE VM (scripts/vm/rdma-vm.sh --nodes 2), on NODETOUR_VM_DEV0/1.
# Prints one HOST_DRILL_SUMMARY line per drill; exit status 1 if any trial failed.
# HOST_DRILL_KINDS picks a subset (default "kill abort"); HOST_DRILL_ARGS adds arguments (e.g.
# "--hold-ms 300": the deterministic variant, where the failure always lands while the failing
# rank waits on held peers in the middle of collective 50).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
transport=${1:?usage: $0 tcp|verbs [TRIALS] [RANKS] [LOG]}
trials=${2:-20} ranks=${3:-4} log=${4:-/tmp/host-drills.log}
BIN=${NODETOUR_EXAMPLES:-target/release/examples}
extra=()
[[ $transport == verbs ]] && extra=(--transport verbs --devices "${NODETOUR_VM_DEV0:?run in the VM},${NODETOUR_VM_DEV1}")
export NODETOUR_TIMEOUT_MS=${NODETOUR_TIMEOUT_MS:-3000}
: >"$log"
failed=0
for drill in ${HOST_DRILL_KINDS:-kill abort}; do
    ok=0 bad=0 wrong=0 verified=0 worst=0
    for ((i = 1; i <= trials; i++)); do
        res=$(timeout 120 scripts/launch-local.sh -n "$ranks" --timeout 100 -- "$BIN/allreduce_check" "${extra[@]}" \
            --count 4099 --slot-bytes 4096 --repeat 1000 --"$drill"-rank 2 ${HOST_DRILL_ARGS:-} 2>&1)
        { echo "=== $transport $drill trial $i"; echo "$res"; } >>"$log"
        if [[ $drill == kill ]]; then
            reported=$(grep -cE 'HOST_RING_DRILL rank=[0-9]* failed_at.*rank 2 (was )?lost' <<<"$res")
            want=$((ranks - 1))
        else
            reported=$(grep -c 'HOST_RING_DRILL rank=[0-9]* failed_at' <<<"$res")
            want=$ranks
            grep -q 'HOST_RING_DRILL rank=2 failed_at.*aborted' <<<"$res" || reported=-1
        fi
        # A wrong Ok stops a rank with "mismatch" before it reaches the drill.
        w=$(grep -ci 'mismatch\|wrong' <<<"$res")
        wrong=$((wrong + w))
        v=$(grep -o 'ok_verified=[0-9]*' <<<"$res" | cut -d= -f2 | awk '{s+=$1} END {print s+0}')
        verified=$((verified + v))
        for ms in $(grep -o 'detected_after_ms=[0-9]*' <<<"$res" | cut -d= -f2); do
            ((ms > worst)) && worst=$ms
        done
        if [[ $reported == "$want" && $w == 0 ]]; then ok=$((ok + 1)); else bad=$((bad + 1)); fi
    done
    echo "HOST_DRILL_SUMMARY transport=$transport drill=$drill ranks=$ranks trials=$trials passed=$ok failed=$bad wrong_ok=$wrong ok_results_verified=$verified slowest_detection_ms=$worst bound_ms=$((2 * NODETOUR_TIMEOUT_MS))"
    ((bad == 0)) || failed=1
done
exit "$failed"

#!/usr/bin/env bash
# gpu-drills.sh: repeated kill and abort drills of the GPU ring, run ON a GPU machine from the
# directory gpu-pack.sh filled (it needs gpu_ring_check and launch-local.sh beside it).
#   ./gpu-drills.sh [TRIALS] [RANKS] [OUTDIR]      (defaults: 20 trials, 2 ranks, .)
# For each transport (cuda-ipc, shm) and each drill (a rank SIGKILLed, a rank aborted from a
# watchdog thread) it runs TRIALS jobs of RANKS processes (one GPU each where there are enough,
# else sharing the GPUs). Every collective that returns Ok is checked bit for bit against the
# reference (gpu_ring_check's drill); a wrong Ok fails the trial, and so does a survivor whose
# error does not name rank 1 and what it did (killed: lost; aborted). Prints one GPU_DRILL_SUMMARY
# line per transport x drill and writes every trial's output to OUTDIR/gpu-drills.log.
# GPU_DRILL_TRANSPORTS and GPU_DRILL_KINDS choose a subset (default: all); GPU_DRILL_ARGS adds
# arguments (e.g. "--hold-ms 300": the deterministic variant, where the failure always lands
# while the failing rank's streams wait on a held peer).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
trials=${1:-20} ranks=${2:-2} out=${3:-.}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NODETOUR_TIMEOUT_MS=${NODETOUR_TIMEOUT_MS:-5000} NODETOUR_CACHE_DIR=${NODETOUR_CACHE_DIR:-$PWD/kernel-cache}
log=$out/gpu-drills.log
: >"$log"
failed=0
for transport in ${GPU_DRILL_TRANSPORTS:-cuda-ipc shm}; do
    for drill in ${GPU_DRILL_KINDS:-kill abort}; do
        ok=0 bad=0 wrong=0 verified=0 worst=0 misnamed=0
        for ((i = 1; i <= trials; i++)); do
            res=$(NODETOUR_TRANSPORT=$transport timeout 90 ./launch-local.sh -n "$ranks" --timeout 60 -- \
                ./gpu_ring_check --"$drill"-rank 1 ${GPU_DRILL_ARGS:-} 2>&1)
            { echo "=== $transport $drill trial $i"; echo "$res"; } >>"$log"
            reported=$(grep -c 'GPU_RING_DRILL rank=[0-9]* failed_at' <<<"$res")
            want=$ranks
            [[ $drill == kill ]] && want=$((ranks - 1))
            w=$(grep -c 'WRONG_OK' <<<"$res")
            wrong=$((wrong + w))
            v=$(grep -o 'ok_verified=[0-9]*' <<<"$res" | cut -d= -f2 | awk '{s+=$1} END {print s+0}')
            verified=$((verified + ${v:-0}))
            for ms in $(grep -o 'detected_after_ms=[0-9]*' <<<"$res" | cut -d= -f2); do
                ((ms > worst)) && worst=$ms
            done
            # Every other rank's error names rank 1 and what it did (its own error aside).
            named=$(grep -E 'GPU_RING_DRILL rank=[0-9]* failed_at' <<<"$res" |
                grep -cE 'rank=1 |rank 1 (lost|was lost|aborted)')
            unnamed=$((reported - named))
            misnamed=$((misnamed + unnamed))
            if [[ $reported == "$want" && $w == 0 && $unnamed == 0 ]]; then ok=$((ok + 1)); else bad=$((bad + 1)); fi
        done
        echo "GPU_DRILL_SUMMARY transport=$transport drill=$drill ranks=$ranks trials=$trials passed=$ok failed=$bad wrong_ok=$wrong ok_results_verified=$verified errors_not_naming_rank_1=$misnamed slowest_detection_ms=$worst bound_ms=$((2 * NODETOUR_TIMEOUT_MS))" |
            tee -a "$out/gpu-drills-summary.txt"
        ((bad == 0)) || failed=1
    done
done
exit "$failed"

#!/usr/bin/env bash
# stream-order.sh: issue 48's GPU drills, run ON a GPU machine, on two builds side by side (the
# fix and its parent), two processes sharing the GPU:
#   ./stream-order.sh PARENT_DIR FIX_DIR OUTDIR [PART...]
# Each DIR holds stream_order_check and communicator_devices_tests (gpu-pack.sh, or the
# parent's built from its commit with the drill's source); FIX_DIR also launch-local.sh.
# PARTs (default all): order (two unordered streams, every Ok checked; the chosen path, then
# the one-kernel path forced), cost (queue time and latency, both paths; under MPS, a
# substitute for two GPUs, interleaved parent/fix), per-thread (a buffer dropped on another
# thread, the default streams), waits (wait, InFlight::wait and close behind a held stream),
# group (a Group on the caller's per-thread stream), differ (gpu_ring_check --from-stream
# --with-gpu --interleave-differ 1: a host-side failure aborts the GPU ring formed with the
# communicator).
# Writes OUTDIR/stream-order.log (every rank's output) and prints each result line.
# COST_ROUNDS (default 2) interleaved cost rounds; JOB_TIMEOUT (default 170 s) per job.
set -uo pipefail
parent=$(realpath "$1") fix=$(realpath "$2") out=$(realpath "$3")
shift 3
parts=${*:-order cost per-thread waits group}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NODETOUR_TIMEOUT_MS=${NODETOUR_TIMEOUT_MS:-10000} NODETOUR_CACHE_DIR=${NODETOUR_CACHE_DIR:-$PWD/kernel-cache}
log=$out/stream-order.log
mkdir -p "$out"
launch=$fix/launch-local.sh
# label dir args...: one 2-process job; its result lines printed, everything logged.
job() {
    local label=$1 dir=$2
    shift 2
    echo "=== $label: $*" >>"$log"
    timeout "${JOB_TIMEOUT:-170}" "$launch" -n 2 --timeout "$((${JOB_TIMEOUT:-170} - 10))" -- "$dir/stream_order_check" "$@" >>"$log.part" 2>&1
    local rc=$?
    grep -v -E ' (INFO|DEBUG) ' "$log.part" >>"$log"
    grep -E 'STREAM_|PER_THREAD|DEFAULT_STREAMS|error' "$log.part" | sed "s/^/$label rc=$rc /"
    rm -f "$log.part"
}
mps_on() {
    export CUDA_MPS_PIPE_DIRECTORY=$PWD/mps-pipe CUDA_MPS_LOG_DIRECTORY=$PWD/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if nvidia-cuda-mps-control -d; then
        echo "MPS on"
    else
        echo "SKIP MPS: nvidia-cuda-mps-control -d failed (the ranks take turns)"
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        return 1
    fi
}
mps_off() {
    [[ -n ${CUDA_MPS_PIPE_DIRECTORY:-} ]] && echo quit | nvidia-cuda-mps-control >/dev/null 2>&1
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    sleep 1
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$log"
for part in $parts; do
    case $part in
        order)
            # Twice: the path the communicator chooses (two processes on one GPU: the ring),
            # then the one-kernel path forced (NODETOUR_ONE_KERNEL=force; under MPS the ranks'
            # kernels run at once, as on two GPUs).
            mps_on
            for b in parent fix; do job "$b" "$(eval echo \$$b)" --order 1200; done
            for b in parent fix; do
                NODETOUR_ONE_KERNEL=force job "$b one-kernel" "$(eval echo \$$b)" --order 1200
            done
            mps_off
            ;;
        cost)
            # Taking turns, a collective costs a ~2.2 ms time slice: no figure to compare.
            mps_on || continue
            for round in $(seq "${COST_ROUNDS:-2}"); do
                for b in parent fix; do job "$b#$round" "$(eval echo \$$b)" --cost; done
                for b in parent fix; do
                    NODETOUR_ONE_KERNEL=force job "$b#$round one-kernel" "$(eval echo \$$b)" --cost
                done
            done
            mps_off
            ;;
        per-thread)
            for b in parent fix; do job "$b" "$(eval echo \$$b)" --per-thread; done
            ;;
        waits)
            # The chosen path, then the one-kernel path forced for what it takes (the 4 bytes).
            for b in parent fix; do job "$b" "$(eval echo \$$b)" --waits; done
            for b in parent fix; do
                NODETOUR_ONE_KERNEL=force job "$b one-kernel" "$(eval echo \$$b)" --waits
            done
            ;;
        differ)
            # Item 6: a communicator formed with its GPU whose host side fails (host and device
            # collectives interleaved differently) aborts its GPU ring: close is quick.
            for b in parent fix; do
                echo "=== $b differ" >>"$log"
                timeout 120 "$launch" -n 2 --timeout 110 -- "$(eval echo \$$b)/gpu_ring_check" \
                    --from-stream --with-gpu --interleave-differ 1 >"$log.part" 2>&1
                local_rc=$?
                grep -v -E ' (INFO|DEBUG) ' "$log.part" >>"$log"
                grep -E 'FROM_STREAM|error' "$log.part" | sed "s/^/$b rc=$local_rc /"
                rm -f "$log.part"
            done
            ;;
        group)
            for b in parent fix; do
                echo "=== $b group" >>"$log"
                (cd "$(eval echo \$$b)" && NODETOUR_REQUIRE_GPU=1 timeout 120 ./communicator_devices_tests \
                    --include-ignored --test-threads 1 a_group_on_the_callers_per_thread_stream 2>&1) >"$log.part"
                cat "$log.part" >>"$log"
                grep -E '^test |test result|panicked|round' "$log.part" | sed "s/^/$b /"
                rm -f "$log.part"
            done
            ;;
    esac
done

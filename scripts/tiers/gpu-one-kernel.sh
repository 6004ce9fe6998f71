#!/usr/bin/env bash
# gpu-one-kernel.sh: the one-kernel allreduce (small messages, one kernel per collective) on a
# GPU machine, from the directory gpu-pack.sh filled; gpu-tier.sh runs it, or alone:
#   ./gpu-one-kernel.sh [OUTDIR] [--late-only]     (writes gpu-one-kernel.log there)
# With one GPU the ranks share it and the path is forced (NODETOUR_ONE_KERNEL=force): the
# cross-process parts (cuda-ipc mappings, signal pages, digests, status words, graph capture)
# are exercised, each wait lasting a context switch; with 2+ GPUs the default (auto) chooses it.
# 1. one_kernel_tests: every type x op at 2, 3, 4 processes, eager and replayed in CUDA graphs,
#    bit for bit against the rank-order fold; an abort inside a replay;
# 2. gpu_ring_check --all with the path on (counts 1 and 7919 take it, 5000011 the ring);
# 3. drills on the path: a disagreement (another count), a rank SIGKILLed, a rank aborted, a
#    peer late by more than the timeout with the next collective queued behind the failed one.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=${1:-.}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 NODETOUR_REQUIRE_GPU=1
export NODETOUR_CACHE_DIR=$PWD/kernel-cache
# shellcheck source=gpu-common.sh
source ./gpu-common.sh
failed=0
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
# late_drills TRIALS: the late-peer drill (LATE_BIN, default ./gpu_ring_check), TRIALS times each
# way (late on the GPU, on the host);
# a trial passes when every rank failed in time, none returned a wrong Ok, and the on-time
# rank's error names the late rank. One GPU_LATE_SUMMARY line per way.
late_drills() {
    local trials=$1 how ok bad wrong verified res i rc=0
    for how in "--late-gpu-ms 5000" "--late-host-ms 5000"; do
        ok=0 bad=0 wrong=0 verified=0
        for ((i = 1; i <= trials; i++)); do
            res=$(NODETOUR_ONE_KERNEL=$mode NODETOUR_TIMEOUT_MS=2000 timeout 90 ./launch-local.sh -n 2 --timeout 80 -- \
                "${LATE_BIN:-./gpu_ring_check}" --late-rank 1 --late-at 8 $how --drill-bytes 65536 2>&1)
            echo "$res" >>"$out/late-drill.log"
            grep -E 'GPU_LATE_DRILL rank=[0-9]+ (late|WRONG)' <<<"$res"
            wrong=$((wrong + $(grep -c 'WRONG_OK' <<<"$res")))
            verified=$((verified + $(grep -o 'ok_verified=[0-9]*' <<<"$res" | cut -d= -f2 | awk '{s+=$1} END {print s+0}')))
            if [[ $(grep -c 'GPU_LATE_DRILL rank=[0-9]* late_rank=1 late_at=8 failed_at=[0-9]' <<<"$res") == 2 ]] &&
                ! grep -q WRONG_OK <<<"$res" && grep -q 'GPU_LATE_DRILL rank=0 .*rank 1' <<<"$res"; then
                ok=$((ok + 1))
            else
                bad=$((bad + 1))
            fi
        done
        echo "GPU_LATE_SUMMARY way=\"$how\" trials=$trials passed=$ok failed=$bad ok_results_verified=$verified wrong_ok=$wrong"
        ((bad == 0)) || rc=1
    done
    return $rc
}
mode=auto
[[ $gpus -ge 2 ]] || mode=force
if [[ ${2:-} == --late-only ]]; then # only the late-peer drill (LATE_TRIALS, LATE_BIN)
    late_drills "${LATE_TRIALS:-3}" 2>&1 | tee -a "$out/gpu-one-kernel.log"
    exit "${PIPESTATUS[0]}"
fi
{
    echo "== one_kernel_tests (ranks on GPU 0, the path forced)"
    ./one_kernel_tests --include-ignored --test-threads 1 --nocapture >"$out/one-kernel-tests.log" 2>&1
    rc=$?
    # The lines that say what ran, and every panic with the message on the line after it.
    grep -E -A1 'ONE_KERNEL|SKIP|test result|panicked|FAILED' "$out/one-kernel-tests.log" | grep -v '^--$'
    ((rc == 0)) || { echo "one_kernel_tests failed (rc $rc)"; failed=1; }
    echo "== gpu_ring_check --all with NODETOUR_ONE_KERNEL=$mode (2 and 3 processes)"
    for n in 2 3; do
        NODETOUR_ONE_KERNEL=$mode ./launch-local.sh -n $n --timeout 300 -- ./gpu_ring_check --all >/tmp/ok-ring.log 2>&1
        rc=$?
        grep -E 'one kernel|GPU_RING OK|rror' /tmp/ok-ring.log | sort | uniq -c
        [[ $rc == 0 ]] && log_reports $n 'GPU_RING OK' /tmp/ok-ring.log || { echo "gpu_ring_check ($n ranks, one kernel) failed"; failed=1; }
    done
    echo "== agreement drill on the path: one rank calls with half the count (64 KiB collectives)"
    for n in 2 3; do
        NODETOUR_ONE_KERNEL=$mode NODETOUR_TIMEOUT_MS=5000 timeout 60 ./launch-local.sh -n $n --timeout 50 -- \
            ./gpu_ring_check --disagree-rank 1 --drill-bytes 65536 2>&1 | grep -E 'GPU_RING_DISAGREE|rror'
        [[ ${PIPESTATUS[0]} == 0 ]] || { echo "agreement drill (one kernel, $n ranks) failed"; failed=1; }
    done
    echo "== failure drills on the path: a rank SIGKILLed, or aborted from a watchdog thread (64 KiB collectives)"
    for spec in "2|--kill-rank 1" "3|--abort-rank 2"; do
        IFS='|' read -r n a <<<"$spec"
        ok=$(NODETOUR_ONE_KERNEL=$mode NODETOUR_TIMEOUT_MS=5000 timeout 90 ./launch-local.sh -n "$n" --timeout 80 -- \
            ./gpu_ring_check $a --drill-bytes 65536 2>&1 | tee /tmp/ok-drill.log | grep -c 'GPU_RING_DRILL rank=[0-9]* failed_at')
        grep DRILL /tmp/ok-drill.log
        [[ $ok == "$n" || ( $a == --kill* && $ok == $((n - 1)) ) ]] || { echo "drill $spec (one kernel): $ok ranks reported"; failed=1; }
    done
    echo "== late-peer drill on the path: rank 1 late for collective 8 by more than the timeout (on the GPU: a busy kernel ahead of it; on the host: a sleep), rank 0 with 8 to 11 queued and a 10 s deadline of its own (NODETOUR_TIMEOUT_MS=2000)"
    late_drills "${LATE_TRIALS:-3}" || failed=1
    echo "gpu-one-kernel: failed=$failed"
} 2>&1 | tee "$out/gpu-one-kernel.log"
exit "$failed"

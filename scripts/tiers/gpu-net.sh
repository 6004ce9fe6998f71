#!/usr/bin/env bash
# gpu-net.sh: the GPU ring's network links (issue 15) on one GPU machine split into "hosts"
# (launch-local.sh --hosts: NODETOUR_HOST_ID per rank), run ON a GPU machine from the directory
# gpu-pack.sh filled. The links between "hosts" are network links over tcp loopback, landing in
# host slots; the links inside one are cuda-ipc or shm as usual.
#   ./gpu-net.sh [OUTDIR]      (writes gpu-net.log there; perf tables in gpu-net-perf.txt)
# 1. the communicator's device collectives across hosts (2 and 3 hosts of one rank, 2 hosts of
#    two), every shape, counts 1 and prime, twice in a row;
# 2. gpu_ring_check across hosts: every type x op, counts 1 / 7919 / 5000011, the non-blocking
#    form;
# 3. drills across hosts, with data checks: a rank SIGKILLed or aborted mid-stream, a rank
#    that closes with a collective in flight, a rank that calls another collective;
# 4. data_parallel across hosts;
# 5. landing in GPU slots (NODETOUR_NET_LANDING=gpu), checked and drilled; the communicator's
#    device tests;
# 6. the hand-off (nodetour perf --handoff: one process, no time slicing), 8 B to 1 MiB, in
#    three wait modes (NODETOUR_NET_SPIN_US = 0, 20, 1000), two rounds; and two processes across
#    hosts for bandwidth (time-sliced on one GPU).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=${1:-.}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NODETOUR_CACHE_DIR=$PWD/kernel-cache NODETOUR_REQUIRE_GPU=1
# shellcheck source=gpu-common.sh
source ./gpu-common.sh
failed=0
{
    echo "== the communicator's device collectives across hosts (NODETOUR_HOST_ID split)"
    ./communicator_gpu_tests --exact device_collectives_on_a_gpu_ring_across_hosts --include-ignored --nocapture --test-threads 1 2>&1 |
        grep -E 'GPU_RING|test result|panicked|FAILED|error' || failed=1
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    echo "== gpu_ring_check across hosts: every type x op"
    ranks_report 2 'GPU_RING OK' ./launch-local.sh -n 2 --hosts 2 --timeout 120 -- ./gpu_ring_check --all || failed=1
    ranks_report 3 'GPU_RING OK' ./launch-local.sh -n 3 --hosts 3 --timeout 120 -- ./gpu_ring_check --all || failed=1
    ranks_report 4 'GPU_RING OK' ./launch-local.sh -n 4 --hosts 2 --timeout 120 -- ./gpu_ring_check || failed=1
    echo "== drills across hosts (NODETOUR_TIMEOUT_MS=5000): killed, aborted"
    for spec in "2|--kill-rank 1" "3|--abort-rank 2" "3|--kill-rank 2"; do
        IFS='|' read -r n a <<<"$spec"
        ok=$(NODETOUR_TIMEOUT_MS=5000 timeout 60 ./launch-local.sh -n "$n" --hosts "$n" --timeout 50 -- ./gpu_ring_check $a 2>&1 |
            tee /tmp/net-drill.log | grep -c 'GPU_RING_DRILL rank=[0-9]* failed_at')
        grep -E 'DRILL|rror' /tmp/net-drill.log | head -20
        [[ $ok == "$n" || ( $a == --kill* && $ok == $((n - 1)) ) ]] || { echo "drill $spec: $ok ranks reported"; failed=1; }
    done
    echo "== one rank with twice the slot bytes across hosts: formation fails on every rank, naming the setting"
    for n in 2 3; do
        ranks_report $n 'SETTINGS_DIFFER' timeout 60 ./launch-local.sh -n $n --hosts $n --timeout 50 -- ./gpu_ring_check --differ-rank 1 || failed=1
    done
    echo "== teardown and agreement drills across hosts"
    NODETOUR_TIMEOUT_MS=5000 timeout 60 ./launch-local.sh -n 2 --hosts 2 --timeout 50 -- \
        ./gpu_ring_check --close-rank 1 2>&1 | grep -E 'GPU_RING_CLOSE|rror'
    [[ ${PIPESTATUS[0]} == 0 ]] || { echo "teardown drill failed"; failed=1; }
    for n in 2 3; do
        NODETOUR_TIMEOUT_MS=5000 timeout 60 ./launch-local.sh -n $n --hosts $n --timeout 50 -- \
            ./gpu_ring_check --disagree-rank 1 2>&1 | grep -E 'GPU_RING_DISAGREE|rror'
        [[ ${PIPESTATUS[0]} == 0 ]] || { echo "agreement drill ($n ranks) failed"; failed=1; }
    done
    echo "== examples/two_node_allreduce across hosts (tcp between the \"hosts\": the network link)"
    ./launch-local.sh -n 2 --hosts 2 --timeout 120 -- ./two_node_allreduce --sizes 1M:64M --iters 5 2>&1 |
        grep -E 'TWO_NODE|size|staged|direct|network' | grep -v INFO || failed=1
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    echo "== data_parallel across hosts"
    ranks_report 2 'DATA_PARALLEL OK' ./launch-local.sh -n 2 --hosts 2 --timeout 120 -- ./data_parallel --steps 3 || failed=1
    echo "== GPU slots: the network link landing in GPU slots (NODETOUR_NET_LANDING=gpu)"
    NODETOUR_NET_LANDING=gpu ranks_report 2 'GPU_RING OK' ./launch-local.sh -n 2 --hosts 2 --timeout 120 -- ./gpu_ring_check --all || failed=1
    NODETOUR_NET_LANDING=gpu ranks_report 3 'GPU_RING OK' ./launch-local.sh -n 3 --hosts 3 --timeout 120 -- ./gpu_ring_check || failed=1
    ok=$(NODETOUR_NET_LANDING=gpu NODETOUR_TIMEOUT_MS=5000 timeout 60 ./launch-local.sh -n 3 --hosts 3 --timeout 50 -- ./gpu_ring_check --kill-rank 2 2>&1 |
        tee /tmp/net-drill.log | grep -c 'GPU_RING_DRILL rank=[0-9]* failed_at')
    grep -E 'DRILL|rror' /tmp/net-drill.log | head -10
    [[ $ok == 2 ]] || { echo "GPU-slot kill drill: $ok ranks reported"; failed=1; }
    echo "== the communicator's device tests"
    ./communicator_gpu_tests --include-ignored --test-threads 1 2>&1 | grep -E '^test |test result|panicked' || failed=1
    [[ ${PIPESTATUS[0]} == 0 ]] || failed=1
    perf="$out/gpu-net-perf.txt"
    : >"$perf"
    echo "== the hand-off: one chunk through the network link (stream -> link thread -> tcp -> link thread -> stream),"
    echo "   8 B to 1 MiB, in three wait modes, beside the same copies handed over by a word; two rounds"
    for round in 1 2; do
        for spin in 0 20 1000; do
            echo "-- round $round: NODETOUR_NET_SPIN_US=$spin" | tee -a "$perf"
            NODETOUR_NET_SPIN_US=$spin ./nodetour perf --handoff --sizes 8:1M --factor 8 --iters 50 2>&1 | grep -vE 'INFO|hugepages' | tee -a "$perf"
        done
    done
    echo "== two processes across hosts (time-sliced on one GPU: bandwidth only), 1 MiB to 64 MiB"
    ./launch-local.sh -n 2 --hosts 2 --timeout 300 -- ./nodetour perf --gpu --sizes 1M:64M --factor 4 --iters 10 2>&1 |
        grep -E '^\[rank 0\]' | grep -vE 'INFO|hugepages' | tee -a "$perf"
    echo "gpu-net: failed=$failed"
} 2>&1 | tee "$out/gpu-net.log"
exit "$failed"

#!/usr/bin/env bash
# gpu-tier.sh: the GPU test tier, run ON a GPU machine from the directory gpu-pack.sh filled.
#   ./gpu-tier.sh [OUTDIR]     (writes gpu-tier.log there too; default: the current directory)
# 1. the GPU tests (device buffers, dma-buf export, CUDA-registered hugepage buffers, NVRTC,
#    teardown that waits for no work but its own), and the teardown probe;
# 2. `nodetour gpus`: attributes, dma-buf export, the registration path GPU memory gets here;
# 3. `two_node_smoke --gpu`: on a machine without RDMA it reports the ladder and exits 2;
# 4. with 2+ GPUs, cuda-ipc and shm between two processes (gpu_transport_check);
# 5. the GPU ring across processes (gpu_ring_check: direct and staged, checked, against NCCL and
#    the concurrent-copy ceiling); the direct GPU ring (GpuGroup) tests; `nodetour perf --gpus` (with 2+ GPUs against NCCL);
# 6. transport_check over tcp with 4 processes.
# Needs hugepages for the 1 GiB shm test at full speed: echo 2200 > /proc/sys/vm/nr_hugepages.
# NCCL_NVLS_ENABLE=0 is exported for anything that starts NCCL on shared GPU hosts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=${1:-.}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NODETOUR_REQUIRE_GPU=1
# shellcheck source=gpu-common.sh
source ./gpu-common.sh
failed=0
tests_passed=0 tests_failed=0 tests_skipped=0
# A GPU test whose capability is missing prints "SKIP <reason>" and returns: libtest calls that
# "ok", so count it here as skipped, never as passed (tests run one at a time, --nocapture).
run_tests() { # BINARY: runs every test of it, tallies passed / failed / skipped
    local line skip=0 rc=1
    while IFS= read -r line; do
        if [[ $line =~ ^rc=([0-9]+)$ ]]; then rc=${BASH_REMATCH[1]}; continue; fi
        echo "$line"
        # libtest prints "test NAME ... ", the test's own output, then "ok" or "FAILED".
        [[ $line == *SKIP* ]] && skip=1
        if [[ $line == ok || $line =~ \.\.\.\ ok$ ]]; then
            if ((skip)); then tests_skipped=$((tests_skipped + 1)); else tests_passed=$((tests_passed + 1)); fi
            skip=0
        elif [[ $line == FAILED || $line =~ \.\.\.\ FAILED$ ]]; then
            tests_failed=$((tests_failed + 1)); skip=0
        fi
    done < <("$@" --include-ignored --test-threads 1 --nocapture 2>&1; echo "rc=$?")
    ((rc == 0))
}
{
    echo "== gpu tests"
    run_tests ./gpu_tests || failed=1
    echo "== GPU reduction kernels against the host reducer (every type x op)"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache run_tests ./gpu_reduce_tests || failed=1
    echo "== several GPUs of one process (Communicator::from_devices: groups and threads) against the host reducer: 1-5 ranks over the GPUs present"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache run_tests ./communicator_devices_tests --skip a_group_on_the_callers_per_thread_stream || failed=1
    echo "== a Group on the caller's per-thread stream, alone (it hung on 2026-12-07; its watchdog ends the process after 90 s with every thread's state)"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache run_tests ./communicator_devices_tests --exact a_group_on_the_callers_per_thread_stream_is_ordered_on_it || failed=1
    echo "== the communicator on device memory (cudarc slices, the caller's streams; ranks as threads)"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache run_tests ./communicator_gpu_tests || failed=1
    echo "== the stream-ordered ring captured into CUDA graphs and replayed (every collective; 2, 3 and 4 processes on GPU 0: cuda-ipc, shm)"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache run_tests ./ring_capture_tests || failed=1
    echo "== the same, every segment cut into pipelined chunks (NODETOUR_IPC_PIPELINE=4, NODETOUR_SHM_PIPELINE=8)"
    NODETOUR_IPC_PIPELINE=4 NODETOUR_SHM_PIPELINE=8 NODETOUR_CACHE_DIR=$PWD/kernel-cache run_tests ./ring_capture_tests || failed=1
    echo "gpu tests: $tests_passed passed, $tests_failed failed, $tests_skipped skipped"
    echo "== teardown_probe: which driver calls that free or close wait for unrelated work (informative)"
    ./teardown_probe --hold-ms 500 || failed=1
    echo "== examples/gpu_allreduce: one rank per GPU, then 4 ranks"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache ./gpu_allreduce || failed=1
    NODETOUR_CACHE_DIR=$PWD/kernel-cache ./gpu_allreduce --ranks 4 || failed=1
    echo "== nodetour gpus"
    ./nodetour gpus || failed=1
    echo "== nodetour devices (exit 2 = no RDMA device here)"
    ./nodetour devices; echo "rc=$?"
    echo "== two_node_smoke --gpu (rank 0)"
    timeout 60 ./two_node_smoke --gpu --rank 0 --addr 127.0.0.1:18517; echo "rc=$?"
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if [[ $gpus -ge 2 ]]; then
        echo "== gpu_transport_check: cuda-ipc and shm between two processes, one GPU each"
        ranks_report 2 'cuda-ipc .* verified' ./launch-local.sh -n 2 --timeout 300 -- ./gpu_transport_check || failed=1
    else
        echo "SKIP gpu_transport_check: needs 2 GPUs, this machine has $gpus"
    fi
    echo "== gpu_ring_check: the GPU ring across processes (one GPU each), direct then staged"
    export NODETOUR_CACHE_DIR=$PWD/kernel-cache
    if [[ $gpus -ge 2 ]]; then
        ranks_report 2 'GPU_RING OK' ./launch-local.sh -n 2 --timeout 400 -- ./gpu_ring_check --all --perf --compare-nccl || failed=1
        NODETOUR_TRANSPORT=shm ranks_report 2 'GPU_RING OK' ./launch-local.sh -n 2 --timeout 400 -- ./gpu_ring_check --all || failed=1
        echo "== nodetour perf --gpu: both paths side by side, against NCCL and the copy ceilings"
        ./launch-local.sh -n 2 --timeout 400 -- ./nodetour perf --gpu --path both --compare nccl,ceiling --sizes 1M:1G --factor 4 --plot "$out/perf-ring.svg" || failed=1
    fi
    ranks_report 3 'GPU_RING OK' ./launch-local.sh -n 3 --timeout 300 -- ./gpu_ring_check --all || failed=1
    NODETOUR_TRANSPORT=shm ranks_report 4 'GPU_RING OK' ./launch-local.sh -n 4 --timeout 300 -- ./gpu_ring_check || failed=1
    echo "== the device from the caller: formed without a GPU, host and device collectives interleaved"
    ranks_report 2 'FROM_STREAM OK' ./launch-local.sh -n 2 --timeout 200 -- ./gpu_ring_check --from-stream || failed=1
    echo "== the training example on the GPU (cuBLAS, NVRTC; buckets on a communication stream), 2 processes"
    ranks_report 2 'TRAIN_MLP OK' ./launch-local.sh -n 2 --timeout 200 -- ./train_mlp --device gpu || failed=1
    echo "== host and device collectives interleaved differently: typed on every rank, never Ok"
    ranks_report 2 'FROM_STREAM_DIFFER' ./launch-local.sh -n 2 --timeout 200 -- ./gpu_ring_check --from-stream --interleave-differ 1 || failed=1
    echo "== gpu_ring_check with the ring's kernels capped at 3 blocks (NODETOUR_RING_BLOCKS: same results)"
    NODETOUR_RING_BLOCKS=3 NODETOUR_LOG=info ./launch-local.sh -n 2 --timeout 300 -- ./gpu_ring_check --all >"$out/ring-blocks.log" 2>&1 || failed=1
    grep -E 'GPU_RING OK|rror' "$out/ring-blocks.log" | sort | uniq -c
    log_reports 2 'GPU_RING OK' "$out/ring-blocks.log" || failed=1
    grep -q 'kernels of up to 3 blocks' "$out/ring-blocks.log" || { echo "the cap was not applied"; failed=1; }
    echo "== gpu_ring_check with pipelined chunks (NODETOUR_IPC_PIPELINE=4 direct at 2 and 3 ranks, NODETOUR_SHM_PIPELINE=8 staged), staged chunks copied in (NODETOUR_SHM_READ_MAX) and direct received copies by the copy engine (NODETOUR_SLOT_COPY_KERNEL_MAX=0) or by a kernel up to 128 KiB: same results"
    NODETOUR_IPC_PIPELINE=4 NODETOUR_SLOT_COPY_KERNEL_MAX=0 NODETOUR_LOG=info ./launch-local.sh -n 2 --timeout 300 -- ./gpu_ring_check --all >"$out/ring-pipeline.log" 2>&1 || failed=1
    NODETOUR_IPC_PIPELINE=4 NODETOUR_SLOT_COPY_KERNEL_MAX=131072 NODETOUR_LOG=info ./launch-local.sh -n 3 --timeout 300 -- ./gpu_ring_check --all >>"$out/ring-pipeline.log" 2>&1 || failed=1
    # Staged chunks up to 256 KiB reduced out of the host slots, larger ones copied in first.
    NODETOUR_SHM_PIPELINE=8 NODETOUR_SHM_READ_MAX=262144 NODETOUR_TRANSPORT=shm NODETOUR_LOG=info ./launch-local.sh -n 3 --timeout 300 -- ./gpu_ring_check --all >>"$out/ring-pipeline.log" 2>&1 || failed=1
    NODETOUR_SHM_READ_MAX=0 NODETOUR_TRANSPORT=shm NODETOUR_LOG=info ./launch-local.sh -n 2 --timeout 300 -- ./gpu_ring_check --all >>"$out/ring-pipeline.log" 2>&1 || failed=1
    grep -E 'GPU_RING OK|rror' "$out/ring-pipeline.log" | sort | uniq -c
    log_reports 10 'GPU_RING OK' "$out/ring-pipeline.log" || failed=1
    for d in 4 8; do
        grep -q "segments cut into $d chunks or more" "$out/ring-pipeline.log" || { echo "the pipeline of $d was not applied"; failed=1; }
    done
    grep -q "chunks of up to 256 KiB reduced straight out of the host slots" "$out/ring-pipeline.log" || { echo "NODETOUR_SHM_READ_MAX was not applied"; failed=1; }
    grep -q "copies of up to 128 KiB out of the slots by one kernel" "$out/ring-pipeline.log" || { echo "NODETOUR_SLOT_COPY_KERNEL_MAX was not applied"; failed=1; }
    grep -q "copies of up to 1024 KiB out of the slots by one kernel" "$out/ring-blocks.log" || { echo "the copy kernel was not on by default"; failed=1; }
    echo "== failure drills: a rank SIGKILLed, or aborted from a watchdog thread, mid-stream (NODETOUR_TIMEOUT_MS=5000)"
    for spec in "2|--kill-rank 1|auto" "2|--kill-rank 1|shm" "3|--abort-rank 2|shm"; do
        IFS='|' read -r n a t <<<"$spec"
        ok=$(NODETOUR_TIMEOUT_MS=5000 NODETOUR_TRANSPORT=$t timeout 60 ./launch-local.sh -n "$n" --timeout 50 -- ./gpu_ring_check $a 2>&1 |
            tee /tmp/drill.log | grep -c 'GPU_RING_DRILL rank=[0-9]* failed_at')
        grep DRILL /tmp/drill.log
        [[ $ok == "$n" || ( $a == --kill* && $ok == $((n - 1)) ) ]] || { echo "drill $spec: $ok ranks reported"; failed=1; }
    done
    echo "== deterministic drills: the peer is held 300 ms before collective 20; the failing rank dies or aborts 5 ms into it"
    for t in cuda-ipc shm; do
        GPU_DRILL_TRANSPORTS=$t GPU_DRILL_ARGS="--hold-ms 300" ./gpu-drills.sh 1 2 "$out" | grep GPU_DRILL_SUMMARY || failed=1
        [[ ${PIPESTATUS[0]} == 0 ]] || { echo "deterministic drill ($t) failed"; failed=1; }
    done
    echo "== teardown drill: a rank closes its ring with a collective its peer never joined"
    for t in auto shm; do
        NODETOUR_TIMEOUT_MS=5000 NODETOUR_TRANSPORT=$t timeout 60 ./launch-local.sh -n 2 --timeout 50 -- \
            ./gpu_ring_check --close-rank 1 2>&1 | grep -E 'GPU_RING_CLOSE|rror' || failed=1
        [[ ${PIPESTATUS[0]} == 0 ]] || { echo "teardown drill ($t) failed"; failed=1; }
    done
    echo "== agreement drill: one rank calls the collective with another count; all fail at once"
    for t in auto shm; do
        for n in 2 3; do
            NODETOUR_TIMEOUT_MS=5000 NODETOUR_TRANSPORT=$t timeout 60 ./launch-local.sh -n $n --timeout 50 -- \
                ./gpu_ring_check --disagree-rank 1 2>&1 | grep -E 'GPU_RING_DISAGREE|rror'
            [[ ${PIPESTATUS[0]} == 0 ]] || { echo "agreement drill ($t, $n ranks) failed"; failed=1; }
        done
    done
    echo "== allreduce_check --gpu: GPU buffers on the GPU ring, every link a network link over tcp (forced)"
    ranks_report 2 'ALLREDUCE OK' ./launch-local.sh -n 2 --timeout 300 -- ./allreduce_check --gpu --all --count 3000017 || failed=1
    ranks_report 3 'ALLREDUCE OK' ./launch-local.sh -n 3 --timeout 300 -- ./allreduce_check --gpu --all || failed=1
    echo "== examples/data_parallel: DDP-shaped buckets (4 x 25 MiB, f32 and bf16) through the communicator"
    ranks_report 2 'DATA_PARALLEL OK' ./launch-local.sh -n 2 --timeout 300 -- ./data_parallel || failed=1
    ranks_report 3 'DATA_PARALLEL OK' ./launch-local.sh -n 3 --timeout 300 -- ./data_parallel --steps 3 || failed=1
    NODETOUR_TRANSPORT=shm ranks_report 2 'DATA_PARALLEL OK' ./launch-local.sh -n 2 --timeout 300 -- ./data_parallel --steps 3 || failed=1
    NODETOUR_TRANSPORT=tcp ranks_report 2 'DATA_PARALLEL OK' ./launch-local.sh -n 2 --timeout 300 -- ./data_parallel --steps 2 --buckets 2 || failed=1
    if [[ $gpus -ge 2 ]]; then
        echo "== nodetour perf: direct GPU ring on GPUs 0,1 against NCCL (same buffers, same run)"
        for dt in f32 bf16; do
            NODETOUR_CACHE_DIR=$PWD/kernel-cache ./nodetour perf --gpus 0,1 --compare nccl --dtype $dt --sizes 1M:1G --factor 4 --iters 20 --format json >"$out/perf-gpu-$dt.json" || failed=1
            NODETOUR_CACHE_DIR=$PWD/kernel-cache ./nodetour perf --gpus 0,1 --compare nccl --dtype $dt --sizes 8:1G --factor 8 --iters 20 || failed=1
        done
    else
        echo "== nodetour perf: direct GPU ring, 2 ranks on one GPU (NCCL cannot put two ranks on one GPU)"
        NODETOUR_CACHE_DIR=$PWD/kernel-cache ./nodetour perf --gpus 0,0 --sizes 1M:256M --factor 4 --iters 10 || failed=1
    fi
    echo "== cargo bench's allreduce bench (direct and staged on the GPUs, host over tcp)"
    NODETOUR_CACHE_DIR=$PWD/kernel-cache ./bench_allreduce --bench 2>&1 | grep -E '^(allreduce|SKIP)|time:|thrpt:' || failed=1
    echo "== transport_check over tcp, 4 processes"
    ranks_report 4 'TRANSPORT OK' ./launch-local.sh -n 4 --timeout 120 -- ./transport_check || failed=1
    echo "== the one-kernel allreduce (gpu-one-kernel.sh)"
    ./gpu-one-kernel.sh "$out" || failed=1
    echo "== the network links across \"hosts\" (gpu-net.sh)"
    ./gpu-net.sh "$out" || failed=1
    echo "gpu-tier: failed=$failed"
} 2>&1 | tee "$out/gpu-tier.log"
exit "$failed"

#!/usr/bin/env bash
# The knob passes of gpu-tier.sh on the final code.
cd "$(dirname "$0")"
out=${1:?out}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NODETOUR_CACHE_DIR=$PWD/kernel-cache
failed=0
{
    echo "== gpu_ring_check with the ring's kernels capped at 3 blocks (NODETOUR_RING_BLOCKS: same results)"
    NODETOUR_RING_BLOCKS=3 NODETOUR_LOG=info ./launch-local.sh -n 2 --timeout 300 -- ./gpu_ring_check --all >"$out/ring-blocks.log" 2>&1 || failed=1
    grep -E 'GPU_RING OK|rror' "$out/ring-blocks.log" | sort | uniq -c
    grep -q 'kernels of up to 3 blocks' "$out/ring-blocks.log" || { echo "the cap was not applied"; failed=1; }
    echo "== gpu_ring_check with pipelined chunks (NODETOUR_IPC_PIPELINE=4 direct at 2 and 3 ranks, NODETOUR_SHM_PIPELINE=8 staged), staged chunks copied in (NODETOUR_SHM_READ_MAX) and direct received copies by the copy engine (NODETOUR_COPY_KERNEL_MAX=0) or by a kernel up to 128 KiB: same results"
    NODETOUR_IPC_PIPELINE=4 NODETOUR_COPY_KERNEL_MAX=0 NODETOUR_LOG=info ./launch-local.sh -n 2 --timeout 300 -- ./gpu_ring_check --all >"$out/ring-pipeline.log" 2>&1 || failed=1
    NODETOUR_IPC_PIPELINE=4 NODETOUR_COPY_KERNEL_MAX=131072 NODETOUR_LOG=info ./launch-local.sh -n 3 --timeout 300 -- ./gpu_ring_check --all >>"$out/ring-pipeline.log" 2>&1 || failed=1
    # Staged chunks up to 256 KiB reduced out of the host slots, larger ones copied in first.
    NODETOUR_SHM_PIPELINE=8 NODETOUR_SHM_READ_MAX=262144 NODETOUR_TRANSPORT=shm NODETOUR_LOG=info ./launch-local.sh -n 3 --timeout 300 -- ./gpu_ring_check --all >>"$out/ring-pipeline.log" 2>&1 || failed=1
    NODETOUR_SHM_READ_MAX=0 NODETOUR_TRANSPORT=shm NODETOUR_LOG=info ./launch-local.sh -n 2 --timeout 300 -- ./gpu_ring_check --all >>"$out/ring-pipeline.log" 2>&1 || failed=1
    grep -E 'GPU_RING OK|rror' "$out/ring-pipeline.log" | sort | uniq -c
    for d in 4 8; do
        grep -q "segments cut into $d chunks or more" "$out/ring-pipeline.log" || { echo "the pipeline of $d was not applied"; failed=1; }
    done
    grep -q "chunks of up to 256 KiB reduced straight out of the host slots" "$out/ring-pipeline.log" || { echo "NODETOUR_SHM_READ_MAX was not applied"; failed=1; }
    grep -q "copies of up to 128 KiB out of the slots by one kernel" "$out/ring-pipeline.log" || { echo "NODETOUR_COPY_KERNEL_MAX was not applied"; failed=1; }
    grep -q "copies of up to 1024 KiB out of the slots by one kernel" "$out/ring-blocks.log" || { echo "the copy kernel was not on by default"; failed=1; }
    echo "== ring capture tests (2-4 processes, cuda-ipc and shm)"
    ./ring_capture_tests --include-ignored --test-threads 1 2>&1 | grep -E "test result|FAILED|panicked" | sort | uniq -c
    echo "final: failed=$failed"
} 2>&1 | tee "$out/final.log"
echo "== the reference script's small part on the final code (one GPU: a check that it runs)"
timeout 200 ./onehost-reference.sh "$out/ref" small --rounds 1 >"$out/ref.out" 2>&1
echo "onehost-reference small rc=$?"
grep -E "^ONEHOST_BEST|SKIP|failed=" "$out/ref.out" | head -20

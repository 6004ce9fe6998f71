#!/usr/bin/env bash
# gpu-tier.sh: the GPU test tier, run ON a GPU machine from the directory gpu-pack.sh filled.
#   ./gpu-tier.sh [OUTDIR]     (writes gpu-tier.log there too; default: the current directory)
# 1. the GPU tests (device buffers, dma-buf export, CUDA-registered hugepage buffers, NVRTC);
# 2. `nodetour gpus`: attributes, dma-buf export, the registration path GPU memory gets here;
# 3. `two_node_smoke --gpu`: on a machine without RDMA it reports the ladder and exits 2.
# NCCL_NVLS_ENABLE=0 is exported for anything that starts NCCL on shared GPU hosts.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
out=${1:-.}
export NCCL_NVLS_ENABLE=0 NODETOUR_REQUIRE_GPU=1
failed=0
{
    echo "== gpu tests"
    ./gpu_tests --include-ignored --test-threads 1 --nocapture || failed=1
    echo "== nodetour gpus"
    ./nodetour gpus || failed=1
    echo "== nodetour devices (exit 2 = no RDMA device here)"
    ./nodetour devices; echo "rc=$?"
    echo "== two_node_smoke --gpu (rank 0)"
    timeout 60 ./two_node_smoke --gpu --rank 0 --addr 127.0.0.1:18517; echo "rc=$?"
    echo "gpu-tier: failed=$failed"
} 2>&1 | tee "$out/gpu-tier.log"
exit "$failed"

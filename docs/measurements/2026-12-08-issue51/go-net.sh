#!/usr/bin/env bash
# go-net.sh OUT [net] [ab]: issue 51's device step 3 (gpu-plan.md in 2026-12-07-issue51), from a
# clone carrying .device/n: the network links between "hosts" (gpu-net.sh), then the device A/B
# against the parent (nodetour-A, built from 09eb96b) under a private MPS daemon (one GPU, two
# processes: a substitute), direct and staged paths.
set -uo pipefail
out=$(realpath -m "$1"); shift
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
r=$PWD/.device/${PACK:-n}
chmod +x "$r"/*
cat "$r/VERSION"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
start=$SECONDS
steps=("$@"); [[ ${#steps[@]} == 0 ]] && steps=(net ab)
for step in "${steps[@]}"; do
    case $step in
        net)
            timeout "${NET_S:-300}" "$r/gpu-net.sh" "$out/net" >"$out/net-run.txt" 2>&1; echo "rc=$?" >>"$out/net-run.txt"
            grep -E 'FAIL|failed=|^rc=|^== ' "$out/net-run.txt" | cut -c1-300 | head -40 ;;
        ab)
            export NODETOUR_CACHE_DIR=/tmp/nodetour-kernel-cache
            export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
            mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
            if nvidia-cuda-mps-control -d; then echo "MPS: private daemon started"; else echo "MPS: failed"; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY; fi
            for path in direct staged; do
                (cd "$r" && AB_PERF_ARGS="--iters 200 --warmup 20 --gpu --path $path" timeout "${AB_S:-150}" \
                    ./ab-perf.sh ./nodetour-A ./nodetour "${BATCHES:-5}" 2 8 65536 2097152 >"$out/ab-$path.txt" 2>&1; echo "rc=$?" >>"$out/ab-$path.txt")
                echo "== $path"; grep -E 'AB_PERF|rror|^rc=' "$out/ab-$path.txt" | cut -c1-300
            done
            echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 ;;
    esac
    echo "##### $step done at $((SECONDS - start)) s"
done

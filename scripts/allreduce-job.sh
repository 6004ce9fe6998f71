#!/usr/bin/env bash
# allreduce-job.sh: the main job's allreduce: two ranks through nodetour's Communicator on the
# best path this machine has, each link's path printed, the bandwidth beside its reference.
#   scripts/allreduce-job.sh gpu           two processes on this machine's GPUs
#                                          (examples/data_parallel: 4 x 25 MiB buckets, f32 and
#                                          bf16, checked); reference: NCCL's allreduce on the
#                                          same GPUs (nodetour perf --compare nccl, 2+ GPUs)
#   scripts/allreduce-job.sh verbs DEV0 DEV1
#                                          two processes over RDMA (host buffers, one device
#                                          each); reference: perftest's ib_write_bw between the
#                                          same devices, the link's one-way ceiling (a two-rank
#                                          ring moves the buffer once each way: busbw ≤ it)
# Runs from a build (target/release); in the soft-RoCE VM too (run.sh boots it).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BIN=${NODETOUR_BIN_DIR:-target/release}
export NODETOUR_JOB_TOKEN=${NODETOUR_JOB_TOKEN:-$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')}
case ${1:?usage: $0 gpu | verbs DEV0 DEV1} in
gpu)
    NCCL_NVLS_ENABLE=0 scripts/launch-local.sh -n 2 --timeout 300 -- "$BIN/examples/data_parallel"
    gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
    if ((gpus >= 2)); then
        echo "== reference: NCCL beside nodetour's GPU ring, same GPUs, same run"
        NCCL_NVLS_ENABLE=0 scripts/launch-local.sh -n 2 --timeout 300 -- "$BIN/nodetour" perf --gpu \
            --path direct --compare nccl --sizes 1M:256M --factor 4
    else
        echo "reference: none on one GPU (NCCL cannot put two ranks on one GPU)"
    fi
    ;;
verbs)
    dev0=${2:?device 0} dev1=${3:?device 1}
    sizes=${ALLREDUCE_SIZES:-64K:4M}
    out=$(mktemp)
    trap 'rm -f "$out"' EXIT
    echo "== allreduce: 2 ranks through the Communicator, host buffers over verbs ($dev0, $dev1)"
    scripts/launch-local.sh -n 2 --timeout 600 -- "$BIN/nodetour" perf --transport verbs \
        --devices "$dev0,$dev1" --sizes "$sizes" --factor 4 --iters 10 --warmup 2 | tee "$out"
    grep -q WRONG "$out" && { echo "allreduce-job: a result was wrong"; exit 1; }
    # The largest size's bus bandwidth (GB/s = 1e9 bytes/s).
    busbw=$(awk '$1 == "[rank" && $2 == "0]" && $3 ~ /^[0-9]+$/ && $NF == "ok" { b = $(NF-1) } END { print b }' "$out")
    echo "== reference: ib_write_bw between the same devices, 1 MiB writes (the link's ceiling)"
    SIZES=1048576 RUNS=1 NODETOUR_BIN=$BIN/nodetour scripts/compare/write-bw-compare.sh | tee -a "$out" ||
        echo "allreduce-job: the reference (ib_write_bw) gave no figure this run (it fails now and then under emulation)"
    link=$(sed -n 's/.*ib_write_bw_MBps=\([0-9.]*\).*/\1/p' "$out" | tail -1)
    if [[ -n $busbw && -n $link ]]; then
        python3 - "$busbw" "$link" <<'PY'
import sys
bus, link = float(sys.argv[1]) * 1e9 / 2**20, float(sys.argv[2])
if link > 0:
    print(f"ALLREDUCE_JOB busbw={bus:.1f} MB/s (largest size) link_ceiling={link:.1f} MB/s (ib_write_bw) ratio={bus / link:.2f}")
else:
    print(f"ALLREDUCE_JOB busbw={bus:.1f} MB/s (largest size) link_ceiling=unavailable (ib_write_bw gave no figure this run; the allreduce's own rows were checked)")
PY
    fi
    ;;
*)
    echo "allreduce-job: gpu or verbs, not $1" >&2
    exit 2
    ;;
esac

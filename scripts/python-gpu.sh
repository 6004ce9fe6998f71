#!/usr/bin/env bash
# python-gpu.sh: the torch.distributed backend on CUDA tensors, on a GPU machine with torch
# installed (the lent machines: torch 2.11, no network), from a clone whose target/wheels holds
# the wheel (scripts/python.sh --wheel here; carry target/wheels).
#   scripts/python-gpu.sh [N]   N processes (default 2) sharing the machine's GPUs (rank r on
#                               GPU r mod count): every collective against gloo; DDP and FSDP2
#                               with nodetour, and with NCCL beside them (a function check:
#                               NCCL_HOSTID per rank), each against one process and each other.
# Logs under $OUT (or /tmp/python-gpu). One "check ... ok|FAILED" line per check.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
N=${1:-2}
LOGS=${OUT:-/tmp/python-gpu}
mkdir -p "$LOGS"
failed=0
check() {
    local name=$1; shift
    if "$@"; then echo "check $name ... ok"; else echo "check $name ... FAILED"; failed=$((failed + 1)); fi
}
wheel=$(ls target/wheels/nodetour-*-abi3-*.whl 2>/dev/null | head -n 1)
[[ -f $wheel ]] || { echo "python-gpu.sh: no wheel in target/wheels (scripts/python.sh --wheel)"; exit 1; }
# The wheel beside the machine's torch: installed into a folder of its own on PYTHONPATH (the
# lent machines' python3 is itself a virtual environment, whose packages a venv made from it
# with --system-site-packages would not see).
py=$(command -v python3)
"$py" -c 'import torch' || { echo "python-gpu.sh: $py has no torch"; exit 1; }
PKG=/tmp/nodetour-py-pkg
rm -rf "$PKG"
"$py" -m pip install -q --no-deps --no-index --target "$PKG" "$wheel" || exit 1
export PYTHONPATH=$PKG${PYTHONPATH:+:$PYTHONPATH}
echo "torch $("$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))')"
"$py" -m nodetour doctor >"$LOGS/doctor.txt" 2>&1
echo "doctor exit $? (0 direct, 3 staged, 2 no usable GPU): $LOGS/doctor.txt"
export NODETOUR_JOB_TOKEN=python-gpu-$$-$RANDOM
# ranks PATTERN FILE: how many ranks printed PATTERN (ranks' lines may share one line).
ranks() { grep -oE "$1" "$2" | grep -oE 'rank=[0-9]+' | sort -u | wc -l; }
run() { # LOG, torchrun arguments...
    local log=$LOGS/$1; shift
    timeout 240 "$py" -m torch.distributed.run --standalone "$@" >"$log" 2>&1
    grep -E 'OK|Error|error' "$log" | grep -v '^W[0-9]' | cut -c1-200 | head -n 8
}
collectives() {
    run collectives.log --nproc-per-node "$N" python/tests/collectives.py --device cuda
    [[ $(ranks 'COLLECTIVES OK rank=[0-9]+ world=[0-9]+ device=cuda' "$LOGS/collectives.log") == "$N" ]]
}
check "every collective on CUDA tensors against gloo, $N processes" collectives
train() { # MODE
    local be
    for be in nodetour nccl; do
        run "$1-$be.log" --nproc-per-node "$N" python/tests/train.py --mode "$1" --backend $be \
            --device cuda --out "$LOGS/$1-$be.pt"
        [[ $(ranks 'TRAIN OK mode=[a-z]+ backend=[a-z]+ device=cuda rank=[0-9]+' "$LOGS/$1-$be.log") == "$N" ]] || return 1
    done
    "$py" python/tests/compare.py "$LOGS/$1-nodetour.pt" "$LOGS/$1-nccl.pt" "$1 on CUDA, nodetour vs NCCL"
}
check "DDP on CUDA, $N processes: nodetour and NCCL each equal one process, and each other" train ddp
check "FSDP2 on CUDA, $N processes: nodetour and NCCL each equal one process, and each other" train fsdp
echo "python-gpu.sh: $failed failed"
((failed == 0))

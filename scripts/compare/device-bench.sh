#!/usr/bin/env bash
# device-bench.sh: the GPU benchmark sweeps, with their references from the same runs, as
# markdown tables, JSON and SVG plots.
#   scripts/compare/device-bench.sh pack [DIR]   here (with Rust): build and pack into DIR (default .device)
#   ./device-bench.sh OUTDIR             on the GPU machine, from the packed DIR
# Sweeps (f32 sum): the direct ring over the GPUs of one process against NCCL and the copy
# ceilings; one GPU per process, direct and staged side by side, against NCCL (default) and
# the ceilings; the same against NCCL's own staged path (NCCL_P2P_DISABLE=1). Needs 2+ GPUs.
set -uo pipefail
if [[ ${1:-} == pack ]]; then
    cd "$(dirname "${BASH_SOURCE[0]}")/../.."
    scripts/gpu-pack.sh "${2:-.device}" && cp scripts/compare/device-bench.sh "${2:-.device}/"
    exit
fi
cd "$(dirname "${BASH_SOURCE[0]}")"
out=${1:?usage: ./device-bench.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 NODETOUR_CACHE_DIR=$PWD/kernel-cache NODETOUR_LOG=${NODETOUR_LOG:-warn}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [[ $gpus -lt 2 ]]; then
    echo "SKIP device-bench: needs 2 GPUs, this machine has $gpus"
    exit 0
fi
sizes=${SIZES:-16:1G} factor=${FACTOR:-4}
list=$(seq -s, 0 $((gpus - 1)))
failed=0
md="$out/bench.md"
{
    echo "# nodetour GPU benchmarks ($(date -u +%Y-%m-%d), $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) x$gpus, driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -1))"
    echo
} >"$md"
run() { # name, then the command; the markdown table goes to bench.md, the JSON beside it
    local name=$1; shift
    echo "== $name"
    if "$@" --format markdown --plot "$out/$name.svg" >"$out/$name.md.raw" 2>"$out/$name.log"; then
        sed 's/^\[rank 0\] //' "$out/$name.md.raw" | grep -E '^(\||all_reduce on|$)' | cat -s >"$out/$name.md"
        { echo "## $name"; echo; cat "$out/$name.md"; echo; echo "![$name]($name.svg)"; echo; } >>"$md"
    else
        echo "FAILED: $name (see $out/$name.log)"; failed=1
    fi
    rm -f "$out/$name.md.raw"
}
run one-process-direct ./nodetour perf --gpus "$list" --compare nccl,ceiling --sizes "$sizes" --factor "$factor"
run per-process-both ./launch-local.sh -n "$gpus" --timeout 580 -- ./nodetour perf --gpu --path both --compare nccl,ceiling --sizes "$sizes" --factor "$factor"
NCCL_P2P_DISABLE=1 run per-process-vs-nccl-staged ./launch-local.sh -n "$gpus" --timeout 580 -- ./nodetour perf --gpu --path staged --compare nccl,ceiling --sizes "1M:1G" --factor "$factor"
cat "$md"
exit "$failed"

#!/usr/bin/env bash
# ab-perf.sh: the cost of a change on the host ring, as interleaved A/B batches.
#   scripts/compare/ab-perf.sh BIN_A BIN_B [BATCHES] [RANKS] [SIZES...]
# BIN_A and BIN_B are two builds of `nodetour` (e.g. before and after a change). Each batch runs
# `nodetour perf` (2 ranks over tcp loopback by default; f32 sum; each row checked) with A, then
# with B; BATCHES batches (default 5). Prints per size the median over batches of each build's
# per-collective median time, the spread (max - min over batches), and the ratio B/A.
# Extra perf arguments go in AB_PERF_ARGS (default "--iters 200 --warmup 20"); for the GPU ring
# (one process per GPU) add e.g. "--gpu --path direct". launch-local.sh is taken from beside
# this script (as in the directory gpu-pack.sh fills).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Beside this script in a packed directory (gpu-pack.sh), one level up in the repository.
launch=$here/launch-local.sh
[[ -x $launch ]] || launch=$here/../launch-local.sh
a=${1:?usage: $0 BIN_A BIN_B [BATCHES] [RANKS] [SIZES...]} b=${2:?}
batches=${3:-5} ranks=${4:-2}
shift 4 2>/dev/null || shift $#
sizes=("$@")
[[ ${#sizes[@]} == 0 ]] && sizes=(8 1048576)
read -r -a extra <<<"${AB_PERF_ARGS:---iters 200 --warmup 20}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for ((i = 1; i <= batches; i++)); do
    for which in A B; do
        bin=$a
        [[ $which == B ]] && bin=$b
        for size in "${sizes[@]}"; do
            NODETOUR_LOG=warn "$launch" -n "$ranks" --timeout 300 -- "$bin" perf \
                --sizes "$size:$size" "${extra[@]}" --format json 2>/dev/null |
                sed -n 's/^\[rank 0\] //p' >"$out/run.json"
            python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["rows"]:
    assert r["correct"], r
    print(sys.argv[2], r["bytes"], r["time_us"])' "$out/run.json" "$which" >>"$out/times"
        done
    done
done
python3 - "$out/times" "$a" "$b" <<'EOF'
import sys, statistics
rows = [l.split() for l in open(sys.argv[1])]
for size in sorted({int(r[1]) for r in rows}):
    t = {w: [float(r[2]) for r in rows if r[0] == w and int(r[1]) == size] for w in "AB"}
    ma, mb = statistics.median(t["A"]), statistics.median(t["B"])
    print(f"AB_PERF bytes={size} batches={len(t['A'])} A_median_us={ma:.2f} A_spread_us={max(t['A']) - min(t['A']):.2f} "
          f"B_median_us={mb:.2f} B_spread_us={max(t['B']) - min(t['B']):.2f} B_over_A={mb / ma:.3f}")
print(f"AB_PERF A={sys.argv[2]} B={sys.argv[3]}")
EOF

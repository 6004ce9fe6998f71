#!/usr/bin/env bash
# soak.sh [tcp|verbs] [COLLECTIVES] [RANKS]: back-to-back allreduces across RANKS processes
# (default 4), every one checked exactly against the float64 reference (the 78 type x op cases
# round-robin), then each rank's resident memory and open descriptors before and after.
# Defaults: tcp 10000 collectives; verbs 1000 (inside the soft-RoCE VM:
#   scripts/vm/rdma-vm.sh --nodes 2 -- scripts/drills/soak.sh verbs).
# Passes when every rank finishes without an error and its descriptor count is unchanged and
# its memory grew by less than 4 MiB.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
transport=${1:-tcp}
case $transport in
    tcp) n=${2:-10000} extra=() ;;
    verbs) n=${2:-1000} extra=(--devices "${NODETOUR_VM_DEV0:-rxe0},${NODETOUR_VM_DEV1:-rxe1}") ;;
    *) echo "soak.sh: tcp or verbs" >&2; exit 2 ;;
esac
ranks=${3:-4}
bin=${NODETOUR_EXAMPLES:-target/release/examples}
[[ -x $bin/allreduce_check ]] || cargo build --release -p nodetour --example allreduce_check >&2
out=$(scripts/launch-local.sh -n "$ranks" --timeout 3600 -- "$bin/allreduce_check" --transport "$transport" \
    "${extra[@]}" --all --count 4099 --slot-bytes 4096 --repeat "$n" 2>&1)
rc=$?
echo "$out" | grep -E 'SOAK|error' | sed 's/^/  /'
verdict=$(echo "$out" | grep -o 'SOAK .*' | awk -v want="$ranks" '
    { for (i = 1; i <= NF; i++) { split($i, kv, "="); v[kv[1]] = kv[2] }
      ok += (v["fds_start"] == v["fds_end"] && v["rss_kib_end"] - v["rss_kib_start"] < 4096); seen++ }
    END { print (seen == want && ok == want) ? "ok" : "FAILED" }')
echo "SOAK_RESULT transport=$transport ranks=$ranks collectives=$n exit=$rc verdict=$verdict"
[[ $rc == 0 && $verdict == ok ]]

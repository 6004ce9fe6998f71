#!/usr/bin/env bash
# load.sh [SECONDS] [RANKS]: RANKS processes (default 8) over tcp on this machine run
# allreduces back to back for SECONDS (default 300), every one checked exactly; prints each
# rank's count, slowest collective and footprint. Passes when every rank ends without an error
# or timeout (the progress loops must not starve a 2-core machine).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
secs=${1:-300}
ranks=${2:-8}
bin=${NODETOUR_EXAMPLES:-target/release/examples}
[[ -x $bin/allreduce_check ]] || cargo build --release -p nodetour --example allreduce_check >&2
out=$(scripts/launch-local.sh -n "$ranks" --timeout $((secs + 300)) -- "$bin/allreduce_check" \
    --all --count 100003 --slot-bytes 65536 --seconds "$secs" 2>&1)
rc=$?
echo "$out" | grep -E 'SOAK|error' | sed 's/^/  /'
done=$(echo "$out" | grep -c 'SOAK ')
total=$(echo "$out" | grep -o 'collectives=[0-9]*' | head -1 | cut -d= -f2)
echo "LOAD_RESULT ranks=$ranks seconds=$secs ranks_finished=$done collectives_per_rank=${total:-0} exit=$rc verdict=$([[ $rc == 0 && $done == "$ranks" ]] && echo ok || echo FAILED)"
[[ $rc == 0 && $done == "$ranks" ]]

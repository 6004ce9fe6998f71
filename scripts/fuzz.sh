#!/usr/bin/env bash
# fuzz.sh [SECONDS] [TARGET...]: runs each cargo-fuzz target for SECONDS (default 600) on its
# corpus under fuzz/corpus/<target>/ (new interesting inputs are added there; the tests replay
# them), then prints one line per target: executions, corpus size, and whether it crashed.
# Needs cargo-fuzz and a nightly toolchain (`rustup toolchain install nightly`).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
secs=${1:-600}; shift || true
targets=("$@")
[[ ${#targets[@]} == 0 ]] && mapfile -t targets < <(cargo +nightly fuzz list --fuzz-dir fuzz 2>/dev/null)
failed=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    log=$(mktemp)
    cargo +nightly fuzz run --fuzz-dir fuzz "$t" "fuzz/corpus/$t" -- -max_total_time="$secs" -print_final_stats=1 >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    echo "FUZZ target=$t seconds=$secs executions=${execs:-?} corpus=$(ls "fuzz/corpus/$t" | wc -l) exit=$rc $([[ $rc == 0 ]] && echo no-crash || echo CRASH)"
    [[ $rc == 0 ]] || { tail -n 30 "$log"; failed=1; }
    rm -f "$log"
done
exit "$failed"

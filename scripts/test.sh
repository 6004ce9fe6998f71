#!/usr/bin/env bash
# test.sh: nodetour's whole test suite, from a fresh Debian/Ubuntu machine with Rust.
#   scripts/test.sh            install what is missing, build, run every tier this machine allows
#   scripts/test.sh --full     also the comparisons that only print (tcp against a plain stream,
#                              Open MPI, ib_write_bw and perf in the VM): CI leaves them out
# Tiers:
#   host   cargo test --workspace: pure logic, fixtures, fault injection, the out-of-band channel,
#          fuzz corpora; hardware tests are ignored (counted as skipped) here.
#   binary the binaries do not link libibverbs/librdmacm (ldd), and start without them.
#   vm     real verbs in a soft-RoCE VM (scripts/vm/rdma-vm.sh --nodes 2): the hardware tests, the
#          two-node smoke example between two rxe devices, and our write loop vs ib_write_bw.
#          Prints "SKIP <reason>" where the VM cannot run.
#   python the Python package and the torch.distributed backend (scripts/python.sh): torch from
#          PyPI in target/py, the wheel built with maturin, torchrun tests on CPUs.
# Env: NODETOUR_SKIP_INSTALL=1 (do not touch packages), NODETOUR_SKIP_VM=1, NODETOUR_SKIP_PYTHON=1,
# NODETOUR_REQUIRE_VM=1
# (a VM tier that cannot run is a failure naming why, not a skip: .ci/run sets it),
# NODETOUR_REQUIRE_LAUNCHERS=1 (mpirun and srun must run: .ci/run sets it).
# Every tier prints its seconds; the last line counts each test once, where it ran.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
case ${1:-} in
    --full) export NODETOUR_FULL=1 ;; # seen by the VM tier too (rdma-vm.sh passes NODETOUR_*)
    "") ;;
    *) echo "usage: $0 [--full]" >&2; exit 2 ;;
esac
# full NAME: whether a print-only comparison runs (else one SKIP line, counted).
full() {
    [[ ${NODETOUR_FULL:-0} == 1 ]] && return 0
    echo "SKIP $1: a comparison that only prints (scripts/test.sh --full)"; skipped=$((skipped + 1))
    return 1
}
# The scripts name binaries under ./target: build there even where CARGO_TARGET_DIR points elsewhere.
export CARGO_TARGET_DIR="$PWD/target"
T0=$(date +%s)
# step NAME: starts a tier; the tier before it ends here (its seconds are listed at the end).
tiers=() tier_name="" tier_t0=$T0
step() {
    local now
    now=$(date +%s)
    [[ -n $tier_name ]] && tiers+=("$(printf '%5ss  %s' $((now - tier_t0)) "$tier_name")")
    tier_name=$* tier_t0=$now
    echo "== test.sh [$((now - T0))s] $*"
}
passed=0 failed=0 skipped=0
tally() { # FILE: echoes cargo test output from stdin, appends "passed failed ignored" per run
    local line
    while IFS= read -r line; do
        echo "$line"
        if [[ $line =~ ^test\ result:.*\ ([0-9]+)\ passed\;\ ([0-9]+)\ failed\;\ ([0-9]+)\ ignored ]]; then
            echo "${BASH_REMATCH[1]} ${BASH_REMATCH[2]} ${BASH_REMATCH[3]}" >>"$1"
        fi
    done
}
sum() { awk '{p+=$1; f+=$2; i+=$3} END {print p+0, f+0, i+0}' "$1"; }
HOST=$(mktemp) VM=$(mktemp)
trap 'rm -f "$HOST" "$VM"' EXIT
check() { # name, command...: one pass/fail line, with its seconds (what to trim when CI grows)
    local name=$1 t0=$SECONDS; shift
    if "$@"; then echo "check $name ... ok ($((SECONDS - t0)) s)"; passed=$((passed + 1)); else echo "check $name ... FAILED ($((SECONDS - t0)) s)"; failed=$((failed + 1)); fi
}

if [[ ${NODETOUR_SKIP_INSTALL:-0} != 1 ]]; then
    step "installing packages"
    scripts/install-deps.sh || { echo "test.sh: installing packages failed"; exit 1; }
fi

step "host tier: cargo test --workspace"
cargo test --workspace --color never 2>&1 | tally "$HOST"
host_rc=${PIPESTATUS[0]}
[[ $host_rc == 0 ]] || failed=$((failed + 1))

step "lint: every unsafe block in nodetour-core documents its soundness (clippy)"
clippy_core() { cargo clippy -p nodetour-core --all-targets --color never 2>&1 | tail -n 3; return "${PIPESTATUS[0]}"; }
check "nodetour-core: clippy with #![deny(clippy::undocumented_unsafe_blocks)]" clippy_core
docs_build() { RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --color never 2>&1 | tail -n 3; return "${PIPESTATUS[0]}"; }
check "cargo doc --workspace without warnings" docs_build
code_shape() { scripts/code-shape.sh --check | tail -n 4; return "${PIPESTATUS[0]}"; }
check "no source file over 1,000 lines (scripts/code-shape.sh)" code_shape

step "valgrind: the host tier's unit tests and fuzz corpora, no invalid read or write"
valgrind_one() { # EXE NAME LOG: one test executable under valgrind, its result line
    local exe=$1 name=$2 log=$3 t0=$SECONDS
    # The network ring's every-shape sweep (thousands of thread hand-offs) takes minutes
    # under valgrind's one-thread-at-a-time scheduling; its smaller siblings cover the same
    # code there.
    # --fair-sched=yes: valgrind runs one thread at a time, and its default lock lets a
    # thread be passed over for long; once (2026-12-07) a ring test's rank then waited out
    # its 20 s slot-grant timeout. The ticket lock hands the CPU round in turn (same time:
    # 169 s against 174-180 s for the ring's unit tests).
    valgrind -q --fair-sched=yes --error-exitcode=99 "$exe" --test-threads 2 --skip every_shape_over_tcp_and_in_process >"$log" 2>&1 ||
        { tail -n 40 "$log"; echo "  $name: FAILED"; return 1; }
    echo "  $name: $(grep 'test result' "$log") ($((SECONDS - t0)) s)"
}
valgrind_host() { # nodetour-core and nodetour-ring unit tests, corpus replays (raw-pointer code)
    local exe spec pkg kind target
    local -A exes=()
    # Built first, one cargo at a time.
    for spec in "nodetour-ring --lib" "nodetour-core --lib" "nodetour-core --test fuzz_corpus" "nodetour-ring --test fuzz_corpus"; do
        read -r pkg kind target <<<"$spec"
        exe=$(cargo test -p "$pkg" $kind $target --no-run --color never 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p' | head -n 1)
        [[ -x $exe ]] || { echo "  no test executable for $spec"; return 1; }
        exes[$spec]=$exe
    done
    # Two lanes at once: valgrind runs all of a process's threads on one core, so one
    # process leaves the other core idle. The ring's unit tests (the longest) lead one lane.
    local rc_a=0 rc_b=0
    { valgrind_one "${exes[nodetour-ring --lib]}" "nodetour-ring --lib" /tmp/valgrind-ring-lib.log &&
        valgrind_one "${exes[nodetour-core --test fuzz_corpus]}" "nodetour-core --test fuzz_corpus" /tmp/valgrind-core-corpus.log; } &
    local lane_a=$!
    { valgrind_one "${exes[nodetour-core --lib]}" "nodetour-core --lib" /tmp/valgrind-core-lib.log &&
        valgrind_one "${exes[nodetour-ring --test fuzz_corpus]}" "nodetour-ring --test fuzz_corpus" /tmp/valgrind-ring-corpus.log; } &
    local lane_b=$!
    wait "$lane_a" || rc_a=$?
    wait "$lane_b" || rc_b=$?
    [[ $rc_a == 0 && $rc_b == 0 ]]
}
if command -v valgrind >/dev/null; then
    check "valgrind: nodetour-core and nodetour-ring unit tests and corpora run clean" valgrind_host
else
    echo "SKIP valgrind: not installed"; skipped=$((skipped + 1))
fi

step "binary tier: release build, no load-time libibverbs/librdmacm"
cargo build --release --workspace --bins --examples --color never 2>&1 | tail -n 3
no_verbs_link() { ! ldd "$1" | grep -E 'libibverbs|librdmacm'; }
check "ldd nodetour has no libibverbs/librdmacm" no_verbs_link target/release/nodetour
check "ldd two_node_smoke has no libibverbs/librdmacm" no_verbs_link target/release/examples/two_node_smoke
starts_without_libibverbs() {
    local out rc
    out=$(NODETOUR_IBVERBS_LIBRARY=/nonexistent/libibverbs.so.1 target/release/nodetour devices 2>&1); rc=$?
    echo "  $out"
    [[ $rc == 2 && $out == *"RDMA verbs is not supported here: cannot load"* ]]
}
check "nodetour starts without libibverbs (typed Unsupported, exit 2)" starts_without_libibverbs
doctor_runs() {
    local rc=0
    target/release/nodetour doctor 2>&1 || rc=$?
    local json
    json=$(target/release/nodetour doctor --json --no-live) || true
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["schema"] == 1 and "host_memory" in d, d' "$json" || return 1
    # Exit status: 0 every GPU direct, 3 some GPU staged, 2 no usable GPU.
    [[ $rc == 0 || $rc == 2 || $rc == 3 ]]
}
check "nodetour doctor explains this machine (text and JSON)" doctor_runs
# Crates outside the workspace, as users write them: each checked (or built and run) in
# target/compat, their lock files ignored (the checkout stays clean).
compat() { # DIR check|run [ENV=VALUE...]: cargo check, or build and run, the crate in DIR
    local dir=$1 how=$2
    shift 2
    env "$@" CARGO_TARGET_DIR="$PWD/target/compat" cargo "$how" --color never --quiet \
        --manifest-path "$dir/Cargo.toml" 2>&1 | tail -n 3
    return "${PIPESTATUS[0]}"
}
# (The repository's .cargo/config.toml sets CUDARC_CUDA_VERSION=12080 for builds started here,
# standing in for nvcc; a crate that names another version sets the same one.)
check "a user's crate builds with nodetour alone and cudarc's cuda-13000 (tests/user-crate)" \
    compat tests/user-crate check CUDARC_CUDA_VERSION=13000
check "nodetour beside candle-core 0.11.1's cudarc features (dynamic-linking) checks" \
    compat tests/compat/candle check
check "nodetour beside cubecl-cuda 0.12's cudarc features (NCCL, fallback loading) builds and allreduces" \
    compat tests/compat/cubecl run
check "nodetour beside cudarc's defaults and cuda-12080 builds and allreduces" compat tests/compat/plain-cudarc run
check "a runtime on cudarc 0.17 reaches nodetour through raw handles, builds and allreduces (tests/compat/old-cudarc)" \
    compat tests/compat/old-cudarc run
check "nodetour builds under the oldest CUDA bindings it supports (11.7: tests/compat/cuda-range)" \
    compat tests/compat/cuda-range check CUDARC_CUDA_VERSION=11070
check "nodetour builds under the newest CUDA bindings of its cudarc (13.4: tests/compat/cuda-range)" \
    compat tests/compat/cuda-range check CUDARC_CUDA_VERSION=13040
package_workspace() { # every crate packs, and builds from its package alone
    # cargo unpacks the packages it verifies under $CARGO_HOME/registry/src/<its temporary,
    # nameless registry>/ and builds them in target/package, and reuses both where it finds
    # them (a registry crate of one version never changes): a second run from the same checkout
    # path would verify the first run's sources. Both go first (of the nameless registries only
    # nodetour's own crates, never a real registry's).
    rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/nodetour*-[0-9]* "$PWD/target/package"
    CARGO_TARGET_DIR="$PWD/target/package" cargo package --workspace --allow-dirty --color never 2>&1 |
        grep -E '^(error|warning: manifest)|Packaged|Verifying' | tail -n 12
    return "${PIPESTATUS[0]}"
}
check "cargo package --workspace: nodetour, -core, -net, -ring and the tools pack and build from their packages" package_workspace

step "process tier: N processes over tcp (scripts/launch-local.sh)"
for n in 2 4 8; do
    ranks_ok() {
        local out
        out=$(scripts/launch-local.sh -n "$1" --timeout 120 -- target/release/examples/transport_check 2>&1)
        grep -E 'TRANSPORT OK|error' <<<"$out"
        [[ $(grep -c 'TRANSPORT OK' <<<"$out") == "$1" ]]
    }
    check "$n processes connect over tcp, write, verify and exit cleanly" ranks_ok "$n"
done
for n in 2 3 8; do
    allreduce_ok() {
        local out
        out=$(scripts/launch-local.sh -n "$1" --timeout 300 -- target/release/examples/allreduce_check --all --count 10007 2>&1)
        grep -E 'ALLREDUCE OK|error' <<<"$out"
        [[ $(grep -c 'ALLREDUCE OK' <<<"$out") == "$1" ]]
    }
    check "ring allreduce of host buffers, $n processes over tcp, 78 type x op cases against float64" allreduce_ok "$n"
done
train_ok() { # N: the training example on CPUs, every rank's weights against one process's
    local out
    out=$(scripts/launch-local.sh -n "$1" --timeout 200 -- target/release/examples/train_mlp --device cpu 2>&1)
    grep -E 'TRAIN_MLP OK|error' <<<"$out" | cut -c1-160
    [[ $(grep -c 'TRAIN_MLP OK' <<<"$out") == "$1" ]]
}
for n in 2 4; do
    check "examples/train_mlp: data-parallel MLP training, $n processes on CPUs, weights equal one process's" train_ok "$n"
done
settings_differ() { # N: one rank with twice the slot bytes: a formation error on every rank
    local out
    out=$(timeout 120 scripts/launch-local.sh -n "$1" --timeout 100 -- target/release/examples/allreduce_check --differ-rank 1 2>&1)
    grep -E 'SETTINGS_DIFFER|error' <<<"$out"
    [[ $(grep -c 'SETTINGS_DIFFER rank=[0-9]* error=.*NODETOUR_SLOT_BYTES' <<<"$out") == "$1" ]]
}
for n in 2 3; do
    check "$n processes over tcp, one with other slot bytes: formation fails on every rank naming the setting" settings_differ "$n"
done
perf_runs() {
    local out
    out=$(NODETOUR_LOG=warn scripts/launch-local.sh -n 2 --timeout 120 -- target/release/nodetour perf --sizes 1K:1M --factor 8 --format json 2>/dev/null | grep '^\[rank 0\]' | sed 's/^\[rank 0\] //')
    echo "$out" | head -c 2000
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["rows"] and all(r["correct"] for r in d["rows"]), d' "$out"
}
check "nodetour perf sweeps sizes over tcp with a correctness check per row (JSON)" perf_runs
lost_is_reported() {
    local out
    out=$(timeout 60 scripts/launch-local.sh -n 4 --timeout 60 -- target/release/examples/transport_check --kill-rank 2 2>&1)
    grep -E 'lost|abrupt|error' <<<"$out"
    [[ $(grep -cE 'rank 2 (was )?lost' <<<"$out") == 3 ]]
}
check "a rank that dies after the rendezvous is reported lost by every other rank" lost_is_reported
tcp_bench() {
    scripts/launch-local.sh -n 2 --timeout 120 -- target/release/examples/transport_check --bench 268435456 2>&1 | grep TCP_BENCH
}
full "tcp large writes against a plain TCP stream" &&
    check "tcp large writes against a plain TCP stream (ratio printed, not asserted)" tcp_bench
# Real launchers (a launcher this machine lacks is a SKIP, counted; never a pass).
launchers_out=$(scripts/tiers/launchers.sh target/release/examples/allreduce_check 2>&1)
launchers_rc=$?
grep -vE '^20[0-9-]+T' <<<"$launchers_out"
launcher_skips=$(grep -c '^SKIP' <<<"$launchers_out")
skipped=$((skipped + launcher_skips))
if [[ $launchers_rc != 0 ]]; then
    echo "check real launchers (mpirun -n 4, srun -n 4) ... FAILED"; failed=$((failed + 1))
elif [[ $launcher_skips == 0 ]]; then
    echo "check real launchers: mpirun -n 4 and srun -n 4 (a one-machine Slurm) form the communicator from their own variables and allreduce; two Slurm steps side by side ... ok"
    passed=$((passed + 1))
fi
mpi_compare() { # issue 16's reference, same run: ratios printed, not asserted (timings are noisy)
    scripts/compare/mpi-compare.sh --ranks "2 4" --batches 5 --iters 20 2>&1 | grep -E '^(MPI_COMPARE|SKIP|mpi-compare)'
    return "${PIPESTATUS[0]}"
}
if ! full "the host allreduce against Open MPI's (mpi-compare)"; then
    :
elif command -v mpirun >/dev/null && command -v mpicc >/dev/null; then
    check "the host allreduce over tcp against Open MPI's, interleaved batches (MPI_COMPARE lines, printed)" mpi_compare
else
    echo "SKIP mpi-compare: Open MPI is not installed (scripts/install-deps.sh installs it)"; skipped=$((skipped + 1))
fi
soak_tcp() { scripts/drills/soak.sh tcp 10000 4; }
drills_tcp() { # 3 kill + 3 abort trials, 4 processes; every Ok result checked (recorded: 20 each)
    NODETOUR_TIMEOUT_MS=3000 scripts/drills/host-drills.sh tcp 3 4 /tmp/host-drills-ci.log | sed 's/^/  /'
    return "${PIPESTATUS[0]}"
}
check "drills over tcp: a rank SIGKILLed or aborted mid-allreduce, the others fail in time naming it, no wrong Ok (3 trials each)" drills_tcp
check "soak: 10000 allreduces across 4 processes over tcp, exact, memory and descriptors flat" soak_tcp
benches_run() { # each criterion bench once (criterion's --test mode); SKIP lines where hardware lacks
    local out
    # Bounded (building the benches included): a bench that hangs fails the check instead of CI.
    out=$(timeout 1500 cargo bench --color never -- --test 2>&1) || {
        echo "$out" | grep -E -A2 'panicked|collective failed' | head -n 20
        echo "$out" | tail -n 20
        return 1
    }
    echo "$out" | grep -E '^(SKIP|Testing|Success)' | sed 's/^/  /' | head -n 40
}
check "cargo bench: every bench runs (once each, criterion --test); SKIP where hardware lacks" benches_run

if [[ ${NODETOUR_SKIP_PYTHON:-0} == 1 ]]; then
    echo "SKIP python tier: NODETOUR_SKIP_PYTHON=1"; skipped=$((skipped + 1))
else
    step "python tier: the wheel, and the torch.distributed backend under torchrun (CPU)"
    # Its checks are listed here; the tier counts as one check (scripts/python.sh alone runs it).
    python_tier() { scripts/python.sh 2>&1 | sed 's/^/  /'; return "${PIPESTATUS[0]}"; }
    check "python: the abi3 wheel; torch $(printf %s "${NODETOUR_TORCH:-2.15.0}")'s DDP, FSDP2 and every collective against gloo (scripts/python.sh)" python_tier
fi

vm_cannot_run() { # REASON: a skip, or with NODETOUR_REQUIRE_VM=1 a failure naming why
    if [[ ${NODETOUR_REQUIRE_VM:-0} == 1 ]]; then
        echo "check vm tier ... FAILED: NODETOUR_REQUIRE_VM=1 but the VM tier cannot run: $1"
        failed=$((failed + 1))
    else
        echo "SKIP vm tier: $1"
        skipped=$((skipped + 1))
    fi
}
if [[ ${NODETOUR_SKIP_VM:-0} == 1 ]]; then
    vm_cannot_run "NODETOUR_SKIP_VM=1"
elif ! reason=$(scripts/vm/rdma-vm.sh --check 2>&1); then
    vm_cannot_run "$reason"
else
    step "vm tier: real verbs between rxe0 and rxe1 in a soft-RoCE VM"
    # The criterion transport bench, to run its verbs part where a device exists.
    NODETOUR_BENCH_TRANSPORT=$(cargo bench --bench transport --no-run --color never 2>&1 |
        sed -n 's/.*Executable .*(\(.*\))$/\1/p' | head -n 1)
    export NODETOUR_BENCH_TRANSPORT
    # The ring's unit tests: their network-link test over verbs runs in the VM.
    NODETOUR_VM_RING_TESTS=$(cargo test -p nodetour-ring --lib --no-run --color never 2>&1 |
        sed -n 's/.*Executable .*(\(.*\))$/\1/p' | head -n 1)
    export NODETOUR_VM_RING_TESTS
    mapfile -t exes < <(cargo test -p nodetour-core --test verbs_rxe --no-run --color never 2>&1 |
        sed -n 's/.*Executable .*(\(.*\))$/\1/p')
    # Point-to-point over verbs (its ignored test: batches between ranks on rxe0 and rxe1).
    mapfile -t -O "${#exes[@]}" exes < <(cargo test -p nodetour-ring --test p2p --no-run --color never 2>&1 |
        sed -n 's/.*Executable .*(\(.*\))$/\1/p')
    if [[ ${#exes[@]} == 0 ]]; then
        echo "test.sh: could not find the verbs_rxe test executable"; failed=$((failed + 1))
    else
        scripts/vm/rdma-vm.sh --nodes 2 --timeout 900 -- scripts/tiers/vm-tier.sh "${exes[@]}" 2>&1 | tally "$VM"
        vm_rc=${PIPESTATUS[0]}
        if [[ $vm_rc == 0 ]]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi
        echo "vm tier exit status: $vm_rc"
    fi
fi

read -r hp hf hi < <(sum "$HOST")
read -r vp vf _ < <(sum "$VM")
step "done"
echo "seconds per tier:"
printf '  %s\n' "${tiers[@]}"
# Hardware tests are ignored on the host; the VM runs only ignored tests (--ignored), so its
# counts are a part of the host's ignored ones: count each test once, where it ran.
not_run=$(( hi > vp + vf ? hi - vp - vf : 0 ))
echo "host cargo tests: $hp passed, $hf failed, $hi ignored; vm cargo tests: $vp passed, $vf failed; checks: $passed passed, $failed failed, $skipped skipped"
echo "tests: $((hp + vp + passed)) passed, $((hf + vf + failed)) failed, $((not_run + skipped)) skipped"
(( failed == 0 && hf == 0 && vf == 0 ))

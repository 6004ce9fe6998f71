#!/usr/bin/env bash
# python.sh: the Python package (python/): build its abi3 wheel with maturin, install it beside
# the pinned torch in a virtual environment under target/py, lint the native crate, and run the
# torch.distributed backend's tests on CPUs under torchrun.
#   scripts/python.sh           everything (the test tier's "python" step)
#   scripts/python.sh --wheel   only the wheel, in target/wheels/ (what a GPU run carries)
# Env: NODETOUR_TORCH (default 2.15.0, the CI pin). Prints seconds per phase; every check one
# "check ... ok|FAILED" line; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export CARGO_TARGET_DIR="$PWD/target"
TORCH=${NODETOUR_TORCH:-2.15.0}
VENV=$PWD/target/py
T0=$(date +%s)
say() { echo "python.sh [$(($(date +%s) - T0))s] $*"; }
failed=0
check() { # name, command...
    local name=$1; shift
    if "$@"; then echo "check $name ... ok"; else echo "check $name ... FAILED"; failed=$((failed + 1)); fi
}

if [[ ! -x $VENV/bin/python ]]; then
    say "virtual environment $VENV"
    python3 -m venv "$VENV" || { echo "python.sh: python3 -m venv failed (Debian: apt install python3-venv)"; exit 1; }
fi
py=$VENV/bin/python
if ! "$py" -m maturin --version >/dev/null 2>&1; then
    say "installing maturin"
    "$py" -m pip install -q --disable-pip-version-check 'maturin>=1.9,<2' || exit 1
fi

say "building the wheel (maturin, release)"
rm -f target/wheels/nodetour-*.whl
"$py" -m maturin build --release --quiet -m python/Cargo.toml -o target/wheels 2>&1 | tail -n 3
wheel=$(ls target/wheels/nodetour-*-abi3-*.whl 2>/dev/null | head -n 1)
[[ -f $wheel ]] || { echo "python.sh: no wheel built"; exit 1; }
say "wheel $wheel ($(du -h "$wheel" | cut -f1))"
[[ ${1:-} == --wheel ]] && exit 0

lint() {
    cargo clippy --quiet --color never --manifest-path python/Cargo.toml -- -D warnings 2>&1 | tail -n 5
    [[ ${PIPESTATUS[0]} == 0 ]] && cargo fmt --manifest-path python/Cargo.toml -- --check
}
check "python/: the native crate is clippy-clean and formatted" lint

if ! "$py" -c "import torch; assert torch.__version__.startswith('$TORCH')" 2>/dev/null; then
    say "installing torch==$TORCH (CUDA wheels from PyPI: about 3 GB to download, 5 GB installed)"
    t=$(date +%s)
    "$py" -m pip install -q --disable-pip-version-check "torch==$TORCH" numpy || exit 1
    say "torch installed in $(($(date +%s) - t))s"
fi
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$wheel" || exit 1

imports() { # the package imports without torch's backend; the doctor answers
    local json rc=0
    "$py" -c 'import nodetour; t, s = nodetour.doctor(live=False); assert s in (0, 2, 3) and "nodetour doctor" in t' || return 1
    # Its exit status is the doctor's (2 here: no GPU); the document must parse.
    json=$("$py" -m nodetour doctor --no-live --json) || rc=$?
    [[ $rc == 0 || $rc == 2 || $rc == 3 ]] || return 1
    "$py" -c 'import json, sys; assert json.loads(sys.argv[1])["schema"] == 1' "$json"
}
check "import nodetour; python -m nodetour doctor (text and JSON)" imports

# The tests run with a job token, as a job should (nothing token-derived enters torch's store).
export NODETOUR_JOB_TOKEN=python-sh-$$-$RANDOM
# ranks PATTERN: how many ranks printed PATTERN (ranks' lines may share one line of output).
ranks() { grep -oE "$1" | grep -oE 'rank=[0-9]+' | sort -u | wc -l; }
torchrun() { timeout 300 "$VENV/bin/torchrun" --standalone "$@" 2>&1 | grep -vE '^W[0-9]{4} |OMP_NUM_THREADS|^\*+$|FutureWarning|return func'; }
collectives() { # N: every collective against gloo
    local out
    out=$(torchrun --nproc-per-node "$1" python/tests/collectives.py)
    grep -E 'COLLECTIVES OK|Error|error' <<<"$out" | head -n 8
    [[ $(ranks 'COLLECTIVES OK rank=[0-9]+' <<<"$out") == "$1" ]]
}
train() { # MODE N: DDP or FSDP2 with nodetour and with gloo; each against one process, and each other
    local out be dir
    dir=$(mktemp -d)
    for be in nodetour gloo; do
        out=$(torchrun --nproc-per-node "$2" python/tests/train.py --mode "$1" --backend $be --out "$dir/$be.pt")
        grep -E 'TRAIN OK.*rank=0|Error|error' <<<"$out" | head -n 6
        [[ $(ranks 'TRAIN OK mode=[a-z]+ backend=[a-z]+ device=[a-z]+ rank=[0-9]+' <<<"$out") == "$2" ]] || { rm -rf "$dir"; return 1; }
    done
    "$py" python/tests/compare.py "$dir/nodetour.pt" "$dir/gloo.pt" "$1 x $2, nodetour vs gloo"
    local rc=$?
    rm -rf "$dir"
    return $rc
}
killed() { # N: the last rank exits mid-training; every survivor raises naming it
    local out
    # A long monitor interval: torchrun's agent would otherwise stop the survivors before they
    # see the loss (a loaded machine takes seconds).
    out=$(torchrun --monitor-interval 30 --nproc-per-node "$1" python/tests/train.py --mode ddp --steps 50 --die-at 3)
    grep -E 'SURVIVOR OK|exiting at' <<<"$out" | cut -c1-200
    [[ $(ranks "SURVIVOR OK rank=[0-9]+ error='[^']*rank $(($1 - 1)) lost" <<<"$out") == $(($1 - 1)) ]]
}
unauthenticated() { # no token: warned, paths() says so, and the collectives still right
    local out
    out=$(NODETOUR_JOB_TOKEN= torchrun --nproc-per-node 2 python/tests/collectives.py)
    grep -E 'COLLECTIVES OK|is unauthenticated' <<<"$out" | cut -c1-160 | head -n 3
    [[ $(ranks 'COLLECTIVES OK rank=[0-9]+' <<<"$out") == 2 ]] && grep -q 'is unauthenticated' <<<"$out"
}
say "torchrun tests (CPU, torch $("$py" -c 'import torch; print(torch.__version__)'))"
for n in 2 4; do
    check "torch backend: every collective against gloo, $n processes" collectives "$n"
done
for n in 2 4; do
    check "torch backend: DDP, $n processes, equal to one process and to gloo" train ddp "$n"
    check "torch backend: FSDP2 (fully_shard, 1-D mesh), $n processes, equal to one process and to gloo" train fsdp "$n"
done
check "torch backend: without NODETOUR_JOB_TOKEN, unauthenticated and warned, 2 processes" unauthenticated
check "torch backend: a rank killed mid-training, every survivor raises naming it (3 processes)" killed 3
say "done: $failed failed"
((failed == 0))

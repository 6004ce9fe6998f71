#!/usr/bin/env bash
# run.sh: nodetour's main job: what a user comes for.
#   1. `nodetour doctor`: this machine's GPUDirect readiness, what is missing and how to fix it;
#   2. an allreduce across two ranks through nodetour's Communicator on the best path this
#      machine has, each link's path printed, the bandwidth beside its reference
#      (scripts/allreduce-job.sh):
#      - with GPUs: two processes on them (examples/data_parallel), NCCL as the reference;
#      - else with RDMA devices: two processes over verbs, ib_write_bw as the reference;
#      - else: the same inside a throw-away VM with two soft-RoCE (rdma_rxe) devices.
# Installs what is missing first and builds (release). The tests are scripts/test.sh.
# Env: NODETOUR_SKIP_INSTALL=1; any NODETOUR_* knob (README) is passed through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The scripts name binaries under ./target: build there even where CARGO_TARGET_DIR points elsewhere.
export CARGO_TARGET_DIR="$PWD/target"
[[ ${NODETOUR_SKIP_INSTALL:-0} == 1 ]] || scripts/install-deps.sh
cargo build --release --workspace --bins --examples
echo "== nodetour doctor"
target/release/nodetour doctor || true
if target/release/nodetour gpus >/dev/null 2>&1; then
    scripts/allreduce-job.sh gpu
elif compgen -G '/sys/class/infiniband/*' >/dev/null; then
    mapfile -t devs < <(ls /sys/class/infiniband)
    scripts/allreduce-job.sh verbs "${devs[0]}" "${devs[1]:-${devs[0]}}"
else
    reason=$(scripts/vm/rdma-vm.sh --check) || { echo "run.sh: no GPU, no RDMA device here, and the VM cannot run: $reason"; exit 2; }
    echo "== no GPU and no RDMA device here: the allreduce runs in a VM with two soft-RoCE devices"
    scripts/vm/rdma-vm.sh --nodes 2 --timeout 900 -- bash -c \
        'target/release/nodetour doctor | sed -n "/RDMA devices/,/host memory/p"; scripts/allreduce-job.sh verbs "$NODETOUR_VM_DEV0" "$NODETOUR_VM_DEV1"'
fi

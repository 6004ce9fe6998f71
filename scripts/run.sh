#!/usr/bin/env bash
# run.sh: nodetour's main job today: RDMA WRITEs between two endpoints over real verbs, verified
# end to end, and our write loop measured beside perftest's ib_write_bw.
#   scripts/run.sh          install what is missing, build (release), then
#                           - with RDMA devices on this machine: list them and run the two-node
#                             smoke test over the first one (both ranks here, loopback path);
#                           - without: boot the soft-RoCE VM with two rxe devices and run
#                             `nodetour devices`, two_node_smoke between them, and the
#                             write-bw vs ib_write_bw comparison.
# Env: NODETOUR_SKIP_INSTALL=1; any NODETOUR_* knob (README) is passed through.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The scripts name binaries under ./target: build there even where CARGO_TARGET_DIR points elsewhere.
export CARGO_TARGET_DIR="$PWD/target"
[[ ${NODETOUR_SKIP_INSTALL:-0} == 1 ]] || scripts/install-deps.sh
cargo build --release --bins --examples
if compgen -G '/sys/class/infiniband/*' >/dev/null; then
    target/release/nodetour devices
    target/release/examples/two_node_smoke --rank 0 --addr 127.0.0.1:18517 &
    rank0=$!
    target/release/examples/two_node_smoke --rank 1 --addr 127.0.0.1:18517
    wait "$rank0"
else
    reason=$(scripts/rdma-vm.sh --check) || { echo "run.sh: no RDMA device here and the VM cannot run: $reason"; exit 2; }
    scripts/rdma-vm.sh --nodes 2 -- bash -c 'target/release/nodetour devices && scripts/vm-tier.sh'
fi

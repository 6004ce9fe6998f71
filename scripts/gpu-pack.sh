#!/usr/bin/env bash
# gpu-pack.sh: build everything the GPU tier runs and pack it into DIR (default .device/), for
# machines that have GPUs but no Rust toolchain: copy DIR there and run DIR/gpu-tier.sh.
# The binaries load libcuda, NVRTC and libibverbs at run time, so one build runs everywhere.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The scripts name binaries under ./target: build there even where CARGO_TARGET_DIR points elsewhere.
export CARGO_TARGET_DIR="$PWD/target"
out=${1:-.device}
mkdir -p "$out"
cargo build --release --workspace --bins --examples
cargo build --release -p nodetour-core --example gpu_spike --example teardown_probe
exe=$(cargo test --release -p nodetour-core --test gpu --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp target/release/nodetour target/release/examples/two_node_smoke target/release/examples/gpu_spike target/release/examples/teardown_probe \
    target/release/examples/gpu_transport_check target/release/examples/transport_check \
    target/release/examples/gpu_allreduce target/release/examples/gpu_ring_check \
    target/release/examples/allreduce_check target/release/examples/data_parallel target/release/examples/two_node_allreduce \
    target/release/examples/train_mlp target/release/examples/stream_order_check "$out/"
cp "$exe" "$out/gpu_tests"
exe=$(cargo test --release -p nodetour-ring --test gpu_reduce --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp "$exe" "$out/gpu_reduce_tests"
exe=$(cargo test --release -p nodetour-ring --test communicator_devices --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp "$exe" "$out/communicator_devices_tests"
exe=$(cargo test --release -p nodetour-ring --test communicator_gpu --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp "$exe" "$out/communicator_gpu_tests"
exe=$(cargo test --release -p nodetour-ring --test one_kernel_gpu --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp "$exe" "$out/one_kernel_tests"
exe=$(cargo test --release -p nodetour-ring --test ring_capture_gpu --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp "$exe" "$out/ring_capture_tests"
exe=$(cargo bench --bench allreduce --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
cp "$exe" "$out/bench_allreduce"
cp scripts/tiers/gpu-common.sh scripts/tiers/gpu-tier.sh scripts/tiers/gpu-one-kernel.sh scripts/tiers/gpu-net.sh scripts/drills/gpu-drills.sh scripts/compare/ab-perf.sh scripts/launch-local.sh \
    scripts/compare/onehost-reference.sh scripts/compare/onehost_reference.py "$out/"
git describe --always --dirty >"$out/VERSION" 2>/dev/null || echo unknown >"$out/VERSION"
strip "$out/nodetour" "$out/two_node_smoke" "$out/gpu_spike" "$out/teardown_probe" "$out/gpu_tests" "$out/gpu_reduce_tests" "$out/communicator_devices_tests" "$out/gpu_transport_check" "$out/transport_check" "$out/gpu_allreduce" "$out/gpu_ring_check" "$out/allreduce_check" "$out/bench_allreduce" "$out/data_parallel" "$out/communicator_gpu_tests" "$out/one_kernel_tests" "$out/ring_capture_tests" "$out/two_node_allreduce" "$out/train_mlp" "$out/stream_order_check"
du -sh "$out"

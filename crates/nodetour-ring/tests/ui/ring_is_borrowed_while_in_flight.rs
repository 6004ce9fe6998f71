// While a non-blocking collective is in flight its handle borrows the ring: queueing another
// collective on the same ring before `wait` does not compile.
use std::time::Duration;

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::gpu_ring::GpuRing;
use nodetour_ring::{DataType, ReduceOp};

fn run(ring: &mut GpuRing, a: DeviceBuffer, b: &DeviceBuffer, stream: &GpuStream) {
    let handle = ring
        .start_all_reduce(a, 1024, DataType::F32, ReduceOp::Sum, stream, Duration::from_secs(5))
        .unwrap();
    ring.all_reduce(b, 1024, DataType::F32, ReduceOp::Sum, stream).unwrap();
    let _a = handle.wait().unwrap();
}

fn main() {}

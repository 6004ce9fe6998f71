// A buffer handed to a non-blocking collective belongs to the handle: reading or freeing it
// before `wait` gives it back does not compile.
use std::time::Duration;

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::gpu_ring::GpuRing;
use nodetour_ring::{DataType, ReduceOp};

fn run(ring: &mut GpuRing, buffer: DeviceBuffer, stream: &GpuStream) {
    let handle = ring
        .start_all_reduce(buffer, 1024, DataType::F32, ReduceOp::Sum, stream, Duration::from_secs(5))
        .unwrap();
    let mut host = vec![0u8; 4096];
    buffer.copy_to_host(0, &mut host).unwrap();
    let _buffer = handle.wait().unwrap();
}

fn main() {}

// A buffer handed to a non-blocking collective belongs to the handle: reading or freeing it
// before `wait` gives it back does not compile.
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::Communicator;
use nodetour_ring::{DataType, ReduceOp};

fn run(comm: &Communicator, buffer: DeviceBuffer, stream: &GpuStream, deadline: Deadline) {
    let handle = comm
        .start_all_reduce_device_buffer(buffer, 1024, DataType::F32, ReduceOp::Sum, stream)
        .unwrap();
    let mut host = vec![0u8; 4096];
    buffer.copy_to_host(0, &mut host).unwrap();
    let _buffer = handle.wait(deadline).unwrap();
}

fn main() {}

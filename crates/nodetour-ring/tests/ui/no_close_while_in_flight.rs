// A handle to a collective in flight borrows its communicator: closing (or dropping) the
// communicator before the handle is waited for does not compile.
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::Communicator;
use nodetour_ring::{DataType, ReduceOp};

fn run(comm: Communicator, buffer: DeviceBuffer, stream: &GpuStream, deadline: Deadline) {
    let handle = comm
        .start_all_reduce_device_buffer(buffer, 1024, DataType::F32, ReduceOp::Sum, stream)
        .unwrap();
    comm.close(deadline).unwrap();
    let _buffer = handle.wait(deadline).unwrap();
}

fn main() {}

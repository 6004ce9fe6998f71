// A handle to a collective in flight borrows its communicator: closing (or dropping) the
// communicator before the handle is waited for does not compile.
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use nodetour_core::Deadline;
use nodetour_ring::ReduceOp;
use nodetour_ring::comm::Communicator;

fn run(comm: Communicator, grads: CudaSlice<f32>, stream: &Arc<CudaStream>, deadline: Deadline) {
    let handle = comm
        .start(grads, stream, |c, g, s| c.all_reduce_in_place(g, ReduceOp::Sum, s))
        .unwrap();
    comm.close(deadline).unwrap();
    let _grads = handle.wait(deadline).unwrap();
}

fn main() {}

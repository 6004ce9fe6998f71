// A buffer handed to a non-blocking collective belongs to the handle: reading or freeing it
// before `wait` gives it back does not compile.
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use nodetour_core::Deadline;
use nodetour_ring::ReduceOp;
use nodetour_ring::comm::Communicator;

fn run(comm: &Communicator, grads: CudaSlice<f32>, stream: &Arc<CudaStream>, deadline: Deadline) {
    let handle = comm
        .start(grads, stream, |c, g, s| c.all_reduce_in_place(g, ReduceOp::Sum, s))
        .unwrap();
    let _host = stream.clone_dtoh(&grads).unwrap();
    let _grads = handle.wait(deadline).unwrap();
}

fn main() {}

//! What a training runtime writes: one communicator, its own tensors (cudarc slices on its own
//! stream, or host vectors), nodetour's typed errors. Built by scripts/test.sh (never run
//! there: it needs a job to join).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use nodetour::{Communicator, Deadline, Error, Host, Options, ReduceOp};

/// One bucket of gradients on the runtime's stream.
fn average_bucket(
    comm: &Communicator,
    grads: &mut CudaSlice<bf16>,
    stream: &Arc<CudaStream>,
) -> nodetour::Result<()> {
    comm.all_reduce_in_place(grads, ReduceOp::Avg, stream)
}

fn main() -> Result<(), Error> {
    let comm = Communicator::from_env(Options::from_env()?.with_gpu(0))?;
    println!("{}", comm.paths());
    // cudarc's errors convert (`From<DriverError>`), keeping the CUDA result code.
    let stream = cudarc::driver::CudaContext::new(0)?.new_stream()?;
    let mut grads = stream.alloc_zeros::<bf16>(1 << 20)?;
    average_bucket(&comm, &mut grads, &stream)?;
    // The owning non-blocking form: the handle holds the buffer until the collective is done.
    let pending = comm
        .start(grads, &stream, |c, g, s| c.all_reduce_in_place(g, ReduceOp::Sum, s))?;
    let _grads = pending.wait(Deadline::after(std::time::Duration::from_secs(30)))?;
    let mut host = vec![1.0f32; 1024];
    comm.all_reduce_in_place(&mut host, ReduceOp::Sum, Host)?;
    match comm.all_reduce_in_place(&mut host, ReduceOp::Sum, Host) {
        Err(Error::Disagreement { rank, .. }) => eprintln!("rank {rank} ran another collective"),
        other => other?,
    }
    comm.close(Deadline::after(std::time::Duration::from_secs(30)))
}

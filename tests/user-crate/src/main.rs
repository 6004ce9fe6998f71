//! What a training runtime writes: one communicator, its own tensors (cudarc slices on its own
//! stream, or host vectors), nodetour's typed errors. Built by scripts/test.sh (never run
//! there: it needs a job to join).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use nodetour::{Communicator, Deadline, Error, Options, ReduceOp};

/// One bucket of gradients on the runtime's stream.
fn average_bucket(
    comm: &Communicator,
    grads: &mut CudaSlice<bf16>,
    stream: &Arc<CudaStream>,
) -> nodetour::Result<()> {
    comm.all_reduce_device_in_place(grads, ReduceOp::Avg, stream)
}

fn main() -> Result<(), Error> {
    let mut options = Options::from_env()?;
    options.gpu = Some(0);
    let comm = Communicator::from_env(options)?;
    println!("{}", comm.paths());
    let ctx = cudarc::driver::CudaContext::new(0).map_err(|e| Error::Gpu {
        reason: format!("{e:?}"),
    })?;
    let stream = ctx.new_stream().map_err(|e| Error::Gpu {
        reason: format!("{e:?}"),
    })?;
    let mut grads = stream.alloc_zeros::<bf16>(1 << 20).map_err(|e| Error::Gpu {
        reason: format!("{e:?}"),
    })?;
    average_bucket(&comm, &mut grads, &stream)?;
    let mut host = vec![1.0f32; 1024];
    comm.all_reduce_in_place(&mut host, ReduceOp::Sum)?;
    comm.close(Deadline::after(std::time::Duration::from_secs(30)))
}

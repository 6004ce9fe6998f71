//! # nodetour
//!
//! Moves gradients from the network straight into GPU memory, and says which path it took and
//! why. A training runtime holds one [`Communicator`]; in the order it works:
//!
//! 1. **Form** it on every rank: [`Communicator::from_env`] (torchrun, Slurm, Open MPI or
//!    `NODETOUR_*`), or [`Communicator::from_unique_id`] with an id passed through the
//!    runtime's own store. [`Options::from_env`] reads every `NODETOUR_*` setting.
//! 2. **Read the paths**: [`Communicator::paths`], per link the transport, where the bytes land
//!    and why that link was chosen.
//! 3. **Run collectives**, one verb each ([`Communicator::all_reduce`], `reduce_scatter`,
//!    `all_gather`, `broadcast`, and their `_in_place` forms), on device memory queued on the
//!    caller's stream (cudarc slices and views; [`Elements`] for a type known at run time) or
//!    on host slices ([`Host`]), typed by their element ([`Element`]: `f32`, `f64`,
//!    `half::f16`, `half::bf16`, `i32`, `i64`, `u8`).
//! 4. **Handle errors**: one typed [`Error`] naming the rank at fault.
//! 5. **Abort** from another thread ([`Communicator::abort_handle`]) and **close**.
//!
//! ```no_run
//! use nodetour::{Communicator, Deadline, Error, Options, ReduceOp};
//! use nodetour::cudarc::driver::CudaContext;
//!
//! fn main() -> Result<(), Box<dyn std::error::Error>> {
//!     let comm = Communicator::from_env(Options::from_env()?.with_gpu(0))?;
//!     println!("{}", comm.paths());
//!     let stream = CudaContext::new(0)?.new_stream()?;
//!     let mut grads = stream.alloc_zeros::<f32>(25 << 18)?; // a 25 MiB bucket
//!     match comm.all_reduce_in_place(&mut grads, ReduceOp::Avg, &stream) {
//!         Ok(()) => {}
//!         Err(Error::PeerLost { rank }) => eprintln!("rank {rank} is gone"),
//!         Err(e) => return Err(e.into()),
//!     }
//!     comm.wait(Deadline::after(std::time::Duration::from_secs(30)))?;
//!     comm.close(Deadline::after(std::time::Duration::from_secs(30)))?;
//!     Ok(())
//! }
//! ```
//!
//! The lower layers stay reachable for tools and tests: [`core`] (verbs, CUDA, memory,
//! transports, bootstrap) and [`ring`] (the pure schedule and its executors). The `nodetour`
//! command (doctor, perf, write-bw) lives in the unpublished `nodetour-tools` package.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use cudarc;
/// The fp8 element types (`F8E4M3`, `F8E5M2`), as nodetour and cudarc's `f8` feature see them.
pub use float8;
/// The 16-bit float element types (`f16`, `bf16`).
pub use half;
pub use nodetour_core as core;
pub use nodetour_core::{Config, Deadline};
pub use nodetour_net as net;
pub use nodetour_ring as ring;
pub use nodetour_ring::comm::{
    AbortHandle, Communicator, Elements, Failed, Group, Host, HostBytes, InFlight, Input, Options,
    Output, Paths, Queue, UniqueId,
};
pub use nodetour_ring::{DataType, Element, Error, ReduceOp, Result, Scalar};

/// Every Rust block of the README compiles (and the runnable ones run) as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

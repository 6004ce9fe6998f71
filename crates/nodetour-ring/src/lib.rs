//! # nodetour-ring
//!
//! Ring collectives for nodetour. This crate starts with the part everything else hangs on:
//! the ring schedule as a pure state machine ([`schedule`]): no I/O, no clocks, no CUDA inside.
//! Inputs arrive through `handle_*` methods (a grant from the next rank, a write landed from the
//! previous one, a local completion, time passing, a lost peer); outputs come out of
//! [`schedule::RingSchedule::poll_action`] (send this chunk into that slot, reduce or copy that
//! chunk, grant a slot, done, failed). Executors (host buffers, GPU direct, staged) drive it
//! over a transport. [`plan`] lays a buffer out in segments and chunks.
//!
//! GPU collectives: the GPUs of one process ([`comm::Communicator::from_devices`]) are ringed
//! by a private group in which each GPU reads its neighbour over NVLink/PCIe peer access;
//! a private GPU ring joins processes of one host,
//! one GPU each, over cuda-ipc (direct) or shared host memory (staged), queued on CUDA streams
//! from the pure program of [`stream_plan`].
//!
//! The schedule is tested by a simulated ring with fault injection (random interleavings,
//! reordered completions, lost peers, stale epochs, forged immediates) in `tests/`.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub(crate) mod call;
pub mod cause;
pub mod comm;
#[cfg(test)]
mod cpu_streams;
pub mod descriptor;
pub mod element;
pub mod error;
pub(crate) mod flag;
#[doc(hidden)]
pub mod fuzzing;
pub(crate) mod gpu;
pub(crate) mod gpu_ring;
pub(crate) mod host;
#[cfg(test)]
mod local;
pub mod net_link;
#[cfg(test)]
mod net_ring_tests;
pub mod order;
pub(crate) mod p2p;
pub mod plan;
pub mod progress;
pub mod reduce;
pub mod schedule;
pub mod seeded;
pub mod stream_plan;

pub use cause::{CauseKind, RootCause};
pub use element::Element;
pub use error::{Error, Result};
pub use plan::Plan;
pub use reduce::{DataType, ReduceOp, Scalar};
pub use schedule::{Action, Immediate, RingSchedule};

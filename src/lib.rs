//! # nodetour
//!
//! Moves gradients from the network straight into GPU memory. This facade re-exports the
//! library crates and holds what the `nodetour` command and the examples share.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use nodetour_core as core;
pub use nodetour_core::{Config, Deadline, Error, Result};
pub use nodetour_ring as ring;
pub use nodetour_ring::{DataType, Element, ReduceOp};

pub mod blob;
pub mod ceiling;
pub mod doctor;
pub mod gpu_job;
pub mod link;
pub mod logging;
pub mod perf;
pub mod perf_gpu;
pub mod plot;
pub mod ring_job;
pub mod write_bw;
pub mod write_lat;

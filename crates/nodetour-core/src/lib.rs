//! # nodetour-core
//!
//! The core of nodetour: RDMA verbs loaded at run time, memory registration, reliable-connected
//! queue pairs and one-sided RDMA WRITE / WRITE_WITH_IMM, with an out-of-band exchange to
//! connect two processes. It is the only nodetour crate with `unsafe`; every `unsafe` block
//! carries a `// SAFETY:` comment.
//!
//! A program that links it starts on machines without libibverbs: the library is loaded on
//! first use, and its absence is an [`Error::Unsupported`] with the reason.
//!
//! ```no_run
//! use std::sync::Arc;
//! use nodetour_core::{Config, Deadline};
//! use nodetour_core::memory::HostBuffer;
//! use nodetour_core::verbs::{Access, Context, MemoryRegion, Near, PathOptions, ProtectionDomain,
//!                            QueuePair, QueuePairOptions};
//!
//! # fn main() -> nodetour_core::Result<()> {
//! let config = Config::from_env()?;
//! let (context, _why) = Context::open_chosen(&config, Near::Host)?;
//! let port = context.first_active_port()?;
//! let gid = context.choose_gid(&port, config.gid_index)?;
//! let pd = ProtectionDomain::new(&context)?;
//! let region = Arc::new(MemoryRegion::register(&pd, HostBuffer::new(1 << 20)?, Access::REMOTE)?);
//! let qp = QueuePair::new(&pd, port.port, QueuePairOptions::default())?;
//! // ... exchange qp.endpoint(&gid) and region.remote() with the peer (see `oob`) ...
//! # let (peer, peer_region) = (qp.endpoint(&gid), region.remote());
//! qp.connect(&peer, &PathOptions::new(port.port, &gid, &config))?;
//! qp.post_write(&region, 0..4096, &peer_region, 0, Some(7), true)?;
//! let mut done = Vec::new();
//! qp.wait(&mut done, Deadline::after(config.timeout))?;
//! # Ok(()) }
//! ```
#![warn(missing_docs)]
// Every unsafe block states why it is sound; the lint keeps it so.
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod auth;
pub mod config;
pub mod cuda;
pub mod deadline;
pub mod dtype;
pub mod error;
pub mod gdr;
pub mod knobs;
pub mod meeting;
pub mod memlock;
pub mod memory;
pub mod net;
pub mod notice;
pub mod probe;
pub mod random;
pub mod transport;
pub mod verbs;

/// The registration ladder ([`gdr::registration`], where it was before GPUDirect got its room).
pub use gdr::registration;
/// Visibility of landed chunks ([`gdr::visibility`], where it was before).
pub use gdr::visibility;

pub use config::Config;
pub use deadline::Deadline;
pub use error::{Error, Result};

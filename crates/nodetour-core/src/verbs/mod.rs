//! ibverbs, loaded at run time, in three layers: [`library`] resolves the C functions,
//! `result` turns each call into a `Result`, and the modules below own the handles.
//!
//! The order a user works in: list [`devices`] (or let [`Context::open_chosen`] pick one),
//! open a [`Context`], allocate a [`ProtectionDomain`], register memory as a
//! [`MemoryRegion`], create a [`QueuePair`], exchange [`EndpointDescription`]s with the peer
//! (the tools' out-of-band channel, `nodetour_tools::oob`, is one way), [`QueuePair::connect`], then post writes and poll completions.
//! Dropping tears down in the safe order on its own.

/// Asynchronous device events (defined beside the error that carries them).
pub use crate::error::async_event;
pub mod completion;
pub mod context;
mod cq;
pub use cq::{DEFAULT_SPIN, set_spin};
pub mod device;
pub mod endpoint;
pub mod gid;
pub mod inject;
pub mod library;
mod local_side;
pub mod mr;
pub mod pd;
pub mod port;
pub mod qp;
pub mod qp_state;
mod result;
pub mod sysfs;

pub use async_event::AsyncEvent;
pub use completion::Completion;
pub use context::Context;
pub use device::{DeviceChoice, DeviceInfo, Near, devices};
pub use endpoint::{Endpoint, EndpointDescription};
pub use gid::{GidChoice, LinkLayer};
pub use local_side::LocalSide;
pub use mr::{Access, MemoryRegion, RelaxedOrdering, RemoteRegion};
pub use pd::{DmabufSupport, ProtectionDomain};
pub use port::{DeviceAttributes, Mtu, PortAttributes, PortState};
pub use qp::{PathOptions, QueuePair, QueuePairOptions};
pub use qp_state::QpState;

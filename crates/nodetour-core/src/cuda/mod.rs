//! CUDA, loaded at run time through cudarc's dynamic loading: what nodetour needs of the driver
//! beyond cudarc's safe layer (GPUDirect attributes, dma-buf export, host registration, flushes),
//! as a thin result layer ([`result`]) and probes ([`driver`]).
//!
//! Nothing here links libcuda: [`driver::availability`] checks that the library loads and a GPU
//! answers before any other call, and turns absence into [`crate::Error::Unsupported`]. Entry
//! points newer than CUDA 11.0 are resolved with `cuGetProcAddress`, so an old driver is a typed
//! error, not a panic.

pub(crate) mod copy;
pub mod driver;
pub mod kernel_cache;
pub mod nvrtc;
pub mod reduce;
pub(crate) mod result;
pub mod stream;

pub use driver::{GdrAttributes, GpuInfo, availability, flush_rdma_writes, gpus};
pub use stream::{GpuEvent, GpuStream, can_access_peer, enable_peer_access, reap_releases};

//! CUDA, loaded at run time through cudarc's dynamic loading: what nodetour needs of the driver
//! beyond cudarc's safe layer (GPUDirect attributes, dma-buf export, host registration, flushes),
//! as a thin result layer (`result`, private) and probes ([`driver`]).
//!
//! Nothing here links libcuda: [`driver::availability`] checks that the library loads and a GPU
//! answers before any other call, and turns absence into [`crate::Error::Unsupported`]. Entry
//! points newer than CUDA 11.0 are resolved with `cuGetProcAddress`, so an old driver is a typed
//! error, not a panic.

pub mod busy;
pub(crate) mod copy;
pub mod device_buffer;
pub mod driver;
pub mod kernel_cache;
pub(crate) mod libs;
pub mod nvrtc;
pub mod one_kernel;
pub mod reduce;
pub(crate) mod result;
pub mod stream;
pub mod stream_buffer;

pub use driver::{GdrAttributes, GpuInfo, availability, flush_rdma_writes, gpus, open_context};
pub use libs::nccl_loadable;
pub use stream::{GpuEvent, GpuStream, can_access_peer, enable_peer_access, reap_releases};
pub use stream_buffer::StreamOrderedBuffer;

/// Whether two handles name the same CUDA context: the same `Arc`, or two `Arc`s of one
/// context (`CudaContext::new(ordinal)` wraps the GPU's primary context anew on every call, so
/// a runtime's handle and nodetour's for the same GPU are different `Arc`s of one context).
pub fn same_context(
    a: &std::sync::Arc<cudarc::driver::CudaContext>,
    b: &std::sync::Arc<cudarc::driver::CudaContext>,
) -> bool {
    std::sync::Arc::ptr_eq(a, b) || a.cu_ctx() == b.cu_ctx()
}

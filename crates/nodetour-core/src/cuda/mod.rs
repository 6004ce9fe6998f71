//! CUDA, loaded at run time through cudarc's dynamic loading: what nodetour needs of the driver
//! beyond cudarc's safe layer (GPUDirect attributes, dma-buf export, host registration, flushes),
//! as a thin result layer (`result`, private) and probes ([`driver`]).
//!
//! Nothing here links libcuda: [`driver::availability`] checks that the library loads and a GPU
//! answers before any other call, and turns absence into [`crate::Error::Unsupported`]. Entry
//! points newer than CUDA 11.0 are resolved with `cuGetProcAddress`, so an old driver is a typed
//! error, not a panic.
//!
//! # Raw handles: the contracts in one place
//!
//! Runtimes that hold their memory and streams as raw CUDA handles lend them through four
//! `unsafe` constructors. Each checks what the driver can check and states the rest here:
//!
//! | constructor | checked by nodetour | the caller promises |
//! |---|---|---|
//! | [`device_buffer::DeviceBuffer::borrowed`]`(ctx, ptr, len)` | nothing (the fast path) | `[ptr, ptr+len)` is live device memory of `ctx` |
//! | [`device_buffer::DeviceBuffer::from_raw`]`(ptr, len)` | device memory; its GPU; the GPU's primary context; `[ptr, ptr+len)` inside one allocation | the allocation stays live |
//! | [`GpuStream::borrowed`]`(ctx, raw)` | the stream's context is `ctx` | the handle stays valid |
//! | [`GpuStream::from_raw`]`(raw)` | the stream's context, its GPU, that it is the primary context | the handle stays valid |
//!
//! For every one: the memory stays allocated, and the stream undestroyed, while the value (or
//! anything that noted it: a buffer that queued work on the stream, a communicator) lives
//! **and** until every piece of work queued through it has run; free memory only in the order
//! of the streams that work was queued on. Memory from cudarc's `upgrade_device_ptr` (whose
//! owner frees on drop) is not a borrowed view.
//!
//! A communicator's device collectives run on a stream of its own, joined from and back to
//! the caller's stream on the calling thread: a stream handle (the per-thread default stream
//! included) is used only during the call that passed it, on that thread. A GPU's peers read
//! its memory on one host: through the one-kernel path's and the ring's own exported slots
//! (never the caller's memory) across processes; **directly** in one process
//! (`Communicator::from_devices`), where a GPU reads and writes its ring neighbours' buffers.
//! There, memory from `cuMemAlloc` (nodetour's [`device_buffer::DeviceBuffer::new`], views of
//! such memory) is reached through peer access, and memory from each GPU's *current memory
//! pool* (`cuMemAllocAsync`: cudarc's allocations) through the pool access `from_devices`
//! grants ([`enable_pool_access`]); memory from any other pool of the caller's needs the
//! caller's own `cuMemPoolSetAccess` for the neighbour GPUs, else the first collective
//! faults.

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
pub use stream::{
    GpuEvent, GpuStream, can_access_peer, enable_peer_access, enable_pool_access, reap_releases,
};
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

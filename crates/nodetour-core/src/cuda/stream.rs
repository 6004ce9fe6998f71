//! CUDA streams and events as owning types, the stream memory operations the in-host transports
//! queue their notifications with, and peer access between GPUs.

use std::sync::Arc;

use cudarc::driver::result::{self, stream::StreamKind};
use cudarc::driver::{CudaContext, sys};

use super::result::cuda_error;
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;

/// A non-blocking CUDA stream on one GPU. Dropping it waits for its work, then destroys it.
pub struct GpuStream {
    raw: sys::CUstream,
    context: Arc<CudaContext>,
}

// SAFETY: a CUstream may be used from any thread that binds its context (every method does).
unsafe impl Send for GpuStream {}
// SAFETY: as above.
unsafe impl Sync for GpuStream {}

impl GpuStream {
    /// Creates a stream on `context`'s GPU.
    pub fn new(context: &Arc<CudaContext>) -> Result<GpuStream> {
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        let raw = result::stream::create(StreamKind::NonBlocking)
            .map_err(|e| cuda_error("cuStreamCreate", e))?;
        Ok(GpuStream {
            raw,
            context: context.clone(),
        })
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    pub(crate) fn bind(&self) -> Result<sys::CUstream> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        Ok(self.raw)
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`; the
    /// buffers may be on different GPUs (unified addressing; peer access makes it direct).
    pub fn copy(
        &self,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        dst.check("GPU copy", dst_offset, len)?;
        src.check("GPU copy", src_offset, len)?;
        let s = self.bind()?;
        // SAFETY: both ranges are inside live allocations (checked); DeviceBuffer's Drop waits for
        // the GPU before freeing, so queued work never outlives them.
        unsafe {
            sys::cuMemcpyAsync(
                dst.device_ptr() + dst_offset as u64,
                src.device_ptr() + src_offset as u64,
                len,
                s,
            )
        }
        .result()
        .map_err(|e| cuda_error("cuMemcpyAsync", e))
    }

    /// Waits until everything queued so far has run.
    pub fn synchronize(&self) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(s) }.map_err(|e| cuda_error("cuStreamSynchronize", e))
    }

    /// Records a timing event at this point of the stream.
    pub fn record(&self) -> Result<GpuEvent> {
        let s = self.bind()?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
            .map_err(|e| cuda_error("cuEventCreate", e))?;
        // SAFETY: live event and stream of the current context.
        unsafe { result::event::record(raw, s) }.map_err(|e| cuda_error("cuEventRecord", e))?;
        Ok(GpuEvent {
            raw,
            context: self.context.clone(),
        })
    }

    /// Whether the stream is being captured into a CUDA graph right now.
    pub fn is_capturing(&self) -> Result<bool> {
        let s = self.bind()?;
        // SAFETY: a live stream.
        let status = unsafe { result::stream::is_capturing(s) }
            .map_err(|e| cuda_error("cuStreamIsCapturing", e))?;
        Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    /// Records `marker` at this point of the stream (re-recording moves it here; waits queued
    /// earlier keep the point they captured).
    pub fn record_marker(&self, marker: &GpuEvent) -> Result<()> {
        if !Arc::ptr_eq(&marker.context, &self.context) {
            return Err(Error::InvalidArgument {
                reason: "a marker is recorded on a stream of the GPU it was made for".into(),
            });
        }
        let s = self.bind()?;
        // SAFETY: live event and stream of the same (current) context.
        unsafe { result::event::record(marker.raw, s) }.map_err(|e| cuda_error("cuEventRecord", e))
    }

    /// Queues a wait: work queued on this stream afterwards starts only after the point where
    /// `marker` was last recorded (on a stream of any GPU) has run.
    pub fn wait_marker(&self, marker: &GpuEvent) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: live stream and event; cross-context waits are allowed by the driver.
        unsafe {
            result::stream::wait_event(
                s,
                marker.raw,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| cuda_error("cuStreamWaitEvent", e))
    }

    /// Queues a 32-bit write of `value` to `address` (device-accessible memory: pinned host
    /// memory or GPU memory), after all earlier work of the stream and with a memory barrier:
    /// whoever sees the value sees the stream's earlier writes.
    pub(crate) fn write_value(&self, address: u64, value: u32) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: the caller passes a device-accessible address that outlives the queued work;
        // flags 0 = with a memory barrier.
        unsafe { sys::cuStreamWriteValue32_v2(s, address, value, 0) }
            .result()
            .map_err(|e| cuda_error("cuStreamWriteValue32", e))
    }

    /// Queues a wait until the 32-bit word at `address` is ≥ `value` (wrapping comparison not
    /// used: values only grow).
    pub(crate) fn wait_value(&self, address: u64, value: u32) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: as above; flags 0 = CU_STREAM_WAIT_VALUE_GEQ.
        unsafe { sys::cuStreamWaitValue32_v2(s, address, value, 0) }
            .result()
            .map_err(|e| cuda_error("cuStreamWaitValue32", e))
    }

    /// Queues a wait until the 32-bit word at `address` equals `value`.
    pub(crate) fn wait_value_eq(&self, address: u64, value: u32) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: as above; flags 1 = CU_STREAM_WAIT_VALUE_EQ.
        unsafe { sys::cuStreamWaitValue32_v2(s, address, value, 1) }
            .result()
            .map_err(|e| cuda_error("cuStreamWaitValue32", e))
    }
}

impl Drop for GpuStream {
    fn drop(&mut self) {
        // Failure policy: log; the context is being torn down anyway.
        if let Ok(s) = self.bind() {
            // SAFETY: a live stream; synchronised so nothing queued outlives the objects it uses.
            unsafe {
                let _ = result::stream::synchronize(s);
                let _ = result::stream::destroy(s);
            }
        }
    }
}

/// A point recorded on a stream, for timing.
pub struct GpuEvent {
    raw: sys::CUevent,
    context: Arc<CudaContext>,
}

// SAFETY: events are usable from any thread that binds their context.
unsafe impl Send for GpuEvent {}

impl GpuEvent {
    /// Creates an ordering marker of `context`'s GPU: an event without timing, recorded on one
    /// of its streams with [`GpuStream::record_marker`] and waited on by streams of any GPU
    /// with [`GpuStream::wait_marker`].
    pub fn marker(context: &Arc<CudaContext>) -> Result<GpuEvent> {
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        let raw = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_error("cuEventCreate", e))?;
        Ok(GpuEvent {
            raw,
            context: context.clone(),
        })
    }

    /// Whether the work before the point where this event was last recorded has finished
    /// (`cuEventQuery`; an event never recorded counts as finished). Never blocks.
    pub fn is_complete(&self) -> Result<bool> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: a live event of the bound context.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(cuda_error("cuEventQuery", result::DriverError(e))),
        }
    }

    /// Milliseconds from this event to `later` (both completed: synchronises on `later`).
    pub fn elapsed_ms(&self, later: &GpuEvent) -> Result<f32> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: both events are live and recorded.
        unsafe {
            result::event::synchronize(later.raw)
                .map_err(|e| cuda_error("cuEventSynchronize", e))?;
            result::event::elapsed(self.raw, later.raw)
                .map_err(|e| cuda_error("cuEventElapsedTime", e))
        }
    }
}

impl Drop for GpuEvent {
    fn drop(&mut self) {
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: a live event; destruction of a pending event is deferred by the driver.
            let _ = unsafe { result::event::destroy(self.raw) };
        }
    }
}

/// Whether `from`'s GPU can read and write `to`'s memory directly (NVLink or PCIe
/// peer-to-peer), without enabling anything.
pub fn can_access_peer(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<bool> {
    let mut can = 0;
    // SAFETY: valid out-pointer and device handles.
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, from.cu_device(), to.cu_device()) }
        .result()
        .map_err(|e| cuda_error("cuDeviceCanAccessPeer", e))?;
    Ok(can != 0)
}

/// Lets `from`'s GPU access `to`'s memory directly (NVLink or PCIe peer-to-peer). Returns
/// whether the hardware allows it; enabling twice is fine.
pub fn enable_peer_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<bool> {
    if !can_access_peer(from, to)? {
        return Ok(false);
    }
    from.bind_to_thread()
        .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
    // SAFETY: `to`'s context is live.
    match unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(true)
        }
        e => Err(cuda_error(
            "cuCtxEnablePeerAccess",
            cudarc::driver::DriverError(e),
        )),
    }
}

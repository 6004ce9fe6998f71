//! CUDA streams and events as owning types, the stream memory operations the in-host transports
//! queue their notifications with, and peer access between GPUs.

use std::sync::Arc;

use cudarc::driver::result::{self, stream::StreamKind};
use cudarc::driver::{CudaContext, sys};

use super::device_buffer::DeviceBuffer;
use super::result::cuda_error;
use crate::error::{Error, Result};

/// A non-blocking CUDA stream on one GPU.
///
/// Dropping it never waits: the driver destroys a stream once its queued work has run
/// (`cuStreamDestroy` returns at once). GPU memory that its work used stays allocated until
/// then: every [`DeviceBuffer`] notes the streams that queue work on it and frees itself in
/// stream order after them (see [`DeviceBuffer`]'s `Drop`). Clones share the one stream, which
/// goes with the last of them.
#[derive(Clone)]
pub struct GpuStream {
    inner: Arc<RawStream>,
}

/// The stream handle itself, shared by the [`GpuStream`] and the buffers its work used (they
/// order their frees after it), destroyed when the last of them lets go.
pub(crate) struct RawStream {
    raw: sys::CUstream,
    context: Arc<CudaContext>,
    /// cudarc's view of the stream, which kernels are launched on (its launch builder): the
    /// caller's own cudarc stream (kept alive while anything refers to it), else a wrapper
    /// that never destroys the handle ([`wrap`]).
    launch_on: Arc<cudarc::driver::CudaStream>,
    /// A stream of the caller's (cudarc's, or a raw handle, [`GpuStream::borrowed`]): never
    /// destroyed here.
    borrowed: bool,
}

impl RawStream {
    /// A new non-blocking stream of `context`, destroyed with this value.
    fn create(context: &Arc<CudaContext>) -> Result<RawStream> {
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        let raw = result::stream::create(StreamKind::NonBlocking)
            .map_err(|e| cuda_error("cuStreamCreate", e))?;
        Ok(RawStream {
            raw,
            context: context.clone(),
            // SAFETY: the stream just created, destroyed only by this value's Drop.
            launch_on: unsafe { wrap(context, raw) },
            borrowed: false,
        })
    }
}

/// cudarc's non-owning view of `raw`, a stream of `context` held by a [`RawStream`] (dropped
/// with it, before or as the handle is destroyed: the wrapper never destroys it).
///
/// # Safety
///
/// `raw` is a live stream of `context` that outlives the returned wrapper (it lives in the
/// same [`RawStream`] and is handed out only as a borrow of it).
unsafe fn wrap(context: &Arc<CudaContext>, raw: sys::CUstream) -> Arc<cudarc::driver::CudaStream> {
    // SAFETY: forwarded contract; nodetour orders its own work on the stream.
    unsafe { context.wrap_borrowed_stream(raw) }
}

// SAFETY: a CUstream may be used from any thread that binds its context (every method does).
unsafe impl Send for RawStream {}
// SAFETY: as above.
unsafe impl Sync for RawStream {}

impl Drop for RawStream {
    fn drop(&mut self) {
        if self.borrowed {
            return; // the caller's stream: its owner destroys it
        }
        // Failure policy: log nothing; the context is being torn down anyway.
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: a live stream that nothing will queue on again (no owner is left).
            // cuStreamDestroy returns at once; the driver releases the stream after its work
            // (measured: it never waits for other streams either, see examples/teardown_probe).
            let _ = unsafe { result::stream::destroy(self.raw) };
        }
    }
}

/// The legacy default stream's handle (`CU_STREAM_LEGACY`), for [`GpuStream::borrowed`].
pub const CU_STREAM_LEGACY: sys::CUstream = 0x1 as sys::CUstream;
/// The per-thread default stream's handle (`CU_STREAM_PER_THREAD`), for [`GpuStream::borrowed`].
pub const CU_STREAM_PER_THREAD: sys::CUstream = 0x2 as sys::CUstream;

/// The streams that have queued work on something (a buffer, a mapping): what its release must
/// come after. Noting is a lock and a pointer comparison per call (no CUDA call).
#[derive(Default)]
pub(crate) struct Uses {
    streams: std::sync::Mutex<Vec<Arc<RawStream>>>,
    // The stream noted last (its address while noted; 0 after `take`): noting it again is one
    // atomic load, no lock.
    last: std::sync::atomic::AtomicUsize,
}

impl Uses {
    /// Notes that `stream` queues work on the owner (once per stream).
    pub(crate) fn note(&self, stream: &GpuStream) {
        use std::sync::atomic::Ordering;
        let key = Arc::as_ptr(&stream.inner) as usize;
        if self.last.load(Ordering::Acquire) == key {
            return; // noted, and held in `streams` (so the address cannot have been reused)
        }
        let mut v = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        if !v.iter().any(|s| Arc::ptr_eq(s, &stream.inner)) {
            v.push(stream.inner.clone());
        }
        self.last.store(key, Ordering::Release);
    }

    /// The streams noted so far (and forgets them).
    pub(crate) fn take(&self) -> Vec<Arc<RawStream>> {
        let mut v = self.streams.lock().unwrap_or_else(|p| p.into_inner());
        self.last.store(0, std::sync::atomic::Ordering::Release);
        std::mem::take(&mut *v)
    }

    /// Waits until the work queued so far on the noted streams has run, at most until
    /// `deadline` (spinning briefly, then napping); whether it has. Waits for nothing else.
    pub(crate) fn wait_until(
        &self,
        context: &Arc<CudaContext>,
        deadline: std::time::Instant,
    ) -> bool {
        wait_for_streams(context, &self.take(), deadline)
    }
}

/// Waits until the work queued so far on `streams` has run, at most until `deadline` (spinning
/// briefly, then napping); whether it has. Waits for nothing else.
pub(crate) fn wait_for_streams(
    context: &Arc<CudaContext>,
    streams: &[Arc<RawStream>],
    deadline: std::time::Instant,
) -> bool {
    let mut marks = Vec::with_capacity(streams.len());
    for s in streams {
        let Ok(m) = GpuEvent::marker(context) else {
            return false;
        };
        // SAFETY: live event and stream (held through its Arc).
        if unsafe { result::event::record(m.raw, s.raw) }.is_err() {
            return false;
        }
        marks.push(m);
    }
    let mut nap = std::time::Duration::from_micros(10);
    loop {
        match marks
            .iter()
            .try_fold(true, |all, m| m.is_complete().map(|c| all && c))
        {
            Ok(true) => return true,
            Ok(false) if std::time::Instant::now() < deadline => {}
            _ => return false,
        }
        std::thread::sleep(nap);
        nap = (nap * 2).min(std::time::Duration::from_millis(1));
    }
}

/// Queues `release` on a fresh stream of `context` after the work queued so far on each of
/// `streams`, without waiting for that work: the stream-ordered way to free what it used. The
/// fresh stream waits on an event recorded on each of them (their later work is not held up).
///
/// The driver hands a stream-ordered free back to the allocator only when the host
/// synchronises the freeing stream (measured by `examples/teardown_probe`: a query does not
/// do it). So the fresh stream is synchronised here if its work runs at once (the usual case:
/// the owner's streams have drained), else kept pending and synchronised once idle by a later
/// [`reap_releases`] (every allocation and release calls it): neither waits for anything but
/// the released thing's own work.
pub(crate) fn queue_release_after(
    context: &Arc<CudaContext>,
    streams: &[Arc<RawStream>],
    release: impl FnOnce(sys::CUstream) -> std::result::Result<(), result::DriverError>,
) -> Result<()> {
    reap_releases();
    let t = RawStream::create(context)?;
    for s in streams {
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| cuda_error("cuEventCreate", e))?;
        // SAFETY: live event and streams (each held through its Arc); the event is destroyed
        // after the wait captured it (the driver defers destroying a pending event).
        let r = unsafe {
            result::event::record(ev, s.raw).and_then(|()| {
                result::stream::wait_event(
                    t.raw,
                    ev,
                    sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )
            })
        };
        // SAFETY: a live event, not used again.
        let _ = unsafe { result::event::destroy(ev) };
        r.map_err(|e| cuda_error("cuEventRecord/cuStreamWaitEvent", e))?;
    }
    release(t.raw).map_err(|e| cuda_error("stream-ordered release", e))?;
    // Give the release a moment to run (it usually depends on nothing still running).
    let spin_until = std::time::Instant::now() + std::time::Duration::from_micros(500);
    loop {
        if finish_if_idle(&t) {
            return Ok(());
        }
        if std::time::Instant::now() >= spin_until {
            break;
        }
        std::thread::yield_now();
    }
    PENDING.lock().unwrap_or_else(|p| p.into_inner()).push(t);
    Ok(())
}

/// Release streams whose work has not run yet (see [`queue_release_after`]).
static PENDING: std::sync::Mutex<Vec<RawStream>> = std::sync::Mutex::new(Vec::new());

/// If `t`'s work has run, synchronises it (returns at once; hands stream-ordered frees back to
/// the allocator) and says so. Never waits for unfinished work.
fn finish_if_idle(t: &RawStream) -> bool {
    if t.context.bind_to_thread().is_err() {
        return false;
    }
    // SAFETY: a live stream.
    match unsafe { super::result::stream_idle(t.raw) } {
        Ok(true) => {
            // SAFETY: a live, idle stream: this returns at once.
            let _ = unsafe { result::stream::synchronize(t.raw) };
            true
        }
        Ok(false) => false,
        // A broken context: nothing more will run on it; let the stream go.
        Err(_) => true,
    }
}

/// Completes the stream-ordered releases (GPU memory of dropped buffers) whose work has run
/// since they were queued, without waiting for any that has not. Every allocation and release
/// of this crate calls it; call it to get such memory back sooner.
pub fn reap_releases() {
    let mut pending = PENDING.lock().unwrap_or_else(|p| p.into_inner());
    pending.retain(|t| !finish_if_idle(t));
}

impl GpuStream {
    /// Creates a stream on `context`'s GPU.
    pub fn new(context: &Arc<CudaContext>) -> Result<GpuStream> {
        Ok(GpuStream {
            inner: Arc::new(RawStream::create(context)?),
        })
    }

    /// The caller's cudarc stream, for queueing nodetour's work on it: work queued through
    /// the returned value runs in that stream's order. The cudarc stream is kept alive while
    /// anything of nodetour refers to it (a buffer that noted it for its free) and is never
    /// destroyed here. The legacy and per-thread default streams are accepted (cudarc's
    /// `CudaContext::default_stream`).
    pub fn of_cudarc(stream: &Arc<cudarc::driver::CudaStream>) -> GpuStream {
        GpuStream {
            inner: Arc::new(RawStream {
                raw: stream.cu_stream(),
                context: stream.context().clone(),
                launch_on: stream.clone(),
                borrowed: true,
            }),
        }
    }

    /// A raw stream handle of the caller's, for runtimes that do not use cudarc: a `CUstream`
    /// of `context`, or [`CU_STREAM_LEGACY`] / [`CU_STREAM_PER_THREAD`] (the default streams,
    /// always valid). The handle's context is checked (`cuStreamGetCtx`): a stream of another
    /// context is `InvalidArgument`. Never destroyed here.
    ///
    /// # Safety
    ///
    /// `raw` must be a stream handle that stays valid (not destroyed) for as long as the
    /// returned value or anything that noted it lives: the device buffers and communicators
    /// that queued work on it (drop or close them first). The default-stream handles always
    /// are.
    pub unsafe fn borrowed(context: &Arc<CudaContext>, raw: sys::CUstream) -> Result<GpuStream> {
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: `raw` is a valid stream handle or a default-stream handle (the caller's
        // contract).
        let ctx = unsafe { super::result::stream_context(raw) }?;
        if ctx != context.cu_ctx() {
            return Err(Error::InvalidArgument {
                reason: "the stream belongs to another CUDA context than the GPU given".into(),
            });
        }
        Ok(GpuStream {
            inner: Arc::new(RawStream {
                raw,
                context: context.clone(),
                // SAFETY: a live stream of `context` (checked above; the caller keeps it
                // alive while this value lives), held here.
                launch_on: unsafe { wrap(context, raw) },
                borrowed: true,
            }),
        })
    }

    /// A raw stream handle of the caller's without a cudarc context (runtimes on another cudarc
    /// version, foreign bindings): its context is asked of the driver (`cuStreamGetCtx`), and
    /// must be its GPU's primary context (another is `Unsupported`). The default-stream
    /// handles name the calling thread's current context.
    ///
    /// # Safety
    ///
    /// As [`Self::borrowed`] (the contracts of every raw handle are listed together in
    /// [`crate::cuda`]'s docs).
    pub unsafe fn from_raw(raw: sys::CUstream) -> Result<GpuStream> {
        crate::cuda::driver::availability()?;
        // SAFETY: `raw` is a valid stream handle (the caller's contract).
        let ctx = unsafe { super::result::stream_context(raw) }?;
        // SAFETY: a live context (the stream's).
        let dev = unsafe { super::result::context_device(ctx) }?;
        let context = crate::cuda::open_context(dev as usize)?;
        if context.cu_ctx() != ctx {
            return Err(Error::Unsupported {
                what: "raw stream",
                reason: format!(
                    "the stream belongs to a CUDA context other than GPU {dev}'s primary context"
                ),
            });
        }
        // SAFETY: forwarded contract.
        unsafe { Self::borrowed(&context, raw) }
    }

    /// Whether this is the per-thread default stream (`CU_STREAM_PER_THREAD`, cudarc's
    /// `per_thread_stream`): a handle that names another stream on every thread, so nodetour
    /// uses it only on the thread that passed it (see the communicator's call order).
    pub fn is_per_thread(&self) -> bool {
        self.inner.raw == CU_STREAM_PER_THREAD
    }

    /// Whether this is a stream of the caller's ([`Self::of_cudarc`], [`Self::borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        self.inner.borrowed
    }

    /// The stream's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.inner.context
    }

    /// cudarc's view of the stream, for kernel launches through its launch builder (borrowed:
    /// never handed out beyond the launch, so it cannot outlive the handle).
    pub(crate) fn launch_on(&self) -> &cudarc::driver::CudaStream {
        &self.inner.launch_on
    }

    pub(crate) fn bind(&self) -> Result<sys::CUstream> {
        self.inner
            .context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        Ok(self.inner.raw)
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
        dst.note_use(self);
        src.note_use(self);
        // SAFETY: both ranges are inside live allocations (checked); both buffers noted this
        // stream, so they are freed only after the work queued here has run.
        unsafe {
            super::result::memcpy_dtod_async(
                dst.device_ptr() + dst_offset as u64,
                src.device_ptr() + src_offset as u64,
                len,
                s,
            )
        }
    }

    /// Waits until everything queued so far has run.
    pub fn synchronize(&self) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: a live stream.
        unsafe { result::stream::synchronize(s) }.map_err(|e| cuda_error("cuStreamSynchronize", e))
    }

    /// The id of the CUDA graph capture this stream takes part in (`None`: not capturing).
    /// Streams joined into one capture (forked from its origin stream by an event) share it.
    pub fn capture_id(&self) -> Result<Option<u64>> {
        let s = self.bind()?;
        // SAFETY: a live stream of the context just bound.
        unsafe { super::result::stream_capture_id(s) }
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
            context: self.inner.context.clone(),
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
        if !crate::cuda::same_context(&marker.context, &self.inner.context) {
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
        unsafe { super::result::stream_write_value32(s, address, value, 0) }
    }

    /// Queues a wait until the 32-bit word at `address` is ≥ `value` (wrapping comparison not
    /// used: values only grow).
    pub(crate) fn wait_value(&self, address: u64, value: u32) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: as above; flags 0 = CU_STREAM_WAIT_VALUE_GEQ.
        unsafe { super::result::stream_wait_value32(s, address, value, 0) }
    }

    /// Queues a wait until the 32-bit word at `address` equals `value`.
    pub(crate) fn wait_value_eq(&self, address: u64, value: u32) -> Result<()> {
        let s = self.bind()?;
        // SAFETY: as above; flags 1 = CU_STREAM_WAIT_VALUE_EQ.
        unsafe { super::result::stream_wait_value32(s, address, value, 1) }
    }
}

/// A point recorded on a stream, for timing.
pub struct GpuEvent {
    raw: sys::CUevent,
    context: Arc<CudaContext>,
}

// SAFETY: events are usable from any thread that binds their context.
unsafe impl Send for GpuEvent {}
// SAFETY: every `&self` method is one driver call (record, wait, query), which the driver
// makes thread-safe; nothing is cached on the host.
unsafe impl Sync for GpuEvent {}

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
        unsafe { super::result::event_complete(self.raw) }
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
    super::result::can_access_peer(from.cu_device(), to.cu_device())
}

/// Lets `from`'s GPU read and write what `to`'s GPU allocates from its current memory pool
/// (`cuMemAllocAsync`: cudarc's allocations, nodetour's stream-ordered buffers), which
/// `cuCtxEnablePeerAccess` does not reach (`cuMemPoolSetAccess`). Memory of another pool of
/// the caller's needs the same from the caller. Granting twice is fine.
pub fn enable_pool_access(from: &Arc<CudaContext>, to: &Arc<CudaContext>) -> Result<()> {
    if from.cu_device() == to.cu_device() {
        return Ok(()); // a GPU reads its own pools
    }
    to.bind_to_thread()
        .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
    super::result::grant_pool_access(to.cu_device(), from.cu_device())
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
    unsafe { super::result::enable_peer_access(to.cu_ctx()) }?;
    Ok(true)
}

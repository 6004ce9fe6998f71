//! GPU memory that a NIC or a peer may write: dedicated, aligned allocations.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use super::GpuStream;
use super::result::{cuda_error, dmabuf_fd};
use super::stream::{Uses, queue_release_after};
use crate::error::{Error, Result};

/// Alignment and size granularity of GPU buffers: the GPU page size that peer mappings (and
/// nvidia-peermem) work in.
pub const DEVICE_ALIGNMENT: usize = 64 << 10;

/// A dedicated GPU allocation, 64 KiB-aligned, a multiple of 64 KiB long.
///
/// Dedicated means nothing else lives in it: it never comes from a caching allocator, so
/// registering or exporting it exposes only itself. The CPU cannot dereference its address; it
/// is not [`HostAccessible`](crate::memory::HostAccessible), so registered regions over it offer no
/// `read_at`/`write_at` (copy with the GPU instead).
///
/// Dropping it never waits. Every call in this crate that queues work on the buffer notes the
/// stream; the drop queues the free (`cuMemFreeAsync`) on a fresh stream after the work queued
/// so far on those streams, so the memory outlives what uses it and the caller waits for
/// nothing: not for that work, and not for the rest of the GPU, as `cuMemFree` would (it
/// waits for every stream of the context; measured by `examples/teardown_probe`). Memory whose
/// work was still running at the drop comes back at a later allocation or drop, or at
/// [`crate::cuda::stream::reap_releases`].
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    // The allocation as returned by cuMemAlloc (ptr is aligned within it); freed in Drop.
    base: sys::CUdeviceptr,
    context: Arc<CudaContext>,
    // The streams that queued work on it: the free is ordered after them.
    uses: Box<Uses>,
    // False for a view of the caller's memory (`with_cudarc_slice`): never freed here.
    owned: bool,
}

// SAFETY: a device pointer is usable from any thread that binds the context.
unsafe impl Send for DeviceBuffer {}
// SAFETY: &self methods only copy through the driver.
unsafe impl Sync for DeviceBuffer {}

/// A dma-buf exported from GPU memory, for `ibv_reg_dmabuf_mr`.
#[derive(Debug)]
pub struct DmabufExport {
    /// The dma-buf. Owned: closed when dropped. Registration takes its own reference in the
    /// kernel, so the descriptor may be closed as soon as `ibv_reg_dmabuf_mr` returns.
    pub fd: OwnedFd,
    /// Offset of the buffer in the dma-buf (0: the export starts at the buffer).
    pub offset: u64,
    /// Bytes exported.
    pub len: usize,
}

impl DeviceBuffer {
    /// Allocates at least `len` bytes (rounded up to 64 KiB) on the GPU of `context`.
    pub fn new(context: &Arc<CudaContext>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidRegistration {
                reason: "a GPU buffer of zero bytes".into(),
            });
        }
        let rounded = len
            .checked_next_multiple_of(DEVICE_ALIGNMENT)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("{len} bytes cannot be rounded to 64 KiB"),
            })?;
        crate::cuda::stream::reap_releases();
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // One alignment unit of slack lets the buffer start on a 64 KiB boundary whatever
        // cuMemAlloc returns (in practice it is already 2 MiB-aligned for large sizes).
        // SAFETY: the context is current.
        let base = unsafe { result::malloc_sync(rounded + DEVICE_ALIGNMENT) }
            .map_err(|e| cuda_error("cuMemAlloc", e))?;
        let ptr = base.next_multiple_of(DEVICE_ALIGNMENT as u64);
        // Zero all of it, the alignment slack too: nothing of an earlier owner of this memory
        // is ever sent, and a peer that maps the whole allocation (cuda-ipc exports it whole)
        // finds only zeros outside the buffer.
        // On a stream of its own, waited for alone: a synchronous memset would wait for the
        // whole context.
        let buffer = DeviceBuffer {
            ptr,
            len: rounded,
            base,
            context: context.clone(),
            uses: Box::default(),
            owned: true,
        };
        let stream = GpuStream::new(context)?;
        let s = stream.bind()?;
        // SAFETY: [base, base+rounded+DEVICE_ALIGNMENT) is the allocation just made; the stream
        // is synchronised below, before anything can drop `buffer` (on error, dropping it frees
        // after nothing: a failed synchronise means the context is broken).
        unsafe { crate::cuda::result::memset_d8_async(base, 0, rounded + DEVICE_ALIGNMENT, s) }?;
        stream.synchronize()?;
        Ok(buffer)
    }

    /// Notes that `stream` queues work on the buffer: its free will come after that work.
    /// Every call of this crate that queues work on a buffer does this; code that queues its
    /// own work on [`Self::device_ptr`] calls it too.
    pub fn note_use(&self, stream: &GpuStream) {
        self.uses.note(stream);
    }

    /// The GPU virtual address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's base address and the buffer's offset in it (for IPC export).
    pub(crate) fn allocation(&self) -> (u64, u64) {
        (self.base, self.ptr - self.base)
    }

    /// The CUDA context (and so the GPU) the memory belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// Exports the buffer as a dma-buf (`cuMemGetHandleForAddressRange`), the input of
    /// `ibv_reg_dmabuf_mr`. Fails with `Unsupported` where the driver lacks the call, and with
    /// `Cuda { code: "CUDA_ERROR_NOT_SUPPORTED" }` where the GPU or kernel cannot export.
    pub fn export_dmabuf(&self) -> Result<DmabufExport> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: CUDA is initialised (the buffer exists); the range is this live allocation,
        // host-page aligned at both ends (64 KiB granularity).
        let fd = unsafe { dmabuf_fd(self.ptr, self.len)? };
        Ok(DmabufExport {
            fd,
            offset: 0,
            len: self.len,
        })
    }

    /// Copies `src` into the buffer at `offset`. Synchronous: on return the bytes are in GPU
    /// memory, visible to work queued afterwards on any stream. Waits only for the copy (on a
    /// stream of its own), never for other work of the GPU.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check("copy to GPU", offset, src.len())?;
        // From pageable memory a synchronous cuMemcpyHtoD returns once `src` is staged, before
        // the DMA lands, and non-blocking streams are not ordered after it: copy on a stream of
        // our own and wait for that stream.
        let stream = GpuStream::new(&self.context)?;
        crate::cuda::copy::htod(self, offset, src.as_ptr(), src.len(), &stream)
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer (synchronously, on a stream of its
    /// own: it waits for nothing else).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check("copy from GPU", offset, dst.len())?;
        let stream = GpuStream::new(&self.context)?;
        crate::cuda::copy::dtoh(dst.as_mut_ptr(), self, offset, dst.len(), &stream)
    }

    /// `len` bytes at `offset` lie inside the buffer; `OutOfBounds` naming `what` otherwise.
    pub(crate) fn check(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what,
                offset: offset as u64,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }
}

/// Runs `f` with a view of the caller's cudarc memory `slice` (read by the work `f` queues on
/// `stream`): a [`DeviceBuffer`] over the same bytes that nodetour's calls accept and that is
/// never freed here. `stream` first waits for the slice's last write (cudarc's own ordering);
/// after `f`, cudarc records that `stream` read the slice, so cudarc orders later writes and the
/// slice's free after the work `f` queued. Queue work only on `stream` in `f`. A stream being
/// captured into a CUDA graph is refused (`Unsupported`) before anything is queued on it while
/// the context tracks events (cudarc's default); with event tracking off the call goes on.
pub fn with_cudarc_slice<T, S, R>(
    slice: &S,
    stream: &Arc<cudarc::driver::CudaStream>,
    f: impl FnOnce(&DeviceBuffer) -> R,
) -> Result<R>
where
    S: cudarc::driver::DevicePtr<T>,
{
    let (context, len) = cudarc_view_of(slice, stream)?;
    let (ptr, record) = slice.device_ptr(stream);
    // SAFETY: [ptr, ptr + len) is the live memory of `slice`, borrowed for this call; the view
    // never frees it; cudarc's record (dropped after `f`) orders the slice's later writes and
    // its free after what `f` queued on `stream`.
    let view = unsafe { DeviceBuffer::borrowed(&context, ptr, len) };
    Ok(view_then_record(view, record, f))
}

/// [`with_cudarc_slice`] for memory the work `f` queues on `stream` writes (cudarc records a
/// write: its later reads and writes on other streams wait for it).
pub fn with_cudarc_slice_mut<T, S, R>(
    slice: &mut S,
    stream: &Arc<cudarc::driver::CudaStream>,
    f: impl FnOnce(&DeviceBuffer) -> R,
) -> Result<R>
where
    S: cudarc::driver::DevicePtrMut<T>,
{
    let (context, len) = cudarc_view_of(&*slice, stream)?;
    let (ptr, record) = slice.device_ptr_mut(stream);
    // SAFETY: as in `with_cudarc_slice`; the slice is borrowed mutably, so nothing else of the
    // caller's reaches it during `f`.
    let view = unsafe { DeviceBuffer::borrowed(&context, ptr, len) };
    Ok(view_then_record(view, record, f))
}

/// The context and byte length of a cudarc slice used on `stream`; another GPU's stream is
/// `InvalidArgument`.
fn cudarc_view_of<T, S: cudarc::driver::DeviceSlice<T> + ?Sized>(
    slice: &S,
    stream: &Arc<cudarc::driver::CudaStream>,
) -> Result<(Arc<CudaContext>, usize)> {
    let context = slice.stream().context().clone();
    if !crate::cuda::same_context(&context, stream.context()) {
        return Err(Error::InvalidArgument {
            reason: "the slice and the stream are on different GPUs".into(),
        });
    }
    // With cudarc's event tracking on, refused before cudarc orders the slice on `stream`:
    // that wait names an event recorded outside the capture, which would invalidate the
    // caller's capture. Without it (`CudaContext::disable_event_tracking`, what code that
    // captures does) cudarc queues nothing, and the collective decides whether it can be
    // captured.
    let capture = stream
        .capture_status()
        .map_err(|e| crate::cuda::result::cuda_error("cuStreamIsCapturing", e))?;
    if capture != cudarc::driver::sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE
        && context.is_event_tracking()
    {
        return Err(Error::Unsupported {
            what: "graph capture",
            reason: "the stream is being captured into a CUDA graph while cudarc tracks events \
                     (its wait for the slice's last write would break the capture): disable \
                     event tracking on the context (CudaContext::disable_event_tracking) to \
                     capture nodetour's collectives"
                .into(),
        });
    }
    Ok((context, slice.num_bytes()))
}

/// Runs `f` on `view`, then drops the view before cudarc's `record` (which records the use).
fn view_then_record<R>(
    view: DeviceBuffer,
    record: cudarc::driver::SyncOnDrop<'_>,
    f: impl FnOnce(&DeviceBuffer) -> R,
) -> R {
    let r = f(&view);
    drop(view);
    drop(record);
    r
}

impl DeviceBuffer {
    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// A view of `len` bytes of device memory at `ptr` in `context`, owned by someone else:
    /// nodetour's calls take it like its own buffers and never free it.
    ///
    /// # Safety
    ///
    /// `[ptr, ptr + len)` must be live device memory of `context` (or mapped into it) for as
    /// long as the view lives **and** until every piece of work queued on it has run: free it
    /// only in the order of the streams that work was queued on (as CUDA's stream-ordered
    /// semantics require of any asynchronous call). Not memory from cudarc's
    /// `upgrade_device_ptr`, whose owner frees on drop.
    pub unsafe fn borrowed(context: &Arc<CudaContext>, ptr: u64, len: usize) -> DeviceBuffer {
        DeviceBuffer {
            ptr,
            len,
            base: ptr,
            context: context.clone(),
            uses: Box::default(),
            owned: false,
        }
    }

    /// A view of `len` bytes of device memory at the raw address `ptr`, for runtimes on
    /// another cudarc version or foreign bindings: the driver is asked what it can check (that
    /// `ptr` is device memory, of which GPU and context, and that `[ptr, ptr + len)` lies in
    /// one allocation), and the view is of that GPU's primary context (memory of another
    /// context is `Unsupported`). Never freed here.
    ///
    /// # Safety
    ///
    /// As [`Self::borrowed`] (the contracts of every raw handle are listed together in
    /// [`crate::cuda`]'s docs): the memory stays allocated while the view lives and until the
    /// work queued on it has run.
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Result<DeviceBuffer> {
        crate::cuda::driver::availability()?;
        // SAFETY: the driver is initialised; querying an address has no other precondition
        // (an address the driver does not know is an error it returns).
        let facts = unsafe { super::result::pointer_facts(ptr) }?;
        if !facts.device_memory || facts.context.is_null() || facts.ordinal < 0 {
            return Err(Error::InvalidArgument {
                reason: format!("{ptr:#x} is not device memory of a CUDA context"),
            });
        }
        let context = crate::cuda::open_context(facts.ordinal as usize)?;
        if context.cu_ctx() != facts.context {
            return Err(Error::Unsupported {
                what: "raw device memory",
                reason: format!(
                    "{ptr:#x} belongs to a CUDA context other than GPU {}'s primary context \
                     (nodetour queues its work in the primary context)",
                    facts.ordinal
                ),
            });
        }
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: the context that owns `ptr` is current.
        let (base, size) = unsafe { super::result::address_range(ptr) }?;
        let end = ptr.checked_add(len as u64);
        if end.is_none_or(|e| e > base + size as u64) {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{len} bytes at {ptr:#x} run past their allocation ({size} bytes at {base:#x})"
                ),
            });
        }
        // SAFETY: checked above as far as the driver can; the rest is the caller's contract.
        Ok(unsafe { DeviceBuffer::borrowed(&context, ptr, len) })
    }

    /// Whether this is a view of memory nodetour does not own ([`Self::borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        !self.owned
    }
}

/// How long a drop waits for the buffer's own work where the driver has no stream-ordered free
/// (then it frees with `cuMemFree`, which waits for the whole context).
const FALLBACK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if !self.owned {
            return; // a view of the caller's memory: its owner frees it
        }
        // Failure policy: log and leak (a failing free means the context is already gone).
        let uses = self.uses.take();
        let base = self.base;
        let queued = queue_release_after(&self.context, &uses, |s| {
            // SAFETY: base came from cuMemAlloc in this context; no region is registered over
            // it any more (a MemoryRegion owns its buffer and deregisters before dropping it);
            // the free runs only after the work queued so far on every stream that used it
            // (noted by each call that queued such work).
            unsafe { crate::cuda::result::mem_free_async(base, s) }
        });
        let Err(why) = queued else {
            return;
        };
        // Without the stream-ordered allocator (some virtualised GPUs): wait for the buffer's
        // own work (a deadline), then the synchronous free; past the deadline leak.
        tracing::debug!(%why, "no stream-ordered free: waiting for the buffer's own work");
        let deadline = std::time::Instant::now() + FALLBACK_DEADLINE;
        if !crate::cuda::stream::wait_for_streams(&self.context, &uses, deadline) {
            tracing::warn!("work queued on a GPU buffer did not finish: leaking it");
            return;
        }
        // SAFETY: as above; the buffer's own work has run (waited for just now).
        if let Err(e) = unsafe { result::free_sync(base) } {
            tracing::warn!(error = ?e, "cuMemFree failed");
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("gpu", &self.context.ordinal())
            .finish()
    }
}

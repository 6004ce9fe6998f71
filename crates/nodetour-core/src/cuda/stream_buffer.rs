//! GPU memory allocated and freed in a stream's order: scratch for one call whose work may be
//! captured into a CUDA graph.

use super::GpuStream;
use super::device_buffer::DeviceBuffer;
use super::result::{cuda_error, mem_alloc_async, mem_free_async};
use crate::error::{Error, Result};

/// `len` bytes from the device's default memory pool, allocated on a stream
/// (`cuMemAllocAsync`) and freed on the same stream when dropped (`cuMemFreeAsync`).
///
/// The memory is usable by the work queued on the stream after [`Self::new`] and before the
/// drop (work on other streams must be joined back into the stream before the drop). Under CUDA
/// graph capture the two calls become an allocation node and a free node of the caller's graph:
/// every launch of the graph has its own memory for the span between them, owned by the graph,
/// so later calls of the host never reuse it while a launch still writes it. CUDA allows one
/// instantiation at a time of a graph with such nodes and no launch of it on two streams at once.
///
/// Not zeroed: it holds whatever this process's pool held before. Write before you send.
pub struct StreamOrderedBuffer {
    /// A view over the allocation (never freed through it).
    view: DeviceBuffer,
    stream: GpuStream,
    freed: bool,
}

impl StreamOrderedBuffer {
    /// Allocates `len` (> 0) bytes in `stream`'s order.
    pub fn new(stream: &GpuStream, len: usize) -> Result<StreamOrderedBuffer> {
        if len == 0 {
            return Err(Error::InvalidArgument {
                reason: "a stream-ordered GPU buffer of zero bytes".into(),
            });
        }
        let s = stream.bind()?;
        // SAFETY: the stream's context is current (bind); a stream of this context.
        let ptr =
            unsafe { mem_alloc_async(len, s) }.map_err(|e| cuda_error("cuMemAllocAsync", e))?;
        // SAFETY: [ptr, ptr + len) was just allocated in this context and stays allocated until
        // `free` queues its release on `stream`, after every use queued there (the view is
        // dropped with `self`, never outliving the allocation's owner).
        let view = unsafe { DeviceBuffer::borrowed(stream.context(), ptr, len) };
        Ok(StreamOrderedBuffer {
            view,
            stream: stream.clone(),
            freed: false,
        })
    }

    /// The memory, as nodetour's calls take it (a view: never freed through it).
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.view
    }

    /// Frees the memory on its stream, after the work queued there so far, saying whether
    /// that could be queued (dropping does the same and logs a failure).
    pub fn free(mut self) -> Result<()> {
        self.release()
    }

    fn release(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.freed, true) {
            return Ok(());
        }
        let s = self.stream.bind()?;
        // SAFETY: the allocation of `new` on this stream's context, freed once (the flag); the
        // free is queued on the allocating stream, after all work queued there, which includes
        // every use (the contract: other streams' uses are joined into it first).
        unsafe { mem_free_async(self.view.device_ptr(), s) }
            .map_err(|e| cuda_error("cuMemFreeAsync", e))
    }
}

impl Drop for StreamOrderedBuffer {
    fn drop(&mut self) {
        // Failure policy: log and leak (a failing free means the context or the capture is
        // already broken).
        if let Err(e) = self.release() {
            tracing::warn!(error = %e, "a stream-ordered GPU buffer could not be freed");
        }
    }
}

impl std::fmt::Debug for StreamOrderedBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamOrderedBuffer")
            .field("buffer", &self.view)
            .finish()
    }
}

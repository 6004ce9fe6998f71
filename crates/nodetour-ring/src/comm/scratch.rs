//! A communicator's scratch device buffer: the whole input of an out-of-place reduce-scatter
//! (reduced in place there, so the caller's input is never written), grown to the largest size
//! asked for and reused in stream order (each use waits for the end of the previous one, on
//! whichever stream that ran). A buffer it outgrew is kept until the communicator goes, never
//! freed during a collective: `cuMemFree` waits for every stream of the context (measured by
//! `teardown_probe`), the caller's unrelated kernels included.
//!
//! Under CUDA graph capture the pool is not used: a graph would keep writing the buffer at
//! every replay while later calls reuse, grow or free it. A captured call gets memory of the
//! graph's own instead ([`StreamOrderedBuffer`]: an allocation node and a free node around the
//! call's work), so every replay has its own scratch for the span of that call.

use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use nodetour_core::cuda::{GpuEvent, GpuStream, StreamOrderedBuffer};
use nodetour_core::memory::DeviceBuffer;

use crate::error::{Error, Result};

/// The buffer, and the marker of the end of its last use.
#[derive(Default)]
pub(crate) struct Scratch {
    buffer: Option<DeviceBuffer>,
    free: Option<GpuEvent>,
    /// Buffers it outgrew, freed with it.
    retired: Vec<DeviceBuffer>,
}

impl Scratch {
    /// The scratch buffer of at least `len` bytes, ordered after its last use on `stream`.
    pub(crate) fn take(
        &mut self,
        context: &Arc<CudaContext>,
        len: usize,
        stream: &GpuStream,
    ) -> Result<DeviceBuffer> {
        if let Some(free) = &self.free {
            stream
                .wait_marker(free)
                .map_err(|e| Error::gpu("ordering the scratch buffer", e))?;
        }
        match self.buffer.take() {
            Some(b) if b.len() >= len => Ok(b),
            smaller => {
                self.retired.extend(smaller);
                DeviceBuffer::new(context, len.max(1))
                    .map_err(|e| Error::gpu("allocating scratch", e))
            }
        }
    }

    pub(crate) fn put_back(&mut self, buffer: DeviceBuffer, stream: &GpuStream) -> Result<()> {
        let free = match self.free.take() {
            Some(f) => f,
            None => GpuEvent::marker(stream.context())
                .map_err(|e| Error::gpu("creating a marker", e))?,
        };
        stream
            .record_marker(&free)
            .map_err(|e| Error::gpu("marking the scratch buffer", e))?;
        self.free = Some(free);
        self.buffer = Some(buffer);
        Ok(())
    }
}

/// Runs `f` with scratch of at least `len` bytes for work that `f` queues on `stream` (and joins
/// back into it): the pool's buffer, or under capture memory of the graph's own (see the
/// module). `context` is the buffer's GPU, `stream`'s.
pub(crate) fn with_scratch<R>(
    pool: &Mutex<Scratch>,
    context: &Arc<CudaContext>,
    len: usize,
    stream: &GpuStream,
    f: impl FnOnce(&DeviceBuffer) -> Result<R>,
) -> Result<R> {
    if stream
        .is_capturing()
        .map_err(|e| Error::gpu("asking about stream capture", e))?
    {
        let scratch = StreamOrderedBuffer::new(stream, len.max(1))
            .map_err(|e| Error::gpu("allocating scratch in the graph", e))?;
        let result = f(scratch.buffer());
        let freed = scratch
            .free()
            .map_err(|e| Error::gpu("freeing scratch in the graph", e));
        return result.and_then(|r| freed.map(|()| r));
    }
    let mut pool = pool.lock().map_err(|_| super::poisoned())?;
    let buffer = pool.take(context, len, stream)?;
    let result = f(&buffer);
    pool.put_back(buffer, stream)?;
    result
}

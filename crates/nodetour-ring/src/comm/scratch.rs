//! A communicator's scratch device buffer: the whole input of an out-of-place reduce-scatter
//! (reduced in place there, so the caller's input is never written), grown to the largest size
//! asked for and reused in stream order (each use waits for the end of the previous one, on
//! whichever stream that ran). A buffer it outgrew is kept until the communicator goes, never
//! freed during a collective: `cuMemFree` waits for every stream of the context (measured by
//! `teardown_probe`), the caller's unrelated kernels included.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::cuda::{GpuEvent, GpuStream};
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
                .map_err(|e| gpu("ordering the scratch buffer", e))?;
        }
        match self.buffer.take() {
            Some(b) if b.len() >= len => Ok(b),
            smaller => {
                self.retired.extend(smaller);
                DeviceBuffer::new(context, len.max(1)).map_err(|e| gpu("allocating scratch", e))
            }
        }
    }

    pub(crate) fn put_back(&mut self, buffer: DeviceBuffer, stream: &GpuStream) -> Result<()> {
        let free = match self.free.take() {
            Some(f) => f,
            None => GpuEvent::marker(stream.context()).map_err(|e| gpu("creating a marker", e))?,
        };
        stream
            .record_marker(&free)
            .map_err(|e| gpu("marking the scratch buffer", e))?;
        self.free = Some(free);
        self.buffer = Some(buffer);
        Ok(())
    }
}

fn gpu(what: &str, e: nodetour_core::Error) -> Error {
    Error::Gpu {
        reason: format!("{what}: {e}"),
    }
}

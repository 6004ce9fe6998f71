//! The owning non-blocking form of a device collective: the handle owns the buffer until the
//! collective has finished, so nothing of the caller's can read, reuse or free it meanwhile.

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuEvent;
use nodetour_core::memory::DeviceBuffer;

use super::Communicator;
use crate::error::{Error, Result};

/// A device collective queued by [`Communicator::start_all_reduce_device_buffer`]; it owns the
/// buffer until [`InFlight::wait`] gives it back.
///
/// Dropping the handle waits for the collective (to the communicator's timeout; past it the
/// communicator is broken) before the buffer is freed (in stream order); forgetting it leaks
/// the buffer rather than freeing memory a collective may still use.
#[must_use = "dropping the handle waits for the collective"]
pub struct InFlight<'c> {
    pub(super) comm: &'c Communicator,
    pub(super) buffer: Option<DeviceBuffer>,
    /// Recorded on the caller's stream after the collective.
    pub(super) done: GpuEvent,
}

/// A collective that failed, and the buffer it owned (its contents are undefined).
#[derive(Debug)]
pub struct Failed {
    /// Why.
    pub error: Error,
    /// The buffer, given back.
    pub buffer: DeviceBuffer,
}

impl InFlight<'_> {
    /// Whether the collective has finished on the caller's stream (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        self.done
            .is_complete()
            .map_err(|e| Error::gpu("asking about the collective", e))
    }

    /// Waits for the collective (and every device collective queued before it) to `deadline`,
    /// and gives the buffer back; on failure the buffer comes back with the error.
    #[allow(clippy::result_large_err)]
    pub fn wait(mut self, deadline: Deadline) -> std::result::Result<DeviceBuffer, Failed> {
        let buffer = self.buffer.take().expect("taken only here or in drop");
        match self.comm.wait(deadline) {
            Ok(()) => Ok(buffer),
            Err(error) => Err(Failed { error, buffer }),
        }
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if self.buffer.is_some()
            && let Err(e) = self.comm.wait(Deadline::after(self.comm.timeout))
        {
            tracing::warn!(error = %e, "a dropped device collective failed");
        }
    }
}

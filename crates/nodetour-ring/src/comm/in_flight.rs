//! The owning non-blocking form of every device collective: [`Communicator::start`] hands the
//! buffers to a handle that owns them until the collective has finished, so no code of the
//! caller's can read, reuse or free them meanwhile (its GPU work queued later on other
//! streams is ordered by cudarc's event tracking where it is on; with it off
//! (`disable_event_tracking`) that ordering is the caller's).

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuEvent;

use super::operand::{Queue, sealed};
use super::{Communicator, gpu_error};
use crate::error::{Error, Result};

/// A device collective queued by [`Communicator::start`]; it owns the buffers `B` until
/// [`InFlight::wait`] gives them back.
///
/// Dropping the handle waits for the collective (to the communicator's timeout; past it the
/// communicator is broken) before the buffers are dropped (cudarc and nodetour free in stream
/// order); forgetting it leaks them rather than freeing memory a collective may still use.
#[must_use = "dropping the handle waits for the collective"]
pub struct InFlight<'c, B> {
    comm: &'c Communicator,
    buffers: Option<B>,
    /// Recorded on the caller's stream after the collective.
    done: GpuEvent,
}

/// A collective that failed, and the buffers it owned (their contents are undefined).
pub struct Failed<B> {
    /// Why.
    pub error: Error,
    /// The buffers, given back.
    pub buffers: B,
}

impl<B> std::fmt::Debug for Failed<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failed")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<B> std::fmt::Display for Failed<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<B> std::error::Error for Failed<B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The error, the buffers dropped (after the collective: a failed one was waited for or never
/// queued).
impl<B> From<Failed<B>> for Error {
    fn from(f: Failed<B>) -> Error {
        f.error
    }
}

impl Communicator {
    /// Starts a device collective that owns its buffers: `call` issues it on `buffers` (one
    /// buffer, or a tuple of send and receive buffers) and `queue`, then the returned handle
    /// owns them until [`InFlight::wait`] gives them back. A collective that cannot be queued
    /// gives them back with the error.
    ///
    /// ```no_run
    /// # fn demo(
    /// #     comm: &nodetour_ring::comm::Communicator,
    /// #     grads: cudarc::driver::CudaSlice<f32>,
    /// #     stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    /// # ) -> nodetour_ring::Result<()> {
    /// use nodetour_ring::ReduceOp;
    /// let pending = comm.start(grads, stream, |c, g, s| c.all_reduce_in_place(g, ReduceOp::Avg, s))?;
    /// // ... the backward pass goes on ...
    /// let grads = pending.wait(nodetour_core::Deadline::after(std::time::Duration::from_secs(60)))?;
    /// # Ok(()) }
    /// ```
    #[allow(clippy::result_large_err)]
    pub fn start<B, Q>(
        &self,
        mut buffers: B,
        queue: Q,
        call: impl FnOnce(&Communicator, &mut B, Q) -> Result<()>,
    ) -> std::result::Result<InFlight<'_, B>, Failed<B>>
    where
        Q: Queue,
    {
        let Some(stream) = sealed::Queue::stream(&queue) else {
            return Err(Failed {
                error: Error::InvalidArgument {
                    reason: "start is for device collectives (host collectives return when done)"
                        .into(),
                },
                buffers,
            });
        };
        let queued = call(self, &mut buffers, queue).and_then(|()| {
            let done = GpuEvent::marker(stream.context()).map_err(gpu_error)?;
            stream.record_marker(&done).map_err(gpu_error)?;
            Ok(done)
        });
        match queued {
            Ok(done) => Ok(InFlight {
                comm: self,
                buffers: Some(buffers),
                done,
            }),
            Err(error) => Err(Failed { error, buffers }),
        }
    }
}

impl<B> InFlight<'_, B> {
    /// Whether the collective has finished on the caller's stream (never blocks).
    pub fn is_done(&self) -> Result<bool> {
        self.done
            .is_complete()
            .map_err(|e| Error::gpu("asking about the collective", e))
    }

    /// Waits for the collective (and every device collective queued before it) to `deadline`,
    /// and gives the buffers back; on failure they come back with the error.
    #[allow(clippy::result_large_err)]
    pub fn wait(mut self, deadline: Deadline) -> std::result::Result<B, Failed<B>> {
        let buffers = self.buffers.take().expect("taken only here or in drop");
        match self.comm.wait(deadline) {
            Ok(()) => Ok(buffers),
            Err(error) => Err(Failed { error, buffers }),
        }
    }
}

impl<B> Drop for InFlight<'_, B> {
    fn drop(&mut self) {
        if self.buffers.is_some()
            && let Err(e) = self.comm.wait(Deadline::after(self.comm.engine.timeout))
        {
            tracing::warn!(error = %e, "a dropped device collective failed");
        }
    }
}

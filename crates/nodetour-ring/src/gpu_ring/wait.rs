//! Waiting for a ring's collectives with a deadline: the streams' guards, the neighbours'
//! end notices and disagreements, and which cause a failure is reported with.

use super::*;

/// How long a wait whose deadline passed lets the aborted streams drain before it names the
/// cause from what the GPU latched.
const DEADLINE_DRAIN: Duration = Duration::from_millis(500);

impl GpuRing {
    /// A guarded wait of the streams that gave up at its deadline (it set the stop word
    /// itself: inside a CUDA graph no host waits), as the error to report.
    pub(super) fn guard_timeout(&self) -> Option<Error> {
        let stop = self.abort.shared.stop.as_ref()?;
        if stop.concurrent() {
            return Some(Error::Aborted {
                reason: "a ring collective ran at the same time as another collective of this \
                         communicator on this GPU (a CUDA graph replay not ordered against the \
                         communicator's other collectives: launch replays on a stream ordered \
                         after them); the rank stopped"
                    .into(),
            });
        }
        stop.timed_out().then(|| Error::Timeout {
            waiting_for: "a peer's flag inside a ring collective (a guarded wait on this \
                          rank's GPU gave up; its stop word now ends every wait)"
                .into(),
            rank: None,
            after: self.wait_timeout.unwrap_or_default(),
        })
    }

    /// Waits until every collective queued so far has finished on this rank, at most `timeout`
    /// (spins briefly, then sleeps in growing steps up to 1 ms; on expiry the ring is aborted),
    /// asking `alive` (the job's liveness check, e.g. the bootstrap's `check`) between polls (a
    /// lost rank aborts the ring at once and is named in the error), and until the work before
    /// `lane` (a marker on the communicator's
    /// stream, which every eager collective passes through in call order: see
    /// `comm::call_order`) has run, and `stream` has run everything queued on it so far:
    /// graph replays of this ring's collectives included, which the host does not see
    /// launched. Their outcome is what the GPU latched (a guarded wait that timed out, a
    /// one-kernel block that failed: the stop word keeps it) and the neighbours' notices, each
    /// of which taints every replay not yet confirmed by a wait.
    pub(crate) fn wait_streams(
        &mut self,
        lane: Option<&GpuEvent>,
        stream: Option<&GpuStream>,
        timeout: Duration,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let g = |e| Error::gpu("marking the caller's stream", e);
        let done = match stream {
            Some(s) => {
                let done = GpuEvent::marker(s.context()).map_err(g)?;
                s.record_marker(&done).map_err(g)?;
                Some(done)
            }
            None => None,
        };
        let marks: Vec<&GpuEvent> = lane.into_iter().chain(done.as_ref()).collect();
        self.wait_until(&marks, timeout, alive)
    }

    /// Whether any collective of this ring was captured into a CUDA graph.
    pub(super) fn captured(&self) -> bool {
        self.ring_captured || self.one_kernel_log.captured
    }

    pub(super) fn wait_until(
        &mut self,
        streams_done: &[&GpuEvent],
        timeout: Duration,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let g = |e| Error::gpu("waiting for the collective", e);
        let spin_until = Instant::now() + Duration::from_micros(50);
        let mut nap = Duration::from_micros(10);
        let mut lost = None;
        loop {
            // A network link's thread may still be carrying the streams' last chunks (unless it
            // stopped: a failure or an abort, which the error says).
            let carried = self.net().is_none_or(|n| {
                n.all_sent() || n.failure().is_some() || self.abort.error().is_some()
            });
            if carried
                && self.marks.end[0].is_complete().map_err(g)?
                && self.marks.end[1].is_complete().map_err(g)?
                && streams_done
                    .iter()
                    .try_fold(true, |all, m| m.is_complete().map(|c| all && c))
                    .map_err(g)?
            {
                // Read the neighbours' notices once more after the streams finished: a
                // neighbour that aborted told us before its stop word ended its waits.
                let failed = self.abort.error();
                let ended = self.abort.read_notice(self.queued, self.captured());
                if let Some((e, _)) = &ended {
                    // Ended by a neighbour: nothing more runs on this ring.
                    self.abort.abort_with(e.clone());
                }
                // The first error this ring ended with (its own abort, a lost rank, a
                // neighbour's notice) names the cause; later ones are its echoes. A notice for
                // a collective after the ones queued here leaves them correct.
                let tainted = ended.and_then(|(e, tainted)| tainted.then_some(e));
                // A peer that broke the link's protocol may have written a slot it held no
                // credit for: nothing it sent is trusted.
                let broke = self
                    .net()
                    .filter(|n| n.broke_protocol())
                    .and_then(NetLink::failure);
                // A one-kernel collective that a block gave up on (its peers learn through the
                // end notices of the abort below).
                let kernel = self.one_kernel_failure().or_else(|| self.guard_timeout());
                if let Some(e) = &kernel {
                    self.abort.abort_with(e.clone());
                }
                return match failed.or(lost).or(tainted).or(broke).or(kernel) {
                    Some(e) => Err(e),
                    None => {
                        self.abort.confirm(self.queued);
                        Ok(())
                    }
                };
            }
            if lost.is_none() {
                if let Some(e) = self.abort.read_disagreement() {
                    // Nothing of the previous rank's collective has landed (the receive stream
                    // waits for an equal descriptor): abort, tell the neighbours, drain.
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                } else if let Some((e, true)) = self.abort.read_notice(self.queued, self.captured())
                {
                    // A collective queued here is tainted: abort (which tells the other
                    // neighbour) and keep polling; the streams drain now that the stop word
                    // ends every wait. (A notice for a later collective waits for these.)
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                } else if let Some(e) = self.net().and_then(NetLink::failure) {
                    // A network link failed (its peer is gone, or broke the protocol).
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                } else if let Err(e) = alive() {
                    let e = Error::from(e);
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                self.abort
                    .abort("a collective did not finish before its deadline");
                if let Some(e) = lost {
                    return Err(e);
                }
                return Err(self.name_the_deadline(timeout));
            }
            if now >= spin_until {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(Duration::from_millis(1));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The error of a wait whose deadline passed (the ring already aborted): the stop word now
    /// ends every wait on the GPU, so the streams drain within moments; once they have (at
    /// most [`DEADLINE_DRAIN`]), what the GPU saw names the cause: a one-kernel block that
    /// timed out, or was stopped while it waited, names the rank it waited for and the
    /// collective.
    pub(super) fn name_the_deadline(&self, timeout: Duration) -> Error {
        let until = Instant::now() + DEADLINE_DRAIN;
        while Instant::now() < until
            && !(self.marks.end[0].is_complete().unwrap_or(true)
                && self.marks.end[1].is_complete().unwrap_or(true))
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        let generic = Error::Timeout {
            waiting_for: "the GPU ring's streams (aborted: a peer stopped?)".into(),
            rank: None,
            after: timeout,
        };
        let Some(kernel) = self.held.as_ref().and_then(|h| h.one_kernel.as_ref()) else {
            return generic;
        };
        let Some(failed) = kernel.failure() else {
            return generic;
        };
        let what = self.one_kernel_log.name(failed.collective);
        match failed.failure {
            OneKernelFailure::Timeout { peer } | OneKernelFailure::Aborted { peer }
                if peer != self.rank =>
            {
                Error::Timeout {
                    waiting_for: format!("its arrival at {what}"),
                    rank: Some(peer),
                    after: timeout,
                }
            }
            _ => self.one_kernel_failure().unwrap_or(generic),
        }
    }

    /// Checks `call`'s buffer and stream; whether `stream` is being captured into a CUDA
    /// graph.
    pub(super) fn check(
        &self,
        buffer: &DeviceBuffer,
        call: &RingCall,
        stream: &GpuStream,
    ) -> Result<bool> {
        let bytes = call.bytes()?;
        if buffer.len() < bytes {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "the buffer holds {} bytes, the collective needs {bytes}",
                    buffer.len()
                ),
            });
        }
        if !nodetour_core::cuda::same_context(buffer.context(), &self.context) {
            return Err(Error::InvalidArgument {
                reason: format!("the buffer is not on rank {}'s GPU", self.rank),
            });
        }
        if !nodetour_core::cuda::same_context(stream.context(), &self.context) {
            return Err(Error::InvalidArgument {
                reason: format!("the stream is not on rank {}'s GPU", self.rank),
            });
        }
        stream
            .is_capturing()
            .map_err(|e| Error::gpu("asking about stream capture", e))
    }
}

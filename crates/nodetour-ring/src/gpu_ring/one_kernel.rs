//! The one-kernel path on the caller's stream (small allreduces, symmetric buffers): queueing,
//! and naming the collective a failed block latched.

use super::*;

/// The one-kernel collectives a rank queued, by their number on its GPU (what a failed block
/// latches), to name the failed one.
#[derive(Default)]
pub(super) struct OneKernelLog {
    /// Eager launches queued.
    pub(super) launched: u32,
    /// Some were captured into a graph: replays count on the GPU, not here.
    pub(super) captured: bool,
    /// The last few eager ones: (number on the GPU modulo 2^16, descriptor).
    pub(super) recent: std::collections::VecDeque<(u16, Descriptor)>,
}

impl OneKernelLog {
    const KEPT: usize = 64;

    pub(super) fn queued(&mut self, what: Descriptor, capturing: bool) {
        if capturing {
            self.captured = true;
            return;
        }
        self.launched = self.launched.wrapping_add(1);
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((self.launched as u16, what));
    }

    /// The failed collective, in words.
    pub(super) fn name(&self, collective: u16) -> String {
        match self.recent.iter().find(|(n, _)| *n == collective) {
            Some((_, d)) if !self.captured => d.to_string(),
            _ => format!(
                "one-kernel collective #{collective} of this rank's GPU (counted modulo 65536,                  graph replays included)"
            ),
        }
    }
}

impl GpuRing {
    /// Runs allreduces of at most `max` bytes as one kernel on the caller's stream (formed by
    /// `comm::form::one_kernel`; every rank must have it on with the same `max`), or, with
    /// `None`, on the ring; `why` says which and why (for [`Self::path`]).
    pub(crate) fn set_one_kernel(&mut self, kernel: Option<OneKernel>, max: usize, why: String) {
        if let Some(h) = self.held.as_mut() {
            self.one_kernel_max = if kernel.is_some() {
                max.min(kernel.as_ref().map_or(0, OneKernel::max_bytes))
            } else {
                0
            };
            h.one_kernel = kernel;
        }
        self.one_kernel_path = why;
    }

    /// The one-kernel path, where formation turned it on (to allocate symmetric buffers).
    pub(crate) fn one_kernel_mut(&mut self) -> Option<&mut OneKernel> {
        self.held.as_mut()?.one_kernel.as_mut()
    }

    /// This rank's part of symmetric buffer `id`, for `f` (under the caller's lock).
    pub(crate) fn symmetric_buffer(&self, id: usize) -> Option<&DeviceBuffer> {
        self.held
            .as_ref()?
            .one_kernel
            .as_ref()?
            .symmetric_buffer(id)
    }

    /// Queues `call` (an allreduce) in place on symmetric buffer `id` on `stream`: one
    /// two-shot kernel reading every rank's part directly. Captured like the other one-kernel
    /// collectives.
    pub(crate) fn symmetric_all_reduce(
        &mut self,
        id: usize,
        call: RingCall,
        stream: &GpuStream,
    ) -> Result<()> {
        self.ready_to_queue()?;
        let buffer = self
            .symmetric_buffer(id)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("no symmetric buffer {id} on this communicator"),
            })?;
        let capturing = self.check(buffer, &call, stream)?;
        if call.count == 0 {
            return Ok(());
        }
        // The buffer is part of what the ranks agree on.
        let salt = (id as u32 + 1).wrapping_mul(0x9e37_79b9);
        let (dtype, op, count) = (call.dtype, call.op, call.count);
        self.queue_one_kernel(
            &call,
            Algorithm::TwoShotSymmetric,
            salt,
            stream,
            capturing,
            &|kernel, kernels, digest| {
                kernel.enqueue_all_reduce_symmetric(kernels, stream, dtype, op, id, count, digest)
            },
        )
    }

    /// Queues an allreduce as one kernel on `stream` (the caller's): see
    /// `nodetour_core::cuda::one_kernel`. The kernel checks that every rank's descriptor
    /// digest (the algorithm in it) is the same.
    ///
    /// Into a CUDA graph (`capturing`): only the kernel is captured. Its sequence numbers live
    /// in GPU memory and are advanced by the kernel itself, so every replay is the next
    /// collective; the host's count of collectives (what end notices name) counts eager ones
    /// only. A replay that fails latches its status, which the next [`Self::wait_alive`] or
    /// collective reports.
    pub(super) fn one_kernel(
        &mut self,
        buffer: &DeviceBuffer,
        call: &RingCall,
        stream: &GpuStream,
        capturing: bool,
    ) -> Result<()> {
        let kernel = self.held.as_ref().and_then(|h| h.one_kernel.as_ref());
        let two_shot = kernel
            .expect("checked by the caller")
            .two_shot(call.count * call.dtype.size());
        let algorithm = if two_shot {
            Algorithm::TwoShot
        } else {
            Algorithm::OneShot
        };
        let (dtype, op, count) = (call.dtype, call.op, call.count);
        self.queue_one_kernel(
            call,
            algorithm,
            0,
            stream,
            capturing,
            &|kernel, kernels, digest| {
                kernel.enqueue_all_reduce(kernels, stream, dtype, op, buffer, buffer, count, digest)
            },
        )
    }

    /// Queues one one-kernel collective, `call` by `algorithm`, through `enqueue` (given the
    /// path, the kernels and the descriptor's digest, `salt` folded in), then, unless
    /// `capturing`, the end markers that `wait` polls.
    pub(super) fn queue_one_kernel(
        &mut self,
        call: &RingCall,
        algorithm: Algorithm,
        salt: u32,
        stream: &GpuStream,
        capturing: bool,
        enqueue: &dyn Fn(&OneKernel, &ReduceKernels, u32) -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let what = call.descriptor(algorithm, self.queued, self.call);
        let g = |e| Error::gpu("queueing the collective", e);
        let held = self.held.as_ref().expect("checked by the caller");
        let kernel = held.one_kernel.as_ref().ok_or_else(|| Error::Unsupported {
            reason: "the one-kernel path is off on this communicator".into(),
        })?;
        // From here the peers count this collective: a failure to queue breaks the ring.
        let queued = enqueue(kernel, &held.kernels, what.digest() ^ salt)
            .map_err(g)
            .and_then(|()| {
                if capturing {
                    return Ok(());
                }
                // What `wait` polls: both ends of the collective are the caller's stream.
                stream.record_marker(&self.marks.end[0]).map_err(g)?;
                stream.record_marker(&self.marks.end[1]).map_err(g)
            });
        if !capturing {
            self.queued += 1;
        }
        self.one_kernel_log.queued(what, capturing);
        if let Err(e) = &queued {
            self.abort
                .abort(&format!("queueing a collective failed: {e}"));
        }
        queued
    }

    /// What the one-kernel path's blocks latched, as the error to report (once the streams
    /// have passed every collective queued).
    pub(super) fn one_kernel_failure(&self) -> Option<Error> {
        let kernel = self.held.as_ref()?.one_kernel.as_ref()?;
        let failed = kernel.failure()?;
        let what = self.one_kernel_log.name(failed.collective);
        // The kernels name job ranks; on one host (the only place the path runs) the ring
        // order is the rank order, so `self.rank` is this rank's too.
        Some(match failed.failure {
            OneKernelFailure::Aborted { peer } if peer == self.rank => Error::Aborted {
                reason: format!("{what}: this rank had aborted before it arrived"),
            },
            OneKernelFailure::Aborted { peer } => Error::Aborted {
                reason: format!("{what}: stopped while waiting for rank {peer}"),
            },
            OneKernelFailure::Timeout { peer } => Error::Timeout {
                waiting_for: format!("its arrival at {what}"),
                rank: Some(peer),
                after: kernel.timeout(),
            },
            OneKernelFailure::Concurrent => Error::Aborted {
                reason: format!(
                    "{what}: another collective of this communicator ran at the same time on \
                     this GPU (a CUDA graph replay not ordered against the communicator's other \
                     collectives: launch replays on a stream ordered after them)"
                ),
            },
            OneKernelFailure::PeerGaveUp { peer } => Error::Aborted {
                reason: format!(
                    "{what}: rank {peer} gave up at a barrier after arriving (its own error \
                     names the cause)"
                ),
            },
            OneKernelFailure::Disagreement { peer } => Error::Disagreement {
                rank: self.rank,
                peer,
                ours: what,
                theirs: "another collective (its descriptor or its number differs)".into(),
            },
        })
    }
}

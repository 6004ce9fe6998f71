//! Collectives on device memory, queued on the caller's stream: the GPU ring where the ranks
//! share one host, else staged through host memory.

use super::device_buffers::holds;
use super::executor::DeviceOperands;
use super::*;
use crate::call::CallSpec;

impl Engine {
    /// Device memory of this process's communicator (`executor::DeviceMemory`): queues `call`
    /// on the operands' stream (without an input, in place in the output).
    pub(super) fn device_verb(&self, call: CallSpec, on: DeviceOperands<'_>) -> Result<()> {
        let DeviceOperands { send, out, stream } = on;
        let block = call.block_bytes()?;
        let mine = self.rank as usize * block;
        match call.kind {
            Collective::AllReduce => {
                if let Some(src) = send {
                    holds(src, block, stream, "send")?;
                    holds(out, block, stream, "recv")?;
                    stream.copy(out, 0, src, 0, block).map_err(gpu_error)?;
                }
                self.device_all_reduce(out, &call, stream)
            }
            Collective::ReduceScatter => match send {
                Some(src) => self.device_reduce_scatter(src, out, 0, &call, stream),
                None => self.device_reduce_scatter(out, out, mine, &call, stream),
            },
            Collective::AllGather => match send {
                Some(src) => self.device_all_gather(src, 0, out, &call, stream),
                None => self.device_all_gather(out, mine, out, &call, stream),
            },
            Collective::Broadcast => {
                if let Some(src) = send.filter(|_| self.rank == call.root) {
                    holds(src, block, stream, "send")?;
                    holds(out, block, stream, "recv")?;
                    stream.copy(out, 0, src, 0, block).map_err(gpu_error)?;
                }
                self.device_broadcast(out, &call, stream)
            }
        }
    }

    /// The device allreduce `call` in place on `buffer`, on `stream`: through the GPU ring
    /// where there is one, else staged through the host ring.
    fn device_all_reduce(
        &self,
        buffer: &DeviceBuffer,
        call: &CallSpec,
        stream: &GpuStream,
    ) -> Result<()> {
        holds(buffer, call.block_bytes()?, stream, "the buffer")?;
        if self.has_gpu_ring() {
            let on_ring = call.on_ring(self.world, 0);
            return self.on_gpu_ring(|ring| ring.collective(buffer, on_ring, stream));
        }
        device_buffers::refuse_capture(stream)?;
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let result = self.staged_all_reduce(job, buffer, call, stream);
        if let Err(e) = &result {
            self.record_failure(&mut state, e);
        }
        result
    }

    /// Whether device collectives run on a GPU ring (queued on the stream, no host wait).
    pub(super) fn has_gpu_ring(&self) -> bool {
        matches!(self.paths.device, DevicePath::GpuRing { .. })
    }

    /// Queues a collective on the GPU ring through `queue` (given the ring, numbered as the
    /// communicator's next collective). A failure once the neighbours count on the collective
    /// breaks the communicator; arguments refused before anything was queued do not. Errors
    /// name job ranks.
    pub(super) fn on_gpu_ring(
        &self,
        queue: impl FnOnce(&mut crate::gpu_ring::GpuRing) -> Result<()>,
    ) -> Result<()> {
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let ring = job.gpu_ring.as_mut().ok_or_else(|| Error::Unsupported {
            reason: "this communicator has no GPU ring".into(),
        })?;
        ring.number_next(self.next_call());
        let result = match queue(ring) {
            Err(e @ (Error::InvalidArgument { .. } | Error::Unsupported { .. })) => return Err(e),
            other => other.map_err(|e| self.job_ranks(e)),
        };
        if let Err(e) = &result {
            self.record_failure(&mut state, e);
        }
        result
    }

    /// Queues `world` block copies of `block` bytes from `src` to `dst`; `at(r)` gives, for
    /// rank `r`, the block index in `dst` and in `src`. One copy when the ring order is the rank
    /// order.
    pub(super) fn copy_blocks(
        &self,
        s: &GpuStream,
        dst: &DeviceBuffer,
        src: &DeviceBuffer,
        block: usize,
        at: impl Fn(u32) -> (u32, u32),
    ) -> Result<()> {
        let identity = (0..self.world).all(|r| at(r) == (r, r));
        if identity {
            return s
                .copy(dst, 0, src, 0, block * self.world as usize)
                .map_err(gpu_error);
        }
        for r in 0..self.world {
            let (d, from) = at(r);
            s.copy(dst, d as usize * block, src, from as usize * block, block)
                .map_err(gpu_error)?;
        }
        Ok(())
    }

    /// The allreduce `call` of `buffer` staged through the host ring, piece by piece, once
    /// the work queued on `stream` has run.
    fn staged_all_reduce(
        &self,
        job: &mut HostJob,
        buffer: &DeviceBuffer,
        call: &CallSpec,
        stream: &GpuStream,
    ) -> Result<()> {
        let what = Descriptor {
            algorithm: Algorithm::HostRingGpuStaged,
            call: self.next_call(),
            ..self.descriptor(Collective::AllReduce, call.count, call.dtype, call.op, None)
        };
        let per = job.piece_bytes() / call.dtype.size();
        job.with_staging(buffer, stream, |job, staging| {
            for r in pieces(call.count, per) {
                job.run(&self.aborted, |ring, seq, alive| {
                    let d = Descriptor { seq, ..what };
                    ring.all_reduce_gpu_piece(buffer, r, &d, staging, alive)
                })?;
            }
            super::lifecycle::stream_done(stream, self.staged_deadline())
        })
    }
}

//! Collectives on device memory, queued on the caller's stream: the GPU ring where the ranks
//! share one host, else staged through host memory.

use super::call::CallSpec;
use super::device_buffers::holds;
use super::*;

impl Communicator {
    /// The executor of device memory of this process's communicator: queues `call` on
    /// `stream` (without `send`, in place in `out`).
    pub(super) fn device_verb(
        &self,
        call: CallSpec,
        send: Option<&DeviceBuffer>,
        out: &DeviceBuffer,
        stream: &GpuStream,
    ) -> Result<()> {
        let (n, dtype, op, root) = (call.count, call.dtype, call.op, call.root);
        let block = call.block_bytes()?;
        let mine = self.rank as usize * block;
        match call.kind {
            Collective::AllReduce => {
                if let Some(src) = send {
                    holds(src, block, stream, "send")?;
                    holds(out, block, stream, "recv")?;
                    stream.copy(out, 0, src, 0, block).map_err(gpu_error)?;
                }
                self.device_all_reduce(out, n, dtype, op, stream)
            }
            Collective::ReduceScatter => match send {
                Some(src) => self.device_reduce_scatter(src, out, 0, n, dtype, op, stream),
                None => self.device_reduce_scatter(out, out, mine, n, dtype, op, stream),
            },
            Collective::AllGather => match send {
                Some(src) => self.device_all_gather(src, 0, out, n, dtype, stream),
                None => self.device_all_gather(out, mine, out, n, dtype, stream),
            },
            Collective::Broadcast => {
                if let Some(src) = send.filter(|_| self.rank == root) {
                    holds(src, block, stream, "send")?;
                    holds(out, block, stream, "recv")?;
                    stream.copy(out, 0, src, 0, block).map_err(gpu_error)?;
                }
                self.device_broadcast(out, n, dtype, root, stream)
            }
        }
    }

    /// The device allreduce of the first `count` elements of `buffer`, on `stream`: through the
    /// GPU ring where there is one, else staged through the host ring.
    pub(super) fn device_all_reduce(
        &self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        if !nodetour_core::cuda::same_context(stream.context(), buffer.context()) {
            return Err(Error::InvalidArgument {
                reason: "the stream is not on the buffer's GPU".into(),
            });
        }
        if count
            .checked_mul(dtype.size())
            .is_none_or(|b| b > buffer.len())
        {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{count} elements of {dtype:?} in a buffer of {} bytes",
                    buffer.len()
                ),
            });
        }
        if self.has_gpu_ring() {
            return self.gpu_ring_collective(buffer, Shape::AllReduce, count, dtype, op, stream);
        }
        device_buffers::refuse_capture(stream)?;
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let result = self.staged_all_reduce(job, buffer, count, dtype, op, stream);
        if let Err(e) = &result {
            self.record_failure(&mut state, e);
        }
        result
    }

    /// Whether device collectives run on a GPU ring (queued on the stream, no host wait).
    pub(super) fn has_gpu_ring(&self) -> bool {
        matches!(self.paths.device, DevicePath::GpuRing { .. })
    }

    /// Queues `shape` on the GPU ring, in place on `buffer` (laid out in ring positions). A
    /// failure once the neighbours count on the collective breaks the communicator; arguments
    /// refused before anything was queued do not.
    pub(super) fn gpu_ring_collective(
        &self,
        buffer: &DeviceBuffer,
        shape: Shape,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let ring = job.gpu_ring.as_mut().ok_or_else(|| Error::Unsupported {
            reason: "this communicator has no GPU ring".into(),
        })?;
        ring.number_next(self.next_call());
        let result = match ring.collective(buffer, shape, count, dtype, op, stream) {
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

    pub(super) fn staged_all_reduce(
        &self,
        job: &mut HostJob,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        let what = Descriptor {
            collective: Collective::AllReduce,
            count: count as u64,
            dtype,
            op,
            root: None,
            algorithm: Algorithm::HostRingGpuStaged,
            seq: 0,
            call: self.next_call(),
        };
        let per = job.piece_bytes() / dtype.size();
        job.with_staging(buffer, stream, |job, staging| {
            for r in pieces(count, per) {
                job.run(&self.aborted, |ring, seq, alive| {
                    let d = Descriptor { seq, ..what };
                    ring.all_reduce_gpu_piece(buffer, r, &d, staging, alive)
                })?;
            }
            super::lifecycle::stream_done(stream, self.staged_deadline())
        })
    }
}

//! Collectives on device memory, queued on the caller's stream: the GPU ring where the ranks
//! share one host, else staged through host memory.

use super::*;

impl Communicator {
    /// [`Self::all_reduce_device_in_place`] on the first `count` elements of nodetour's own
    /// device buffer and stream (lower level: what the tools and examples that allocate with
    /// nodetour use).
    pub fn all_reduce_device_buffer(
        &self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        if let Some(m) = &self.member {
            return m
                .all_reduce_buffer(buffer, count, dtype, op, stream)?
                .run_alone(m.timeout());
        }
        self.device_all_reduce(buffer, count, dtype, op, stream)
    }

    /// The owning non-blocking form of [`Self::all_reduce_device_buffer`]: queues the allreduce
    /// and returns a handle that owns `buffer` until [`InFlight::wait`] gives it back (the
    /// buffer cannot be read, reused or freed meanwhile). A collective that cannot be queued
    /// gives the buffer back with the error.
    #[allow(clippy::result_large_err)]
    pub fn start_all_reduce_device_buffer(
        &self,
        buffer: DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> std::result::Result<InFlight<'_>, Failed> {
        let queued = self
            .all_reduce_device_buffer(&buffer, count, dtype, op, stream)
            .and_then(|()| {
                let done =
                    nodetour_core::cuda::GpuEvent::marker(stream.context()).map_err(gpu_error)?;
                stream.record_marker(&done).map_err(gpu_error)?;
                Ok(done)
            });
        match queued {
            Ok(done) => Ok(InFlight {
                comm: self,
                buffer: Some(buffer),
                done,
            }),
            Err(error) => Err(Failed { error, buffer }),
        }
    }

    /// Allreduces `send` into `recv` on every rank: device memory of this rank's GPU
    /// ([`Options::gpu`]), as cudarc slices or views, queued on `stream` (the caller's stream of
    /// that GPU). On a GPU ring ([`DevicePath::GpuRing`]) the call queues the collective after
    /// the work already on `stream` and returns: no host wait, no device-wide synchronisation;
    /// work queued on `stream` afterwards sees the result, and a failure after the call returned
    /// is reported by [`Self::wait`], [`Self::error`] or the next call. Staged through host
    /// memory ([`DevicePath::Staged`]) it waits for `stream` before returning. cudarc's own
    /// ordering of the slices (its read and write events) is kept.
    pub fn all_reduce_device<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m
                .all_reduce_from(send, recv, op, stream)?
                .run_alone(m.timeout());
        }
        same_len(send.len(), recv.len(), "send", "recv")?;
        let (n, bytes) = (recv.len(), recv.num_bytes());
        let s = GpuStream::of_cudarc(stream);
        with_cudarc_slice_mut(recv, stream, |out| {
            with_cudarc_slice(send, stream, |inp| s.copy(out, 0, inp, 0, bytes))??;
            self.device_all_reduce(out, n, T::DATA_TYPE, op, &s)
        })?
    }

    /// [`Self::all_reduce_device`] with `data` as both input and output.
    pub fn all_reduce_device_in_place<T, R>(
        &self,
        data: &mut R,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m.all_reduce(data, op, stream)?.run_alone(m.timeout());
        }
        let n = data.len();
        let s = GpuStream::of_cudarc(stream);
        with_cudarc_slice_mut(data, stream, |buf| {
            self.device_all_reduce(buf, n, T::DATA_TYPE, op, &s)
        })?
    }

    /// [`Self::reduce_scatter`] on device memory (cudarc slices of [`Options::gpu`]'s GPU):
    /// `send` holds `world` blocks of `recv.len()` elements; `recv` gets block `rank` of the
    /// reduction; `send` is never written. On a GPU ring it is queued on `stream` like
    /// [`Self::all_reduce_device`] (`send` is copied into the communicator's scratch buffer,
    /// reduced there, and this rank's block copied out; under CUDA graph capture the scratch
    /// is the graph's own); staged, it is copied out on `stream`, reduced by the host ring and
    /// copied back: synchronous, waiting for `stream` only. On nodetour's buffers or a
    /// runtime's own memory with the type at run time:
    /// [`Self::reduce_scatter_device_buffer`].
    pub fn reduce_scatter_device<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m
                .reduce_scatter(send, recv, op, stream)?
                .run_alone(m.timeout());
        }
        self.blocks(send.len(), recv.len(), "send", "recv")?;
        let s = GpuStream::of_cudarc(stream);
        let count = recv.len();
        with_cudarc_slice_mut(recv, stream, |out| {
            with_cudarc_slice(send, stream, |inp| {
                self.reduce_scatter_device_buffer(inp, out, count, T::DATA_TYPE, op, &s)
            })?
        })?
    }

    /// [`Self::all_gather`] on device memory: `recv` holds `world` blocks of `send.len()`
    /// elements. Queued on a GPU ring, staged elsewhere (as [`Self::reduce_scatter_device`]).
    pub fn all_gather_device<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m.all_gather(send, recv, stream)?.run_alone(m.timeout());
        }
        self.blocks(recv.len(), send.len(), "recv", "send")?;
        let s = GpuStream::of_cudarc(stream);
        let count = send.len();
        with_cudarc_slice_mut(recv, stream, |out| {
            with_cudarc_slice(send, stream, |inp| {
                self.all_gather_device_buffer(inp, out, count, T::DATA_TYPE, &s)
            })?
        })?
    }

    /// [`Self::broadcast`] on device memory: rank `root`'s `data` into `data` everywhere.
    /// Queued on a GPU ring, staged elsewhere (as [`Self::reduce_scatter_device`]).
    pub fn broadcast_device_in_place<T, R>(
        &self,
        data: &mut R,
        root: u32,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        R: DevicePtr<T> + DevicePtrMut<T>,
    {
        self.check_root(root)?;
        if let Some(m) = &self.member {
            return m
                .broadcast(data, root as usize, stream)?
                .run_alone(m.timeout());
        }
        let s = GpuStream::of_cudarc(stream);
        let count = data.len();
        with_cudarc_slice_mut(data, stream, |buf| {
            self.broadcast_device_buffer(buf, count, T::DATA_TYPE, root, &s)
        })?
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
            state.failed.get_or_insert_with(|| e.clone());
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
        let result = match ring.collective(buffer, shape, count, dtype, op, stream) {
            Err(e @ (Error::InvalidArgument { .. } | Error::Unsupported { .. })) => return Err(e),
            other => other.map_err(|e| self.job_ranks(e)),
        };
        if let Err(e) = &result {
            state.failed.get_or_insert_with(|| e.clone());
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
        };
        let per = job.piece_bytes() / dtype.size();
        job.with_staging(buffer, stream, |job, staging| {
            for r in pieces(count, per) {
                job.run(&self.aborted, |ring, seq, alive| {
                    let d = Descriptor { seq, ..what };
                    ring.all_reduce_gpu_piece(buffer, r, &d, staging, alive)
                })?;
            }
            stream.synchronize().map_err(gpu_error)
        })
    }
}

//! What the schedule does with a landed chunk: reduce or copy it into host memory, or stage
//! it through GPU memory (`GpuStaging`).

use super::*;

/// A landed chunk: byte offset `slot` in the slot region, `n` bytes, for byte offset `at` of
/// the buffer.
#[derive(Clone, Copy)]
pub(super) struct Chunk {
    pub(super) slot: usize,
    pub(super) at: usize,
    pub(super) n: usize,
}

/// What a rank does with a chunk that landed in its slot; the work region always holds the
/// values this rank sends on.
pub(super) trait ChunkOps {
    /// `local[at..at + n] = op(local[at..at + n], recv[slot..slot + n])`.
    fn reduce(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()>;
    /// `local[at..at + n] = recv[slot..slot + n]`.
    fn copy(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()>;
}

/// Host buffers: the work region is the local buffer, reduced by the CPU.
pub(super) struct HostOps<'a> {
    pub(super) dtype: DataType,
    pub(super) op: ReduceOp,
    // 8-byte aligned (as u64s), so that the reduction runs typed and vectorised.
    pub(super) scratch: Vec<u64>,
    pub(super) mine: Vec<u64>,
    /// The caller's input in the buffer's layout, where reductions read this rank's own values
    /// from it rather than from the work region (an allreduce's reduce-scatter reduces each
    /// range once, into this rank's input: only the ranges sent unreduced are staged). A
    /// PreMulSum multiplies what it reads from here; what it reads from the work region was
    /// multiplied when it was staged ([`HostRing::stage_in_as`]).
    pub(super) input: Option<&'a [u8]>,
}

/// Bytes reduced at a time: the two copies out and the one back stay in the core's cache, so a
/// chunk costs about what an in-place reduction would (the slot read once, the work region read
/// and written once). A multiple of every element size.
pub(super) const REDUCE_BLOCK: usize = 32 << 10;

impl ChunkOps for HostOps<'_> {
    fn reduce(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        let scratch: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch);
        let mine: &mut [u8] = bytemuck::cast_slice_mut(&mut self.mine);
        let mut done = 0;
        while done < n {
            let k = (n - done).min(REDUCE_BLOCK).min(scratch.len());
            recv.read_at(slot + done, &mut scratch[..k])?;
            match self.input {
                Some(input) => {
                    let from = input.get(at + done..at + done + k).ok_or_else(|| {
                        Error::InvalidArgument {
                            reason: format!(
                                "a chunk at {} of {k} bytes past an input of {}",
                                at + done,
                                input.len()
                            ),
                        }
                    })?;
                    // A PreMulSum multiplies this rank's values here, as they are first read.
                    copy_scaled(self.dtype, self.op, &mut mine[..k], from)?;
                }
                None => work.read_at(at + done, &mut mine[..k])?,
            }
            reduce_into(self.dtype, self.op, &mut mine[..k], &scratch[..k])?;
            work.write_at(at + done, &mine[..k])?;
            done += k;
        }
        Ok(())
    }

    fn copy(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        Ok(recv.copy_to(slot, work, at, n)?)
    }
}

/// What the staged GPU path needs on this rank's GPU: its reduction kernels, a stream, and a
/// scratch buffer of at least one slot.
pub(crate) struct GpuStaging<'a> {
    /// The kernels of the buffer's GPU.
    pub kernels: &'a ReduceKernels,
    /// A stream of the buffer's GPU (the caller's: the collective runs after its queued work,
    /// and the call waits for this stream only).
    pub stream: &'a GpuStream,
    /// At least `slot_bytes` of GPU memory.
    pub scratch: &'a DeviceBuffer,
}

/// GPU buffers staged through host slots: chunks land in host memory, are copied to the GPU and
/// reduced there; the reduced chunk is copied back to the work region, from which it is sent on.
pub(super) struct GpuOps<'a> {
    pub(super) staging: &'a GpuStaging<'a>,
    pub(super) buffer: &'a DeviceBuffer,
    /// Byte offset of the piece in `buffer` (work-region offset 0).
    pub(super) base: usize,
    pub(super) dtype: DataType,
    pub(super) op: ReduceOp,
    pub(super) bounce: Vec<u8>,
}

/// A CUDA call of the staged GPU path failed (its error kept as the source).
pub(super) fn gpu(e: nodetour_core::Error) -> Error {
    Error::gpu("staging a GPU piece through the host ring", e)
}

impl ChunkOps for GpuOps<'_> {
    fn reduce(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        let st = self.staging;
        recv.copy_to_gpu(slot, st.scratch, 0, n, st.stream)
            .map_err(gpu)?;
        let count = n / self.dtype.size();
        st.kernels
            .reduce(
                st.stream,
                Reduction {
                    dtype: self.dtype,
                    op: self.op,
                },
                At::new(self.buffer, self.base + at),
                At::new(st.scratch, 0),
                count,
            )
            .map_err(gpu)?;
        // After the reduce (the same stream), waited for on that stream.
        work.copy_from_gpu(at, self.buffer, self.base + at, n, st.stream)
            .map_err(gpu)
    }

    fn copy(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        recv.copy_to_gpu(slot, self.buffer, self.base + at, n, self.staging.stream)
            .map_err(gpu)?;
        recv.read_at(slot, &mut self.bounce[..n])?;
        work.write_at(at, &self.bounce[..n])?;
        Ok(())
    }
}

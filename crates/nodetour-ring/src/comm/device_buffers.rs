//! The device reduce-scatter, all-gather and broadcast of a process's communicator on views
//! of device memory (what every device operand becomes, see `operand`), at byte offsets for
//! the in-place forms.
//!
//! On a GPU ring every call is queued on the stream and can be captured into a graph (its
//! scratch is then the graph's own, see `scratch`); staged through host memory it waits for
//! the stream, runs the host ring and copies back, and is refused under capture.

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;

use super::engine::Engine;
use super::{gpu_error, scratch};
use crate::call::{CallSpec, element_bytes};
use crate::error::{Error, Result};

impl Engine {
    /// How long a staged device collective waits for the work queued before it (the
    /// communicator's timeout): its stream never holds the host without a deadline.
    pub(super) fn staged_deadline(&self) -> nodetour_core::Deadline {
        nodetour_core::Deadline::after(self.timeout)
    }

    /// Bytes of one block of `call` and of every rank's blocks.
    fn block_and_whole(&self, call: &CallSpec) -> Result<(usize, usize)> {
        let whole = element_bytes(call.count, self.world as usize, call.dtype)?;
        Ok((call.block_bytes()?, whole))
    }

    /// The device reduce-scatter `call`: `send` holds `world` blocks (block `r` for rank
    /// `r`); the block of `recv` at byte `out_at` gets block `rank` of the reduction; `send`
    /// is never written (unless it is `recv`: in place).
    pub(super) fn device_reduce_scatter(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        out_at: usize,
        call: &CallSpec,
        stream: &GpuStream,
    ) -> Result<()> {
        let (block, whole) = self.block_and_whole(call)?;
        holds(send, whole, stream, "send")?;
        holds(recv, out_at + block, stream, "recv")?;
        if self.has_gpu_ring() {
            return scratch::with_scratch(&self.scratch, stream.context(), whole, stream, |all| {
                // Rank r's block goes to its ring position's segment.
                self.copy_blocks(stream, all, send, block, |r| (self.position_of(r), r))?;
                let on_ring = call.on_ring(self.world, 0);
                self.on_gpu_ring(|ring| ring.collective(all, on_ring, stream))?;
                let at = self.position() as usize * block;
                stream.copy(recv, out_at, all, at, block).map_err(gpu_error)
            });
        }
        let input = staged_in(send, 0, whole, stream, self.staged_deadline())?;
        let mut out = vec![0u8; block];
        self.reduce_scatter_into(Some(&input), &mut out, call.count, 0, call.dtype, call.op)?;
        recv.copy_from_host(out_at, &out).map_err(gpu_error)
    }

    /// The device all-gather `call`: the block of `send` at byte `send_at` from every rank
    /// into `recv` (`world` blocks, block `r` from rank `r`).
    pub(super) fn device_all_gather(
        &self,
        send: &DeviceBuffer,
        send_at: usize,
        recv: &DeviceBuffer,
        call: &CallSpec,
        stream: &GpuStream,
    ) -> Result<()> {
        let (block, whole) = self.block_and_whole(call)?;
        holds(send, send_at + block, stream, "send")?;
        holds(recv, whole, stream, "recv")?;
        if self.has_gpu_ring() {
            return scratch::with_scratch(&self.scratch, stream.context(), whole, stream, |all| {
                let at = self.position() as usize * block;
                stream
                    .copy(all, at, send, send_at, block)
                    .map_err(gpu_error)?;
                let on_ring = call.on_ring(self.world, 0);
                self.on_gpu_ring(|ring| ring.collective(all, on_ring, stream))?;
                // Ring position p's segment is rank order[p]'s block.
                self.copy_blocks(stream, recv, all, block, |r| (r, self.position_of(r)))
            });
        }
        let input = staged_in(send, send_at, block, stream, self.staged_deadline())?;
        let mut out = vec![0u8; whole];
        self.all_gather_into(Some(&input), &mut out, call.count, call.dtype)?;
        recv.copy_from_host(0, &out).map_err(gpu_error)
    }

    /// The device broadcast `call`: rank `root`'s block into `data` on every rank.
    pub(super) fn device_broadcast(
        &self,
        data: &DeviceBuffer,
        call: &CallSpec,
        stream: &GpuStream,
    ) -> Result<()> {
        let bytes = call.block_bytes()?;
        holds(data, bytes, stream, "data")?;
        if self.has_gpu_ring() {
            let on_ring = call.on_ring(self.world, self.position_of(call.root));
            return self.on_gpu_ring(|ring| ring.collective(data, on_ring, stream));
        }
        let mut host = if self.rank == call.root {
            staged_in(data, 0, bytes, stream, self.staged_deadline())?
        } else {
            // Written below from the host: after the work already queued on `stream`.
            refuse_capture(stream)?;
            super::lifecycle::stream_done(stream, self.staged_deadline())?;
            vec![0u8; bytes]
        };
        self.broadcast_into(None, &mut host, call.root, call.dtype)?;
        data.copy_from_host(0, &host).map_err(gpu_error)
    }
}

/// `InvalidArgument` unless `buffer` holds `bytes` bytes and lives on `stream`'s GPU.
pub(super) fn holds(
    buffer: &DeviceBuffer,
    bytes: usize,
    stream: &GpuStream,
    what: &str,
) -> Result<()> {
    if !nodetour_core::cuda::same_context(stream.context(), buffer.context()) {
        return Err(Error::InvalidArgument {
            reason: format!("the stream is not on {what}'s GPU"),
        });
    }
    if buffer.len() < bytes {
        return Err(Error::InvalidArgument {
            reason: format!(
                "{what} holds {} bytes, the collective needs {bytes}",
                buffer.len()
            ),
        });
    }
    Ok(())
}

/// `bytes` bytes of `buffer` at `at`, after the work queued on `stream` (waited for, to
/// `deadline`): the staged path's input. Refused under capture (see [`refuse_capture`]).
fn staged_in(
    buffer: &DeviceBuffer,
    at: usize,
    bytes: usize,
    stream: &GpuStream,
    deadline: nodetour_core::Deadline,
) -> Result<Vec<u8>> {
    refuse_capture(stream)?;
    super::lifecycle::stream_done(stream, deadline)?;
    let mut host = vec![0u8; bytes];
    buffer.copy_to_host(at, &mut host).map_err(gpu_error)?;
    Ok(host)
}

/// `Unsupported` when `stream` is being captured into a CUDA graph: the staged path runs the
/// host ring when called and waits for the stream, which a capture can neither record nor
/// allow (waiting for a capturing stream would end the caller's capture with an error).
pub(crate) fn refuse_capture(stream: &GpuStream) -> Result<()> {
    if stream.is_capturing().map_err(gpu_error)? {
        return Err(Error::Unsupported {
            reason: "a device collective staged through host memory (this communicator has no \
                     GPU ring) cannot be captured into a CUDA graph: its host ring runs when \
                     called"
                .into(),
        });
    }
    Ok(())
}

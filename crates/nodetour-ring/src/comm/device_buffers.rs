//! The device collectives on nodetour's device buffers, or on views of a runtime's own memory
//! ([`DeviceBuffer::borrowed`]) and streams ([`GpuStream::borrowed`]), with the element type
//! at run time, as NCCL takes a pointer, a count and a datatype: what runtimes that do not use
//! cudarc call, and what a CUDA graph captures without cudarc's event tracking. The cudarc
//! forms ([`Communicator::reduce_scatter_device`] and the others) come here with views of
//! their slices.
//!
//! On a GPU ring every call is queued on the stream and can be captured into a graph (its
//! scratch is then the graph's own, see `scratch`); in a [`Communicator::from_devices`] set it
//! meets the other members (captured when every member's stream is in one capture); staged
//! through host memory it waits for the stream, runs the host ring and copies back, and is
//! refused under capture.

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;

use super::device_set::element_bytes;
use super::{Communicator, gpu_error, scratch};
use crate::element::{Element, typed};
use crate::error::{Error, Result};
use crate::plan::Shape;
use crate::reduce::{DataType, ReduceOp};
use bytemuck::Zeroable;

impl Communicator {
    /// [`Self::reduce_scatter_device`] on device buffers: `send` holds `world` blocks of
    /// `count` elements of `dtype` (block `r` for rank `r`); the first `count` elements of
    /// `recv` get block `rank` of the reduction; `send` is never written.
    pub fn reduce_scatter_device_buffer(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        if let Some(m) = &self.member {
            return m
                .reduce_scatter_buffer(send, recv, count, dtype, op, stream)?
                .run_alone(m.timeout());
        }
        let world = self.world as usize;
        let (block, whole) = (
            element_bytes(count, 1, dtype)?,
            element_bytes(count, world, dtype)?,
        );
        holds(send, whole, stream, "send")?;
        holds(recv, block, stream, "recv")?;
        if self.has_gpu_ring() {
            return scratch::with_scratch(&self.scratch, stream.context(), whole, stream, |all| {
                // Rank r's block goes to its ring position's segment.
                self.copy_blocks(stream, all, send, block, |r| (self.position_of(r), r))?;
                self.gpu_ring_collective(
                    all,
                    Shape::ReduceScatter,
                    count * world,
                    dtype,
                    op,
                    stream,
                )?;
                let at = self.position() as usize * block;
                stream.copy(recv, 0, all, at, block).map_err(gpu_error)
            });
        }
        let input = staged_in(send, whole, stream)?;
        let out = typed!(dtype, T => {
            let input: Vec<T> = elements(&input);
            let mut out = vec![T::zeroed(); count];
            self.reduce_scatter(&input, &mut out, op)?;
            bytemuck::cast_slice::<T, u8>(&out).to_vec()
        });
        recv.copy_from_host(0, &out).map_err(gpu_error)
    }

    /// [`Self::all_gather_device`] on device buffers: the first `count` elements of `dtype` of
    /// `send` from every rank into `recv` (`world` blocks of `count`, block `r` from rank `r`).
    pub fn all_gather_device_buffer(
        &self,
        send: &DeviceBuffer,
        recv: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        stream: &GpuStream,
    ) -> Result<()> {
        if let Some(m) = &self.member {
            return m
                .all_gather_buffer(send, recv, count, dtype, stream)?
                .run_alone(m.timeout());
        }
        let world = self.world as usize;
        let (block, whole) = (
            element_bytes(count, 1, dtype)?,
            element_bytes(count, world, dtype)?,
        );
        holds(send, block, stream, "send")?;
        holds(recv, whole, stream, "recv")?;
        if self.has_gpu_ring() {
            return scratch::with_scratch(&self.scratch, stream.context(), whole, stream, |all| {
                let at = self.position() as usize * block;
                stream.copy(all, at, send, 0, block).map_err(gpu_error)?;
                self.gpu_ring_collective(
                    all,
                    Shape::AllGather,
                    count * world,
                    dtype,
                    ReduceOp::Sum,
                    stream,
                )?;
                // Ring position p's segment is rank order[p]'s block.
                self.copy_blocks(stream, recv, all, block, |r| (r, self.position_of(r)))
            });
        }
        let input = staged_in(send, block, stream)?;
        let out = typed!(dtype, T => {
            let input: Vec<T> = elements(&input);
            let mut out = vec![T::zeroed(); count * world];
            self.all_gather(&input, &mut out)?;
            bytemuck::cast_slice::<T, u8>(&out).to_vec()
        });
        recv.copy_from_host(0, &out).map_err(gpu_error)
    }

    /// [`Self::broadcast_device_in_place`] on a device buffer: rank `root`'s first `count`
    /// elements of `dtype` into `data` on every rank.
    pub fn broadcast_device_buffer(
        &self,
        data: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        root: u32,
        stream: &GpuStream,
    ) -> Result<()> {
        self.check_root(root)?;
        if let Some(m) = &self.member {
            return m
                .broadcast_buffer(data, count, dtype, root as usize, stream)?
                .run_alone(m.timeout());
        }
        let bytes = element_bytes(count, 1, dtype)?;
        holds(data, bytes, stream, "data")?;
        if self.has_gpu_ring() {
            let root = self.position_of(root);
            return self.gpu_ring_collective(
                data,
                Shape::Broadcast { root },
                count,
                dtype,
                ReduceOp::Sum,
                stream,
            );
        }
        let mut host = if self.rank == root {
            staged_in(data, bytes, stream)?
        } else {
            // Written below from the host: after the work already queued on `stream`.
            refuse_capture(stream)?;
            stream.synchronize().map_err(gpu_error)?;
            vec![0u8; bytes]
        };
        self.broadcast_in_place(&mut host, root)?;
        data.copy_from_host(0, &host).map_err(gpu_error)
    }
}

/// `InvalidArgument` unless `buffer` holds `bytes` bytes and lives on `stream`'s GPU.
fn holds(buffer: &DeviceBuffer, bytes: usize, stream: &GpuStream, what: &str) -> Result<()> {
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

/// The first `bytes` bytes of `buffer`, after the work queued on `stream` (waited for): the
/// staged path's input. Refused under capture (see [`refuse_capture`]).
fn staged_in(buffer: &DeviceBuffer, bytes: usize, stream: &GpuStream) -> Result<Vec<u8>> {
    refuse_capture(stream)?;
    stream.synchronize().map_err(gpu_error)?;
    let mut host = vec![0u8; bytes];
    buffer.copy_to_host(0, &mut host).map_err(gpu_error)?;
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

/// `bytes` (whole elements) as a vector of `T`.
fn elements<T: Element>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

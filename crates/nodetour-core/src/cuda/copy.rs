//! Copies between raw host memory that peers may write (slot and work regions, never visible
//! as slices) and GPU buffers, ordered on a stream and waited for on that stream only (never the
//! whole device). Callers check both ranges. The buffers do not note the stream (see
//! `DeviceBuffer::note_use`): the copy has landed when these return, so nothing is left for
//! their release to wait for, and they do not keep a finished stream alive.

use super::GpuStream;
use super::device_buffer::DeviceBuffer;
use crate::error::Result;

/// Copies `len` bytes from host memory at `src` into `dst` at `dst_offset` on `stream` (after
/// the work already queued there), and waits for that stream until they have landed.
pub(crate) fn htod(
    dst: &DeviceBuffer,
    dst_offset: usize,
    src: *const u8,
    len: usize,
    stream: &GpuStream,
) -> Result<()> {
    let s = stream.bind()?;
    // SAFETY: the caller checked that src..src+len is readable host memory that stays valid
    // until the copy has landed (we wait for the stream below) and that the destination range
    // lies inside `dst`.
    unsafe {
        super::result::memcpy_htod_async(dst.device_ptr() + dst_offset as u64, src.cast(), len, s)
    }?;
    stream.synchronize()
}

/// Copies `len` bytes of `src` at `src_offset` into host memory at `dst` on `stream` (after the
/// work already queued there), and waits for that stream until they have landed.
pub(crate) fn dtoh(
    dst: *mut u8,
    src: &DeviceBuffer,
    src_offset: usize,
    len: usize,
    stream: &GpuStream,
) -> Result<()> {
    let s = stream.bind()?;
    // SAFETY: the caller checked that dst..dst+len is writable host memory nobody else uses
    // until the copy has landed (we wait for the stream below), and that the source range lies
    // inside `src`.
    unsafe {
        super::result::memcpy_dtoh_async(dst.cast(), src.device_ptr() + src_offset as u64, len, s)
    }?;
    stream.synchronize()
}

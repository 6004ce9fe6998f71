//! Synchronous copies between raw host memory that peers may write (slot and work regions,
//! never visible as slices) and GPU buffers. Callers check both ranges.

use cudarc::driver::sys;

use super::result::cuda_error;
use crate::error::Result;
use crate::memory::DeviceBuffer;

/// Copies `len` bytes from host memory at `src` into `dst` at `dst_offset`, and waits until
/// they have landed (from pageable memory `cuMemcpyHtoD` returns before the DMA finishes, and
/// non-blocking streams are not ordered after it).
pub(crate) fn htod(
    dst: &DeviceBuffer,
    dst_offset: usize,
    src: *const u8,
    len: usize,
) -> Result<()> {
    let ctx = dst.context();
    ctx.bind_to_thread()
        .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
    // SAFETY: the caller checked that src..src+len is readable host memory and that the
    // destination range lies inside `dst`.
    unsafe { sys::cuMemcpyHtoD_v2(dst.device_ptr() + dst_offset as u64, src.cast(), len) }
        .result()
        .map_err(|e| cuda_error("cuMemcpyHtoD", e))?;
    ctx.synchronize()
        .map_err(|e| cuda_error("cuCtxSynchronize", e))
}

/// Copies `len` bytes of `src` at `src_offset` into host memory at `dst` (synchronous, after
/// everything already queued on `src`'s GPU has finished).
pub(crate) fn dtoh(dst: *mut u8, src: &DeviceBuffer, src_offset: usize, len: usize) -> Result<()> {
    let ctx = src.context();
    ctx.bind_to_thread()
        .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
    ctx.synchronize()
        .map_err(|e| cuda_error("cuCtxSynchronize", e))?;
    // SAFETY: the caller checked that dst..dst+len is writable host memory nobody else uses
    // during the copy, and that the source range lies inside `src`.
    unsafe { sys::cuMemcpyDtoH_v2(dst.cast(), src.device_ptr() + src_offset as u64, len) }
        .result()
        .map_err(|e| cuda_error("cuMemcpyDtoH", e))
}

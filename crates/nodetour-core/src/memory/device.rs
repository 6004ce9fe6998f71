//! GPU memory that a NIC or a peer may write: dedicated, aligned allocations.

use std::os::fd::OwnedFd;
use std::sync::Arc;

use cudarc::driver::{CudaContext, result, sys};

use super::RdmaBuffer;
use crate::cuda::result::{cuda_error, dmabuf_fd};
use crate::error::{Error, Result};

/// Alignment and size granularity of GPU buffers: the GPU page size that peer mappings (and
/// nvidia-peermem) work in.
pub const DEVICE_ALIGNMENT: usize = 64 << 10;

/// A dedicated GPU allocation, 64 KiB-aligned, a multiple of 64 KiB long.
///
/// Dedicated means nothing else lives in it: it never comes from a caching allocator, so
/// registering or exporting it exposes only itself. The CPU cannot dereference its address; it
/// is not [`HostAccessible`](super::HostAccessible), so registered regions over it offer no
/// `read_at`/`write_at` (copy with the GPU instead).
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    // The allocation as returned by cuMemAlloc (ptr is aligned within it); freed in Drop.
    base: sys::CUdeviceptr,
    context: Arc<CudaContext>,
}

// SAFETY: a device pointer is usable from any thread that binds the context.
unsafe impl Send for DeviceBuffer {}
// SAFETY: &self methods only copy through the driver.
unsafe impl Sync for DeviceBuffer {}

/// A dma-buf exported from GPU memory, for `ibv_reg_dmabuf_mr`.
#[derive(Debug)]
pub struct DmabufExport {
    /// The dma-buf. Owned: closed when dropped. Registration takes its own reference in the
    /// kernel, so the descriptor may be closed as soon as `ibv_reg_dmabuf_mr` returns.
    pub fd: OwnedFd,
    /// Offset of the buffer in the dma-buf (0: the export starts at the buffer).
    pub offset: u64,
    /// Bytes exported.
    pub len: usize,
}

impl DeviceBuffer {
    /// Allocates at least `len` bytes (rounded up to 64 KiB) on the GPU of `context`.
    pub fn new(context: &Arc<CudaContext>, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidRegistration {
                reason: "a GPU buffer of zero bytes".into(),
            });
        }
        let rounded = len
            .checked_next_multiple_of(DEVICE_ALIGNMENT)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("{len} bytes cannot be rounded to 64 KiB"),
            })?;
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // One alignment unit of slack lets the buffer start on a 64 KiB boundary whatever
        // cuMemAlloc returns (in practice it is already 2 MiB-aligned for large sizes).
        // SAFETY: the context is current.
        let base = unsafe { result::malloc_sync(rounded + DEVICE_ALIGNMENT) }
            .map_err(|e| cuda_error("cuMemAlloc", e))?;
        let ptr = base.next_multiple_of(DEVICE_ALIGNMENT as u64);
        // Zero all of it, the alignment slack too: nothing of an earlier owner of this memory
        // is ever sent, and a peer that maps the whole allocation (cuda-ipc exports it whole)
        // finds only zeros outside the buffer.
        // SAFETY: [base, base+rounded+DEVICE_ALIGNMENT) is the allocation just made.
        unsafe { result::memset_d8_sync(base, 0, rounded + DEVICE_ALIGNMENT) }
            .map_err(|e| cuda_error("cuMemsetD8", e))?;
        Ok(DeviceBuffer {
            ptr,
            len: rounded,
            base,
            context: context.clone(),
        })
    }

    /// The GPU virtual address.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The allocation's base address and the buffer's offset in it (for IPC export).
    pub(crate) fn allocation(&self) -> (u64, u64) {
        (self.base, self.ptr - self.base)
    }

    /// The CUDA context (and so the GPU) the memory belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// Exports the buffer as a dma-buf (`cuMemGetHandleForAddressRange`), the input of
    /// `ibv_reg_dmabuf_mr`. Fails with `Unsupported` where the driver lacks the call, and with
    /// `Cuda { code: "CUDA_ERROR_NOT_SUPPORTED" }` where the GPU or kernel cannot export.
    pub fn export_dmabuf(&self) -> Result<DmabufExport> {
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: CUDA is initialised (the buffer exists); the range is this live allocation,
        // host-page aligned at both ends (64 KiB granularity).
        let fd = unsafe { dmabuf_fd(self.ptr, self.len)? };
        Ok(DmabufExport {
            fd,
            offset: 0,
            len: self.len,
        })
    }

    /// Copies `src` into the buffer at `offset`. Synchronous: on return the bytes are in GPU
    /// memory, visible to work queued afterwards on any stream.
    pub fn copy_from_host(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check("copy to GPU", offset, src.len())?;
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: the destination range is inside the allocation (checked); src is host memory.
        unsafe { result::memcpy_htod_sync(self.ptr + offset as u64, src) }
            .map_err(|e| cuda_error("cuMemcpyHtoD", e))?;
        // From pageable memory cuMemcpyHtoD returns once `src` is staged, before the DMA into
        // the GPU lands, and non-blocking streams are not ordered after it: wait for the
        // context, so that work queued on any stream afterwards sees the new bytes.
        self.context
            .synchronize()
            .map_err(|e| cuda_error("cuCtxSynchronize", e))
    }

    /// Copies `dst.len()` bytes at `offset` out of the buffer (synchronously).
    pub fn copy_to_host(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check("copy from GPU", offset, dst.len())?;
        self.context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: as above.
        unsafe { result::memcpy_dtoh_sync(dst, self.ptr + offset as u64) }
            .map_err(|e| cuda_error("cuMemcpyDtoH", e))
    }

    /// `len` bytes at `offset` lie inside the buffer; `OutOfBounds` naming `what` otherwise.
    pub(crate) fn check(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what,
                offset: offset as u64,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Failure policy: log and leak (a failing free means the context is already gone).
        if let Err(e) = self.context.bind_to_thread() {
            tracing::warn!(error = ?e, "binding the CUDA context to free a GPU buffer failed");
            return;
        }
        // Queued copies or kernels may still use the memory: let them finish first.
        if let Err(e) = self.context.synchronize() {
            tracing::warn!(error = ?e, "synchronising before freeing a GPU buffer failed");
        }
        // SAFETY: base came from malloc_sync in this context; no region is registered over it
        // any more (a MemoryRegion owns its buffer and deregisters before dropping it), and no
        // queued work uses it (synchronised above).
        if let Err(e) = unsafe { result::free_sync(self.base) } {
            tracing::warn!(error = ?e, "cuMemFree failed");
        }
    }
}

// SAFETY: ptr..ptr+len is inside a live dedicated allocation that this value owns and frees only
// in Drop; the address is a GPU virtual address (never dereferenced by the CPU).
unsafe impl RdmaBuffer for DeviceBuffer {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr as *mut u8
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &'static str {
        "gpu"
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("gpu", &self.context.ordinal())
            .finish()
    }
}

//! Memory that NICs and peers may read and write.
//!
//! A buffer that is registered for RDMA can be written by hardware at any moment, so safe code
//! never holds a `&[u8]`/`&mut [u8]` into it while it is registered: a buffer type implements
//! [`RdmaBuffer`] (an address that never moves, and a length), registration takes the buffer by
//! value, and the registered region hands out copies (`read_at`/`write_at`, only for
//! [`HostAccessible`] memory) until it is deregistered and gives the buffer back.

mod host;
mod shared;
mod shm_name;

pub use crate::cuda::device_buffer::{
    DEVICE_ALIGNMENT, DeviceBuffer, DmabufExport, with_cudarc_slice, with_cudarc_slice_mut,
};
pub use host::{HUGE_PAGE, HostBuffer, HugePages, Pages};
pub use shared::SharedHostMemory;
pub use shm_name::{ShmDir, ShmName};

/// Memory that can be registered with an RDMA device.
///
/// # Safety
/// Implementors guarantee that `as_mut_ptr()` returns the same address for the whole life of
/// the value (moving the value must not move the memory), that `len()` bytes from it stay
/// allocated until the value is dropped, and that nothing else frees or remaps that memory
/// meanwhile. The address is a host virtual address, or a GPU virtual address for GPU memory.
pub unsafe trait RdmaBuffer: Send + Sync + 'static {
    /// Start of the memory.
    fn as_mut_ptr(&self) -> *mut u8;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether the length is zero.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// What kind of memory this is, for messages ("host", "gpu").
    fn kind(&self) -> &'static str;
}

/// Marks buffers whose address the CPU may dereference (host memory, not GPU memory).
///
/// # Safety
/// `as_mut_ptr()..+len()` must be readable and writable host memory.
pub unsafe trait HostAccessible: RdmaBuffer {}

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 { n as usize } else { 4096 }
}

// SAFETY: the buffer's range is inside a live dedicated allocation that the value owns and frees
// only in Drop (a borrowed view: the caller's memory, alive while the view is, by its
// constructor's contract); the address is a GPU virtual address (never dereferenced by the CPU).
unsafe impl RdmaBuffer for DeviceBuffer {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.device_ptr() as *mut u8
    }
    fn len(&self) -> usize {
        DeviceBuffer::len(self)
    }
    fn kind(&self) -> &'static str {
        "gpu"
    }
}

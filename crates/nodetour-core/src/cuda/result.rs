//! One fallible function per CUDA driver call that cudarc leaves raw.
//!
//! # Safety
//! Callers have checked [`super::driver::availability`] (libcuda loaded and initialised) and
//! bound a context to the calling thread where the call needs one.

use std::ffi::{CString, c_void};
use std::os::fd::{FromRawFd, OwnedFd};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys;

use crate::error::Error;

/// The error name of a CUDA result (`CUDA_ERROR_OUT_OF_MEMORY`).
pub(crate) fn error_name(e: DriverError) -> String {
    format!("{:?}", e.0)
}

/// Builds [`Error::Cuda`] for `op`.
pub(crate) fn cuda_error(op: &'static str, e: DriverError) -> Error {
    let hint = match e.0 {
        sys::CUresult::CUDA_ERROR_NOT_SUPPORTED => "the GPU or driver does not support this",
        sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => "out of GPU memory (or pinned host memory)",
        sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED => {
            "the host range is already registered with CUDA"
        }
        sys::CUresult::CUDA_ERROR_INVALID_VALUE => "an argument is out of range",
        _ => "",
    };
    Error::Cuda {
        op,
        code: error_name(e),
        hint,
    }
}

/// Resolves a driver entry point by name with `cuGetProcAddress`, as the driver exposes it for
/// CUDA version `version` (e.g. 11070). `None` when this driver lacks it.
pub(crate) unsafe fn proc_address(symbol: &str, version: i32) -> Option<*mut c_void> {
    type GetProcAddress =
        unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void, i32, u64) -> sys::CUresult;
    // cuGetProcAddress (the v1 ABI, CUDA 11.3+) is looked up by hand: cudarc's loader would
    // panic on a driver that lacks it.
    // SAFETY: culib() is loaded (availability checked by the caller); the symbol, if present, has
    // this signature.
    let get = unsafe { sys::culib().get::<GetProcAddress>(b"cuGetProcAddress\0") }.ok()?;
    let name = CString::new(symbol).ok()?;
    let mut pfn: *mut c_void = std::ptr::null_mut();
    // SAFETY: name is a valid C string and pfn a valid out-pointer; flags 0 = default.
    let rc = unsafe { get(name.as_ptr(), &mut pfn, version, 0) };
    (rc == sys::CUresult::CUDA_SUCCESS && !pfn.is_null()).then_some(pfn)
}

type GetHandleForAddressRange = unsafe extern "C" fn(
    *mut c_void,
    sys::CUdeviceptr,
    usize,
    sys::CUmemRangeHandleType,
    u64,
) -> sys::CUresult;
type FlushGpuDirectRdmaWrites = unsafe extern "C" fn(u32, u32) -> sys::CUresult;

/// `cuMemGetHandleForAddressRange(..., CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD)`: a dma-buf file
/// descriptor for `[ptr, ptr+len)`, owned by the caller.
pub(crate) unsafe fn dmabuf_fd(ptr: sys::CUdeviceptr, len: usize) -> Result<OwnedFd, Error> {
    // SAFETY: forwarded contract.
    let f = unsafe { proc_address("cuMemGetHandleForAddressRange", 11070) }.ok_or_else(|| Error::Unsupported {
        what: "dma-buf export of GPU memory",
        reason: "the NVIDIA driver has no cuMemGetHandleForAddressRange (needs CUDA 11.7 / driver 515 or newer)".into(),
    })?;
    // SAFETY: f is cuMemGetHandleForAddressRange's address, of this signature.
    let f: GetHandleForAddressRange =
        unsafe { std::mem::transmute::<*mut c_void, GetHandleForAddressRange>(f) };
    let mut fd: i32 = -1;
    // SAFETY: fd is a valid out-pointer for an int; the range is a live allocation.
    let rc = unsafe {
        f(
            (&mut fd as *mut i32).cast(),
            ptr,
            len,
            sys::CUmemRangeHandleType::CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD,
            0,
        )
    };
    rc.result()
        .map_err(|e| cuda_error("cuMemGetHandleForAddressRange", e))?;
    if fd < 0 {
        return Err(Error::Cuda {
            op: "cuMemGetHandleForAddressRange",
            code: "no descriptor returned".into(),
            hint: "",
        });
    }
    // SAFETY: the driver returned a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `cuFlushGPUDirectRDMAWrites(CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX,
/// CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER)`: makes RDMA writes that completed visible to the
/// GPU's own work.
pub(crate) unsafe fn flush_gpudirect_rdma_writes() -> Result<(), Error> {
    // SAFETY: forwarded contract.
    let f = unsafe { proc_address("cuFlushGPUDirectRDMAWrites", 11030) }.ok_or_else(|| {
        Error::Unsupported {
            what: "cuFlushGPUDirectRDMAWrites",
            reason: "the NVIDIA driver predates CUDA 11.3".into(),
        }
    })?;
    // SAFETY: f has this signature.
    let f: FlushGpuDirectRdmaWrites =
        unsafe { std::mem::transmute::<*mut c_void, FlushGpuDirectRdmaWrites>(f) };
    // SAFETY: a context is current (caller's contract); target 0 = current context, scope 100 = owner.
    unsafe { f(0, 100) }
        .result()
        .map_err(|e| cuda_error("cuFlushGPUDirectRDMAWrites", e))
}

/// `cuMemHostRegister` with `CU_MEMHOSTREGISTER_PORTABLE`: pins host memory for fast copies
/// from every context.
pub(crate) unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<(), Error> {
    // SAFETY: [ptr, ptr+len) is mapped host memory that outlives the registration.
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) }
        .result()
        .map_err(|e| cuda_error("cuMemHostRegister", e))
}

/// `cuMemHostRegister` with `PORTABLE | DEVICEMAP`: pinned and addressable by streams' memory
/// operations (flags).
pub(crate) unsafe fn host_register_mapped(ptr: *mut u8, len: usize) -> Result<(), Error> {
    // SAFETY: [ptr, ptr+len) is mapped host memory that outlives the registration.
    unsafe {
        sys::cuMemHostRegister_v2(
            ptr.cast(),
            len,
            sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP,
        )
    }
    .result()
    .map_err(|e| cuda_error("cuMemHostRegister", e))
}

/// `cuMemHostUnregister`.
pub(crate) unsafe fn host_unregister(ptr: *mut u8) -> Result<(), Error> {
    // SAFETY: ptr was registered with host_register.
    unsafe { sys::cuMemHostUnregister(ptr.cast()) }
        .result()
        .map_err(|e| cuda_error("cuMemHostUnregister", e))
}

/// `cuMemGetAddressRange`: the base and size of the allocation that contains `ptr` (for a
/// peer's memory mapped with `cuIpcOpenMemHandle`, the whole exported allocation).
pub(crate) unsafe fn address_range(
    ptr: sys::CUdeviceptr,
) -> Result<(sys::CUdeviceptr, usize), Error> {
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: valid out-pointers; the caller has a context current.
    unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
        .result()
        .map_err(|e| cuda_error("cuMemGetAddressRange", e))?;
    Ok((base, size))
}

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

/// A failed cudarc call (a caller's, or one nodetour makes through cudarc's safe layer):
/// [`Error::Cuda`] with the CUDA error code.
impl From<DriverError> for Error {
    fn from(e: DriverError) -> Error {
        cuda_error("cudarc call", e)
    }
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
    // cuGetProcAddress (the v1 ABI, CUDA 11.3+) is looked up by hand, in nodetour's own handle
    // on libcuda (cudarc's loader exists only when it loads at run time, and would panic on a
    // driver that lacks the symbol).
    let get = super::libs::libcuda()?.symbol(c"cuGetProcAddress")?;
    // SAFETY: the driver exports cuGetProcAddress with this signature.
    let get = unsafe { std::mem::transmute::<*mut c_void, GetProcAddress>(get) };
    let name = CString::new(symbol).ok()?;
    let mut pfn: *mut c_void = std::ptr::null_mut();
    // SAFETY: name is a valid C string and pfn a valid out-pointer; flags 0 = default.
    let rc = unsafe { get(name.as_ptr(), &mut pfn, version, 0) };
    (rc == sys::CUresult::CUDA_SUCCESS && !pfn.is_null()).then_some(pfn)
}

/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD` (CUDA 11.7; spelled here so that bindings of older
/// CUDA versions, which lack the enum, build too: the call is resolved at run time).
const DMA_BUF_FD: u32 = 1;

type GetHandleForAddressRange =
    unsafe extern "C" fn(*mut c_void, sys::CUdeviceptr, usize, u32, u64) -> sys::CUresult;
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
    let rc = unsafe { f((&mut fd as *mut i32).cast(), ptr, len, DMA_BUF_FD, 0) };
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

type DeviceGetMemPool =
    unsafe extern "C" fn(*mut sys::CUmemoryPool, sys::CUdevice) -> sys::CUresult;
type MemPoolSetAccess =
    unsafe extern "C" fn(sys::CUmemoryPool, *const AccessDesc, usize) -> sys::CUresult;

/// `CUmemAccessDesc`: a location (type, device id) and the access flags, three C ints in every
/// CUDA version (spelled here: newer bindings make the id a union).
#[repr(C)]
pub(crate) struct AccessDesc {
    location_type: i32,
    location_id: i32,
    flags: i32,
}

/// `cuMemPoolSetAccess` on `owner`'s current memory pool (where `cuMemAllocAsync` allocates):
/// `reader`'s GPU may read and write it. Pool memory ignores `cuCtxEnablePeerAccess`.
pub(crate) fn grant_pool_access(owner: sys::CUdevice, reader: sys::CUdevice) -> Result<(), Error> {
    let unsupported = |what: &str| Error::Unsupported {
        what: "peer access to memory-pool allocations",
        reason: format!("the NVIDIA driver has no {what} (needs CUDA 11.2 or newer)"),
    };
    // SAFETY: looked up by name; None where the driver lacks them.
    let (get, set) = unsafe {
        (
            proc_address("cuDeviceGetMemPool", 11020)
                .ok_or_else(|| unsupported("cuDeviceGetMemPool"))?,
            proc_address("cuMemPoolSetAccess", 11020)
                .ok_or_else(|| unsupported("cuMemPoolSetAccess"))?,
        )
    };
    // SAFETY: the addresses of these two entry points, of these signatures.
    let (get, set) = unsafe {
        (
            std::mem::transmute::<*mut c_void, DeviceGetMemPool>(get),
            std::mem::transmute::<*mut c_void, MemPoolSetAccess>(set),
        )
    };
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the driver checks the device handle.
    unsafe { get(&mut pool, owner) }
        .result()
        .map_err(|e| cuda_error("cuDeviceGetMemPool", e))?;
    let desc = AccessDesc {
        // CU_MEM_LOCATION_TYPE_DEVICE, CU_MEM_ACCESS_FLAGS_PROT_READWRITE.
        location_type: 1,
        location_id: reader,
        flags: 3,
    };
    // SAFETY: the pool the driver returned; one descriptor of CUmemAccessDesc's layout.
    unsafe { set(pool, &desc, 1) }
        .result()
        .map_err(|e| cuda_error("cuMemPoolSetAccess", e))
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

/// `cuPointerGetAttribute` for an attribute held in a `T` (a context handle, an ordinal, a
/// memory type).
unsafe fn pointer_attribute<T: Default>(
    ptr: sys::CUdeviceptr,
    attribute: sys::CUpointer_attribute,
) -> Result<T, Error> {
    let mut value = T::default();
    // SAFETY: `value` is a valid out-pointer of the attribute's type (the callers below pass
    // the type the driver documents for each attribute).
    unsafe { sys::cuPointerGetAttribute((&mut value as *mut T).cast(), attribute, ptr) }
        .result()
        .map_err(|e| cuda_error("cuPointerGetAttribute", e))?;
    Ok(value)
}

/// What the driver knows of a device address: its context, its GPU's ordinal, and whether it
/// is device memory (`CU_MEMORYTYPE_DEVICE`).
pub(crate) struct PointerFacts {
    pub(crate) context: sys::CUcontext,
    pub(crate) ordinal: i32,
    pub(crate) device_memory: bool,
}

/// `cuPointerGetAttribute` (context, device ordinal, memory type) of `ptr`.
pub(crate) unsafe fn pointer_facts(ptr: sys::CUdeviceptr) -> Result<PointerFacts, Error> {
    use sys::CUpointer_attribute as A;
    // SAFETY: each attribute is read into its documented type: CUcontext, int, unsigned int
    // (a CUmemorytype value).
    let context: usize = unsafe { pointer_attribute(ptr, A::CU_POINTER_ATTRIBUTE_CONTEXT) }?;
    // SAFETY: as above.
    let ordinal: i32 = unsafe { pointer_attribute(ptr, A::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) }?;
    // SAFETY: as above.
    let kind: u32 = unsafe { pointer_attribute(ptr, A::CU_POINTER_ATTRIBUTE_MEMORY_TYPE) }?;
    Ok(PointerFacts {
        context: context as sys::CUcontext,
        ordinal,
        device_memory: kind == sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32,
    })
}

/// The GPU of context `ctx` (`cuCtxPushCurrent`, `cuCtxGetDevice`, `cuCtxPopCurrent`: the
/// thread's current context is as it was afterwards).
pub(crate) unsafe fn context_device(ctx: sys::CUcontext) -> Result<sys::CUdevice, Error> {
    // SAFETY: `ctx` is a live context (the caller's contract).
    unsafe { sys::cuCtxPushCurrent_v2(ctx) }
        .result()
        .map_err(|e| cuda_error("cuCtxPushCurrent", e))?;
    let mut dev: sys::CUdevice = 0;
    // SAFETY: a context is current; `dev` is a valid out-pointer.
    let got = unsafe { sys::cuCtxGetDevice(&mut dev) }.result();
    let mut popped: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: pops the context pushed above.
    let pop = unsafe { sys::cuCtxPopCurrent_v2(&mut popped) }.result();
    got.map_err(|e| cuda_error("cuCtxGetDevice", e))?;
    pop.map_err(|e| cuda_error("cuCtxPopCurrent", e))?;
    Ok(dev)
}

// --- copies, memsets and frees queued on a stream ---

/// `cuMemcpyHtoDAsync`: `len` bytes from host `src` to device `dst` on `stream`.
pub(crate) unsafe fn memcpy_htod_async(
    dst: sys::CUdeviceptr,
    src: *const c_void,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), Error> {
    // SAFETY: forwarded contract (both ranges live until the copy has run; a live stream).
    unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src, len, stream) }
        .result()
        .map_err(|e| cuda_error("cuMemcpyHtoDAsync", e))
}

/// `cuMemcpyDtoHAsync`: `len` bytes from device `src` to host `dst` on `stream`.
pub(crate) unsafe fn memcpy_dtoh_async(
    dst: *mut c_void,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), Error> {
    // SAFETY: forwarded contract.
    unsafe { sys::cuMemcpyDtoHAsync_v2(dst, src, len, stream) }
        .result()
        .map_err(|e| cuda_error("cuMemcpyDtoHAsync", e))
}

/// `cuMemcpyAsync`: `len` bytes between device (or mapped) addresses on `stream`.
pub(crate) unsafe fn memcpy_dtod_async(
    dst: sys::CUdeviceptr,
    src: sys::CUdeviceptr,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), Error> {
    // SAFETY: forwarded contract.
    unsafe { sys::cuMemcpyAsync(dst, src, len, stream) }
        .result()
        .map_err(|e| cuda_error("cuMemcpyAsync", e))
}

/// `cuMemsetD8Async`: `len` bytes at `dst` set to `value` on `stream`.
pub(crate) unsafe fn memset_d8_async(
    dst: sys::CUdeviceptr,
    value: u8,
    len: usize,
    stream: sys::CUstream,
) -> Result<(), Error> {
    // SAFETY: forwarded contract.
    unsafe { sys::cuMemsetD8Async(dst, value, len, stream) }
        .result()
        .map_err(|e| cuda_error("cuMemsetD8Async", e))
}

/// `cuMemAllocAsync`: `len` bytes from the device's default memory pool, usable by the work
/// queued on `stream` from here on; under capture, an allocation node of the graph.
pub(crate) unsafe fn mem_alloc_async(
    len: usize,
    stream: sys::CUstream,
) -> Result<sys::CUdeviceptr, DriverError> {
    let mut ptr: sys::CUdeviceptr = 0;
    // SAFETY: forwarded contract (the stream's context is current); `ptr` is a valid out
    // pointer.
    unsafe { sys::cuMemAllocAsync(&mut ptr, len, stream) }.result()?;
    Ok(ptr)
}

/// `cuMemFreeAsync`: frees `ptr` after the work queued on `stream`.
pub(crate) unsafe fn mem_free_async(
    ptr: sys::CUdeviceptr,
    stream: sys::CUstream,
) -> Result<(), DriverError> {
    // SAFETY: forwarded contract (ptr from cuMemAlloc of the current context, used by nothing
    // queued after this).
    unsafe { sys::cuMemFreeAsync(ptr, stream) }.result()
}

// --- streams, events, peers ---

type GetCaptureInfo = unsafe extern "C" fn(
    sys::CUstream,
    *mut sys::CUstreamCaptureStatus,
    *mut u64,
    *mut sys::CUgraph,
    *mut *const sys::CUgraphNode,
    *mut usize,
) -> sys::CUresult;

/// `cuStreamGetCaptureInfo` (the CUDA 11.3 ABI, `_v2`): the id of the capture sequence
/// `stream` takes part in, `None` when it is not being captured. Two streams in one capture
/// (one forked from the other by an event) have the same id.
pub(crate) unsafe fn stream_capture_id(stream: sys::CUstream) -> Result<Option<u64>, Error> {
    // SAFETY: forwarded contract.
    let f = unsafe { proc_address("cuStreamGetCaptureInfo", 11030) }.ok_or_else(|| {
        Error::Unsupported {
            what: "CUDA graph capture",
            reason: "the NVIDIA driver has no cuStreamGetCaptureInfo (needs CUDA 11.3 or newer)"
                .into(),
        }
    })?;
    // SAFETY: f is cuStreamGetCaptureInfo as of CUDA 11.3, of this signature.
    let f: GetCaptureInfo = unsafe { std::mem::transmute::<*mut c_void, GetCaptureInfo>(f) };
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    let mut id = 0u64;
    // SAFETY: valid out-pointers for the status and the id; the optional outputs are null
    // (allowed); `stream` is a live stream of the current context (the caller's contract).
    let rc = unsafe {
        f(
            stream,
            &mut status,
            &mut id,
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
    };
    rc.result()
        .map_err(|e| cuda_error("cuStreamGetCaptureInfo", e))?;
    Ok((status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE).then_some(id))
}

/// `cuStreamQuery`: whether everything queued on `stream` has run.
pub(crate) unsafe fn stream_idle(stream: sys::CUstream) -> Result<bool, DriverError> {
    // SAFETY: forwarded contract (a live stream).
    match unsafe { sys::cuStreamQuery(stream) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(DriverError(e)),
    }
}

/// `cuStreamGetCtx`: the context of `stream`.
pub(crate) unsafe fn stream_context(stream: sys::CUstream) -> Result<sys::CUcontext, Error> {
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: forwarded contract (a valid stream or default-stream handle); ctx is a valid
    // out-pointer.
    unsafe { sys::cuStreamGetCtx(stream, &mut ctx) }
        .result()
        .map_err(|e| cuda_error("cuStreamGetCtx", e))?;
    Ok(ctx)
}

/// `cuStreamWriteValue32`: queues a store of `value` at `address` (`flags` 0: with a memory
/// barrier).
pub(crate) unsafe fn stream_write_value32(
    stream: sys::CUstream,
    address: sys::CUdeviceptr,
    value: u32,
    flags: u32,
) -> Result<(), Error> {
    // SAFETY: forwarded contract (a device-accessible address that outlives the queued work).
    unsafe { sys::cuStreamWriteValue32_v2(stream, address, value, flags) }
        .result()
        .map_err(|e| cuda_error("cuStreamWriteValue32", e))
}

/// `cuStreamWaitValue32`: queues a wait on the word at `address` (`flags` 0: ≥ `value`, 1:
/// equal).
pub(crate) unsafe fn stream_wait_value32(
    stream: sys::CUstream,
    address: sys::CUdeviceptr,
    value: u32,
    flags: u32,
) -> Result<(), Error> {
    // SAFETY: forwarded contract.
    unsafe { sys::cuStreamWaitValue32_v2(stream, address, value, flags) }
        .result()
        .map_err(|e| cuda_error("cuStreamWaitValue32", e))
}

/// `cuEventQuery`: whether the work before the event's record has run.
pub(crate) unsafe fn event_complete(event: sys::CUevent) -> Result<bool, Error> {
    // SAFETY: forwarded contract (a live event of the bound context).
    match unsafe { sys::cuEventQuery(event) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        e => Err(cuda_error("cuEventQuery", DriverError(e))),
    }
}

/// `cuDeviceCanAccessPeer`.
pub(crate) fn can_access_peer(from: sys::CUdevice, to: sys::CUdevice) -> Result<bool, Error> {
    let mut can = 0;
    // SAFETY: a valid out-pointer and device handles (any value is checked by the driver).
    unsafe { sys::cuDeviceCanAccessPeer(&mut can, from, to) }
        .result()
        .map_err(|e| cuda_error("cuDeviceCanAccessPeer", e))?;
    Ok(can != 0)
}

/// `cuCtxEnablePeerAccess` from the bound context to `to` (already enabled counts as done).
pub(crate) unsafe fn enable_peer_access(to: sys::CUcontext) -> Result<(), Error> {
    // SAFETY: forwarded contract (`to` is a live context; one is bound).
    match unsafe { sys::cuCtxEnablePeerAccess(to, 0) } {
        sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
            Ok(())
        }
        e => Err(cuda_error("cuCtxEnablePeerAccess", DriverError(e))),
    }
}

// --- the driver and devices ---

/// `cuDriverGetVersion` (e.g. 12080).
pub(crate) unsafe fn driver_version() -> Result<i32, DriverError> {
    let mut version = 0;
    // SAFETY: a valid out-pointer; the library is loaded (caller's contract).
    unsafe { sys::cuDriverGetVersion(&mut version) }.result()?;
    Ok(version)
}

/// `cuDeviceGetPCIBusId` (`0000:17:00.0`).
pub(crate) fn device_pci_bus_id(dev: sys::CUdevice) -> Result<String, Error> {
    let mut bus = [0 as std::ffi::c_char; 32];
    // SAFETY: bus has room for the 13-character id and its NUL.
    unsafe { sys::cuDeviceGetPCIBusId(bus.as_mut_ptr(), bus.len() as i32, dev) }
        .result()
        .map_err(|e| cuda_error("cuDeviceGetPCIBusId", e))?;
    // SAFETY: the driver wrote a NUL-terminated string into bus.
    Ok(unsafe { std::ffi::CStr::from_ptr(bus.as_ptr()) }
        .to_string_lossy()
        .into_owned())
}

// --- cuda-ipc ---

/// `cuIpcGetMemHandle` of the allocation starting at `base`.
pub(crate) unsafe fn ipc_get_mem_handle(base: sys::CUdeviceptr) -> Result<[u8; 64], Error> {
    // SAFETY: CUipcMemHandle is plain bytes; zeroed is a valid value.
    let mut handle = unsafe { std::mem::zeroed::<sys::CUipcMemHandle>() };
    // SAFETY: a valid out-pointer; base starts a live cuMemAlloc allocation (caller's contract).
    unsafe { sys::cuIpcGetMemHandle(&mut handle, base) }
        .result()
        .map_err(|e| cuda_error("cuIpcGetMemHandle", e))?;
    Ok(handle.reserved.map(|c| c as u8))
}

/// `cuIpcOpenMemHandle` (lazy peer access): maps a peer's exported allocation.
pub(crate) unsafe fn ipc_open_mem_handle(
    handle: [u8; 64],
) -> Result<sys::CUdeviceptr, DriverError> {
    let handle = sys::CUipcMemHandle {
        reserved: handle.map(|b| b as std::ffi::c_char),
    };
    let mut base: sys::CUdeviceptr = 0;
    // SAFETY: a valid out-pointer; the handle is plain bytes (the driver validates it).
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut base,
            handle,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()?;
    Ok(base)
}

/// `cuIpcCloseMemHandle`.
pub(crate) unsafe fn ipc_close_mem_handle(base: sys::CUdeviceptr) -> Result<(), DriverError> {
    // SAFETY: forwarded contract (base came from cuIpcOpenMemHandle; nothing queued uses it).
    unsafe { sys::cuIpcCloseMemHandle(base) }.result()
}

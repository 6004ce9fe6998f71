//! Is CUDA here, which GPUs, and what do they say about GPUDirect RDMA.

use std::path::PathBuf;
use std::sync::OnceLock;

use cudarc::driver::result;
use cudarc::driver::sys::CUdevice_attribute as A;

use super::result::{cuda_error, error_name};
use crate::error::{Error, Result};

/// The oldest driver API nodetour uses (CUDA 11.0); newer calls are resolved one by one.
pub const MIN_DRIVER_VERSION: i32 = 11000;

static AVAILABLE: OnceLock<std::result::Result<i32, String>> = OnceLock::new();

/// GPU `ordinal`'s primary context, after [`availability`] (CUDA is loaded at run time: its
/// absence is a typed error, not a crash); a failure is [`Error::Cuda`] naming the call.
pub fn open_context(ordinal: usize) -> Result<std::sync::Arc<cudarc::driver::CudaContext>> {
    availability()?;
    cudarc::driver::CudaContext::new(ordinal).map_err(|e| cuda_error("cuDevicePrimaryCtxRetain", e))
}

/// Checks once per process that libcuda loads and `cuInit` succeeds; returns the driver's CUDA
/// version (12080 = 12.8). Every other CUDA call in nodetour comes after this.
pub fn availability() -> Result<i32> {
    AVAILABLE
        .get_or_init(|| {
            if super::libs::libcuda().is_none() {
                return Err("libcuda.so is not loadable: no NVIDIA driver on this machine (or not visible to this container)".into());
            }
            result::init().map_err(|e| format!("cuInit failed: {} (no usable GPU, or the driver and kernel module disagree)", error_name(e)))?;
            // SAFETY: the library is loaded.
            let version = unsafe { super::result::driver_version() }
                .map_err(|e| format!("cuDriverGetVersion failed: {}", error_name(e)))?;
            if version < MIN_DRIVER_VERSION {
                return Err(format!(
                    "the NVIDIA driver supports CUDA {}.{}; nodetour needs 11.0 or newer (dma-buf export needs 11.7)",
                    version / 1000,
                    (version % 1000) / 10
                ));
            }
            Ok(version)
        })
        .clone()
        .map_err(|reason| Error::Unsupported { what: "CUDA", reason })
}

/// GPUDirect-related attributes of a GPU, as the driver reports them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GdrAttributes {
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED`.
    pub gpu_direct_rdma: bool,
    /// `..._GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS` bitmask (1: `cuFlushGPUDirectRDMAWrites`,
    /// 2: stream memory operations).
    pub flush_writes_options: i32,
    /// `..._GPU_DIRECT_RDMA_WRITES_ORDERING` (0 none, 100 owner, 200 all devices).
    pub writes_ordering: i32,
    /// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`.
    pub dma_buf: bool,
    /// `CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED`.
    pub host_register: bool,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED`.
    pub gdr_with_vmm: bool,
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR` (stream memory operations usable).
    pub stream_wait_value: bool,
}

/// One GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Product name.
    pub name: String,
    /// PCI address, lower case (`0000:18:00.0`).
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Memory in bytes.
    pub total_memory: usize,
    /// GPUDirect attributes.
    pub gdr: GdrAttributes,
}

impl GpuInfo {
    /// The GPU's canonical sysfs path (`/sys/devices/pci0000:00/.../0000:18:00.0`), the input of
    /// NIC choice and PCIe distance; `None` if sysfs does not show it.
    pub fn pci_path(&self) -> Option<PathBuf> {
        std::fs::canonicalize(format!("/sys/bus/pci/devices/{}", self.pci_bus_id)).ok()
    }
}

/// Lists the GPUs. `Unsupported` where CUDA is absent; an empty list never happens (cuInit fails
/// with no device).
pub fn gpus() -> Result<Vec<GpuInfo>> {
    availability()?;
    let n = result::device::get_count().map_err(|e| cuda_error("cuDeviceGetCount", e))?;
    (0..n.max(0) as usize).map(gpu).collect()
}

fn gpu(ordinal: usize) -> Result<GpuInfo> {
    let dev = result::device::get(ordinal as i32).map_err(|e| cuda_error("cuDeviceGet", e))?;
    // SAFETY: dev is a valid device handle; attributes of any number are queried safely (an
    // attribute this driver does not know fails and reads as 0).
    let attr = |a: A| unsafe { result::device::get_attribute(dev, a) }.unwrap_or(0);
    let name = result::device::get_name(dev).map_err(|e| cuda_error("cuDeviceGetName", e))?;
    let pci_bus_id = super::result::device_pci_bus_id(dev)?.to_lowercase();
    // SAFETY: dev is valid.
    let total_memory =
        unsafe { result::device::total_mem(dev) }.map_err(|e| cuda_error("cuDeviceTotalMem", e))?;
    Ok(GpuInfo {
        ordinal,
        name,
        pci_bus_id,
        compute_capability: (
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
            attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        ),
        total_memory,
        gdr: GdrAttributes {
            gpu_direct_rdma: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED) == 1,
            flush_writes_options: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS),
            writes_ordering: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING),
            dma_buf: attr(A::CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED) == 1,
            host_register: attr(A::CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED) == 1,
            gdr_with_vmm: attr(A::CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED) == 1,
            stream_wait_value: attr(A::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR) == 1,
        },
    })
}

/// Makes RDMA writes that have completed visible to later work of `context`'s GPU
/// (`cuFlushGPUDirectRDMAWrites`, to the owner). Needed before the GPU reads NIC-written data
/// where the GPU does not order such writes itself (writes ordering below "owner").
pub fn flush_rdma_writes(context: &cudarc::driver::CudaContext) -> Result<()> {
    availability()?;
    context
        .bind_to_thread()
        .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
    // SAFETY: CUDA is initialised and the context is current.
    unsafe { super::result::flush_gpudirect_rdma_writes() }
}

//! NCCL, loaded at run time, as the reference nodetour measures itself against in the same
//! binary and run (`nodetour perf --compare nccl`): one communicator per GPU of this process
//! (`ncclCommInitAll`) and its allreduce, queued on nodetour's streams and buffers.
//!
//! Where libnccl is missing this is [`Error::Unsupported`]. Callers on shared GPU hosts export
//! `NCCL_NVLS_ENABLE=0` before the first call (NVLink multicast can take the host's GPUs out of
//! service); [`LocalNccl::new`] refuses to start without it.
//!
//! Built only with this crate's `nccl` feature, which the tools turn on: a runtime that links
//! nodetour never links NCCL through it.

use cudarc::nccl::{result, sys};

use crate::cuda::GpuStream;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;

/// NCCL communicators for a list of GPUs of this process, one rank each.
pub struct LocalNccl {
    comms: Vec<sys::ncclComm_t>,
    ordinals: Vec<i32>,
}

// SAFETY: NCCL communicators may be used from any thread (one at a time: &mut for launches).
unsafe impl Send for LocalNccl {}

fn nccl_error(what: &'static str, e: result::NcclError) -> Error {
    Error::Unsupported {
        what: "NCCL",
        reason: format!("{what} failed: {e:?}"),
    }
}

/// NCCL's version as (major, minor, patch), or `Unsupported` where libnccl cannot be loaded.
pub fn version() -> Result<(i32, i32, i32)> {
    if !crate::cuda::libs::nccl_present() {
        return Err(Error::Unsupported {
            what: "NCCL",
            reason: "libnccl.so is not loadable (install NCCL, e.g. libnccl2)".into(),
        });
    }
    let v = result::get_nccl_version().map_err(|e| nccl_error("ncclGetVersion", e))?;
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    Ok((v / 10000, (v / 100) % 100, v % 100))
}

/// Libnccl is loadable and `NCCL_NVLS_ENABLE=0` is set.
fn ready() -> Result<()> {
    version()?;
    if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
        return Err(Error::InvalidArgument {
            reason: "export NCCL_NVLS_ENABLE=0 before starting NCCL on these machines \
                     (NVLink multicast can take a shared host's GPUs out of service)"
                .into(),
        });
    }
    Ok(())
}

/// A new NCCL unique id (`ncclGetUniqueId`), to hand to every rank of a job of processes
/// through the bootstrap.
pub fn unique_id() -> Result<[u8; 128]> {
    ready()?;
    let id = result::get_uniqueid().map_err(|e| nccl_error("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

impl LocalNccl {
    /// This process's one rank of a job of processes (`ncclCommInitRank` on GPU `ordinal`):
    /// `id` from [`unique_id`] on one rank, shared by all. Blocks until every rank has joined.
    pub fn join(id: &[u8; 128], world: u32, rank: u32, ordinal: i32) -> Result<LocalNccl> {
        ready()?;
        let context = cudarc::driver::CudaContext::new(ordinal as usize)
            .map_err(|e| crate::cuda::result::cuda_error("cuDevicePrimaryCtxRetain", e))?;
        context
            .bind_to_thread()
            .map_err(|e| crate::cuda::result::cuda_error("cuCtxSetCurrent", e))?;
        let mut comm = std::ptr::null_mut();
        let id = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: a valid out-pointer; the id came from ncclGetUniqueId on one rank.
        unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
            .map_err(|e| nccl_error("ncclCommInitRank", e))?;
        Ok(LocalNccl {
            comms: vec![comm],
            ordinals: vec![ordinal],
        })
    }

    /// One communicator per entry of `ordinals` (CUDA device ordinals), rank = position.
    pub fn new(ordinals: &[i32]) -> Result<LocalNccl> {
        ready()?;
        if ordinals.is_empty() {
            return Err(Error::InvalidArgument {
                reason: "NCCL needs at least one GPU".into(),
            });
        }
        let mut comms = vec![std::ptr::null_mut(); ordinals.len()];
        // SAFETY: comms has room for one communicator per ordinal; the list outlives the call.
        unsafe {
            result::comm_init_all(comms.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
        }
        .map_err(|e| nccl_error("ncclCommInitAll", e))?;
        Ok(LocalNccl {
            comms,
            ordinals: ordinals.to_vec(),
        })
    }

    /// Queues NCCL's in-place allreduce of `count` elements on every rank's buffer and stream
    /// (grouped, so one thread can drive all ranks).
    pub fn all_reduce(
        &mut self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.comms.len();
        let bytes = count.checked_mul(dtype.size());
        if buffers.len() != n
            || streams.len() != n
            || buffers.iter().any(|b| bytes.is_none_or(|x| x > b.len()))
        {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "NCCL allreduce of {count} x {dtype:?} over {} buffers / {} streams for {n} ranks",
                    buffers.len(),
                    streams.len()
                ),
            });
        }
        for (r, (b, s)) in buffers.iter().zip(streams).enumerate() {
            let want = self.ordinals[r] as usize;
            if b.context().ordinal() != want || s.context().ordinal() != want {
                return Err(Error::InvalidArgument {
                    reason: format!("rank {r}'s buffer or stream is not on GPU {want}"),
                });
            }
        }
        let dt = match dtype {
            DataType::F32 => sys::ncclDataType_t::ncclFloat32,
            DataType::F64 => sys::ncclDataType_t::ncclFloat64,
            DataType::F16 => sys::ncclDataType_t::ncclFloat16,
            DataType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
            DataType::I32 => sys::ncclDataType_t::ncclInt32,
            DataType::I64 => sys::ncclDataType_t::ncclInt64,
            DataType::U8 => sys::ncclDataType_t::ncclUint8,
        };
        let o = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Prod => sys::ncclRedOp_t::ncclProd,
            ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
            ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        };
        for (b, s) in buffers.iter().zip(streams) {
            b.note_use(s);
        }
        result::group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
        let mut first_error = None;
        for r in 0..n {
            let s = match streams[r].bind() {
                Ok(s) => s,
                Err(e) => {
                    first_error.get_or_insert(e);
                    continue;
                }
            };
            let p = buffers[r].device_ptr() as *mut std::ffi::c_void;
            // SAFETY: p holds count elements (checked) on this rank's GPU (checked); the
            // stream is live; DeviceBuffer waits for its GPU before freeing.
            let done = unsafe { result::all_reduce(p, p, count, dt, o, self.comms[r], s.cast()) };
            if let Err(e) = done {
                first_error.get_or_insert(nccl_error("ncclAllReduce", e));
            }
        }
        // The group is always closed, even after an error, so NCCL is left usable.
        let end = result::group_end().map_err(|e| nccl_error("ncclGroupEnd", e));
        match first_error {
            Some(e) => Err(e),
            None => end.map(|_| ()),
        }
    }
}

impl Drop for LocalNccl {
    fn drop(&mut self) {
        for &c in &self.comms {
            // SAFETY: c came from ncclCommInitAll and is destroyed once (destroy waits for the
            // communicator's outstanding work).
            let _ = unsafe { result::comm_destroy(c) };
        }
    }
}

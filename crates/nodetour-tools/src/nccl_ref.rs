//! NCCL, the reference the perf tool measures nodetour against in the same run (`nodetour perf
//! --compare nccl`), through cudarc's safe `nccl::Comm`: the library never uses NCCL, only
//! this tool does.
//!
//! NCCL runs on buffers of its own ([`NcclBuffer`], typed cudarc slices) queued on the same
//! streams as nodetour's collectives, and its results are checked like nodetour's (the seeded
//! inputs of `nodetour_ring::seeded`).
//!
//! cudarc loads libnccl at its first call and panics where it is missing: every entry point
//! here looks first ([`ready`]). Callers on shared GPU hosts export `NCCL_NVLS_ENABLE=0` (NVLink
//! multicast can take the host's GPUs out of service); NCCL is refused without it.

use std::sync::Arc;

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::{self, Comm, Id};
use half::{bf16, f16};
use nodetour_ring::{DataType, ReduceOp};

/// NCCL's version as (major, minor, patch), where libnccl loads.
pub fn version() -> Result<(i32, i32, i32)> {
    ensure!(
        nodetour_core::cuda::nccl_loadable(),
        "libnccl.so is not loadable (install NCCL, e.g. libnccl2)"
    );
    let v = nccl::result::get_nccl_version().map_err(|e| anyhow!("ncclGetVersion: {e:?}"))?;
    // NCCL >= 2.9 encodes major*10000 + minor*100 + patch.
    Ok((v / 10000, (v / 100) % 100, v % 100))
}

/// Libnccl loads and `NCCL_NVLS_ENABLE=0` is set.
pub fn ready() -> Result<()> {
    version()?;
    if std::env::var("NCCL_NVLS_ENABLE").as_deref() != Ok("0") {
        bail!(
            "export NCCL_NVLS_ENABLE=0 before starting NCCL on these machines \
             (NVLink multicast can take a shared host's GPUs out of service)"
        );
    }
    Ok(())
}

/// A new NCCL unique id, to hand to every rank of a job of processes through the bootstrap.
pub fn unique_id() -> Result<[u8; 128]> {
    ready()?;
    let id = Id::new().map_err(|e| anyhow!("ncclGetUniqueId: {e:?}"))?;
    Ok(id.internal().map(|c| c as u8))
}

/// This process's one rank of a job of processes (`ncclCommInitRank`), its collectives queued
/// on `stream`: `id` from [`unique_id`] on one rank, shared by all. Blocks until every rank
/// has joined.
pub fn join(id: &[u8; 128], world: u32, rank: u32, stream: &Arc<CudaStream>) -> Result<Comm> {
    ready()?;
    // ncclCommInitRank joins on the thread's current GPU.
    stream.context().bind_to_thread()?;
    let id = Id::uninit(id.map(|b| b as std::ffi::c_char));
    Comm::from_rank(stream.clone(), rank as usize, world as usize, id)
        .map_err(|e| anyhow!("ncclCommInitRank: {e:?}"))
}

/// One communicator per stream (`ncclCommInitAll` over the streams' GPUs), rank = position.
pub fn local(streams: &[Arc<CudaStream>]) -> Result<Vec<Comm>> {
    ready()?;
    ensure!(!streams.is_empty(), "NCCL needs at least one GPU");
    Comm::from_devices(streams.to_vec()).map_err(|e| anyhow!("ncclCommInitAll: {e:?}"))
}

/// A device buffer NCCL reduces: a cudarc slice of the element type of the sweep.
pub enum NcclBuffer {
    /// `f32`.
    F32(CudaSlice<f32>),
    /// `f64`.
    F64(CudaSlice<f64>),
    /// `f16`.
    F16(CudaSlice<f16>),
    /// `bf16`.
    Bf16(CudaSlice<bf16>),
    /// `i32`.
    I32(CudaSlice<i32>),
    /// `i64`.
    I64(CudaSlice<i64>),
    /// `i8`.
    I8(CudaSlice<i8>),
    /// `u32`.
    U32(CudaSlice<u32>),
    /// `u64`.
    U64(CudaSlice<u64>),
    /// `u8`.
    U8(CudaSlice<u8>),
}

/// `$body` with `$s` bound to the typed slice of `$buf` (whatever its element type).
macro_rules! each {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            NcclBuffer::F32($s) => $body,
            NcclBuffer::F64($s) => $body,
            NcclBuffer::F16($s) => $body,
            NcclBuffer::Bf16($s) => $body,
            NcclBuffer::I32($s) => $body,
            NcclBuffer::I64($s) => $body,
            NcclBuffer::U8($s) => $body,
            NcclBuffer::I8($s) => $body,
            NcclBuffer::U32($s) => $body,
            NcclBuffer::U64($s) => $body,
        }
    };
}

fn nccl_op(op: ReduceOp) -> Result<nccl::ReduceOp> {
    Ok(match op {
        ReduceOp::Sum => nccl::ReduceOp::Sum,
        ReduceOp::Prod => nccl::ReduceOp::Prod,
        ReduceOp::Min => nccl::ReduceOp::Min,
        ReduceOp::Max => nccl::ReduceOp::Max,
        ReduceOp::Avg => nccl::ReduceOp::Avg,
        #[allow(unreachable_patterns)]
        other => bail!("NCCL has no {other:?}"),
    })
}

impl NcclBuffer {
    /// `count` zeroed elements of `dtype` on `stream`'s GPU.
    pub fn zeroed(stream: &Arc<CudaStream>, dtype: DataType, count: usize) -> Result<NcclBuffer> {
        let n = count.max(1);
        Ok(match dtype {
            DataType::F32 => NcclBuffer::F32(stream.alloc_zeros(n)?),
            DataType::F64 => NcclBuffer::F64(stream.alloc_zeros(n)?),
            DataType::F16 => NcclBuffer::F16(stream.alloc_zeros(n)?),
            DataType::Bf16 => NcclBuffer::Bf16(stream.alloc_zeros(n)?),
            DataType::I32 => NcclBuffer::I32(stream.alloc_zeros(n)?),
            DataType::I64 => NcclBuffer::I64(stream.alloc_zeros(n)?),
            DataType::U8 => NcclBuffer::U8(stream.alloc_zeros(n)?),
            DataType::I8 => NcclBuffer::I8(stream.alloc_zeros(n)?),
            DataType::U32 => NcclBuffer::U32(stream.alloc_zeros(n)?),
            DataType::U64 => NcclBuffer::U64(stream.alloc_zeros(n)?),
            // i16: NCCL has none; fp8: cudarc's NCCL bindings name no fp8 type.
            #[allow(unreachable_patterns)]
            other => bail!("NCCL has no {other:?} here"),
        })
    }

    /// Copies `bytes` (elements in native byte order, as the seeded inputs are) to the start
    /// of the buffer, queued on `stream`.
    pub fn load(&mut self, stream: &Arc<CudaStream>, bytes: &[u8]) -> Result<()> {
        each!(self, s => {
            let host = bytemuck::pod_collect_to_vec(bytes);
            ensure!(host.len() <= s.len(), "{} elements into a buffer of {}", host.len(), s.len());
            stream.memcpy_htod(&host, &mut s.slice_mut(..host.len()))?;
        });
        Ok(())
    }

    /// The first `count` elements as bytes, once `stream` has run what was queued before.
    pub fn read(&self, stream: &Arc<CudaStream>, count: usize) -> Result<Vec<u8>> {
        each!(self, s => {
            ensure!(count <= s.len(), "{count} elements of a buffer of {}", s.len());
            let host = stream.clone_dtoh(&s.slice(..count))?;
            Ok(bytemuck::cast_slice(&host).to_vec())
        })
    }

    /// Queues NCCL's in-place allreduce of the first `count` elements on `comm`'s stream.
    pub fn all_reduce(&mut self, comm: &Comm, count: usize, op: ReduceOp) -> Result<()> {
        let op = nccl_op(op)?;
        each!(self, s => {
            ensure!(count <= s.len(), "{count} elements of a buffer of {}", s.len());
            comm.all_reduce_in_place(&mut s.slice_mut(..count), &op)
                .map_err(|e| anyhow!("ncclAllReduce: {e:?}"))?;
        });
        Ok(())
    }
}

/// One allreduce over every rank of a local set (`comms[r]` reduces `buffers[r]`), queued from
/// this thread as one NCCL group.
pub fn all_reduce_group(
    comms: &[Comm],
    buffers: &mut [NcclBuffer],
    count: usize,
    op: ReduceOp,
) -> Result<()> {
    ensure!(
        comms.len() == buffers.len(),
        "{} buffers for {} NCCL ranks",
        buffers.len(),
        comms.len()
    );
    nccl::group_start().map_err(|e| anyhow!("ncclGroupStart: {e:?}"))?;
    let queued = comms
        .iter()
        .zip(buffers.iter_mut())
        .try_for_each(|(c, b)| b.all_reduce(c, count, op));
    // The group is always closed, even after an error, so NCCL is left usable.
    let end = nccl::group_end().map_err(|e| anyhow!("ncclGroupEnd: {e:?}"));
    queued.context("queueing NCCL's allreduce")?;
    end.map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_libnccl_is_an_error_not_a_panic() {
        // cudarc would panic at its first NCCL call where libnccl is missing; the look first
        // turns that into an error. Where libnccl is installed, its version reads.
        match (nodetour_core::cuda::nccl_loadable(), version()) {
            (false, Err(e)) => assert!(e.to_string().contains("not loadable"), "{e}"),
            (true, Ok((major, _, _))) => assert!(major >= 2),
            (loadable, v) => panic!("libnccl loadable: {loadable}, version: {v:?}"),
        }
    }

    #[test]
    fn nccl_is_refused_without_nvls_off() {
        // The look comes first: with no libnccl, the error says so; with it, the variable.
        let Err(e) = ready() else {
            assert_eq!(std::env::var("NCCL_NVLS_ENABLE").as_deref(), Ok("0"));
            return;
        };
        let e = e.to_string();
        assert!(
            e.contains("not loadable") || e.contains("NCCL_NVLS_ENABLE=0"),
            "{e}"
        );
    }
}

// A runtime on cudarc 0.17 hands its device memory and stream to nodetour as raw handles:
// `DeviceBuffer::borrowed` (pointer, bytes) and `GpuStream::borrowed` (a `CUstream`), both
// under nodetour's handle of the same primary context (cudarc 0.19, re-exported as
// `nodetour::cudarc`). Two ranks (threads over tcp on loopback) allreduce host memory anywhere,
// then, where a GPU answers, device memory of cudarc 0.17's.

use std::sync::Arc;

use cudarc017::driver::{CudaContext as OldContext, DevicePtr as _};
use nodetour::core::cuda::GpuStream;
use nodetour::core::memory::DeviceBuffer;
use nodetour::cudarc::driver::CudaContext;
use nodetour::{Communicator, DataType, Options, ReduceOp, UniqueId};

const N: usize = 100_003;

fn value(rank: u32, i: usize) -> f32 {
    ((i * 7 + rank as usize * 5) % 13) as f32
}

/// `body(rank, communicator)` on two ranks (threads) formed with `options`.
fn two_ranks<R: Send>(
    options: Options,
    body: impl Fn(u32, Communicator) -> nodetour::Result<R> + Sync,
) -> nodetour::Result<Vec<R>> {
    let id = UniqueId::create().map_err(nodetour::Error::from)?;
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2u32)
            .map(|r| {
                let (id, options, body) = (&id, options.clone(), &body);
                s.spawn(move || body(r, Communicator::from_unique_id(id, r, 2, options)?))
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// The device allreduce on memory and a stream of cudarc 0.17's, through raw handles.
fn device_rank(rank: u32, comm: Communicator) -> nodetour::Result<Vec<f32>> {
    let gpu_err = |what: &str, e: cudarc017::driver::DriverError| nodetour::Error::Unsupported {
        reason: format!("cudarc 0.17: {what}: {e:?}"),
    };
    // The runtime's own objects, on its cudarc.
    let old = OldContext::new(0).map_err(|e| gpu_err("context", e))?;
    let old_stream = old.new_stream().map_err(|e| gpu_err("stream", e))?;
    let host: Vec<f32> = (0..N).map(|i| value(rank, i)).collect();
    let slice = old_stream.memcpy_stod(&host).map_err(|e| gpu_err("copy in", e))?;
    // nodetour's handle of the same (primary) context, and the raw handles.
    let context: Arc<CudaContext> =
        CudaContext::new(0).map_err(|e| nodetour::Error::Unsupported {
            reason: format!("cudarc 0.19: context: {e:?}"),
        })?;
    let (ptr, _record) = slice.device_ptr(&old_stream);
    // SAFETY: `old_stream` outlives `stream` and everything queued through it (both are dropped
    // at the end of this function after the stream is synchronised).
    let stream = unsafe { GpuStream::borrowed(&context, old_stream.cu_stream() as _) }?;
    // SAFETY: `slice` holds N f32 on GPU 0 and is freed only after the synchronise below.
    let buffer = unsafe { DeviceBuffer::borrowed(&context, ptr, N * 4) };
    comm.all_reduce_device_buffer(&buffer, N, DataType::F32, ReduceOp::Sum, &stream)?;
    stream.synchronize()?;
    drop(buffer);
    drop(stream);
    comm.close(nodetour::Deadline::after(std::time::Duration::from_secs(10)))?;
    old_stream.memcpy_dtov(&slice).map_err(|e| gpu_err("copy out", e))
}

fn main() -> nodetour::Result<()> {
    let sums = two_ranks(Options::default(), |r, comm| {
        let mut x: Vec<i64> = (0..1000).map(|i| i * (i64::from(r) + 1)).collect();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum)?;
        Ok(x)
    })?;
    for (r, got) in sums.into_iter().enumerate() {
        let want: Vec<i64> = (0..1000).map(|i| 3 * i).collect();
        assert_eq!(got, want, "rank {r}: host allreduce");
    }
    match nodetour::core::cuda::availability() {
        Err(e) => println!("SKIP the device allreduce of cudarc 0.17's memory: {e}"),
        Ok(_) => {
            let options = Options::default().with_gpu(0);
            let got = two_ranks(options, device_rank)?;
            for (r, got) in got.into_iter().enumerate() {
                let bad = (0..N).find(|&i| got[i] != value(0, i) + value(1, i));
                assert_eq!(bad, None, "rank {r}: device allreduce, first wrong element");
            }
            println!("device allreduce of cudarc 0.17's memory through raw handles: {N} f32 x 2 ranks checked");
        }
    }
    println!("COMPAT OK {}", env!("CARGO_PKG_NAME"));
    Ok(())
}

// A runtime on cudarc 0.17 hands its device memory and stream to nodetour as raw handles:
// `DeviceBuffer::from_raw` (pointer, bytes: the driver names its GPU and context, and checks
// the range) and `GpuStream::from_raw` (a `CUstream`: its context asked of the driver), with no
// cudarc 0.19 object of its own. Two ranks (threads over tcp on loopback) allreduce host
// memory anywhere, then, where a GPU answers, device memory of cudarc 0.17's.

use cudarc017::driver::{CudaContext as OldContext, DevicePtr as _};
use nodetour::core::cuda::GpuStream;
use nodetour::core::memory::DeviceBuffer;
use nodetour::{Communicator, DataType, Elements, Host, Options, ReduceOp, UniqueId};

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
        hs.into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
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
    let slice = old_stream
        .memcpy_stod(&host)
        .map_err(|e| gpu_err("copy in", e))?;
    // The raw handles: nodetour asks the driver what they are.
    let (ptr, _record) = slice.device_ptr(&old_stream);
    // SAFETY: `old_stream` outlives `stream` and everything queued through it (both are dropped
    // at the end of this function after the stream is synchronised).
    let stream = unsafe { GpuStream::from_raw(old_stream.cu_stream() as _) }?;
    // SAFETY: `slice` holds N f32 on GPU 0 and is freed only after the synchronise below.
    let buffer = unsafe { DeviceBuffer::from_raw(ptr, N * 4) }?;
    // What the driver can check, it does: a range past the allocation, and host memory.
    // SAFETY: refused before any use (the calls only ask the driver).
    let past = unsafe { DeviceBuffer::from_raw(ptr, N * 4 + (1 << 30)) };
    assert!(past.is_err(), "a range past the allocation was taken");
    // SAFETY: as above.
    let on_host = unsafe { DeviceBuffer::from_raw(host.as_ptr() as u64, 4) };
    assert!(on_host.is_err(), "host memory was taken for device memory");
    comm.all_reduce_in_place(
        &mut Elements::new(&buffer, N, DataType::F32)?,
        ReduceOp::Sum,
        &stream,
    )?;
    stream.synchronize()?;
    drop(buffer);
    drop(stream);
    comm.close(nodetour::Deadline::after(std::time::Duration::from_secs(
        10,
    )))?;
    old_stream
        .memcpy_dtov(&slice)
        .map_err(|e| gpu_err("copy out", e))
}

fn main() -> nodetour::Result<()> {
    let sums = two_ranks(Options::default(), |r, comm| {
        let mut x: Vec<i64> = (0..1000).map(|i| i * (i64::from(r) + 1)).collect();
        comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)?;
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
            println!(
                "device allreduce of cudarc 0.17's memory through raw handles: {N} f32 x 2 ranks checked"
            );
        }
    }
    println!("COMPAT OK {}", env!("CARGO_PKG_NAME"));
    Ok(())
}

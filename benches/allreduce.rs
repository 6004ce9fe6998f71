//! Allreduce throughput (busbw-style: bytes per rank per second) through the communicator, on
//! every path this machine has:
//! - host buffers, 4 ranks (threads of this process, each with its own communicator) over tcp
//!   on loopback, reduced on the CPU (between processes: `nodetour perf`, which
//!   scripts/test.sh prints);
//! - GPU buffers where GPUs exist: several GPUs of one process (`Communicator::from_devices`
//!   driven by a `Group`, each GPU reads its neighbour) beside the staged path (2 thread ranks,
//!   chunks through host slots, reduced on the GPU), on the same GPUs; else `SKIP` with the
//!   reason.
//!
//! NCCL and the copy ceilings are compared by `nodetour perf --compare nccl,ceiling`, which
//! needs one process per GPU for the per-process paths; see docs/PERFORMANCE.md.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::CudaContext;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::TransportKind;
use nodetour_net::bootstrap::UniqueId;
use nodetour_ring::comm::{Communicator, Elements, Group, Host, Options};
use nodetour_ring::{DataType, ReduceOp};

const HOST_SIZES: [usize; 2] = [256 << 10, 4 << 20];
const GPU_SIZES: [usize; 3] = [1 << 20, 16 << 20, 256 << 20];

/// Ranks as threads, each with its own communicator (formed over tcp loopback): rank 0 runs on
/// the caller's thread, the others wait at a barrier for each collective. A rank whose
/// collective fails still meets the others at the barriers and leaves its error for rank 0 to
/// report, so a failure ends the bench with every rank's error instead of leaving the barriers
/// (and the teardown) waiting for a thread that is gone.
struct Ranks {
    rank0: Communicator,
    start: Arc<Barrier>,
    done: Arc<Barrier>,
    bytes: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    errors: Arc<Mutex<Vec<String>>>,
    workers: Vec<std::thread::JoinHandle<()>>,
}

/// One collective of `bytes` on one rank.
type Each = dyn Fn(&Communicator, usize) -> nodetour::Result<()>;

impl Ranks {
    /// `world` ranks; `each(comm, bytes)` is one collective of `bytes` on a rank.
    fn new(
        world: u32,
        options: Options,
        each: impl Fn(&Communicator, usize) -> nodetour::Result<()> + Send + Sync + Clone + 'static,
    ) -> Ranks {
        let id = Arc::new(UniqueId::create().expect("unique id"));
        let (start, done) = (
            Arc::new(Barrier::new(world as usize)),
            Arc::new(Barrier::new(world as usize)),
        );
        let bytes = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let errors = Arc::new(Mutex::new(Vec::new()));
        let workers = (1..world)
            .map(|r| {
                let (id, options, each) = (id.clone(), options.clone(), each.clone());
                let (start, done, bytes, stop, errors) = (
                    start.clone(),
                    done.clone(),
                    bytes.clone(),
                    stop.clone(),
                    errors.clone(),
                );
                std::thread::spawn(move || {
                    let comm = Communicator::from_unique_id(&id, r, world, options).expect("rank");
                    loop {
                        start.wait();
                        if stop.load(Ordering::Acquire) {
                            break;
                        }
                        if let Err(e) = each(&comm, bytes.load(Ordering::Acquire)) {
                            errors
                                .lock()
                                .expect("errors")
                                .push(format!("rank {r}: {e}"));
                        }
                        done.wait();
                    }
                })
            })
            .collect();
        let rank0 = Communicator::from_unique_id(&id, 0, world, options).expect("rank 0");
        Ranks {
            rank0,
            start,
            done,
            bytes,
            stop,
            errors,
            workers,
        }
    }

    /// One collective of `bytes` on every rank; panics with every rank's error if any failed
    /// (after the barrier: the other ranks are then waiting for the next collective, which
    /// the teardown releases).
    fn run(&self, bytes: usize, each: &Each) {
        self.bytes.store(bytes, Ordering::Release);
        self.start.wait();
        let mine = each(&self.rank0, bytes);
        self.done.wait();
        let mut errors = std::mem::take(&mut *self.errors.lock().expect("errors"));
        if let Err(e) = mine {
            errors.insert(0, format!("rank 0: {e}"));
        }
        assert!(
            errors.is_empty(),
            "the collective failed: {}",
            errors.join("; ")
        );
    }
}

impl Drop for Ranks {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.start.wait();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn tcp(gpu: Option<usize>) -> Options {
    let mut o = Options::default()
        .with_transport(TransportKind::Tcp)
        .with_timeout(Duration::from_secs(30));
    o.gpu = gpu;
    o
}

fn host(c: &mut Criterion) {
    let mut g = c.benchmark_group("allreduce_host_tcp_4_ranks");
    let each = |comm: &Communicator, bytes: usize| {
        thread_local! {
            static DATA: std::cell::RefCell<Vec<f32>> =
                std::cell::RefCell::new(vec![1.0; HOST_SIZES[1] / 4]);
        }
        DATA.with_borrow_mut(|d| comm.all_reduce_in_place(&mut d[..bytes / 4], ReduceOp::Sum, Host))
    };
    let ranks = Ranks::new(4, tcp(None), each);
    for bytes in HOST_SIZES {
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("f32_sum_{}KiB", bytes >> 10), |b| {
            b.iter(|| ranks.run(bytes, &each))
        });
    }
    g.finish();
}

fn gpu(c: &mut Criterion) {
    if let Err(e) = nodetour_core::cuda::availability() {
        return println!("SKIP allreduce_gpu_direct / allreduce_gpu_staged: {e}");
    }
    let n = match nodetour_core::cuda::gpus() {
        Ok(list) if !list.is_empty() => list.len(),
        Ok(_) => return println!("SKIP allreduce_gpu: no GPU"),
        Err(e) => return println!("SKIP allreduce_gpu: {e}"),
    };
    // Two ranks: on two GPUs where there are two, else both on GPU 0.
    let contexts: Vec<Arc<CudaContext>> = (0..2)
        .map(|r| CudaContext::new(r % n).expect("GPU"))
        .collect();
    let largest = *GPU_SIZES.last().expect("sizes");
    let buffers: Vec<DeviceBuffer> = contexts
        .iter()
        .map(|c| DeviceBuffer::new(c, largest).expect("buffer"))
        .collect();
    let streams: Vec<GpuStream> = contexts
        .iter()
        .map(|c| GpuStream::new(c).expect("stream"))
        .collect();
    let direct = match Communicator::from_devices(&contexts, Options::default()) {
        Ok(g) => Some(g),
        Err(e) => {
            println!("SKIP allreduce_gpu_direct: {e}");
            None
        }
    };
    // The staged path: each thread rank allreduces its own buffer through host slots.
    let staged_each = move |comm: &Communicator, bytes: usize| {
        let ctx = CudaContext::new(comm.rank() as usize % n).expect("GPU");
        thread_local! {
            static MINE: std::cell::RefCell<Option<(DeviceBuffer, GpuStream)>> =
                const { std::cell::RefCell::new(None) };
        }
        MINE.with_borrow_mut(|m| {
            let (buf, stream) = m.get_or_insert_with(|| {
                (
                    DeviceBuffer::new(&ctx, largest).expect("buffer"),
                    GpuStream::new(&ctx).expect("stream"),
                )
            });
            comm.all_reduce_in_place(
                &mut Elements::new(buf, bytes / 4, DataType::F32)?,
                ReduceOp::Sum,
                stream,
            )
        })
    };
    let mut o = tcp(Some(0));
    o.piece_bytes = largest;
    let staged = Ranks::new(2, o, staged_each);
    let mut g = c.benchmark_group(format!("allreduce_gpu_2_ranks_on_{}_gpus", n.min(2)));
    g.sample_size(10);
    for bytes in GPU_SIZES {
        let count = bytes / 4;
        g.throughput(Throughput::Bytes(bytes as u64));
        if let Some(comms) = direct.as_ref() {
            g.bench_function(format!("direct_f32_sum_{}MiB", bytes >> 20), |bn| {
                bn.iter(|| {
                    let mut group = Group::new();
                    for ((comm, buf), st) in comms.iter().zip(&buffers).zip(&streams) {
                        group
                            .add(comm, move |c| {
                                let mut e = Elements::new(buf, count, DataType::F32)?;
                                c.all_reduce_in_place(&mut e, ReduceOp::Sum, st)
                            })
                            .expect("direct");
                    }
                    group.end().expect("direct");
                    for st in &streams {
                        st.synchronize().expect("sync");
                    }
                })
            });
        }
        g.bench_function(format!("staged_f32_sum_{}MiB", bytes >> 20), |bn| {
            bn.iter(|| staged.run(bytes, &staged_each))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    targets = host, gpu
}
criterion_main!(benches);

//! The communicator on device memory: cudarc slices on the caller's streams, ranks as threads
//! of this process sharing GPU 0 (each with its own communicator and its own handle of the
//! GPU's context, as separate runtimes would have). Ranks that share a process take the staged
//! path through the host ring (they share one CUDA context: a rank's synchronising call would
//! wait for another rank's streams); the GPU ring between processes (cuda-ipc, shm, and network
//! links across "hosts") is tested by starting this binary again as ranks
//! (`device_collectives_on_a_gpu_ring_of_processes`). Every result is checked
//! against the exact reference and compared bit for bit across ranks. Needs a GPU: `#[ignore]`d elsewhere (counted as skipped); run by
//! `scripts/tiers/gpu-tier.sh` with `--include-ignored` under `NODETOUR_REQUIRE_GPU=1`.

use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use nodetour_core::Deadline;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::cuda::{GpuEvent, GpuStream};
use nodetour_core::transport::TransportKind;
use nodetour_core::transport::gpu::{
    FlagValue, Flags, Guarded, StopWord, StreamGuard, enqueue_wait,
};
use nodetour_net::bootstrap::UniqueId;
use nodetour_ring::comm::{Communicator, DevicePath, Elements, Options};
use nodetour_ring::{Error, ReduceOp};

mod common;

fn options(transport: Option<TransportKind>) -> Options {
    let mut o = Options::default()
        .with_gpu(0)
        .with_timeout(Duration::from_secs(20));
    o.transport = transport;
    o
}

fn ranks<R: Send>(world: u32, options: Options, body: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    let id = UniqueId::create().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (id, options, body) = (&id, options.clone(), &body);
                s.spawn(move || {
                    let comm = Communicator::from_unique_id(id, r, world, options)
                        .unwrap_or_else(|e| panic!("rank {r} formation: {e}"));
                    body(comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn value(rank: u32, i: usize) -> f32 {
    ((i * 7 + rank as usize * 5) % 13) as f32
}

/// f32 sum out of place, f32 average in place, bf16 sum in place: `n` elements each.
fn run(world: u32, transport: Option<TransportKind>, n: usize) {
    let got = ranks(world, options(transport), |comm| {
        match &comm.paths().device {
            DevicePath::Staged { .. } if world > 1 => {}
            DevicePath::GpuRing { .. } if world == 1 => {}
            other => panic!("rank {}: device path {other:?}", comm.rank()),
        }
        let r = comm.rank();
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let host: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
        let send = stream.clone_htod(&host).unwrap();
        let mut sum = stream.alloc_zeros::<f32>(n).unwrap();
        comm.all_reduce(&send, &mut sum, ReduceOp::Sum, &stream)
            .unwrap();
        let mut avg = stream.clone_htod(&host).unwrap();
        comm.all_reduce_in_place(&mut avg, ReduceOp::Avg, &stream)
            .unwrap();
        let hb: Vec<bf16> = host.iter().map(|x| bf16::from_f32(*x)).collect();
        let mut b = stream.clone_htod(&hb).unwrap();
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, &stream)
            .unwrap();
        comm.wait(Deadline::after(Duration::from_secs(20))).unwrap();
        let out = (
            stream.clone_dtoh(&sum).unwrap(),
            stream.clone_dtoh(&avg).unwrap(),
            stream.clone_dtoh(&b).unwrap(),
            stream.clone_dtoh(&send).unwrap(),
        );
        comm.close(Deadline::after(Duration::from_secs(60)))
            .unwrap();
        out
    });
    for (r, (sum, avg, b, send)) in got.iter().enumerate() {
        assert_eq!(
            send,
            &(0..n).map(|i| value(r as u32, i)).collect::<Vec<_>>(),
            "rank {r}: the input is untouched"
        );
        for i in (0..n).step_by(997).chain([n - 1]) {
            let want: f32 = (0..world).map(|q| value(q, i)).sum();
            assert_eq!(sum[i], want, "rank {r} element {i}: sum");
            assert!(
                (avg[i] - want / world as f32).abs() <= 1e-6 * want.max(1.0),
                "rank {r} element {i}: average"
            );
            assert_eq!(b[i].to_f32(), want, "rank {r} element {i}: bf16 sum");
        }
        assert_eq!(sum, &got[0].0, "rank {r}: same bits as rank 0");
        assert_eq!(avg, &got[0].1, "rank {r}: same bits as rank 0");
        assert_eq!(b, &got[0].2, "rank {r}: same bits as rank 0");
    }
}

#[test]
#[ignore = "needs a GPU"]
fn device_collectives_on_the_callers_stream_staged_between_threads() {
    if common::gpus().is_none() {
        return;
    }
    for world in [1, 2, 3] {
        // 12 MiB of f32: several slots of the ring.
        run(world, None, 3 << 20);
    }
}

#[test]
#[ignore = "needs a GPU"]
fn device_collectives_staged_through_forced_tcp_links() {
    if common::gpus().is_none() {
        return;
    }
    run(2, Some(TransportKind::Tcp), 3 << 20);
}

type Shapes = (Vec<i32>, Vec<f32>, Vec<bf16>, Vec<f32>);

/// Reduce-scatter (i32 sum), all-gather (f32), broadcast from rank 1 (bf16) and allreduce out
/// of place (f32 average) of `n` elements per rank, on cudarc slices on one stream.
fn shapes(comm: &Communicator, n: usize) -> Shapes {
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    shapes_on(comm, n, &ctx.new_stream().unwrap())
}

/// [`shapes`] on `stream`.
fn shapes_on(comm: &Communicator, n: usize, stream: &Arc<cudarc::driver::CudaStream>) -> Shapes {
    let (r, world) = (comm.rank(), comm.world());
    let whole: Vec<i32> = (0..n * world as usize)
        .map(|i| (i as i32 % 1000) * (r as i32 + 1))
        .collect();
    let step = |what: &str| eprintln!("SPINNER_STEP rank={r} {what}");
    let send = stream.clone_htod(&whole).unwrap();
    let mut rs = stream.alloc_zeros::<i32>(n).unwrap();
    step("reduce_scatter_device");
    comm.reduce_scatter(&send, &mut rs, ReduceOp::Sum, stream)
        .unwrap();
    step("all_gather_device");
    let mine: Vec<f32> = (0..n).map(|i| value(r, i)).collect();
    let mine_d = stream.clone_htod(&mine).unwrap();
    let mut ag = stream.alloc_zeros::<f32>(n * world as usize).unwrap();
    comm.all_gather(&mine_d, &mut ag, stream).unwrap();
    step("broadcast_device_in_place");
    let mut b = stream
        .clone_htod(&vec![bf16::from_f32(r as f32); n])
        .unwrap();
    comm.broadcast_in_place(&mut b, 1 % world, stream).unwrap();
    let mut avg = stream.alloc_zeros::<f32>(n).unwrap();
    step("all_reduce on device");
    comm.all_reduce(&mine_d, &mut avg, ReduceOp::Avg, stream)
        .unwrap();
    step("copies out");
    (
        stream.clone_dtoh(&rs).unwrap(),
        stream.clone_dtoh(&ag).unwrap(),
        stream.clone_dtoh(&b).unwrap(),
        stream.clone_dtoh(&avg).unwrap(),
    )
}

/// What rank `r` of `world` must hold after [`shapes`].
fn check_shapes(r: usize, world: u32, n: usize, got: &Shapes) {
    let (rs, ag, b, avg) = got;
    let factor: i32 = (1..=world as i32).sum();
    let want_rs: Vec<i32> = (0..n)
        .map(|i| ((r * n + i) as i32 % 1000) * factor)
        .collect();
    assert_eq!(rs, &want_rs, "rank {r}: reduce-scatter");
    let want_ag: Vec<f32> = (0..world)
        .flat_map(|q| (0..n).map(move |i| value(q, i)))
        .collect();
    assert_eq!(ag, &want_ag, "rank {r}: all-gather");
    let root = (1 % world) as f32;
    assert!(
        b.iter().all(|x| x.to_f32() == root),
        "rank {r}: broadcast from rank 1"
    );
    for (i, got) in avg.iter().enumerate() {
        let want = (0..world).map(|q| value(q, i)).sum::<f32>() / world as f32;
        assert!(
            (got - want).abs() <= 1e-6 * want.max(1.0),
            "rank {r} element {i}: allreduce average {got}, want {want}"
        );
    }
}

#[test]
#[ignore = "needs a GPU"]
fn device_reduce_scatter_all_gather_and_broadcast_are_exact_on_every_rank() {
    if common::gpus().is_none() {
        return;
    }
    let world = 3u32;
    let n = 100_003usize; // per rank
    let got = ranks(world, options(None), |comm| {
        let out = shapes(&comm, n);
        comm.close(Deadline::after(Duration::from_secs(20)))
            .unwrap();
        out
    });
    for (r, out) in got.iter().enumerate() {
        check_shapes(r, world, n, out);
    }
}

/// The environment that makes a test process a rank of [`device_collectives_on_a_gpu_ring_of_processes`].
const CHILD: &str = "NODETOUR_TEST_GPU_RING_CHILD";

/// Processes (this test binary, started again as ranks) on one GPU form a GPU ring: every
/// device collective queues on it (no host staging), and every rank's answer is exact, twice
/// in a row (the scratch buffer and the ring's counters carry over).
#[test]
#[ignore = "needs a GPU"]
fn device_collectives_on_a_gpu_ring_of_processes() {
    if common::gpus().is_none() {
        return;
    }
    for world in [2u32, 3] {
        gpu_ring_of_processes(world, |_| None);
    }
}

/// The same across "hosts" (`NODETOUR_HOST_ID`: one machine split): every rank its own host
/// (network links only), and two hosts of two ranks (network links between them, in-host links
/// inside each). The links between hosts are the GPU ring's network links over tcp.
#[test]
#[ignore = "needs a GPU"]
fn device_collectives_on_a_gpu_ring_across_hosts() {
    if common::gpus().is_none() {
        return;
    }
    for world in [2u32, 3] {
        gpu_ring_of_processes(world, |r| Some(format!("host{r}")));
    }
    gpu_ring_of_processes(4, |r| Some(format!("host{}", r / 2)));
}

fn gpu_ring_of_processes(world: u32, host_of: impl Fn(u32) -> Option<String>) {
    common::run_rank_processes(
        "gpu_ring_rank",
        CHILD,
        world,
        20_000,
        |r, c| {
            match host_of(r) {
                Some(h) => c.env("NODETOUR_HOST_ID", h),
                None => c.env_remove("NODETOUR_HOST_ID"),
            };
        },
        Duration::from_secs(120),
    );
}

/// A one-thread kernel spinning on a host-mapped word, on a stream of its own. A watchdog
/// ends it (through its stop word) after [`SPINNER_BOUND`] if the test has not released it, so
/// that a synchronising call in the collectives' path shows as a failure naming it, not a hang.
struct Spinner {
    flags: Arc<Flags>,
    stream: GpuStream,
    done: GpuEvent,
    released: Arc<std::sync::atomic::AtomicBool>,
    _kernels: ReduceKernels,
    _guard: StreamGuard,
}

/// How long the spinner may spin before its watchdog ends it.
const SPINNER_BOUND: Duration = Duration::from_secs(30);

impl Spinner {
    fn start() -> Spinner {
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let flags = Arc::new(Flags::create(&ctx, 4).unwrap());
        flags.unlink().unwrap();
        let kernels = ReduceKernels::load(&ctx).unwrap();
        let guard = StreamGuard::new(&ctx, StopWord::new(flags.clone(), 1).unwrap()).unwrap();
        let stream = GpuStream::new(&ctx).unwrap();
        enqueue_wait(
            Guarded {
                stream: &stream,
                kernels: &kernels,
                guard: &guard,
            },
            Some(FlagValue::fixed(&*flags, 0, 1)),
            false,
            None,
        )
        .unwrap();
        let done = GpuEvent::marker(&ctx).unwrap();
        stream.record_marker(&done).unwrap();
        assert!(!done.is_complete().unwrap(), "the spinner spins");
        let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (r, f) = (released.clone(), flags.clone());
        std::thread::spawn(move || {
            let until = std::time::Instant::now() + SPINNER_BOUND;
            while std::time::Instant::now() < until {
                if r.load(std::sync::atomic::Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            eprintln!("SPINNER watchdog: not released after {SPINNER_BOUND:?}: ending it");
            let _ = f.store(1, 1); // the stop word: the kernel ends
        });
        Spinner {
            flags,
            stream,
            done,
            released,
            _kernels: kernels,
            _guard: guard,
        }
    }

    /// Releases the kernel and waits (bounded) for it to end.
    fn release(self) {
        self.released
            .store(true, std::sync::atomic::Ordering::SeqCst);
        assert!(
            !self.done.is_complete().unwrap(),
            "the spinner was ended by its watchdog: something in the collectives' path waited \
             for the whole GPU (see the SPINNER_STEP lines for the call)"
        );
        self.flags.store(0, 1).unwrap();
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while !self.done.is_complete().unwrap() {
            assert!(std::time::Instant::now() < until, "the spinner did not end");
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(self.stream);
    }
}

/// One rank of [`device_collectives_on_a_gpu_ring_of_processes`] (only as its child).
#[test]
#[ignore = "a rank of device_collectives_on_a_gpu_ring_of_processes"]
fn gpu_ring_rank() {
    if std::env::var_os(CHILD).is_none() {
        println!("SKIP runs only as a rank of device_collectives_on_a_gpu_ring_of_processes");
        return;
    }
    let mut o = Options::from_env().unwrap();
    o.gpu = Some(0);
    let comm = Communicator::from_env(o).unwrap();
    let (r, world) = (comm.rank(), comm.world());
    assert!(
        matches!(comm.paths().device, DevicePath::GpuRing { .. }),
        "rank {r}: {}",
        comm.paths()
    );
    if r == 0 {
        println!("GPU_RING_PATHS world={world} {}", comm.paths());
    }
    // No device-wide synchronisation anywhere in the collectives' path: a one-thread kernel
    // spins on another stream of this GPU until the test releases it, after every collective
    // has returned; a synchronising call would wait for it forever (the parent's deadline).
    // The test's own cudarc stream is made first: cudarc synchronises the whole context when a
    // context handle makes its first stream (found by this check).
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let spinner = Spinner::start();
    for n in [1usize, 100_003] {
        for round in 0..2 {
            eprintln!("SPINNER_STEP rank={r} n={n} round={round}");
            let got = shapes_on(&comm, n, &stream);
            check_shapes(r as usize, world, n, &got);
        }
    }
    comm.wait(Deadline::after(Duration::from_secs(20))).unwrap();
    spinner.release();
    // This ring has network links (the ranks are split into hosts over tcp): capturing a
    // collective into a CUDA graph is refused, typed, before anything is queued (the network
    // hand-offs are not replay-safe); the communicator goes on.
    use cudarc::driver::sys;
    let mut x = stream.clone_htod(&vec![1.0f32; 1024]).unwrap();
    stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let refused = comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &stream);
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap();
    drop(graph);
    assert!(
        matches!(&refused, Err(Error::Unsupported { reason }) if reason.contains("graph")),
        "rank {r}: {refused:?}"
    );
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, &stream)
        .unwrap();
    let sum = stream.clone_dtoh(&x).unwrap();
    assert!(
        sum.iter().all(|v| *v == world as f32),
        "rank {r}: after the refused capture"
    );
    comm.close(Deadline::after(Duration::from_secs(20)))
        .unwrap();
    println!("GPU_RING_SHAPES OK rank={r} world={world} (graph capture refused, typed)");
}

#[test]
#[ignore = "needs a GPU"]
fn device_arguments_that_cannot_make_a_collective_fail_before_anything_is_queued() {
    if common::gpus().is_none() {
        return;
    }
    ranks(2, options(None), |comm| {
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let stream = ctx.new_stream().unwrap();
        let a = stream.alloc_zeros::<f32>(10).unwrap();
        let mut b = stream.alloc_zeros::<f32>(11).unwrap();
        let e = comm
            .all_reduce(&a, &mut b, ReduceOp::Sum, &stream)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // The communicator is still usable.
        let mut c = stream.clone_htod(&[comm.rank() as f32; 4]).unwrap();
        comm.all_reduce_in_place(&mut c, ReduceOp::Sum, &stream)
            .unwrap();
        comm.wait(Deadline::after(Duration::from_secs(30))).unwrap();
        assert_eq!(stream.clone_dtoh(&c).unwrap(), vec![1.0f32; 4]);
        let _ = Arc::strong_count(&stream);
        comm.close(Deadline::after(Duration::from_secs(30)))
            .unwrap();
    });
}

/// The staged path (ranks as threads of one process) runs its host ring when called: under
/// CUDA graph capture every device collective is refused, typed, before anything is queued or
/// waited for (a wait would end the caller's capture with an error), and the communicator
/// goes on eagerly.
#[test]
#[ignore = "needs a GPU"]
fn staged_device_collectives_refuse_graph_capture() {
    if common::gpus().is_none() {
        return;
    }
    ranks(2, options(None), |comm| {
        use cudarc::driver::sys;
        use nodetour_ring::DataType;
        let ctx = cudarc::driver::CudaContext::new(0).unwrap();
        let cu = ctx.new_stream().unwrap();
        let stream = GpuStream::of_cudarc(&cu);
        let world = comm.world() as usize;
        let (t, n) = (DataType::F32, 1000usize);
        let buf = nodetour_core::memory::DeviceBuffer::new(&ctx, n * 4 * world).unwrap();
        let out = nodetour_core::memory::DeviceBuffer::new(&ctx, n * 4 * world).unwrap();
        cu.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
            .unwrap();
        let whole = |b| Elements::new(b, n * world, t).unwrap();
        let block = |b| Elements::new(b, n, t).unwrap();
        let refused = [
            comm.all_reduce_in_place(&mut block(&buf), ReduceOp::Sum, &stream),
            comm.reduce_scatter(&whole(&buf), &mut block(&out), ReduceOp::Max, &stream),
            comm.all_gather(&block(&buf), &mut whole(&out), &stream),
            comm.broadcast_in_place(&mut block(&buf), 0, &stream),
        ];
        drop(cu.end_capture(sys::CUgraphInstantiate_flags(0)).unwrap());
        for r in &refused {
            assert!(
                matches!(r, Err(Error::Unsupported { reason }) if reason.contains("captured")),
                "{r:?}"
            );
        }
        // Eagerly, the same calls work.
        buf.copy_from_host(0, &vec![1u8; n * 4 * world]).unwrap();
        comm.all_gather(&block(&buf), &mut whole(&out), &stream)
            .unwrap();
        let mut got = vec![0u8; n * 4 * world];
        out.copy_to_host(0, &mut got).unwrap();
        assert!(got.iter().all(|b| *b == 1));
        comm.close(Deadline::after(Duration::from_secs(20)))
            .unwrap();
    });
}

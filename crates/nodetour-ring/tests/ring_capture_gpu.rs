//! The stream-ordered GPU ring captured into CUDA graphs, between processes of one host: this
//! binary starts itself again as 2, 3 and 4 ranks on GPU 0 (ranks that share a GPU take the
//! ring, not the one-kernel path), over cuda-ipc (direct) and over shared host memory (staged).
//! Each rank captures an allreduce and a reduce-scatter of every type × operation, an
//! all-gather and a broadcast of every type (ring-sized: several chunks per link; the
//! reduce-scatters and all-gathers through scratch of the graph's own) into one graph, replays
//! it with new inputs each time, runs eager collectives of other sizes between the replays, and
//! checks every result bit for bit on every rank (inputs are small integers, so every order of
//! reduction gives the same bytes). The graph's flag values and
//! slots come from counters on the GPU, so each replay is the next collective. A drill: a
//! replay that waits for a rank that never replays ends by its deadline on the GPU.
//!
//! Needs a GPU: `#[ignore]`d elsewhere (counted as skipped); run by
//! `scripts/tiers/gpu-tier.sh` with `--include-ignored` under `NODETOUR_REQUIRE_GPU=1`.

mod common;

use std::time::Duration;

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::{Communicator, Elements, Host, Options};
use nodetour_ring::{DataType, ReduceOp};

const CHILD: &str = "NODETOUR_RING_CAPTURE_TEST_CHILD";

#[test]
#[ignore = "needs a GPU"]
fn ring_collectives_captured_and_replayed_across_processes() {
    if common::gpus().is_none() {
        return;
    }
    for (world, transport) in [
        (2u32, "cuda-ipc"),
        (3, "cuda-ipc"),
        (4, "cuda-ipc"),
        (2, "shm"),
    ] {
        common::run_rank_processes(
            "ring_capture_rank",
            CHILD,
            world,
            20_000,
            |_, c| {
                c.env_remove("NODETOUR_HOST_ID")
                    .env("NODETOUR_TRANSPORT", transport)
                    .env("NODETOUR_ONE_KERNEL", "off");
            },
            Duration::from_secs(300),
        );
    }
}

/// A replay that waits for a rank that never replays ends inside the graph (no host waits
/// there), two ranks with a 5 s timeout, rank 0 replaying alone: by the GPU's own deadline (its
/// stream passes the graph within seconds, its `wait` says `Timeout`), and, in a second job, by
/// an abort from another thread 300 ms in (the stop word ends the waits at once, `wait` says
/// `Aborted`). Either way rank 1's next collective (after rank 0 told it) fails, never `Ok`.
#[test]
#[ignore = "needs a GPU"]
fn ring_replay_alone_ends_by_its_deadline_or_an_abort() {
    if common::gpus().is_none() {
        return;
    }
    for drill in ["deadline", "abort"] {
        common::run_rank_processes(
            "ring_replay_drill_rank",
            CHILD,
            2,
            5_000,
            |_, c| {
                c.env_remove("NODETOUR_HOST_ID")
                    .env("NODETOUR_TRANSPORT", "cuda-ipc")
                    .env("NODETOUR_ONE_KERNEL", "off")
                    .env("RING_REPLAY_DRILL", drill);
            },
            Duration::from_secs(120),
        );
    }
}

/// One rank of the drills (only as a child of the test above).
#[test]
#[ignore = "a rank of ring_replay_alone_ends_by_its_deadline_or_an_abort"]
fn ring_replay_drill_rank() {
    if std::env::var_os(CHILD).is_none() {
        println!("SKIP runs only as a rank of ring_replay_alone_ends_by_its_deadline_or_an_abort");
        return;
    }
    let comm = form_on_gpu0();
    let (r, world) = (comm.rank(), comm.world());
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let cu_stream = ctx.new_stream().unwrap();
    let stream = GpuStream::of_cudarc(&cu_stream);
    let wait = || comm.wait(Deadline::after(Duration::from_secs(20)));
    let (t, n) = (DataType::F32, 1_000_003usize);
    let buf = DeviceBuffer::new(&ctx, n * 4).unwrap();
    use cudarc::driver::sys;
    cu_stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    comm.all_reduce_in_place(
        &mut Elements::new(&buf, n, t).unwrap(),
        ReduceOp::Sum,
        &stream,
    )
    .unwrap();
    let graph = cu_stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    // Both replay once: right.
    buf.copy_from_host(0, &input(t, r, n, 1)).unwrap();
    graph.launch().unwrap();
    cu_stream.synchronize().unwrap();
    wait().unwrap();
    let mut got = vec![0u8; n * 4];
    buf.copy_to_host(0, &mut got).unwrap();
    check(
        "replay together",
        r,
        &got,
        &expected(t, ReduceOp::Sum, world, n, 1),
    );
    let mut x = [1i32];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
        .unwrap();
    let abort = std::env::var("RING_REPLAY_DRILL").as_deref() == Ok("abort");
    if r == 0 {
        if abort {
            let handle = comm.abort_handle();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                handle.abort("the ring replay drill");
            });
        }
        let started = std::time::Instant::now();
        graph.launch().unwrap();
        cu_stream.synchronize().unwrap();
        let ms = started.elapsed().as_millis();
        let e = wait().unwrap_err();
        let drill = if abort { "abort" } else { "deadline" };
        println!("RING_DRILL drill={drill} rank=0 lone_replay_ended_after_ms={ms} error=\"{e}\"");
        if abort {
            assert!(ms < 3_000, "the aborted replay ended only after {ms} ms");
            assert!(
                matches!(e, nodetour_ring::Error::Aborted { .. }),
                "rank 0: {e:?}"
            );
        } else {
            assert!(ms < 15_000, "the lone replay ended only after {ms} ms");
            assert!(
                matches!(e, nodetour_ring::Error::Timeout { .. }),
                "rank 0: {e:?}"
            );
        }
    } else {
        // Past rank 0's deadline (5 s), and its report to this rank.
        std::thread::sleep(Duration::from_secs(9));
        let started = std::time::Instant::now();
        let e = comm
            .all_reduce_in_place(
                &mut Elements::new(&buf, n, t).unwrap(),
                ReduceOp::Sum,
                &stream,
            )
            .and_then(|()| wait())
            .expect_err("a collective returned Ok although rank 0's replay had failed");
        println!(
            "RING_DRILL rank=1 failed_after_ms={} error=\"{e}\"",
            started.elapsed().as_millis()
        );
    }
    drop(graph);
    let _ = comm.close(Deadline::after(Duration::from_secs(10)));
}

/// Rank `rank`'s input for case `seed`: integers in -3..=3 (u8: any byte), exact in every type,
/// so that sums, products (of at most 4 ranks: at most 81), minima and maxima are the same in
/// every order of reduction; fp8 in -1..=1 (E5M2 holds every integer only to 8; products of
/// 81 would round in E4M3 too).
fn input(dtype: DataType, rank: u32, count: usize, seed: u64) -> Vec<u8> {
    let fp8 = matches!(dtype, DataType::F8E4M3 | DataType::F8E5M2);
    common::typed_input(dtype, rank, count, seed, |rng| {
        if fp8 {
            rng.below(3) as f64 - 1.0
        } else {
            rng.below(7) as f64 - 3.0
        }
    })
}

/// What every rank must hold: the fold of every rank's input (any order: see `input`).
fn expected(dtype: DataType, op: ReduceOp, world: u32, count: usize, seed: u64) -> Vec<u8> {
    common::fold_inputs(dtype, op, world, |r| input(dtype, r, count, seed))
}

fn check(what: &str, rank: u32, got: &[u8], want: &[u8]) {
    common::check_bytes(what, rank, got, want);
}

/// One rank (only as a child of the test above).
#[test]
#[ignore = "a rank of ring_collectives_captured_and_replayed_across_processes"]
fn ring_capture_rank() {
    if std::env::var_os(CHILD).is_none() {
        println!(
            "SKIP runs only as a rank of ring_collectives_captured_and_replayed_across_processes"
        );
        return;
    }
    let comm = form_on_gpu0();
    let (r, world) = (comm.rank(), comm.world());
    let paths = comm.paths().to_string();
    if r == 0 {
        println!("RING_CAPTURE_PATHS world={world} {paths}");
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let cu_stream = ctx.new_stream().unwrap();
    let stream = GpuStream::of_cudarc(&cu_stream);
    let wait = || comm.wait(Deadline::after(Duration::from_secs(20)));

    // Every type × operation, one allreduce and one reduce-scatter each; every type, one
    // all-gather and one broadcast each; all of several chunks per link.
    let count = |dtype: DataType| (1 << 20) / dtype.size() + 37;
    let block = |dtype: DataType| (1 << 18) / dtype.size() + 5;
    let mut cases = Vec::new();
    for dtype in DataType::ALL {
        for op in common::device_ops() {
            cases.push(Case::new(
                &ctx,
                Shape::AllReduce,
                dtype,
                op,
                count(dtype),
                world,
            ));
            cases.push(Case::new(
                &ctx,
                Shape::ReduceScatter,
                dtype,
                op,
                block(dtype),
                world,
            ));
        }
        let root = cases.len() as u32 % world;
        let sum = ReduceOp::Sum;
        cases.push(Case::new(
            &ctx,
            Shape::AllGather,
            dtype,
            sum,
            block(dtype),
            world,
        ));
        cases.push(Case::new(
            &ctx,
            Shape::Broadcast(root),
            dtype,
            sum,
            count(dtype),
            world,
        ));
    }
    // One eager collective first: the graph starts from counters that are not zero.
    let warm = DeviceBuffer::new(&ctx, 4 << 20).unwrap();
    let (wn, wt) = (1_000_003usize, DataType::F32);
    warm.copy_from_host(0, &input(wt, r, wn, 1)).unwrap();
    comm.all_reduce_in_place(
        &mut Elements::new(&warm, wn, wt).unwrap(),
        ReduceOp::Sum,
        &stream,
    )
    .unwrap();
    wait().unwrap();

    use cudarc::driver::sys;
    cu_stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    for c in &cases {
        c.queue(&comm, &stream).unwrap();
    }
    let graph = cu_stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph with the captured collectives");
    let replays = 4u64;
    for replay in 0..replays {
        for (k, c) in cases.iter().enumerate() {
            c.fill(r, 100 * replay + k as u64);
        }
        graph.launch().unwrap();
        cu_stream.synchronize().unwrap();
        // A replay that failed says so at the next wait (no host waited for it).
        wait().unwrap();
        for (k, c) in cases.iter().enumerate() {
            c.check(&format!("replay {replay}"), r, 100 * replay + k as u64);
        }
        // Eager collectives between replays, of other sizes (other chunk counts), checked.
        for (e, (t, op, n)) in [
            (DataType::I32, ReduceOp::Max, 777usize),
            (DataType::Bf16, ReduceOp::Sum, 1_500_001),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 10_000 + 10 * replay + e as u64;
            warm.copy_from_host(0, &input(t, r, n, seed)).unwrap();
            comm.all_reduce_in_place(&mut Elements::new(&warm, n, t).unwrap(), op, &stream)
                .unwrap();
            wait().unwrap();
            let mut got = vec![0u8; n * t.size()];
            warm.copy_to_host(0, &mut got).unwrap();
            check(
                &format!("eager after replay {replay}: {t:?} {op:?} x {n}"),
                r,
                &got,
                &expected(t, op, world, n, seed),
            );
        }
        // And an eager reduce-scatter (through the communicator's own scratch).
        let eager = Case::new(
            &ctx,
            Shape::ReduceScatter,
            DataType::F32,
            ReduceOp::Sum,
            4099,
            world,
        );
        let seed = 20_000 + replay;
        eager.fill(r, seed);
        eager.queue(&comm, &stream).unwrap();
        wait().unwrap();
        eager.check(&format!("eager after replay {replay}"), r, seed);
    }
    println!(
        "RING_CAPTURE OK rank={r} world={world} cases={} replays={replays} (eager ones between)",
        cases.len()
    );
    drop(graph);
    let _ = comm.close(Deadline::after(Duration::from_secs(20)));
}

/// What a case runs.
#[derive(Clone, Copy, Debug)]
enum Shape {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast(u32),
}

/// One collective of the graph, on nodetour's device buffers: `send` (in) and `recv` (out;
/// the same buffer for allreduces and broadcasts, in place).
struct Case {
    shape: Shape,
    dtype: DataType,
    op: ReduceOp,
    /// Elements per rank's block (reduce-scatter, all-gather) or of the buffer.
    count: usize,
    world: u32,
    send: DeviceBuffer,
    recv: Option<DeviceBuffer>,
}

impl Case {
    fn new(
        ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
        shape: Shape,
        dtype: DataType,
        op: ReduceOp,
        count: usize,
        world: u32,
    ) -> Case {
        let (block, whole) = (count * dtype.size(), count * dtype.size() * world as usize);
        let (send, recv) = match shape {
            Shape::AllReduce | Shape::Broadcast(_) => (block, None),
            Shape::ReduceScatter => (whole, Some(block)),
            Shape::AllGather => (block, Some(whole)),
        };
        Case {
            shape,
            dtype,
            op,
            count,
            world,
            send: DeviceBuffer::new(ctx, send).unwrap(),
            recv: recv.map(|b| DeviceBuffer::new(ctx, b).unwrap()),
        }
    }

    /// Rank `r`'s input of this case's `seed`.
    fn input(&self, r: u32, seed: u64) -> Vec<u8> {
        let n = match self.shape {
            Shape::ReduceScatter => self.count * self.world as usize,
            _ => self.count,
        };
        input(self.dtype, r, n, seed)
    }

    fn fill(&self, r: u32, seed: u64) {
        self.send.copy_from_host(0, &self.input(r, seed)).unwrap();
    }

    fn queue(&self, comm: &Communicator, stream: &GpuStream) -> nodetour_ring::Result<()> {
        let (t, n, out) = (self.dtype, self.count, self.recv.as_ref());
        match self.shape {
            Shape::AllReduce => {
                let op = common::rank_op(self.op, t, comm.rank() as usize);
                comm.all_reduce_in_place(&mut Elements::new(&self.send, n, t)?, op, stream)
            }
            Shape::ReduceScatter => {
                let send = Elements::new(&self.send, n * comm.world() as usize, t)?;
                let mut recv = Elements::new(out.unwrap(), n, t)?;
                let op = common::rank_op(self.op, t, comm.rank() as usize);
                comm.reduce_scatter(&send, &mut recv, op, stream)
            }
            Shape::AllGather => {
                let send = Elements::new(&self.send, n, t)?;
                let mut recv = Elements::new(out.unwrap(), n * comm.world() as usize, t)?;
                comm.all_gather(&send, &mut recv, stream)
            }
            Shape::Broadcast(root) => {
                comm.broadcast_in_place(&mut Elements::new(&self.send, n, t)?, root, stream)
            }
        }
    }

    /// Checks rank `r`'s output against the inputs of `seed`, bit for bit.
    fn check(&self, when: &str, r: u32, seed: u64) {
        let size = self.dtype.size();
        let all = |r| self.input(r, seed);
        // A PreMulSum's ranks each multiplied by their own scalar.
        let summed = |q: u32| common::summed_as(self.dtype, self.op, q as usize, all(q));
        let want = match self.shape {
            Shape::AllReduce => common::fold_inputs(self.dtype, self.op, self.world, summed),
            Shape::ReduceScatter => {
                let whole = common::fold_inputs(self.dtype, self.op, self.world, summed);
                whole[r as usize * self.count * size..][..self.count * size].to_vec()
            }
            Shape::AllGather => (0..self.world).flat_map(all).collect(),
            Shape::Broadcast(root) => all(root),
        };
        let out = self.recv.as_ref().unwrap_or(&self.send);
        let mut got = vec![0u8; want.len()];
        out.copy_to_host(0, &mut got).unwrap();
        let what = format!(
            "{when}: {:?} {:?} {:?} x {}",
            self.shape, self.dtype, self.op, self.count
        );
        check(&what, r, &got, &want);
    }
}

/// Replays report their outcome and outlive the close (issue 34, item 4), two processes on
/// GPU 0, on the stream-ordered ring and on the one-kernel path, every replay on an input of
/// its own and every `Ok` checked:
/// - rank 1 starts each replay 300 ms after rank 0: `wait` right after rank 0's launch says
///   nothing about the replay (it reports calls, and returns at once: the drill prints it), and
///   `wait_stream` returns only once the replay ran, with the right answer;
/// - rank 1 aborts instead of launching replay 4: rank 0's `wait_stream` fails (the notice
///   taints every replay not yet confirmed), never `Ok`;
/// - both close, then launch the graph again: the replays after the close touch memory the ring
///   kept for them and do nothing (no CUDA error on the stream).
#[test]
#[ignore = "needs a GPU"]
fn replays_report_their_outcome_and_outlive_the_close() {
    if common::gpus().is_none() {
        return;
    }
    for one_kernel in ["off", "force"] {
        // 20 s: formation on a cold machine (kernels loaded for the first time) takes seconds;
        // nothing here waits for the timeout.
        common::run_rank_processes(
            "ring_replay_outcome_rank",
            CHILD,
            2,
            20_000,
            |_, c| {
                c.env_remove("NODETOUR_HOST_ID")
                    .env("NODETOUR_TRANSPORT", "cuda-ipc")
                    .env("NODETOUR_ONE_KERNEL", one_kernel);
            },
            Duration::from_secs(120),
        );
    }
}

/// One rank of the test above (only as its child).
#[test]
#[ignore = "a rank of replays_report_their_outcome_and_outlive_the_close"]
fn ring_replay_outcome_rank() {
    if std::env::var_os(CHILD).is_none() {
        println!("SKIP runs only as a rank of replays_report_their_outcome_and_outlive_the_close");
        return;
    }
    let comm = form_on_gpu0();
    let (r, world) = (comm.rank(), comm.world());
    let path = std::env::var("NODETOUR_ONE_KERNEL").unwrap_or_default();
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let cu_stream = ctx.new_stream().unwrap();
    let stream = GpuStream::of_cudarc(&cu_stream);
    // The one-kernel path takes small collectives (at most NODETOUR_ONE_KERNEL_MAX).
    let (t, n) = if path == "force" {
        (DataType::F32, 65_536usize)
    } else {
        (DataType::F32, 4_000_037usize)
    };
    let buf = DeviceBuffer::new(&ctx, n * 4).unwrap();
    use cudarc::driver::sys;
    cu_stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    comm.all_reduce_in_place(
        &mut Elements::new(&buf, n, t).unwrap(),
        ReduceOp::Sum,
        &stream,
    )
    .unwrap();
    let graph = cu_stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph");
    let deadline = || Deadline::after(Duration::from_secs(20));
    let mut got = vec![0u8; n * 4];
    let mut verified = 0;
    for k in 0..4u64 {
        buf.copy_from_host(0, &input(t, r, n, 100 + k)).unwrap();
        if r == 1 {
            std::thread::sleep(Duration::from_millis(300));
        }
        graph.launch().unwrap();
        if r == 0 {
            let started = std::time::Instant::now();
            let plain = comm.wait(deadline());
            let ran = stream_done(&cu_stream);
            println!(
                "RING_REPLAY path={path} replay={k} rank=0 wait_after_launch={plain:?} after_ms={} replay_done_then={ran}",
                started.elapsed().as_millis()
            );
        }
        comm.wait_stream(&stream, deadline())
            .unwrap_or_else(|e| panic!("rank {r} replay {k}: {e}"));
        assert!(
            stream_done(&cu_stream),
            "wait_stream returned before the replay ran"
        );
        buf.copy_to_host(0, &mut got).unwrap();
        check(
            &format!("replay {k} (path {path})"),
            r,
            &got,
            &expected(t, ReduceOp::Sum, world, n, 100 + k),
        );
        verified += 1;
    }
    // Replay 4: rank 1 aborts instead of launching it; rank 0's replay waits for it.
    buf.copy_from_host(0, &input(t, r, n, 104)).unwrap();
    if r == 0 {
        graph.launch().unwrap();
        let started = std::time::Instant::now();
        match comm.wait_stream(&stream, deadline()) {
            Ok(()) => {
                buf.copy_to_host(0, &mut got).unwrap();
                let right = got == expected(t, ReduceOp::Sum, world, n, 104);
                panic!(
                    "rank 0: replay 4 returned Ok (right answer: {right}) although rank 1 aborted"
                );
            }
            Err(e) => println!(
                "RING_REPLAY path={path} replay=4 rank=0 failed_after_ms={} error=\"{e}\"",
                started.elapsed().as_millis()
            ),
        }
    } else {
        std::thread::sleep(Duration::from_millis(300));
        comm.abort_handle().abort("the replay drill: rank 1 leaves");
        let e = comm.wait_stream(&stream, deadline()).unwrap_err();
        println!("RING_REPLAY path={path} replay=4 rank=1 error=\"{e}\"");
    }
    // Closed, then replayed: the memory the graph uses is still there, and the replay does
    // nothing (its stop word is set for good).
    let closed = comm.close(Deadline::after(Duration::from_secs(10)));
    graph.launch().unwrap();
    cu_stream
        .synchronize()
        .unwrap_or_else(|e| panic!("rank {r}: a replay after the close: {e:?}"));
    println!(
        "RING_REPLAY path={path} rank={r} ok_verified={verified} closed={closed:?} replay_after_close=no CUDA error"
    );
    drop(graph);
}

/// Whether `stream` has run everything queued on it (a query: nothing waits).
fn stream_done(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> bool {
    let event = stream.record_event(None).unwrap();
    event.is_complete()
}

/// This process's communicator as a rank of one of the tests above, on GPU 0.
fn form_on_gpu0() -> Communicator {
    let mut o = Options::from_env().unwrap();
    o.gpu = Some(0);
    Communicator::from_env(o).unwrap()
}

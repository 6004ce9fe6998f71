//! The one-kernel allreduce (`nodetour_core::cuda::one_kernel`) between processes of one host:
//! this binary starts itself again as 2, 3 and 4 ranks on GPU 0 with the path forced on
//! (`OneKernelMode::Force`: ranks that share a GPU are time-sliced, so each wait lasts a context
//! switch; on GPUs of their own the path is chosen by default). Each rank checks, bit for bit:
//!
//! - every type × operation at several counts, eager, against the rank-order fold of every
//!   rank's input by the host reducer (which the kernels match bit for bit): so every rank
//!   holds the same bytes;
//! - collectives captured into a CUDA graph, replayed several times with new inputs each time,
//!   interleaved with eager collectives on the same communicator; a collective too large for
//!   the path (the stream-ordered ring) captured into the same graph;
//! - symmetric buffers (`Communicator::symmetric_buffer`): every type × operation in place,
//!   eager and replayed;
//! - drills: an abort while a replayed kernel waits for a rank that never replays (ends by the
//!   stop word, long before the deadline), then the peer's next collective fails too.
//!
//! Needs a GPU: `#[ignore]`d elsewhere (counted as skipped); run by
//! `scripts/tiers/gpu-tier.sh` with `--include-ignored` under `NODETOUR_REQUIRE_GPU=1`.

mod common;

use std::time::{Duration, Instant};

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::{Communicator, Elements, Host, OneKernelMode, Options};
use nodetour_ring::{DataType, ReduceOp};

const CHILD: &str = "NODETOUR_ONE_KERNEL_TEST_CHILD";

#[test]
#[ignore = "needs a GPU"]
fn one_kernel_allreduces_eager_and_replayed_across_processes() {
    if common::gpus().is_none() {
        return;
    }
    for world in [2u32, 3, 4] {
        run_ranks(world);
    }
}

fn run_ranks(world: u32) {
    common::run_rank_processes(
        "one_kernel_rank",
        CHILD,
        world,
        20_000,
        |_, c| {
            c.env_remove("NODETOUR_HOST_ID")
                .env_remove("NODETOUR_TRANSPORT");
        },
        Duration::from_secs(300),
    );
}

/// Rank `rank`'s input for case `seed`: values exact in every type, different per rank and
/// element (small integers and halves, signed, so that sums, products, minima and maxima all
/// depend on the order only through rounding, which must then be the same on every rank).
fn input(dtype: DataType, rank: u32, count: usize, seed: u64) -> Vec<u8> {
    common::typed_input(dtype, rank, count, seed, |rng| {
        (rng.below(41) as f64 - 20.0) / 2.0 + rng.below(1000) as f64 / 1024.0
    })
}

/// What every rank must hold: the fold of every rank's input in rank order (a PreMulSum's
/// each multiplied by its rank's scalar, `common::rank_op`).
fn expected(dtype: DataType, op: ReduceOp, world: u32, count: usize, seed: u64) -> Vec<u8> {
    common::fold_inputs(dtype, op, world, |r| {
        common::summed_as(dtype, op, r as usize, input(dtype, r, count, seed))
    })
}

fn check(what: &str, rank: u32, got: &[u8], want: &[u8]) {
    common::check_bytes(what, rank, got, want);
}

/// One rank (only as a child of the test above).
#[test]
#[ignore = "a rank of one_kernel_allreduces_eager_and_replayed_across_processes"]
fn one_kernel_rank() {
    if std::env::var_os(CHILD).is_none() {
        println!(
            "SKIP runs only as a rank of one_kernel_allreduces_eager_and_replayed_across_processes"
        );
        return;
    }
    let mut o = Options::from_env().unwrap();
    o.gpu = Some(0);
    o.gpu_ring.one_kernel = OneKernelMode::Force;
    let max = o.gpu_ring.one_kernel_max;
    let comm = Communicator::from_env(o).unwrap();
    let (r, world) = (comm.rank(), comm.world());
    let paths = comm.paths().to_string();
    assert!(
        paths.contains("one kernel per allreduce up to"),
        "rank {r}: {paths}"
    );
    if r == 0 {
        println!("ONE_KERNEL_PATHS world={world} {paths}");
    }
    let ctx = cudarc::driver::CudaContext::new(0).unwrap();
    let cu_stream = ctx.new_stream().unwrap();
    let stream = GpuStream::of_cudarc(&cu_stream);
    let wait = || comm.wait(Deadline::after(Duration::from_secs(20)));

    // Debugging the symmetric buffers: `ONE_KERNEL_TEST_ONLY_SYMMETRIC=1` skips the eager cases.
    let only_symmetric = std::env::var_os("ONE_KERNEL_TEST_ONLY_SYMMETRIC").is_some();
    // Every type × operation, eager, at counts from one element to the path's largest.
    let mut cases = 0;
    for dtype in DataType::ALL.into_iter().filter(|_| !only_symmetric) {
        for op in common::device_ops() {
            // The largest, and one element less: with more than two ranks a two-shot segment
            // that ends off a 16-byte lane (blocks past its end must do nothing).
            let counts = [1usize, 9, 4099, max / dtype.size(), max / dtype.size() - 1];
            for (k, &count) in counts.iter().enumerate() {
                let seed = (cases * 8 + k) as u64;
                let buf = DeviceBuffer::new(&ctx, count * dtype.size()).unwrap();
                buf.copy_from_host(0, &input(dtype, r, count, seed))
                    .unwrap();
                comm.all_reduce_in_place(
                    &mut Elements::new(&buf, count, dtype).unwrap(),
                    common::rank_op(op, dtype, r as usize),
                    &stream,
                )
                .unwrap();
                wait().unwrap();
                stream.synchronize().unwrap();
                let mut got = vec![0u8; count * dtype.size()];
                buf.copy_to_host(0, &mut got).unwrap();
                let what = format!("{dtype:?} {op:?} x {count}");
                check(&what, r, &got, &expected(dtype, op, world, count, seed));
            }
            cases += 1;
        }
    }
    println!("ONE_KERNEL_EAGER OK rank={r} world={world} cases={cases}");

    // Captured: three collectives in one graph, replayed with new inputs, eager ones between.
    let shapes = [
        (DataType::Bf16, ReduceOp::Sum, 3001usize),
        (DataType::F32, ReduceOp::Avg, 65536),
        (DataType::I64, ReduceOp::Max, 17),
        (DataType::F16, ReduceOp::pre_mul_sum(1.0), 2049),
    ];
    let bufs: Vec<DeviceBuffer> = shapes
        .iter()
        .map(|(t, _, n)| DeviceBuffer::new(&ctx, n * t.size()).unwrap())
        .collect();
    use cudarc::driver::sys;
    cu_stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    for ((t, op, n), b) in shapes.iter().zip(&bufs) {
        let op = common::rank_op(*op, *t, r as usize);
        comm.all_reduce_in_place(&mut Elements::new(b, *n, *t).unwrap(), op, &stream)
            .unwrap();
    }
    // Too large for the path: the stream-ordered ring, captured into the same graph.
    let big = DeviceBuffer::new(&ctx, 2 * max + 64).unwrap();
    let big_n = (2 * max + 64) / 4;
    comm.all_reduce_in_place(
        &mut Elements::new(&big, big_n, DataType::I32).unwrap(),
        ReduceOp::Max,
        &stream,
    )
    .unwrap();
    let graph = cu_stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph with the captured kernels");
    for replay in 0..6u64 {
        for ((t, _, n), b) in shapes.iter().zip(&bufs) {
            b.copy_from_host(0, &input(*t, r, *n, 1000 + replay))
                .unwrap();
        }
        big.copy_from_host(0, &input(DataType::I32, r, big_n, 3000 + replay))
            .unwrap();
        graph.launch().unwrap();
        cu_stream.synchronize().unwrap();
        let mut got = vec![0u8; big_n * 4];
        big.copy_to_host(0, &mut got).unwrap();
        let want = expected(DataType::I32, ReduceOp::Max, world, big_n, 3000 + replay);
        check(
            &format!("replay {replay}: the ring's I32 Max x {big_n}"),
            r,
            &got,
            &want,
        );
        for ((t, op, n), b) in shapes.iter().zip(&bufs) {
            let mut got = vec![0u8; n * t.size()];
            b.copy_to_host(0, &mut got).unwrap();
            let what = format!("replay {replay}: {t:?} {op:?} x {n}");
            check(&what, r, &got, &expected(*t, *op, world, *n, 1000 + replay));
        }
        // An eager collective between replays (every third replay, a ring-sized one too).
        let (t, op, n) = if replay % 3 == 2 {
            (DataType::F32, ReduceOp::Sum, (2 * max + 64) / 4)
        } else {
            (DataType::F16, ReduceOp::Min, 777)
        };
        let b = if n * t.size() > max { &big } else { &bufs[1] };
        b.copy_from_host(0, &input(t, r, n, 2000 + replay)).unwrap();
        comm.all_reduce_in_place(&mut Elements::new(b, n, t).unwrap(), op, &stream)
            .unwrap();
        wait().unwrap();
        stream.synchronize().unwrap();
        let mut got = vec![0u8; n * t.size()];
        b.copy_to_host(0, &mut got).unwrap();
        if n * t.size() <= max {
            check(
                &format!("eager after replay {replay}"),
                r,
                &got,
                &expected(t, op, world, n, 2000 + replay),
            );
        }
    }
    wait().unwrap();
    println!(
        "ONE_KERNEL_GRAPH OK rank={r} world={world} replays=6 (3 collectives each, eager ones between)"
    );

    // Symmetric buffers: every type × operation in place on every rank's part, read directly
    // by the peers (two-shot with a closing barrier), then captured and replayed.
    let sym = comm.symmetric_buffer(max + 123).unwrap();
    let mut cases = 0;
    for dtype in DataType::ALL {
        for op in common::device_ops() {
            for (k, count) in [3usize, (max + 123) / dtype.size()].into_iter().enumerate() {
                let seed = 5000 + (cases * 8 + k) as u64;
                let inp = input(dtype, r, count, seed);
                sym.with_device_buffer(|d| d.copy_from_host(0, &inp))
                    .unwrap()
                    .unwrap();
                let mut e = sym.elements(count, dtype).unwrap();
                comm.all_reduce_in_place(&mut e, common::rank_op(op, dtype, r as usize), &stream)
                    .unwrap();
                wait().unwrap();
                stream.synchronize().unwrap();
                let mut got = vec![0u8; count * dtype.size()];
                sym.with_device_buffer(|d| d.copy_to_host(0, &mut got))
                    .unwrap()
                    .unwrap();
                let what = format!("symmetric {dtype:?} {op:?} x {count}");
                let want = expected(dtype, op, world, count, seed);
                if got != want {
                    // What the bytes look like beside every rank's input (which went wrong).
                    let head = |b: &[u8]| format!("{:02x?}", &b[..b.len().min(24)]);
                    eprintln!("SYMMETRIC_MISMATCH rank={r} {what}: got {}", head(&got));
                    eprintln!("SYMMETRIC_MISMATCH rank={r} {what}: want {}", head(&want));
                    for q in 0..world {
                        let i = input(dtype, q, count, seed);
                        eprintln!(
                            "SYMMETRIC_MISMATCH rank={r} {what}: input of {q} {}",
                            head(&i)
                        );
                    }
                }
                check(&what, r, &got, &want);
            }
            cases += 1;
        }
    }
    let n = 100_003usize;
    cu_stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
        .unwrap();
    let mut e = sym.elements(n, DataType::Bf16).unwrap();
    comm.all_reduce_in_place(&mut e, ReduceOp::Sum, &stream)
        .unwrap();
    let sym_graph = cu_stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .unwrap()
        .expect("a graph with the captured kernel");
    for replay in 0..3u64 {
        let inp = input(DataType::Bf16, r, n, 7000 + replay);
        sym.with_device_buffer(|d| d.copy_from_host(0, &inp))
            .unwrap()
            .unwrap();
        sym_graph.launch().unwrap();
        cu_stream.synchronize().unwrap();
        let mut got = vec![0u8; n * 2];
        sym.with_device_buffer(|d| d.copy_to_host(0, &mut got))
            .unwrap()
            .unwrap();
        let want = expected(DataType::Bf16, ReduceOp::Sum, world, n, 7000 + replay);
        check(&format!("symmetric replay {replay}"), r, &got, &want);
    }
    drop(sym_graph);
    wait().unwrap();
    // The communicator is held inside the closure: a call of it there fails typed instead of
    // waiting for itself, and a panic there leaves it usable.
    let inner = sym
        .with_device_buffer(|_| comm.wait(Deadline::after(Duration::from_secs(1))))
        .unwrap();
    assert!(
        matches!(inner, Err(nodetour_ring::Error::InvalidArgument { .. })),
        "rank {r}: a call inside the closure: {inner:?}"
    );
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        sym.with_device_buffer(|_| panic!("the caller's own panic"))
    }));
    assert!(panicked.is_err(), "rank {r}: the closure's panic went on");
    wait().unwrap_or_else(|e| panic!("rank {r}: unusable after a panic in the closure: {e}"));
    println!("ONE_KERNEL_SYMMETRIC OK rank={r} world={world} cases={cases} replays=3");

    // Drill: rank 0 replays once more alone and aborts while its kernel waits for ranks that
    // never replay; the kernel ends by the stop word, long before the deadline.
    share_barrier(&comm);
    if r == 0 {
        let handle = comm.abort_handle();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            handle.abort("the one-kernel abort drill");
        });
        let t = Instant::now();
        graph.launch().unwrap();
        cu_stream.synchronize().unwrap();
        let ms = t.elapsed().as_millis();
        let e = wait().unwrap_err();
        println!("ONE_KERNEL_DRILL rank=0 replay_ended_after_ms={ms} error=\"{e}\"");
        assert!(ms < 10_000, "rank 0: the replay ended only after {ms} ms");
    } else {
        // Once rank 0 has aborted (its replay waits 300 ms for these ranks, which join no
        // collective meanwhile), its notice reaches every rank (passed around the ring): the
        // next collective fails, never Ok.
        std::thread::sleep(Duration::from_millis(1500));
        // Rank 0 never joins again, so no collective can return Ok here: one that does is a
        // wrong answer (its data could not be rank 0's), not a retry.
        let b = &bufs[2];
        let t = Instant::now();
        let e = comm
            .all_reduce_in_place(
                &mut Elements::new(b, 17, DataType::I64).unwrap(),
                ReduceOp::Max,
                &stream,
            )
            .and_then(|()| wait())
            .expect_err("a collective returned Ok although rank 0 had aborted and never joined");
        println!(
            "ONE_KERNEL_DRILL rank={r} failed_after_ms={} error=\"{e}\"",
            t.elapsed().as_millis()
        );
    }
    drop(graph);
    let _ = comm.close(Deadline::after(Duration::from_secs(20)));
    println!("ONE_KERNEL OK rank={r} world={world}");
}

/// Every rank here before any goes on (a host allreduce: the communicator's host path).
fn share_barrier(comm: &Communicator) {
    let mut x = [1i32];
    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
        .unwrap();
    assert_eq!(x[0], comm.world() as i32);
}

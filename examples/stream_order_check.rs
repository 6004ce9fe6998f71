//! Drills of a communicator's device collectives on several of the runtime's streams (issue
//! 48), one GPU per process (processes may share one), every `Ok` checked:
//!
//! ```text
//! scripts/launch-local.sh -n 2 -- target/release/examples/stream_order_check --order 1200
//! scripts/launch-local.sh -n 2 -- target/release/examples/stream_order_check --waits
//! scripts/launch-local.sh -n 2 -- target/release/examples/stream_order_check --per-thread
//! scripts/launch-local.sh -n 2 -- target/release/examples/stream_order_check --cost
//! ```
//! - `--order N`: N allreduces of `--bytes` (64 KiB: the one-kernel path), each on an input of
//!   its own (seeded by its index and the rank), alternating between two streams that nothing
//!   orders, in batches of 40; after each batch `wait`, then both streams synchronised, then
//!   every result checked. Prints `STREAM_ORDER rank=.. ok_verified=.. wrong=.. error=..`.
//! - `--waits`: the first stream held by a long kernel, a 256 MiB allreduce queued behind it,
//!   then 4 bytes on the second stream; `wait`, `InFlight::wait` and `close` must not return
//!   before the first has run. Prints `STREAM_WAITS rank=.. <call>_early=<bool> ...`.
//! - `--per-thread`: an allreduce on the calling thread's per-thread default stream (held by a
//!   long kernel), its buffer dropped on another thread while the collective is queued, a new
//!   buffer of the same size filled with a sentinel: the collective must not write the
//!   sentinel. Then allreduces on the legacy default stream (cudarc's and the raw handle),
//!   each checked. Prints `PER_THREAD rank=.. reused=.. sentinel_intact=..` and
//!   `DEFAULT_STREAMS rank=.. ok_verified=..`.
//! - `--cost`: the host time to queue one allreduce (median of 10,000 calls, in batches of
//!   100 with a wait between) and the latency of one (median of 500 queue-and-synchronise
//!   rounds) at 8 B, 64 KiB and 1 MiB. Prints `STREAM_COST bytes=.. queue_us=.. latency_us=..`.
//!
//! Without a GPU it prints `SKIP <reason>` and exits 0.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use clap::Parser;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nodetour::ring::comm::Elements;
use nodetour::{Communicator, Options};
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::seeded::{input, verify};
use nodetour_ring::{DataType, ReduceOp};

const TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Parser)]
#[command(about = "A communicator's device collectives on several streams, every Ok checked")]
struct Args {
    /// Allreduces on two unordered streams, each checked.
    #[arg(long)]
    order: Option<u64>,
    /// Bytes of each `--order` allreduce.
    #[arg(long, default_value_t = 64 << 10)]
    bytes: usize,
    /// Waits that must cover every stream.
    #[arg(long)]
    waits: bool,
    /// The per-thread default stream, and the legacy default stream.
    #[arg(long)]
    per_thread: bool,
    /// Host time to queue, and latency.
    #[arg(long)]
    cost: bool,
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    if let Err(reason) = nodetour_core::cuda::availability() {
        println!("SKIP stream_order_check: {reason}");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("stream_order_check: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let gpus = nodetour_core::cuda::gpus()?.len().max(1);
    // The GPU first (the launcher's local rank), then the communicator on it.
    let local: usize = std::env::var("LOCAL_RANK")
        .or_else(|_| std::env::var("NODETOUR_LOCAL_RANK"))
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let gpu = local % gpus;
    let ctx = CudaContext::new(gpu)?;
    let comm = Communicator::from_env(Options::from_env()?.with_gpu(gpu))?;
    if let Some(n) = args.order {
        order(&comm, &ctx, n, args.bytes)?;
    }
    if args.per_thread {
        per_thread(&comm, &ctx)?;
    }
    if args.cost {
        cost(&comm, &ctx)?;
    }
    if args.waits {
        // Last: `close` takes the communicator.
        return waits(comm, &ctx);
    }
    comm.close(Deadline::after(TIMEOUT))?;
    Ok(())
}

/// Collective `i`'s input on this rank (f32 sum).
fn seeded(rank: u32, count: usize, i: u64) -> Vec<f32> {
    bytemuck::cast_slice(&input(DataType::F32, ReduceOp::Sum, rank, count, i)).to_vec()
}

fn check(world: u32, got: &[f32], i: u64) -> Result<(), String> {
    verify(
        DataType::F32,
        ReduceOp::Sum,
        world,
        bytemuck::cast_slice(got),
        i,
    )
}

/// `--order`: see the module's doc.
fn order(comm: &Communicator, ctx: &Arc<CudaContext>, n: u64, bytes: usize) -> anyhow::Result<()> {
    let (rank, world) = (comm.rank(), comm.world());
    let count = (bytes / 4).max(1);
    let streams = [ctx.new_stream()?, ctx.new_stream()?];
    const BATCH: u64 = 40;
    let (mut ok, mut wrong, mut first_wrong) = (0u64, 0u64, String::new());
    let mut error = String::new();
    let mut i = 0u64;
    'batches: while i < n {
        let batch: Vec<u64> = (i..(i + BATCH).min(n)).collect();
        let mut bufs: Vec<CudaSlice<f32>> = Vec::new();
        for &k in &batch {
            let s = &streams[(k % 2) as usize];
            bufs.push(s.clone_htod(&seeded(rank, count, k))?);
        }
        // Each stream has its inputs; the calls themselves alternate, unordered.
        for (j, &k) in batch.iter().enumerate() {
            let s = &streams[(k % 2) as usize];
            if let Err(e) = comm.all_reduce_in_place(&mut bufs[j], ReduceOp::Sum, s) {
                error = format!("collective {k}: {e}");
                break 'batches;
            }
        }
        let waited = comm.wait(Deadline::after(TIMEOUT));
        for s in &streams {
            s.synchronize()?;
        }
        if let Err(e) = waited {
            error = format!("wait after collective {}: {e}", batch.last().unwrap_or(&0));
            break;
        }
        // `wait` said Ok: every one of these must be right.
        for (j, &k) in batch.iter().enumerate() {
            let got: Vec<f32> = streams[(k % 2) as usize].clone_dtoh(&bufs[j])?;
            match check(world, &got, k) {
                Ok(()) => ok += 1,
                Err(e) => {
                    wrong += 1;
                    if first_wrong.is_empty() {
                        first_wrong = e;
                    }
                }
            }
        }
        i += batch.len() as u64;
    }
    println!(
        "STREAM_ORDER rank={rank} world={world} bytes={bytes} called={n} ok_verified={ok} wrong={wrong} first_wrong=\"{first_wrong}\" error=\"{error}\""
    );
    if wrong > 0 {
        bail!("{wrong} wrong Ok");
    }
    if !error.is_empty() {
        bail!("{error}");
    }
    Ok(())
}

/// Queues on `stream` the busy kernel for about `ms` on this GPU (one block, calibrated here);
/// what it returns must outlive the kernel.
fn hold(
    context: &Arc<CudaContext>,
    stream: &GpuStream,
    ms: u64,
) -> anyhow::Result<(ReduceKernels, DeviceBuffer)> {
    let kernels = ReduceKernels::load(context)?;
    let sink = DeviceBuffer::new(context, 4096)?;
    let probe = 1u32 << 20;
    let calibrate = GpuStream::new(context)?;
    let start = calibrate.record()?;
    kernels.busy(&calibrate, &sink, probe, 1)?;
    let end = calibrate.record()?;
    calibrate.synchronize()?;
    let per_iter_ms = f64::from(start.elapsed_ms(&end)?) / f64::from(probe);
    let iters = (ms as f64 / per_iter_ms.max(1e-9)).clamp(1.0, f64::from(u32::MAX)) as u32;
    kernels.busy(stream, &sink, iters, 1)?;
    Ok((kernels, sink))
}

/// Whether the work queued on `stream` so far has run (never blocks).
fn ran(stream: &Arc<CudaStream>) -> anyhow::Result<bool> {
    let m = nodetour_core::cuda::GpuEvent::marker(stream.context())?;
    GpuStream::of_cudarc(stream).record_marker(&m)?;
    Ok(m.is_complete()?)
}

/// `--waits`: see the module's doc.
fn waits(comm: Communicator, ctx: &Arc<CudaContext>) -> anyhow::Result<()> {
    let (rank, world) = (comm.rank(), comm.world());
    let big = (256 << 20) / 4;
    let [s1, s2] = [ctx.new_stream()?, ctx.new_stream()?];
    let mut small = s2.clone_htod(&seeded(rank, 1, 7))?;
    // `wait` and `InFlight::wait`: the first stream held for ~1.5 s.
    let mut results = Vec::new();
    for (round, what) in ["wait", "inflight_wait"].into_iter().enumerate() {
        let seed = 100 + round as u64;
        let mut large = s1.clone_htod(&seeded(rank, big, seed))?;
        s1.synchronize()?;
        let _held = hold(ctx, &GpuStream::of_cudarc(&s1), 1500)?;
        let t = Instant::now();
        let early = if round == 0 {
            comm.all_reduce_in_place(&mut large, ReduceOp::Sum, &s1)?;
            comm.all_reduce_in_place(&mut small, ReduceOp::Sum, &s2)?;
            comm.wait(Deadline::after(TIMEOUT))?;
            !ran(&s1)?
        } else {
            let pending = comm
                .start(large, &s1, |c, g, s| {
                    c.all_reduce_in_place(g, ReduceOp::Sum, s)
                })
                .map_err(|f| f.error)?;
            comm.all_reduce_in_place(&mut small, ReduceOp::Sum, &s2)?;
            large = pending
                .wait(Deadline::after(TIMEOUT))
                .map_err(|f| f.error)?;
            !ran(&s1)?
        };
        let waited_ms = t.elapsed().as_millis();
        s1.synchronize()?;
        s2.synchronize()?;
        let got: Vec<f32> = s1.clone_dtoh(&large)?;
        let right = check(world, &got, seed).is_ok();
        results.push(format!(
            "{what}_early={early} {what}_ms={waited_ms} {what}_right={right}"
        ));
    }
    // `close`: the same, then close; the first stream must have run by the time it returns.
    let mut large = s1.clone_htod(&seeded(rank, big, 102))?;
    s1.synchronize()?;
    let _held = hold(ctx, &GpuStream::of_cudarc(&s1), 1500)?;
    comm.all_reduce_in_place(&mut large, ReduceOp::Sum, &s1)?;
    comm.all_reduce_in_place(&mut small, ReduceOp::Sum, &s2)?;
    let t = Instant::now();
    let closed = comm.close(Deadline::after(TIMEOUT));
    let early = !ran(&s1)?;
    let close_ms = t.elapsed().as_millis();
    s1.synchronize()?;
    results.push(format!(
        "close_early={early} close_ms={close_ms} close_ok={}",
        closed.is_ok()
    ));
    println!(
        "STREAM_WAITS rank={rank} world={world} {}",
        results.join(" ")
    );
    Ok(())
}

/// `--per-thread`: see the module's doc.
fn per_thread(comm: &Communicator, ctx: &Arc<CudaContext>) -> anyhow::Result<()> {
    let (rank, world) = (comm.rank(), comm.world());
    let bytes = 64 << 10;
    let count = bytes / 4;
    let per_thread = GpuStream::of_cudarc(&ctx.per_thread_stream());
    let buffer = DeviceBuffer::new(ctx, bytes)?;
    buffer.copy_from_host(0, bytemuck::cast_slice(&seeded(rank, count, 300)))?;
    let address = buffer.device_ptr();
    let held = hold(ctx, &per_thread, 1500)?;
    comm.all_reduce_in_place(
        &mut Elements::new(&buffer, count, DataType::F32)?,
        ReduceOp::Sum,
        &per_thread,
    )?;
    // Dropped on another thread while the collective waits behind the long kernel.
    std::thread::spawn(move || drop(buffer))
        .join()
        .map_err(|_| anyhow::anyhow!("the dropping thread panicked"))?;
    nodetour_core::cuda::reap_releases();
    let fresh = DeviceBuffer::new(ctx, bytes)?;
    let reused = fresh.device_ptr() == address;
    let sentinel = vec![0xa5u8; bytes];
    fresh.copy_from_host(0, &sentinel)?;
    comm.wait(Deadline::after(TIMEOUT))?;
    per_thread.synchronize()?;
    let mut got = vec![0u8; bytes];
    fresh.copy_to_host(0, &mut got)?;
    let intact = got == sentinel;
    drop(held);
    println!("PER_THREAD rank={rank} world={world} reused={reused} sentinel_intact={intact}");
    // The legacy default stream: cudarc's `default_stream()` (the NULL handle) and the raw
    // `CU_STREAM_LEGACY`, each result checked.
    let mut ok = 0;
    for (k, stream) in [
        ctx.default_stream(),
        // SAFETY: the legacy default stream's handle is always valid.
        unsafe { ctx.wrap_borrowed_stream(nodetour_core::cuda::stream::CU_STREAM_LEGACY) },
        ctx.per_thread_stream(),
    ]
    .iter()
    .enumerate()
    {
        let seed = 310 + k as u64;
        let mut data = stream.clone_htod(&seeded(rank, count, seed))?;
        comm.all_reduce_in_place(&mut data, ReduceOp::Sum, stream)?;
        comm.wait(Deadline::after(TIMEOUT))?;
        let got: Vec<f32> = stream.clone_dtoh(&data)?;
        check(world, &got, seed).map_err(|e| anyhow::anyhow!("default stream {k}: {e}"))?;
        ok += 1;
    }
    println!("DEFAULT_STREAMS rank={rank} world={world} ok_verified={ok}");
    if !intact {
        bail!("the collective wrote memory freed under it (the sentinel changed)");
    }
    Ok(())
}

/// The median of `v`, in microseconds.
fn median_us(v: &mut [Duration]) -> f64 {
    v.sort();
    v.get(v.len() / 2).map_or(0.0, |d| d.as_secs_f64() * 1e6)
}

/// `--cost`: see the module's doc.
fn cost(comm: &Communicator, ctx: &Arc<CudaContext>) -> anyhow::Result<()> {
    let (rank, world) = (comm.rank(), comm.world());
    let stream = ctx.new_stream()?;
    for bytes in [8usize, 64 << 10, 1 << 20] {
        let count = bytes / 4;
        let mut data = stream.clone_htod(&seeded(rank, count, 400))?;
        for _ in 0..50 {
            comm.all_reduce_in_place(&mut data, ReduceOp::Sum, &stream)?;
        }
        comm.wait(Deadline::after(TIMEOUT))?;
        let mut queue = Vec::with_capacity(10_000);
        for _ in 0..100 {
            for _ in 0..100 {
                let t = Instant::now();
                comm.all_reduce_in_place(&mut data, ReduceOp::Sum, &stream)?;
                queue.push(t.elapsed());
            }
            comm.wait(Deadline::after(TIMEOUT))?;
        }
        let mut latency = Vec::with_capacity(500);
        for _ in 0..500 {
            let t = Instant::now();
            comm.all_reduce_in_place(&mut data, ReduceOp::Sum, &stream)?;
            stream.synchronize()?;
            latency.push(t.elapsed());
        }
        comm.wait(Deadline::after(TIMEOUT))
            .context("after the cost rounds")?;
        println!(
            "STREAM_COST rank={rank} world={world} bytes={bytes} queue_us={:.2} latency_us={:.2}",
            median_us(&mut queue),
            median_us(&mut latency)
        );
    }
    Ok(())
}

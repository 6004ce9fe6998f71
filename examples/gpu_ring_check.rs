//! The GPU ring across processes, one GPU each, through `nodetour::Communicator` (direct over
//! cuda-ipc, or staged through shared host memory with `NODETOUR_TRANSPORT=shm`): correctness against the float64 reference, then
//! an `all_reduce_perf`-style sweep with the references measured in the same run:
//!
//! ```text
//! NCCL_NVLS_ENABLE=0 scripts/launch-local.sh -n 2 -- target/release/examples/gpu_ring_check --all --perf --compare-nccl
//! NODETOUR_TRANSPORT=shm scripts/launch-local.sh -n 2 -- target/release/examples/gpu_ring_check --perf --ceiling
//! ```
//! - `--all`: every data type and operation (else f32 sum, i64 max, bf16 avg) at several
//!   counts (1, a prime, and one that spans several slots per segment);
//! - `--perf`: f32 sum from 1 MiB to 1 GiB, median of 5 batches timed by CUDA events, each row
//!   checked; `--compare-nccl` alternates NCCL's allreduce (one rank per process,
//!   `ncclCommInitRank`) on buffers of its own on the same streams;
//! - `--ceiling`: the concurrent-copy ceiling of this machine in the same run (every rank's GPU
//!   copying to and from pinned shared memory at once, both directions), which the staged
//!   path is measured against.
//!
//! Prints `GPU_RING OK ...` per rank, `GPU_RING_PERF ...` rows and `GPU_RING_CEILING ...`.
//! Without a GPU it prints `SKIP <reason>` and exits 0.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use nodetour::ring::comm::{Elements, GpuRingOptions};
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::{Config, Deadline};
use nodetour_ring::seeded::{input, rank_op, verify};
use nodetour_ring::{DataType, ReduceOp};
use nodetour_tools::gpu_job::{GpuJob, VariantSpec, ring_path, variants_of};
use nodetour_tools::perf::cases;
use nodetour_tools::perf_gpu::{SweepSpec, render, ring_sweep};

#[derive(Parser)]
#[command(about = "GPU ring allreduce across processes, checked and measured")]
struct Args {
    /// Every data type and operation.
    #[arg(long)]
    all: bool,
    /// The performance sweep (f32 sum).
    #[arg(long)]
    perf: bool,
    /// Largest size of the sweep, bytes.
    #[arg(long, default_value_t = 1 << 30)]
    max_bytes: usize,
    /// NCCL alongside, on the same streams.
    #[arg(long)]
    compare_nccl: bool,
    /// Measure the concurrent-copy ceiling.
    #[arg(long)]
    ceiling: bool,
    /// Slots per link.
    #[arg(long)]
    slots: Option<u32>,
    /// Bytes per slot (both paths).
    #[arg(long)]
    slot_bytes: Option<usize>,
    /// Direct path: flags in shared host memory instead of GPU memory.
    #[arg(long)]
    host_flags: bool,
    /// Failure drill: this rank kills itself (SIGKILL) in the middle of a stream of
    /// collectives; every other rank must fail naming it within 2x NODETOUR_TIMEOUT_MS.
    #[arg(long)]
    kill_rank: Option<u32>,
    /// Agreement drill: this rank calls the collective with half the count of the others; every
    /// rank must fail at once (a typed disagreement, or its neighbour's notice), none with Ok.
    #[arg(long)]
    disagree_rank: Option<u32>,
    /// Teardown drill: this rank queues a collective its peers never join and closes its ring
    /// (the close aborts it, tells the peers and drains within the deadline); the peers' next
    /// collective then fails at once with the notice instead of at their deadline.
    #[arg(long)]
    close_rank: Option<u32>,
    /// Abort drill: this rank aborts its ring from another thread in the middle of a stream of
    /// collectives, then leaves; it must see `Aborted`, the others the lost rank.
    #[arg(long)]
    abort_rank: Option<u32>,
    /// Late-peer drill (`--drill-bytes` at most `NODETOUR_ONE_KERNEL_MAX` takes the one-kernel
    /// path): this rank is late for collective `--late-at` by `--late-gpu-ms` (a busy kernel
    /// queued ahead of it on its stream) or `--late-host-ms` (its host sleeps before queueing
    /// it), longer than the timeout, and queues one collective at a time; every other rank
    /// queues four at a time (t to t+3 queued when t fails: launches queued ahead) and waits
    /// for them up to 5x the timeout (a caller's deadline longer than the path's own). Every
    /// `Ok` is checked against its own collective's seeded input (`GPU_LATE_DRILL` lines,
    /// `WRONG_OK` if one is wrong).
    #[arg(long)]
    late_rank: Option<u32>,
    /// The collective the late rank is late for (a multiple of 4).
    #[arg(long, default_value_t = 8)]
    late_at: u32,
    /// How late on the GPU, ms.
    #[arg(long)]
    late_gpu_ms: Option<u64>,
    /// How late on the host, ms.
    #[arg(long)]
    late_host_ms: Option<u64>,
    /// Agreement drill: this rank's slots are twice the others' bytes (both paths, and the
    /// network links'); formation must fail on every rank naming the setting and both values
    /// (prints `SETTINGS_DIFFER rank=..`).
    #[arg(long)]
    differ_rank: Option<u32>,
    /// Deterministic drills: every other rank holds this many milliseconds before it queues
    /// collective 20, and the kill or abort rank fails 5 ms after it queued collective 20, so
    /// the failure always lands while that rank's streams wait on a held peer (credit for its
    /// next chunk, the peer's first chunk), and the peer queues the collective after it.
    #[arg(long)]
    hold_ms: Option<u64>,
    /// Two ranks: also sweep the two-step ring beside the default one-step exchange (a second
    /// communicator, formed from a unique id).
    #[arg(long)]
    also_ring: bool,
    /// The device from the caller: a communicator formed without a GPU runs host and device
    /// collectives interleaved (every `Ok` checked), its first device collective forming the
    /// GPU path on its stream's GPU, which `paths()` must then show (`FROM_STREAM OK ...`).
    #[arg(long)]
    from_stream: bool,
    /// With `--from-stream`: form the communicator with its GPU named
    /// (`Options::with_gpu`), so its GPU ring is formed with it; `--interleave-differ` then
    /// checks that a host-side failure aborts that ring too.
    #[arg(long)]
    with_gpu: bool,
    /// With `--from-stream`: after the checked collectives, this rank runs a device collective
    /// then a host one while the others run them the other way round; every rank must fail
    /// typed within the timeout, none `Ok` (prints `FROM_STREAM_DIFFER rank=..`).
    #[arg(long)]
    interleave_differ: Option<u32>,
    /// Bytes per collective of the drills (default: 64 MiB for the kill and abort drills,
    /// 4 MiB for the agreement drill); at most `NODETOUR_ONE_KERNEL_MAX` drills the one-kernel
    /// path where it is on.
    #[arg(long)]
    drill_bytes: Option<usize>,
}

const TIMEOUT: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    if let Err(reason) = nodetour_core::cuda::availability() {
        println!("SKIP gpu_ring_check: {reason}");
        return ExitCode::SUCCESS;
    }
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_ring_check: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::from_env()?;
    let mut options = GpuRingOptions::default();
    if let Some(s) = args.slots {
        options.slots = s;
        options.ipc_slots = s;
    }
    options.device_flags = !args.host_flags;
    if let Some(b) = args.slot_bytes {
        options.ipc_slot_bytes = b;
        options.shm_slot_bytes = b;
    }
    if args.from_stream {
        return from_stream_check(args.interleave_differ, args.with_gpu);
    }
    let launch = nodetour_net::bootstrap::LaunchInfo::from_env()?;
    let world = launch.world_size;
    if let Some(odd) = args.differ_rank {
        if launch.rank == odd {
            options.ipc_slot_bytes *= 2;
            options.shm_slot_bytes *= 2;
        }
        let me = launch.rank;
        return match GpuJob::form(&variants_of("auto")?, options, false) {
            Err(e @ nodetour_ring::Error::SettingDiffers { .. }) => {
                println!("SETTINGS_DIFFER rank={me} error=\"{e}\"");
                Ok(())
            }
            Err(e) => bail!("rank {me}: formation failed, but not naming the setting: {e}"),
            Ok(_) => bail!("rank {me}: formed with a rank whose slot bytes differ"),
        };
    }
    let mut variants = variants_of("auto")?;
    if args.perf && args.also_ring && world == 2 {
        variants.push(VariantSpec {
            label: "two-step ring".into(),
            paths: variants[0].paths,
            two_rank_exchange: false,
        });
    }
    let g = GpuJob::form(&variants, options, args.compare_nccl)?;
    let comm = &g.variants[0].comm;
    let deadline = || Deadline::after(config.timeout);
    if args.kill_rank.is_some() || args.abort_rank.is_some() {
        return drill(g, &args, &config);
    }
    if let Some(victim) = args.close_rank {
        return close_drill(g, victim, &config);
    }
    if let Some(late) = args.late_rank {
        return late_drill(&g, late, &args, &config);
    }
    if let Some(odd) = args.disagree_rank {
        return disagree_drill(&g, odd, args.drill_bytes.unwrap_or(4 << 20), &config);
    }
    println!("{}", comm.paths());
    let stream = GpuStream::new(&g.context)?;

    // Correctness.
    let cases = cases(
        args.all,
        true,
        &[
            (DataType::F32, ReduceOp::Sum),
            (DataType::I64, ReduceOp::Max),
            (DataType::Bf16, ReduceOp::Avg),
        ],
    );
    let counts = [1usize, 7919, 5_000_011];
    let buf = DeviceBuffer::new(&g.context, 5_000_011 * 8)?;
    // Every collective has its own input (seeded by its index and the rank), and every Ok is
    // checked against that collective's answer.
    let mut seed = 0u64;
    for &(dtype, op) in &cases {
        for &count in &counts {
            buf.copy_from_host(0, &input(dtype, op, g.rank, count, seed))?;
            let mine = rank_op(op, dtype, g.rank);
            comm.all_reduce_in_place(&mut Elements::new(&buf, count, dtype)?, mine, &stream)?;
            comm.wait(Deadline::after(TIMEOUT))?;
            stream.synchronize()?;
            let mut got = vec![0u8; count * dtype.size()];
            buf.copy_to_host(0, &mut got)?;
            if let Err(e) = verify(dtype, op, g.world, &got, seed) {
                bail!("{dtype:?} {op:?} count {count}: {e}");
            }
            seed += 1;
        }
    }
    // The non-blocking form: the handle owns the buffer until `wait` gives it back.
    let count = 5_000_011;
    buf.copy_from_host(0, &input(DataType::F32, ReduceOp::Sum, g.rank, count, seed))?;
    let handle = comm
        .start(buf, &stream, |comm, b, s| {
            comm.all_reduce_in_place(
                &mut Elements::new(b, count, DataType::F32)?,
                ReduceOp::Sum,
                s,
            )
        })
        .map_err(|f| f.error)?;
    let buf = handle.wait(Deadline::after(TIMEOUT)).map_err(|f| f.error)?;
    stream.synchronize()?;
    let mut got = vec![0u8; count * 4];
    buf.copy_to_host(0, &mut got)?;
    if let Err(e) = verify(DataType::F32, ReduceOp::Sum, g.world, &got, seed) {
        bail!("non-blocking f32 sum: {e}");
    }
    drop(buf);
    println!(
        "GPU_RING OK rank={} world={} cases={} counts={counts:?} ok_verified={} path=\"{}\"",
        g.rank,
        g.world,
        cases.len(),
        seed + 1,
        ring_path(comm)
    );
    g.barrier()?;

    if args.perf {
        let sizes = nodetour_tools::perf::parse_sizes(&format!("1M:{}", args.max_bytes), 4)?;
        let spec = SweepSpec {
            sizes,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            warmup: 2,
            iters: 0,
            compare_nccl: args.compare_nccl,
            ceiling: args.ceiling,
            beside_compute: false,
            graph: false,
        };
        let rows = ring_sweep(&g, &spec, TIMEOUT)?;
        let what = format!("{} processes, one GPU each", g.world);
        let path = g
            .variants
            .iter()
            .map(|v| format!("{}: {}", v.label, ring_path(&v.comm)))
            .collect::<Vec<_>>()
            .join(" | ");
        print!(
            "{}",
            render(&rows, "text", &what, &path, DataType::F32, ReduceOp::Sum)
        );
        if rows
            .iter()
            .any(|r| !r.nodetour.2 || r.nccl.is_some_and(|x| !x.2))
        {
            bail!("a wrong result in the sweep");
        }
    }
    Ok(g.close(deadline())?)
}

/// `--from-stream`: formed with no GPU named, host and device collectives interleaved in the
/// same order on every rank, each checked against its own seeded input; the device path must
/// be a GPU ring after the first device collective, and none before.
fn from_stream_check(differ: Option<u32>, with_gpu: bool) -> anyhow::Result<()> {
    use nodetour::{Communicator, Host, Options};
    use nodetour_ring::comm::DevicePath;
    let gpus = nodetour_core::cuda::gpus()?.len().max(1);
    let local: usize = std::env::var("LOCAL_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let options = match with_gpu {
        true => Options::from_env()?.with_gpu(local % gpus),
        false => Options::from_env()?,
    };
    let comm = Communicator::from_env(options)?;
    if !with_gpu && !matches!(comm.paths().device, DevicePath::None) {
        bail!(
            "a device path before any device collective: {}",
            comm.paths()
        );
    }
    let ctx = cudarc::driver::CudaContext::new(comm.local_rank() as usize % gpus)?;
    let stream = ctx.new_stream()?;
    let (r, world) = (comm.rank(), comm.world());
    let count = 1 << 20;
    for i in 0..6u64 {
        // Host metadata, then device gradients: the same order on every rank.
        let (host_op, dev_op) = (ReduceOp::Max, ReduceOp::Sum);
        let mut meta: Vec<i64> =
            bytemuck::cast_slice(&input(DataType::I64, host_op, r, 64, 2 * i)).to_vec();
        comm.all_reduce_in_place(&mut meta, host_op, Host)?;
        if let Err(e) = verify(
            DataType::I64,
            host_op,
            world,
            bytemuck::cast_slice(&meta),
            2 * i,
        ) {
            bail!("host allreduce {i}: {e}");
        }
        let seed = 2 * i + 1;
        let host: Vec<f32> =
            bytemuck::cast_slice(&input(DataType::F32, dev_op, r, count, seed)).to_vec();
        let mut grads = stream.clone_htod(&host)?;
        comm.all_reduce_in_place(&mut grads, dev_op, &stream)?;
        comm.wait(Deadline::after(TIMEOUT))?;
        let got: Vec<f32> = stream.clone_dtoh(&grads)?;
        if let Err(e) = verify(
            DataType::F32,
            dev_op,
            world,
            bytemuck::cast_slice(&got),
            seed,
        ) {
            bail!("device allreduce {i}: {e}");
        }
    }
    let paths = comm.paths();
    if !matches!(paths.device, DevicePath::GpuRing { .. }) {
        bail!("no GPU ring after the first device collective: {paths}");
    }
    println!(
        "FROM_STREAM OK rank={r} world={world} collectives=12 path=\"{}\"",
        ring_path(&comm)
    );
    if let Some(odd) = differ {
        let t = std::time::Instant::now();
        let mut meta = [1i64; 64];
        let mut grads = stream.alloc_zeros::<f32>(count)?;
        let mut device = || comm.all_reduce_in_place(&mut grads, ReduceOp::Sum, &stream);
        let result = if r == odd {
            device().and_then(|()| comm.all_reduce_in_place(&mut meta, ReduceOp::Sum, Host))
        } else {
            comm.all_reduce_in_place(&mut meta, ReduceOp::Sum, Host)
                .and_then(|()| device())
        }
        .and_then(|()| comm.wait(Deadline::after(TIMEOUT)));
        match result {
            Ok(()) => bail!("rank {r}: Ok from collectives interleaved differently"),
            Err(e) => println!(
                "FROM_STREAM_DIFFER rank={r} after_ms={} error=\"{e}\"",
                t.elapsed().as_millis()
            ),
        }
        // Broken now, and its device side with it (the odd rank's queued device collective
        // was aborted): close tears down at once, with the handshake, on every rank. Its error
        // is the failure above; running to the deadline would mean a rank still waited for
        // work no peer will join (and exported slots leaked).
        let closing = std::time::Instant::now();
        let closed = comm.close(Deadline::after(Duration::from_secs(20)));
        let close_ms = closing.elapsed().as_millis();
        println!("FROM_STREAM_DIFFER_CLOSED rank={r} close_ms={close_ms}");
        if close_ms >= 10_000 {
            bail!("rank {r}: close of the broken communicator took {close_ms} ms: {closed:?}");
        }
        return Ok(());
    }
    comm.close(Deadline::after(TIMEOUT))?;
    Ok(())
}

/// Queues on `stream` the busy kernel for about `ms` on this GPU (one block, calibrated here);
/// what it returns must outlive the kernel.
fn queue_busy(
    context: &std::sync::Arc<cudarc::driver::CudaContext>,
    stream: &GpuStream,
    ms: u64,
) -> anyhow::Result<(nodetour_core::cuda::reduce::ReduceKernels, DeviceBuffer)> {
    let kernels = nodetour_core::cuda::reduce::ReduceKernels::load(context)?;
    let sink = DeviceBuffer::new(context, 4096)?;
    let probe = 1u32 << 22;
    let start = stream.record()?;
    kernels.busy(stream, &sink, probe, 1)?;
    let end = stream.record()?;
    stream.synchronize()?;
    let per_iter_ms = f64::from(start.elapsed_ms(&end)?) / f64::from(probe);
    let iters = (ms as f64 / per_iter_ms.max(1e-9)).clamp(1.0, f64::from(u32::MAX)) as u32;
    kernels.busy(stream, &sink, iters, 1)?;
    Ok((kernels, sink))
}

/// The late-peer drill (see `--late-rank`): collectives 0..40 of `--drill-bytes` (f32 sum),
/// each on an input of its own; the late rank queues one at a time and is late for
/// `--late-at`, the others queue four at a time and wait up to 5x the timeout. Prints one `GPU_LATE_DRILL` line per rank:
/// the first failed collective, how many `Ok` were verified, and the error.
fn late_drill(g: &GpuJob, late: u32, args: &Args, config: &Config) -> anyhow::Result<()> {
    let comm = &g.variants[0].comm;
    let bytes = args.drill_bytes.unwrap_or(64 << 10);
    let count = bytes / 4;
    let bufs = (0..4)
        .map(|_| DeviceBuffer::new(&g.context, bytes))
        .collect::<nodetour_core::Result<Vec<_>>>()?;
    let stream = GpuStream::new(&g.context)?;
    let me = g.rank;
    const AHEAD: u32 = 4;
    let t = args.late_at / AHEAD * AHEAD;
    let depth = if me == late { 1 } else { AHEAD };
    let deadline = if me == late {
        config.timeout
    } else {
        5 * config.timeout
    };
    let mut got = vec![0u8; bytes];
    let (mut verified, mut wrong) = (0u32, 0u32);
    let mut failed = None;
    // The busy kernel's module and sink, alive until the stream has run it.
    let mut busy = None;
    g.barrier()?;
    let mut k = 0u32;
    while k < 40 && failed.is_none() {
        let n = depth.min(40 - k);
        for j in 0..n {
            bufs[j as usize].copy_from_host(
                0,
                &input(DataType::F32, ReduceOp::Sum, me, count, u64::from(k + j)),
            )?;
        }
        if me == late && k == t {
            if let Some(ms) = args.late_gpu_ms {
                println!(
                    "GPU_LATE_DRILL rank={me}: a busy kernel of {ms} ms ahead of collective {k}"
                );
                busy = Some(queue_busy(&g.context, &stream, ms)?);
            }
            if let Some(ms) = args.late_host_ms {
                println!("GPU_LATE_DRILL rank={me}: the host sleeps {ms} ms before collective {k}");
                std::thread::sleep(Duration::from_millis(ms));
            }
        }
        let result = (0..n)
            .try_for_each(|j| {
                comm.all_reduce_in_place(
                    &mut Elements::new(&bufs[j as usize], count, DataType::F32)?,
                    ReduceOp::Sum,
                    &stream,
                )
            })
            .and_then(|()| comm.wait(Deadline::after(deadline)));
        if let Err(e) = result {
            failed = Some((k, e));
            break;
        }
        stream.synchronize()?;
        for j in 0..n {
            bufs[j as usize].copy_to_host(0, &mut got)?;
            match verify(
                DataType::F32,
                ReduceOp::Sum,
                g.world,
                &got,
                u64::from(k + j),
            ) {
                Ok(()) => verified += 1,
                Err(e) => {
                    println!(
                        "GPU_LATE_DRILL rank={me} WRONG_OK collective={}: {e}",
                        k + j
                    );
                    wrong += 1;
                }
            }
        }
        k += n;
    }
    stream.synchronize()?;
    drop(busy);
    let (at, error) = match &failed {
        Some((k, e)) => (i64::from(*k), e.to_string()),
        None => (-1, String::new()),
    };
    println!(
        "GPU_LATE_DRILL rank={me} late_rank={late} late_at={t} failed_at={at} ok_verified={verified} wrong_ok={wrong} error=\"{error}\""
    );
    if wrong > 0 {
        bail!("rank {me}: {wrong} collectives returned Ok with a wrong result");
    }
    if failed.is_none() {
        bail!("rank {me}: 40 collectives and no failure: the drill did not happen");
    }
    Ok(())
}

/// The agreement drill: rank `odd` calls with half the count; every rank's wait must fail long
/// before the deadline.
fn disagree_drill(g: &GpuJob, odd: u32, bytes: usize, config: &Config) -> anyhow::Result<()> {
    let comm = &g.variants[0].comm;
    let count = bytes / 4;
    let buf = DeviceBuffer::new(&g.context, count * 4)?;
    let stream = GpuStream::new(&g.context)?;
    let me = g.rank;
    // One agreed collective first, checked: the communicator works.
    buf.copy_from_host(0, &input(DataType::F32, ReduceOp::Sum, me, count, 0))?;
    comm.all_reduce_in_place(
        &mut Elements::new(&buf, count, DataType::F32)?,
        ReduceOp::Sum,
        &stream,
    )?;
    comm.wait(Deadline::after(config.timeout))?;
    stream.synchronize()?;
    let mut got = vec![0u8; count * 4];
    buf.copy_to_host(0, &mut got)?;
    if let Err(e) = verify(DataType::F32, ReduceOp::Sum, g.world, &got, 0) {
        bail!("rank {me}: the agreed collective returned Ok with a wrong result: {e}");
    }
    buf.copy_from_host(0, &input(DataType::F32, ReduceOp::Sum, me, count, 1))?;
    g.barrier()?;
    let mine = if me == odd { count / 2 } else { count };
    let t = std::time::Instant::now();
    let result = comm
        .all_reduce_in_place(
            &mut Elements::new(&buf, mine, DataType::F32)?,
            ReduceOp::Sum,
            &stream,
        )
        .and_then(|()| comm.wait(Deadline::after(config.timeout)));
    let ms = t.elapsed().as_millis();
    println!("GPU_RING_DISAGREE rank={me} count={mine} failed_in_ms={ms} result={result:?}");
    match result {
        Ok(()) => bail!("rank {me}: a collective the ranks disagree on returned Ok"),
        Err(_) if t.elapsed() >= config.timeout => bail!("rank {me}: noticed only at the deadline"),
        Err(_) => {}
    }
    // Broken now: every later call says so.
    if comm.error().is_none() {
        bail!("rank {me}: the communicator is not broken after the disagreement");
    }
    Ok(())
}

/// The teardown drill: `victim` queues a collective alone and leaves (aborts and closes its
/// communicator); the close must end within its deadline, telling the peers, whose collective
/// must then fail at once, naming the victim's notice, never reported as a result.
fn close_drill(g: GpuJob, victim: u32, config: &Config) -> anyhow::Result<()> {
    let count = (16 << 20) / 4;
    let buf = DeviceBuffer::new(&g.context, count * 4)?;
    let stream = GpuStream::new(&g.context)?;
    let me = g.rank;
    g.barrier()?;
    let comm = &g.variants[0].comm;
    if me == victim {
        comm.all_reduce_in_place(
            &mut Elements::new(&buf, count, DataType::F32)?,
            ReduceOp::Sum,
            &stream,
        )?;
        let t = std::time::Instant::now();
        comm.abort_handle().abort("the close drill's victim leaves");
        let closed = g.close(Deadline::after(Duration::from_secs(3)));
        println!(
            "GPU_RING_CLOSE rank={me} closed_in_ms={} result={closed:?}",
            t.elapsed().as_millis()
        );
        if t.elapsed() > Duration::from_secs(5) {
            bail!("rank {me}: the close took longer than its deadline");
        }
        // The caller's stream waited on the ring's end markers: it must not hang either.
        stream.synchronize()?;
    } else {
        std::thread::sleep(Duration::from_millis(500));
        let t = std::time::Instant::now();
        let result = comm
            .all_reduce_in_place(
                &mut Elements::new(&buf, count, DataType::F32)?,
                ReduceOp::Sum,
                &stream,
            )
            .and_then(|()| comm.wait(Deadline::after(config.timeout)));
        println!(
            "GPU_RING_CLOSE rank={me} failed_in_ms={} result={result:?}",
            t.elapsed().as_millis()
        );
        if result.is_ok() {
            bail!("rank {me}: a collective the victim never joined returned Ok");
        }
    }
    Ok(())
}

/// The failure drills: every rank queues 64 MiB allreduces and waits for each (the
/// communicator's wait checks the job's liveness); the victim dies (SIGKILL) or aborts from a
/// watchdog thread after a few. Collective k's input is seeded by k and the rank (small
/// integers: f32 sums are exact): every collective that returns `Ok` is compared bit for bit
/// with its own reference, before and after the failure.
fn drill(g: GpuJob, args: &Args, config: &Config) -> anyhow::Result<()> {
    let comm = &g.variants[0].comm;
    let count = args.drill_bytes.unwrap_or(64 << 20) / 4;
    let buf = DeviceBuffer::new(&g.context, count * 4)?;
    let stream = GpuStream::new(&g.context)?;
    let me = g.rank;
    let mut got = vec![0u8; count * 4];
    let mut verified = 0u32;
    g.barrier()?;
    let start = std::time::Instant::now();
    let mut lost_at = None;
    let failing = args.kill_rank == Some(me) || args.abort_rank == Some(me);
    for k in 0..1000u32 {
        if let (Some(ms), 20, false) = (args.hold_ms, k, failing) {
            println!("GPU_RING_DRILL rank={me}: holding {ms} ms before collective {k}");
            std::thread::sleep(Duration::from_millis(ms));
        }
        if args.kill_rank == Some(me) && k == 20 && args.hold_ms.is_some() {
            println!("GPU_RING_DRILL rank={me}: killing myself (SIGKILL) 5 ms into collective {k}");
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(5));
                let _ = std::process::Command::new("kill")
                    .args(["-9", &std::process::id().to_string()])
                    .status();
            });
        } else if args.kill_rank == Some(me) && k == 20 {
            println!("GPU_RING_DRILL rank={me}: killing myself (SIGKILL) after {k} collectives");
            let _ = std::process::Command::new("kill")
                .args(["-9", &std::process::id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(60));
        }
        if args.abort_rank == Some(me) && k == 20 {
            let handle = comm.abort_handle();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                handle.abort("the abort drill's watchdog");
            });
        }
        // Collective k's own input: an Ok computed from another collective's data fails.
        buf.copy_from_host(
            0,
            &input(DataType::F32, ReduceOp::Sum, me, count, u64::from(k)),
        )?;
        let t = std::time::Instant::now();
        let result = comm
            .all_reduce_in_place(
                &mut Elements::new(&buf, count, DataType::F32)?,
                ReduceOp::Sum,
                &stream,
            )
            .and_then(|()| comm.wait(Deadline::after(config.timeout)));
        if let Err(e) = result {
            lost_at = Some((k, t.elapsed(), e));
            break;
        }
        // Ok means the right answer, on every rank: check every byte.
        buf.copy_to_host(0, &mut got)?;
        if let Err(e) = verify(DataType::F32, ReduceOp::Sum, g.world, &got, u64::from(k)) {
            println!("GPU_RING_DRILL rank={me} WRONG_OK collective={k}: {e}");
            bail!("rank {me}: collective {k} returned Ok with a wrong result: {e}");
        }
        verified += 1;
    }
    let Some((k, waited, e)) = lost_at else {
        bail!("rank {me}: 1000 collectives and no failure: the drill did not happen");
    };
    println!(
        "GPU_RING_DRILL rank={me} failed_at_collective={k} ok_verified={verified} detected_after_ms={} bound_ms={} since_start_ms={} error=\"{e}\"",
        waited.as_millis(),
        2 * config.timeout.as_millis(),
        start.elapsed().as_millis()
    );
    if waited > 2 * config.timeout {
        bail!("rank {me} took longer than 2x the timeout to notice");
    }
    // The teardown with a rank gone: what this rank exported is freed only once every live
    // neighbour confirmed its close (else leaked: the log says which), and the GPU is fine
    // after it (no fault from memory freed under a neighbour's write).
    let t = std::time::Instant::now();
    drop(buf);
    let context = g.context.clone();
    let closed = g.close(Deadline::after(config.timeout));
    let probe = DeviceBuffer::new(&context, 4096).and_then(|b| {
        b.copy_from_host(0, &[7u8; 4096])?;
        let mut back = [0u8; 4096];
        b.copy_to_host(0, &mut back)?;
        Ok(back == [7u8; 4096])
    });
    let cuda_ok = stream.synchronize().is_ok() && matches!(probe, Ok(true));
    println!(
        "GPU_RING_DRILL rank={me} teardown_ms={} close={closed:?} cuda_ok={cuda_ok}",
        t.elapsed().as_millis()
    );
    if !cuda_ok {
        bail!("rank {me}: the GPU failed after the teardown: {probe:?}");
    }
    Ok(())
}

//! The GPU ring across processes, one GPU each (direct over cuda-ipc, or staged through shared
//! host memory with `NODETOUR_TRANSPORT=shm`): correctness against the float64 reference, then
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
//!   `ncclCommInitRank`) on the same buffers and streams;
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
use nodetour::gpu_job::{GpuRingJob, GpuRingOptions};
use nodetour::perf::{cases, pattern, verify};
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::nccl::LocalNccl;
use nodetour_core::transport::gpu::{Flags, ShmSender, ShmSlot};
use nodetour_core::{Config, Deadline};
use nodetour_ring::{DataType, ReduceOp};

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
    /// NCCL alongside, same buffers and streams.
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
    /// cuda-ipc chunks up to this many bytes are written by a kernel (else the copy engine).
    #[arg(long)]
    kernel_send_max: Option<usize>,
    /// Two ranks: also sweep the two-step ring beside the default one-step exchange.
    #[arg(long)]
    also_ring: bool,
}

const BATCHES: usize = 5;
const TIMEOUT: Duration = Duration::from_secs(60);

fn main() -> ExitCode {
    nodetour::logging::init();
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

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
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
    let info = nodetour_core::bootstrap::LaunchInfo::from_env()?;
    let nccl_id = if args.compare_nccl && info.rank == 0 {
        nodetour_core::nccl::unique_id()?.to_vec()
    } else {
        Vec::new()
    };
    let mut g = GpuRingJob::form(&config, options, &nccl_id)?;
    if let Some(b) = args.kernel_send_max {
        g.ring.set_kernel_send_max(b);
    }
    let deadline = || Deadline::after(config.timeout);
    println!(
        "rank {} of {}: GPU {}, {}; {}",
        g.rank,
        g.world,
        g.context.ordinal(),
        g.choice,
        g.ring.path()
    );
    let stream = GpuStream::new(&g.context)?;

    // Correctness.
    let cases = cases(
        args.all,
        &[
            (DataType::F32, ReduceOp::Sum),
            (DataType::I64, ReduceOp::Max),
            (DataType::Bf16, ReduceOp::Avg),
        ],
    );
    let counts = [1usize, 7919, 5_000_011];
    let buf = DeviceBuffer::new(&g.context, 5_000_011 * 8)?;
    for &(dtype, op) in &cases {
        for &count in &counts {
            buf.copy_from_host(0, &pattern(dtype, g.rank, count))?;
            g.ring.all_reduce(&buf, count, dtype, op, &stream)?;
            g.ring.wait(TIMEOUT)?;
            stream.synchronize()?;
            let mut got = vec![0u8; count * dtype.size()];
            buf.copy_to_host(0, &mut got)?;
            if let Err(e) = verify(dtype, op, g.world, &got) {
                bail!("{dtype:?} {op:?} count {count}: {e}");
            }
        }
    }
    // The non-blocking form: the handle owns the buffer until `wait` gives it back.
    let count = 5_000_011;
    buf.copy_from_host(0, &pattern(DataType::F32, g.rank, count))?;
    let handle = g
        .ring
        .start_all_reduce(buf, count, DataType::F32, ReduceOp::Sum, &stream, TIMEOUT)
        .map_err(|f| f.error)?;
    let buf = handle.wait().map_err(|f| f.error)?;
    stream.synchronize()?;
    let mut got = vec![0u8; count * 4];
    buf.copy_to_host(0, &mut got)?;
    if let Err(e) = verify(DataType::F32, ReduceOp::Sum, g.world, &got) {
        bail!("non-blocking f32 sum: {e}");
    }
    drop(buf);
    println!(
        "GPU_RING OK rank={} world={} cases={} counts={counts:?} path=\"{}\"",
        g.rank,
        g.world,
        cases.len(),
        g.ring.path()
    );
    g.job.barrier(deadline())?;

    let ceiling = if args.ceiling {
        Some(copy_ceiling(&g, &stream, &config)?)
    } else {
        None
    };
    if args.perf {
        perf(&mut g, &stream, &args, ceiling, &config)?;
    }
    g.job.barrier(deadline())?;
    Ok(())
}

/// Every rank's GPU copies `BYTES` to pinned shared host memory and `BYTES` back at once
/// (two streams), after a barrier so that all ranks overlap; GB/s of each direction, median of
/// 3. The staged ring moves the same bytes the same way, so this is its ceiling.
fn copy_ceiling(g: &GpuRingJob, stream: &GpuStream, config: &Config) -> anyhow::Result<f64> {
    const BYTES: usize = 512 << 20;
    let host = ShmSlot::create(2 * BYTES)?;
    let (path, len) = host.grant();
    let out = ShmSender::open(&path, len, Flags::create(1)?, 0)?;
    host.unlink()?;
    let src = DeviceBuffer::new(&g.context, BYTES)?;
    let dst = DeviceBuffer::new(&g.context, BYTES)?;
    let other = GpuStream::new(&g.context)?;
    let (mut d2h, mut h2d) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        g.job.barrier(Deadline::after(config.timeout))?;
        let start = stream.record()?;
        other.wait_marker(&start)?;
        out.enqueue_write(stream, &src, 0, 0, BYTES, None)?;
        host.enqueue_copy_out(&other, &dst, 0, BYTES, BYTES)?;
        let (a, b) = (stream.record()?, other.record()?);
        d2h.push(BYTES as f64 / (f64::from(start.elapsed_ms(&a)?) / 1e3) / 1e9);
        h2d.push(BYTES as f64 / (f64::from(start.elapsed_ms(&b)?) / 1e3) / 1e9);
    }
    let (d, h) = (median(d2h), median(h2d));
    println!(
        "GPU_RING_CEILING rank={} bytes={BYTES} concurrent_d2h_GBps={d:.1} concurrent_h2d_GBps={h:.1} ceiling_GBps={:.1} pages={:?}",
        g.rank,
        d.min(h),
        host.pages()
    );
    Ok(d.min(h))
}

fn perf(
    g: &mut GpuRingJob,
    stream: &GpuStream,
    args: &Args,
    ceiling: Option<f64>,
    config: &Config,
) -> anyhow::Result<()> {
    let (dtype, op) = (DataType::F32, ReduceOp::Sum);
    let mut nccl = if args.compare_nccl {
        let id: [u8; 128] = g.extras[0]
            .as_slice()
            .try_into()
            .map_err(|_| anyhow::anyhow!("rank 0 sent no NCCL id"))?;
        Some(LocalNccl::join(
            &id,
            g.world,
            g.rank,
            g.context.ordinal() as i32,
        )?)
    } else {
        None
    };
    let buf = DeviceBuffer::new(&g.context, args.max_bytes)?;
    let n = f64::from(g.world);
    let algos: &[bool] = if args.also_ring && g.world == 2 {
        &[true, false]
    } else {
        &[true]
    };
    for &exchange in algos {
        g.ring.set_two_rank_exchange(exchange);
        let mut bytes = 1 << 20;
        while bytes <= args.max_bytes {
            let count = bytes / dtype.size();
            let iters = (((4u64 << 30) / bytes as u64).clamp(2, 50)) as usize;
            // Checked first: ours, then NCCL's.
            buf.copy_from_host(0, &pattern(dtype, g.rank, count))?;
            g.ring.all_reduce(&buf, count, dtype, op, stream)?;
            g.ring.wait(TIMEOUT)?;
            stream.synchronize()?;
            let mut got = vec![0u8; bytes];
            buf.copy_to_host(0, &mut got)?;
            let ours_ok = verify(dtype, op, g.world, &got).is_ok();
            let nccl_ok = match nccl.as_mut() {
                Some(c) => {
                    buf.copy_from_host(0, &pattern(dtype, g.rank, count))?;
                    c.all_reduce(&[&buf], &[stream], count, dtype, op)?;
                    stream.synchronize()?;
                    buf.copy_to_host(0, &mut got)?;
                    Some(verify(dtype, op, g.world, &got).is_ok())
                }
                None => None,
            };
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for batch in 0..=BATCHES {
                let start = stream.record()?;
                for _ in 0..iters {
                    g.ring.all_reduce(&buf, count, dtype, op, stream)?;
                }
                let end = stream.record()?;
                g.ring.wait(TIMEOUT)?;
                let t = f64::from(start.elapsed_ms(&end)?) / 1e3 / iters as f64;
                if batch > 0 {
                    ours.push(t); // batch 0 warms up
                }
                if let Some(c) = nccl.as_mut() {
                    let start = stream.record()?;
                    for _ in 0..iters {
                        c.all_reduce(&[&buf], &[stream], count, dtype, op)?;
                    }
                    let end = stream.record()?;
                    let t = f64::from(start.elapsed_ms(&end)?) / 1e3 / iters as f64;
                    if batch > 0 {
                        theirs.push(t);
                    }
                }
            }
            let t = median(ours);
            let busbw = bytes as f64 / t / 1e9 * 2.0 * (n - 1.0) / n;
            let mut row = format!(
                "GPU_RING_PERF rank={} world={} bytes={bytes} time_us={:.1} busbw_GBps={busbw:.1} check={}",
                g.rank,
                g.world,
                t * 1e6,
                if ours_ok { "ok" } else { "WRONG" }
            );
            if let Some(c) = ceiling {
                row += &format!(" vs_ceiling={:.2}", busbw / c);
            }
            if !theirs.is_empty() {
                let tn = median(theirs);
                let nb = bytes as f64 / tn / 1e9 * 2.0 * (n - 1.0) / n;
                row += &format!(
                    " nccl_time_us={:.1} nccl_busbw_GBps={nb:.1} nccl_check={} vs_nccl={:.2}",
                    tn * 1e6,
                    if nccl_ok == Some(true) { "ok" } else { "WRONG" },
                    busbw / nb
                );
            }
            println!("{row} path=\"{}\"", g.ring.path());
            if !ours_ok || nccl_ok == Some(false) {
                bail!("a wrong result at {bytes} bytes");
            }
            bytes *= 4;
        }
    }
    g.job.barrier(Deadline::after(config.timeout))?;
    Ok(())
}

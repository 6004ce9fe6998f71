//! The main job's benchmark (`scripts/run.sh`), in the shape of data-parallel training
//! (PyTorch's DDP); it fills its buckets with nodetour's own test kernels, so it is not the
//! example to copy: that is `examples/train_mlp/` (published crates only). Every step a kernel on the
//! runtime's compute stream produces the gradient buckets (25 MiB each, f32 and bf16 in turn);
//! each bucket is averaged across the ranks on a communication stream as soon as its kernel
//! has run, while the kernel of the next bucket runs; at the end every rank checks every
//! bucket against the exact average, and that all ranks hold the same bits.
//!
//! ```text
//! scripts/launch-local.sh -n 2 -- target/release/examples/data_parallel
//! scripts/launch-local.sh -n 2 -- target/release/examples/data_parallel --host   # host buffers
//! ```
//! Without a GPU the buckets are host memory (said so). Prints the communicator's paths, then
//! `DATA_PARALLEL OK rank=.. world=.. memory=.. buckets=.. steps=.. GB/s=..` per rank, or fails
//! naming the first wrong element.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use half::bf16;
use nodetour::core::cuda::GpuStream;
use nodetour::core::cuda::reduce::{At, ReduceKernels, pattern_value};
use nodetour::core::memory::with_cudarc_slice_mut;
use nodetour::cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use nodetour::{Communicator, DataType, Deadline, Element, Host, Options, ReduceOp};

#[derive(Parser)]
#[command(about = "DDP-shaped gradient averaging through nodetour's communicator, checked")]
struct Args {
    /// Gradient buckets per step (f32 and bf16 in turn).
    #[arg(long, default_value_t = 4)]
    buckets: usize,
    /// MiB per bucket.
    #[arg(long, default_value_t = 25)]
    bucket_mib: usize,
    /// Training steps.
    #[arg(long, default_value_t = 4)]
    steps: u32,
    /// Host buffers even where a GPU exists.
    #[arg(long)]
    host: bool,
}

/// What rank `rank`'s gradient kernel writes into bucket `b` at step `t`.
fn seed(rank: u32, t: u32, b: usize) -> u32 {
    rank * 31 + t * 7 + b as u32 * 3
}

/// The bucket's data type: f32 and bf16 in turn.
fn dtype_of(b: usize) -> DataType {
    if b.is_multiple_of(2) {
        DataType::F32
    } else {
        DataType::Bf16
    }
}

/// Element `i` of the average of bucket `b` at step `t` over `world` ranks, exactly.
fn want(world: u32, t: u32, b: usize, i: usize) -> f64 {
    let sum: u32 = (0..world)
        .map(|r| pattern_value(i as u64, seed(r, t, b)))
        .sum();
    f64::from(sum) / f64::from(world)
}

/// Checks a bucket's values (as f64) and returns a hash of its bits.
fn check(
    values: impl Iterator<Item = f64>,
    bits: &[u8],
    world: u32,
    t: u32,
    b: usize,
) -> anyhow::Result<u64> {
    let tolerance = match dtype_of(b) {
        DataType::Bf16 => 1.0 / 128.0,
        _ => 1e-6,
    };
    for (i, got) in values.enumerate() {
        let w = want(world, t, b, i);
        if (got - w).abs() > tolerance * w.abs().max(1.0) {
            bail!(
                "bucket {b} ({:?}) element {i}: {got}, want {w}",
                dtype_of(b)
            );
        }
    }
    // FNV-1a over the bytes: the same bits on every rank.
    Ok(bits.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, x| {
        (h ^ u64::from(*x)).wrapping_mul(0x0100_0000_01b3)
    }))
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("data_parallel: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let info = nodetour::net::bootstrap::LaunchInfo::from_env()?;
    let gpu = if args.host {
        Err("--host".to_owned())
    } else {
        match nodetour::core::cuda::gpus() {
            Ok(g) if !g.is_empty() => Ok(info.local_rank.unwrap_or(info.rank) as usize % g.len()),
            Ok(_) => Err("no GPU on this machine".to_owned()),
            Err(e) => Err(e.to_string()),
        }
    };
    let mut options = Options::from_env()?;
    options.gpu = gpu.as_ref().ok().copied();
    let timeout = options.timeout();
    let comm = Communicator::from_env(options)?;
    if comm.rank() == 0 {
        println!("{}", comm.paths());
    }
    let bytes = args.bucket_mib << 20;
    let (hashes, seconds, memory) = match gpu {
        Ok(ordinal) => {
            let (h, s) = on_gpu(&comm, ordinal, &args, bytes, timeout)?;
            (h, s, format!("GPU{ordinal}"))
        }
        Err(why) => {
            let (h, s) = on_host(&comm, &args, bytes)?;
            (h, s, format!("host ({why})"))
        }
    };
    // Every rank holds the same bits: gather every rank's hashes and compare.
    let hashes: Vec<i64> = hashes.iter().map(|h| *h as i64).collect();
    let mut all = vec![0i64; hashes.len() * comm.world() as usize];
    comm.all_gather(&hashes, &mut all, Host)?;
    if let Some(r) = all.chunks(hashes.len()).position(|h| h != &hashes[..]) {
        bail!("rank {r}'s buckets differ from rank {}'s", comm.rank());
    }
    let moved = (bytes * args.buckets) as f64 * f64::from(args.steps.saturating_sub(1));
    println!(
        "DATA_PARALLEL OK rank={} world={} memory={memory} buckets={}x{}MiB steps={} seconds={:.3} GB/s={:.2}",
        comm.rank(),
        comm.world(),
        args.buckets,
        args.bucket_mib,
        args.steps,
        seconds,
        moved / seconds.max(1e-9) / 1e9
    );
    comm.close(Deadline::after(timeout))?;
    Ok(())
}

enum Bucket {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

/// The training loop on the GPU; returns the last step's bucket hashes and the seconds of the
/// steps after the first.
fn on_gpu(
    comm: &Communicator,
    ordinal: usize,
    args: &Args,
    bytes: usize,
    timeout: Duration,
) -> anyhow::Result<(Vec<u64>, f64)> {
    let ctx = CudaContext::new(ordinal).map_err(|e| anyhow::anyhow!("GPU {ordinal}: {e:?}"))?;
    let compute: Arc<CudaStream> = ctx.new_stream()?;
    let comms: Arc<CudaStream> = ctx.new_stream()?;
    // The runtime's "gradient kernel": a pattern fill on the compute stream.
    let kernels = ReduceKernels::load(&ctx)?;
    let on_compute = GpuStream::of_cudarc(&compute);
    let mut buckets: Vec<Bucket> = (0..args.buckets)
        .map(|b| -> anyhow::Result<Bucket> {
            Ok(match dtype_of(b) {
                DataType::F32 => Bucket::F32(compute.alloc_zeros::<f32>(bytes / 4)?),
                _ => Bucket::Bf16(compute.alloc_zeros::<bf16>(bytes / 2)?),
            })
        })
        .collect::<anyhow::Result<_>>()?;
    let rank = comm.rank();
    let mut start = Instant::now();
    for t in 0..args.steps {
        if t == 1 {
            comm.wait(Deadline::after(timeout))?;
            start = Instant::now();
        }
        for (b, bucket) in buckets.iter_mut().enumerate() {
            // The backward kernel of this bucket on the compute stream; cudarc orders the
            // communication stream after it, and the next bucket's kernel runs meanwhile.
            let s = seed(rank, t, b);
            match bucket {
                Bucket::F32(x) => {
                    let n = x.len();
                    with_cudarc_slice_mut(x, &compute, |v| {
                        kernels.fill_pattern(&on_compute, DataType::F32, At::new(v, 0), n, 0, s)
                    })??;
                    comm.all_reduce_in_place(x, ReduceOp::Avg, &comms)?;
                }
                Bucket::Bf16(x) => {
                    let n = x.len();
                    with_cudarc_slice_mut(x, &compute, |v| {
                        kernels.fill_pattern(&on_compute, DataType::Bf16, At::new(v, 0), n, 0, s)
                    })??;
                    comm.all_reduce_in_place(x, ReduceOp::Avg, &comms)?;
                }
            }
        }
    }
    // Device collectives return at once: wait for this rank's before timing and reading.
    comm.wait(Deadline::after(timeout))?;
    let seconds = start.elapsed().as_secs_f64();
    let t = args.steps - 1;
    let mut hashes = Vec::new();
    for (b, bucket) in buckets.iter().enumerate() {
        let h = match bucket {
            Bucket::F32(x) => {
                let v = comms.clone_dtoh(x)?;
                check(
                    v.iter().map(|x| f64::from(*x)),
                    bytemuck::cast_slice(&v),
                    comm.world(),
                    t,
                    b,
                )
            }
            Bucket::Bf16(x) => {
                let v = comms.clone_dtoh(x)?;
                check(
                    v.iter().map(|x| f64::from(x.to_f32())),
                    bytemuck::cast_slice(&v),
                    comm.world(),
                    t,
                    b,
                )
            }
        }
        .with_context(|| format!("rank {rank}, step {t}"))?;
        hashes.push(h);
    }
    Ok((hashes, seconds))
}

/// The same loop on host memory (synchronous collectives).
fn on_host(comm: &Communicator, args: &Args, bytes: usize) -> anyhow::Result<(Vec<u64>, f64)> {
    fn fill<T: Element>(v: &mut [T], s: u32, from: impl Fn(u32) -> T) {
        for (i, x) in v.iter_mut().enumerate() {
            *x = from(pattern_value(i as u64, s));
        }
    }
    let rank = comm.rank();
    let mut f32s: Vec<Vec<f32>> = (0..args.buckets)
        .filter(|b| b % 2 == 0)
        .map(|_| vec![0.0; bytes / 4])
        .collect();
    let mut bf16s: Vec<Vec<bf16>> = (0..args.buckets)
        .filter(|b| b % 2 == 1)
        .map(|_| vec![bf16::ZERO; bytes / 2])
        .collect();
    let mut start = Instant::now();
    for t in 0..args.steps {
        if t == 1 {
            start = Instant::now();
        }
        for b in 0..args.buckets {
            let s = seed(rank, t, b);
            if b % 2 == 0 {
                let v = &mut f32s[b / 2];
                fill(v, s, |x| x as f32);
                comm.all_reduce_in_place(v, ReduceOp::Avg, Host)?;
            } else {
                let v = &mut bf16s[b / 2];
                fill(v, s, |x| bf16::from_f32(x as f32));
                comm.all_reduce_in_place(v, ReduceOp::Avg, Host)?;
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let t = args.steps - 1;
    let mut hashes = Vec::new();
    for b in 0..args.buckets {
        let h = if b % 2 == 0 {
            let v = &f32s[b / 2];
            check(
                v.iter().map(|x| f64::from(*x)),
                bytemuck::cast_slice(v),
                comm.world(),
                t,
                b,
            )
        } else {
            let v = &bf16s[b / 2];
            check(
                v.iter().map(|x| f64::from(x.to_f32())),
                bytemuck::cast_slice(v),
                comm.world(),
                t,
                b,
            )
        }
        .with_context(|| format!("rank {rank}, step {t}"))?;
        hashes.push(h);
    }
    Ok((hashes, seconds))
}

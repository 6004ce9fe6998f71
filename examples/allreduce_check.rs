//! Ring allreduce of host buffers between N processes over tcp or verbs, checked against a
//! float64 reference on every rank, for every data type and operation (or one of each).
//!
//! ```text
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --all
//! # inside the soft-RoCE VM:
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --transport verbs --devices rxe0,rxe1
//! ```
//! With `--gpu` the buffers are GPU memory, staged through the host slots (`RingJob::all_reduce_gpu`):
//! `NCCL_NVLS_ENABLE=0 scripts/launch-local.sh -n 2 -- target/release/examples/allreduce_check --gpu --all`.
//!
//! Prints `ALLREDUCE OK rank=.. world=.. transport=.. cases=..` per rank, or fails naming the
//! first mismatch.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::bail;
use clap::Parser;
use cudarc::driver::CudaContext;
use nodetour::perf::{cases, pattern, verify};
use nodetour::ring_job::{RingJob, RingTransport};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::{Config, Deadline};
use nodetour_ring::host::HostRingOptions;
use nodetour_ring::{DataType, ReduceOp};

#[derive(Parser)]
#[command(about = "Ring allreduce of host buffers across processes, checked against float64")]
struct Args {
    /// tcp or verbs.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// RDMA devices to spread the ranks over (rank r takes device r mod n).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Elements per buffer.
    #[arg(long, default_value_t = 100_003)]
    count: usize,
    /// Bytes per slot.
    #[arg(long, default_value_t = 64 << 10)]
    slot_bytes: usize,
    /// Run every type and operation (else f32 sum and i64 max).
    #[arg(long)]
    all: bool,
    /// GPU buffers (GPU `local rank mod GPUs`), staged through the host slots: SKIP without
    /// CUDA.
    #[arg(long)]
    gpu: bool,
}

fn main() -> ExitCode {
    nodetour::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce_check: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.gpu {
        if let Err(e) = nodetour_core::cuda::availability() {
            println!("SKIP allreduce_check --gpu: {e}");
            return Ok(());
        }
    }
    let config = Config::from_env()?;
    let transport = match args.transport.as_str() {
        "tcp" => RingTransport::Tcp,
        "verbs" => RingTransport::Verbs {
            devices: args.devices.clone(),
        },
        other => bail!("allreduce_check speaks tcp and verbs, not {other}"),
    };
    let options = HostRingOptions {
        slot_bytes: args.slot_bytes,
        slots: 4,
        timeout: config.timeout,
    };
    let mut ring = if args.gpu {
        RingJob::form_for_gpu(&config, &transport, args.count * 8, options)?
    } else {
        RingJob::form(&config, &transport, args.count * 8, options)?
    };
    let gpu = if args.gpu {
        let n = nodetour_core::cuda::gpus()?.len().max(1);
        let local = nodetour_core::bootstrap::LaunchInfo::from_env()?
            .local_rank
            .unwrap_or(ring.rank);
        let ordinal = local as usize % n;
        Some(CudaContext::new(ordinal).map_err(|e| anyhow::anyhow!("GPU {ordinal}: {e:?}"))?)
    } else {
        None
    };
    let cases = cases(
        args.all,
        &[
            (DataType::F32, ReduceOp::Sum),
            (DataType::I64, ReduceOp::Max),
        ],
    );
    let start = Instant::now();
    for &(dtype, op) in &cases {
        let mut data = pattern(dtype, ring.rank, args.count);
        match &gpu {
            None => ring.all_reduce(&mut data, dtype, op)?,
            Some(ctx) => {
                let buffer = DeviceBuffer::new(ctx, data.len().max(1))?;
                buffer.copy_from_host(0, &data)?;
                ring.all_reduce_gpu(&buffer, args.count, dtype, op)?;
                buffer.copy_to_host(0, &mut data)?;
            }
        }
        if let Err(mismatch) = verify(dtype, op, ring.world, &data) {
            bail!("{mismatch}");
        }
    }
    ring.job.check()?;
    println!(
        "ALLREDUCE OK rank={} world={} transport={}{} cases={} count={} seconds={:.2} ring={:?}",
        ring.rank,
        ring.world,
        args.transport,
        match &gpu {
            Some(c) => format!(" buffers=GPU{} (staged)", c.ordinal()),
            None => String::new(),
        },
        cases.len(),
        args.count,
        start.elapsed().as_secs_f64(),
        ring.order
    );
    ring.job.barrier(Deadline::after(config.timeout))?;
    Ok(())
}

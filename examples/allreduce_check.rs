//! Ring allreduce of host buffers between N processes over tcp or verbs, checked against a
//! float64 reference on every rank, for every data type and operation (or one of each).
//!
//! ```text
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --all
//! # inside the soft-RoCE VM:
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --transport verbs --devices rxe0,rxe1
//! ```
//! Prints `ALLREDUCE OK rank=.. world=.. transport=.. cases=..` per rank, or fails naming the
//! first mismatch.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::bail;
use clap::Parser;
use nodetour::perf::{cases, pattern, verify};
use nodetour::ring_job::{RingJob, RingTransport};
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
    let mut ring = RingJob::form(&config, &transport, args.count * 8, options)?;
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
        ring.all_reduce(&mut data, dtype, op)?;
        if let Err(mismatch) = verify(dtype, op, ring.world, &data) {
            bail!("{mismatch}");
        }
    }
    ring.job.check()?;
    println!(
        "ALLREDUCE OK rank={} world={} transport={} cases={} count={} seconds={:.2} ring={:?}",
        ring.rank,
        ring.world,
        args.transport,
        cases.len(),
        args.count,
        start.elapsed().as_secs_f64(),
        ring.order
    );
    ring.job.barrier(Deadline::after(config.timeout))?;
    Ok(())
}

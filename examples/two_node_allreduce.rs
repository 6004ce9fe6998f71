//! Allreduce across two (or more) GPU nodes with RDMA NICs, for users to run on their own
//! cluster: one process per GPU, started by a launcher (torchrun, Slurm, Open MPI, or
//! `scripts/launch-local.sh`). It forms a communicator from the launcher's environment, prints
//! each link's path and the reason for it (between nodes with GPUDirect RDMA, expect the GPU
//! ring's network links over verbs, "from GPU send slots the NIC reads: direct (dma-buf …)" and
//! "landing in GPU slots the NIC writes: direct (dma-buf …); no flush (…)" on Hopper; where a
//! rung is refused, host slots and every rung's reason), checks an allreduce on every rank,
//! then sweeps f32 sums beside NCCL's allreduce on the same streams, in the same
//! run.
//!
//! ```text
//! # on each of two nodes (NODE_RANK 0 and 1), 8 GPUs each:
//! NCCL_NVLS_ENABLE=0 torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 \
//!     --master-addr $HEAD --master-port 29500 --no-python \
//!     target/release/examples/two_node_allreduce --compare-nccl
//! ```
//!
//! What was run where this was written: no machine had an RDMA NIC next to a GPU. The network
//! link was run over tcp between GPUs (one machine split into "hosts" with
//! `NODETOUR_HOST_ID`), and over real verbs (soft-RoCE) without a GPU; the registration of GPU
//! memory with a NIC and the NIC's writes into it were not run. Please report what this prints
//! (the paths, the `TWO_NODE` lines) with `nodetour doctor`'s output.
//!
//! Without a GPU it runs the same on host buffers (the soft-RoCE VM does this).

use std::process::ExitCode;
use std::time::Duration;

use anyhow::bail;
use clap::Parser;
use nodetour::ring::comm::{Communicator, Elements, GpuRingOptions, Options};
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::{Config, Deadline};
use nodetour_ring::seeded::{input, verify};
use nodetour_ring::{DataType, ReduceOp};
use nodetour_tools::gpu_job::{GpuJob, ring_path, variants_of};
use nodetour_tools::perf::parse_sizes;
use nodetour_tools::perf_gpu::{SweepSpec, render, ring_sweep};

#[derive(Parser)]
#[command(about = "Allreduce across GPU nodes: paths, a checked result, busbw beside NCCL")]
struct Args {
    /// Sizes per rank for the sweep (MIN:MAX, K/M/G suffixes).
    #[arg(long, default_value = "1M:1G")]
    sizes: String,
    /// NCCL's allreduce alongside (its own buffers, same streams, alternating batches).
    #[arg(long)]
    compare_nccl: bool,
    /// Collectives per timed batch.
    #[arg(long, default_value_t = 10)]
    iters: usize,
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("two_node_allreduce: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::from_env()?;
    let sizes = parse_sizes(&args.sizes, 4)?;
    if let Err(reason) = nodetour_core::cuda::availability() {
        println!("TWO_NODE no GPU here ({reason}): host buffers");
        return host(&sizes, &config);
    }
    let g = GpuJob::form(
        &variants_of("auto")?,
        GpuRingOptions::default(),
        args.compare_nccl,
    )?;
    let comm = &g.variants[0].comm;
    if g.rank == 0 {
        println!("{}", comm.paths());
    }
    // One checked allreduce first, on every rank.
    let count = 3_000_017;
    let stream = GpuStream::new(&g.context)?;
    let buf = DeviceBuffer::new(&g.context, count * 4)?;
    buf.copy_from_host(0, &input(DataType::F32, ReduceOp::Sum, g.rank, count, 0))?;
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
        bail!("rank {}: wrong allreduce result: {e}", g.rank);
    }
    println!(
        "TWO_NODE OK rank={} world={} gpu={} path=\"{}\"",
        g.rank,
        g.world,
        g.context.ordinal(),
        ring_path(comm)
    );
    let spec = SweepSpec {
        sizes,
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        warmup: 2,
        iters: args.iters,
        compare_nccl: args.compare_nccl,
        ceiling: false,
        beside_compute: false,
        graph: false,
    };
    let rows = ring_sweep(&g, &spec, config.timeout)?;
    if g.rank == 0 {
        let what = format!("{} processes, one GPU each", g.world);
        print!(
            "{}",
            render(&rows, "text", &what, &ring_path(comm), spec.dtype, spec.op)
        );
    }
    if rows
        .iter()
        .any(|r| !r.nodetour.2 || r.nccl.is_some_and(|n| !n.2))
    {
        bail!("rank {}: a row of the sweep was wrong", g.rank);
    }
    Ok(())
}

/// The same on host buffers: the links' paths, a checked allreduce, the sweep.
fn host(sizes: &[usize], config: &Config) -> anyhow::Result<()> {
    let comm = Communicator::from_env(Options::from_env()?)?;
    if comm.rank() == 0 {
        println!("{}", comm.paths());
    }
    let rows = nodetour_tools::perf::sweep(&comm, sizes, DataType::F32, ReduceOp::Sum, 1, 3)?;
    if rows.iter().any(|r| !r.correct) {
        bail!("rank {}: a row of the sweep was wrong", comm.rank());
    }
    if comm.rank() == 0 {
        for r in &rows {
            println!(
                "TWO_NODE_HOST bytes={} time_us={:.1} busbw_gbs={:.3}",
                r.bytes,
                r.seconds * 1e6,
                r.busbw
            );
        }
    }
    println!(
        "TWO_NODE OK rank={} world={} host buffers",
        comm.rank(),
        comm.world()
    );
    comm.close(Deadline::after(config.timeout.max(Duration::from_secs(10))))?;
    Ok(())
}

//! The smallest complete use of the direct GPU ring: an allreduce of f32 gradients over every
//! GPU of this machine (or `--ranks N` ranks spread over them), queued on one stream per rank,
//! checked on the host. Exits 2 with `SKIP <reason>` where there is no GPU or CUDA.
//!
//! ```text
//! cargo run --release --example gpu_allreduce              # one rank per GPU
//! cargo run --release --example gpu_allreduce -- --ranks 4 # several ranks per GPU
//! ```

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::Parser;
use cudarc::driver::CudaContext;
use nodetour_core::cuda::{self, GpuStream};
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::{DataType, GpuGroup, ReduceOp};

#[derive(Parser)]
#[command(about = "Allreduce f32 gradients over the GPUs of this machine, directly")]
struct Args {
    /// Ranks (default: one per GPU); ranks beyond the GPU count share GPUs.
    #[arg(long)]
    ranks: Option<usize>,
    /// Elements per rank.
    #[arg(long, default_value_t = 1 << 24)]
    count: usize,
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    let args = Args::parse();
    let gpus = match cuda::gpus() {
        Ok(g) if !g.is_empty() => g.len(),
        Ok(_) => return skip("no GPU".into()),
        Err(e) => return skip(e.to_string()),
    };
    match run(&args, gpus) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_allreduce: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn skip(why: String) -> ExitCode {
    println!("SKIP {why}");
    ExitCode::from(2)
}

fn run(args: &Args, gpus: usize) -> anyhow::Result<()> {
    let ranks = args.ranks.unwrap_or(gpus).max(1);
    // 1. One context per GPU; rank r runs on GPU r mod gpus.
    let contexts = (0..gpus.min(ranks))
        .map(|i| CudaContext::new(i).with_context(|| format!("opening GPU {i}")))
        .collect::<anyhow::Result<Vec<Arc<CudaContext>>>>()?;
    let rank_gpus: Vec<_> = (0..ranks)
        .map(|r| contexts[r % contexts.len()].clone())
        .collect();
    // 2. The group: peer access between neighbours, kernels compiled or loaded from the cache.
    let mut group = GpuGroup::new(&rank_gpus)?;
    println!("path: {}", group.path());
    // 3. Each rank's gradients and stream. Rank r holds r + 1 everywhere.
    let bytes = args.count * 4;
    let mut buffers = Vec::new();
    let mut streams = Vec::new();
    for (r, ctx) in rank_gpus.iter().enumerate() {
        let b = DeviceBuffer::new(ctx, bytes)?;
        let grads: Vec<u8> = std::iter::repeat_n((r as f32 + 1.0).to_ne_bytes(), args.count)
            .flatten()
            .collect();
        b.copy_from_host(0, &grads)?;
        buffers.push(b);
        streams.push(GpuStream::new(ctx)?);
    }
    // 4. Queue the allreduce (returns at once), then wait on each stream.
    let b: Vec<&DeviceBuffer> = buffers.iter().collect();
    let s: Vec<&GpuStream> = streams.iter().collect();
    let t = std::time::Instant::now();
    group.all_reduce(&b, &s, args.count, DataType::F32, ReduceOp::Sum)?;
    for stream in &streams {
        stream.synchronize()?;
    }
    let elapsed = t.elapsed();
    // 5. Every element is 1 + 2 + ... + ranks.
    let want = (ranks * (ranks + 1) / 2) as f32;
    for (r, buf) in buffers.iter().enumerate() {
        let mut out = vec![0u8; bytes];
        buf.copy_to_host(0, &mut out)?;
        if let Some(i) = out
            .chunks_exact(4)
            .position(|c| f32::from_ne_bytes(c.try_into().expect("4 bytes")) != want)
        {
            bail!("rank {r}: element {i} is not {want}");
        }
    }
    println!(
        "GPU ALLREDUCE OK ranks={ranks} gpus={} count={} first allreduce {:.1} ms",
        contexts.len(),
        args.count,
        elapsed.as_secs_f64() * 1e3
    );
    Ok(())
}

//! The smallest complete use of several GPUs in one process: one communicator per GPU
//! (`Communicator::from_devices`, as `ncclCommInitAll`), an allreduce of f32 gradients held in
//! cudarc slices, queued from one thread as a group (as `ncclGroupStart`/`ncclGroupEnd`) on one
//! stream per GPU, checked on the host. `--ranks N` spreads N ranks over the GPUs. Exits 2 with
//! `SKIP <reason>` where there is no GPU or CUDA.
//!
//! ```text
//! cargo run --release --example gpu_allreduce              # one rank per GPU
//! cargo run --release --example gpu_allreduce -- --ranks 4 # several ranks per GPU
//! ```

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use clap::Parser;
use nodetour::cudarc::driver::{CudaContext, CudaSlice};
use nodetour::{Communicator, Group, Options, ReduceOp};

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
    let gpus = match nodetour::core::cuda::gpus() {
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
    // 2. One communicator per rank: peer access between neighbours, kernels compiled or
    //    loaded from the cache.
    let comms = Communicator::from_devices(&rank_gpus, Options::from_env()?)?;
    println!("{}", comms[0].paths());
    // 3. Each rank's gradients (rank r holds r + 1 everywhere) on its own stream.
    let streams = rank_gpus
        .iter()
        .map(|c| c.new_stream())
        .collect::<Result<Vec<_>, _>>()?;
    let mut grads = streams
        .iter()
        .enumerate()
        .map(|(r, s)| s.clone_htod(&vec![r as f32 + 1.0; args.count]))
        .collect::<Result<Vec<CudaSlice<f32>>, _>>()?;
    // 4. Queue the allreduce from this thread as a group (returns at once), then wait on each
    //    stream. (With one thread per GPU, each thread calls its communicator's
    //    `all_reduce_in_place` instead.)
    let t = std::time::Instant::now();
    let mut group = Group::new();
    for ((comm, g), s) in comms.iter().zip(grads.iter_mut()).zip(&streams) {
        group.add(comm, move |c| c.all_reduce_in_place(g, ReduceOp::Sum, s))?;
    }
    group.end()?;
    for s in &streams {
        s.synchronize()?;
    }
    let elapsed = t.elapsed();
    // 5. Every element is 1 + 2 + ... + ranks.
    let want = (ranks * (ranks + 1) / 2) as f32;
    for (r, (g, s)) in grads.iter().zip(&streams).enumerate() {
        let out = s.clone_dtoh(g)?;
        if let Some(i) = out.iter().position(|x| *x != want) {
            bail!("rank {r}: element {i} is not {want}");
        }
    }
    for comm in comms {
        comm.close(nodetour::Deadline::after(std::time::Duration::from_secs(
            30,
        )))?;
    }
    println!(
        "GPU ALLREDUCE OK ranks={ranks} gpus={} count={} first allreduce {:.1} ms",
        contexts.len(),
        args.count,
        elapsed.as_secs_f64() * 1e3
    );
    Ok(())
}

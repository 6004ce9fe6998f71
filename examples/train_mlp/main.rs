//! Data-parallel training of a small model, the way a training runtime uses nodetour: every
//! rank trains the same two-layer perceptron on its shard of a synthetic batch; the backward
//! pass produces the gradients layer by layer, and each layer's gradients (one bucket) are
//! averaged across the ranks on a communication stream while the backward pass of the layer
//! below runs; then every rank takes the same SGD step.
//!
//! On a GPU the forward and backward passes are cuBLAS matrix products and NVRTC kernels on a
//! compute stream (through cudarc), and the buckets are averaged on a second stream; on a CPU
//! they are plain Rust, and the first bucket is averaged on a second thread. At the end every
//! rank checks that its weights equal, within float rounding, those of one process trained on
//! the whole batch, and that every rank holds the same bits.
//!
//! ```text
//! torchrun --nproc-per-node 2 target/release/examples/train_mlp           # one node
//! srun -N 2 --ntasks-per-node 4 target/release/examples/train_mlp          # Slurm
//! mpirun -n 4 target/release/examples/train_mlp --device cpu               # CPUs only
//! ```
//! Prints `TRAIN_MLP OK rank=.. world=.. device=.. loss=..->.. distance=..` per rank.

mod gpu;
mod model;

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, ensure};
use clap::{Parser, ValueEnum};
use nodetour::{Communicator, Deadline, Host, Options, ReduceOp};

use model::{Params, Shape};

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Device {
    /// The GPU where CUDA is available, else the CPU (said so).
    Auto,
    Cpu,
    Gpu,
}

#[derive(Parser)]
#[command(about = "Data-parallel training of a small MLP through nodetour, checked")]
struct Args {
    /// Where the model runs.
    #[arg(long, value_enum, default_value_t = Device::Auto)]
    device: Device,
    /// SGD steps.
    #[arg(long, default_value_t = 40)]
    steps: usize,
    /// Samples in the global batch (split evenly over the ranks).
    #[arg(long, default_value_t = 512)]
    batch: usize,
    /// Learning rate.
    #[arg(long, default_value_t = 0.1)]
    lr: f32,
}

const SHAPE: Shape = Shape {
    d_in: 32,
    hidden: 64,
    d_out: 8,
};

/// What training on one device returns: the final weights and the mean loss (over all ranks)
/// at the first and the last step.
pub(crate) struct Trained {
    pub(crate) params: Params,
    pub(crate) loss: (f32, f32),
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("train_mlp: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let comm = Communicator::from_env(Options::from_env()?)?;
    let (rank, world) = (comm.rank() as usize, comm.world() as usize);
    ensure!(
        args.batch % world == 0 && args.batch > 0,
        "the batch of {} does not split evenly over {world} ranks",
        args.batch
    );
    let (x, t) = model::data(SHAPE, args.batch, 7);
    let (xs, ts) = model::shard(SHAPE, &x, &t, rank, world);
    let start = Params::init(SHAPE, 11);
    let device = match (args.device, nodetour::core::cuda::availability()) {
        (Device::Cpu, _) => "cpu",
        (Device::Gpu | Device::Auto, Ok(_)) => "gpu",
        (Device::Gpu, Err(e)) => bail!("--device gpu: {e}"),
        (Device::Auto, Err(e)) => {
            println!("train_mlp: no GPU ({e}): training on the CPU");
            "cpu"
        }
    };
    let trained = if device == "gpu" {
        gpu::train(&comm, SHAPE, start.clone(), &xs, &ts, args.steps, args.lr)?
    } else {
        train_cpu(&comm, start.clone(), &xs, &ts, args.steps, args.lr)?
    };
    // The reference: one process, the whole batch, the same steps.
    let alone = model::train_alone(SHAPE, start, &x, &t, args.steps, args.lr);
    let distance = model::distance(&trained.params, &alone);
    ensure!(
        distance < 1e-4,
        "rank {rank}: the weights differ from one process's by {distance:e} (relative)"
    );
    // Every rank holds the same bits.
    let hash = trained
        .params
        .flat()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, v| {
            (h ^ u64::from(v.to_bits())).wrapping_mul(0x0100_0000_01b3)
        }) as i64;
    let mut hashes = vec![0i64; world];
    comm.all_gather(&[hash], &mut hashes, Host)?;
    ensure!(
        hashes.iter().all(|h| *h == hash),
        "rank {rank}: the ranks' weights differ: {hashes:x?}"
    );
    ensure!(
        trained.loss.1 < trained.loss.0,
        "the loss did not fall: {:?}",
        trained.loss
    );
    println!(
        "TRAIN_MLP OK rank={rank} world={world} device={device} steps={} loss={:.4}->{:.4} distance={distance:.1e} paths=\"{}\"",
        args.steps,
        trained.loss.0,
        trained.loss.1,
        comm.paths()
    );
    comm.close(Deadline::after(Duration::from_secs(60)))?;
    Ok(())
}

/// Training on the CPU: the first bucket (layer 2) is averaged on a second thread while this
/// one runs layer 1's backward pass; then the second bucket; then the step.
fn train_cpu(
    comm: &Communicator,
    mut p: Params,
    x: &[f32],
    t: &[f32],
    steps: usize,
    lr: f32,
) -> anyhow::Result<Trained> {
    let s = SHAPE;
    let mut loss = (0.0, 0.0);
    // The data-parallel average as torch's DDP takes it: each rank's gradients multiplied by
    // 1 / world as the reduction first reads them (PreMulSum), no scaling pass of their own.
    let average = ReduceOp::pre_mul_sum(1.0 / f64::from(comm.world()));
    for step in 0..steps {
        let f = model::forward(s, &p, x);
        if step == 0 || step + 1 == steps {
            let mut l = [model::loss(&f.y, t, t.len() / s.d_out)];
            comm.all_reduce_in_place(&mut l, ReduceOp::Avg, Host)?;
            *(if step == 0 { &mut loss.0 } else { &mut loss.1 }) = l[0];
        }
        let (mut grad2, da1) = model::backward_layer2(s, &p, &f, t);
        let grad1 = std::thread::scope(|scope| -> anyhow::Result<Vec<f32>> {
            let bucket2 = scope.spawn(|| comm.all_reduce_in_place(&mut grad2, average, Host));
            let mut grad1 = model::backward_layer1(s, &f, x, &da1);
            bucket2.join().expect("the communication thread")?;
            comm.all_reduce_in_place(&mut grad1, average, Host)?;
            Ok(grad1)
        })?;
        model::sgd(s, &mut p, &grad2, &grad1, lr);
    }
    Ok(Trained { params: p, loss })
}

//! A job of processes, one GPU each, for the perf tool and `examples/gpu_ring_check`, built from
//! communicators as a runtime would: the first from the launcher environment, each further
//! variant (the staged path beside the direct one, the two-rank ring beside the exchange) from a
//! unique id that rank 0 makes and broadcasts through the first; NCCL's unique id travels the
//! same way.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour::core::Deadline;
use nodetour::core::transport::TransportKind;
use nodetour::net::bootstrap::{LaunchInfo, UniqueId};
use nodetour::ring::comm::{DevicePath, Options};
use nodetour::ring::comm::{GpuPaths, GpuRingOptions};
use nodetour::{Communicator, Error, Host, ReduceOp, Result};

/// One formed variant.
pub struct Variant {
    /// What differs (for reports).
    pub label: String,
    /// Its communicator.
    pub comm: Communicator,
}

/// The communicators of this rank.
pub struct GpuJob {
    /// The variants, in the order asked for; the first formed from the environment.
    pub variants: Vec<Variant>,
    /// This rank's GPU.
    pub context: Arc<CudaContext>,
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// The GPU (ordinal on this host) of the next rank, if it is another rank.
    pub next_gpu: Option<usize>,
    /// NCCL's unique id, when asked for (made by rank 0).
    pub nccl_id: Option<[u8; 128]>,
}

/// The options of each variant to form: the environment's, with these changes.
pub struct VariantSpec {
    /// What differs.
    pub label: String,
    /// Which path the GPU ring takes.
    pub paths: GpuPaths,
    /// Two ranks: the exchange step (else the two-step ring).
    pub two_rank_exchange: bool,
}

/// The variants a `--path` value asks for.
pub fn variants_of(path: &str) -> Result<Vec<VariantSpec>> {
    let v = |label: &str, paths| VariantSpec {
        label: label.into(),
        paths,
        two_rank_exchange: true,
    };
    Ok(match path {
        "auto" => vec![v("auto", GpuPaths::Auto)],
        "direct" => vec![v("direct", GpuPaths::Direct)],
        "staged" => vec![v("staged", GpuPaths::Staged)],
        "both" => vec![v("direct", GpuPaths::Direct), v("staged", GpuPaths::Staged)],
        other => {
            return Err(Error::InvalidArgument {
                reason: format!("--path {other}: direct, staged, both or auto"),
            });
        }
    })
}

impl GpuJob {
    /// Forms every variant: rank `r` uses GPU `local_rank mod GPUs`; `gpu_ring` shapes the
    /// slots of every variant (the environment's one-kernel, landing and block-cap settings
    /// are kept).
    pub fn form(
        specs: &[VariantSpec],
        gpu_ring: GpuRingOptions,
        want_nccl: bool,
    ) -> Result<GpuJob> {
        let info = LaunchInfo::from_env()?;
        let gpus = nodetour::core::cuda::gpus()?.len();
        if gpus == 0 {
            return Err(Error::Unsupported {
                reason: "no GPU on this machine".into(),
            });
        }
        let gpu = info.local_rank.unwrap_or(info.rank) as usize % gpus;
        let context = nodetour::core::cuda::open_context(gpu)?;
        let options = |s: &VariantSpec| -> Result<Options> {
            let mut o = Options::from_env()?;
            o.gpu = Some(gpu);
            o.gpu_ring = GpuRingOptions {
                paths: s.paths,
                net_landing: o.gpu_ring.net_landing,
                one_kernel: o.gpu_ring.one_kernel,
                one_kernel_max: o.gpu_ring.one_kernel_max,
                max_blocks: o.gpu_ring.max_blocks,
                ipc_pipeline: o.gpu_ring.ipc_pipeline,
                shm_pipeline: o.gpu_ring.shm_pipeline,
                shm_read_max: o.gpu_ring.shm_read_max,
                copy_kernel_max: o.gpu_ring.copy_kernel_max,
                ..gpu_ring
            };
            o.two_rank_exchange = s.two_rank_exchange;
            Ok(o)
        };
        let first = specs.first().ok_or_else(|| Error::InvalidArgument {
            reason: "no variant to form".into(),
        })?;
        let comm = Communicator::from_env(options(first)?)?;
        if !matches!(comm.paths().device, DevicePath::GpuRing { .. }) {
            return Err(Error::Unsupported {
                reason: format!(
                    "no GPU ring here ({}): the GPU ring joins processes of one host, one GPU each",
                    comm.paths()
                ),
            });
        }
        let (rank, world) = (comm.rank(), comm.world());
        let mut variants = vec![Variant {
            label: first.label.clone(),
            comm,
        }];
        // Each further variant's job: rank 0 binds its rendezvous and shares only the
        // address; every rank derives the variant's token from the job's own (no token
        // travels).
        let job = nodetour::net::bootstrap::job_token(&LaunchInfo::from_env()?)?;
        for (k, s) in specs.iter().enumerate().skip(1) {
            let address = if rank == 0 {
                UniqueId::create()?.address
            } else {
                String::new()
            };
            let address = share(&variants[0].comm, address)?;
            let id = UniqueId {
                address,
                token: job.derive(format!("nodetour perf variant {k}").as_bytes()),
            };
            let comm = Communicator::from_unique_id(&id, rank, world, options(s)?)?;
            variants.push(Variant {
                label: s.label.clone(),
                comm,
            });
        }
        let first = &variants[0].comm;
        let nccl_id = if want_nccl {
            let mut id = if rank == 0 {
                crate::nccl_ref::unique_id().map_err(|e| Error::Unsupported {
                    reason: format!("NCCL: {e:#}"),
                })?
            } else {
                [0u8; 128]
            };
            first.broadcast_in_place(&mut id, 0, Host)?;
            Some(id)
        } else {
            None
        };
        let mut ordinals = vec![0i64; world as usize];
        first.all_gather(&[gpu as i64], &mut ordinals, Host)?;
        let next_gpu = (world > 1).then(|| ordinals[((rank + 1) % world) as usize] as usize);
        Ok(GpuJob {
            variants,
            context,
            rank,
            world,
            next_gpu,
            nccl_id,
        })
    }

    /// Waits until every rank is here (a one-byte allreduce on the first variant).
    pub fn barrier(&self) -> Result<()> {
        let mut b = [0u8];
        self.variants[0]
            .comm
            .all_reduce_in_place(&mut b, ReduceOp::Max, Host)?;
        Ok(())
    }

    /// Closes every variant (the last formed first).
    pub fn close(self, deadline: Deadline) -> Result<()> {
        for v in self.variants.into_iter().rev() {
            v.comm.close(deadline)?;
        }
        Ok(())
    }
}

/// Whether `comm`'s GPU ring goes direct (cuda-ipc).
pub fn is_direct(comm: &Communicator) -> bool {
    matches!(
        comm.paths().device,
        DevicePath::GpuRing {
            transport: Some(TransportKind::CudaIpc),
            ..
        }
    )
}

/// The GPU ring's path of `comm`, for reports.
pub fn ring_path(comm: &Communicator) -> String {
    match &comm.paths().device {
        DevicePath::GpuRing { transport, reason } => match transport {
            Some(t) => format!("{t}: {reason}"),
            None => reason.clone(),
        },
        other => format!("{other:?}"),
    }
}

/// Rank 0's `text` on every rank (its length first, then its bytes).
fn share(comm: &Communicator, text: String) -> Result<String> {
    let mut len = [text.len() as i64];
    comm.broadcast_in_place(&mut len, 0, Host)?;
    let mut bytes = text.into_bytes();
    bytes.resize(len[0] as usize, 0);
    comm.broadcast_in_place(&mut bytes, 0, Host)?;
    String::from_utf8(bytes).map_err(|e| Error::InvalidArgument {
        reason: format!("rank 0 shared a text that is not UTF-8: {e}"),
    })
}

//! A job of processes, one GPU each, joined in a GPU ring on one host, for the perf tool and
//! `examples/gpu_ring_check`: the bootstrap from the launcher environment with every rank's GPU
//! and the caller's extra bytes (an NCCL unique id), then the ring of
//! [`nodetour_ring::comm::gpu_links::form`] (the communicator's own formation), optionally with
//! both paths side by side. Runtimes use `nodetour::Communicator`.

use std::sync::Arc;

use anyhow::{Context as _, bail};
use cudarc::driver::CudaContext;
use nodetour_core::bootstrap::{Bootstrap, HostIdentity, JobToken, LaunchInfo};
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{TransportKind, forced_from_env};
use nodetour_core::{Config, Deadline};
use nodetour_ring::comm::gpu_links::{self, Seat};
pub use nodetour_ring::comm::gpu_links::{GpuPaths, GpuRingOptions};
use nodetour_ring::gpu_ring::GpuRing;
use nodetour_ring::order::{neighbours, ring_order};

use crate::blob::{put, rendezvous, take};

/// A formed GPU ring.
pub struct GpuRingJob {
    /// This rank's ring (drops before the bootstrap): the direct one where cuda-ipc works.
    pub ring: GpuRing,
    /// With [`GpuPaths::Both`]: the staged ring beside the direct one (for comparisons).
    pub staged: Option<GpuRing>,
    /// This rank's GPU.
    pub context: Arc<CudaContext>,
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// The ring order.
    pub order: Vec<u32>,
    /// Why the link to the next rank takes its path.
    pub choice: String,
    /// The bootstrap (barriers, liveness).
    pub job: Bootstrap,
    /// Every rank's extra setup bytes (e.g. an NCCL unique id), by rank.
    pub extras: Vec<Vec<u8>>,
    /// The GPU (ordinal on this host) of the next rank, if it is another rank.
    pub next_gpu: Option<usize>,
    closed: bool,
}

impl Drop for GpuRingJob {
    fn drop(&mut self) {
        if let Err(e) = self.close(nodetour_ring::gpu_ring::TEARDOWN_DEADLINE) {
            tracing::warn!(error = %e, "closing the GPU ring job");
        }
    }
}

/// What each rank announces through the bootstrap, which every rank hears: its GPU and the
/// caller's extra bytes. The handles and names of its slots and flag pages go only to its
/// neighbours ([`GpuNeighbourSetup`], over an authenticated loopback connection).
struct Announcement {
    gpu: usize,
    extra: Vec<u8>,
}

impl Announcement {
    fn encode(&self) -> Vec<u8> {
        let mut b = Vec::new();
        put(&mut b, &(self.gpu as u32).to_be_bytes());
        put(&mut b, &self.extra);
        b
    }

    fn decode(b: &[u8]) -> anyhow::Result<Announcement> {
        let mut at = 0;
        Ok(Announcement {
            gpu: u32::from_be_bytes(take(b, &mut at)?.try_into()?) as usize,
            extra: take(b, &mut at)?.to_vec(),
        })
    }
}

impl GpuRingJob {
    /// Ends the job's rings with the teardown handshake: each rank drains its streams and
    /// closes its mappings of its neighbours' memory, then a barrier (or the liveness mesh
    /// reporting a rank lost, which counts as closed) says every neighbour has done the same,
    /// and only then is this rank's exported slot memory freed. Past `timeout` the exported
    /// memory is leaked, never freed under a peer's mapping. `Drop` does this with
    /// [`nodetour_ring::gpu_ring::TEARDOWN_DEADLINE`] and can only log.
    pub fn close(&mut self, timeout: std::time::Duration) -> nodetour_ring::Result<()> {
        if std::mem::replace(&mut self.closed, true) {
            return Ok(());
        }
        let mut rings: Vec<&mut GpuRing> = std::iter::once(&mut self.ring)
            .chain(self.staged.as_mut())
            .collect();
        gpu_links::teardown(&mut rings, &self.job, Deadline::after(timeout))
    }

    /// Forms the ring from the launcher environment: rank `r` uses GPU `local_rank mod GPUs`.
    /// `extra` travels to every rank (see [`GpuRingJob::extras`]).
    pub fn form(
        config: &Config,
        options: GpuRingOptions,
        extra: &[u8],
    ) -> anyhow::Result<GpuRingJob> {
        let info = LaunchInfo::from_env()?;
        let (me, world) = (info.rank, info.world_size);
        let gpus = nodetour_core::cuda::gpus()?.len();
        if gpus == 0 {
            bail!("no GPU on this machine");
        }
        let gpu = info.local_rank.unwrap_or(me) as usize % gpus;
        let context = CudaContext::new(gpu).map_err(|e| anyhow::anyhow!("GPU {gpu}: {e:?}"))?;
        let forced = forced_from_env()?;
        if let Some(k) =
            forced.filter(|k| !matches!(k, TransportKind::CudaIpc | TransportKind::Shm))
        {
            bail!("NODETOUR_TRANSPORT={k}: the GPU ring runs over cuda-ipc or shm");
        }
        let blob = Announcement {
            gpu,
            extra: extra.to_vec(),
        }
        .encode();
        // The ring's neighbours share this host: they reach this rank on loopback only.
        let endpoint = TcpEndpoint::bind("127.0.0.1:0", JobToken::from_env(), config.timeout)?;
        let address = format!("127.0.0.1:{}", endpoint.local_addr()?.port());
        let deadline = Deadline::after(config.timeout);
        let job = rendezvous(&info, config, address, blob)?;
        let hosts: Vec<_> = job.peers().iter().map(|p| p.host.clone()).collect();
        let order = ring_order(&hosts);
        let position = order
            .iter()
            .position(|&r| r == me)
            .context("not in the ring")? as u32;
        let (prev, next) = neighbours(&order, me).context("not in the ring")?;
        // Every rank's announcement, decoded once.
        let announced = job
            .peers()
            .iter()
            .map(|p| Announcement::decode(&p.blob))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let extras = announced.iter().map(|a| a.extra.clone()).collect();
        let next_gpu = (world > 1).then_some(announced[next as usize].gpu);
        if world > 1 && !hosts[next as usize].same_host(&HostIdentity::current())
            || !hosts[prev as usize].same_host(&HostIdentity::current())
        {
            bail!(
                "the GPU ring's neighbours must share this host (cuda-ipc or shm); a GPU ring \
                 across hosts goes staged through nodetour::Communicator"
            );
        }
        let formed = gpu_links::form(
            Seat {
                job: &job,
                endpoint: &endpoint,
                context: &context,
                me,
                world,
                position,
                prev,
                next,
                forced,
                deadline,
            },
            options,
        )?;
        drop(endpoint);
        let (ring, staged, choice) = (formed.ring, formed.staged, formed.choice);
        Ok(GpuRingJob {
            ring,
            staged,
            context,
            rank: me,
            world,
            order,
            choice,
            job,
            extras,
            next_gpu,
            closed: false,
        })
    }
}

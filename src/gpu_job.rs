//! A job of processes, one GPU each, joined in a GPU ring on one host: the bootstrap (from the
//! launcher environment), the ring order, and for each link the choice between the direct path
//! (cuda-ipc) and the staged path (shm), with the reason.
//!
//! The sender chooses: cuda-ipc when it can map the next rank's GPU slots (same host, peer
//! access), else shm; `NODETOUR_TRANSPORT=shm` forces the staged path and
//! `NODETOUR_TRANSPORT=cuda-ipc` makes a failed mapping an error. The choice is announced in the
//! receiver's flag page before a barrier, so both ends agree without another exchange.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use cudarc::driver::CudaContext;
use nodetour_core::bootstrap::{Bootstrap, HostIdentity, LaunchInfo};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::gpu::{CudaIpcSender, Flags, GpuSlot, IpcGrant, ShmSender, ShmSlot};
use nodetour_core::transport::{TransportKind, forced_from_env};
use nodetour_core::{Config, Deadline};
use nodetour_ring::gpu_ring::{
    GpuRing, IPC_SLOT_BYTES, Incoming, Outgoing, SHM_SLOT_BYTES, SLOT_MEMORY_MAX, SLOTS,
    StreamLinks, flag,
};
use nodetour_ring::order::{neighbours, ring_order};

use crate::blob::{put, rendezvous, take};

const MODE_IPC: u32 = 1;
const MODE_SHM: u32 = 2;

/// Slot shapes of a GPU ring.
#[derive(Clone, Copy, Debug)]
pub struct GpuRingOptions {
    /// Slots per link.
    pub slots: u32,
    /// Bytes per slot on the direct path.
    pub ipc_slot_bytes: usize,
    /// Bytes per slot on the staged path.
    pub shm_slot_bytes: usize,
}

impl Default for GpuRingOptions {
    fn default() -> Self {
        GpuRingOptions {
            slots: SLOTS,
            ipc_slot_bytes: IPC_SLOT_BYTES,
            shm_slot_bytes: SHM_SLOT_BYTES,
        }
    }
}

/// A formed GPU ring.
pub struct GpuRingJob {
    /// This rank's ring (drops before the bootstrap).
    pub ring: GpuRing,
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
}

impl GpuRingJob {
    /// Forms the ring from the launcher environment: rank `r` uses GPU `local_rank mod GPUs`.
    /// `extra` travels to every rank (see [`GpuRingJob::extras`]).
    pub fn form(
        config: &Config,
        options: GpuRingOptions,
        extra: &[u8],
    ) -> anyhow::Result<GpuRingJob> {
        let info = LaunchInfo::from_env()?;
        let (me, world) = (info.rank, info.world_size);
        for (what, bytes) in [
            ("cuda-ipc", options.ipc_slot_bytes),
            ("shm", options.shm_slot_bytes),
        ] {
            let total = bytes.saturating_mul(options.slots as usize);
            if total > SLOT_MEMORY_MAX || options.slots == 0 || bytes == 0 {
                bail!(
                    "{what}: {} slots of {bytes} bytes: slot memory is bounded by {} MiB",
                    options.slots,
                    SLOT_MEMORY_MAX >> 20
                );
            }
        }
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

        // What this rank receives into, announced before the rendezvous; the unused one is
        // freed once the previous rank has said which it chose.
        let flags = Flags::create(flag::WORDS)?;
        let gpu_slots = GpuSlot::new(&context, options.slots as usize * options.ipc_slot_bytes)?;
        let shm_slots = ShmSlot::create(options.slots as usize * options.shm_slot_bytes)?;
        let (shm_path, shm_len) = shm_slots.grant();
        let mut blob = Vec::new();
        put(&mut blob, &gpu_slots.ipc_grant()?.encode());
        put(&mut blob, flags.path().to_string_lossy().as_bytes());
        put(&mut blob, shm_path.to_string_lossy().as_bytes());
        put(&mut blob, &(shm_len as u64).to_be_bytes());
        put(&mut blob, extra);
        let deadline = Deadline::after(config.timeout);
        let job = rendezvous(&info, config, blob)?;
        let hosts: Vec<_> = job.peers().iter().map(|p| p.host.clone()).collect();
        let order = ring_order(&hosts);
        let position = order
            .iter()
            .position(|&r| r == me)
            .context("not in the ring")? as u32;
        let (prev, next) = neighbours(&order, me).context("not in the ring")?;
        let mut extras = Vec::new();
        for p in job.peers() {
            let mut at = 0;
            for _ in 0..4 {
                take(&p.blob, &mut at)?;
            }
            extras.push(take(&p.blob, &mut at)?.to_vec());
        }
        if world == 1 {
            let ring = GpuRing::new(&context, 0, 1, None)?;
            return Ok(GpuRingJob {
                ring,
                context,
                rank: me,
                world,
                order,
                choice: "a ring of one".into(),
                job,
                extras,
            });
        }
        if !hosts[next as usize].same_host(&HostIdentity::current())
            || !hosts[prev as usize].same_host(&HostIdentity::current())
        {
            bail!(
                "the GPU ring's neighbours must share this host (cuda-ipc or shm); a GPU ring \
                 across hosts (verbs, staged through host slots) is not built yet"
            );
        }
        let theirs = &job.peers()[next as usize].blob;
        let mut at = 0;
        let grant = IpcGrant::decode(take(theirs, &mut at)?)?;
        let next_flags = PathBuf::from(String::from_utf8(take(theirs, &mut at)?.to_vec())?);
        let next_shm = PathBuf::from(String::from_utf8(take(theirs, &mut at)?.to_vec())?);
        let next_shm_len = u64::from_be_bytes(take(theirs, &mut at)?.try_into()?) as usize;
        let prev_flags = {
            let b = &job.peers()[prev as usize].blob;
            let mut at = 0;
            take(b, &mut at)?;
            let path = PathBuf::from(String::from_utf8(take(b, &mut at)?.to_vec())?);
            Flags::open(&path, flag::WORDS)?
        };

        let open_flags = || Flags::open(&next_flags, flag::WORDS);
        let (outgoing, choice) = if forced == Some(TransportKind::Shm) {
            let s = ShmSender::open(&next_shm, next_shm_len, open_flags()?, flag::READY)?;
            (
                Outgoing::Shm(s),
                "staged (shm): NODETOUR_TRANSPORT=shm".to_owned(),
            )
        } else {
            match CudaIpcSender::open(&context, &grant, open_flags()?, flag::READY) {
                Ok(s) => (
                    Outgoing::CudaIpc(s),
                    "direct (cuda-ipc): the next rank's GPU slots are mapped into this GPU"
                        .to_owned(),
                ),
                Err(e) if forced.is_none() => {
                    let s = ShmSender::open(&next_shm, next_shm_len, open_flags()?, flag::READY)?;
                    (Outgoing::Shm(s), format!("staged (shm): {e}"))
                }
                Err(e) => return Err(e.into()),
            }
        };
        let mode = match outgoing {
            Outgoing::CudaIpc(_) => MODE_IPC,
            Outgoing::Shm(_) => MODE_SHM,
        };
        open_flags()?.store(flag::MODE, mode)?;
        job.barrier(deadline)?;
        // Every peer has mapped our files and announced its choice: remove the names (nothing
        // is left behind on a crash).
        flags.unlink()?;
        shm_slots.unlink()?;
        let incoming = match flags.read(flag::MODE)? {
            MODE_IPC => {
                drop(shm_slots);
                Incoming::CudaIpc(gpu_slots)
            }
            MODE_SHM => {
                drop(gpu_slots);
                Incoming::Shm {
                    slots: shm_slots,
                    scratch: DeviceBuffer::new(&context, options.shm_slot_bytes)?,
                }
            }
            other => bail!("rank {prev} announced transport {other}"),
        };
        let slot_bytes = match incoming {
            Incoming::CudaIpc(_) => options.ipc_slot_bytes,
            Incoming::Shm { .. } => options.shm_slot_bytes,
        };
        let out_bytes = match outgoing {
            Outgoing::CudaIpc(_) => options.ipc_slot_bytes,
            Outgoing::Shm(_) => options.shm_slot_bytes,
        };
        if slot_bytes != out_bytes {
            // One slot size per link would do; the plan uses one per ring, so both links of a
            // rank must agree (they do whenever every link takes the same path).
            bail!(
                "mixed paths in one ring (to next: {choice}; from previous: mode {}): \
                 set NODETOUR_TRANSPORT=shm",
                flags.read(flag::MODE)?
            );
        }
        let links = StreamLinks {
            flags,
            prev_flags,
            outgoing,
            incoming,
            slots: options.slots,
            slot_bytes,
        };
        job.barrier(deadline)?;
        let ring = GpuRing::new(&context, position, world, Some(links))?;
        tracing::info!(rank = me, gpu, path = ring.path(), reason = %choice, "GPU ring formed");
        Ok(GpuRingJob {
            ring,
            context,
            rank: me,
            world,
            order,
            choice,
            job,
            extras,
        })
    }
}

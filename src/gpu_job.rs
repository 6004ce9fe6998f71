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
use nodetour_core::transport::gpu::{
    CudaIpcSender, DeviceFlags, FlagPage, Flags, GpuSlot, IpcGrant, PeerDeviceFlags, ShmSender,
    ShmSlot,
};
use nodetour_core::transport::{TransportKind, forced_from_env};
use nodetour_core::{Config, Deadline};
use nodetour_ring::gpu_ring::{
    GpuRing, IPC_SLOT_BYTES, IPC_SLOTS, Incoming, Outgoing, SHM_SLOT_BYTES, SLOT_MEMORY_MAX, SLOTS,
    StreamLinks, flag,
};
use nodetour_ring::order::{neighbours, ring_order};

use crate::blob::{put, rendezvous, take};

const MODE_IPC: u32 = 1;
const MODE_SHM: u32 = 2;

/// Slot shapes of a GPU ring.
#[derive(Clone, Copy, Debug)]
pub struct GpuRingOptions {
    /// Slots per link on the staged path.
    pub slots: u32,
    /// Bytes per slot on the direct path.
    pub ipc_slot_bytes: usize,
    /// Bytes per slot on the staged path.
    pub shm_slot_bytes: usize,
    /// Slots per link on the direct path.
    pub ipc_slots: u32,
    /// Direct path: flags in GPU memory (polled locally, set over NVLink/PCIe) rather than in
    /// shared host memory.
    pub device_flags: bool,
}

impl Default for GpuRingOptions {
    fn default() -> Self {
        GpuRingOptions {
            slots: SLOTS,
            ipc_slot_bytes: IPC_SLOT_BYTES,
            shm_slot_bytes: SHM_SLOT_BYTES,
            ipc_slots: IPC_SLOTS,
            device_flags: true,
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
        for (what, slots, bytes) in [
            ("cuda-ipc", options.ipc_slots, options.ipc_slot_bytes),
            ("shm", options.slots, options.shm_slot_bytes),
        ] {
            let total = bytes.saturating_mul(slots as usize);
            if total > SLOT_MEMORY_MAX || slots == 0 || bytes == 0 {
                bail!(
                    "{what}: {slots} slots of {bytes} bytes: slot memory is bounded by {} MiB",
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
        let device_flags = DeviceFlags::create(&context, flag::WORDS)?;
        let gpu_slots = GpuSlot::new(
            &context,
            options.ipc_slots as usize * options.ipc_slot_bytes,
        )?;
        let shm_slots = ShmSlot::create(options.slots as usize * options.shm_slot_bytes)?;
        let (shm_path, shm_len) = shm_slots.grant();
        let mut blob = Vec::new();
        put(&mut blob, &gpu_slots.ipc_grant()?.encode());
        put(&mut blob, flags.path().to_string_lossy().as_bytes());
        put(&mut blob, shm_path.to_string_lossy().as_bytes());
        put(&mut blob, &(shm_len as u64).to_be_bytes());
        put(&mut blob, &device_flags.ipc_grant()?.encode());
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
            for _ in 0..5 {
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
        let next_device_flags = IpcGrant::decode(take(theirs, &mut at)?)?;
        let (prev_flags, prev_device_flags) = {
            let b = &job.peers()[prev as usize].blob;
            let mut at = 0;
            take(b, &mut at)?;
            let path = PathBuf::from(String::from_utf8(take(b, &mut at)?.to_vec())?);
            take(b, &mut at)?;
            take(b, &mut at)?;
            let device = IpcGrant::decode(take(b, &mut at)?)?;
            (Flags::open(&path, flag::WORDS)?, device)
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
        // Opened now: the name goes away after the barrier.
        let next_host_flags = open_flags()?;
        next_host_flags.store(flag::MODE, mode)?;
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
        let slots = match incoming {
            Incoming::CudaIpc(_) => options.ipc_slots,
            Incoming::Shm { .. } => options.slots,
        };
        // Direct links keep their flags in GPU memory (each GPU polls its own memory); the
        // pages of both neighbours are mapped before anyone's names go away.
        let on_gpu = matches!(incoming, Incoming::CudaIpc(_)) && options.device_flags;
        let choice = format!(
            "{choice}; flags in {}",
            if on_gpu {
                "GPU memory"
            } else {
                "shared host memory"
            }
        );
        let pages: [Box<dyn FlagPage>; 3] = match on_gpu {
            true => [
                Box::new(device_flags),
                Box::new(PeerDeviceFlags::open(
                    &context,
                    &next_device_flags,
                    flag::WORDS,
                )?),
                Box::new(PeerDeviceFlags::open(
                    &context,
                    &prev_device_flags,
                    flag::WORDS,
                )?),
            ],
            _ => [
                Box::new(flags),
                Box::new(next_host_flags),
                Box::new(prev_flags),
            ],
        };
        let [flags, next_flags, prev_flags] = pages;
        let links = StreamLinks {
            flags,
            next_flags,
            prev_flags,
            outgoing,
            incoming,
            slots,
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

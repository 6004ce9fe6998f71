//! A job of processes, one GPU each, joined in a GPU ring on one host: the bootstrap (from the
//! launcher environment), the ring order, and for each link the choice between the direct path
//! (cuda-ipc) and the staged path (shm), with the reason.
//!
//! The sender chooses: cuda-ipc when it can map the next rank's GPU slots (same host, peer
//! access), else shm; `NODETOUR_TRANSPORT=shm` forces the staged path and
//! `NODETOUR_TRANSPORT=cuda-ipc` makes a failed mapping an error. The choice is announced in the
//! receiver's flag page before a barrier, so both ends agree without another exchange.

use std::sync::Arc;

use anyhow::{Context as _, bail};
use cudarc::driver::CudaContext;
use nodetour_core::bootstrap::{Bootstrap, HostIdentity, JobToken, LaunchInfo};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::gpu::{
    CudaIpcSender, DeviceFlags, FlagPage, Flags, GpuSlot, PeerDeviceFlags, ShmSender, ShmSlot,
};
use nodetour_core::transport::setup::GpuNeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{TransportKind, forced_from_env};
use nodetour_core::{Config, Deadline};
use nodetour_ring::gpu_ring::{
    EndPages, GpuRing, IPC_SLOT_BYTES, IPC_SLOTS, Incoming, Outgoing, SHM_SLOT_BYTES,
    SLOT_MEMORY_MAX, SLOTS, StreamLinks, flag,
};
use nodetour_ring::order::{neighbours, ring_order};

use crate::blob::{put, rendezvous, take};

const MODE_IPC: u32 = 1;
const MODE_SHM: u32 = 2;

/// Which paths a GPU ring builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPaths {
    /// Direct where the next GPU's memory can be mapped, else staged (the default).
    Auto,
    /// Direct only (an error where cuda-ipc cannot map the peer's memory).
    Direct,
    /// Staged only.
    Staged,
    /// Both: a direct ring and a staged ring side by side (benchmarks).
    Both,
}

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
    /// Which paths to build (`NODETOUR_TRANSPORT=cuda-ipc|shm` overrides it).
    pub paths: GpuPaths,
}

impl Default for GpuRingOptions {
    fn default() -> Self {
        GpuRingOptions {
            slots: SLOTS,
            ipc_slot_bytes: IPC_SLOT_BYTES,
            shm_slot_bytes: SHM_SLOT_BYTES,
            ipc_slots: IPC_SLOTS,
            device_flags: true,
            paths: GpuPaths::Auto,
        }
    }
}

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
        let mut first = self.ring.close_imports(timeout).err();
        if let Some(s) = &mut self.staged {
            first = first.or(s.close_imports(timeout).err());
        }
        let handshake = self.job.barrier(Deadline::after(timeout));
        let peers_done = match &handshake {
            Ok(()) => true,
            // A rank that is gone has no mapping left.
            Err(_) => self.job.check().is_err(),
        };
        for ring in std::iter::once(&mut self.ring).chain(self.staged.as_mut()) {
            if peers_done {
                first = first.or(ring.close(timeout).err());
            } else {
                ring.leak_exports();
            }
        }
        match (first, handshake) {
            (Some(e), _) => Err(e),
            (None, Err(e)) if !peers_done => {
                // leak_exports logged the leak; the handshake's own error is the source.
                tracing::error!(error = %e, "the teardown handshake failed: exported slots leaked");
                Err(nodetour_ring::Error::Transport { source: e.into() })
            }
            _ => Ok(()),
        }
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
        let flags = Flags::create(&context, flag::WORDS)?;
        let device_flags = DeviceFlags::create(&context, flag::WORDS)?;
        let gpu_slots = GpuSlot::new(
            &context,
            options.ipc_slots as usize * options.ipc_slot_bytes,
        )?;
        let shm_slots = ShmSlot::create(&context, options.slots as usize * options.shm_slot_bytes)?;
        let (shm_path, shm_len) = shm_slots.grant();
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
        if world == 1 {
            let ring = GpuRing::new(&context, 0, 1, None)?;
            return Ok(GpuRingJob {
                ring,
                staged: None,
                context,
                rank: me,
                world,
                order,
                choice: "a ring of one".into(),
                job,
                extras,
                next_gpu,
                closed: false,
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
        // To each neighbour, and to no one else: this rank's flag pages (both write them); to
        // the previous rank also the slots it writes into.
        let my_device_flags = device_flags.ipc_grant()?;
        let my_slots = gpu_slots.ipc_grant()?;
        let setup_for = |p: u32| {
            GpuNeighbourSetup {
                flags: flags.name().clone(),
                device_flags: my_device_flags,
                slots: (p == prev).then(|| (my_slots, shm_path.clone(), shm_len as u64)),
            }
            .encode()
        };
        let linked: Vec<u32> = if next == prev {
            vec![next]
        } else {
            vec![next, prev]
        };
        let alive = || job.check();
        let peer_address = |p: u32| job.peers()[p as usize].address.clone();
        let setups = endpoint.exchange(
            &linked,
            me,
            world,
            &peer_address,
            &setup_for,
            &alive,
            deadline,
        )?;
        drop(endpoint);
        let setup_of = |p: u32| -> anyhow::Result<GpuNeighbourSetup> {
            GpuNeighbourSetup::decode(setups.get(&p).context("no setup from a neighbour")?)
                .with_context(|| format!("rank {p}'s setup"))
        };
        let (theirs, from_prev) = (setup_of(next)?, setup_of(prev)?);
        let (grant, next_shm, next_shm_len) = theirs
            .slots
            .clone()
            .with_context(|| format!("rank {next} sent no slots"))?;
        let (next_flags, next_device_flags) = (&theirs.flags, theirs.device_flags);
        let next_shm_len = usize::try_from(next_shm_len)?;
        let next_shm = &next_shm;
        let prev_flags = Flags::open(&context, &from_prev.flags, flag::WORDS)?;
        let prev_device_flags = from_prev.device_flags;

        let open_flags = || Flags::open(&context, next_flags, flag::WORDS);
        // Which paths to build: Auto tries direct and falls back to staged.
        let env_path = match forced {
            Some(TransportKind::Shm) => Some(GpuPaths::Staged),
            Some(TransportKind::CudaIpc) => Some(GpuPaths::Direct),
            _ => None,
        };
        let paths = env_path.unwrap_or(options.paths);
        if paths == GpuPaths::Both && !options.device_flags {
            bail!("both paths at once need the direct ring's flags in GPU memory");
        }
        let mut choice = Vec::new();
        let mut out_ipc = None;
        if paths != GpuPaths::Staged {
            match CudaIpcSender::open(&context, &grant, open_flags()?, flag::READY) {
                Ok(s) => {
                    out_ipc = Some(s);
                    choice.push(
                        "direct (cuda-ipc): the next rank's GPU slots are mapped into this GPU"
                            .to_owned(),
                    );
                }
                Err(e) if paths == GpuPaths::Auto => {
                    choice.push(format!("staged (shm): {e}"));
                }
                Err(e) => return Err(e.into()),
            }
        }
        let out_shm = if paths == GpuPaths::Staged || paths == GpuPaths::Both || out_ipc.is_none() {
            if paths == GpuPaths::Staged {
                choice.push(match env_path {
                    Some(_) => "staged (shm): NODETOUR_TRANSPORT=shm".to_owned(),
                    None => "staged (shm): requested".to_owned(),
                });
            } else if paths == GpuPaths::Both {
                choice.push("staged (shm) beside it, for comparison".to_owned());
            }
            Some(ShmSender::open(
                &context,
                next_shm,
                next_shm_len,
                open_flags()?,
                flag::READY,
            )?)
        } else {
            None
        };
        let mode =
            u32::from(out_ipc.is_some()) * MODE_IPC + u32::from(out_shm.is_some()) * MODE_SHM;
        // Opened now: the name goes away after the barrier.
        let next_host_flags = open_flags()?;
        next_host_flags.store(flag::MODE, mode)?;
        job.barrier(deadline)?;
        // Every peer has mapped our files and announced its choice: remove the names (nothing
        // is left behind on a crash).
        flags.unlink()?;
        shm_slots.unlink()?;
        let incoming_mode = flags.read(flag::MODE)?;
        if incoming_mode != mode {
            bail!(
                "mixed paths in one ring (to next: {}; from previous: mode {incoming_mode}): set \
                 NODETOUR_TRANSPORT=shm",
                choice.join("; ")
            );
        }
        // The host pages carry end notices on every path; the staged path's streams use them
        // for their flags too.
        let ends = EndPages {
            mine: Arc::new(flags),
            next: Arc::new(next_host_flags),
            prev: Arc::new(prev_flags),
        };
        let host_page = |f: &Arc<Flags>| -> Arc<dyn FlagPage> { f.clone() };
        let mut host_pages_free = true;
        let mut rings = Vec::new();
        if let Some(out) = out_ipc {
            // Direct links keep their flags in GPU memory (each GPU polls its own memory); the
            // pages of both neighbours are mapped before anyone's names go away.
            let pages: [Arc<dyn FlagPage>; 3] = if options.device_flags {
                [
                    Arc::new(device_flags),
                    Arc::new(PeerDeviceFlags::open(
                        &context,
                        &next_device_flags,
                        flag::WORDS,
                    )?),
                    Arc::new(PeerDeviceFlags::open(
                        &context,
                        &prev_device_flags,
                        flag::WORDS,
                    )?),
                ]
            } else {
                host_pages_free = false;
                [
                    host_page(&ends.mine),
                    host_page(&ends.next),
                    host_page(&ends.prev),
                ]
            };
            let [mine, next_page, prev_page] = pages;
            rings.push(StreamLinks {
                flags: mine,
                next_flags: next_page,
                prev_flags: prev_page,
                outgoing: Outgoing::CudaIpc(out),
                incoming: Incoming::CudaIpc(gpu_slots),
                slots: options.ipc_slots,
                slot_bytes: options.ipc_slot_bytes,
                ends: ends.clone(),
                desc_half: 0,
            });
        }
        if let Some(out) = out_shm {
            // Both paths at once only with the direct ring's flags in GPU memory (checked).
            if !host_pages_free {
                bail!("the host flag pages are taken by the direct ring");
            }
            rings.push(StreamLinks {
                flags: host_page(&ends.mine),
                next_flags: host_page(&ends.next),
                prev_flags: host_page(&ends.prev),
                outgoing: Outgoing::Shm(out),
                incoming: Incoming::Shm {
                    slots: shm_slots,
                    scratch: DeviceBuffer::new(&context, options.shm_slot_bytes)?,
                },
                slots: options.slots,
                slot_bytes: options.shm_slot_bytes,
                ends: ends.clone(),
                desc_half: u32::from(!rings.is_empty()),
            });
        }
        let flags_where = if options.device_flags {
            "flags in GPU memory (direct), shared host memory (staged)"
        } else {
            "flags in shared host memory"
        };
        let choice = format!("{}; {flags_where}", choice.join("; "));
        job.barrier(deadline)?;
        let mut rings = rings
            .into_iter()
            .map(|links| GpuRing::new(&context, position, world, Some(links)))
            .collect::<nodetour_ring::Result<Vec<_>>>()?;
        let staged = if rings.len() == 2 { rings.pop() } else { None };
        let ring = rings.pop().context("no path was built")?;
        tracing::info!(rank = me, gpu, path = ring.path(), reason = %choice, "GPU ring formed");
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

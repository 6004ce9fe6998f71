//! The GPU ring of a communicator whose ranks all share one host, one GPU each: for the link to
//! the next rank, the direct path (cuda-ipc: this GPU writes the next GPU's slots) where the
//! next GPU's memory can be mapped, else the staged path (shm: through shared host memory),
//! with the reason. `NODETOUR_TRANSPORT=cuda-ipc` makes a failed mapping an error,
//! `NODETOUR_TRANSPORT=shm` forces the staged path. The sender chooses, and announces its
//! choice in the receiver's flag page before a barrier, so both ends agree without another
//! exchange. Handles and names go only to the neighbours that use them.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::Deadline;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::TransportKind;
use nodetour_core::transport::gpu::{
    CudaIpcSender, DeviceFlags, FlagPage, Flags, GpuSlot, PeerDeviceFlags, ShmSender, ShmSlot,
};
use nodetour_core::transport::setup::{GpuNeighbourSetup, RingShape};
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_net::bootstrap::Bootstrap;

use crate::error::{Error, Result};
use crate::gpu_ring::{
    EndPages, GpuRing, IPC_SLOT_BYTES, IPC_SLOTS, Incoming, Outgoing, SHM_SLOT_BYTES,
    SLOT_MEMORY_MAX, SLOTS, StreamLinks, flag,
};

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
}

/// Where a network link lands the previous rank's chunks (a ring across hosts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetLanding {
    /// The direct path where the registration ladder allows it (a verbs link: RDMA writes into
    /// GPU slots, from GPU send slots), else host slots (the default).
    Auto,
    /// Host slots; the receive stream copies each chunk in (the staged path).
    Host,
    /// GPU slots the receive stream reduces from directly: over verbs the NIC writes them where
    /// the ladder allows; else (tcp, or the ladder refused) the progress thread lands each chunk
    /// in a host bounce slot and copies it in on a stream of its own.
    Gpu,
}

impl NetLanding {
    /// Parses `NODETOUR_NET_LANDING` (`auto`, `host` or `gpu`).
    pub fn parse(v: &str) -> Option<NetLanding> {
        match v.trim() {
            "" | "auto" => Some(NetLanding::Auto),
            "host" => Some(NetLanding::Host),
            "gpu" => Some(NetLanding::Gpu),
            _ => None,
        }
    }
}

/// Whether small allreduces run as one kernel per collective (`nodetour_core::cuda::one_kernel`:
/// every rank reads every rank's mapped scratch) where every rank of the host has a GPU of its
/// own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OneKernelMode {
    /// Where every rank has its own GPU and every peer's memory can be mapped (the default).
    Auto,
    /// Never: every collective runs on the stream-ordered ring.
    Off,
    /// Always (an error where the peers' memory cannot be mapped), even between ranks that
    /// share a GPU: for tests only. Ranks sharing a GPU are time-sliced, so each wait lasts
    /// until the driver switches contexts (milliseconds, not microseconds).
    Force,
}

impl OneKernelMode {
    /// Parses `NODETOUR_ONE_KERNEL` (`auto`, `off` or `force`).
    pub fn parse(v: &str) -> Option<OneKernelMode> {
        match v.trim() {
            "" | "auto" => Some(OneKernelMode::Auto),
            "off" => Some(OneKernelMode::Off),
            "force" => Some(OneKernelMode::Force),
            _ => None,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            OneKernelMode::Auto => 0,
            OneKernelMode::Off => 1,
            OneKernelMode::Force => 2,
        }
    }
}

/// Default for [`GpuRingOptions::one_kernel_max`]: allreduces of at most this many bytes run
/// as one kernel.
pub const ONE_KERNEL_MAX: usize = 1 << 20;

/// Slot shapes and paths of a GPU ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// Where network links land (`NODETOUR_NET_LANDING`).
    pub net_landing: NetLanding,
    /// Small allreduces as one kernel (`NODETOUR_ONE_KERNEL`).
    pub one_kernel: OneKernelMode,
    /// The largest allreduce, in bytes, that runs as one kernel (`NODETOUR_ONE_KERNEL_MAX`;
    /// also the size of each of the two halves of every rank's scratch). Every rank must use
    /// the same value (checked at formation).
    pub one_kernel_max: usize,
    /// The most blocks one reduce, copy or send kernel of the stream-ordered ring launches
    /// (`NODETOUR_RING_BLOCKS`; 0: `4 × SMs`, the default): a cap leaves SMs to compute that
    /// runs beside large collectives (measure with `nodetour perf --gpu --beside-compute`).
    /// A rank's own choice: ranks need not agree.
    pub max_blocks: u32,
    /// Direct path: cut each collective's segment into at least this many chunks where the
    /// slots allow (none smaller than [`crate::plan::PIPELINE_MIN_CHUNK`]), so that a chunk's
    /// transfer overlaps the previous chunk's reduce (`NODETOUR_IPC_PIPELINE`, 1 to 64;
    /// 1: chunks of a whole slot). Every rank must use the same value (checked at formation).
    pub ipc_pipeline: u32,
    /// Staged path: the same (`NODETOUR_SHM_PIPELINE`): a chunk's copy out of one GPU then
    /// overlaps the previous chunk's copy into the next.
    pub shm_pipeline: u32,
    /// Staged path: chunks of at most this many bytes are reduced straight out of the host
    /// slot by the reduce kernel (its loads cross PCIe), larger ones copied into GPU scratch
    /// by the copy engine first (`NODETOUR_SHM_READ_MAX`; 0: always the copy engine). A rank's
    /// own choice: ranks need not agree.
    pub shm_read_max: usize,
    /// Direct path: received chunks that are only copied (the all-gather's steps) of at most
    /// this many bytes are copied out of the slot by one kernel that then credits the slot,
    /// larger ones by the copy engine and a credit kernel (`NODETOUR_SLOT_COPY_KERNEL_MAX`; 0:
    /// always the copy engine). A rank's own choice: ranks need not agree.
    pub copy_kernel_max: usize,
}

/// Default for [`GpuRingOptions::shm_read_max`]. On one H200 with two processes under MPS
/// (bf16 sum, the exchange of two ranks: one chunk per collective up to a slot), reading the
/// host slot in the reduce kernel ran 1.19× faster than copying it in first at 64 KiB, 1.10× at
/// 256 KiB, the same at 1-4 MiB, and 0.88-0.94× at 16-256 MiB (chunks of 8 MiB: the copy
/// engine reads PCIe faster than the SMs) (`docs/measurements/2026-12-03-pipelines-wide-loads/`).
pub(super) const SHM_READ_MAX: usize = 1 << 20;

/// Default for [`GpuRingOptions::copy_kernel_max`]. On one H200 with two processes under MPS
/// (bf16 sum, two ranks: the all-gather step copies half the buffer), copying out of the GPU
/// slot by the copy engine and a credit kernel ran 0.88× of the one kernel at 64 KiB, 0.91× at
/// 256 KiB, 0.87× at 1 MiB; the kernel up to 16 MiB ran 0.98-1.02× of this default from 1 to
/// 256 MiB (3 rounds, interleaved). The staged path's host slots always take the copy engine:
/// the same kernel reading a host slot over PCIe ran 0.89× of it at 64 KiB and 0.92× at 1 MiB
/// (`docs/measurements/2026-12-03-copy-kernel/`). Reducing out of a host slot is another
/// matter ([`SHM_READ_MAX`]): there one kernel replaces three operations.
pub(super) const COPY_KERNEL_MAX: usize = 1 << 20;

/// Default for [`GpuRingOptions::ipc_pipeline`]: whole slots. Each chunk pays a hand-off of
/// several µs that more, smaller chunks do not hide: on two H200s (host flags) 16 × 4 MiB
/// slots ran 0.64× and 2 × 32 MiB 1.05× of NCCL at 1 GiB; on one H200 with two processes
/// under MPS (a substitute: HBM for NVLink), depth 2 ran 0.79-0.83× of whole slots at 1-16 MiB
/// and depth 4 0.48-0.54× (`docs/measurements/2026-12-03-pipelines-wide-loads/`).
pub(super) const IPC_PIPELINE: u32 = 1;
/// Default for [`GpuRingOptions::shm_pipeline`]: whole slots. On one H200 under MPS (both
/// ranks share one PCIe link, so a chunk's copy out cannot overlap the peer's copy in as it
/// would on two GPUs) depth 4 ran 0.59× of whole slots at 1 MiB and 0.90× at 4 MiB, and no
/// depth won at any size; the run on two GPUs decides (`onehost-reference.sh OUT pipeline`).
pub(super) const SHM_PIPELINE: u32 = 1;

impl Default for GpuRingOptions {
    fn default() -> Self {
        GpuRingOptions {
            slots: SLOTS,
            ipc_slot_bytes: IPC_SLOT_BYTES,
            shm_slot_bytes: SHM_SLOT_BYTES,
            ipc_slots: IPC_SLOTS,
            device_flags: true,
            paths: GpuPaths::Auto,
            net_landing: NetLanding::Auto,
            one_kernel: OneKernelMode::Auto,
            one_kernel_max: ONE_KERNEL_MAX,
            max_blocks: 0,
            ipc_pipeline: IPC_PIPELINE,
            shm_pipeline: SHM_PIPELINE,
            shm_read_max: SHM_READ_MAX,
            copy_kernel_max: COPY_KERNEL_MAX,
        }
    }
}

/// The most chunks a pipeline cuts a segment into.
pub(super) const PIPELINE_MAX: u32 = 64;

impl GpuRingOptions {
    /// How this rank cuts its links: what its neighbours must match.
    pub(crate) fn shape(&self) -> RingShape {
        RingShape {
            ipc_slots: self.ipc_slots,
            ipc_slot_bytes: self.ipc_slot_bytes as u64,
            ipc_pipeline: self.ipc_pipeline,
            shm_slots: self.slots,
            shm_slot_bytes: self.shm_slot_bytes as u64,
            shm_pipeline: self.shm_pipeline,
        }
    }

    /// The in-host paths to build: `NODETOUR_TRANSPORT=shm|cuda-ipc` (`forced`) overrides
    /// [`Self::paths`].
    pub(crate) fn paths_under(&self, forced: Option<TransportKind>) -> GpuPaths {
        match forced {
            Some(TransportKind::Shm) => GpuPaths::Staged,
            Some(TransportKind::CudaIpc) => GpuPaths::Direct,
            _ => self.paths,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.one_kernel_max == 0 || self.one_kernel_max > SLOT_MEMORY_MAX / 2 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "one-kernel collectives of up to {} bytes: between 1 and {} (two halves of \
                     scratch are bounded by the slot memory bound)",
                    self.one_kernel_max,
                    SLOT_MEMORY_MAX / 2
                ),
            });
        }
        for (what, depth) in [("ipc", self.ipc_pipeline), ("shm", self.shm_pipeline)] {
            if !(1..=PIPELINE_MAX).contains(&depth) {
                return Err(Error::InvalidArgument {
                    reason: format!(
                        "a {what} pipeline of {depth} chunks: between 1 and {PIPELINE_MAX}"
                    ),
                });
            }
        }
        for (what, slots, bytes) in [
            ("cuda-ipc", self.ipc_slots, self.ipc_slot_bytes),
            ("shm", self.slots, self.shm_slot_bytes),
        ] {
            let total = bytes.saturating_mul(slots as usize);
            if total > SLOT_MEMORY_MAX || slots == 0 || bytes == 0 {
                return Err(Error::InvalidArgument {
                    reason: format!(
                        "{what}: {slots} slots of {bytes} bytes: slot memory is bounded by {} MiB",
                        SLOT_MEMORY_MAX >> 20
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Refuses neighbours whose links are cut differently from this rank's (`mine`): they would
/// plan other chunks for the same collective. Both ends of a link check it, so a ring forms
/// only where every rank has the same shape.
pub(crate) fn check_shape(
    mine: &RingShape,
    me: u32,
    neighbours: &[(u32, &GpuNeighbourSetup)],
) -> Result<()> {
    match neighbours.iter().find(|(_, s)| s.shape != *mine) {
        None => Ok(()),
        Some((r, s)) => Err(Error::InvalidArgument {
            reason: format!(
                "rank {r} cuts its GPU links differently from rank {me} ({:?} against {mine:?}): \
                 the slot shapes, NODETOUR_IPC_PIPELINE and NODETOUR_SHM_PIPELINE must be the \
                 same on every rank",
                s.shape
            ),
        }),
    }
}

/// A formed GPU ring (direct where cuda-ipc works), and why the link to the next rank takes
/// its path.
pub(crate) struct FormedGpuRing {
    /// The ring.
    pub ring: GpuRing,
    /// Why.
    pub choice: String,
}

/// Where this rank sits in a job whose ranks all share this host, and what it may use.
pub(crate) struct Seat<'a> {
    /// The job's bootstrap (barriers, liveness, every rank's address).
    pub job: &'a Bootstrap,
    /// This rank's authenticated endpoint (the neighbours' setups travel over it).
    pub endpoint: &'a TcpEndpoint,
    /// This rank's GPU.
    pub context: &'a Arc<CudaContext>,
    /// This rank.
    pub me: u32,
    /// Ranks in the job.
    pub world: u32,
    /// This rank's position in the ring order.
    pub position: u32,
    /// The previous rank in the ring.
    pub prev: u32,
    /// The next rank in the ring.
    pub next: u32,
    /// `NODETOUR_TRANSPORT` (cuda-ipc or shm here; anything else means "choose").
    pub forced: Option<TransportKind>,
    /// Formation's deadline.
    pub deadline: Deadline,
    /// The collective timeout (how long a one-kernel collective waits for a peer).
    pub timeout: std::time::Duration,
}

/// Forms the GPU ring of `seat`'s job with `options` (every rank calls it, with the same
/// options): the communicator's device path on one host.
pub(crate) fn form(seat: Seat<'_>, options: GpuRingOptions) -> Result<FormedGpuRing> {
    options.validate()?;
    let Seat {
        job,
        endpoint,
        context,
        me,
        world,
        position,
        prev,
        next,
        forced,
        deadline,
        timeout,
    } = seat;
    if world == 1 {
        return Ok(FormedGpuRing {
            ring: GpuRing::new(context, 0, 1, None)?,
            choice: "a ring of one".into(),
        });
    }
    let (ipc_slots, ipc_slot_bytes) = (options.ipc_slots, options.ipc_slot_bytes);
    let (shm_slots_n, shm_slot_bytes) = (options.slots, options.shm_slot_bytes);
    // Which paths to build: the environment's override, else the options'.
    let paths = options.paths_under(forced);
    // What this rank receives into; the unused kind is freed once the previous rank has said
    // which it chose.
    let flags = Flags::create(context, flag::WORDS)?;
    let device_flags = DeviceFlags::create(context, flag::WORDS)?;
    let gpu_slots = GpuSlot::new(context, ipc_slots as usize * ipc_slot_bytes)?;
    let shm_slots = ShmSlot::create(context, shm_slots_n as usize * shm_slot_bytes)?;
    let (shm_path, shm_len) = shm_slots.grant();
    // To each neighbour, and to no one else: this rank's flag pages (both write them); to the
    // previous rank also the slots it writes into.
    let my_device_flags = device_flags.ipc_grant()?;
    let my_slots = gpu_slots.ipc_grant()?;
    let setup_for = |p: u32| {
        GpuNeighbourSetup {
            shape: options.shape(),
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
    let alive = || job.check_present();
    let address = |p: u32| job.peers()[p as usize].address.clone();
    let setups = endpoint.exchange(&linked, me, world, &address, &setup_for, &alive, deadline)?;
    let setup_of = |p: u32| -> Result<GpuNeighbourSetup> {
        let bytes = setups.get(&p).ok_or_else(|| Error::Protocol {
            rank: p,
            reason: "sent no GPU setup".into(),
        })?;
        GpuNeighbourSetup::decode(bytes).map_err(|e| Error::Protocol {
            rank: p,
            reason: format!("its GPU setup: {e}"),
        })
    };
    let (theirs, from_prev) = (setup_of(next)?, setup_of(prev)?);
    check_shape(&options.shape(), me, &[(next, &theirs), (prev, &from_prev)])?;
    let (grant, next_shm, next_shm_len) = theirs.slots.clone().ok_or_else(|| Error::Protocol {
        rank: next,
        reason: "sent no slots".into(),
    })?;
    let next_shm_len = usize::try_from(next_shm_len).map_err(|_| Error::Protocol {
        rank: next,
        reason: format!("slots of {next_shm_len} bytes"),
    })?;
    let prev_flags = Flags::open(context, &from_prev.flags, flag::WORDS)?;
    let open_flags = || Flags::open(context, &theirs.flags, flag::WORDS);
    let mut choice = Vec::new();
    let mut out_ipc = None;
    if paths != GpuPaths::Staged {
        match CudaIpcSender::open(context, &grant, open_flags()?, flag::READY) {
            Ok(s) => {
                out_ipc = Some(s);
                choice.push(
                    "direct (cuda-ipc): the next rank's GPU slots are mapped into this GPU"
                        .to_owned(),
                );
            }
            Err(e) if paths == GpuPaths::Auto => choice.push(format!("staged (shm): {e}")),
            Err(e) => return Err(e.into()),
        }
    }
    let out_shm = if paths == GpuPaths::Staged || out_ipc.is_none() {
        match (paths, forced) {
            (GpuPaths::Staged, Some(TransportKind::Shm)) => {
                choice.push("staged (shm): NODETOUR_TRANSPORT=shm".to_owned())
            }
            (GpuPaths::Staged, _) => choice.push("staged (shm): requested".to_owned()),
            _ => {}
        }
        Some(ShmSender::open(
            context,
            &next_shm,
            next_shm_len,
            open_flags()?,
            flag::READY,
        )?)
    } else {
        None
    };
    let mode = u32::from(out_ipc.is_some()) * MODE_IPC + u32::from(out_shm.is_some()) * MODE_SHM;
    // Opened now: the name goes away after the barrier.
    let next_host_flags = open_flags()?;
    next_host_flags.store(flag::MODE, mode)?;
    job.barrier(deadline)?;
    // Every peer has mapped our files and announced its choice: remove the names (nothing is
    // left behind on a crash).
    flags.unlink()?;
    shm_slots.unlink()?;
    let incoming_mode = flags.read(flag::MODE)?;
    if incoming_mode != mode {
        return Err(Error::Unsupported {
            reason: format!(
                "mixed paths in one GPU ring (to rank {next}: {}; from rank {prev}: mode \
                 {incoming_mode}): set NODETOUR_TRANSPORT=shm",
                choice.join("; ")
            ),
        });
    }
    // The host pages carry end notices on every path; the staged path's streams use them for
    // their flags too.
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
                    context,
                    &theirs.device_flags,
                    flag::WORDS,
                )?),
                Arc::new(PeerDeviceFlags::open(
                    context,
                    &from_prev.device_flags,
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
            slots: ipc_slots,
            slot_bytes: ipc_slot_bytes,
            pipeline: options.ipc_pipeline,
            host_read_max: 0,
            copy_kernel_max: options.copy_kernel_max,
            ends: ends.clone(),
            desc_half: 0,
            net: None,
        });
    }
    if let Some(out) = out_shm {
        // Both paths at once only with the direct ring's flags in GPU memory (validated).
        if !host_pages_free {
            return Err(Error::InvalidArgument {
                reason: "the host flag pages are taken by the direct ring".into(),
            });
        }
        rings.push(StreamLinks {
            flags: host_page(&ends.mine),
            next_flags: host_page(&ends.next),
            prev_flags: host_page(&ends.prev),
            outgoing: Outgoing::Shm(out),
            incoming: Incoming::Shm {
                slots: shm_slots,
                scratch: DeviceBuffer::new(context, shm_slot_bytes)?,
            },
            slots: shm_slots_n,
            slot_bytes: shm_slot_bytes,
            pipeline: options.shm_pipeline,
            host_read_max: options.shm_read_max,
            // Host slots: the copy engine (see COPY_KERNEL_MAX).
            copy_kernel_max: 0,
            ends: ends.clone(),
            desc_half: u32::from(!rings.is_empty()),
            net: None,
        });
    }
    let flags_where = if options.device_flags {
        "flags in GPU memory (direct), shared host memory (staged)"
    } else {
        "flags in shared host memory"
    };
    let choice = format!("{}; {flags_where}", choice.join("; "));
    job.barrier(deadline)?;
    let links = rings.pop().ok_or_else(|| Error::Unsupported {
        reason: "no GPU path was built".into(),
    })?;
    let mut ring = GpuRing::new(context, position, world, Some(links))?;
    ring.set_neighbours(prev, next);
    // Each guarded wait gives up at the job's timeout, inside CUDA graphs too.
    ring.set_wait_timeout(timeout);
    ring.set_max_blocks(options.max_blocks);
    // Small allreduces as one kernel, where every rank can map every rank's memory.
    let stop = ring.stop_word().ok_or_else(|| Error::InvalidArgument {
        reason: "a GPU ring with links has a stop word".into(),
    })?;
    let one = super::one_kernel_links::form(super::one_kernel_links::OneKernelSeat {
        job,
        endpoint,
        context,
        me,
        world,
        // The staged path asked for (`NODETOUR_TRANSPORT=shm`, `GpuPaths::Staged`) maps no peer
        // GPU memory: no one-kernel path either.
        mode: if paths == GpuPaths::Staged {
            OneKernelMode::Off
        } else {
            options.one_kernel
        },
        max: options.one_kernel_max,
        timeout,
        stop,
        deadline,
    })?;
    let choice = format!("{choice}; {}", one.reason);
    ring.set_one_kernel(one.kernel, options.one_kernel_max, one.reason);
    tracing::info!(rank = me, path = ring.path(), reason = %choice, "GPU ring formed");
    Ok(FormedGpuRing { ring, choice })
}

/// Ends GPU rings with the teardown handshake: each ring's streams drained and its mappings of
/// the neighbours' memory closed, then a barrier over `job` (or the liveness mesh reporting a
/// rank gone, which counts as closed) says every rank has done the same, and only then is the
/// memory this rank exported freed; past `deadline` it is leaked, never freed under a
/// neighbour's mapping. Every rank of the job calls it.
pub(crate) fn teardown(
    rings: &mut [&mut GpuRing],
    job: &Bootstrap,
    deadline: Deadline,
) -> Result<()> {
    let mut first = None;
    for ring in rings.iter_mut() {
        first = first.or(ring.close_imports(deadline.remaining()).err());
    }
    let handshake = job.barrier(deadline);
    // Without the handshake (a rank is lost, or late past the deadline), each ring frees what
    // it exported only once every neighbour that maps it confirmed its close or is gone (its
    // mappings went with it); a live neighbour that did not confirm may still map it, or write
    // it with credit it already holds: leaked, never freed under it.
    let mut leaked = false;
    for ring in rings.iter_mut() {
        if handshake.is_ok() || ring.neighbours_closed(&|r| job.is_absent(r)) {
            if handshake.is_err() {
                tracing::info!("teardown: every neighbour confirmed its close or is gone: freed");
            }
            first = first.or(ring.close(deadline.remaining()).err());
        } else {
            ring.leak_exports();
            leaked = true;
        }
    }
    match (first, handshake) {
        (Some(e), _) => Err(e),
        (None, Err(e)) if leaked => {
            tracing::error!(error = %e, "the teardown handshake failed: exported slots leaked");
            Err(Error::from(e))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_must_cut_their_links_the_same_way() {
        use nodetour_core::memory::{ShmDir, ShmName};
        use nodetour_core::transport::gpu::IpcGrant;
        let mine = GpuRingOptions::default();
        let setup = |o: &GpuRingOptions| GpuNeighbourSetup {
            shape: o.shape(),
            flags: ShmName::new(ShmDir::Tmpfs, "nodetour-1-0123456789abcdef").unwrap(),
            device_flags: IpcGrant {
                handle: [0; 64],
                offset: 0,
                len: 4096,
            },
            slots: None,
        };
        let same = setup(&mine);
        assert!(check_shape(&mine.shape(), 0, &[(1, &same), (2, &same)]).is_ok());
        let deeper = setup(&GpuRingOptions {
            shm_pipeline: mine.shm_pipeline + 1,
            ..mine
        });
        let e = check_shape(&mine.shape(), 0, &[(1, &same), (2, &deeper)]).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { reason } if reason.contains("rank 2")
                && reason.contains("NODETOUR_SHM_PIPELINE")),
            "{e}"
        );
        for bad in [0, PIPELINE_MAX + 1] {
            let o = GpuRingOptions {
                ipc_pipeline: bad,
                ..mine
            };
            assert!(matches!(o.validate(), Err(Error::InvalidArgument { .. })));
        }
    }

    #[test]
    fn one_kernel_modes_parse_and_thresholds_are_bounded() {
        assert_eq!(OneKernelMode::parse(""), Some(OneKernelMode::Auto));
        assert_eq!(OneKernelMode::parse(" off "), Some(OneKernelMode::Off));
        assert_eq!(OneKernelMode::parse("force"), Some(OneKernelMode::Force));
        assert_eq!(OneKernelMode::parse("on"), None);
        let codes: Vec<u8> = [
            OneKernelMode::Auto,
            OneKernelMode::Off,
            OneKernelMode::Force,
        ]
        .iter()
        .map(|m| m.code())
        .collect();
        assert_eq!(codes, [0, 1, 2]);
        assert!(GpuRingOptions::default().validate().is_ok());
        for max in [0, SLOT_MEMORY_MAX / 2 + 1] {
            let o = GpuRingOptions {
                one_kernel_max: max,
                ..GpuRingOptions::default()
            };
            assert!(matches!(o.validate(), Err(Error::InvalidArgument { .. })));
        }
    }
}

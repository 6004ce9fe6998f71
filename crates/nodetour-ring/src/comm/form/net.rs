//! The GPU ring of a communicator whose ranks span several hosts (issue 15): a **network link**
//! to a neighbour on another host ([`crate::net_link`]: the streams fill and read host slots of
//! this rank, a progress thread carries them over the wire), an in-host link (cuda-ipc where the
//! next GPU's memory maps, else shm) to a neighbour on this host. The ring is ordered by host, so
//! a host's ranks sit side by side and only the links between hosts cross the network.
//!
//! Every link of such a ring uses the same slots (the staged path's count and size: every rank
//! plans the same chunks), and every flag page is in host memory (the progress thread stores
//! into it). What a network neighbour learns: the grant of the slots it writes (the previous
//! rank only) and of its mailbox; the connection is the bootstrap's authenticated tcp.
//! The network link is verbs (RDMA WRITE_WITH_IMM) where the host links to that neighbour chose
//! verbs (both ranks have an RDMA device), else tcp. Over verbs the slots are GPU memory where
//! the registration ladder allows it (the direct path, [`super::net_direct`]: the NIC reads the
//! send slots and writes the receive slots), else registered host memory; over tcp, host
//! memory. `paths()` says which, and why.

use std::sync::Arc;

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::{DeviceBuffer, HostBuffer};
use nodetour_core::transport::gpu::{
    CudaIpcSender, DeviceFlags, FlagPage, Flags, GpuSlot, LinkSlots, ShmSender, ShmSlot,
    StagedReceive,
};
use nodetour_core::transport::setup::{GpuNeighbourSetup, NeighbourSetup};
use nodetour_core::transport::{SlotGrant, SlotRegion, TransportKind};
use nodetour_core::verbs::{Access, LocalSide, MemoryRegion, QueuePairOptions};
use nodetour_core::visibility;

use super::gpu::{FormedGpuRing, Seat};
use super::links::{self, Allocating, Connecting, Prepared};
use super::net_direct::{self, DirectSlots, Ladder};
use super::setups::{self, Conns, Received, missing};
use super::table::Why;
use crate::comm::gpu_options::{GpuPaths, GpuRingOptions, NetLanding, check_shape};
use crate::error::{Error, Result};
use crate::flag;
use crate::gpu_ring::{EndPages, GpuRing, Incoming, Outgoing, StreamLinks, desc_cells};
use crate::net_link::{
    Lander, MAILBOX_BYTES, NetLink, NetLinkSetup, NetOptions, WordPage, receive_depth,
};

const MODE_IPC: u32 = 1;
const MODE_SHM: u32 = 2;

/// Which neighbours share this rank's host, and how the others are reached.
#[derive(Clone, Copy)]
pub(crate) struct Locality<'a> {
    /// The next rank is on this host.
    pub next_local: bool,
    /// The previous rank is on this host.
    pub prev_local: bool,
    /// This rank's RDMA device, where the host links to a network neighbour chose verbs.
    pub verbs: Option<&'a LocalSide>,
    /// The host link kind to the next rank (what a network link to it goes over).
    pub next_over: TransportKind,
    /// The same for the previous rank.
    pub prev_over: TransportKind,
}

/// Host memory for a network link: registered with CUDA where a stream reads or writes it
/// (`context`), and with the RDMA device where a verbs link carries it (remote write only where
/// a neighbour writes it).
fn region(
    len: usize,
    context: Option<&Arc<cudarc::driver::CudaContext>>,
    verbs: Option<&LocalSide>,
    peers_write: bool,
) -> Result<SlotRegion> {
    let mut buf = HostBuffer::new(len.max(4096))?;
    if let Some(c) = context {
        buf.register_with_cuda(c)?;
    }
    Ok(match verbs {
        Some(l) => {
            let access = if peers_write {
                Access::REMOTE
            } else {
                Access::LOCAL
            };
            SlotRegion::registered(Arc::new(MemoryRegion::register(&l.pd, buf, access)?))
        }
        None => SlotRegion::host(buf),
    })
}

/// Lands chunks in GPU slots over a host-landing wire (tcp): each chunk is copied from its host
/// bounce slot into the GPU slot on the link's own stream, which then sets `ready` (so the
/// receive stream's wait sees the copy done). A bounce slot is written again only after the
/// receive stream released the chunk, so after the copy.
struct GpuLander {
    stream: GpuStream,
    bounce: LinkSlots,
    slots: Arc<GpuSlot>,
    mine: Arc<Flags>,
}

impl Lander for GpuLander {
    fn land(&mut self, offset: usize, len: usize, ready: u32) -> nodetour_core::Result<()> {
        self.bounce
            .enqueue_copy_out(&self.stream, self.slots.buffer(), offset, offset, len)?;
        FlagPage::enqueue_set(&*self.mine, &self.stream, flag::READY, ready)
    }
}

/// A page of this rank's that no neighbour maps (an outbox).
fn private_page(context: &Arc<cudarc::driver::CudaContext>) -> Result<Arc<Flags>> {
    let f = Flags::create(context, flag::WORDS)?;
    f.unlink()?;
    Ok(Arc::new(f))
}

/// How the GPU ring reaches a neighbour of this rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    /// An in-host link (cuda-ipc where the next GPU's memory maps, else shm).
    InHost,
    /// A network link over this host link kind (verbs or tcp).
    Network(TransportKind),
}

/// The network ring's plan (pure): each neighbour's side, the slots every link uses (the
/// staged path's count and size: every rank plans the same chunks), and the paths asked for.
struct NetPlan {
    me: u32,
    prev: u32,
    next: u32,
    to_next: Side,
    from_prev: Side,
    slots: u32,
    slot_bytes: usize,
    slot_total: usize,
    paths: GpuPaths,
    landing: NetLanding,
}

impl NetPlan {
    fn new(seat: &Seat<'_>, here: &Locality<'_>, options: &GpuRingOptions) -> Result<NetPlan> {
        let side = |local: bool, over: TransportKind| {
            if local {
                Side::InHost
            } else {
                Side::Network(over)
            }
        };
        let slot_total = (options.slots as usize)
            .checked_mul(options.shm_slot_bytes)
            .ok_or_else(|| Error::InvalidArgument {
                reason: "slots × slot bytes overflows".into(),
            })?;
        Ok(NetPlan {
            me: seat.me,
            prev: seat.prev,
            next: seat.next,
            to_next: side(here.next_local, here.next_over),
            from_prev: side(here.prev_local, here.prev_over),
            slots: options.slots,
            slot_bytes: options.shm_slot_bytes,
            slot_total,
            paths: options.paths_under(seat.forced),
            landing: options.net_landing,
        })
    }

    /// The neighbours (one in a ring of two).
    fn linked(&self) -> Vec<u32> {
        if self.next == self.prev {
            vec![self.next]
        } else {
            vec![self.next, self.prev]
        }
    }

    fn side(&self, p: u32) -> Side {
        if p == self.next {
            self.to_next
        } else {
            self.from_prev
        }
    }

    /// Whether any neighbour is in this host.
    fn any_in_host(&self) -> bool {
        self.to_next == Side::InHost || self.from_prev == Side::InHost
    }

    /// The neighbours reached over the network by `kind`.
    fn network_peers(&self, kind: TransportKind) -> Vec<u32> {
        self.linked()
            .into_iter()
            .filter(|p| self.side(*p) == Side::Network(kind))
            .collect()
    }

    /// Both neighbours are one rank on another host: one connection carries both ways.
    fn same_peer(&self) -> bool {
        self.next == self.prev && self.to_next != Side::InHost
    }
}

/// Where this rank's chunks for a network next rank are sent from, and why.
enum SendFrom {
    /// GPU send slots the NIC reads (the direct path).
    Gpu(DirectSlots),
    /// Host send slots, and why not the direct path.
    Host { slots: SlotRegion, why: Why },
}

/// Where the previous rank's chunks land over the network, and why.
enum RecvInto {
    /// GPU slots the NIC writes, and what makes a landed chunk visible.
    Gpu {
        direct: DirectSlots,
        flush: visibility::Flush,
    },
    /// Host slots (or host bounce slots for GPU landing), and why not the direct path.
    Host { slots: SlotRegion, why: Why },
}

impl SendFrom {
    fn slots(&self) -> SlotRegion {
        match self {
            SendFrom::Gpu(d) => d.slots.clone(),
            SendFrom::Host { slots, .. } => slots.clone(),
        }
    }

    fn said(&self, over: TransportKind) -> String {
        match self {
            SendFrom::Gpu(d) => format!("from GPU send slots the NIC reads: {}", d.said),
            SendFrom::Host { .. } if over == TransportKind::Tcp => "from host send slots".into(),
            SendFrom::Host { why, .. } => format!("from host send slots ({why})"),
        }
    }
}

impl RecvInto {
    fn slots(&self) -> SlotRegion {
        match self {
            RecvInto::Gpu { direct, .. } => direct.slots.clone(),
            RecvInto::Host { slots, .. } => slots.clone(),
        }
    }

    fn said(&self, over: TransportKind, landing: NetLanding) -> String {
        let why = |why: &Why| match over {
            TransportKind::Tcp => String::new(),
            _ => format!(": {why}"),
        };
        match self {
            RecvInto::Gpu { direct, flush } => {
                format!("GPU slots the NIC writes: {}; {flush}", direct.said)
            }
            RecvInto::Host { why: w, .. } if landing == NetLanding::Gpu => format!(
                "GPU slots (through host bounce slots, copied in on the link's stream{})",
                why(w)
            ),
            RecvInto::Host { .. } if over == TransportKind::Tcp => "host slots".into(),
            RecvInto::Host { why, .. } => format!("host slots ({why})"),
        }
    }
}

/// What the allocate step made.
struct NetMemory {
    /// This rank's flag page (the in-host previous rank maps it; the progress thread stores
    /// into it).
    mine: Arc<Flags>,
    /// In-host: what the previous rank writes into (both kinds until it says which it chose)
    /// and the GPU flag page.
    in_host: Option<(GpuSlot, ShmSlot, DeviceFlags)>,
    send: Option<SendFrom>,
    recv: Option<RecvInto>,
    /// One mailbox per network neighbour (one for both in a ring of two).
    box_next: Option<SlotRegion>,
    box_prev: Option<SlotRegion>,
    /// A queue pair per verbs neighbour.
    prepared: Prepared,
}

/// Allocate: the slots, pages and mailboxes `plan` needs. The network slots are GPU memory
/// where the ladder registers it for a verbs link (the direct path), else host memory: the
/// fallback is recorded with its reason (an error under `NODETOUR_GDR=force`).
fn allocate(
    plan: &NetPlan,
    verbs: Option<&LocalSide>,
    context: &Arc<cudarc::driver::CudaContext>,
    config: &nodetour_core::Config,
) -> Result<NetMemory> {
    let total = plan.slot_total;
    let in_host = if plan.any_in_host() {
        Some((
            GpuSlot::new(context, total)?,
            ShmSlot::create(context, total)?,
            DeviceFlags::create(context, flag::WORDS)?,
        ))
    } else {
        None
    };
    let ladder = verbs
        .map(|l| Ladder::gather(context, l, config))
        .transpose()?;
    let mode = config.gdr;
    let direct = |side: &str,
                  allowed: std::result::Result<(), Why>,
                  access: Access|
     -> Result<std::result::Result<DirectSlots, Why>> {
        let why = match (allowed, verbs, &ladder) {
            (Err(why), ..) => why,
            (Ok(()), Some(l), Some(ladder)) => {
                match net_direct::register(ladder, l, context, total, access)? {
                    Ok(direct) => return Ok(Ok(direct)),
                    Err(why) => why,
                }
            }
            (Ok(()), ..) => Why::NoRdmaDevice,
        };
        net_direct::forced(mode, side, &why)?;
        Ok(Err(why))
    };
    let send = match plan.to_next {
        Side::InHost => None,
        Side::Network(over) => {
            let allowed = net_direct::send_side(plan.landing, over, mode);
            Some(
                match direct("the link to the next rank", allowed, Access::LOCAL)? {
                    Ok(d) => SendFrom::Gpu(d),
                    Err(why) => {
                        let slots = region(total, Some(context), verbs, false)?;
                        SendFrom::Host { slots, why }
                    }
                },
            )
        }
    };
    let recv = match plan.from_prev {
        Side::InHost => None,
        Side::Network(over) => {
            let flush = ladder
                .as_ref()
                .map_or_else(|| Err(Why::NoRdmaDevice), |l| l.flush.clone());
            let allowed = net_direct::recv_side(plan.landing, over, mode, &flush);
            let flush = allowed.clone().unwrap_or_else(|_| visibility::host_slots());
            let side = "the link from the previous rank";
            Some(match direct(side, allowed.map(|_| ()), Access::REMOTE)? {
                Ok(direct) => RecvInto::Gpu { direct, flush },
                Err(why) => {
                    let slots = region(total, Some(context), verbs, true)?;
                    RecvInto::Host { slots, why }
                }
            })
        }
    };
    let mailbox = |side: Side| {
        (side != Side::InHost)
            .then(|| region(MAILBOX_BYTES, None, verbs, true))
            .transpose()
    };
    let box_next = mailbox(plan.to_next)?;
    let box_prev = if plan.next == plan.prev {
        box_next.clone()
    } else {
        mailbox(plan.from_prev)?
    };
    Ok(NetMemory {
        mine: Arc::new(Flags::create(context, flag::WORDS)?),
        in_host,
        send,
        recv,
        box_next,
        box_prev,
        prepared: queue_pairs(plan, verbs)?,
    })
}

/// What each network link kind makes for its peers: a queue pair for each verbs neighbour,
/// deep enough for every slot's write.
fn queue_pairs(plan: &NetPlan, verbs: Option<&LocalSide>) -> Result<Prepared> {
    let at = Allocating {
        verbs,
        depth: Some(QueuePairOptions {
            send_depth: 64,
            recv_depth: receive_depth(plan.slots),
            max_inline: 0,
        }),
    };
    links::allocate(&|k| plan.network_peers(k), &at)
}

/// Exchange: to an in-host neighbour its GPU setup (this rank's flag pages; to the previous
/// rank also the slots it writes), to a network neighbour the grants it writes (the receive
/// slots: the previous rank only; its mailbox) and the queue pair made for it.
fn exchange(
    seat: &Seat<'_>,
    plan: &NetPlan,
    memory: &NetMemory,
    options: &GpuRingOptions,
) -> Result<Received> {
    let setup_for = |p: u32| -> Vec<u8> {
        if plan.side(p) == Side::InHost {
            let Some((g, s, d)) = &memory.in_host else {
                return Vec::new();
            };
            let (Ok(dg), Ok(sg)) = (d.ipc_grant(), g.ipc_grant()) else {
                return Vec::new(); // the neighbour refuses an empty setup
            };
            let (shm, len) = s.grant();
            GpuNeighbourSetup {
                shape: options.shape(),
                flags: memory.mine.name().clone(),
                device_flags: dg,
                slots: (p == plan.prev).then_some((sg, shm, len as u64)),
            }
            .encode()
        } else {
            let mailbox = if p == plan.next {
                &memory.box_next
            } else {
                &memory.box_prev
            };
            let recv = memory.recv.as_ref().filter(|_| p == plan.prev);
            NeighbourSetup {
                recv: recv.map(|r| SlotGrant::of(&r.slots())),
                bell: mailbox.as_ref().map(SlotGrant::of),
                endpoint: memory.prepared.get(&p).map(|m| m.endpoint()),
            }
            .encode()
        }
    };
    Received::exchange(
        seat.job,
        seat.endpoint,
        &plan.linked(),
        &setup_for,
        seat.deadline,
    )
}

/// An in-host neighbour's GPU setup, its shape checked against this rank's.
fn in_host_setup(
    received: &Received,
    p: u32,
    me: u32,
    options: &GpuRingOptions,
) -> Result<GpuNeighbourSetup> {
    let s = received.gpu(p)?;
    check_shape(&options.shape(), me, &[(p, &s)])?;
    Ok(s)
}

/// The link to the next rank, connected: how chunks go out, the next rank's flag page (or a
/// private outbox for a network link), its grants (network), and why.
struct ToNext {
    outgoing: Outgoing,
    page: Arc<Flags>,
    grants: Option<(SlotGrant, SlotGrant)>,
    said: String,
}

/// Connect the link to the next rank. In-host: cuda-ipc where the next GPU's slots map (the
/// fallback to shm is recorded with its reason), the choice announced in the next rank's flag
/// page. Network: the grants checked against the agreed shape.
fn connect_next(
    context: &Arc<cudarc::driver::CudaContext>,
    plan: &NetPlan,
    memory: &NetMemory,
    received: &Received,
    options: &GpuRingOptions,
) -> Result<ToNext> {
    let next = plan.next;
    let Side::Network(over) = plan.to_next else {
        let theirs = in_host_setup(received, next, plan.me, options)?;
        let (grant, shm, len) = theirs.slots.clone().ok_or_else(|| missing(next, "slots"))?;
        let len = usize::try_from(len).map_err(|_| Error::Protocol {
            rank: next,
            reason: format!("slots of {len} bytes"),
        })?;
        let page = Arc::new(Flags::open(context, &theirs.flags, flag::WORDS)?);
        let open_flags = || Flags::open(context, &theirs.flags, flag::WORDS);
        let mut said = Vec::new();
        let ipc = match plan.paths {
            GpuPaths::Staged => None,
            paths => match CudaIpcSender::open(context, &grant, open_flags()?, flag::READY) {
                Ok(s) => Some(s),
                Err(e) if paths == GpuPaths::Auto => {
                    said.push(format!("to next: staged (shm): {e}"));
                    None
                }
                Err(e) => return Err(e.into()),
            },
        };
        let (outgoing, mode) = match ipc {
            Some(s) => {
                said.push("to next: direct (cuda-ipc), same host".to_owned());
                (Outgoing::CudaIpc(s), MODE_IPC)
            }
            None => {
                let s = ShmSender::open(context, &shm, len, open_flags()?, flag::READY)?;
                (Outgoing::Shm(s), MODE_SHM)
            }
        };
        page.store(flag::MODE, mode)?;
        let said = said.join("; ");
        return Ok(ToNext {
            outgoing,
            page,
            grants: None,
            said,
        });
    };
    let theirs = received.host(next)?;
    let recv = theirs
        .recv
        .ok_or_else(|| missing(next, "receive-slot grant"))?;
    let recv = setups::at_least(recv, next, "receive slots", plan.slot_total)?;
    let mailbox = theirs.bell.ok_or_else(|| missing(next, "mailbox grant"))?;
    let mailbox = setups::at_least(mailbox, next, "mailbox", MAILBOX_BYTES)?;
    let send = memory.send.as_ref().expect("made for a network next");
    Ok(ToNext {
        outgoing: Outgoing::Net(LinkSlots::new(send.slots())?),
        page: private_page(context)?,
        grants: Some((recv, mailbox)),
        said: format!(
            "to next: network ({over}), rank {next} is on another host, {}",
            send.said(over)
        ),
    })
}

/// The link from the previous rank, as far as the exchange goes: its flag page (or a private
/// outbox for a network link), the mailbox it granted, and why (network).
fn connect_prev(
    context: &Arc<cudarc::driver::CudaContext>,
    plan: &NetPlan,
    memory: &NetMemory,
    received: &Received,
    options: &GpuRingOptions,
) -> Result<(Arc<Flags>, Option<SlotGrant>, Option<String>)> {
    let prev = plan.prev;
    let Side::Network(over) = plan.from_prev else {
        let theirs = in_host_setup(received, prev, plan.me, options)?;
        let page = Arc::new(Flags::open(context, &theirs.flags, flag::WORDS)?);
        return Ok((page, None, None));
    };
    let mailbox = received
        .host(prev)?
        .bell
        .ok_or_else(|| missing(prev, "mailbox grant"))?;
    let mailbox = setups::at_least(mailbox, prev, "mailbox", MAILBOX_BYTES)?;
    let recv = memory.recv.as_ref().expect("made for a network previous");
    let said = format!(
        "from previous: network ({over}) landing in {}, rank {prev} is on another host",
        recv.said(over, plan.landing)
    );
    Ok((private_page(context)?, Some(mailbox), Some(said)))
}

/// Connect the network neighbours (authenticated both ways), each connection starting with
/// what that neighbour may write granted: the receive slots (previous rank) and its mailbox.
/// A write must not reach a queue pair that is not ready yet: every rank has connected before
/// any rank's first collective (the barrier); every in-host neighbour has then mapped what it
/// needs, so the names go.
fn connect_network(
    seat: &Seat<'_>,
    plan: &NetPlan,
    memory: &mut NetMemory,
    received: &Received,
    verbs: Option<&LocalSide>,
    config: &nodetour_core::Config,
) -> Result<Conns> {
    let grants_for = |p: u32| {
        let mut g = Vec::new();
        if p == plan.prev {
            g.extend(memory.recv.as_ref().map(RecvInto::slots));
        }
        let mailbox = if p == plan.next {
            &memory.box_next
        } else {
            &memory.box_prev
        };
        g.extend(mailbox.clone());
        g
    };
    let at = Connecting {
        job: seat.job,
        endpoint: seat.endpoint,
        received,
        verbs,
        config,
        // The connection's waits are the collective's (not the joining deadline's remainder).
        timeout: seat.timeout,
        deadline: seat.deadline,
        grants_for: &grants_for,
    };
    let conns = links::connect(&|k| plan.network_peers(k), &mut memory.prepared, &at)?;
    seat.job.barrier(seat.deadline)?;
    memory.mine.unlink()?;
    if let Some((_, s, _)) = &memory.in_host {
        s.unlink()?;
    }
    Ok(conns)
}

/// How chunks come in, the progress thread's lander, and why (in-host).
type Arrival = (Incoming, Option<Box<dyn Lander>>, Option<String>);

/// How chunks from the previous rank come in: the in-host kind the previous rank announced
/// in this rank's flag page, or the network slots (and the thread's lander where chunks land
/// in GPU memory), and why (in-host; the network's reason was said when it connected).
fn incoming(
    context: &Arc<cudarc::driver::CudaContext>,
    plan: &NetPlan,
    memory: &mut NetMemory,
    verbs: Option<&LocalSide>,
    config: &nodetour_core::Config,
) -> Result<Arrival> {
    if plan.from_prev == Side::InHost {
        let (gpu, shm, _) = memory
            .in_host
            .take()
            .expect("made for an in-host previous rank");
        return match memory.mine.read(flag::MODE)? {
            MODE_IPC => Ok((
                Incoming::CudaIpc(gpu),
                None,
                Some("from previous: direct (cuda-ipc), same host".to_owned()),
            )),
            MODE_SHM => {
                let scratch = DeviceBuffer::new(context, plan.slot_bytes)?;
                Ok((
                    Incoming::Shm {
                        slots: shm,
                        scratch,
                    },
                    None,
                    None,
                ))
            }
            other => Err(Error::Protocol {
                rank: plan.prev,
                reason: format!("announced path {other}"),
            }),
        };
    }
    let recv = memory.recv.as_ref().expect("made for a network previous");
    match recv {
        RecvInto::Gpu { direct, flush } => {
            // The NIC writes the GPU slots: the thread releases each chunk once it is visible.
            let l = verbs.expect("direct slots are registered on the device");
            let page = memory.mine.clone() as Arc<dyn WordPage>;
            let lander = net_direct::lander(flush.method, direct, l, config, context, page)?;
            Ok((
                Incoming::NetDirect(LinkSlots::new(direct.slots.clone())?),
                lander,
                None,
            ))
        }
        RecvInto::Host { slots: bounce, .. } if plan.landing == NetLanding::Gpu => {
            let slots = Arc::new(GpuSlot::new(context, plan.slot_total)?);
            let lander: Box<dyn Lander> = Box::new(GpuLander {
                stream: GpuStream::new(context)?,
                bounce: LinkSlots::new(bounce.clone())?,
                slots: slots.clone(),
                mine: memory.mine.clone(),
            });
            Ok((Incoming::NetGpu(slots), Some(lander), None))
        }
        RecvInto::Host { slots, .. } => {
            let slots = LinkSlots::new(slots.clone())?;
            let scratch = DeviceBuffer::new(context, plan.slot_bytes)?;
            Ok((Incoming::Net { slots, scratch }, None, None))
        }
    }
}

/// Forms the GPU ring of `seat`'s job across hosts (every rank calls it, with the same
/// options, when any link of the ring crosses hosts): plan, allocate, exchange, connect the
/// link to the next rank and from the previous, connect the network, then start the progress
/// thread and the ring.
pub(crate) fn form(
    seat: Seat<'_>,
    here: Locality<'_>,
    options: GpuRingOptions,
    job_config: &nodetour_core::Config,
) -> Result<FormedGpuRing> {
    options.validate()?;
    let context = seat.context;
    let plan = NetPlan::new(&seat, &here, &options)?;
    let verbs = here
        .verbs
        .filter(|_| links::uses_rdma_device(&|k| plan.network_peers(k)));
    let mut memory = allocate(&plan, verbs, context, job_config)?;
    if let Some(RecvInto::Host { why, .. }) = &memory.recv {
        // The mission's own fallback is never silent: on standard error too, as the staged
        // device path says it (a program without a `tracing` subscriber sees this line).
        nodetour_core::notice::warn(format_args!(
            "rank {}: device collectives' chunks from rank {} land in host memory, not in GPU \
             memory (no GPUDirect RDMA on this link): {why}",
            plan.me, plan.prev
        ));
    }
    let received = exchange(&seat, &plan, &memory, &options)?;
    let to_next = connect_next(context, &plan, &memory, &received, &options)?;
    let (prev_page, prev_mailbox, from_prev) =
        connect_prev(context, &plan, &memory, &received, &options)?;
    let mut conns = connect_network(&seat, &plan, &mut memory, &received, verbs, job_config)?;
    let (incoming, lander, in_host_prev) =
        incoming(context, &plan, &mut memory, verbs, job_config)?;
    let said: Vec<String> = [Some(to_next.said.clone()), from_prev, in_host_prev]
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
        .collect();
    let same_peer = plan.same_peer();
    let mine = memory.mine.clone();
    let word = |f: &Arc<Flags>| -> Arc<dyn WordPage> { f.clone() };
    let net = NetLink::start(NetLinkSetup {
        next: plan.next,
        prev: plan.prev,
        to_next: (plan.to_next != Side::InHost)
            .then(|| conns.remove(&plan.next))
            .flatten(),
        to_prev: (plan.from_prev != Side::InHost && !same_peer)
            .then(|| conns.remove(&plan.prev))
            .flatten(),
        same_peer,
        send_slots: memory.send.as_ref().map(SendFrom::slots),
        recv_slots: memory.recv.as_ref().map(RecvInto::slots),
        next_recv: to_next.grants.map(|g| g.0),
        next_mailbox: to_next.grants.map(|g| g.1),
        prev_mailbox,
        mailbox_from_prev: memory
            .box_prev
            .clone()
            .filter(|_| plan.from_prev != Side::InHost),
        mailbox_from_next: memory.box_next.clone(),
        cells: region(MAILBOX_BYTES, None, verbs, false)?,
        slots: plan.slots,
        slot_bytes: plan.slot_bytes,
        mine: word(&mine),
        out_next: word(&to_next.page),
        out_prev: word(&prev_page),
        desc_cells: desc_cells(plan.slots, 0),
        stop_word: flag::STOPPED,
        options: NetOptions::from_config(job_config),
        lander,
    })?;
    let links = stream_links(
        &plan,
        mine,
        to_next.page,
        prev_page,
        to_next.outgoing,
        incoming,
        net,
    );
    seat.job.barrier(seat.deadline)?;
    let choice = format!("{}; flags in host memory", said.join("; "));
    let mut ring = GpuRing::new(context, seat.position, seat.world, Some(links))?;
    ring.set_neighbours(plan.prev, plan.next);
    // Each guarded wait gives up at the job's timeout on the GPU too, as on one host (a
    // progress thread that stalls, or a host that stops polling, cannot hang the streams).
    ring.set_wait_timeout(seat.timeout);
    tracing::info!(rank = plan.me, path = ring.path(), reason = %choice, "GPU ring formed across hosts");
    Ok(FormedGpuRing { ring, choice })
}

/// The stream ring's links of a ring across hosts.
fn stream_links(
    plan: &NetPlan,
    mine: Arc<Flags>,
    next_page: Arc<Flags>,
    prev_page: Arc<Flags>,
    outgoing: Outgoing,
    incoming: Incoming,
    net: NetLink,
) -> StreamLinks {
    let page = |f: &Arc<Flags>| -> Arc<dyn FlagPage> { f.clone() };
    StreamLinks {
        flags: page(&mine),
        next_flags: page(&next_page),
        prev_flags: page(&prev_page),
        outgoing,
        incoming,
        slots: plan.slots,
        slot_bytes: plan.slot_bytes,
        // Whole slots: the progress thread's chunks, measured over tcp and verbs as they are.
        pipeline: 1,
        // Host slots of a network link are copied in (as measured over tcp and verbs).
        host_read_max: 0,
        // Received copies by the copy engine and a credit kernel (the one-kernel copy was
        // measured on cuda-ipc slots only).
        copy_kernel_max: 0,
        ends: EndPages {
            mine,
            next: next_page,
            prev: prev_page,
        },
        desc_half: 0,
        net: Some(net),
    }
}

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

use std::collections::HashMap;
use std::sync::Arc;

use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::{DeviceBuffer, HostBuffer};
use nodetour_core::transport::gpu::{
    CudaIpcSender, DeviceFlags, FlagPage, Flags, GpuSlot, LinkSlots, ShmSender, ShmSlot,
    StagedReceive,
};
use nodetour_core::transport::setup::{GpuNeighbourSetup, NeighbourSetup};
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::transport::{HostConnection, SlotGrant, SlotRegion, TransportKind};
use nodetour_core::verbs::{
    Access, EndpointDescription, LocalSide, MemoryRegion, PathOptions, QueuePairOptions,
};

use super::gpu_links::{FormedGpuRing, GpuPaths, GpuRingOptions, NetLanding, Seat};
use super::net_direct::{self, DirectSlots, Ladder};
use crate::error::{Error, Result};
use crate::flag;
use crate::gpu_ring::{EndPages, GpuRing, Incoming, Outgoing, StreamLinks, desc_cells};
use crate::net_link::{
    Lander, MAILBOX_BYTES, NetLink, NetLinkSetup, NetOptions, WordPage, receive_depth,
};
use nodetour_core::visibility;

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
    /// Which network neighbours the verbs links reach (the others: tcp).
    pub verbs_next: bool,
    /// The same for the previous rank.
    pub verbs_prev: bool,
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

/// Forms the GPU ring of `seat`'s job across hosts (every rank calls it, with the same
/// options, when any link of the ring crosses hosts).
pub(crate) fn form(
    seat: Seat<'_>,
    here: Locality<'_>,
    options: GpuRingOptions,
    job_config: &nodetour_core::Config,
) -> Result<FormedGpuRing> {
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
        // Network rings take no one-kernel path.
        timeout,
    } = seat;
    let Locality {
        next_local,
        prev_local,
        verbs,
        verbs_next,
        verbs_prev,
    } = here;
    let verbs = verbs.filter(|_| (verbs_next && !next_local) || (verbs_prev && !prev_local));
    let over = |p: u32| {
        if (p == next && verbs_next) || (p == prev && verbs_prev) {
            TransportKind::Verbs
        } else {
            TransportKind::Tcp
        }
    };
    let (slots, slot_bytes) = (options.slots, options.shm_slot_bytes);
    let slot_total = slots as usize * slot_bytes;
    let paths = options.paths_under(forced);
    let mine = Arc::new(Flags::create(context, flag::WORDS)?);
    // In-host: what the previous rank writes into (both kinds until it says which it chose).
    let (gpu_slots, shm_slots, device_flags) = if prev_local || next_local {
        (
            Some(GpuSlot::new(context, slot_total)?),
            Some(ShmSlot::create(context, slot_total)?),
            Some(DeviceFlags::create(context, flag::WORDS)?),
        )
    } else {
        (None, None, None)
    };
    // Network: this rank's send slots (the send stream fills them), receive slots, and one
    // mailbox per network neighbour (one for both in a ring of two). The slots are GPU memory
    // where the ladder registers it for a verbs link (the direct path), else host memory.
    let mut choice = Vec::new();
    let mode = job_config.gdr;
    let ladder = verbs
        .map(|l| Ladder::gather(context, l, job_config))
        .transpose()?;
    let direct = |side: &str,
                  allowed: std::result::Result<(), String>,
                  access: Access|
     -> Result<std::result::Result<DirectSlots, String>> {
        let why = match (allowed, verbs, &ladder) {
            (Err(why), ..) => why,
            (Ok(()), Some(l), Some(ladder)) => {
                match net_direct::register(ladder, l, context, slot_total, access)? {
                    Ok(direct) => return Ok(Ok(direct)),
                    Err(why) => why,
                }
            }
            (Ok(()), ..) => "no RDMA device".to_owned(),
        };
        net_direct::forced(mode, side, &why)?;
        Ok(Err(why))
    };
    let send_direct = if next_local {
        None
    } else {
        let allowed = net_direct::send_side(options.net_landing, over(next), mode);
        Some(direct("the link to the next rank", allowed, Access::LOCAL)?)
    };
    let send_slots = match &send_direct {
        None => None,
        Some(Ok(d)) => Some(d.slots.clone()),
        Some(Err(_)) => Some(region(slot_total, Some(context), verbs, false)?),
    };
    let recv_flush = ladder
        .as_ref()
        .map_or_else(|| Err("no RDMA device".to_owned()), |l| l.flush.clone());
    let recv_direct = if prev_local {
        None
    } else {
        let allowed = net_direct::recv_side(options.net_landing, over(prev), mode, &recv_flush);
        let flush = allowed.clone().unwrap_or_else(|_| visibility::host_slots());
        let side = "the link from the previous rank";
        Some(direct(side, allowed.map(|_| ()), Access::REMOTE)?.map(|d| (d, flush)))
    };
    let recv_slots = match &recv_direct {
        None => None,
        Some(Ok((d, _))) => Some(d.slots.clone()),
        Some(Err(_)) => Some(region(slot_total, Some(context), verbs, true)?),
    };
    let box_next = (!next_local)
        .then(|| region(MAILBOX_BYTES, None, verbs, true))
        .transpose()?;
    let box_prev = if next == prev {
        box_next.clone()
    } else {
        (!prev_local)
            .then(|| region(MAILBOX_BYTES, None, verbs, true))
            .transpose()?
    };
    let local = |p: u32| (p == next && next_local) || (p == prev && prev_local);
    let linked: Vec<u32> = if next == prev {
        vec![next]
    } else {
        vec![next, prev]
    };
    // A queue pair for each verbs neighbour, its endpoint sent with the setup.
    let mut prepared: HashMap<u32, (PreparedVerbs, Vec<u8>)> = HashMap::new();
    if let Some(l) = verbs {
        for &p in linked
            .iter()
            .filter(|&&p| !local(p) && over(p) == TransportKind::Verbs)
        {
            let depth = QueuePairOptions {
                send_depth: 64,
                recv_depth: receive_depth(slots),
                max_inline: 0,
            };
            prepared.insert(p, PreparedVerbs::for_peer_with(l, depth)?);
        }
    }
    let setup_for = |p: u32| -> Vec<u8> {
        if local(p) {
            let (Some(g), Some(s), Some(d)) = (&gpu_slots, &shm_slots, &device_flags) else {
                return Vec::new();
            };
            let (Ok(dg), Ok(sg)) = (d.ipc_grant(), g.ipc_grant()) else {
                return Vec::new(); // the neighbour refuses an empty setup
            };
            let (shm, len) = s.grant();
            GpuNeighbourSetup {
                shape: options.shape(),
                flags: mine.name().clone(),
                device_flags: dg,
                slots: (p == prev).then_some((sg, shm, len as u64)),
            }
            .encode()
        } else {
            let mailbox = if p == next { &box_next } else { &box_prev };
            NeighbourSetup {
                recv: (p == prev)
                    .then(|| recv_slots.as_ref().map(SlotGrant::of))
                    .flatten(),
                bell: mailbox.as_ref().map(SlotGrant::of),
                endpoint: prepared.get(&p).map(|(_, e)| e.clone()),
            }
            .encode()
        }
    };
    let alive = || job.check_present();
    let address = |p: u32| job.peers()[p as usize].address.clone();
    let setups = endpoint.exchange(&linked, me, world, &address, &setup_for, &alive, deadline)?;
    let bytes_of = |p: u32| -> Result<&Vec<u8>> {
        setups.get(&p).ok_or_else(|| Error::Protocol {
            rank: p,
            reason: "sent no GPU setup".into(),
        })
    };
    let in_host = |p: u32| -> Result<GpuNeighbourSetup> {
        let s = GpuNeighbourSetup::decode(bytes_of(p)?).map_err(|e| Error::Protocol {
            rank: p,
            reason: format!("its GPU setup: {e}"),
        })?;
        super::gpu_links::check_shape(&options.shape(), me, &[(p, &s)])?;
        Ok(s)
    };
    let network = |p: u32| -> Result<NeighbourSetup> {
        NeighbourSetup::decode(bytes_of(p)?).map_err(|e| Error::Protocol {
            rank: p,
            reason: format!("its network setup: {e}"),
        })
    };
    let missing = |p: u32, what: &str| Error::Protocol {
        rank: p,
        reason: format!("sent no {what}"),
    };
    // To the next rank.
    let (outgoing, next_page, next_grants): (Outgoing, Arc<Flags>, Option<(SlotGrant, SlotGrant)>) =
        if next_local {
            let theirs = in_host(next)?;
            let (grant, shm, len) = theirs.slots.clone().ok_or_else(|| missing(next, "slots"))?;
            let len = usize::try_from(len).map_err(|_| Error::Protocol {
                rank: next,
                reason: format!("slots of {len} bytes"),
            })?;
            let page = Arc::new(Flags::open(context, &theirs.flags, flag::WORDS)?);
            let open_flags = || Flags::open(context, &theirs.flags, flag::WORDS);
            let ipc = if paths == GpuPaths::Staged {
                None
            } else {
                match CudaIpcSender::open(context, &grant, open_flags()?, flag::READY) {
                    Ok(s) => Some(s),
                    Err(e) if paths == GpuPaths::Auto => {
                        choice.push(format!("to next: staged (shm): {e}"));
                        None
                    }
                    Err(e) => return Err(e.into()),
                }
            };
            let (out, mode) = match ipc {
                Some(s) => {
                    choice.push("to next: direct (cuda-ipc), same host".to_owned());
                    (Outgoing::CudaIpc(s), MODE_IPC)
                }
                None => (
                    Outgoing::Shm(ShmSender::open(
                        context,
                        &shm,
                        len,
                        open_flags()?,
                        flag::READY,
                    )?),
                    MODE_SHM,
                ),
            };
            page.store(flag::MODE, mode)?;
            (out, page, None)
        } else {
            let theirs = network(next)?;
            let recv = theirs
                .recv
                .ok_or_else(|| missing(next, "receive-slot grant"))?;
            let mailbox = theirs.bell.ok_or_else(|| missing(next, "mailbox grant"))?;
            if (recv.len as usize) < slot_total || (mailbox.len as usize) < MAILBOX_BYTES {
                return Err(Error::Protocol {
                    rank: next,
                    reason: format!(
                        "granted {} bytes of slots and {} of mailbox, the ring needs {slot_total} \
                         and {MAILBOX_BYTES}",
                        recv.len, mailbox.len
                    ),
                });
            }
            let slots = LinkSlots::new(send_slots.clone().expect("made for a network next"))?;
            choice.push(format!(
                "to next: network ({}), rank {next} is on another host, {}",
                over(next),
                match &send_direct {
                    Some(Ok(d)) => format!("from GPU send slots the NIC reads: {}", d.said),
                    Some(Err(_)) if over(next) == TransportKind::Tcp => {
                        "from host send slots".to_owned()
                    }
                    Some(Err(why)) => format!("from host send slots ({why})"),
                    None => unreachable!("a network next has send slots"),
                }
            ));
            (
                Outgoing::Net(slots),
                private_page(context)?,
                Some((recv, mailbox)),
            )
        };
    // From the previous rank.
    let (prev_page, prev_mailbox) = if prev_local {
        let theirs = in_host(prev)?;
        (
            Arc::new(Flags::open(context, &theirs.flags, flag::WORDS)?),
            None,
        )
    } else {
        let theirs = network(prev)?;
        let mailbox = theirs.bell.ok_or_else(|| missing(prev, "mailbox grant"))?;
        if (mailbox.len as usize) < MAILBOX_BYTES {
            return Err(Error::Protocol {
                rank: prev,
                reason: format!("a mailbox of {} bytes", mailbox.len),
            });
        }
        let landing = match (&recv_direct, options.net_landing) {
            (Some(Ok((d, flush))), _) => format!("GPU slots the NIC writes: {}; {flush}", d.said),
            (Some(Err(why)), NetLanding::Gpu) => {
                let why = if over(prev) == TransportKind::Tcp {
                    String::new()
                } else {
                    format!(": {why}")
                };
                format!(
                    "GPU slots (through host bounce slots, copied in on the link's stream{why})"
                )
            }
            (Some(Err(_)), _) if over(prev) == TransportKind::Tcp => "host slots".to_owned(),
            (Some(Err(why)), _) => format!("host slots ({why})"),
            (None, _) => unreachable!("a network previous has receive slots"),
        };
        choice.push(format!(
            "from previous: network ({}) landing in {landing}, rank {prev} is on another host",
            over(prev),
        ));
        (private_page(context)?, Some(mailbox))
    };
    // The network neighbours' connections (authenticated both ways), each starting with what
    // that neighbour may write granted: the receive slots (previous rank) and its mailbox.
    let net_peers: Vec<u32> = linked
        .iter()
        .copied()
        .filter(|&p| !local(p) && over(p) == TransportKind::Tcp)
        .collect();
    let grants_for = |p: u32| {
        let mut g = Vec::new();
        if p == prev && !prev_local {
            g.extend(recv_slots.clone());
        }
        let mailbox = if p == next { &box_next } else { &box_prev };
        g.extend(mailbox.clone());
        g
    };
    let mut conns: HashMap<u32, Box<dyn HostConnection>> = endpoint
        .connect_mesh(
            &net_peers,
            me,
            world,
            &address,
            &grants_for,
            &alive,
            deadline,
        )?
        .into_iter()
        .map(|(p, c)| (p, Box::new(c) as Box<dyn HostConnection>))
        .collect();
    for (p, (q, _)) in prepared.drain() {
        let l = verbs.expect("queue pairs are made on the device");
        let sent = network(p)?
            .endpoint
            .ok_or_else(|| missing(p, "queue pair"))?;
        let remote = EndpointDescription::decode(&sent)
            .map_err(|e| Error::Protocol {
                rank: p,
                reason: format!("its queue pair: {e}"),
            })?
            .endpoint;
        let path = PathOptions::new(l.port.port, &l.gid, job_config);
        let c = q.connect(&remote, &path, format!("rank {p}"), deadline.remaining())?;
        conns.insert(p, Box::new(c));
    }
    // A write must not reach a queue pair that is not ready yet: every rank has connected
    // before any rank's first collective.
    job.barrier(deadline)?;
    // Every in-host neighbour has mapped what it needs: the names go.
    mine.unlink()?;
    if let Some(s) = &shm_slots {
        s.unlink()?;
    }
    let mut lander: Option<Box<dyn Lander>> = None;
    let incoming = if prev_local {
        match mine.read(flag::MODE)? {
            MODE_IPC => {
                choice.push("from previous: direct (cuda-ipc), same host".to_owned());
                Incoming::CudaIpc(gpu_slots.expect("made for an in-host previous rank"))
            }
            MODE_SHM => Incoming::Shm {
                slots: shm_slots.expect("made for an in-host previous rank"),
                scratch: DeviceBuffer::new(context, slot_bytes)?,
            },
            other => {
                return Err(Error::Protocol {
                    rank: prev,
                    reason: format!("announced path {other}"),
                });
            }
        }
    } else if let Some(Ok((direct, flush))) = &recv_direct {
        // The NIC writes the GPU slots: the thread releases each chunk once it is visible.
        let l = verbs.expect("direct slots are registered on the device");
        let page = mine.clone() as Arc<dyn WordPage>;
        lander = net_direct::lander(flush.method, direct, l, job_config, context, page)?;
        Incoming::NetDirect(LinkSlots::new(direct.slots.clone())?)
    } else if options.net_landing == NetLanding::Gpu {
        let slots = Arc::new(GpuSlot::new(context, slot_total)?);
        lander = Some(Box::new(GpuLander {
            stream: GpuStream::new(context)?,
            bounce: LinkSlots::new(recv_slots.clone().expect("made for a network previous"))?,
            slots: slots.clone(),
            mine: mine.clone(),
        }));
        Incoming::NetGpu(slots)
    } else {
        Incoming::Net {
            slots: LinkSlots::new(recv_slots.clone().expect("made for a network previous"))?,
            scratch: DeviceBuffer::new(context, slot_bytes)?,
        }
    };
    let same_peer = next == prev && !next_local;
    let to_next = (!next_local).then(|| conns.remove(&next)).flatten();
    let to_prev = (!prev_local && !same_peer)
        .then(|| conns.remove(&prev))
        .flatten();
    let word = |f: &Arc<Flags>| -> Arc<dyn WordPage> { f.clone() };
    let cells = desc_cells(slots, 0);
    let net = NetLink::start(NetLinkSetup {
        next,
        prev,
        to_next,
        to_prev,
        same_peer,
        send_slots,
        recv_slots: (!prev_local).then_some(recv_slots).flatten(),
        next_recv: next_grants.map(|g| g.0),
        next_mailbox: next_grants.map(|g| g.1),
        prev_mailbox,
        mailbox_from_prev: if prev_local { None } else { box_prev },
        mailbox_from_next: box_next,
        cells: region(MAILBOX_BYTES, None, verbs, false)?,
        slots,
        slot_bytes,
        mine: word(&mine),
        out_next: word(&next_page),
        out_prev: word(&prev_page),
        desc_cells: cells,
        stop_word: flag::STOPPED,
        options: NetOptions::from_config(job_config),
        lander,
    })?;
    let page = |f: &Arc<Flags>| -> Arc<dyn FlagPage> { f.clone() };
    let links = StreamLinks {
        flags: page(&mine),
        next_flags: page(&next_page),
        prev_flags: page(&prev_page),
        outgoing,
        incoming,
        slots,
        slot_bytes,
        // Whole slots: the progress thread's chunks, measured over tcp and verbs as they are.
        pipeline: 1,
        // Host slots of a network link are copied in (as measured over tcp and verbs).
        host_read_max: 0,
        // Received copies by the copy engine and a credit kernel (the one-kernel copy was
        // measured on cuda-ipc slots only).
        copy_kernel_max: 0,
        ends: EndPages {
            mine: mine.clone(),
            next: next_page,
            prev: prev_page,
        },
        desc_half: 0,
        net: Some(net),
    };
    job.barrier(deadline)?;
    let choice = format!("{}; flags in host memory", choice.join("; "));
    let mut ring = GpuRing::new(context, position, world, Some(links))?;
    ring.set_neighbours(prev, next);
    // Each guarded wait gives up at the job's timeout on the GPU too, as on one host (a
    // progress thread that stalls, or a host that stops polling, cannot hang the streams).
    ring.set_wait_timeout(timeout);
    tracing::info!(rank = me, path = ring.path(), reason = %choice, "GPU ring formed across hosts");
    Ok(FormedGpuRing { ring, choice })
}

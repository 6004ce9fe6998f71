//! The host ring's formation, step by step: announce (the bootstrap: where to reach this
//! rank, what it can link with and the settings every rank must share), plan (pure:
//! [`super::plan`]), allocate (the regions and queue pairs the plan asks for), exchange (each
//! neighbour's grants and endpoint, checked against the agreed shape), connect.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::Deadline;
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::setup::NeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{MemConnection, SlotGrant, SlotRegion, TransportKind};
use nodetour_core::verbs::{Access, LocalSide, MemoryRegion, Near};
use nodetour_net::bootstrap::{Bootstrap, HostIdentity, PeerEntry};

use super::links::{self, Allocating, Connecting, Prepared};
use super::plan::{Facts, RingPlan, address_book};
use super::setups::{self, Conns, Received};
use crate::comm::host_job::Launch;
use crate::comm::links::Announcement;
use crate::comm::options::Options;
use crate::error::{Error, Result};
use crate::host::{BELL_BYTES, HostRingOptions};

/// A rank that has joined its job: the bootstrap, its authenticated endpoint, and the
/// formation deadline.
pub(crate) struct Joined {
    pub job: Bootstrap,
    pub endpoint: TcpEndpoint,
    pub deadline: Deadline,
    /// This rank's RDMA device for host memory, or why it has none.
    pub verbs: std::result::Result<LocalSide, String>,
}

/// Opens this rank's RDMA device for host memory, unless the links are forced to tcp; `Err`
/// says why there is none.
fn open_verbs(options: &Options, rank: u32) -> std::result::Result<LocalSide, String> {
    let config = verbs_config(options, rank).ok_or("NODETOUR_TRANSPORT=tcp")?;
    LocalSide::open(&config, Near::Host).map_err(|e| e.to_string())
}

/// The settings this rank opens its RDMA device with (the device `NODETOUR_IB_DEVICES` names
/// for it), or `None` where the links are forced to tcp.
pub(crate) fn verbs_config(options: &Options, rank: u32) -> Option<nodetour_core::Config> {
    if options.transport == Some(TransportKind::Tcp) {
        return None;
    }
    let mut config = options.config.clone();
    if !options.devices.is_empty() {
        config.ib_device = Some(options.devices[rank as usize % options.devices.len()].clone());
    }
    Some(config)
}

/// Announce: joins `launch`'s job. The bootstrap, which every rank hears, carries no key and
/// no queue pair: where to reach this rank and what it can link with. What only a neighbour
/// may use goes to that neighbour alone (the exchange step). Each rank receives every other
/// rank's address ([`address_book`]: no secret; a point-to-point link may join any two).
pub(crate) fn announce(launch: &Launch, options: &Options) -> Result<Joined> {
    let (me, world) = (launch.rank, launch.world);
    // Joining has its own, longer budget (ranks of a job start tens of seconds apart); the
    // endpoint's connections carry collectives, so their I/O waits take the collective's.
    let timeout = options.timeout();
    let deadline = Deadline::after(options.join_timeout());
    let verbs = open_verbs(options, me);
    let ours = Announcement::ours(
        options.transport,
        verbs.is_ok(),
        options.gpu.map(|g| g as u32),
        options.must_agree(),
    );
    let endpoint = TcpEndpoint::bind("0.0.0.0:0", launch.token.clone(), timeout)?;
    let rendezvous = launch.rendezvous.as_str();
    let (host, port) = rendezvous.rsplit_once(':').unwrap_or((rendezvous, "0"));
    let ip = nodetour_net::bootstrap::host::local_ip_towards(host, port.parse().unwrap_or(0));
    let entry = PeerEntry {
        rank: me,
        host: HostIdentity::current(),
        address: format!("{ip}:{}", endpoint.local_addr()?.port()),
        blob: ours.encode(),
    };
    let share = |table: &[PeerEntry]| -> Vec<Vec<u32>> { address_book(table.len()) };
    let job = Bootstrap::rendezvous_sharing(
        rendezvous,
        me,
        world,
        entry,
        &launch.token,
        deadline,
        Some(&share),
    )?;
    Ok(Joined {
        job,
        endpoint,
        deadline,
        verbs,
    })
}

/// Plan: every rank's announcement and host, decoded, through [`RingPlan::new`].
pub(crate) fn plan(joined: &Joined, options: &Options, gpu: bool) -> Result<RingPlan> {
    let peers = joined.job.peers();
    let announced = peers
        .iter()
        .map(|p| Announcement::decode(p.rank, &p.blob))
        .collect::<Result<Vec<_>>>()?;
    let hosts: Vec<&HostIdentity> = peers.iter().map(|p| &p.host).collect();
    let plan = RingPlan::new(&Facts {
        me: joined.job.rank(),
        announced: &announced,
        hosts: &hosts,
        why_no_verbs: joined.verbs.as_ref().err().map_or("", String::as_str),
        forced: options.transport,
        gpu,
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
    })?;
    if let Some((local_ranks, cpus)) = plan.oversubscribed {
        // Spinning on a CPU only pays where every rank of this host has one: with more ranks
        // than CPUs a spinning rank would take the CPU a neighbour needs to answer it, so the
        // ring's spin gives its CPU away after each look (as MPI yields when oversubscribed),
        // and the verbs waits of this process (a per-process setting) do not spin at all.
        tracing::info!(
            local_ranks,
            cpus,
            "more ranks than CPUs on this host: the ring yields its CPU while it spins"
        );
        nodetour_core::verbs::set_spin(std::time::Duration::ZERO);
    }
    Ok(plan)
}

/// The host ring's running options under `plan`.
pub(crate) fn ring_options(plan: &RingPlan, options: &Options) -> HostRingOptions {
    HostRingOptions {
        slot_bytes: options.slot_bytes,
        slots: options.slots,
        timeout: options.timeout(),
        spin: options.config.ring_spin,
        spin_yields: plan.oversubscribed.is_some(),
    }
}

/// What the allocate step made: the regions (each exactly as long as asked: the receive
/// slots are what the previous rank is granted, no more), the RDMA device where a verbs link
/// uses it, and a queue pair per verbs neighbour.
pub(crate) struct HostMemory {
    /// The slots the previous rank writes (remote write).
    pub recv: SlotRegion,
    /// The doorbell the next rank writes grants into (remote write, strict).
    pub bell: SlotRegion,
    /// The staging region (a send source: local only).
    pub work: SlotRegion,
    /// The RDMA device, where a link of the plan is verbs (least privilege: else none).
    pub local: Option<LocalSide>,
    /// A queue pair per verbs neighbour.
    pub prepared: Prepared,
}

/// Allocate: the regions and queue pairs `plan` needs. With `pin`, the regions are also
/// registered with CUDA under that context (pinned for the staged GPU path's copies).
pub(crate) fn allocate(
    plan: &RingPlan,
    verbs: std::result::Result<LocalSide, String>,
    options: &Options,
    pin: Option<&Arc<CudaContext>>,
) -> Result<HostMemory> {
    let peers_over = |k| plan.peers_over(k);
    let local = verbs.ok().filter(|_| links::uses_rdma_device(&peers_over));
    let region = |len: usize, access: Access| -> Result<SlotRegion> {
        let mut buf = HostBuffer::new(len.max(1))?;
        if let Some(context) = pin {
            buf.register_with_cuda(context)?;
        }
        Ok(match &local {
            Some(l) => {
                SlotRegion::registered(Arc::new(MemoryRegion::register(&l.pd, buf, access)?))
            }
            None => SlotRegion::host(buf),
        })
    };
    let recv = region(slot_total(options)?, Access::REMOTE)?;
    let bell = region(4096, Access::REMOTE_STRICT)?;
    let work = region(options.piece_bytes, Access::LOCAL)?;
    let at = Allocating {
        verbs: local.as_ref(),
        depth: None,
    };
    let prepared = links::allocate(&peers_over, &at)?;
    Ok(HostMemory {
        recv,
        bell,
        work,
        local,
        prepared,
    })
}

/// Slots × slot bytes, overflow-checked.
fn slot_total(options: &Options) -> Result<usize> {
    (options.slots as usize)
        .checked_mul(options.slot_bytes)
        .ok_or_else(|| Error::InvalidArgument {
            reason: "slots × slot bytes overflows".into(),
        })
}

/// What the neighbours granted: the receive slots of the next rank (exactly the agreed
/// shape) and the doorbell of the previous rank (holding the notices).
pub(crate) struct HostGrants {
    pub next_slots: SlotGrant,
    pub prev_slots: SlotGrant,
    pub received: Received,
}

/// Exchange: to the previous rank the receive slots it writes, to the next the doorbell it
/// writes grants into, and to each the queue pair made for it.
pub(crate) fn exchange(
    joined: &Joined,
    plan: &RingPlan,
    memory: &HostMemory,
    options: &Options,
) -> Result<HostGrants> {
    let (prev, next) = (plan.prev, plan.next);
    let setup_for = |p: u32| {
        NeighbourSetup {
            recv: (p == prev).then(|| SlotGrant::of(&memory.recv)),
            bell: (p == next).then(|| SlotGrant::of(&memory.bell)),
            endpoint: memory.prepared.get(&p).map(|m| m.endpoint()),
        }
        .encode()
    };
    let (job, endpoint) = (&joined.job, &joined.endpoint);
    let received = Received::exchange(job, endpoint, &plan.linked(), &setup_for, joined.deadline)?;
    if plan.world == 1 {
        let (next_slots, prev_slots) = (SlotGrant::of(&memory.recv), SlotGrant::of(&memory.bell));
        return Ok(HostGrants {
            next_slots,
            prev_slots,
            received,
        });
    }
    // The shapes were compared in the plan: a grant of another size is a peer that breaks the
    // protocol.
    let next_slots = received
        .host(next)?
        .recv
        .ok_or_else(|| setups::missing(next, "receive-slot grant"))?;
    let shape = format!("receive slots ({} × {})", options.slots, options.slot_bytes);
    let next_slots = setups::exactly(next_slots, next, &shape, slot_total(options)?)?;
    let prev_slots = received
        .host(prev)?
        .bell
        .ok_or_else(|| setups::missing(prev, "doorbell grant"))?;
    let prev_slots = setups::at_least(prev_slots, prev, "doorbell", BELL_BYTES)?;
    Ok(HostGrants {
        next_slots,
        prev_slots,
        received,
    })
}

/// Connect: each host link kind's connections (a queue pair for each verbs neighbour, a tcp
/// connection starting with what that neighbour may write granted), and for one rank a
/// loopback link that carries nothing (its plans have no sends), so that its collectives run
/// through the same code. A verbs write must not reach a queue pair that is not ready yet:
/// every rank has connected every link before any rank's first collective (the barrier).
pub(crate) fn connect(
    joined: &Joined,
    plan: &RingPlan,
    memory: &mut HostMemory,
    grants: &HostGrants,
    options: &Options,
) -> Result<(Conns, Option<MemConnection>)> {
    let (prev, next) = (plan.prev, plan.next);
    let (recv, bell) = (&memory.recv, &memory.bell);
    let grants_for = |p: u32| {
        let mut g = Vec::new();
        if p == prev {
            g.push(recv.clone());
        }
        if p == next {
            g.push(bell.clone());
        }
        g
    };
    let at = Connecting {
        job: &joined.job,
        endpoint: &joined.endpoint,
        received: &grants.received,
        verbs: memory.local.as_ref(),
        config: &options.config,
        timeout: options.timeout(),
        deadline: joined.deadline,
        grants_for: &grants_for,
    };
    let mut conns = links::connect(&|k| plan.peers_over(k), &mut memory.prepared, &at)?;
    let mut loopback = None;
    if plan.world == 1 {
        let (a, b) = MemConnection::pair();
        conns.insert(plan.me, Box::new(a));
        loopback = Some(b);
    } else {
        joined.job.barrier(joined.deadline)?;
    }
    Ok((conns, loopback))
}

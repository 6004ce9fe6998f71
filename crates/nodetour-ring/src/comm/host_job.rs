//! The host-memory ring of a communicator: formation (bootstrap, ring order by host, one link
//! per neighbour of the kind both ends choose, registered slot, doorbell and staging regions)
//! and the running of one ring collective over it, with the sequence number and the early
//! notifications carried from one to the next.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::one_kernel::ONE_SHOT_MAX_RANKS;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::{DeviceBuffer, HostBuffer};
use nodetour_core::transport::setup::NeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::transport::{HostConnection, SlotGrant, SlotRegion, TransportKind};
use nodetour_core::verbs::{
    Access, EndpointDescription, LocalSide, MemoryRegion, Near, PathOptions,
};
use nodetour_net::bootstrap::{Bootstrap, HostIdentity, JobToken, PeerEntry};

use super::links::Announcement;
use super::options::Options;
use super::paths::{DevicePath, Direction, LinkPath, Paths};
use super::table::{self, Pair};
use crate::cause::CauseKind;
use crate::error::{Error, Result};
use crate::gpu_ring::GpuRing;
use crate::host::{BELL_BYTES, GpuStaging, HostRing, HostRingOptions, Links};
use crate::order::{neighbours, ring_order};

/// Where and how this process joins its job.
pub(crate) struct Launch {
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// Rank 0's rendezvous, `host:port`.
    pub rendezvous: String,
    /// The job token (authenticates every connection, both ways).
    pub token: JobToken,
}

/// The abort flag a communicator shares with its [`super::AbortHandle`]s.
pub(crate) type AbortFlag = Arc<Mutex<Option<String>>>;

/// A formed host ring.
pub(crate) struct HostJob {
    // Drop order (fields drop in declaration order): links (queue pairs drained and destroyed,
    // sockets closed) before the regions they may write, regions before the device, the
    // bootstrap last. The GPU ring is closed (its teardown handshake) before the job drops.
    conns: HashMap<u32, Box<dyn HostConnection>>,
    recv: SlotRegion,
    work: SlotRegion,
    bell: SlotRegion,
    next_slots: SlotGrant,
    prev_slots: SlotGrant,
    options: HostRingOptions,
    backlog: Vec<u32>,
    owed: Vec<u8>,
    seq: u64,
    host_gather_max: usize,
    gpu: Option<GpuSide>,
    /// The GPU ring of a one-host job with a GPU on every rank (device collectives).
    pub gpu_ring: Option<GpuRing>,
    _loopback: Option<nodetour_core::transport::MemConnection>,
    _local: Option<LocalSide>,
    pub rank: u32,
    pub world: u32,
    pub neighbours: (u32, u32),
    pub order: Vec<u32>,
    pub paths: Paths,
    pub job: Bootstrap,
}

/// The GPU side of the staged path: kernels and one slot of scratch (the stream is the caller's).
struct GpuSide {
    scratch: DeviceBuffer,
    kernels: ReduceKernels,
}

/// Opens this rank's RDMA device for host memory, unless the links are forced to tcp; `Err`
/// says why there is none.
fn open_verbs(options: &Options, rank: u32) -> std::result::Result<LocalSide, String> {
    if options.transport == Some(TransportKind::Tcp) {
        return Err("NODETOUR_TRANSPORT=tcp".into());
    }
    let mut config = options.config.clone();
    if !options.devices.is_empty() {
        config.ib_device = Some(options.devices[rank as usize % options.devices.len()].clone());
    }
    LocalSide::open(&config, Near::Host).map_err(|e| e.to_string())
}

impl HostJob {
    /// Forms the ring of `launch`'s job. With `pin`, the slot and staging regions are also
    /// registered with CUDA under that context (pinned for the staged GPU path's copies).
    pub(super) fn form(
        launch: Launch,
        options: &Options,
        pin: Option<&Arc<cudarc::driver::CudaContext>>,
    ) -> Result<HostJob> {
        options.validate()?;
        let Launch {
            rank: me,
            world,
            rendezvous,
            token,
        } = launch;
        let timeout = options.timeout();
        let deadline = Deadline::after(timeout);
        let verbs = open_verbs(options, me);
        let why_no_verbs = verbs.as_ref().err().cloned().unwrap_or_default();
        let ours = Announcement::ours(
            options.transport,
            verbs.is_ok(),
            options.gpu.map(|g| g as u32),
            options.must_agree(),
        );
        let endpoint = TcpEndpoint::bind("0.0.0.0:0", token.clone(), timeout)?;
        let (host, port) = rendezvous
            .rsplit_once(':')
            .unwrap_or((rendezvous.as_str(), "0"));
        let ip = nodetour_net::bootstrap::host::local_ip_towards(host, port.parse().unwrap_or(0));
        // The bootstrap, which every rank hears, carries no key and no queue pair: where to
        // reach this rank and what it can link with. What only a neighbour may use goes to that
        // neighbour alone (TcpEndpoint::exchange, authenticated both ways).
        let entry = PeerEntry {
            rank: me,
            host: HostIdentity::current(),
            address: format!("{ip}:{}", endpoint.local_addr()?.port()),
            blob: ours.encode(),
        };
        // Each rank receives the addresses of its ring neighbours only (rank 0 orders the ring
        // as every rank does below); every rank's host and announcement reach everyone. The
        // exception: a job of GPU ranks all on one host, small enough for the one-kernel path
        // (`one_kernel_links`), where every rank exchanges its scratch with every rank.
        let share = |table: &[PeerEntry]| -> Vec<Vec<u32>> {
            let keys: Vec<&str> = table.iter().map(|p| p.host.boot_id.as_str()).collect();
            let order = ring_order(&keys);
            let one_host = table.iter().all(|p| p.host.same_host(&table[0].host));
            let all_gpus = table
                .iter()
                .all(|p| Announcement::decode(p.rank, &p.blob).is_ok_and(|a| a.gpu.is_some()));
            let n = table.len() as u32;
            if one_host && all_gpus && (2..=ONE_SHOT_MAX_RANKS as u32).contains(&n) {
                return (0..n)
                    .map(|r| (0..n).filter(|p| *p != r).collect())
                    .collect();
            }
            (0..n)
                .map(|r| neighbours(&order, r).map_or(vec![], |(p, n)| vec![p, n]))
                .collect()
        };
        let job = Bootstrap::rendezvous_sharing(
            &rendezvous,
            me,
            world,
            entry,
            &token,
            deadline,
            Some(&share),
        )?;
        // The settings that shape chunks or choose algorithms, against every rank's: every rank
        // hears every announcement, so a rank that differs fails formation on every rank, here,
        // naming the setting and both values (not a protocol error after a collective ran).
        for p in job.peers() {
            let theirs = Announcement::decode(p.rank, &p.blob)?;
            super::options::check_agreement(&ours.settings, &theirs.settings, p.rank)?;
        }
        let keys: Vec<&str> = job
            .peers()
            .iter()
            .map(|p| p.host.boot_id.as_str())
            .collect();
        let order = ring_order(&keys);
        let (prev, next) = neighbours(&order, me).ok_or_else(|| Error::InvalidArgument {
            reason: format!("rank {me} is not in the ring order"),
        })?;
        let linked: Vec<u32> = if world == 1 {
            vec![]
        } else if next == prev {
            vec![next]
        } else {
            vec![next, prev]
        };
        // Each link's kind, from both ends' announcements.
        let mut kinds: HashMap<u32, TransportKind> = HashMap::new();
        let mut links = Vec::new();
        for p in linked.iter().copied() {
            let theirs = Announcement::decode(p, &job.peers()[p as usize].blob)?;
            let (kind, landing, reason) = table::host_link(&Pair {
                ours: (&ours, me),
                theirs: (&theirs, p),
                same_host: job.peers()[me as usize]
                    .host
                    .same_host(&job.peers()[p as usize].host),
                why_no_verbs: &why_no_verbs,
            })?;
            kinds.insert(p, kind);
            let direction = if next == prev {
                Direction::Both
            } else if p == next {
                Direction::Next
            } else {
                Direction::Prev
            };
            links.push(LinkPath {
                peer: p,
                direction,
                transport: kind,
                landing,
                reason,
            });
        }
        // Registered with the device only where a verbs link writes them (least privilege).
        let local = verbs
            .ok()
            .filter(|_| kinds.values().any(|k| *k == TransportKind::Verbs));
        // Spinning on a CPU only pays where every rank of this host has one: with more ranks
        // than CPUs a spinning rank would take the CPU a neighbour needs to answer it, so the
        // ring's spin gives its CPU away after each look (as MPI yields when oversubscribed):
        // a neighbour's message then finds the rank runnable, not asleep.
        let local_ranks = job
            .peers()
            .iter()
            .filter(|p| p.host.same_host(&job.peers()[me as usize].host))
            .count();
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let oversubscribed = local_ranks > cpus;
        if oversubscribed {
            tracing::info!(
                local_ranks,
                cpus,
                "more ranks than CPUs on this host: the ring yields its CPU while it spins"
            );
            // The verbs waits of this process do not spin at all (their setting is per
            // process).
            nodetour_core::verbs::set_spin(std::time::Duration::ZERO);
        }
        let ring_options = HostRingOptions {
            slot_bytes: options.slot_bytes,
            slots: options.slots,
            timeout,
            spin: options.config.ring_spin,
            spin_yields: oversubscribed,
        };
        // Only the regions peers write (slots, doorbell) allow remote writes; the staging
        // region is a send source and local only.
        // Each region exactly as long as asked (the receive slots: what the previous rank is
        // granted, no more).
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
        let slot_total = (options.slots as usize)
            .checked_mul(options.slot_bytes)
            .ok_or_else(|| Error::InvalidArgument {
                reason: "slots × slot bytes overflows".into(),
            })?;
        let recv = region(slot_total, Access::REMOTE)?;
        let bell = region(4096, Access::REMOTE_STRICT)?;
        let work = region(options.piece_bytes, Access::LOCAL)?;
        let grant = SlotGrant::of;
        let mut prepared: HashMap<u32, (PreparedVerbs, Vec<u8>)> = HashMap::new();
        if let Some(l) = &local {
            for p in linked.iter().copied() {
                if kinds[&p] == TransportKind::Verbs {
                    prepared.insert(p, PreparedVerbs::for_peer(l)?);
                }
            }
        }
        // To the previous rank: the receive slots it writes; to the next: the doorbell it
        // writes grants into; and the queue pair made for it.
        let setup_for = |p: u32| {
            NeighbourSetup {
                recv: (p == prev).then(|| grant(&recv)),
                bell: (p == next).then(|| grant(&bell)),
                endpoint: prepared.get(&p).map(|(_, e)| e.clone()),
            }
            .encode()
        };
        let alive = || job.check_present();
        let address = |p: u32| job.peers()[p as usize].address.clone();
        let setups =
            endpoint.exchange(&linked, me, world, &address, &setup_for, &alive, deadline)?;
        let setup_of = |p: u32| -> Result<NeighbourSetup> {
            let bytes = setups.get(&p).ok_or_else(|| Error::Protocol {
                rank: p,
                reason: "sent no setup".into(),
            })?;
            NeighbourSetup::decode(bytes).map_err(|e| Error::Protocol {
                rank: p,
                reason: format!("its setup: {e}"),
            })
        };
        let missing = |what: &str, p: u32| Error::Protocol {
            rank: p,
            reason: format!("sent no {what}"),
        };
        let (next_slots, prev_slots) = if world == 1 {
            (grant(&recv), grant(&bell))
        } else {
            (
                setup_of(next)?
                    .recv
                    .ok_or_else(|| missing("receive-slot grant", next))?,
                setup_of(prev)?
                    .bell
                    .ok_or_else(|| missing("doorbell grant", prev))?,
            )
        };
        // The slots this rank writes: exactly the agreed slots × slot bytes (the shapes were
        // compared at the bootstrap; a grant of another size is a peer that breaks the
        // protocol), and a doorbell that holds the notices.
        if world > 1 && next_slots.len != slot_total as u64 {
            return Err(Error::Protocol {
                rank: next,
                reason: format!(
                    "granted {} bytes of receive slots, the agreed shape is {} × {} = {slot_total}",
                    next_slots.len, options.slots, options.slot_bytes
                ),
            });
        }
        if world > 1 && prev_slots.len < BELL_BYTES as u64 {
            return Err(Error::Protocol {
                rank: prev,
                reason: format!(
                    "granted a doorbell of {} bytes, it must hold {BELL_BYTES}",
                    prev_slots.len
                ),
            });
        }
        let mut conns: HashMap<u32, Box<dyn HostConnection>> = HashMap::new();
        if let Some(l) = &local {
            for (p, (q, _)) in prepared.drain() {
                let sent = setup_of(p)?
                    .endpoint
                    .ok_or_else(|| missing("queue pair", p))?;
                let remote = EndpointDescription::decode(&sent)
                    .map_err(|e| Error::Protocol {
                        rank: p,
                        reason: format!("its queue pair: {e}"),
                    })?
                    .endpoint;
                let path = PathOptions::new(l.port.port, &l.gid, &options.config);
                let c = q.connect(&remote, &path, format!("rank {p}"), timeout)?;
                conns.insert(p, Box::new(c));
            }
        }
        let tcp_peers: Vec<u32> = linked
            .iter()
            .copied()
            .filter(|p| kinds[p] == TransportKind::Tcp)
            .collect();
        if !tcp_peers.is_empty() {
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
            let made = endpoint.connect_mesh(
                &tcp_peers,
                me,
                world,
                &address,
                &grants_for,
                &alive,
                deadline,
            )?;
            conns.extend(
                made.into_iter()
                    .map(|(p, c)| (p, Box::new(c) as Box<dyn HostConnection>)),
            );
        }
        // One rank: a loopback link that carries nothing (its plans have no sends), so that the
        // collective still runs (stages in, copies out) through the same code.
        let mut loopback = None;
        if world == 1 {
            let (a, b) = nodetour_core::transport::MemConnection::pair();
            conns.insert(me, Box::new(a));
            loopback = Some(b);
        }
        // A verbs write must not reach a queue pair that is not ready yet: every rank has
        // connected every link before any rank's first collective.
        if world > 1 {
            job.barrier(deadline)?;
        }
        // GPU buffers: a GPU ring when every rank has a GPU in a process of its own (in-host
        // links between processes of one host, network links between hosts), else staged
        // through this ring. Every rank decides from the same table, so all take the same
        // branch.
        let announced = job
            .peers()
            .iter()
            .map(|p| Announcement::decode(p.rank, &p.blob))
            .collect::<Result<Vec<_>>>()?;
        // Every link of the ring, as the transport table sees it (the same on every rank).
        let hosts: Vec<&HostIdentity> = job.peers().iter().map(|p| &p.host).collect();
        let ring_links: Vec<Pair<'_>> = (0..order.len())
            .filter(|_| world > 1)
            .map(|i| {
                let (a, b) = (order[i], order[(i + 1) % order.len()]);
                Pair {
                    ours: (&announced[a as usize], a),
                    theirs: (&announced[b as usize], b),
                    same_host: hosts[a as usize].same_host(hosts[b as usize]),
                    why_no_verbs: "",
                }
            })
            .collect();
        let mut processes: Vec<(&str, u32)> = announced
            .iter()
            .zip(&hosts)
            .map(|(a, h)| (h.boot_id.as_str(), a.pid))
            .collect();
        processes.sort_unstable();
        processes.dedup();
        let pids_distinct = processes.len() == announced.len();
        let ring_choice = table::device_ring(&ring_links, options.transport, pids_distinct);
        let (gpu_ring, device) = match pin {
            None => (None, DevicePath::None),
            Some(context) if ring_choice.is_ok() => {
                let seat = super::gpu_links::Seat {
                    job: &job,
                    endpoint: &endpoint,
                    context,
                    me,
                    world,
                    position: position(&order, me),
                    prev,
                    next,
                    forced: options.transport,
                    deadline,
                    timeout: options.timeout(),
                };
                // A link between hosts (or processes) makes it a ring with network links.
                let network = |l: &Pair<'_>| table::network_link(l, options.transport);
                let formed = if ring_links.iter().any(network) {
                    // The link from `a` to `b` as the table saw it.
                    let in_host = |a: u32, b: u32| {
                        ring_links
                            .iter()
                            .find(|l| l.ours.1 == a && l.theirs.1 == b)
                            .is_some_and(|l| !network(l))
                    };
                    super::net_links::form(
                        seat,
                        super::net_links::Locality {
                            next_local: in_host(me, next),
                            prev_local: in_host(prev, me),
                            verbs: local.as_ref(),
                            verbs_next: kinds.get(&next) == Some(&TransportKind::Verbs),
                            verbs_prev: kinds.get(&prev) == Some(&TransportKind::Verbs),
                        },
                        options.gpu_ring,
                        &options.config,
                    )?
                } else {
                    super::gpu_links::form(seat, options.gpu_ring)?
                };
                let (mut ring, reason) = (formed.ring, formed.choice);
                ring.set_two_rank_exchange(options.two_rank_exchange);
                let transport = ring.kind();
                (Some(ring), DevicePath::GpuRing { transport, reason })
            }
            Some(_) => {
                let reason = ring_choice.err().unwrap_or_default();
                (None, DevicePath::Staged { reason })
            }
        };
        drop(endpoint);
        let paths = Paths {
            rank: me,
            world,
            order: order.clone(),
            links,
            security: token.describe(),
            device,
        };
        tracing::info!(%paths, "communicator formed");
        Ok(HostJob {
            conns,
            recv,
            work,
            bell,
            next_slots,
            prev_slots,
            options: ring_options,
            backlog: Vec::new(),
            owed: Vec::new(),
            host_gather_max: options.host_gather_max,
            seq: 0,
            gpu: None,
            gpu_ring,
            _loopback: loopback,
            _local: local,
            rank: me,
            world,
            neighbours: (prev, next),
            order,
            paths,
            job,
        })
    }

    /// Bytes of the staging region (the largest piece).
    pub(super) fn piece_bytes(&self) -> usize {
        self.work.len()
    }

    /// The largest host allreduce that gathers instead of running the ring
    /// ([`super::Options::host_gather_max`]).
    pub(super) fn host_gather_max(&self) -> usize {
        self.host_gather_max
    }

    /// Runs one ring collective through `f` (given the ring, the collective's sequence number
    /// and the liveness check, which also reports an abort). Every call consumes a sequence
    /// number on every rank, also on one rank alone.
    pub(super) fn run(
        &mut self,
        aborted: &AbortFlag,
        f: impl FnOnce(&mut HostRing<'_>, u64, &dyn Fn() -> nodetour_core::Result<()>) -> Result<()>,
    ) -> Result<()> {
        let (prev, next) = self.neighbours;
        let seq = self.seq;
        self.seq += 1;
        let gone = |what: &str| Error::InvalidArgument {
            reason: format!("no connection to the {what} rank"),
        };
        let links = if next == prev {
            Links::One(
                self.conns
                    .get_mut(&next)
                    .ok_or_else(|| gone("next"))?
                    .as_mut(),
            )
        } else {
            let (mut n, mut p) = (None, None);
            for (r, c) in self.conns.iter_mut() {
                if *r == next {
                    n = Some(c.as_mut());
                } else if *r == prev {
                    p = Some(c.as_mut());
                }
            }
            Links::Two {
                next: n.ok_or_else(|| gone("next"))?,
                prev: p.ok_or_else(|| gone("previous"))?,
            }
        };
        let mut ring = HostRing {
            rank: position(&self.order, self.rank),
            world: self.world,
            links,
            next_slots: self.next_slots,
            prev_slots: self.prev_slots,
            recv: self.recv.clone(),
            bell: self.bell.clone(),
            work: self.work.clone(),
            options: self.options,
            backlog: std::mem::take(&mut self.backlog),
            owed: std::mem::take(&mut self.owed),
        };
        // Owed until the collective gives its slots back (also when it never starts).
        ring.owe_release(seq);
        let aborted_before = aborted.lock().ok().and_then(|r| r.clone());
        let job = &self.job;
        let order = &self.order;
        let alive = || {
            if let Some(reason) = aborted.lock().ok().and_then(|r| r.clone()) {
                return Err(nodetour_core::Error::Aborted { reason });
            }
            // The ring numbers ranks by their position in it (blame maps them back).
            job.check_present().map_err(|e| match e {
                nodetour_core::Error::RankLost { rank, reason } => nodetour_core::Error::RankLost {
                    rank: position(order, rank),
                    reason,
                },
                e => e,
            })
        };
        let result = match aborted_before {
            Some(reason) => Err(Error::Aborted { reason }),
            None => f(&mut ring, seq, &alive),
        };
        self.backlog = std::mem::take(&mut ring.backlog);
        self.owed = std::mem::take(&mut ring.owed);
        result.map_err(|e| self.blame(e))
    }

    /// Runs `f` with the staged GPU path's scratch and kernels on `buffer`'s GPU (made on
    /// first use, kept for the next call) and `stream`.
    pub(super) fn with_staging<R>(
        &mut self,
        buffer: &DeviceBuffer,
        stream: &GpuStream,
        f: impl FnOnce(&mut Self, &GpuStaging<'_>) -> Result<R>,
    ) -> Result<R> {
        let same =
            |g: &GpuSide| nodetour_core::cuda::same_context(g.scratch.context(), buffer.context());
        let gpu = match self.gpu.take() {
            Some(g) if same(&g) => g,
            _ => {
                let ctx = buffer.context();
                GpuSide {
                    scratch: DeviceBuffer::new(ctx, self.options.slot_bytes)?,
                    kernels: ReduceKernels::load(ctx)?,
                }
            }
        };
        let staging = GpuStaging {
            kernels: &gpu.kernels,
            stream,
            scratch: &gpu.scratch,
        };
        let result = f(self, &staging);
        self.gpu = Some(gpu);
        result
    }

    /// Ring positions become job ranks. A failure whose cause is not known yet (a transport
    /// error, a timeout, a failure there) is usually the echo of a rank that died (its
    /// connection closed, or a neighbour that failed because of it closed its own): ask the
    /// liveness mesh, briefly, who was lost first, and name that rank. A known cause (an
    /// abort, a disagreement, a loss) stays: a rank that disagreed or aborted and then left is
    /// reported for what it did, not for leaving.
    fn blame(&self, e: Error) -> Error {
        let rank_at = |p: u32| self.order.get(p as usize).copied().unwrap_or(p);
        let e = e.map_ranks(&rank_at);
        let known = matches!(
            e.root_cause().map(|c| c.kind),
            Some(CauseKind::Aborted | CauseKind::Disagreement | CauseKind::Lost)
        );
        if known || matches!(e, Error::Aborted { .. }) {
            return e;
        }
        let wait = std::time::Duration::from_millis(500).min(self.options.timeout);
        match self.job.wait_for_loss(Deadline::after(wait)) {
            Some((rank, why)) => {
                tracing::warn!(rank, %why, ring_saw = %e, "a rank was lost during the collective");
                Error::PeerLost { rank }
            }
            None => e,
        }
    }
}

/// The ring position of `rank` (the schedule numbers ranks by position in the ring order).
fn position(order: &[u32], rank: u32) -> u32 {
    order.iter().position(|r| *r == rank).unwrap_or(0) as u32
}

//! The host-memory ring of a communicator, once formed ([`super::form`]'s steps): its links and
//! regions, and the running of one ring collective over it, with the sequence number and the
//! early notifications carried from one to the next.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{HostConnection, SlotGrant, SlotRegion};
use nodetour_core::verbs::LocalSide;
use nodetour_net::bootstrap::{Bootstrap, JobToken};

use super::form;
use super::form::plan::position;
use super::options::Options;
use super::paths::Paths;
use crate::cause::CauseKind;
use crate::error::{Error, Result};
use crate::gpu_ring::GpuRing;
use crate::host::{GpuStaging, HostRing, HostRingOptions, Links};

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
    // Drop order (fields drop in declaration order): the peer links (each its connection before
    // its regions), the ring's links (queue pairs drained and destroyed, sockets closed) before
    // the regions they may write, regions before the device, the endpoint and the bootstrap
    // last. The GPU ring is closed (its teardown handshake) before the job drops.
    peers: super::peers::run::PeerLinks,
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
    /// This rank's local rank and its host's ranks.
    pub local: (u32, u32),
    pub order: Vec<u32>,
    pub paths: Paths,
    /// What forming a peer link uses beside the job: the verbs settings (the device chosen
    /// for this rank), the links' shape, the joining timeout.
    p2p: P2pSettings,
    /// This rank's authenticated endpoint (peer links form through it on first use).
    endpoint: TcpEndpoint,
    pub job: Bootstrap,
}

/// What forming a peer link uses (from the options at formation).
struct P2pSettings {
    config: nodetour_core::Config,
    /// The RDMA device's settings for this rank (`None`: links forced to tcp).
    verbs: Option<nodetour_core::Config>,
    /// Slots per link and their bytes (the host ring's: settings every rank shares).
    shape: (u32, usize),
    join_timeout: std::time::Duration,
}

/// The GPU side of the staged path: kernels and one slot of scratch (the stream is the caller's).
struct GpuSide {
    scratch: DeviceBuffer,
    kernels: ReduceKernels,
}

impl HostJob {
    /// Forms the ring of `launch`'s job, through the steps of [`super::form`]. With `pin`, the
    /// slot and staging regions are also registered with CUDA under that context (pinned for
    /// the staged GPU path's copies), and GPU buffers get the device path the plan chose.
    pub(super) fn form(
        launch: Launch,
        options: &Options,
        pin: Option<&Arc<cudarc::driver::CudaContext>>,
    ) -> Result<HostJob> {
        options.validate()?;
        let mut joined = form::host::announce(&launch, options)?;
        let plan = form::host::plan(&joined, options, pin.is_some())?;
        let verbs = std::mem::replace(&mut joined.verbs, Err(String::new()));
        let mut memory = form::host::allocate(&plan, verbs, options, pin)?;
        let grants = form::host::exchange(&joined, &plan, &memory, options)?;
        let (conns, loopback) = form::host::connect(&joined, &plan, &mut memory, &grants, options)?;
        let (gpu_ring, device) = form::device(&joined, &plan, memory.local.as_ref(), options, pin)?;
        let paths = Paths {
            rank: plan.me,
            world: plan.world,
            order: plan.order.clone(),
            links: plan.links.clone(),
            security: launch.token.describe(),
            device,
            peers: Vec::new(),
        };
        tracing::info!(%paths, "communicator formed");
        if let (super::paths::DevicePath::Staged { reason }, 0) = (&paths.device, plan.local.0) {
            // Once per host: device memory takes the host, not the direct path.
            nodetour_core::notice::warn(format_args!(
                "device collectives are staged through host memory: {reason}"
            ));
        }
        let ring_options = form::host::ring_options(&plan, options);
        Ok(HostJob {
            peers: super::peers::run::PeerLinks::new(
                options.p2p_max_links,
                super::peers::run::Waiting {
                    spin: ring_options.spin,
                    yields: ring_options.spin_yields,
                },
            ),
            conns,
            recv: memory.recv,
            work: memory.work,
            bell: memory.bell,
            next_slots: grants.next_slots,
            prev_slots: grants.prev_slots,
            options: ring_options,
            backlog: Vec::new(),
            owed: Vec::new(),
            host_gather_max: options.host_gather_max,
            seq: 0,
            gpu: None,
            gpu_ring,
            _loopback: loopback,
            _local: memory.local,
            rank: plan.me,
            world: plan.world,
            neighbours: (plan.prev, plan.next),
            local: plan.local,
            order: plan.order,
            paths,
            p2p: P2pSettings {
                config: options.config.clone(),
                verbs: form::host::verbs_config(options, plan.me),
                shape: (options.slots, options.slot_bytes),
                join_timeout: options.join_timeout(),
            },
            endpoint: joined.endpoint,
            job: joined.job,
        })
    }

    /// Runs point-to-point `parts` over the peer links, forming those missing first (within
    /// the joining timeout), each part within `timeout`.
    pub(super) fn point_to_point(
        &mut self,
        parts: Vec<super::peers::run::Part<'_>>,
        timeout: std::time::Duration,
        aborted: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let peers: Vec<u32> = parts.iter().map(|p| p.peer).collect();
        if peers.iter().any(|p| !self.peers.has(*p)) {
            if let (None, Some(config)) = (&self._local, &self.p2p.verbs) {
                // A peer link may use the RDMA device where the ring's links did not.
                self._local = LocalSide::open(config, nodetour_core::verbs::Near::Host).ok();
            }
            let why_not = "no RDMA device";
            let at = super::peers::form::Forming {
                job: &self.job,
                endpoint: &self.endpoint,
                verbs: self._local.as_ref().ok_or(why_not),
                config: &self.p2p.config,
                shape: self.p2p.shape,
                timeout,
                deadline: Deadline::after(self.p2p.join_timeout),
            };
            self.peers.ensure(&at, &peers)?;
        }
        let deadline = Deadline::after(timeout);
        // An abort, or a rank of the job gone (the bootstrap's liveness mesh), ends the batch.
        let job = &self.job;
        let stop = || aborted().or_else(|| job.check_present().err().map(|e| e.to_string()));
        self.peers.run(self.rank, parts, deadline, timeout, &stop)
    }

    /// What `paths()` shows of the peer links, kept up to date as they form.
    pub(super) fn peer_paths(&self) -> std::sync::Arc<Mutex<Vec<super::PeerLinkPath>>> {
        self.peers.shown()
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

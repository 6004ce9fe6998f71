//! A job of processes joined in a ring for host-buffer collectives: the bootstrap (from the
//! launcher environment), the ring order by host, the connections to the two neighbours over tcp
//! or verbs, and the registered slot, doorbell and work regions. `all_reduce` runs one
//! collective; the job carries the epoch and the early notifications from one to the next.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{Context as _, bail};
use nodetour_core::bootstrap::{Bootstrap, HostIdentity, JobToken, LaunchInfo, PeerEntry};
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::setup::NeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::transport::{HostConnection, SlotGrant, SlotRegion};
use nodetour_core::verbs::{Access, EndpointDescription, MemoryRegion, Near, PathOptions};
use nodetour_core::{Config, Deadline};
use nodetour_ring::host::{GpuStaging, HostRing, HostRingOptions, Links};
use nodetour_ring::order::{neighbours, ring_order};
use nodetour_ring::{DataType, ReduceOp};

use crate::link::LocalSide;

/// The transport between neighbours.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RingTransport {
    /// TCP.
    Tcp,
    /// RDMA verbs; rank r uses `devices[r mod len]` (all devices' default choice if empty).
    Verbs {
        /// Devices to spread the ranks over.
        devices: Vec<String>,
    },
}

/// A formed ring.
pub struct RingJob {
    // Drop order: connections (queue pairs drained and destroyed) before the regions they may
    // write, regions before the device, the bootstrap last.
    conns: HashMap<u32, Box<dyn HostConnection>>,
    recv: SlotRegion,
    work: SlotRegion,
    bell: SlotRegion,
    next_slots: SlotGrant,
    prev_slots: SlotGrant,
    options: HostRingOptions,
    backlog: Vec<u32>,
    seq: u64,
    _local: Option<LocalSide>,
    gpu: Option<GpuSide>,
    aborted: Arc<std::sync::Mutex<Option<String>>>,
    /// This rank.
    pub rank: u32,
    /// Ranks in the job.
    pub world: u32,
    /// (previous, next) in the ring.
    pub neighbours: (u32, u32),
    /// The ring order (ranks of one host next to each other).
    pub order: Vec<u32>,
    /// The bootstrap (liveness, barriers).
    pub job: Bootstrap,
}

impl RingJob {
    /// Forms the job from the launcher environment, for buffers up to `max_bytes`.
    pub fn form(
        config: &Config,
        transport: &RingTransport,
        max_bytes: usize,
        options: HostRingOptions,
    ) -> anyhow::Result<RingJob> {
        Self::form_with(config, transport, max_bytes, options, None)
    }

    /// Like [`RingJob::form`], with the slot and work regions registered with CUDA under
    /// `context` (this rank's GPU: pinned for the copies of [`RingJob::all_reduce_gpu`]; no
    /// context is made on another GPU).
    pub fn form_for_gpu(
        config: &Config,
        transport: &RingTransport,
        max_bytes: usize,
        options: HostRingOptions,
        context: &Arc<cudarc::driver::CudaContext>,
    ) -> anyhow::Result<RingJob> {
        Self::form_with(config, transport, max_bytes, options, Some(context))
    }

    fn form_with(
        config: &Config,
        transport: &RingTransport,
        max_bytes: usize,
        options: HostRingOptions,
        pin: Option<&Arc<cudarc::driver::CudaContext>>,
    ) -> anyhow::Result<RingJob> {
        let info = LaunchInfo::from_env()?;
        let token = JobToken::from_env();
        let (me, world) = (info.rank, info.world_size);
        let local = match transport {
            RingTransport::Tcp => None,
            RingTransport::Verbs { devices } => {
                let mut cfg = config.clone();
                if !devices.is_empty() {
                    cfg.ib_device = Some(devices[me as usize % devices.len()].clone());
                }
                Some(LocalSide::open(&cfg, Near::Host)?)
            }
        };
        // Least privilege: only the regions peers write (slots, doorbell) allow remote writes;
        // the work buffer is a send source and local only.
        let region = |len: usize, access: Access| -> anyhow::Result<SlotRegion> {
            let mut buf = HostBuffer::new(len.max(4096))?;
            if let Some(context) = pin {
                // Pinned for fast GPU copies (the staged GPU path copies in and out of it).
                buf.register_with_cuda(context)?;
            }
            Ok(match &local {
                Some(l) => {
                    SlotRegion::registered(Arc::new(MemoryRegion::register(&l.pd, buf, access)?))
                }
                None => SlotRegion::host(buf),
            })
        };
        let recv = region(options.slots as usize * options.slot_bytes, Access::REMOTE)?;
        let bell = region(4096, Access::REMOTE_STRICT)?;
        let work = region(max_bytes, Access::LOCAL)?;
        let grant = |r: &SlotRegion| SlotGrant {
            key: r.key(),
            len: r.len() as u64,
            remote: r.memory_region().map(|m| m.remote()),
        };
        let endpoint = TcpEndpoint::bind("0.0.0.0:0", token.clone(), config.timeout)?;
        let ip = nodetour_core::bootstrap::host::local_ip_towards(&info.master_addr, info.port);
        let host = HostIdentity::current();
        // The bootstrap, which every rank hears, carries no remote key and no queue pair: only
        // where to reach this rank. What only a neighbour may use goes to that neighbour alone
        // (TcpEndpoint::exchange, authenticated both ways).
        let entry = PeerEntry {
            rank: me,
            host,
            address: format!("{ip}:{}", endpoint.local_addr()?.port()),
            blob: Vec::new(),
        };
        let deadline = Deadline::after(config.timeout);
        let job =
            Bootstrap::rendezvous(&info.rendezvous_addr(), me, world, entry, &token, deadline)?;
        let keys: Vec<&str> = job
            .peers()
            .iter()
            .map(|p| p.host.boot_id.as_str())
            .collect();
        let order = ring_order(&keys);
        let (prev, next) = neighbours(&order, me).context("this rank is not in the ring order")?;
        let linked: Vec<u32> = if world == 1 {
            vec![]
        } else if next == prev {
            vec![next]
        } else {
            vec![next, prev]
        };
        // Verbs: queue pairs for the neighbours only.
        let mut prepared: HashMap<u32, (PreparedVerbs, Vec<u8>)> = HashMap::new();
        if let Some(l) = &local {
            for p in linked.iter().copied() {
                prepared.insert(p, PreparedVerbs::for_peer(l)?);
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
        let alive = || job.check();
        let address = |p: u32| job.peers()[p as usize].address.clone();
        let setups =
            endpoint.exchange(&linked, me, world, &address, &setup_for, &alive, deadline)?;
        let setup_of = |p: u32| -> anyhow::Result<NeighbourSetup> {
            NeighbourSetup::decode(setups.get(&p).context("no setup from a neighbour")?)
                .with_context(|| format!("rank {p}'s setup"))
        };
        let (next_slots, prev_slots) = if world == 1 {
            (grant(&recv), grant(&bell))
        } else {
            let missing = |what: &str, p: u32| format!("rank {p} sent no {what}");
            (
                setup_of(next)?
                    .recv
                    .with_context(|| missing("receive-slot grant", next))?,
                setup_of(prev)?
                    .bell
                    .with_context(|| missing("doorbell grant", prev))?,
            )
        };
        let mut conns: HashMap<u32, Box<dyn HostConnection>> = HashMap::new();
        if let Some(l) = &local {
            for p in linked.iter().copied() {
                let (q, _) = prepared.remove(&p).context("queue pair")?;
                let remote = EndpointDescription::decode(
                    &setup_of(p)?
                        .endpoint
                        .with_context(|| format!("rank {p} made no queue pair for us"))?,
                )?
                .endpoint;
                let path = PathOptions::new(l.port.port, &l.gid, config);
                conns.insert(
                    p,
                    Box::new(q.connect(&remote, &path, format!("rank {p}"), config.timeout)?),
                );
            }
            job.barrier(deadline)?;
        } else if world > 1 {
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
            let tcp_conns = endpoint.connect_mesh(
                &linked,
                me,
                world,
                &address,
                &grants_for,
                &alive,
                deadline,
            )?;
            conns.extend(
                tcp_conns
                    .into_iter()
                    .map(|(p, c)| (p, Box::new(c) as Box<dyn HostConnection>)),
            );
        }
        tracing::info!(rank = me, prev, next, order = ?order, "ring formed");
        Ok(RingJob {
            conns,
            recv,
            work,
            bell,
            next_slots,
            prev_slots,
            options,
            backlog: Vec::new(),
            seq: 0,
            _local: local,
            gpu: None,
            aborted: Arc::new(std::sync::Mutex::new(None)),
            rank: me,
            world,
            neighbours: (prev, next),
            order,
            job,
        })
    }

    /// A handle that aborts the collective in flight from another thread: it returns
    /// `Aborted`, and so does every later one (its epoch is spent: late writes are stale).
    pub fn abort_handle(&self) -> HostAbortHandle {
        HostAbortHandle(self.aborted.clone())
    }

    /// Allreduces `data` across the job.
    pub fn all_reduce(
        &mut self,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> anyhow::Result<()> {
        if data.len() > self.work.len() {
            bail!(
                "{} bytes exceed the {} the job was formed for",
                data.len(),
                self.work.len()
            );
        }
        self.with_ring(|ring, seq, alive| ring.all_reduce(data, dtype, op, seq, alive))
    }

    /// Allreduces `data` across the job in place; its element type names the data type
    /// (`&mut [f32]`, `&mut [half::bf16]`, ...: no byte conversion).
    pub fn all_reduce_in_place<T: nodetour_ring::Element>(
        &mut self,
        data: &mut [T],
        op: ReduceOp,
    ) -> anyhow::Result<()> {
        self.all_reduce(nodetour_ring::element::bytes_mut(data), T::DATA_TYPE, op)
    }

    /// Allreduces the first `count` elements of GPU memory `buffer` in place, staged through
    /// this job's host slots (the path for GPUs whose transport cannot reach GPU memory:
    /// tcp, or verbs without GPUDirect). Runs on `stream` (a stream of the buffer's GPU) after
    /// the work queued there, and returns once it has finished: it waits for `stream` only,
    /// never for the whole device.
    pub fn all_reduce_gpu(
        &mut self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> anyhow::Result<()> {
        if !Arc::ptr_eq(stream.context(), buffer.context()) {
            bail!("the stream is not on the buffer's GPU");
        }
        let same = |g: &GpuSide| Arc::ptr_eq(g.scratch.context(), buffer.context());
        if !self.gpu.as_ref().is_some_and(same) {
            let ctx = buffer.context();
            self.gpu = Some(GpuSide {
                scratch: DeviceBuffer::new(ctx, self.options.slot_bytes)?,
                kernels: ReduceKernels::load(ctx)?,
            });
        }
        let gpu = self.gpu.take().expect("set above");
        let staging = GpuStaging {
            kernels: &gpu.kernels,
            stream,
            scratch: &gpu.scratch,
        };
        let result = self.with_ring(|ring, seq, alive| {
            ring.all_reduce_gpu(buffer, count, dtype, op, seq, &staging, alive)
        });
        self.gpu = Some(gpu);
        result
    }

    fn with_ring(
        &mut self,
        f: impl FnOnce(
            &mut HostRing<'_>,
            u64,
            &dyn Fn() -> nodetour_core::Result<()>,
        ) -> nodetour_ring::Result<()>,
    ) -> anyhow::Result<()> {
        let (prev, next) = self.neighbours;
        let seq = self.seq;
        self.seq += 1;
        if self.world == 1 {
            return Ok(());
        }
        let links = if next == prev {
            Links::One(self.conns.get_mut(&next).context("connection")?.as_mut())
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
                next: n.context("next")?,
                prev: p.context("prev")?,
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
        };
        let job = &self.job;
        let aborted = &self.aborted;
        let alive = || {
            if let Some(reason) = aborted.lock().ok().and_then(|r| r.clone()) {
                return Err(nodetour_core::Error::Aborted { reason });
            }
            job.check()
        };
        let result = f(&mut ring, seq, &alive);
        self.backlog = std::mem::take(&mut ring.backlog);
        result.map_err(|e| self.blame(e))
    }

    /// A transport failure is usually the echo of a rank that died (its connection closed, or a
    /// neighbour that failed because of it closed its own): ask the liveness mesh, briefly, who
    /// was lost first, and name that rank.
    fn blame(&self, e: nodetour_ring::Error) -> anyhow::Error {
        // The ring numbers ranks by their position in the ring order: name job ranks.
        let rank_at = |p: u32| self.order.get(p as usize).copied().unwrap_or(p);
        let e = match e {
            nodetour_ring::Error::Disagreement {
                rank,
                peer,
                ours,
                theirs,
            } => {
                return nodetour_ring::Error::Disagreement {
                    rank: rank_at(rank),
                    peer: rank_at(peer),
                    ours,
                    theirs,
                }
                .into();
            }
            nodetour_ring::Error::PeerFailed { peer, seq, reason } => {
                nodetour_ring::Error::PeerFailed {
                    peer: rank_at(peer),
                    seq,
                    reason,
                }
            }
            other => other,
        };
        if matches!(
            e,
            nodetour_ring::Error::PeerLost { .. } | nodetour_ring::Error::Aborted { .. }
        ) {
            return e.into();
        }
        let wait = std::time::Duration::from_millis(500).min(self.options.timeout);
        match self.job.wait_for_loss(Deadline::after(wait)) {
            Some((rank, why)) => anyhow::Error::new(nodetour_ring::Error::PeerLost { rank })
                .context(format!("{why}; the ring saw: {e}")),
            None => e.into(),
        }
    }
}

/// Aborts a [`RingJob`]'s collectives from any thread (see [`RingJob::abort_handle`]).
#[derive(Clone)]
pub struct HostAbortHandle(Arc<std::sync::Mutex<Option<String>>>);

impl HostAbortHandle {
    /// Aborts the collective in flight and every later one, with `reason`.
    pub fn abort(&self, reason: &str) {
        if let Ok(mut r) = self.0.lock() {
            r.get_or_insert_with(|| reason.to_owned());
        }
    }
}

/// The GPU side of the staged path: kernels and one slot of scratch (the stream is the caller's).
struct GpuSide {
    scratch: DeviceBuffer,
    kernels: ReduceKernels,
}

/// The ring position of `rank` (the schedule numbers ranks by position in the ring order).
fn position(order: &[u32], rank: u32) -> u32 {
    order.iter().position(|r| *r == rank).unwrap_or(0) as u32
}

//! Reliable-connected queue pairs: connection, one-sided RDMA WRITE / WRITE_WITH_IMM,
//! receives for immediates, selective signalling with send-queue accounting, completions with
//! deadlines, and a teardown that never lets the NIC write freed memory.

use std::collections::VecDeque;
use std::ops::Range;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rdma_sys::{ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_wc};

use super::completion::{self, Completion, RECV_WR_BIT, Raw};
use super::cq::CompletionQueue;
use super::endpoint::Endpoint;
use super::gid::{GidChoice, LinkLayer};
use super::mr::{MemoryRegion, Registered, RemoteRegion};
use super::pd::ProtectionDomain;
use super::port::{Mtu, PortAttributes};
use super::qp_state::{self, QpState, transition_mask};
use super::result;
use crate::config::Config;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::memory::RdmaBuffer;

const IBV_QPT_RC: u32 = 2;
const IBV_WR_RDMA_WRITE: u32 = 0;
const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
const IBV_WR_RDMA_READ: u32 = 4;
const ACCESS_REMOTE_READ: u32 = 4;
const IBV_SEND_SIGNALED: u32 = 2;
const IBV_SEND_INLINE: u32 = 8;
/// What a peer may do through a queue pair: RDMA WRITE (and WRITE_WITH_IMM) only. No remote
/// read or atomics: no nodetour path uses them (least privilege; the regions say the same).
const ACCESS_REMOTE: u32 = 1 | 2; // LOCAL_WRITE | REMOTE_WRITE
const POLL_BATCH: usize = 32;

/// Sizes of a queue pair's queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QueuePairOptions {
    /// Send queue depth: work requests outstanding at once.
    pub send_depth: u32,
    /// Receive queue depth: receives (for WRITE_WITH_IMM) posted at once.
    pub recv_depth: u32,
    /// Bytes a write may carry inline (copied at post time, no registration needed).
    pub max_inline: u32,
}

impl Default for QueuePairOptions {
    fn default() -> Self {
        QueuePairOptions {
            send_depth: 128,
            recv_depth: 128,
            max_inline: 64,
        }
    }
}

/// How to reach the peer: port, GID, traffic class, and the retransmission policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PathOptions {
    /// Local port number.
    pub port: u8,
    /// Local GID index.
    pub gid_index: u32,
    /// RoCE traffic class (`NODETOUR_IB_TC`).
    pub traffic_class: u8,
    /// InfiniBand service level (`NODETOUR_IB_SL`).
    pub service_level: u8,
    /// Local ACK timeout code: 4.096 µs × 2^code per attempt.
    pub ack_timeout: u8,
    /// Transport retries before `IBV_WC_RETRY_EXC_ERR` (at most 7).
    pub retry_count: u8,
    /// Receiver-not-ready retries (7 would mean "forever": never used).
    pub rnr_retry: u8,
    /// Receiver-not-ready back-off code the peer is asked to wait.
    pub min_rnr_timer: u8,
}

impl PathOptions {
    /// The path for `port`/`gid` under `config` (`NODETOUR_IB_TC`, `NODETOUR_IB_SL`, and
    /// retransmission derived from `NODETOUR_TIMEOUT_MS`).
    pub fn new(port: u8, gid: &GidChoice, config: &Config) -> Self {
        let retry_count = 7;
        PathOptions {
            port,
            gid_index: gid.index,
            traffic_class: config.traffic_class,
            service_level: config.service_level,
            ack_timeout: ack_timeout_code(config.timeout, retry_count),
            retry_count,
            rnr_retry: 6,
            // 20 = 10.24 ms between RNR retries (the IB encoding is not linear).
            min_rnr_timer: 20,
        }
    }
}

/// The largest ACK timeout code such that all `retries + 1` attempts fit in `budget`, kept
/// within 14 (67 ms: below that, slow or emulated links retransmit spuriously) and 24 (69 s).
pub fn ack_timeout_code(budget: Duration, retries: u8) -> u8 {
    let per_attempt_us = budget.as_secs_f64() * 1e6 / f64::from(u32::from(retries) + 1);
    let code = (per_attempt_us / 4.096).log2().floor();
    if code.is_nan() {
        14
    } else {
        code.clamp(14.0, 24.0) as u8
    }
}

/// What a send-side work request does.
#[derive(Clone, Copy)]
enum Op {
    /// RDMA WRITE, with an immediate (WRITE_WITH_IMM) or not.
    Write(Option<u32>),
    /// RDMA READ.
    Read,
}

struct Posted {
    wr_id: u64,
    // Keeps the source region registered (and its memory alive) until the NIC is done.
    _keep: Option<Arc<dyn Registered>>,
}

struct Inner {
    state: QpState,
    local_psn: u32,
    next_wr_id: u64,
    outstanding: VecDeque<Posted>,
    unsignaled_run: u32,
    recv_posted: u32,
    next_recv_id: u64,
    failed: Option<String>,
    wc: Vec<ibv_wc>,
}

// SAFETY: ibv_wc is plain data; Inner is only reached through the Mutex.
unsafe impl Send for Inner {}

/// A reliable-connected queue pair with its own completion queue.
pub struct QueuePair {
    // Moved to ERR, drained and destroyed in Drop::drop. Then the fields drop in this order:
    // `inner` releases the regions that posted work kept alive (the QP no longer exists, so the
    // NIC cannot touch them), `cq` destroys the completion queue and its channel, and `pd` lets
    // the protection domain go.
    raw: *mut ibv_qp,
    qpn: u32,
    inner: Mutex<Inner>,
    cq: CompletionQueue,
    pd: Arc<ProtectionDomain>,
    port: PortAttributes,
    options: QueuePairOptions,
    // Serves and initiates RDMA READs (a loopback flush queue pair only).
    reads: bool,
    max_inline: u32,
    drain_timeout: Duration,
}

// SAFETY: ibv_qp may be used from any thread; mutable bookkeeping is behind a Mutex.
unsafe impl Send for QueuePair {}
// SAFETY: as above.
unsafe impl Sync for QueuePair {}

impl QueuePair {
    /// Creates an RC queue pair on `port` (which must be ACTIVE) and moves it to INIT.
    pub fn new(pd: &Arc<ProtectionDomain>, port: u8, options: QueuePairOptions) -> Result<Self> {
        Self::create(pd, port, options, false)
    }

    /// Like [`Self::new`], for a queue pair that both initiates and serves RDMA READs: only for
    /// a queue pair connected to itself in a protection domain of its own (the flush by read,
    /// [`crate::gdr::read_flush`]); no queue pair that reaches a peer ever serves reads.
    pub fn new_reader(
        pd: &Arc<ProtectionDomain>,
        port: u8,
        options: QueuePairOptions,
    ) -> Result<Self> {
        Self::create(pd, port, options, true)
    }

    fn create(
        pd: &Arc<ProtectionDomain>,
        port: u8,
        options: QueuePairOptions,
        reads: bool,
    ) -> Result<Self> {
        let context = pd.context();
        let port = context.active_port(port)?;
        let attr = context.attributes();
        if options.send_depth == 0 || options.recv_depth == 0 {
            return Err(Error::InvalidArgument {
                reason: "queue depths must be at least 1".into(),
            });
        }
        if attr.max_qp_wr > 0 && options.send_depth.max(options.recv_depth) > attr.max_qp_wr {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "queue depth {} exceeds the device's max_qp_wr {}",
                    options.send_depth.max(options.recv_depth),
                    attr.max_qp_wr
                ),
            });
        }
        // Every send may be signalled and every receive completes: size the CQ for both.
        let cq = CompletionQueue::new(context, options.send_depth + options.recv_depth)?;
        // SAFETY: all-zero is a valid ibv_qp_init_attr (null pointers, zero integers).
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq.raw();
        init.recv_cq = cq.raw();
        init.qp_type = IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = options.send_depth;
        init.cap.max_recv_wr = options.recv_depth;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        init.cap.max_inline_data = options.max_inline;
        // SAFETY: pd and cq are live; init is valid.
        let raw =
            unsafe { result::create_qp(context.lib(), pd.raw(), &mut init) }.map_err(|source| {
                Error::CreateQueuePair {
                    device: context.name().to_owned(),
                    hint: match source.raw_os_error() {
                        Some(libc::ENOMEM) => "out of queue pair resources or memlock (ulimit -l)",
                        Some(libc::EINVAL) => "the device refused the queue sizes or inline size",
                        _ => "",
                    },
                    source,
                }
            })?;
        // SAFETY: raw is a live QP.
        let qpn = unsafe { (*raw).qp_num };
        let qp = QueuePair {
            raw,
            qpn,
            inner: Mutex::new(Inner {
                state: QpState::Reset,
                local_psn: random_psn(),
                next_wr_id: 1,
                outstanding: VecDeque::with_capacity(options.send_depth as usize),
                unsignaled_run: 0,
                recv_posted: 0,
                next_recv_id: 1,
                failed: None,
                // SAFETY: all-zero is a valid ibv_wc (integers and a union of integers).
                wc: (0..POLL_BATCH)
                    .map(|_| unsafe { std::mem::zeroed() })
                    .collect(),
            }),
            cq,
            pd: pd.clone(),
            max_inline: init.cap.max_inline_data,
            port,
            options,
            reads,
            drain_timeout: Duration::from_secs(5),
        };
        {
            let mut inner = qp.lock();
            // SAFETY: all-zero is a valid ibv_qp_attr.
            let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
            a.pkey_index = 0;
            a.port_num = qp.port.port;
            a.qp_access_flags = if reads {
                ACCESS_REMOTE | ACCESS_REMOTE_READ
            } else {
                ACCESS_REMOTE
            };
            qp.modify(&mut inner, QpState::Init, &mut a)?;
        }
        Ok(qp)
    }

    /// Queue pair number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// Current state as this side knows it.
    pub fn state(&self) -> QpState {
        self.lock().state
    }

    /// The port this queue pair uses.
    pub fn port(&self) -> &PortAttributes {
        &self.port
    }

    /// The protection domain.
    pub fn protection_domain(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// Largest inline write this queue pair accepts.
    pub fn max_inline(&self) -> u32 {
        self.max_inline
    }

    /// Send queue depth.
    pub fn send_depth(&self) -> u32 {
        self.options.send_depth
    }

    /// Send work requests posted and not yet retired by a completion.
    pub fn outstanding_sends(&self) -> u32 {
        self.lock().outstanding.len() as u32
    }

    /// Receives posted and not yet consumed.
    pub fn posted_receives(&self) -> u32 {
        self.lock().recv_posted
    }

    /// The completion channel's file descriptor (readable when an armed completion queue has an
    /// event), for progress engines that wait on many queue pairs.
    pub fn completion_fd(&self) -> std::os::fd::RawFd {
        self.cq.fd()
    }

    /// What the peer needs to connect to this queue pair, sending from `gid`.
    pub fn endpoint(&self, gid: &GidChoice) -> Endpoint {
        Endpoint {
            qpn: self.qpn,
            psn: self.lock().local_psn,
            lid: self.port.lid,
            gid: gid.gid,
            mtu: self.port.active_mtu.unwrap_or(Mtu::Mtu1024),
            link_layer: self.port.link_layer,
        }
    }

    /// Connects to `remote` (INIT → RTR → RTS). The path MTU is the smaller of the two ends'
    /// active MTUs.
    pub fn connect(&self, remote: &Endpoint, path: &PathOptions) -> Result<()> {
        if remote.link_layer != self.port.link_layer {
            return Err(Error::PeerMismatch {
                reason: format!(
                    "peer link layer is {:?}, ours is {:?}",
                    remote.link_layer, self.port.link_layer
                ),
            });
        }
        let local_mtu = self.port.active_mtu.unwrap_or(Mtu::Mtu1024);
        let mtu = local_mtu.min(remote.mtu);
        let mut inner = self.lock();

        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.path_mtu = mtu.code();
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn;
        // No RDMA READ or atomic is served (ACCESS_REMOTE), so no responder resources; except
        // by a reader (its own loopback), one read at a time.
        a.max_dest_rd_atomic = u8::from(self.reads);
        a.min_rnr_timer = path.min_rnr_timer;
        a.ah_attr.port_num = path.port;
        a.ah_attr.sl = path.service_level;
        a.ah_attr.dlid = remote.lid;
        if self.port.link_layer == LinkLayer::Ethernet || remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.sgid_index =
                u8::try_from(path.gid_index).map_err(|_| Error::InvalidArgument {
                    reason: format!("GID index {} > 255", path.gid_index),
                })?;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.traffic_class = path.traffic_class;
        }
        self.modify(&mut inner, QpState::ReadyToReceive, &mut a)?;

        // SAFETY: as above.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.timeout = path.ack_timeout;
        a.retry_cnt = path.retry_count.min(7);
        a.rnr_retry = path.rnr_retry.min(6);
        a.sq_psn = inner.local_psn;
        // Nor initiated: nodetour only writes (a reader reads one at a time).
        a.max_rd_atomic = u8::from(self.reads);
        self.modify(&mut inner, QpState::ReadyToSend, &mut a)?;
        tracing::debug!(
            qpn = self.qpn,
            remote_qpn = remote.qpn,
            mtu = mtu.bytes(),
            "queue pair connected"
        );
        Ok(())
    }

    /// Posts `n` receives, each consumed by one incoming WRITE_WITH_IMM.
    pub fn post_receives(&self, n: u32) -> Result<()> {
        let mut inner = self.lock();
        self.check_usable(&inner, "post receives", qp_state::can_receive)?;
        if inner.recv_posted + n > self.options.recv_depth {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} receives posted + {n} would exceed the receive queue depth {}",
                    inner.recv_posted, self.options.recv_depth
                ),
            });
        }
        for _ in 0..n {
            let wr_id = RECV_WR_BIT | inner.next_recv_id;
            let mut wr = ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
            };
            // SAFETY: the QP is live; the request has no scatter list (a WRITE_WITH_IMM's
            // receive carries no data).
            unsafe { result::post_recv(self.raw, &mut wr) }.map_err(|source| {
                Error::PostReceive {
                    qpn: self.qpn,
                    source,
                }
            })?;
            inner.next_recv_id += 1;
            inner.recv_posted += 1;
        }
        Ok(())
    }

    /// Posts an RDMA WRITE of `local[range]` to `remote` at `remote_offset`, carrying
    /// `immediate` (WRITE_WITH_IMM: consumes one of the peer's receives and completes there) if
    /// given. `signaled` asks for a local completion; the queue pair also signals on its own
    /// often enough that the send queue can always be retired. Returns the work request id.
    ///
    /// The region stays registered and alive until the request is retired by a completion (or
    /// the queue pair is torn down), even if the caller drops its `Arc`.
    pub fn post_write<B: RdmaBuffer>(
        &self,
        local: &Arc<MemoryRegion<B>>,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
        immediate: Option<u32>,
        signaled: bool,
    ) -> Result<u64> {
        self.post_region(
            local,
            range,
            remote,
            remote_offset,
            Op::Write(immediate),
            signaled,
        )
    }

    /// Posts a signalled RDMA READ of `remote` at `remote_offset` into `local[range]` (a
    /// [`Self::new_reader`] queue pair only). Returns the work request id; the read is done
    /// when its completion is polled.
    pub fn post_read<B: RdmaBuffer>(
        &self,
        local: &Arc<MemoryRegion<B>>,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
    ) -> Result<u64> {
        if !self.reads || range.is_empty() {
            return Err(Error::InvalidArgument {
                reason: "an RDMA READ needs bytes to read and a queue pair made for reads \
                         (QueuePair::new_reader)"
                    .into(),
            });
        }
        self.post_region(local, range, remote, remote_offset, Op::Read, true)
    }

    /// Posts `op` between `local[range]` and `remote` at `remote_offset`, both bounds-checked.
    fn post_region<B: RdmaBuffer>(
        &self,
        local: &Arc<MemoryRegion<B>>,
        range: Range<usize>,
        remote: &RemoteRegion,
        remote_offset: u64,
        op: Op,
        signaled: bool,
    ) -> Result<u64> {
        let len = range
            .end
            .checked_sub(range.start)
            .filter(|_| range.end <= local.len())
            .ok_or(Error::OutOfBounds {
                what: "local side of an RDMA operation",
                offset: range.start as u64,
                len: range.end.saturating_sub(range.start) as u64,
                region_len: local.len() as u64,
            })?;
        let len32 = u32::try_from(len).map_err(|_| Error::InvalidArgument {
            reason: format!("a single RDMA operation of {len} bytes exceeds 4 GiB"),
        })?;
        if len32 > self.port.max_message_size && self.port.max_message_size > 0 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{len} bytes exceed the port's max message size {}",
                    self.port.max_message_size
                ),
            });
        }
        let raddr = remote.address_of(remote_offset, len as u64)?;
        let mut sge = ibv_sge {
            addr: Registered::addr(&**local) + range.start as u64,
            length: len32,
            lkey: local.lkey(),
        };
        let keep: Arc<dyn Registered> = local.clone();
        self.post(
            &mut sge,
            len32,
            raddr,
            remote.rkey,
            op,
            signaled,
            0,
            Some(keep),
        )
    }

    /// Posts an RDMA WRITE whose payload (at most [`max_inline`](Self::max_inline) bytes) is
    /// copied into the work request, so no local registration is needed and `data` may be
    /// reused as soon as this returns.
    pub fn post_write_inline(
        &self,
        data: &[u8],
        remote: &RemoteRegion,
        remote_offset: u64,
        immediate: Option<u32>,
        signaled: bool,
    ) -> Result<u64> {
        if data.len() > self.max_inline as usize {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} bytes exceed the inline limit of {}",
                    data.len(),
                    self.max_inline
                ),
            });
        }
        let raddr = remote.address_of(remote_offset, data.len() as u64)?;
        let mut sge = ibv_sge {
            addr: data.as_ptr() as u64,
            length: data.len() as u32,
            lkey: 0,
        };
        self.post(
            &mut sge,
            data.len() as u32,
            raddr,
            remote.rkey,
            Op::Write(immediate),
            signaled,
            IBV_SEND_INLINE,
            None,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn post(
        &self,
        sge: &mut ibv_sge,
        len: u32,
        remote_addr: u64,
        rkey: u32,
        op: Op,
        signaled: bool,
        extra_flags: u32,
        keep: Option<Arc<dyn Registered>>,
    ) -> Result<u64> {
        let mut inner = self.lock();
        self.check_usable(&inner, "post writes", qp_state::can_send)?;
        if inner.outstanding.len() as u32 >= self.options.send_depth {
            return Err(Error::SendQueueFull {
                qpn: self.qpn,
                depth: self.options.send_depth,
            });
        }
        // Unsignalled requests are retired only by a later signalled one: signal at least every
        // half queue so a full queue always has a completion on its way.
        let signal_every = (self.options.send_depth / 2).max(1);
        let signal = signaled || inner.unsignaled_run + 1 >= signal_every;
        let wr_id = inner.next_wr_id;
        // SAFETY: all-zero is a valid ibv_send_wr (null pointers, zero integers, plain unions).
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = sge;
        wr.num_sge = if len == 0 { 0 } else { 1 };
        let immediate = match op {
            Op::Write(i) => i,
            Op::Read => None,
        };
        wr.opcode = match op {
            Op::Read => IBV_WR_RDMA_READ,
            Op::Write(Some(_)) => IBV_WR_RDMA_WRITE_WITH_IMM,
            Op::Write(None) => IBV_WR_RDMA_WRITE,
        };
        wr.send_flags = extra_flags | if signal { IBV_SEND_SIGNALED } else { 0 };
        wr.imm_data_invalidated_rkey_union.imm_data = immediate.unwrap_or(0).to_be();
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        // SAFETY: the QP is live; sge names registered memory kept alive by `keep` (or inline
        // data copied during the call).
        unsafe { result::post_send(self.raw, &mut wr) }.map_err(|source| Error::PostSend {
            qpn: self.qpn,
            source,
        })?;
        inner.next_wr_id += 1;
        inner.unsignaled_run = if signal { 0 } else { inner.unsignaled_run + 1 };
        inner.outstanding.push_back(Posted { wr_id, _keep: keep });
        Ok(wr_id)
    }

    /// Collects completions without blocking; returns how many were added to `out`.
    ///
    /// A failed work request moves the queue pair to ERR and returns
    /// [`Error::WorkCompletion`] (the first failure; the flushes that follow it are absorbed).
    /// Completions that succeeded in the same batch are still added to `out`.
    pub fn poll(&self, out: &mut Vec<Completion>) -> Result<usize> {
        let mut inner = self.lock();
        self.poll_locked(&mut inner, out, None)
    }

    /// Waits until at least one completion arrives or `deadline` passes (spinning briefly, then
    /// blocking on the completion channel).
    pub fn wait(&self, out: &mut Vec<Completion>, deadline: Deadline) -> Result<usize> {
        let mut inner = self.lock();
        let qpn = self.qpn;
        self.poll_locked(
            &mut inner,
            out,
            Some((deadline, &|| format!("a completion on queue pair {qpn}"))),
        )
    }

    /// Prepares a wait on many queue pairs at once (one `poll(2)` over their descriptors):
    /// arms the completion queue and returns the descriptors to block on, its channel's and the
    /// device's asynchronous event file (negative where events are not watched). A completion
    /// queued before arming raises no event: the caller polls once more before it blocks, and
    /// calls [`Self::after_wake`] before it next polls.
    pub fn arm(&self) -> Result<[RawFd; 2]> {
        let _inner = self.lock();
        self.cq.arm()?;
        Ok([self.cq.fd(), self.pd.context().async_fd()])
    }

    /// After a wait prepared by [`Self::arm`]: takes the channel's event (if it fired), and
    /// reports an asynchronous event that is fatal for this queue pair or its port (a port that
    /// went down, a queue pair the device killed).
    pub fn after_wake(&self) -> Result<()> {
        {
            let _inner = self.lock();
            self.cq.consume_event()?;
        }
        self.pd.context().check_async(self.port.port, self.qpn)
    }

    /// Waits until every posted send has been retired.
    pub fn wait_idle(&self, deadline: Deadline) -> Result<()> {
        let mut out = Vec::new();
        while self.outstanding_sends() > 0 {
            out.clear();
            self.wait(&mut out, deadline)?;
        }
        Ok(())
    }

    fn poll_locked(
        &self,
        inner: &mut Inner,
        out: &mut Vec<Completion>,
        wait: Option<(Deadline, &dyn Fn() -> String)>,
    ) -> Result<usize> {
        let mut wc = std::mem::take(&mut inner.wc);
        let polled = match wait {
            None => self.cq.poll(&mut wc),
            Some((deadline, what)) => {
                let context = self.pd.context();
                let port = self.port.port;
                self.cq.wait(&mut wc, deadline, what, &|| {
                    context.check_async(port, self.qpn)
                })
            }
        };
        let result = polled.and_then(|n| {
            let mut first_error = None;
            let before = out.len();
            for w in &wc[..n] {
                let (raw, status) = completion::classify(self.qpn, w);
                let retired = retire(inner, raw);
                match status {
                    Ok(()) => out.push(match raw {
                        Raw::Send { wr_id } => Completion::Send { wr_id, retired },
                        Raw::Recv {
                            wr_id,
                            immediate,
                            byte_len,
                        } => Completion::WriteWithImmediate {
                            wr_id: wr_id & !RECV_WR_BIT,
                            immediate: immediate.unwrap_or(0),
                            byte_len,
                        },
                    }),
                    Err(e) => {
                        inner.state = QpState::Error;
                        if first_error.is_none()
                            && !(completion::is_flush(w.status) && inner.failed.is_some())
                        {
                            inner.failed.get_or_insert_with(|| e.to_string());
                            first_error = Some(e);
                        }
                    }
                }
            }
            match first_error {
                Some(e) => Err(e),
                None => Ok(out.len() - before),
            }
        });
        inner.wc = wc;
        result
    }

    /// Moves the queue pair to ERR: every outstanding work request completes with a flush
    /// error and no further data moves. Used by teardown and by aborts.
    pub fn fail(&self) -> Result<()> {
        let mut inner = self.lock();
        self.to_error(&mut inner)
    }

    fn to_error(&self, inner: &mut Inner) -> Result<()> {
        if matches!(inner.state, QpState::Error | QpState::Reset) {
            inner.state = if inner.state == QpState::Reset {
                QpState::Reset
            } else {
                QpState::Error
            };
            return Ok(());
        }
        // SAFETY: all-zero is a valid ibv_qp_attr.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        self.modify(inner, QpState::Error, &mut a)
    }

    fn modify(&self, inner: &mut Inner, to: QpState, a: &mut ibv_qp_attr) -> Result<()> {
        let from = inner.state;
        let mask = transition_mask(from, to).ok_or(Error::InvalidTransition {
            qpn: self.qpn,
            from: from.name(),
            to: to.name(),
        })?;
        a.qp_state = to.code();
        // SAFETY: the QP is live; `a` holds every attribute `mask` names.
        unsafe { result::modify_qp(self.pd.context().lib(), self.raw, a, mask) }.map_err(|source| {
            Error::ModifyQueuePair {
                qpn: self.qpn,
                from: from.name(),
                to: to.name(),
                hint: match (to, source.raw_os_error()) {
                    (QpState::ReadyToReceive, Some(libc::EINVAL)) => {
                        "bad remote address: check the GID index, MTU and that both ends use the same link layer"
                    }
                    (QpState::ReadyToReceive, Some(libc::ETIMEDOUT)) => "no route to the peer's GID",
                    _ => "",
                },
                source,
            }
        })?;
        inner.state = to;
        Ok(())
    }

    fn check_usable(&self, inner: &Inner, op: &'static str, ok: fn(QpState) -> bool) -> Result<()> {
        if ok(inner.state) {
            Ok(())
        } else {
            Err(Error::QueuePairNotReady {
                qpn: self.qpn,
                state: inner.state.name(),
                op,
            })
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding the lock leaves bookkeeping that is still consistent enough to
        // tear down; take it over rather than propagating the poison.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Retires bookkeeping for one completion; returns how many sends it retired.
fn retire(inner: &mut Inner, raw: Raw) -> u32 {
    match raw {
        Raw::Send { wr_id } => {
            let mut n = 0;
            while inner.outstanding.front().is_some_and(|p| p.wr_id <= wr_id) {
                inner.outstanding.pop_front();
                n += 1;
            }
            n
        }
        Raw::Recv { .. } => {
            inner.recv_posted = inner.recv_posted.saturating_sub(1);
            0
        }
    }
}

impl Drop for QueuePair {
    fn drop(&mut self) {
        // Teardown order: ERR (the NIC stops), drain (every posted request has flushed), destroy
        // the QP, and only then (field drops) release the regions posted work kept alive, the
        // CQ and the protection domain.
        let inner = self.inner.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut inner = std::mem::replace(
            inner,
            Inner {
                state: QpState::Error,
                local_psn: 0,
                next_wr_id: 0,
                outstanding: VecDeque::new(),
                unsignaled_run: 0,
                recv_posted: 0,
                next_recv_id: 0,
                failed: None,
                wc: Vec::new(),
            },
        );
        if let Err(e) = self.to_error(&mut inner) {
            tracing::warn!(qpn = self.qpn, error = %e, "moving the queue pair to ERR failed during teardown");
        }
        let deadline = Deadline::after(self.drain_timeout);
        let mut sink = Vec::new();
        while (!inner.outstanding.is_empty() || inner.recv_posted > 0) && !deadline.expired() {
            sink.clear();
            // Errors here are the expected flushes.
            let _ = self.poll_locked(
                &mut inner,
                &mut sink,
                Some((deadline, &|| "the teardown drain".into())),
            );
        }
        if !inner.outstanding.is_empty() || inner.recv_posted > 0 {
            tracing::warn!(
                qpn = self.qpn,
                sends = inner.outstanding.len(),
                receives = inner.recv_posted,
                "drain timed out; destroying the queue pair anyway (destroy stops the NIC)"
            );
        }
        // Failure policy: if destroy fails the NIC may still use the regions posted work holds,
        // so those are leaked rather than freed.
        // SAFETY: the QP is live; nothing else uses it (we are in drop).
        if let Err(e) = unsafe { result::destroy_qp(self.pd.context().lib(), self.raw) } {
            tracing::error!(qpn = self.qpn, error = %e, "ibv_destroy_qp failed: leaking the regions of posted work");
            std::mem::forget(std::mem::take(&mut inner.outstanding));
        }
        drop(inner);
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qpn", &self.qpn)
            .field("state", &self.state())
            .finish()
    }
}

fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    (h.finish() & 0x00ff_ffff) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ack_timeout_follows_the_budget() {
        // 30 s over 8 attempts: 3.75 s each, 4.096 µs × 2^19 = 2.1 s.
        assert_eq!(ack_timeout_code(Duration::from_secs(30), 7), 19);
        assert_eq!(
            ack_timeout_code(Duration::from_millis(1), 7),
            14,
            "floor for slow links"
        );
        assert_eq!(
            ack_timeout_code(Duration::from_secs(24 * 3600), 7),
            24,
            "cap"
        );
        assert_eq!(ack_timeout_code(Duration::ZERO, 7), 14);
    }

    #[test]
    fn path_options_take_the_knobs() {
        let config = Config {
            traffic_class: 106,
            service_level: 3,
            ..Config::default()
        };
        let gid = GidChoice {
            index: 3,
            gid: [0; 16],
            reason: String::new(),
        };
        let p = PathOptions::new(1, &gid, &config);
        assert_eq!((p.gid_index, p.traffic_class, p.service_level), (3, 106, 3));
        assert!(p.rnr_retry < 7, "7 would retry forever");
        assert_eq!(p.retry_count, 7);
    }

    fn inner_with(ids: &[u64]) -> Inner {
        Inner {
            state: QpState::ReadyToSend,
            local_psn: 0,
            next_wr_id: 0,
            outstanding: ids
                .iter()
                .map(|&wr_id| Posted { wr_id, _keep: None })
                .collect(),
            unsignaled_run: 0,
            recv_posted: 2,
            next_recv_id: 0,
            failed: None,
            wc: Vec::new(),
        }
    }

    #[test]
    fn a_signalled_completion_retires_everything_before_it() {
        let mut inner = inner_with(&[1, 2, 3, 4, 5]);
        assert_eq!(retire(&mut inner, Raw::Send { wr_id: 3 }), 3);
        assert_eq!(inner.outstanding.len(), 2);
        assert_eq!(retire(&mut inner, Raw::Send { wr_id: 3 }), 0, "idempotent");
        assert_eq!(
            retire(
                &mut inner,
                Raw::Recv {
                    wr_id: RECV_WR_BIT,
                    immediate: None,
                    byte_len: 0
                }
            ),
            0
        );
        assert_eq!(inner.recv_posted, 1);
        assert_eq!(retire(&mut inner, Raw::Send { wr_id: 5 }), 2);
        assert!(inner.outstanding.is_empty());
    }

    #[test]
    fn psns_are_24_bit() {
        for _ in 0..100 {
            assert!(random_psn() <= 0x00ff_ffff);
        }
    }
}

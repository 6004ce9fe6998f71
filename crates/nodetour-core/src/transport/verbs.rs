//! The verbs transport: one RC queue pair per peer. Writes are RDMA WRITEs from registered slot
//! regions into the peer's granted regions; a notification is the immediate of the last
//! WRITE_WITH_IMM, which completes at the receiver after every earlier write on the queue pair.
//! Bounds are the NIC's business: a grant carries the region's remote key and window, and the
//! peer's NIC refuses anything outside it.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use super::{Armed, Event, HostConnection, SlotGrant, SlotRegion, SlotRegistration, TransportKind};
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::verbs::{
    Completion, Endpoint, GidChoice, PathOptions, ProtectionDomain, QueuePair, QueuePairOptions,
};

/// A queue pair made for one peer, not yet connected (its endpoint goes to the peer first).
pub struct PreparedVerbs {
    qp: QueuePair,
    recv_depth: u32,
}

impl PreparedVerbs {
    /// A queue pair for one peer of a ring on `local`'s device and port (64 writes and 16
    /// receives outstanding), and the encoded endpoint description to send that peer.
    pub fn for_peer(local: &crate::verbs::LocalSide) -> Result<(PreparedVerbs, Vec<u8>)> {
        Self::for_peer_with(
            local,
            QueuePairOptions {
                send_depth: 64,
                recv_depth: 16,
                max_inline: 0,
            },
        )
    }

    /// [`Self::for_peer`] with the queue depths of `options` (a link whose peer may send more
    /// notifications between two polls than the default keeps receives posted for).
    pub fn for_peer_with(
        local: &crate::verbs::LocalSide,
        options: QueuePairOptions,
    ) -> Result<(PreparedVerbs, Vec<u8>)> {
        let q = PreparedVerbs::new(&local.pd, local.port.port, options)?;
        let e = crate::verbs::EndpointDescription {
            endpoint: q.endpoint(&local.gid),
            regions: vec![],
        }
        .encode()?;
        Ok((q, e))
    }

    /// Creates the queue pair on `port` of `pd`'s device and posts its receives.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        port: u8,
        options: QueuePairOptions,
    ) -> Result<PreparedVerbs> {
        let qp = QueuePair::new(pd, port, options)?;
        qp.post_receives(options.recv_depth)?;
        Ok(PreparedVerbs {
            qp,
            recv_depth: options.recv_depth,
        })
    }

    /// What the peer needs to connect to it.
    pub fn endpoint(&self, gid: &GidChoice) -> Endpoint {
        self.qp.endpoint(gid)
    }

    /// Connects to the peer's queue pair. Writes may start once the peer has connected too (a
    /// barrier between the two, such as the bootstrap's).
    pub fn connect(
        self,
        remote: &Endpoint,
        path: &PathOptions,
        peer: String,
        timeout: Duration,
    ) -> Result<VerbsConnection> {
        self.qp.connect(remote, path)?;
        Ok(VerbsConnection {
            qp: self.qp,
            peer,
            timeout,
            events: VecDeque::new(),
            completions: Vec::new(),
            recv_depth: self.recv_depth,
            armed: false,
        })
    }
}

/// A verbs connection to one peer.
pub struct VerbsConnection {
    qp: QueuePair,
    peer: String,
    timeout: Duration,
    events: VecDeque<Event>,
    completions: Vec<Completion>,
    recv_depth: u32,
    /// Armed for a wait over many connections ([`HostConnection::arm`]): the next poll takes
    /// the channel's event.
    armed: bool,
}

impl VerbsConnection {
    /// The peer.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Moves completions into events, reposting a receive for every notification consumed.
    fn absorb(&mut self) -> Result<()> {
        let mut reposts = 0;
        for c in self.completions.drain(..) {
            if let Completion::WriteWithImmediate { immediate, .. } = c {
                self.events.push_back(Event::Notified(immediate));
                reposts += 1;
            }
        }
        let room = self.recv_depth - self.qp.posted_receives();
        if reposts > 0 && room > 0 {
            self.qp.post_receives(room)?;
        }
        Ok(())
    }

    /// Posts the write (split at the port's message size), then, if `wait`, waits until the
    /// NIC is done with the source.
    fn put(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
        wait: bool,
    ) -> Result<()> {
        let mr = src.registration().ok_or_else(|| Error::InvalidArgument {
            reason: "the verbs transport writes only from registered slot regions".into(),
        })?;
        let remote = dst.remote.ok_or_else(|| Error::InvalidArgument {
            reason: "the grant carries no RDMA window".into(),
        })?;
        let max = (self.qp.port().max_message_size as usize).max(4096);
        let mut at = range.start;
        let deadline = Deadline::after(self.timeout);
        loop {
            let end = (at + max).min(range.end);
            let last = end == range.end;
            let off = dst_offset + (at - range.start) as u64;
            let imm = if last { notify } else { None };
            // From host or GPU memory alike (the NIC reads GPU send slots directly).
            let posted = match mr {
                SlotRegistration::Host(r) => {
                    self.qp.post_write(r, at..end, &remote, off, imm, last)
                }
                SlotRegistration::Device(r) => {
                    self.qp.post_write(r, at..end, &remote, off, imm, last)
                }
            };
            match posted {
                Ok(_) => {
                    if last {
                        break;
                    }
                    at = end;
                }
                Err(Error::SendQueueFull { .. }) => {
                    self.qp.wait(&mut self.completions, deadline)?;
                    self.absorb()?;
                }
                Err(e) => return Err(e),
            }
        }
        // A zero-length write (a notification: a grant, an end notice) has no source to protect,
        // and a post's caller protects its source itself: return at once, the completions are
        // reaped by the next wait or poll. (Waiting here would hold a failing rank for the
        // retry timeout of a peer that is already gone.)
        if range.is_empty() || !wait {
            return Ok(());
        }
        // The source may be reused on return: wait until the NIC is done with it.
        while self.qp.outstanding_sends() > 0 {
            self.qp.wait(&mut self.completions, deadline)?;
            self.absorb()?;
        }
        Ok(())
    }
}

impl HostConnection for VerbsConnection {
    fn kind(&self) -> TransportKind {
        TransportKind::Verbs
    }

    fn grant(&mut self, region: &SlotRegion) -> Result<SlotGrant> {
        let mr = region.registration().ok_or_else(|| Error::InvalidArgument {
            reason: "the verbs transport grants only registered slot regions (SlotRegion::registered or ::device)".into(),
        })?;
        Ok(SlotGrant {
            key: region.key(),
            len: region.len() as u64,
            remote: Some(mr.remote()),
        })
    }

    fn write(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()> {
        self.put(src, range, dst, dst_offset, notify, true)
    }

    /// Returns once the work requests are posted: the queue pair holds the source region until
    /// their completions retire them (reaped by later polls and waits).
    fn post(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()> {
        self.put(src, range, dst, dst_offset, notify, false)
    }

    /// A notice without bytes (a grant, a release, an end notice) is posted: no source to
    /// hold, so nothing to wait for; a write with bytes waits as [`Self::write`] does.
    fn write_deferred(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()> {
        let wait = !range.is_empty();
        self.put(src, range, dst, dst_offset, notify, wait)
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<()> {
        if std::mem::take(&mut self.armed) {
            self.qp.after_wake()?;
        }
        self.qp.poll(&mut self.completions)?;
        self.absorb()?;
        events.extend(self.events.drain(..));
        Ok(())
    }

    fn arm(&mut self) -> Result<Armed> {
        let fds = self.qp.arm()?;
        self.armed = true;
        // What completed before the arming raises no event: look once more.
        self.qp.poll(&mut self.completions)?;
        self.absorb()?;
        Ok(if self.events.is_empty() {
            Armed::Fds(fds)
        } else {
            Armed::Pending
        })
    }

    fn wait(&mut self, events: &mut Vec<Event>, deadline: Deadline) -> Result<()> {
        while self.events.is_empty() {
            self.qp.wait(&mut self.completions, deadline)?;
            self.absorb()?;
        }
        events.extend(self.events.drain(..));
        Ok(())
    }
}

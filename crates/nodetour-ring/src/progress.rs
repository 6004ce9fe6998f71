//! The progress engine of a network link in the GPU ring (issue 15): what a progress thread does
//! between a GPU stream and the wire, as two pure state machines, one per end of the link. No
//! I/O, no clocks, no CUDA: the thread feeds in what it observed and performs what comes out.
//! See `docs/network-link-design.md`.
//!
//! Sequence numbers count chunks on the link from 0 and never wrap (u64); chunk `k` uses slot
//! `k mod slots` of the receiver.
//!
//! **Sender** ([`SendEnd`]): the send stream stores `sent = k + 1` once chunk `k` is in the send
//! slot (or ready in the caller's registered buffer); the receiver's credit says how many chunks
//! its stream has released. Chunk `k` is written (RDMA WRITE_WITH_IMM, imm = `k`) once it is
//! sent by the stream and its slot is free: `k + 1 − slots ≤ credit`. Writes go out in order.
//!
//! **Receiver** ([`RecvEnd`]): a write lands (its completion names `k`); it must be the next one
//! in order and inside the slots this end granted, else the peer broke the protocol. Once landed
//! and, where the GPU needs it, flushed (see `nodetour_core::visibility`), the receive stream is
//! released: `ready = k + 1`. When the stream has read a slot it stores `released = k + 1`; the
//! engine sends that credit back.
//!
//! Both ends stop on abort or a lost peer and never act afterwards: no write without credit, no
//! write after an abort, no `ready` past a chunk that is not landed and visible, no credit for a
//! slot the stream still reads.

/// Why an end stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Stop {
    /// This rank aborted.
    Aborted,
    /// The peer is gone (or told us it aborted).
    PeerLost,
    /// A write or a completion failed on the wire.
    Wire {
        /// What failed.
        reason: String,
    },
    /// The peer broke the protocol.
    Protocol {
        /// What it did.
        reason: String,
    },
}

/// What the sender's progress thread does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendAction {
    /// Post the write of chunk `seq` into the receiver's slot `slot` (imm = `seq`).
    Write {
        /// The chunk.
        seq: u64,
        /// The receiver's slot.
        slot: u32,
    },
    /// Stopped: fail the collective with this.
    Stop(Stop),
}

/// The sending end of a network link.
#[derive(Clone, Debug)]
pub struct SendEnd {
    slots: u64,
    /// Chunks the stream has made ready.
    sent_by_stream: u64,
    /// Chunks whose write was posted.
    posted: u64,
    /// Chunks whose write completed.
    completed: u64,
    /// Chunks the receiver's stream has released.
    credit: u64,
    stopped: Option<Stop>,
    reported: bool,
}

impl SendEnd {
    /// A link end with `slots` receive slots at the peer (≥ 1).
    pub fn new(slots: u32) -> SendEnd {
        SendEnd {
            slots: u64::from(slots.max(1)),
            sent_by_stream: 0,
            posted: 0,
            completed: 0,
            credit: 0,
            stopped: None,
            reported: false,
        }
    }

    fn stop(&mut self, why: Stop) {
        self.stopped.get_or_insert(why);
    }

    /// The stream stored `sent = n` (values only grow; an older one is ignored).
    pub fn stream_sent(&mut self, n: u64) {
        self.sent_by_stream = self.sent_by_stream.max(n);
    }

    /// The receiver's credit word reads `n`. More credit than chunks sent is a protocol
    /// violation (the peer released a slot it never received).
    pub fn credit(&mut self, n: u64) {
        if n > self.completed.max(self.posted) {
            self.stop(Stop::Protocol {
                reason: format!("credit for {n} chunks, {} were written", self.posted),
            });
            return;
        }
        self.credit = self.credit.max(n);
    }

    /// The write of chunk `seq` completed (`ok`), or failed.
    pub fn write_completed(&mut self, seq: u64, ok: bool) {
        if !ok {
            self.stop(Stop::Wire {
                reason: format!("the write of chunk {seq} failed"),
            });
            return;
        }
        if seq != self.completed || seq >= self.posted {
            self.stop(Stop::Protocol {
                reason: format!(
                    "completion of chunk {seq}, expected {} ({} posted)",
                    self.completed, self.posted
                ),
            });
            return;
        }
        self.completed += 1;
    }

    /// This rank aborts: nothing more is posted.
    pub fn abort(&mut self) {
        self.stop(Stop::Aborted);
    }

    /// The peer is gone.
    pub fn peer_lost(&mut self) {
        self.stop(Stop::PeerLost);
    }

    /// Chunks written and completed.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// The credit accepted so far (chunks the receiver's stream released).
    pub fn credited(&self) -> u64 {
        self.credit
    }

    /// Whether the end stopped.
    pub fn is_stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// The next thing to do, if any.
    pub fn poll(&mut self) -> Option<SendAction> {
        if let Some(why) = &self.stopped {
            if self.reported {
                return None;
            }
            self.reported = true;
            return Some(SendAction::Stop(why.clone()));
        }
        let k = self.posted;
        let slot_free = k < self.credit + self.slots;
        if k < self.sent_by_stream && slot_free {
            self.posted += 1;
            return Some(SendAction::Write {
                seq: k,
                slot: (k % self.slots) as u32,
            });
        }
        None
    }
}

/// What the receiver's progress thread does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecvAction {
    /// Make chunks up to `upto` (exclusive) visible to the GPU (an RDMA read on the loopback
    /// queue pair, or `cuFlushGPUDirectRDMAWrites`), then report [`RecvEnd::flushed`].
    Flush {
        /// Chunks below this have landed.
        upto: u64,
    },
    /// Store `ready = n` where the receive stream waits.
    Ready(u64),
    /// Send the credit `n` (the stream released chunks below `n`).
    Credit(u64),
    /// Stopped: fail the collective with this.
    Stop(Stop),
}

/// The receiving end of a network link.
#[derive(Clone, Debug)]
pub struct RecvEnd {
    slots: u64,
    flush: bool,
    /// Chunks landed (in order).
    landed: u64,
    /// A flush in flight up to this.
    flushing: Option<u64>,
    /// Chunks made visible.
    visible: u64,
    /// `ready` stored so far.
    ready: u64,
    /// Chunks the stream released.
    released: u64,
    /// Credit sent so far.
    credited: u64,
    stopped: Option<Stop>,
    reported: bool,
}

impl RecvEnd {
    /// A link end granting `slots` receive slots; `flush`: the GPU needs a flush before it reads
    /// a landed chunk (host slots and GPUs with owner ordering do not).
    pub fn new(slots: u32, flush: bool) -> RecvEnd {
        RecvEnd {
            slots: u64::from(slots.max(1)),
            flush,
            landed: 0,
            flushing: None,
            visible: 0,
            ready: 0,
            released: 0,
            credited: 0,
            stopped: None,
            reported: false,
        }
    }

    fn stop(&mut self, why: Stop) {
        self.stopped.get_or_insert(why);
    }

    /// A write landed, its completion naming chunk `seq`. Only the next chunk, and only into a
    /// slot this end granted (the stream released what the slot held before), is accepted.
    pub fn landed(&mut self, seq: u64) {
        if seq != self.landed {
            self.stop(Stop::Protocol {
                reason: format!("chunk {seq} landed, expected {}", self.landed),
            });
            return;
        }
        if seq >= self.credited + self.slots {
            self.stop(Stop::Protocol {
                reason: format!(
                    "chunk {seq} written into slot {} before it was released (credit {})",
                    seq % self.slots,
                    self.credited
                ),
            });
            return;
        }
        self.landed += 1;
    }

    /// The flush asked for completed (`ok`), or failed.
    pub fn flushed(&mut self, ok: bool) {
        let Some(upto) = self.flushing.take() else {
            self.stop(Stop::Protocol {
                reason: "a flush completed that was not asked for".into(),
            });
            return;
        };
        if !ok {
            self.stop(Stop::Wire {
                reason: format!("the flush of chunks below {upto} failed"),
            });
            return;
        }
        self.visible = self.visible.max(upto);
    }

    /// The stream stored `released = n` (values only grow). More than it was made ready for is
    /// a bug here, not the peer's: it stops the end.
    pub fn stream_released(&mut self, n: u64) {
        if n > self.ready {
            self.stop(Stop::Protocol {
                reason: format!("the stream released {n} chunks, {} were ready", self.ready),
            });
            return;
        }
        self.released = self.released.max(n);
    }

    /// A receive or completion error on the wire.
    pub fn wire_failed(&mut self, reason: String) {
        self.stop(Stop::Wire { reason });
    }

    /// This rank aborts.
    pub fn abort(&mut self) {
        self.stop(Stop::Aborted);
    }

    /// The peer is gone.
    pub fn peer_lost(&mut self) {
        self.stop(Stop::PeerLost);
    }

    /// Chunks landed so far (the next one expected).
    pub fn landed_count(&self) -> u64 {
        self.landed
    }

    /// Credit sent so far.
    pub fn credited(&self) -> u64 {
        self.credited
    }

    /// Whether the end stopped.
    pub fn is_stopped(&self) -> bool {
        self.stopped.is_some()
    }

    /// The next thing to do, if any.
    pub fn poll(&mut self) -> Option<RecvAction> {
        if let Some(why) = &self.stopped {
            if self.reported {
                return None;
            }
            self.reported = true;
            return Some(RecvAction::Stop(why.clone()));
        }
        if !self.flush {
            self.visible = self.landed;
        } else if self.flushing.is_none() && self.visible < self.landed {
            self.flushing = Some(self.landed);
            return Some(RecvAction::Flush { upto: self.landed });
        }
        if self.ready < self.visible {
            self.ready = self.visible;
            return Some(RecvAction::Ready(self.ready));
        }
        if self.credited < self.released {
            self.credited = self.released;
            return Some(RecvAction::Credit(self.credited));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sender_waits_for_the_stream_and_for_credit() {
        let mut s = SendEnd::new(2);
        assert_eq!(s.poll(), None);
        s.stream_sent(3);
        assert_eq!(s.poll(), Some(SendAction::Write { seq: 0, slot: 0 }));
        assert_eq!(s.poll(), Some(SendAction::Write { seq: 1, slot: 1 }));
        // Slot 0 is still the receiver's until it says so.
        assert_eq!(s.poll(), None);
        s.write_completed(0, true);
        s.credit(1);
        assert_eq!(s.poll(), Some(SendAction::Write { seq: 2, slot: 0 }));
        s.abort();
        s.stream_sent(10);
        s.credit(2);
        assert_eq!(s.poll(), Some(SendAction::Stop(Stop::Aborted)));
        assert_eq!(s.poll(), None);
    }

    #[test]
    fn the_receiver_flushes_before_release_and_credits_after_the_stream() {
        let mut r = RecvEnd::new(2, true);
        r.landed(0);
        r.landed(1);
        assert_eq!(r.poll(), Some(RecvAction::Flush { upto: 2 }));
        assert_eq!(r.poll(), None, "no release before the flush");
        r.flushed(true);
        assert_eq!(r.poll(), Some(RecvAction::Ready(2)));
        r.stream_released(1);
        assert_eq!(r.poll(), Some(RecvAction::Credit(1)));
        // A write into slot 1 again before chunk 1 was released: the peer broke the protocol.
        r.landed(2);
        r.landed(3);
        assert!(matches!(
            r.poll(),
            Some(RecvAction::Stop(Stop::Protocol { .. }))
        ));
    }

    #[test]
    fn out_of_order_and_unasked_events_are_protocol_errors() {
        let mut r = RecvEnd::new(4, false);
        r.landed(1);
        assert!(matches!(
            r.poll(),
            Some(RecvAction::Stop(Stop::Protocol { .. }))
        ));
        let mut r = RecvEnd::new(4, false);
        r.flushed(true);
        assert!(matches!(
            r.poll(),
            Some(RecvAction::Stop(Stop::Protocol { .. }))
        ));
        let mut s = SendEnd::new(4);
        s.credit(1);
        assert!(matches!(
            s.poll(),
            Some(SendAction::Stop(Stop::Protocol { .. }))
        ));
    }
}

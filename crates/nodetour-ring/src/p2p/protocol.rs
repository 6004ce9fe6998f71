//! One peer link's send and receive protocol, as a pure state machine: no I/O, no clocks.
//!
//! A link joins two ranks over one host connection. Each rank receives into `slots` slots of
//! `slot_bytes` it granted the peer at formation; every slot starts out the peer's to write (a
//! message's first chunks leave without waiting a round trip). A message (one `send`) goes in
//! chunks, each a [`Header`] then up to `slot_bytes - HEADER` bytes of payload, written into a
//! slot the sender holds and announced by a [`Notice::Data`]. The receiver copies a chunk out
//! into the matching `recv`'s memory once that `recv` is posted, then hands the slot back
//! ([`Notice::Credit`]). Messages match in order: the k-th send from a rank to a peer meets the
//! peer's k-th receive from that rank (NCCL's and MPI's order per pair).
//!
//! Agreement rides in the chunks: every header carries the message's sequence number, element
//! count and type, and the receiver checks them against its own receive before it copies a
//! byte. A receive that disagrees fails on the receiver ([`Failure::Disagreement`]) and tells
//! the sender ([`Notice::Disagree`], its own shape written first to the sender's bell), whose
//! send fails the same way: both sides typed, nothing truncated, no extra round trip. A send
//! completes once every chunk was credited back (the receiver has the bytes), so a send whose
//! receive never comes ends at the caller's deadline, not before.
//!
//! Inputs: [`Link::post_send`], [`Link::post_recv`], [`Link::handle_data`],
//! [`Link::handle_credit`], [`Link::handle_disagree`], [`Link::handle_end`], [`Link::fail`].
//! Outputs: [`Link::poll_action`]. Anything out of protocol from the peer (a slot it does not
//! hold, a chunk out of order, a header that does not fit) fails every part on the link, naming
//! the peer.

use std::collections::{HashMap, VecDeque};

use crate::reduce::DataType;

/// Bytes of a chunk's header at the start of its slot.
pub(crate) const HEADER: usize = 32;

/// Identifies a posted send or receive (the caller's).
pub(crate) type PartId = u64;

/// What a message holds: its element count and type (what both sides must agree on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shape {
    /// Elements.
    pub count: u64,
    /// Their type.
    pub dtype: DataType,
}

impl Shape {
    /// Bytes, or `None` past `u64`.
    pub(crate) fn bytes(self) -> Option<u64> {
        self.count.checked_mul(self.dtype.size() as u64)
    }

    /// `count u64 | dtype u8`, for the bell.
    pub(crate) fn encode(self) -> [u8; 9] {
        let mut b = [0u8; 9];
        b[..8].copy_from_slice(&self.count.to_be_bytes());
        b[8] = dtype_code(self.dtype);
        b
    }

    /// The inverse of [`Self::encode`] (`None`: not a shape).
    pub(crate) fn decode(b: &[u8]) -> Option<Shape> {
        let count = u64::from_be_bytes(b.get(..8)?.try_into().ok()?);
        let dtype = *DataType::ALL.get(usize::from(*b.get(8)?))?;
        Some(Shape { count, dtype })
    }
}

fn dtype_code(d: DataType) -> u8 {
    DataType::ALL.iter().position(|x| *x == d).unwrap_or(0) as u8
}

/// A chunk's header: `seq u32 | dtype u8 | 0 0 0 | count u64 | offset u64 | len u32 | 0 0 0 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Header {
    /// The message's sequence number on this direction of the link.
    pub seq: u32,
    /// The message's shape.
    pub shape: Shape,
    /// Where the chunk's payload goes in the message, in bytes.
    pub offset: u64,
    /// Payload bytes.
    pub len: u32,
}

impl Header {
    /// The wire form.
    pub(crate) fn encode(self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[..4].copy_from_slice(&self.seq.to_be_bytes());
        b[4] = dtype_code(self.shape.dtype);
        b[8..16].copy_from_slice(&self.shape.count.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// The inverse of [`Self::encode`] (`None`: not a header: an unknown type, or bytes set
    /// that must be zero).
    pub(crate) fn decode(b: &[u8; HEADER]) -> Option<Header> {
        if b[5..8] != [0, 0, 0] || b[28..] != [0, 0, 0, 0] {
            return None;
        }
        let word = |r: std::ops::Range<usize>| {
            let mut x = [0u8; 8];
            x[8 - r.len()..].copy_from_slice(&b[r]);
            u64::from_be_bytes(x)
        };
        Some(Header {
            seq: word(0..4) as u32,
            shape: Shape {
                count: word(8..16),
                dtype: *DataType::ALL.get(usize::from(b[4]))?,
            },
            offset: word(16..24),
            len: word(24..28) as u32,
        })
    }
}

/// A link's notification word: `kind:4 | value:28`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Notice {
    /// A chunk landed in this slot of the receiver's.
    Data { slot: u32 },
    /// The receiver copied this slot out: the sender holds it again.
    Credit { slot: u32 },
    /// The receiver's receive of this message (its sequence number, mod 2^28) disagrees; its
    /// shape is in the sender's bell.
    Disagree { seq: u32 },
    /// The peer ended the link (a failure, an abort, its close): `cause` says which.
    End { cause: u32 },
}

const VALUE: u32 = (1 << 28) - 1;

impl Notice {
    /// The wire form.
    pub(crate) fn encode(self) -> u32 {
        let (kind, value) = match self {
            Notice::Data { slot } => (1, slot),
            Notice::Credit { slot } => (2, slot),
            Notice::Disagree { seq } => (3, seq),
            Notice::End { cause } => (4, cause),
        };
        (kind << 28) | (value & VALUE)
    }

    /// The inverse of [`Self::encode`] (`None`: no such kind).
    pub(crate) fn decode(v: u32) -> Option<Notice> {
        let value = v & VALUE;
        Some(match v >> 28 {
            1 => Notice::Data { slot: value },
            2 => Notice::Credit { slot: value },
            3 => Notice::Disagree { seq: value },
            4 => Notice::End { cause: value },
            _ => return None,
        })
    }
}

/// Why a part failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The send and its receive disagree on the message's shape.
    Disagreement {
        /// This side's shape.
        ours: Shape,
        /// The peer's.
        theirs: Shape,
    },
    /// The peer broke the protocol.
    Protocol(String),
    /// The peer ended the link (its cause word).
    Ended(u32),
    /// This side ended the link (an abort, a timeout, another part's failure).
    Local(String),
}

/// What the link wants done, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Write `header` then `header.len` bytes of send `id` from `header.offset` into the
    /// peer's slot `slot`, then notify [`Notice::Data`] for it.
    Write {
        id: PartId,
        slot: u32,
        header: Header,
    },
    /// Copy `len` bytes of this side's slot `slot` (after its header) into receive `id` at
    /// `offset`, then notify [`Notice::Credit`] for it ([`Link::handle_copied`] is not needed:
    /// the slot is the peer's once the credit leaves).
    CopyOut {
        id: PartId,
        slot: u32,
        offset: u64,
        len: u32,
    },
    /// Write this side's shape to the peer's bell, then notify [`Notice::Disagree`].
    Disagree { seq: u32, ours: Shape },
    /// Notify [`Notice::End`] (the link is over).
    End { cause: u32 },
    /// The part finished: a send's every byte is with the receiver; a receive's every byte is
    /// in its memory.
    Done(PartId),
    /// The part failed.
    Failed(PartId, Failure),
}

/// A send not yet acknowledged in full.
struct OutMsg {
    id: PartId,
    seq: u32,
    shape: Shape,
    bytes: u64,
    /// The next byte to write.
    written: u64,
    /// Whether its (only, for an empty message) header-only chunk left.
    started: bool,
    /// Chunks written and not yet credited.
    out: u32,
}

/// A receive not yet complete.
struct InMsg {
    id: PartId,
    seq: u32,
    shape: Shape,
    bytes: u64,
    /// The next byte expected.
    offset: u64,
    started: bool,
}

/// One peer link's protocol state: both directions.
pub(crate) struct Link {
    slots: u32,
    payload: u64,
    // --- sending ---
    /// The peer's slots this side may write.
    free: VecDeque<u32>,
    /// Sends in order; the front ones may be fully written and awaiting credits.
    sends: VecDeque<OutMsg>,
    /// Which send each written slot carries.
    carrying: HashMap<u32, PartId>,
    next_send_seq: u32,
    // --- receiving ---
    /// Whether the peer holds each of this side's slots.
    peer_holds: Vec<bool>,
    /// Chunks landed and not yet copied out, in arrival order.
    landed: VecDeque<(u32, Header)>,
    recvs: VecDeque<InMsg>,
    next_recv_seq: u32,
    /// The sequence number of the next message's first chunk to land.
    next_landing_seq: u32,
    /// The message landing now, and where its next chunk starts (`None`: a new message).
    landing: Option<(Shape, u64)>,
    actions: VecDeque<Action>,
    /// Set once the link failed: every later part fails with it.
    failed: Option<Failure>,
}

impl Link {
    /// A link whose two sides each receive into `slots` slots of `slot_bytes` (both agreed at
    /// formation; `slot_bytes > HEADER`, `1 <= slots < 2^28`).
    pub(crate) fn new(slots: u32, slot_bytes: usize) -> Link {
        assert!(
            slot_bytes > HEADER && (1..=VALUE).contains(&slots),
            "a link's shape"
        );
        Link {
            slots,
            payload: (slot_bytes - HEADER) as u64,
            free: (0..slots).collect(),
            sends: VecDeque::new(),
            carrying: HashMap::new(),
            next_send_seq: 0,
            peer_holds: vec![true; slots as usize],
            landed: VecDeque::new(),
            recvs: VecDeque::new(),
            next_recv_seq: 0,
            next_landing_seq: 0,
            landing: None,
            actions: VecDeque::new(),
            failed: None,
        }
    }

    /// Whether the link failed (and why).
    #[cfg(test)]
    pub(crate) fn failure(&self) -> Option<&Failure> {
        self.failed.as_ref()
    }

    /// Whether any part is still open.
    pub(crate) fn is_idle(&self) -> bool {
        self.sends.is_empty() && self.recvs.is_empty()
    }

    /// Posts a send of `shape` (its bytes are read by the [`Action::Write`]s that follow).
    pub(crate) fn post_send(&mut self, id: PartId, shape: Shape) {
        let Some((seq, bytes)) = self.admit(id, shape, true) else {
            return;
        };
        self.sends.push_back(OutMsg {
            id,
            seq,
            shape,
            bytes,
            written: 0,
            started: false,
            out: 0,
        });
        self.pump_sends();
    }

    /// Posts a receive of `shape` (written by the [`Action::CopyOut`]s that follow).
    pub(crate) fn post_recv(&mut self, id: PartId, shape: Shape) {
        let Some((seq, bytes)) = self.admit(id, shape, false) else {
            return;
        };
        self.recvs.push_back(InMsg {
            id,
            seq,
            shape,
            bytes,
            offset: 0,
            started: false,
        });
        self.pump_recvs();
    }

    /// A part's sequence number (in its direction) and bytes, or `None` where it fails at
    /// once: the link failed before, or its bytes overflow.
    fn admit(&mut self, id: PartId, shape: Shape, send: bool) -> Option<(u32, u64)> {
        if let Some(f) = &self.failed {
            self.actions.push_back(Action::Failed(id, f.clone()));
            return None;
        }
        let Some(bytes) = shape.bytes() else {
            let why = format!(
                "{} elements of {} overflow",
                shape.count,
                shape.dtype.name()
            );
            self.actions
                .push_back(Action::Failed(id, Failure::Local(why)));
            return None;
        };
        let next = if send {
            &mut self.next_send_seq
        } else {
            &mut self.next_recv_seq
        };
        let seq = *next;
        *next = seq.wrapping_add(1);
        Some((seq, bytes))
    }

    /// A [`Notice::Data`] arrived for `slot`, whose header reads `header` (`None`: the bytes
    /// are not a header).
    pub(crate) fn handle_data(&mut self, slot: u32, header: Option<Header>) {
        if self.failed.is_some() {
            return;
        }
        if slot >= self.slots || !self.peer_holds[slot as usize] {
            return self.violation(format!("wrote slot {slot}, which it did not hold"));
        }
        let Some(h) = header else {
            return self.violation(format!("wrote a malformed header into slot {slot}"));
        };
        if let Err(why) = self.check_landing(&h) {
            return self.violation(why);
        }
        self.peer_holds[slot as usize] = false;
        self.landed.push_back((slot, h));
        self.pump_recvs();
    }

    /// A [`Notice::Credit`] arrived: the peer copied `slot` out.
    pub(crate) fn handle_credit(&mut self, slot: u32) {
        if self.failed.is_some() {
            return;
        }
        let Some(id) = self.carrying.remove(&slot) else {
            return self.violation(format!("credited slot {slot}, which carried nothing"));
        };
        self.free.push_back(slot);
        if let Some(m) = self.sends.iter_mut().find(|m| m.id == id) {
            m.out -= 1;
        }
        while let Some(m) = self.sends.front() {
            let done = m.started && m.written == m.bytes && m.out == 0;
            if !done {
                break;
            }
            self.actions.push_back(Action::Done(m.id));
            self.sends.pop_front();
        }
        self.pump_sends();
    }

    /// A [`Notice::Disagree`] arrived for message `seq` (mod 2^28), with the receiver's shape
    /// read from this side's bell (`None`: unreadable).
    pub(crate) fn handle_disagree(&mut self, seq: u32, theirs: Option<Shape>) {
        if self.failed.is_some() {
            return;
        }
        let Some(theirs) = theirs else {
            return self.violation("said it disagrees, with no shape".into());
        };
        let Some(m) = self.sends.iter().find(|m| m.seq & VALUE == seq) else {
            return self.violation(format!("disagreed with message {seq}, not in flight"));
        };
        let f = Failure::Disagreement {
            ours: m.shape,
            theirs,
        };
        self.fail_all(f, None);
    }

    /// A [`Notice::End`] arrived: the peer ended the link.
    pub(crate) fn handle_end(&mut self, cause: u32) {
        if self.failed.is_none() {
            self.fail_all(Failure::Ended(cause), None);
        }
    }

    /// This side ends the link (an abort, a timeout, another part failing): every open part
    /// fails, and the peer is told with `cause`.
    pub(crate) fn fail(&mut self, why: String, cause: u32) {
        if self.failed.is_none() {
            self.fail_all(Failure::Local(why), Some(cause));
        }
    }

    /// The next thing to do.
    pub(crate) fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// Checks that `h` is the next chunk of the messages landing in order.
    fn check_landing(&mut self, h: &Header) -> Result<(), String> {
        let bytes = h
            .shape
            .bytes()
            .ok_or_else(|| format!("sent a header of {} elements", h.shape.count))?;
        let offset = match self.landing {
            Some((shape, _)) if shape != h.shape => {
                return Err(format!(
                    "changed message {}'s shape between its chunks",
                    h.seq
                ));
            }
            Some((_, at)) => at,
            None => 0,
        };
        if h.seq != self.next_landing_seq || h.offset != offset {
            return Err(format!(
                "sent message {} at byte {}, expected message {} at byte {offset}",
                h.seq, h.offset, self.next_landing_seq
            ));
        }
        let want = (bytes - offset).min(self.payload);
        if u64::from(h.len) != want {
            return Err(format!(
                "sent a chunk of {} bytes at byte {offset} of {bytes}, expected {want}",
                h.len
            ));
        }
        let end = offset + want;
        if end == bytes {
            self.landing = None;
            self.next_landing_seq = h.seq.wrapping_add(1);
        } else {
            self.landing = Some((h.shape, end));
        }
        Ok(())
    }

    fn pump_sends(&mut self) {
        let payload = self.payload;
        for m in self.sends.iter_mut() {
            while m.written < m.bytes || !m.started {
                let Some(slot) = self.free.pop_front() else {
                    return;
                };
                let len = (m.bytes - m.written).min(payload);
                let header = Header {
                    seq: m.seq,
                    shape: m.shape,
                    offset: m.written,
                    len: len as u32,
                };
                m.written += len;
                m.started = true;
                m.out += 1;
                self.carrying.insert(slot, m.id);
                self.actions.push_back(Action::Write {
                    id: m.id,
                    slot,
                    header,
                });
            }
        }
    }

    fn pump_recvs(&mut self) {
        while let (Some(r), Some(&(slot, h))) = (self.recvs.front_mut(), self.landed.front()) {
            if h.seq != r.seq {
                // Landing checked the order, so this is the peer's send with no receive of
                // this side's to meet it: a count of sends and receives that differ.
                let why = format!(
                    "sent message {} while this rank waits for message {}",
                    h.seq, r.seq
                );
                return self.violation(why);
            }
            if !r.started && h.shape != r.shape {
                let (seq, ours, theirs) = (r.seq, r.shape, h.shape);
                let f = Failure::Disagreement { ours, theirs };
                self.actions.push_back(Action::Disagree { seq, ours });
                return self.fail_all(f, None);
            }
            r.started = true;
            self.landed.pop_front();
            // The slot goes back to the peer with the credit that follows the copy.
            self.peer_holds[slot as usize] = true;
            self.actions.push_back(Action::CopyOut {
                id: r.id,
                slot,
                offset: h.offset,
                len: h.len,
            });
            r.offset += u64::from(h.len);
            if r.offset == r.bytes {
                self.actions.push_back(Action::Done(r.id));
                self.recvs.pop_front();
            }
        }
    }

    fn violation(&mut self, why: String) {
        self.fail_all(Failure::Protocol(why), Some(END_PROTOCOL));
    }

    /// Fails every open part with `f` (and tells the peer with `cause`, where given).
    fn fail_all(&mut self, f: Failure, cause: Option<u32>) {
        if let Some(cause) = cause {
            self.actions.push_back(Action::End { cause });
        }
        for m in self.sends.drain(..) {
            self.actions.push_back(Action::Failed(m.id, f.clone()));
        }
        for r in self.recvs.drain(..) {
            self.actions.push_back(Action::Failed(r.id, f.clone()));
        }
        self.landed.clear();
        self.carrying.clear();
        self.free.clear();
        self.failed = Some(f);
    }
}

/// The cause word of an end for a protocol violation.
pub(crate) const END_PROTOCOL: u32 = 1;

//! One formed peer link on host memory: the connection, the memory it writes from and receives
//! into, and the protocol ([`super::protocol::Link`]) whose actions it carries out.
//!
//! Memory: this rank receives into `slots × slot_bytes` of slots and a bell (the peer's shape
//! when it disagrees), granted to the peer alone; it writes each chunk from a staging slot of
//! its own (the caller's memory is never registered or exposed). Both are host memory, read and
//! written only by copies (`SlotRegion::read_at` / `write_at`), never as slices.

use std::collections::HashMap;
use std::ops::Range;

use nodetour_core::transport::{Event, HostConnection, SlotGrant, SlotRegion};

use super::protocol::{Action, Failure, HEADER, Header, Link, Notice, PartId, Shape};
use crate::error::{Error, Result};

/// Bytes of the bell (a [`Shape`], with room).
pub(crate) const BELL: usize = 64;

/// The memory a part lends the link: a send's bytes, or a receive's.
pub(crate) enum PartMemory<'a> {
    Send(&'a [u8]),
    Recv(&'a mut [u8]),
}

/// A formed link to one peer.
pub(crate) struct PeerLink {
    pub(crate) peer: u32,
    // Drop order: the connection (queue pair drained, socket closed) before the regions it
    // may write.
    conn: Box<dyn HostConnection>,
    /// This rank's slots, then its bell (granted to the peer).
    inbox: SlotRegion,
    /// The peer's slots, then its bell.
    theirs: SlotGrant,
    /// One chunk, staged before it is written (local only).
    staging: SlotRegion,
    slot_bytes: usize,
    slots: u32,
    pub(crate) link: Link,
}

/// How a part ended, by id.
pub(crate) type Ended = HashMap<PartId, std::result::Result<(), Failure>>;

impl PeerLink {
    /// A link over `conn` whose inbox is `inbox` (`slots × slot_bytes` then [`BELL`] bytes) and
    /// whose peer granted `theirs` (checked by the caller to be exactly as long).
    pub(crate) fn new(
        peer: u32,
        conn: Box<dyn HostConnection>,
        inbox: SlotRegion,
        theirs: SlotGrant,
        staging: SlotRegion,
        (slots, slot_bytes): (u32, usize),
    ) -> PeerLink {
        PeerLink {
            peer,
            conn,
            inbox,
            theirs,
            staging,
            slot_bytes,
            slots,
            link: Link::new(slots, slot_bytes),
        }
    }

    /// Host memory the link holds on this rank (inbox and staging).
    pub(crate) fn memory_bytes(&self) -> u64 {
        (self.inbox.len() + self.staging.len()) as u64
    }

    /// The connection (to wait on several links at once).
    pub(crate) fn conn(&mut self) -> &mut dyn HostConnection {
        self.conn.as_mut()
    }

    /// Where slot `slot` starts in an inbox (this rank's or the peer's).
    fn slot_at(&self, slot: u32) -> usize {
        slot as usize * self.slot_bytes
    }

    /// Where the bell starts.
    fn bell_at(&self) -> usize {
        self.slots as usize * self.slot_bytes
    }

    /// One event from the peer.
    pub(crate) fn handle(&mut self, e: &Event) -> Result<()> {
        let Event::Notified(word) = *e;
        match Notice::decode(word) {
            Some(Notice::Data { slot }) => {
                let header = (slot < self.slots)
                    .then(|| {
                        let mut h = [0u8; HEADER];
                        self.inbox.read_at(self.slot_at(slot), &mut h).ok()?;
                        Header::decode(&h)
                    })
                    .flatten();
                self.link.handle_data(slot, header);
            }
            Some(Notice::Credit { slot }) => self.link.handle_credit(slot),
            Some(Notice::Disagree { seq }) => {
                let mut b = [0u8; 9];
                let theirs = self.inbox.read_at(self.bell_at(), &mut b).ok();
                self.link
                    .handle_disagree(seq, theirs.and_then(|()| Shape::decode(&b)));
            }
            Some(Notice::End { cause }) => self.link.handle_end(cause),
            None => self.link.fail(
                format!("rank {} sent notice {word:#x}, which is none", self.peer),
                super::protocol::END_PROTOCOL,
            ),
        }
        Ok(())
    }

    /// Carries out the protocol's actions with the parts' memory, recording how parts end.
    pub(crate) fn act(
        &mut self,
        memory: &mut HashMap<PartId, PartMemory<'_>>,
        ended: &mut Ended,
    ) -> Result<()> {
        while let Some(a) = self.link.poll_action() {
            match a {
                Action::Write { id, slot, header } => {
                    let Some(PartMemory::Send(src)) = memory.get(&id) else {
                        return Err(lost_part(id));
                    };
                    let range = part_range(header.offset, header.len, src.len())?;
                    self.staging.write_at(0, &header.encode())?;
                    self.staging.write_at(HEADER, &src[range])?;
                    let len = HEADER + header.len as usize;
                    let at = self.slot_at(slot) as u64;
                    let notice = Notice::Data { slot }.encode();
                    self.conn
                        .write(&self.staging, 0..len, &self.theirs, at, Some(notice))?;
                }
                Action::CopyOut {
                    id,
                    slot,
                    offset,
                    len,
                } => {
                    let Some(PartMemory::Recv(dst)) = memory.get_mut(&id) else {
                        return Err(lost_part(id));
                    };
                    let range = part_range(offset, len, dst.len())?;
                    let from = self.slot_at(slot) + HEADER;
                    self.inbox.read_at(from, &mut dst[range])?;
                    self.notify(Notice::Credit { slot })?;
                }
                Action::Disagree { seq, ours } => {
                    self.staging.write_at(0, &ours.encode())?;
                    let bell = self.bell_at() as u64;
                    let notice = Notice::Disagree { seq }.encode();
                    self.conn
                        .write(&self.staging, 0..9, &self.theirs, bell, Some(notice))?;
                }
                Action::End { cause } => {
                    // Best effort: the peer may be gone already.
                    let _ = self.notify(Notice::End { cause });
                }
                Action::Done(id) => {
                    ended.insert(id, Ok(()));
                }
                Action::Failed(id, f) => {
                    ended.insert(id, Err(f));
                }
            }
        }
        self.conn.flush()?;
        Ok(())
    }

    /// A notice with no bytes.
    fn notify(&mut self, n: Notice) -> Result<()> {
        let notice = Some(n.encode());
        Ok(self
            .conn
            .write_deferred(&self.staging, 0..0, &self.theirs, 0, notice)?)
    }
}

/// `offset..offset + len` within a part of `total` bytes (the protocol keeps it so; checked
/// again where memory is touched).
fn part_range(offset: u64, len: u32, total: usize) -> Result<Range<usize>> {
    let start = usize::try_from(offset).ok();
    let end = start.and_then(|s| s.checked_add(len as usize));
    match (start, end) {
        (Some(s), Some(e)) if e <= total => Ok(s..e),
        _ => Err(Error::InvalidArgument {
            reason: format!("a chunk at byte {offset} of {len} bytes past a part of {total}"),
        }),
    }
}

fn lost_part(id: PartId) -> Error {
    Error::InvalidArgument {
        reason: format!("part {id} has no memory lent"),
    }
}

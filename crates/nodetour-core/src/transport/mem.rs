//! The in-process transport: two endpoints in one process, writes are copies. A first-class
//! implementation of the interface, for tests of everything above the transports.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{Event, HostConnection, SlotGrant, SlotRegion, SlotTable, TransportKind};
use crate::deadline::Deadline;
use crate::error::{Error, Result};

#[derive(Default)]
struct Side {
    granted: SlotTable,
    events: Mutex<VecDeque<Event>>,
    arrived: Condvar,
    closed: AtomicBool,
}

/// One end of an in-process connection.
pub struct MemConnection {
    me: Arc<Side>,
    peer: Arc<Side>,
}

impl MemConnection {
    /// Two connected ends.
    pub fn pair() -> (MemConnection, MemConnection) {
        let (a, b) = (Arc::new(Side::default()), Arc::new(Side::default()));
        (
            MemConnection {
                me: a.clone(),
                peer: b.clone(),
            },
            MemConnection { me: b, peer: a },
        )
    }

    fn drain(&self, events: &mut Vec<Event>) -> Result<bool> {
        let mut q = self.me.events.lock().unwrap_or_else(|p| p.into_inner());
        let had = !q.is_empty();
        events.extend(q.drain(..));
        if !had && self.peer.closed.load(Ordering::SeqCst) {
            return Err(closed());
        }
        Ok(had)
    }
}

fn closed() -> Error {
    Error::Exchange {
        op: "receive",
        peer: "in-process peer".into(),
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            "the peer's end was dropped",
        ),
    }
}

impl HostConnection for MemConnection {
    fn kind(&self) -> TransportKind {
        TransportKind::Mem
    }

    fn grant(&mut self, region: &SlotRegion) -> Result<SlotGrant> {
        self.me.granted.insert(region)?;
        Ok(SlotGrant {
            key: region.key(),
            len: region.len() as u64,
            remote: None,
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
        if self.peer.closed.load(Ordering::SeqCst) {
            return Err(closed());
        }
        let len = range
            .end
            .checked_sub(range.start)
            .ok_or(Error::InvalidArgument {
                reason: "an inverted range".into(),
            })?;
        let (region, to) = self.peer.granted.target(dst.key, dst_offset, len as u64)?;
        // Under both regions' CPU locks (one for a region written into itself).
        src.copy_to(range.start, &region, to, len)?;
        if let Some(v) = notify {
            self.peer
                .events
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push_back(Event::Notified(v));
            self.peer.arrived.notify_all();
        }
        Ok(())
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<()> {
        self.drain(events).map(|_| ())
    }

    fn wait(&mut self, events: &mut Vec<Event>, deadline: Deadline) -> Result<()> {
        loop {
            if self.drain(events)? {
                return Ok(());
            }
            deadline.check(|| "an in-process notification".into())?;
            let q = self.me.events.lock().unwrap_or_else(|p| p.into_inner());
            if q.is_empty() {
                let wait = deadline.remaining().min(Duration::from_millis(100));
                drop(
                    self.me
                        .arrived
                        .wait_timeout(q, wait)
                        .unwrap_or_else(|p| p.into_inner()),
                );
            }
        }
    }
}

impl Drop for MemConnection {
    fn drop(&mut self) {
        self.me.closed.store(true, Ordering::SeqCst);
        self.peer.arrived.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::HostBuffer;

    #[test]
    fn writes_land_with_notifications_and_bounds_are_checked() {
        let (mut a, mut b) = MemConnection::pair();
        let target = SlotRegion::host(HostBuffer::new(4096).unwrap());
        let grant = a.grant(&target).unwrap();
        let src = SlotRegion::host(HostBuffer::new(4096).unwrap());
        src.write_at(0, b"hello").unwrap();
        b.write(&src, 0..5, &grant, 100, Some(9)).unwrap();
        let mut ev = Vec::new();
        a.wait(&mut ev, Deadline::after(Duration::from_secs(1)))
            .unwrap();
        assert_eq!(ev, [Event::Notified(9)]);
        let mut got = [0u8; 5];
        target.read_at(100, &mut got).unwrap();
        assert_eq!(&got, b"hello");
        assert!(
            b.write(&src, 0..5, &grant, 4092, None).is_err(),
            "past the end"
        );
        let forged = SlotGrant {
            key: src.key(),
            ..grant
        };
        assert!(
            b.write(&src, 0..5, &forged, 0, None).is_err(),
            "a key never granted to b"
        );
        assert!(matches!(
            a.wait(&mut Vec::new(), Deadline::after(Duration::from_millis(50))),
            Err(Error::Timeout { .. })
        ));
        drop(b);
        assert!(matches!(
            a.wait(&mut Vec::new(), Deadline::after(Duration::from_secs(1))),
            Err(Error::Exchange { .. })
        ));
    }
}

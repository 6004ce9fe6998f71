//! The receive side of a tcp connection: write frames parsed from the socket into the regions
//! granted on it, by whichever thread gets there first.
//!
//! Normally the connection's receive thread reads. While the connection's owner *reads inline*
//! ([`Receiver::read_inline`]: the ring does while it runs a collective), the receive thread
//! stays parked and the owner's `poll` and `wait` read the socket themselves: a peer's frame
//! reaches the waiting thread in one wake-up, not two (the kernel waking the receive thread,
//! which wakes the owner), and the owner can spin on the socket without taking the core a
//! receive thread would need.
//!
//! Progress without the receive thread: a peer may block writing to us only while nobody reads
//! our socket. The owner promises to poll or wait while it expects bytes, and every write of this
//! process that would block first *revokes* inline reading for every connection of the process
//! ([`revoke`]): their receive threads wake and read, as they always did. A ring of ranks each
//! blocked writing to the next therefore never waits for itself. Inline reading resumes only when
//! an owner asks again.

use std::collections::VecDeque;
use std::io;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::wire::{CONTROL_MAX, HEADER_LEN, WriteHeader};
use super::{Event, SlotRegion, SlotTable};
use crate::auth::{SessionKey, TAG_LEN, Tag};
use crate::deadline::Deadline;

/// Bytes read from the socket at a time: many small frames per system call. Larger payloads go
/// straight from the socket into their region once the buffered part of them has landed.
const BUFFER: usize = 64 << 10;
const HEAD: usize = HEADER_LEN + TAG_LEN;

/// The process-wide switch that ends inline reading (see the module's documentation): an epoch
/// bumped by every write that would block, and the condition variable parked receive threads
/// wait on.
struct Gate {
    epoch: AtomicU64,
    lock: Mutex<()>,
    changed: Condvar,
}

static GATE: Gate = Gate {
    epoch: AtomicU64::new(0),
    lock: Mutex::new(()),
    changed: Condvar::new(),
};

impl Gate {
    fn wake_all(&self) {
        drop(self.lock.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.notify_all();
    }
}

/// Ends inline reading on every tcp connection of this process: their receive threads read
/// again. Called before a write blocks.
pub(super) fn revoke() {
    GATE.epoch.fetch_add(1, Ordering::AcqRel);
    GATE.wake_all();
}

/// Events (notifications) that landed, and why the connection ended (if it did).
#[derive(Default)]
pub(super) struct Received {
    pub events: Mutex<(VecDeque<Event>, Option<String>)>,
    pub arrived: Condvar,
    /// Threads waiting on `arrived` (none while the owner reads inline: no wake-up to send).
    pub sleepers: std::sync::atomic::AtomicUsize,
}

/// A payload larger than [`CONTROL_MAX`] on its way into `region` (checked when its header came).
struct Body {
    region: SlotRegion,
    at: usize,
    left: usize,
    notify: Option<u32>,
}

/// The frame parser: what is buffered, the frame under way, the session key that checks tags.
struct Parser {
    key: SessionKey,
    buf: Box<[u8]>,
    start: usize,
    end: usize,
    body: Option<Body>,
    failed: Option<String>,
}

/// The receive side of one connection, shared by its receive thread and its owner.
pub(super) struct Receiver {
    sock: TcpStream,
    parser: Mutex<Parser>,
    granted: SlotTable,
    pub received: Received,
    /// 0: the receive thread reads; else the gate's epoch + 1 when the owner took over.
    inline: AtomicU64,
    closing: AtomicBool,
}

impl Receiver {
    /// The receive side of `sock` (a handle of the connection's socket), landing frames in
    /// `granted`'s regions and checking them with `key`.
    pub(super) fn new(sock: TcpStream, granted: SlotTable, key: SessionKey) -> Receiver {
        Receiver {
            sock,
            parser: Mutex::new(Parser {
                key,
                buf: vec![0u8; BUFFER].into_boxed_slice(),
                start: 0,
                end: 0,
                body: None,
                failed: None,
            }),
            granted,
            received: Received::default(),
            inline: AtomicU64::new(0),
            closing: AtomicBool::new(false),
        }
    }

    /// From now on the owner reads (until a blocked write revokes it, or `false`).
    pub(super) fn read_inline(&self, on: bool) {
        if on {
            self.inline
                .store(GATE.epoch.load(Ordering::Acquire) + 1, Ordering::Release);
        } else if self.inline.swap(0, Ordering::AcqRel) != 0 {
            GATE.wake_all();
        }
    }

    /// Whether the owner reads now.
    pub(super) fn inline(&self) -> bool {
        let v = self.inline.load(Ordering::Acquire);
        v != 0 && v == GATE.epoch.load(Ordering::Acquire) + 1
    }

    /// The socket, to wait on while reading inline.
    pub(super) fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.sock.as_fd()
    }

    /// The receive thread: reads whenever the owner does not, until the connection ends or is
    /// closed; returns why it ended.
    pub(super) fn run(&self) -> String {
        loop {
            if self.closing.load(Ordering::Acquire) {
                return "the connection was closed".into();
            }
            if self.inline() {
                let mut g = GATE.lock.lock().unwrap_or_else(|p| p.into_inner());
                while self.inline() && !self.closing.load(Ordering::Acquire) {
                    g = GATE
                        .changed
                        .wait_timeout(g, Duration::from_secs(1))
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                continue;
            }
            crate::net::wait_readable(
                self.sock.as_raw_fd(),
                Deadline::after(Duration::from_secs(1)),
                Duration::from_secs(1),
            );
            if self.inline() || self.closing.load(Ordering::Acquire) {
                continue;
            }
            if let Err(why) = self.pump() {
                return why;
            }
        }
    }

    /// Lands whatever the socket holds now, without blocking; queues the notifications. `Err`:
    /// the connection ended (recorded: every later call sees it).
    pub(super) fn pump(&self) -> Result<(), String> {
        let mut landed = Vec::new();
        let mut parser = self.parser.lock().unwrap_or_else(|p| p.into_inner());
        let result = match &parser.failed {
            Some(why) => Err(why.clone()),
            None => parser.pump(&self.sock, &self.granted, &mut landed),
        };
        if let Err(why) = &result {
            parser.failed.get_or_insert_with(|| why.clone());
        }
        drop(parser);
        if !landed.is_empty() || result.is_err() {
            let mut ev = self.events();
            ev.0.extend(landed.into_iter().map(Event::Notified));
            if let Err(why) = &result {
                let _ = self.sock.shutdown(Shutdown::Both);
                ev.1.get_or_insert_with(|| why.clone());
            }
            drop(ev);
            if self.received.sleepers.load(Ordering::Acquire) > 0 {
                self.received.arrived.notify_all();
            }
        }
        result
    }

    /// The queue of landed events and the failure.
    pub(super) fn events(&self) -> MutexGuard<'_, (VecDeque<Event>, Option<String>)> {
        self.received
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Stops the receive thread (with the socket's shutdown, which the caller does).
    pub(super) fn close(&self) {
        self.closing.store(true, Ordering::Release);
        GATE.wake_all();
    }
}

impl Parser {
    /// Reads until the socket has nothing more (or the connection fails) and lands every whole
    /// frame: header against the grants, then the tag; a control-sized payload lands only once
    /// its tag is right, a larger one (whose tag covers the header) goes into its region as it
    /// comes, through the region's raw address (no slice is ever formed over slot memory).
    fn pump(
        &mut self,
        sock: &TcpStream,
        granted: &SlotTable,
        landed: &mut Vec<u32>,
    ) -> Result<(), String> {
        loop {
            self.land_buffered(granted, landed)?;
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
            } else if self.body.is_none() && self.buf.len() - self.end < HEAD + CONTROL_MAX as usize
            {
                self.buf.copy_within(self.start..self.end, 0);
                self.end -= self.start;
                self.start = 0;
            }
            let mut drained = false;
            let n = match &mut self.body {
                // Nothing of the body is buffered: straight from the socket into the region.
                Some(body) if self.start == self.end => {
                    let left = body.left;
                    let n = body
                        .region
                        .with_locked("peer write", body.at, left, |dst| {
                            // SAFETY: dst..dst + left lies inside the granted region (checked
                            // by `with_locked`, which holds its CPU lock), which `body` holds;
                            // recv(2) writes at most `left` bytes there and does not block.
                            unsafe {
                                libc::recv(sock.as_raw_fd(), dst.cast(), left, libc::MSG_DONTWAIT)
                            }
                        })
                        .map_err(|e| e.to_string())?;
                    if n > 0 {
                        drained = (n as usize) < body.left;
                        body.at += n as usize;
                        body.left -= n as usize;
                        if body.left == 0 {
                            landed.extend(body.notify);
                            self.body = None;
                        }
                    }
                    n
                }
                _ => {
                    let free = &mut self.buf[self.end..];
                    // SAFETY: `free` is this parser's own buffer; recv(2) writes at most its
                    // length.
                    let n = unsafe {
                        libc::recv(
                            sock.as_raw_fd(),
                            free.as_mut_ptr().cast(),
                            free.len(),
                            libc::MSG_DONTWAIT,
                        )
                    };
                    if n > 0 {
                        drained = (n as usize) < free.len();
                        self.end += n as usize;
                    }
                    n
                }
            };
            match n {
                0 => return Err(closed()),
                // A short read took what the socket had: land it, and leave the rest (if more
                // came meanwhile) to the next call rather than spend a system call on EAGAIN.
                n if n > 0 && drained => {
                    self.land_buffered(granted, landed)?;
                    return Ok(());
                }
                n if n > 0 => {}
                _ => {
                    let e = io::Error::last_os_error();
                    match e.kind() {
                        io::ErrorKind::WouldBlock => return Ok(()),
                        io::ErrorKind::Interrupted => {}
                        _ => return Err(e.to_string()),
                    }
                }
            }
        }
    }

    /// Lands the whole frames (and the part of a body) that are buffered.
    fn land_buffered(&mut self, granted: &SlotTable, landed: &mut Vec<u32>) -> Result<(), String> {
        loop {
            let have = self.end - self.start;
            if let Some(body) = &mut self.body {
                let n = have.min(body.left);
                if n == 0 {
                    return Ok(());
                }
                body.region
                    .write_at(body.at, &self.buf[self.start..self.start + n])
                    .map_err(|e| e.to_string())?;
                self.start += n;
                body.at += n;
                body.left -= n;
                if body.left == 0 {
                    landed.extend(body.notify);
                    self.body = None;
                }
                continue;
            }
            // The header is judged as soon as it is here (a frame that names memory it was
            // not granted ends the connection without waiting for the rest of it).
            if have < HEADER_LEN {
                return Ok(());
            }
            let at = self.start;
            let header: [u8; HEADER_LEN] = self.buf[at..at + HEADER_LEN]
                .try_into()
                .expect("HEADER_LEN bytes");
            let h = WriteHeader::decode(&header)
                .map_err(|e| format!("refused a malformed frame from the peer: {e}"))?;
            let (region, dst_at) =
                granted
                    .target(h.key, h.offset, u64::from(h.len))
                    .map_err(|e| {
                        format!(
                            "refused the peer's write (key {}, offset {}, {} bytes): {e}",
                            h.key, h.offset, h.len
                        )
                    })?;
            if have < HEAD {
                return Ok(());
            }
            let tag: Tag = self.buf[at + HEADER_LEN..at + HEAD]
                .try_into()
                .expect("TAG_LEN bytes");
            let len = h.len as usize;
            if h.len <= CONTROL_MAX {
                if have < HEAD + len {
                    return Ok(());
                }
                let payload = &self.buf[at + HEAD..at + HEAD + len];
                if !self.key.open(&[&header, payload], &tag) {
                    return Err(unauthentic());
                }
                region
                    .write_at(dst_at, payload)
                    .map_err(|e| e.to_string())?;
                self.start += HEAD + len;
                landed.extend(h.notify);
            } else {
                if !self.key.open(&[&header], &tag) {
                    return Err(unauthentic());
                }
                self.start += HEAD;
                self.body = Some(Body {
                    region,
                    at: dst_at,
                    left: len,
                    notify: h.notify,
                });
            }
        }
    }
}

fn closed() -> String {
    "the peer closed the connection".into()
}

fn unauthentic() -> String {
    "refused a frame that failed the session's authentication (tampered, replayed or out of \
     order)"
        .into()
}

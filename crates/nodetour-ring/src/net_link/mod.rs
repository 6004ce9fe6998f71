//! The network links of a GPU ring: a progress thread between this rank's streams and the
//! wire, for a neighbour on another host. A lower layer: the communicator forms and drives it;
//! it is public for tools that measure it alone (`nodetour perf --handoff`). See
//! `docs/network-link-design.md`.
//!
//! The stream program does not change. A stream-ordered link (cuda-ipc, shm) has each stream
//! store straight into the neighbour's flag page; a network link gives the streams **outbox
//! pages** of this rank instead (host-mapped words the streams store into exactly as they would
//! into the neighbour's page) and a progress thread that carries what they store across the
//! wire:
//!
//! - the send stream fills a **send slot** (this rank's host memory) and stores `ready` in the
//!   outbox of the next rank; the thread sees it and, once the next rank's credit allows
//!   ([`crate::progress::SendEnd`]), writes the chunk into the next rank's receive slot with a
//!   notification naming it;
//! - the thread of the next rank sees the notification ([`crate::progress::RecvEnd`]: the next
//!   chunk in order, inside the slots it granted), and stores `ready` in its own page, where its
//!   receive stream waits; once that stream has read the slot it stores `released` in its outbox
//!   of the previous rank, and the thread sends the credit back, which the sender's thread
//!   stores as `released` in its own page (where its send stream waits before refilling the
//!   slot);
//! - the other words the streams and hosts exchange (the descriptor cells, the end notices)
//!   are **cells**: when one changes in an outbox, the thread writes the whole cell into the
//!   neighbour's **mailbox** (memory granted to that neighbour alone) and names it in the
//!   notification; the neighbour's thread accepts only the cells its role allows (from the
//!   previous rank: descriptor cells and `ENDED_BY_PREV`; from the next: `ENDED_BY_NEXT`) and
//!   stores them in its page.
//!
//! Notifications are 32 bits: a kind in the top three, a value in the low 29 (sequence numbers
//! and credit mod 2^29, unwrapped against what this end expects; a cell's index).
//!
//! Any [`HostConnection`] carries it: tcp (software one-sided writes), verbs (RDMA
//! WRITE_WITH_IMM), the in-process transport (tests). The thread never writes a slot without
//! credit, stops writing data when this rank's stop word is set (it still forwards the end
//! notices, which is how the neighbours learn of the abort), and ends typed, never hanging, when
//! a peer goes: its failure is read by the ring's wait ([`NetLink::failure`]).
//!
//! Waiting: the thread spins for [`NetOptions::spin`] (`NODETOUR_NET_SPIN_US`) after its last
//! progress, busy or idle; then, while chunks are in flight, it waits on the connection a chunk
//! (or else a credit) is expected from, at most a nap (growing up to [`NAP_MAX`]) so that what
//! the streams store is seen too; with nothing in flight it blocks until a collective is queued
//! (at most [`IDLE_WAKE`], to see notices).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nodetour_core::transport::{Event, HostConnection, SlotGrant, SlotRegion};

use crate::error::{Error, Result};
use crate::flag;
use crate::progress::{RecvAction, RecvEnd, SendAction, SendEnd, Stop};

mod engine;
mod notes;
use engine::Engine;
pub use notes::*;

/// A page of flag words this rank's streams and threads share (a host flag page registered
/// with CUDA on the GPU path; plain host memory for the CPU executor of the tests).
pub trait WordPage: Send + Sync {
    /// Word `index`.
    fn read(&self, index: u32) -> nodetour_core::Result<u32>;
    /// Sets word `index`.
    fn store(&self, index: u32, value: u32) -> nodetour_core::Result<()>;
    /// Bytes of word `index`'s cell from byte `at`.
    fn read_bytes(&self, index: u32, at: usize, dst: &mut [u8]) -> nodetour_core::Result<()>;
    /// Stores bytes into word `index`'s cell from byte `at`.
    fn store_bytes(&self, index: u32, at: usize, src: &[u8]) -> nodetour_core::Result<()>;
}

impl WordPage for nodetour_core::transport::gpu::Flags {
    fn read(&self, index: u32) -> nodetour_core::Result<u32> {
        nodetour_core::transport::gpu::Flags::read(self, index)
    }
    fn store(&self, index: u32, value: u32) -> nodetour_core::Result<()> {
        nodetour_core::transport::gpu::Flags::store(self, index, value)
    }
    fn read_bytes(&self, index: u32, at: usize, dst: &mut [u8]) -> nodetour_core::Result<()> {
        nodetour_core::transport::gpu::Flags::read_bytes(self, index, at, dst)
    }
    fn store_bytes(&self, index: u32, at: usize, src: &[u8]) -> nodetour_core::Result<()> {
        nodetour_core::transport::gpu::Flags::store_bytes(self, index, at, src)
    }
}

/// Lands chunks somewhere else than where the wire put them (GPU slots over tcp): called for
/// each chunk, in order, once it is in this rank's receive slots (and visible), instead of the
/// plain store of `ready`.
pub trait Lander: Send {
    /// Chunk `ready - 1` is in the receive slots at `offset` (`len` bytes): move it to where the
    /// receive stream reads it, then set `ready` in this rank's page, in that order.
    fn land(&mut self, offset: usize, len: usize, ready: u32) -> nodetour_core::Result<()>;
}

/// How the thread waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetOptions {
    /// Spin this long after the last progress before napping (`NODETOUR_NET_SPIN_US`).
    pub spin: Duration,
}

impl Default for NetOptions {
    /// The declared defaults; no environment read.
    fn default() -> Self {
        Self::from_config(&nodetour_core::Config::default())
    }
}

impl NetOptions {
    /// The job's settings (`NODETOUR_NET_SPIN_US`).
    pub fn from_config(config: &nodetour_core::Config) -> NetOptions {
        NetOptions {
            spin: config.net_spin,
        }
    }
}

/// Which neighbour a connection reaches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Next,
    Prev,
    /// A ring of two: the one neighbour is both.
    Both,
}

impl Role {
    fn is_prev(self) -> bool {
        matches!(self, Role::Prev | Role::Both)
    }
    fn is_next(self) -> bool {
        matches!(self, Role::Next | Role::Both)
    }
}

/// Everything a rank's network links need, made by whoever formed the ring.
pub struct NetLinkSetup {
    /// Ranks (job ranks, for errors): the next and the previous neighbour.
    pub next: u32,
    /// The previous neighbour.
    pub prev: u32,
    /// The connection to the next rank, or `None` where the link to the next rank is not a
    /// network link.
    pub to_next: Option<Box<dyn HostConnection>>,
    /// The connection to the previous rank (`None` where it is `to_next`: a ring of two, or
    /// where the link from the previous rank is not a network link).
    pub to_prev: Option<Box<dyn HostConnection>>,
    /// Whether `to_next` also reaches the previous rank (a ring of two).
    pub same_peer: bool,
    /// This rank's send slots (the send stream fills them).
    pub send_slots: Option<SlotRegion>,
    /// This rank's receive slots (granted to the previous rank).
    pub recv_slots: Option<SlotRegion>,
    /// The next rank's receive slots.
    pub next_recv: Option<SlotGrant>,
    /// The next rank's mailbox for its previous rank (this one).
    pub next_mailbox: Option<SlotGrant>,
    /// The previous rank's mailbox for its next rank (this one).
    pub prev_mailbox: Option<SlotGrant>,
    /// This rank's mailbox for the previous rank.
    pub mailbox_from_prev: Option<SlotRegion>,
    /// This rank's mailbox for the next rank.
    pub mailbox_from_next: Option<SlotRegion>,
    /// Where cells are staged before they are written (local only).
    pub cells: SlotRegion,
    /// Slots per link and bytes per slot (the same on every rank).
    pub slots: u32,
    /// Bytes per slot.
    pub slot_bytes: usize,
    /// This rank's page (where its streams wait).
    pub mine: Arc<dyn WordPage>,
    /// The outbox for the next rank.
    pub out_next: Arc<dyn WordPage>,
    /// The outbox for the previous rank.
    pub out_prev: Arc<dyn WordPage>,
    /// The descriptor cells in use, as (first, count).
    pub desc_cells: (u32, u32),
    /// The stop word's index in `mine`.
    pub stop_word: u32,
    /// How the thread waits.
    pub options: NetOptions,
    /// Where landed chunks go on (`None`: the receive stream reads the receive slots).
    pub lander: Option<Box<dyn Lander>>,
}

/// Why a link failed.
#[derive(Clone, Debug, PartialEq, Eq)]
struct LinkFailure {
    peer: u32,
    stop: Stop,
}

impl LinkFailure {
    fn error(&self) -> Error {
        match &self.stop {
            Stop::Protocol { reason } => Error::Protocol {
                rank: self.peer,
                reason: reason.clone(),
            },
            Stop::Wire { reason } => {
                tracing::warn!(peer = self.peer, %reason, "the network link failed");
                Error::PeerLost { rank: self.peer }
            }
            Stop::PeerLost => Error::PeerLost { rank: self.peer },
            Stop::Aborted => Error::Aborted {
                reason: "the ring was aborted".into(),
            },
        }
    }
}

#[derive(Default)]
struct Planned {
    /// Byte lengths of the chunks still to be written, in order.
    lengths: VecDeque<usize>,
    /// Byte lengths of the chunks still to be received, in order (for a lander).
    recv_lengths: VecDeque<usize>,
    /// Chunks planned to be sent and received so far.
    sends: u64,
    recvs: u64,
}

struct Shared {
    planned: Mutex<Planned>,
    /// Chunks written to the next rank so far (the thread's count, for [`NetLink::all_sent`]).
    sent: std::sync::atomic::AtomicU64,
    wake: Condvar,
    failure: Mutex<Option<LinkFailure>>,
    shutdown: AtomicBool,
    exited: Mutex<bool>,
    exited_cv: Condvar,
}

/// A rank's network links and their progress thread.
pub struct NetLink {
    kind: nodetour_core::transport::TransportKind,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    has_next: bool,
    has_prev: bool,
}

impl NetLink {
    /// Starts the progress thread.
    pub fn start(setup: NetLinkSetup) -> Result<NetLink> {
        let has_next = setup.to_next.is_some();
        let has_prev = setup.to_prev.is_some() || (setup.same_peer && has_next);
        let kind = setup
            .to_next
            .as_ref()
            .or(setup.to_prev.as_ref())
            .map_or(nodetour_core::transport::TransportKind::Tcp, |c| c.kind());
        let bad = |what: &str| Error::InvalidArgument {
            reason: format!("a network link without {what}"),
        };
        if has_next
            && (setup.send_slots.is_none()
                || setup.next_recv.is_none()
                || setup.next_mailbox.is_none()
                || setup.mailbox_from_next.is_none())
        {
            return Err(bad("what the link to the next rank needs"));
        }
        if has_prev
            && (setup.recv_slots.is_none()
                || setup.prev_mailbox.is_none()
                || setup.mailbox_from_prev.is_none())
        {
            return Err(bad("what the link from the previous rank needs"));
        }
        let need = (setup.slots as usize)
            .checked_mul(setup.slot_bytes)
            .ok_or_else(|| bad("a slot layout that fits the address space"))?;
        for (r, what) in [(&setup.send_slots, "send"), (&setup.recv_slots, "receive")] {
            if r.as_ref().is_some_and(|r| r.len() < need) {
                return Err(Error::InvalidArgument {
                    reason: format!(
                        "{what} slots of {} bytes for {need}",
                        r.as_ref().map_or(0, |r| r.len())
                    ),
                });
            }
        }
        let shared = Arc::new(Shared {
            planned: Mutex::new(Planned::default()),
            sent: std::sync::atomic::AtomicU64::new(0),
            wake: Condvar::new(),
            failure: Mutex::new(None),
            shutdown: AtomicBool::new(false),
            exited: Mutex::new(false),
            exited_cv: Condvar::new(),
        });
        let mut engine = Engine::new(setup, shared.clone());
        let thread = std::thread::Builder::new()
            .name("nodetour-net".into())
            .spawn(move || {
                engine.run();
                let shared = engine.shared.clone();
                // The connections (and their receiver threads) end here, before the regions.
                drop(engine);
                *shared.exited.lock().unwrap_or_else(|p| p.into_inner()) = true;
                shared.exited_cv.notify_all();
            })
            .map_err(|e| Error::Unsupported {
                reason: format!("cannot start the network progress thread: {e}"),
            })?;
        Ok(NetLink {
            kind,
            shared,
            thread: Some(thread),
            has_next,
            has_prev,
        })
    }

    /// The transport under the links.
    pub fn kind(&self) -> nodetour_core::transport::TransportKind {
        self.kind
    }

    /// Says what the collective just queued moves: the byte lengths of the chunks it sends to
    /// the next rank, in order, and the number of chunks it receives. Called before the
    /// streams can run it.
    pub fn plan(
        &self,
        send_lengths: impl IntoIterator<Item = usize>,
        recv_lengths: impl IntoIterator<Item = usize>,
    ) {
        let mut p = self
            .shared
            .planned
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.has_next {
            let before = p.lengths.len();
            p.lengths.extend(send_lengths);
            p.sends += (p.lengths.len() - before) as u64;
        }
        if self.has_prev {
            let before = p.recv_lengths.len();
            p.recv_lengths.extend(recv_lengths);
            p.recvs += (p.recv_lengths.len() - before) as u64;
        }
        drop(p);
        self.shared.wake.notify_all();
    }

    /// Whether every chunk planned so far has been written to the next rank. A rank's streams
    /// can finish before its progress thread has carried their last chunk: a collective is done
    /// here only once this holds too (else closing could cut the neighbour's data short).
    pub fn all_sent(&self) -> bool {
        let p = self
            .shared
            .planned
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        self.shared.sent.load(Ordering::Acquire) >= p.sends
    }

    /// Why a link failed, if one did.
    pub fn failure(&self) -> Option<Error> {
        let f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        f.as_ref().map(LinkFailure::error)
    }

    /// Whether the failure (if any) means data this rank received may be wrong (a peer broke
    /// the protocol), rather than that a peer or the wire went away.
    pub fn broke_protocol(&self) -> bool {
        let f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        matches!(f.as_ref().map(|f| &f.stop), Some(Stop::Protocol { .. }))
    }

    /// Stops the thread and ends its connections, waiting at most `timeout`; past it the
    /// thread is left to end on its own (it holds what it uses).
    pub fn close(&mut self, timeout: Duration) -> Result<()> {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let deadline = Instant::now() + timeout;
        let mut exited = self.shared.exited.lock().unwrap_or_else(|p| p.into_inner());
        while !*exited {
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    waiting_for: "the network progress thread to end (left running)".into(),
                    rank: None,
                    after: timeout,
                });
            }
            exited = self
                .shared
                .exited_cv
                .wait_timeout(exited, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(exited);
        let _ = thread.join();
        Ok(())
    }
}

impl Drop for NetLink {
    fn drop(&mut self) {
        if let Err(e) = self.close(Duration::from_secs(10)) {
            tracing::warn!(error = %e, "dropping a network link");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notifications_unwrap_against_what_is_expected() {
        assert_eq!(unwrap29(0, 0), 0);
        assert_eq!(unwrap29(5, 5), 5);
        assert_eq!(unwrap29(5, 7), 7);
        let big = (1u64 << 29) * 3 + 10;
        assert_eq!(unwrap29(big, note_value(DATA, big) & VALUE_MASK), big);
        assert_eq!(
            unwrap29(big, note_value(DATA, big + 2) & VALUE_MASK),
            big + 2
        );
        // A stale value unwraps far ahead: the engine sees the wrong chunk and stops.
        assert!(unwrap29(big, note_value(DATA, big - 1) & VALUE_MASK) > big + 1000);
        assert_eq!(unwrap32(u64::from(u32::MAX), 2), (1u64 << 32) + 2);
        assert_eq!(note_value(CELL_KIND, 7) >> KIND_SHIFT, CELL_KIND);
    }
}

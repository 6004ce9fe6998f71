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

/// The words of a flag page the link reads and writes (the GPU ring's layout).
pub mod words {
    pub use crate::flag::{
        DESC_BASE, ENDED_BY_NEXT, ENDED_BY_PREV, READY, RELEASED, STOPPED, WORDS,
    };
}
use crate::progress::{RecvAction, RecvEnd, SendAction, SendEnd, Stop};

/// Bytes of a cell (a flag word and the bytes after it, as in a host flag page).
pub const CELL: usize = nodetour_core::transport::gpu::FLAG_CELL;
/// Bytes of a mailbox (one cell per flag word).
pub const MAILBOX_BYTES: usize = flag::WORDS as usize * CELL;
/// The longest nap while chunks are in flight.
pub const NAP_MAX: Duration = Duration::from_micros(100);
/// How often an idle thread looks for notices.
pub const IDLE_WAKE: Duration = Duration::from_millis(2);

const KIND_SHIFT: u32 = 29;
const VALUE_MASK: u32 = (1 << KIND_SHIFT) - 1;
const DATA: u32 = 1;
const CREDIT: u32 = 2;
const CELL_KIND: u32 = 3;

fn note_value(kind: u32, value: u64) -> u32 {
    (kind << KIND_SHIFT) | (value as u32 & VALUE_MASK)
}

/// The receives a verbs connection of a network link keeps posted: every notification a
/// neighbour may send between two polls of the progress thread (chunks and credits, each at most
/// `slots` ahead; descriptor cells, at most `slots + 2` collectives ahead; end notices), with
/// room to spare, so that no write meets a receiver that is not ready.
pub fn receive_depth(slots: u32) -> u32 {
    4 * slots + 16
}

/// What a neighbour's notification asks of this end, as it reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Note {
    /// A chunk landed (its sequence number mod 2^29).
    Data(u32),
    /// Credit (chunks released, mod 2^29).
    Credit(u32),
    /// A cell of the mailbox changed: which, and whether it is the previous rank's (else the
    /// next rank's).
    Cell {
        /// The flag word.
        index: u32,
        /// From the previous rank's mailbox.
        from_prev: bool,
    },
    /// Nothing this neighbour may send: a protocol violation.
    Refused(String),
}

/// Reads notification `v` from a neighbour that is this rank's previous (`from_prev`), next
/// (`from_next`), or both (a ring of two), with the descriptor cells `desc_cells` (first,
/// count). Pure. Only the previous rank sends chunks, the descriptor cells and `ENDED_BY_PREV`;
/// only the next rank sends credit and `ENDED_BY_NEXT`; anything else is refused.
pub fn classify(v: u32, from_prev: bool, from_next: bool, desc_cells: (u32, u32)) -> Note {
    let value = v & VALUE_MASK;
    let (first, count) = desc_cells;
    match v >> KIND_SHIFT {
        DATA if from_prev => Note::Data(value),
        CREDIT if from_next => Note::Credit(value),
        CELL_KIND
            if from_prev
                && (value == flag::ENDED_BY_PREV
                    || (first..first.saturating_add(count)).contains(&value)) =>
        {
            Note::Cell {
                index: value,
                from_prev: true,
            }
        }
        CELL_KIND if from_next && value == flag::ENDED_BY_NEXT => Note::Cell {
            index: value,
            from_prev: false,
        },
        CELL_KIND => Note::Refused(format!("a cell it may not write ({value})")),
        DATA | CREDIT => Note::Refused(format!(
            "a notification of kind {} from the wrong neighbour",
            v >> KIND_SHIFT
        )),
        _ => Note::Refused(format!("an unknown notification {v:#010x}")),
    }
}

/// Encodes what a neighbour sends (the counterpart of [`classify`], for tests and fuzzing).
pub fn encode_note(note: &Note) -> Option<u32> {
    match *note {
        Note::Data(seq) => Some(note_value(DATA, u64::from(seq))),
        Note::Credit(n) => Some(note_value(CREDIT, u64::from(n))),
        Note::Cell { index, .. } => Some(note_value(CELL_KIND, u64::from(index))),
        Note::Refused(_) => None,
    }
}

/// The smallest value ≥ `base` that is `v` mod 2^29.
fn unwrap29(base: u64, v: u32) -> u64 {
    base + u64::from(v.wrapping_sub(base as u32) & VALUE_MASK)
}

/// The smallest value ≥ `base` that is `v` mod 2^32 (a stream's counter word).
fn unwrap32(base: u64, v: u32) -> u64 {
    base + u64::from(v.wrapping_sub(base as u32))
}

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

/// The progress thread's state.
struct Engine {
    setup: NetLinkSetup,
    shared: Arc<Shared>,
    send: SendEnd,
    recv: RecvEnd,
    /// The stream's counters as last read (unwrapped).
    stream_sent: u64,
    stream_released: u64,
    /// Cells watched in each outbox, with the word last forwarded.
    next_cells: Vec<(u32, u32)>,
    prev_cells: Vec<(u32, u32)>,
    /// Chunks planned so far (copied from the shared plan).
    planned_sends: u64,
    planned_recvs: u64,
    lengths: VecDeque<usize>,
    recv_lengths: VecDeque<usize>,
    /// `ready` published so far (with a lander: chunks handed to it), and the landed, visible
    /// chunks to publish (a neighbour may run into a collective before this rank has planned
    /// it: its chunks wait for their lengths).
    published: u64,
    ready_target: u64,
    stopped: bool,
    events: Vec<Event>,
    /// Events a nap's wait took off a connection, handled at the next step.
    parked: Vec<(Role, Event)>,
    /// Neighbours known gone (their connection failed): nothing more is written to them (a
    /// write to a dead queue pair waits out its retries).
    lost_next: bool,
    lost_prev: bool,
}

impl Engine {
    fn new(setup: NetLinkSetup, shared: Arc<Shared>) -> Engine {
        let (first, count) = setup.desc_cells;
        let mut next_cells: Vec<(u32, u32)> = (first..first + count).map(|c| (c, 0)).collect();
        next_cells.push((flag::ENDED_BY_PREV, 0));
        let prev_cells = vec![(flag::ENDED_BY_NEXT, 0)];
        Engine {
            send: SendEnd::new(setup.slots),
            // Host slots: the CPU's stores are visible to the GPU's reads once the flag is.
            recv: RecvEnd::new(setup.slots, false),
            setup,
            shared,
            stream_sent: 0,
            stream_released: 0,
            next_cells,
            prev_cells,
            planned_sends: 0,
            planned_recvs: 0,
            lengths: VecDeque::new(),
            recv_lengths: VecDeque::new(),
            published: 0,
            ready_target: 0,
            stopped: false,
            events: Vec::new(),
            parked: Vec::new(),
            lost_next: false,
            lost_prev: false,
        }
    }

    fn has_next(&self) -> bool {
        self.setup.to_next.is_some()
    }

    fn has_prev(&self) -> bool {
        self.setup.to_prev.is_some() || (self.setup.same_peer && self.has_next())
    }

    fn fail(&self, peer: u32, stop: Stop) {
        if stop == Stop::Aborted {
            return; // the ring knows: it set the stop word
        }
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            // Debug only: at teardown a neighbour that closed first looks the same; the ring's
            // error names a failure that mattered.
            tracing::debug!(peer, ?stop, "a network link failed");
            *f = Some(LinkFailure { peer, stop });
        }
    }

    fn run(&mut self) {
        let spin = self.setup.options.spin;
        let mut last = Instant::now();
        let mut nap = Duration::from_micros(5);
        loop {
            if self.shared.shutdown.load(Ordering::SeqCst) {
                return;
            }
            if self.step() {
                last = Instant::now();
                nap = Duration::from_micros(5);
                continue;
            }
            // Spin first, busy or idle: a training loop's next collective (or the next chunk)
            // usually comes within the spin, and a blocked thread's wake-up costs more.
            if last.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            if self.idle() {
                let p = self
                    .shared
                    .planned
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if p.sends == self.planned_sends
                    && p.recvs == self.planned_recvs
                    && !self.shared.shutdown.load(Ordering::SeqCst)
                {
                    let _ = self.shared.wake.wait_timeout(p, IDLE_WAKE);
                }
                continue;
            }
            self.nap(nap);
            nap = (nap * 2).min(NAP_MAX);
        }
    }

    /// Waits at most `d` without holding a core: on the connection a chunk is expected from
    /// (its arrival wakes the thread at once), else on the one credit is expected from, else
    /// asleep (what the streams store is seen at the next step).
    fn nap(&mut self, d: Duration) {
        let data_due =
            self.has_prev() && !self.lost_prev && self.recv.landed_count() < self.planned_recvs;
        let credit_due =
            self.has_next() && !self.lost_next && self.send.completed() > self.send.credited();
        let (conn, role) = if data_due {
            if self.setup.same_peer {
                (self.setup.to_next.as_mut(), Role::Both)
            } else {
                (self.setup.to_prev.as_mut(), Role::Prev)
            }
        } else if credit_due {
            let role = if self.setup.same_peer {
                Role::Both
            } else {
                Role::Next
            };
            (self.setup.to_next.as_mut(), role)
        } else {
            (None, Role::Next)
        };
        let Some(conn) = conn else {
            std::thread::sleep(d);
            return;
        };
        let mut events = Vec::new();
        // A failure shows again at the next step's poll, and is handled there.
        let _ = conn.wait(&mut events, nodetour_core::Deadline::after(d));
        self.parked.extend(events.into_iter().map(|e| (role, e)));
    }

    /// Nothing is in flight: every planned chunk written, landed and credited, both ways (a
    /// credit still due back keeps the thread waiting on its connection, not asleep: the send
    /// stream may be waiting for it to refill a slot).
    fn idle(&self) -> bool {
        self.send.completed() >= self.planned_sends
            && (self.send.credited() >= self.send.completed()
                || self.lost_next
                || self.send.is_stopped())
            && self.recv.landed_count() >= self.planned_recvs
            && self.recv.credited() >= self.planned_recvs
    }

    /// One round: events in, cells and counters from the outboxes, actions out. Whether
    /// anything happened.
    fn step(&mut self) -> bool {
        let mut busy = false;
        // The streams' counters before the plan: a collective is planned before its streams
        // can run, so every chunk seen ready here has its length in the plan read next.
        self.read_streams();
        {
            let mut p = self
                .shared
                .planned
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if p.sends != self.planned_sends || p.recvs != self.planned_recvs {
                self.lengths.extend(p.lengths.drain(..));
                self.recv_lengths.extend(p.recv_lengths.drain(..));
                self.planned_sends = p.sends;
                self.planned_recvs = p.recvs;
                busy = true;
            }
        }
        if self.published < self.ready_target && !self.recv.is_stopped() {
            self.publish();
        }
        busy |= self.take_events();
        busy |= self.forward_cells();
        if !self.stopped && self.setup.mine.read(self.setup.stop_word).unwrap_or(1) != 0 {
            self.stopped = true;
            self.send.abort();
            self.recv.abort();
            busy = true;
        }
        busy |= self.drive_send();
        busy |= self.drive_recv();
        busy
    }

    fn take_events(&mut self) -> bool {
        let mut busy = !self.parked.is_empty();
        for (role, Event::Notified(v)) in std::mem::take(&mut self.parked) {
            self.handle(role, v);
        }
        let roles: [(bool, Role); 2] = [
            (
                self.setup.to_next.is_some(),
                if self.setup.same_peer {
                    Role::Both
                } else {
                    Role::Next
                },
            ),
            (self.setup.to_prev.is_some(), Role::Prev),
        ];
        for (present, role) in roles {
            if !present {
                continue;
            }
            let conn = match role {
                Role::Prev => self.setup.to_prev.as_mut(),
                _ => self.setup.to_next.as_mut(),
            }
            .expect("present");
            let mut events = std::mem::take(&mut self.events);
            let polled = conn.poll(&mut events);
            for e in events.drain(..) {
                busy = true;
                let Event::Notified(v) = e;
                self.handle(role, v);
            }
            self.events = events;
            if let Err(e) = polled {
                let peer = if role == Role::Prev {
                    self.setup.prev
                } else {
                    self.setup.next
                };
                if !self.send.is_stopped() || !self.recv.is_stopped() {
                    busy = true;
                }
                self.fail(peer, Stop::PeerLost);
                self.lose(role);
                tracing::debug!(peer, error = %e, "a network link's connection ended");
            }
        }
        busy
    }

    fn handle(&mut self, role: Role, v: u32) {
        let desc = self.setup.desc_cells;
        match classify(v, role.is_prev(), role.is_next(), desc) {
            Note::Data(low) => {
                let seq = unwrap29(self.recv.landed_count(), low);
                self.recv.landed(seq);
            }
            Note::Credit(low) => {
                let n = unwrap29(self.send.credited(), low);
                self.send.credit(n);
                if !self.send.is_stopped() {
                    let _ = self
                        .setup
                        .mine
                        .store(flag::RELEASED, self.send.credited() as u32);
                }
            }
            Note::Cell { index, from_prev } => {
                let mailbox = if from_prev {
                    self.setup.mailbox_from_prev.as_ref()
                } else {
                    self.setup.mailbox_from_next.as_ref()
                };
                let Some(mailbox) = mailbox else {
                    self.protocol(
                        role,
                        format!("a cell on a link that has no mailbox ({index})"),
                    );
                    return;
                };
                let mut cell = [0u8; CELL];
                let at = index as usize * CELL;
                if mailbox.read_at(at, &mut cell).is_err() {
                    self.protocol(role, format!("cell {index} outside the mailbox"));
                    return;
                }
                let word = u32::from_ne_bytes([cell[0], cell[1], cell[2], cell[3]]);
                let mine = &self.setup.mine;
                let _ = mine.store_bytes(index, 4, &cell[4..]);
                let _ = mine.store(index, word);
            }
            Note::Refused(reason) => self.protocol(role, reason),
        }
    }

    /// The neighbour(s) behind `role` are gone: both ends stop, and nothing more is written
    /// to them.
    fn lose(&mut self, role: Role) {
        let both = self.setup.same_peer;
        self.lost_next |= role.is_next() || both;
        self.lost_prev |= role.is_prev() || both;
        self.send.peer_lost();
        self.recv.peer_lost();
    }

    fn protocol(&mut self, role: Role, reason: String) {
        let stop = Stop::Protocol { reason };
        let peer = if role.is_prev() {
            self.setup.prev
        } else {
            self.setup.next
        };
        self.fail(peer, stop);
        self.send.abort();
        self.recv.abort();
    }

    /// Forwards every outbox cell whose word changed.
    fn forward_cells(&mut self) -> bool {
        let mut busy = false;
        for next in [true, false] {
            let (has, page) = if next {
                (
                    self.has_next() && !self.lost_next,
                    self.setup.out_next.clone(),
                )
            } else {
                (
                    self.has_prev() && !self.lost_prev,
                    self.setup.out_prev.clone(),
                )
            };
            if !has {
                continue;
            }
            let n = if next {
                self.next_cells.len()
            } else {
                self.prev_cells.len()
            };
            for i in 0..n {
                let (index, seen) = if next {
                    self.next_cells[i]
                } else {
                    self.prev_cells[i]
                };
                let word = page.read(index).unwrap_or(seen);
                if word == seen {
                    continue;
                }
                busy = true;
                let mut cell = [0u8; CELL];
                cell[..4].copy_from_slice(&word.to_ne_bytes());
                let _ = page.read_bytes(index, 4, &mut cell[4..]);
                let at = index as usize * CELL;
                let sent = self.setup.cells.write_at(at, &cell).and_then(|()| {
                    let (conn, grant) = if next {
                        (
                            self.setup.to_next.as_mut(),
                            self.setup.next_mailbox.as_ref(),
                        )
                    } else if self.setup.same_peer {
                        (
                            self.setup.to_next.as_mut(),
                            self.setup.prev_mailbox.as_ref(),
                        )
                    } else {
                        (
                            self.setup.to_prev.as_mut(),
                            self.setup.prev_mailbox.as_ref(),
                        )
                    };
                    let (conn, grant) = (conn.expect("present"), grant.expect("checked"));
                    conn.write(
                        &self.setup.cells,
                        at..at + CELL,
                        grant,
                        at as u64,
                        Some(note_value(CELL_KIND, u64::from(index))),
                    )
                });
                if let Err(e) = sent {
                    let peer = if next {
                        self.setup.next
                    } else {
                        self.setup.prev
                    };
                    tracing::debug!(peer, error = %e, "forwarding a cell failed");
                    self.fail(peer, Stop::PeerLost);
                    self.lose(if next { Role::Next } else { Role::Prev });
                }
                if next {
                    self.next_cells[i].1 = word;
                } else {
                    self.prev_cells[i].1 = word;
                }
            }
        }
        busy
    }

    /// Reads what the streams stored: chunks ready to send, slots released.
    fn read_streams(&mut self) {
        if self.has_next() {
            if let Ok(v) = self.setup.out_next.read(flag::READY) {
                let n = unwrap32(self.stream_sent, v);
                if n != self.stream_sent && n - self.stream_sent < 1 << 31 {
                    self.stream_sent = n;
                    self.send.stream_sent(n);
                }
            }
        }
        if self.has_prev() {
            if let Ok(v) = self.setup.out_prev.read(flag::RELEASED) {
                let n = unwrap32(self.stream_released, v);
                if n != self.stream_released && n - self.stream_released < 1 << 31 {
                    self.stream_released = n;
                    self.recv.stream_released(n);
                }
            }
        }
    }

    fn drive_send(&mut self) -> bool {
        let mut busy = false;
        while let Some(action) = self.send.poll() {
            busy = true;
            match action {
                SendAction::Write { seq, slot } => {
                    let Some(len) = self.lengths.pop_front() else {
                        self.fail(
                            self.setup.next,
                            Stop::Protocol {
                                reason: format!(
                                    "the stream made chunk {seq} ready, none was planned"
                                ),
                            },
                        );
                        self.send.abort();
                        continue;
                    };
                    let at = slot as usize * self.setup.slot_bytes;
                    let len = len.min(self.setup.slot_bytes);
                    let conn = self.setup.to_next.as_mut().expect("a send end has a link");
                    // Posted, not waited for: the slot is refilled only after the next
                    // rank's credit for it, which it sends once the chunk has landed there.
                    let ok = !self.lost_next
                        && conn
                            .post(
                                self.setup.send_slots.as_ref().expect("checked"),
                                at..at + len,
                                self.setup.next_recv.as_ref().expect("checked"),
                                at as u64,
                                Some(note_value(DATA, seq)),
                            )
                            .inspect_err(
                                |e| tracing::debug!(error = %e, seq, "a chunk's write failed"),
                            )
                            .is_ok();
                    if !ok {
                        self.lost_next = true;
                    }
                    self.send.write_completed(seq, ok);
                    self.shared
                        .sent
                        .store(self.send.completed(), Ordering::Release);
                }
                SendAction::Stop(stop) => self.fail(self.setup.next, stop),
            }
        }
        busy
    }

    /// Chunks below `ready_target` are landed and visible: tell the receive stream (through
    /// the lander, chunk by chunk, where there is one, as far as they are planned here).
    fn publish(&mut self) {
        let n = self.ready_target;
        let Some(lander) = self.setup.lander.as_mut() else {
            let _ = self.setup.mine.store(flag::READY, n as u32);
            self.published = n;
            return;
        };
        while self.published < n {
            let k = self.published;
            let Some(len) = self.recv_lengths.pop_front() else {
                return; // planned by the next collective's call: published then
            };
            let offset = (k % u64::from(self.setup.slots)) as usize * self.setup.slot_bytes;
            let len = len.min(self.setup.slot_bytes);
            if let Err(e) = lander.land(offset, len, (k + 1) as u32) {
                self.recv.wire_failed(format!("landing chunk {k}: {e}"));
                return;
            }
            self.published = k + 1;
        }
    }

    fn drive_recv(&mut self) -> bool {
        let mut busy = false;
        while let Some(action) = self.recv.poll() {
            busy = true;
            match action {
                RecvAction::Flush { .. } => self.recv.flushed(true),
                RecvAction::Ready(n) => {
                    self.ready_target = n;
                    self.publish();
                }
                RecvAction::Credit(_) if self.lost_prev => {}
                RecvAction::Credit(n) => {
                    let conn = if self.setup.same_peer {
                        self.setup.to_next.as_mut()
                    } else {
                        self.setup.to_prev.as_mut()
                    }
                    .expect("a receive end has a link");
                    let sent = conn.write(
                        &self.setup.cells,
                        0..0,
                        self.setup.prev_mailbox.as_ref().expect("checked"),
                        0,
                        Some(note_value(CREDIT, n)),
                    );
                    if let Err(e) = sent {
                        tracing::debug!(error = %e, "a credit's write failed");
                        self.lost_prev = true;
                        self.recv.wire_failed(e.to_string());
                    }
                }
                RecvAction::Stop(stop) => self.fail(self.setup.prev, stop),
            }
        }
        busy
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

//! Forming the job: every rank connects to rank 0, proves the job token, and tells the others
//! where it listens; rank 0 checks the world (size, duplicate ranks, ranks that never arrive)
//! and sends everyone the table. The connections then stay open as a liveness mesh (a star
//! through rank 0): a rank that dies closes its socket, rank 0 sees it at once and tells every
//! other rank, including ranks that never talk to it otherwise.

use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::wire::{HEADER_LEN, Message, PeerEntry};
use nodetour_core::Deadline;
use nodetour_core::auth::{JobToken, Nonce, SessionKey, SessionKeys, TAG_LEN, nonce};
use nodetour_core::{Error, Result};

/// How long one handshake step may take from a connected peer (a stranger that connects and
/// stays silent is dropped after this, without holding up the others).
const STEP: Duration = Duration::from_secs(10);
/// How often the liveness watcher wakes to check for shutdown.
const WATCH_TICK: Duration = Duration::from_millis(200);

/// What the rendezvous hands back: the table, and this rank's mesh links.
type Formed = (Vec<PeerEntry>, Vec<Link>);

/// A mesh connection after the handshake, with its session keys.
struct Link {
    rank: u32,
    stream: TcpStream,
    keys: SessionKeys,
}

/// One direction of a mesh connection: every message it carries after the handshake is tagged
/// with the connection's session key for that direction (derived from the job token and both
/// handshake nonces), numbered, so that a message forged, altered, replayed, dropped or
/// reordered on the way fails its tag and is never acted on.
struct Sealed {
    rank: u32,
    stream: TcpStream,
    key: SessionKey,
}

/// Which ranks' addresses each rank receives (run by rank 0 on the whole table):
/// `share(table)[r]` lists the ranks whose full entries rank `r` gets (its own always comes
/// whole); every other entry reaches `r` without its address (its host identity and blob,
/// which say what it can link with, still come, so that every rank orders the ring and chooses
/// paths the same way).
pub type Share<'a> = &'a (dyn Fn(&[PeerEntry]) -> Vec<Vec<u32>> + Sync);

/// `table` as rank `r` may see it under `lists` (addresses of the ranks in `lists[r]` only).
fn table_for(table: &[PeerEntry], lists: Option<&[Vec<u32>]>, r: u32) -> Vec<PeerEntry> {
    let Some(lists) = lists else {
        return table.to_vec();
    };
    let mine = lists.get(r as usize).map(Vec::as_slice).unwrap_or(&[]);
    table
        .iter()
        .map(|e| {
            if e.rank == r || mine.contains(&e.rank) {
                e.clone()
            } else {
                PeerEntry {
                    address: String::new(),
                    ..e.clone()
                }
            }
        })
        .collect()
}

/// What the watcher thread and the callers share.
#[derive(Default)]
struct State {
    /// Ranks lost, in the order noticed.
    lost: Vec<(u32, String)>,
    /// Ranks that left on purpose (said goodbye), in the order heard.
    left: Vec<u32>,
    /// Rank 0: the latest barrier generation each rank reached.
    arrived: Vec<u64>,
    /// The latest barrier generation released.
    released: u64,
}

#[derive(Default)]
struct Liveness {
    state: Mutex<State>,
    changed: Condvar,
}

impl Liveness {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark_left(&self, rank: u32) {
        let mut st = self.lock();
        if !st.left.contains(&rank) {
            tracing::debug!(rank, "rank left");
            st.left.push(rank);
            self.changed.notify_all();
        }
    }

    /// The first rank lost, else the first that left, and why.
    fn first_absent(st: &State) -> Option<(u32, String)> {
        st.lost.first().cloned().or_else(|| {
            st.left.first().map(|r| {
                (
                    *r,
                    "it left the job (closed or dropped its communicator)".to_owned(),
                )
            })
        })
    }

    fn mark(&self, rank: u32, reason: String) {
        let mut st = self.lock();
        if !st.lost.iter().any(|(r, _)| *r == rank) {
            tracing::warn!(rank, reason = %reason, "rank lost");
            st.lost.push((rank, reason));
            self.changed.notify_all();
        }
    }
}

/// The mesh's sockets with their sending keys, for whole-frame writes from any thread.
type Writers = Arc<Mutex<Vec<Sealed>>>;

/// Rank 0: releases barrier `generation` if every rank has reached it.
fn release_if_complete(st: &mut State, generation: u64, writers: &Writers, liveness: &Liveness) {
    if st.released >= generation || st.arrived.iter().any(|g| *g < generation) {
        return;
    }
    st.released = generation;
    let msg = Message::BarrierRelease { generation };
    for w in writers.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
        let _ = send_sealed(w, &msg);
    }
    liveness.changed.notify_all();
}

/// A formed job: the peer table, and the liveness mesh that watches it.
pub struct Bootstrap {
    rank: u32,
    world_size: u32,
    table: Vec<PeerEntry>,
    liveness: Arc<Liveness>,
    stop: Arc<AtomicBool>,
    writers: Writers,
    generation: Mutex<u64>,
    watcher: Option<JoinHandle<()>>,
}

impl Bootstrap {
    /// Runs the rendezvous at `rendezvous` (`host:port`; rank 0 listens there, binding all
    /// interfaces on that port) and returns once every rank has joined, or fails before
    /// `deadline` with the ranks that never arrived. `me` is this rank's entry (its `rank` field
    /// must be `rank`).
    pub fn rendezvous(
        rendezvous: &str,
        rank: u32,
        world_size: u32,
        me: PeerEntry,
        token: &JobToken,
        deadline: Deadline,
    ) -> Result<Bootstrap> {
        Self::rendezvous_sharing(rendezvous, rank, world_size, me, token, deadline, None)
    }

    /// [`Self::rendezvous`] where each rank receives the addresses of the ranks `share` names
    /// for it only (rank 0's `share` decides; the other ranks' is not used). See [`Share`].
    pub fn rendezvous_sharing(
        rendezvous: &str,
        rank: u32,
        world_size: u32,
        me: PeerEntry,
        token: &JobToken,
        deadline: Deadline,
        share: Option<Share<'_>>,
    ) -> Result<Bootstrap> {
        if me.rank != rank || rank >= world_size {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "rank {rank} of {world_size} with an entry for rank {}",
                    me.rank
                ),
            });
        }
        if !token.is_authenticated() {
            tracing::warn!(security = %token.describe(), "this job is not authenticated");
        }
        let (table, links) = if rank == 0 {
            serve(rendezvous, world_size, me, token, deadline, share)?
        } else {
            join(rendezvous, rank, world_size, me, token, deadline)?
        };
        let liveness = Arc::new(Liveness::default());
        liveness.lock().arrived = vec![0; world_size as usize];
        let stop = Arc::new(AtomicBool::new(false));
        let mut readers = Vec::with_capacity(links.len());
        let mut senders = Vec::with_capacity(links.len());
        for Link { rank, stream, keys } in links {
            let clone = stream.try_clone().map_err(|source| Error::Exchange {
                op: "clone",
                peer: "bootstrap".into(),
                source,
            })?;
            readers.push(Sealed {
                rank,
                stream: clone,
                key: keys.recv,
            });
            senders.push(Sealed {
                rank,
                stream,
                key: keys.send,
            });
        }
        let writers: Writers = Arc::new(Mutex::new(senders));
        let watcher = {
            let (liveness, stop, writers) = (liveness.clone(), stop.clone(), writers.clone());
            std::thread::Builder::new()
                .name(format!("nodetour-liveness-{rank}"))
                .spawn(move || watch(rank, readers, &writers, &liveness, &stop))
                .map_err(|source| Error::Exchange {
                    op: "spawn watcher",
                    peer: "bootstrap".into(),
                    source,
                })?
        };
        Ok(Bootstrap {
            rank,
            world_size,
            table,
            liveness,
            stop,
            writers,
            generation: Mutex::new(0),
            watcher: Some(watcher),
        })
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// Every rank's entry, indexed by rank.
    pub fn peers(&self) -> &[PeerEntry] {
        &self.table
    }

    /// `Err(RankLost)` naming the first rank lost, if any.
    pub fn check(&self) -> Result<()> {
        match self.liveness.lock().lost.first() {
            Some((rank, reason)) => Err(Error::RankLost {
                rank: *rank,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Whether `rank` is lost or left the job (its process gone, or its communicator closed).
    pub fn is_absent(&self, rank: u32) -> bool {
        let st = self.liveness.lock();
        st.lost.iter().any(|(r, _)| *r == rank) || st.left.contains(&rank)
    }

    /// `Err(RankLost)` naming the first rank lost or, failing that, the first that left on
    /// purpose: for work that needs every rank present (a collective), where a rank that left
    /// is as absent as one that died.
    pub fn check_present(&self) -> Result<()> {
        match Liveness::first_absent(&self.liveness.lock()) {
            Some((rank, reason)) => Err(Error::RankLost { rank, reason }),
            None => Ok(()),
        }
    }

    /// Waits until every rank has called `barrier` as many times as this one, or fails with
    /// the lost rank (or one that left before it arrived), or at `deadline`.
    pub fn barrier(&self, deadline: Deadline) -> Result<()> {
        let generation = {
            let mut g = self.generation.lock().unwrap_or_else(|p| p.into_inner());
            *g += 1;
            *g
        };
        if self.rank == 0 {
            let mut st = self.liveness.lock();
            st.arrived[0] = generation;
            release_if_complete(&mut st, generation, &self.writers, &self.liveness);
        } else {
            let msg = Message::Barrier { generation };
            for w in self
                .writers
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter_mut()
            {
                send_sealed(w, &msg)?;
            }
        }
        let mut st = self.liveness.lock();
        loop {
            if let Some((rank, reason)) = st.lost.first() {
                return Err(Error::RankLost {
                    rank: *rank,
                    reason: reason.clone(),
                });
            }
            if st.released >= generation {
                return Ok(());
            }
            // A rank that left can no longer arrive: rank 0 (which counts the arrivals) fails
            // at once when one left before arriving, every other rank when rank 0 left before
            // releasing this barrier (then it cannot be released).
            let gone = if self.rank == 0 {
                st.left
                    .iter()
                    .copied()
                    .find(|r| st.arrived.get(*r as usize).is_some_and(|g| *g < generation))
            } else {
                st.left.contains(&0).then_some(0)
            };
            if let Some(rank) = gone {
                return Err(Error::RankLost {
                    rank,
                    reason: "it left the job (closed or dropped its communicator) before this \
                             barrier"
                        .into(),
                });
            }
            if deadline.expired() {
                return Err(
                    deadline.timeout(format!("barrier {generation} of {} ranks", self.world_size))
                );
            }
            st = self
                .liveness
                .changed
                .wait_timeout(st, deadline.remaining())
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Waits until some rank is lost or leaves, or `deadline` passes; returns the rank and why
    /// (a lost rank before one that left).
    pub fn wait_for_loss(&self, deadline: Deadline) -> Option<(u32, String)> {
        let mut st = self.liveness.lock();
        while st.lost.is_empty() && st.left.is_empty() && !deadline.expired() {
            st = self
                .liveness
                .changed
                .wait_timeout(st, deadline.remaining())
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Liveness::first_absent(&st)
    }
}

impl Drop for Bootstrap {
    fn drop(&mut self) {
        // Leave on purpose: stop the watcher, say goodbye so the others do not report this rank
        // lost, then close the sockets.
        self.stop.store(true, Ordering::SeqCst);
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        let mut writers = self.writers.lock().unwrap_or_else(|p| p.into_inner());
        for w in writers.iter_mut() {
            let _ = w.stream.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = send_sealed_within(w, &Message::Goodbye, Duration::from_secs(1));
        }
        for w in writers.iter() {
            let _ = w.stream.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// Listeners bound by `UniqueId::create`, by port, until this process's rank-0 rendezvous on
/// that port takes them.
static PARKED: Mutex<Vec<(u16, TcpListener)>> = Mutex::new(Vec::new());

pub(super) fn park_listener(port: u16, listener: TcpListener) {
    PARKED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push((port, listener));
}

fn take_parked_listener(port: u16) -> Option<TcpListener> {
    let mut parked = PARKED.lock().unwrap_or_else(|p| p.into_inner());
    let at = parked.iter().position(|(p, _)| *p == port)?;
    Some(parked.swap_remove(at).1)
}

/// The most a peer may make this process read before it has proven the job token (a challenge,
/// a hello, a server proof, a refusal): nothing large is allocated for an unauthenticated peer.
const UNAUTHENTICATED_MAX: u32 = 2048;

/// At most this many connections in the handshake at once on rank 0; more wait in the
/// listener's backlog.
const MAX_HANDSHAKES: usize = 64;

/// How long a connection may take to answer the challenge (a rank answers at once): what a
/// silent connection costs a slot of `MAX_HANDSHAKES`.
const HELLO_WITHIN: Duration = Duration::from_secs(2);

/// Reads one message of at most `max` payload bytes within `deadline`.
fn read_message_capped(
    s: &mut TcpStream,
    deadline: Deadline,
    peer: &str,
    max: u32,
) -> Result<Message> {
    let (kind, frame) = read_frame(s, deadline, peer, max)?;
    Message::decode_payload(kind, &frame[HEADER_LEN..])
}

/// Reads one frame (header and payload) of at most `max` payload bytes: its kind and bytes.
fn read_frame(
    s: &mut TcpStream,
    deadline: Deadline,
    peer: &str,
    max: u32,
) -> Result<(u8, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    read_exact(s, &mut header, deadline, peer)?;
    let (kind, len) = Message::decode_header(&header)?;
    if len > max {
        return Err(Error::Decode {
            what: "bootstrap message",
            reason: format!(
                "{len} bytes from {peer}, at most {max} at this point of the handshake"
            ),
        });
    }
    let mut frame = vec![0u8; HEADER_LEN + len as usize];
    frame[..HEADER_LEN].copy_from_slice(&header);
    read_exact(s, &mut frame[HEADER_LEN..], deadline, peer)?;
    Ok((kind, frame))
}

/// Reads one message sent after the handshake and checks its session tag (`key`: this
/// direction's); a bad tag is an authentication error and the message is not decoded.
fn read_sealed(
    s: &mut TcpStream,
    key: &mut SessionKey,
    deadline: Deadline,
    peer: &str,
) -> Result<Message> {
    let (kind, frame) = read_frame(s, deadline, peer, super::wire::MAX_PAYLOAD)?;
    let mut tag = [0u8; TAG_LEN];
    read_exact(s, &mut tag, deadline, peer)?;
    if !key.open(&[&frame], &tag) {
        return Err(Error::Authenticate {
            peer: peer.to_owned(),
            reason: "a bootstrap message failed its session tag (forged, altered, replayed or \
                     reordered on the way): not acted on, the connection is dropped"
                .into(),
        });
    }
    Message::decode_payload(kind, &frame[HEADER_LEN..])
}

/// `m`'s frame followed by its tag under `key` (see [`read_sealed`]).
fn sealed_frame(key: &mut SessionKey, m: &Message) -> Result<Vec<u8>> {
    let mut frame = m.encode()?;
    let tag = key.seal(&[&frame]);
    frame.extend_from_slice(&tag);
    Ok(frame)
}

/// Writes a whole frame within `within`.
fn write_frame(s: &mut TcpStream, frame: &[u8], peer: &str, within: Duration) -> Result<()> {
    s.set_write_timeout(Some(within))
        .and_then(|()| s.write_all(frame))
        .map_err(|source| Error::Exchange {
            op: "write",
            peer: peer.to_owned(),
            source,
        })
}

/// Sends `m` tagged with `key` (see [`read_sealed`]).
fn send_tagged(s: &mut TcpStream, key: &mut SessionKey, m: &Message, peer: &str) -> Result<()> {
    let frame = sealed_frame(key, m)?;
    write_frame(s, &frame, peer, STEP)
}

/// Sends `m` on a mesh link, tagged.
fn send_sealed(w: &mut Sealed, m: &Message) -> Result<()> {
    let peer = format!("rank {}", w.rank);
    send_tagged(&mut w.stream, &mut w.key, m, &peer)
}

/// [`send_sealed`] with a shorter write timeout (a goodbye at teardown).
fn send_sealed_within(w: &mut Sealed, m: &Message, within: Duration) -> Result<()> {
    let frame = sealed_frame(&mut w.key, m)?;
    write_frame(&mut w.stream, &frame, &format!("rank {}", w.rank), within)
}

fn read_exact(s: &mut TcpStream, buf: &mut [u8], deadline: Deadline, peer: &str) -> Result<()> {
    let mut at = 0;
    while at < buf.len() {
        if deadline.expired() {
            return Err(deadline.timeout(format!("a bootstrap message from {peer}")));
        }
        s.set_read_timeout(Some(deadline.remaining().max(Duration::from_millis(1))))
            .map_err(|source| Error::Exchange {
                op: "read",
                peer: peer.to_owned(),
                source,
            })?;
        match s.read(&mut buf[at..]) {
            Ok(0) => {
                return Err(Error::Exchange {
                    op: "read",
                    peer: peer.to_owned(),
                    source: io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the connection",
                    ),
                });
            }
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) => {}
            Err(source) => {
                return Err(Error::Exchange {
                    op: "read",
                    peer: peer.to_owned(),
                    source,
                });
            }
        }
    }
    Ok(())
}

fn send(s: &mut TcpStream, m: &Message, peer: &str) -> Result<()> {
    write_frame(s, &m.encode()?, peer, STEP)
}

struct Joined {
    stream: TcpStream,
    entry: PeerEntry,
    peer: String,
    keys: SessionKeys,
}

/// Rank 0: accept, authenticate and collect every other rank, then send the table.
fn serve(
    addr: &str,
    world_size: u32,
    me: PeerEntry,
    token: &JobToken,
    deadline: Deadline,
    share: Option<Share<'_>>,
) -> Result<Formed> {
    let port = addr.rsplit(':').next().unwrap_or("0");
    let bind = format!("0.0.0.0:{port}");
    let parked = port.parse().ok().and_then(take_parked_listener);
    let listener = match parked {
        Some(l) => l,
        None => TcpListener::bind(&bind).map_err(|source| Error::Exchange {
            op: "listen",
            peer: bind.clone(),
            source,
        })?,
    };
    listener
        .set_nonblocking(true)
        .map_err(|source| Error::Exchange {
            op: "listen",
            peer: bind.clone(),
            source,
        })?;
    // Rank 0 holds a socket per rank for the job's life, and one per handshake.
    nodetour_core::net::raise_open_files(u64::from(world_size) + MAX_HANDSHAKES as u64 + 64)?;
    let (tx, rx) = mpsc::channel::<std::result::Result<Joined, (String, Error)>>();
    let mut joined: Vec<Option<Joined>> = (0..world_size).map(|_| None).collect();
    let mut missing = world_size - 1;
    // Handshakes in progress: a bounded number of unauthenticated peers at once.
    let mut pending = 0usize;
    while missing > 0 {
        match (pending < MAX_HANDSHAKES).then(|| listener.accept()) {
            None => {}
            Some(Ok((stream, peer))) => {
                let (tx, token) = (tx.clone(), token.clone());
                let peer = peer.to_string();
                pending += 1;
                std::thread::spawn(move || {
                    let r = handshake_server(stream, &peer, world_size, &token, deadline)
                        .map_err(|e| (peer, e));
                    let _ = tx.send(r);
                });
            }
            Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
            Some(Err(source)) => {
                return Err(Error::Exchange {
                    op: "accept",
                    peer: bind,
                    source,
                });
            }
        }
        while let Ok(result) = rx.try_recv() {
            pending -= 1;
            match result {
                Ok(mut j) => {
                    let r = j.entry.rank as usize;
                    if let Some(first) = &joined[r] {
                        let reason = format!(
                            "rank {r} already joined from {}; {} claims it too",
                            first.peer, j.peer
                        );
                        tracing::warn!(%reason, "duplicate rank refused");
                        let _ = send_tagged(
                            &mut j.stream,
                            &mut j.keys.send,
                            &Message::Reject { reason },
                            &j.peer,
                        );
                        continue;
                    }
                    tracing::debug!(rank = r, peer = %j.peer, "rank joined");
                    joined[r] = Some(j);
                    missing -= 1;
                }
                Err((peer, e)) => {
                    tracing::warn!(peer = %peer, error = %e, "refused a bootstrap connection")
                }
            }
        }
        if missing > 0 && deadline.expired() {
            let absent: Vec<String> = (1..world_size)
                .filter(|r| joined[*r as usize].is_none())
                .map(|r| r.to_string())
                .collect();
            let reason = format!(
                "rank(s) {} never arrived within {:?}",
                absent.join(", "),
                deadline.budget()
            );
            for j in joined.iter_mut().flatten() {
                let _ = send_tagged(
                    &mut j.stream,
                    &mut j.keys.send,
                    &Message::Reject {
                        reason: reason.clone(),
                    },
                    &j.peer,
                );
            }
            // Rank 0's own joining deadline passed: a timeout (the others hear the reason).
            return Err(Error::Timeout {
                what: format!("rank(s) {} to arrive at the rendezvous", absent.join(", ")),
                after: deadline.budget(),
            });
        }
        // A short wait, so that handshake results are collected promptly.
        nodetour_core::net::wait_readable(
            listener.as_raw_fd(),
            deadline,
            Duration::from_millis(20),
        );
    }
    let mut table = vec![me];
    table.extend(joined.iter().skip(1).flatten().map(|j| j.entry.clone()));
    let lists = share.map(|f| f(&table));
    if let Some(l) = &lists
        && l.len() != world_size as usize
    {
        return Err(Error::InvalidArgument {
            reason: format!("a sharing policy for {} ranks of {world_size}", l.len()),
        });
    }
    let mut links = Vec::new();
    for j in joined.into_iter().skip(1).flatten() {
        let Joined {
            mut stream,
            entry,
            peer,
            mut keys,
        } = j;
        let msg = Message::Table(table_for(&table, lists.as_deref(), entry.rank));
        send_tagged(&mut stream, &mut keys.send, &msg, &peer)?;
        links.push(Link {
            rank: entry.rank,
            stream,
            keys,
        });
    }
    Ok((table_for(&table, lists.as_deref(), 0), links))
}

fn handshake_server(
    mut s: TcpStream,
    peer: &str,
    world_size: u32,
    token: &JobToken,
    deadline: Deadline,
) -> Result<Joined> {
    s.set_nodelay(true).ok();
    let step = Deadline::after(STEP.min(deadline.remaining().max(Duration::from_millis(100))));
    let ours = nonce();
    send(&mut s, &Message::Challenge { nonce: ours }, peer)?;
    let hello = Deadline::after(HELLO_WITHIN.min(step.remaining()));
    let (rank, claimed_world, theirs) =
        match read_message_capped(&mut s, hello, peer, UNAUTHENTICATED_MAX)? {
            Message::Hello {
                rank,
                world_size: w,
                proof,
                nonce,
            } => {
                if !token.verify_client(&ours, rank, w, &proof) {
                    let _ = send(
                        &mut s,
                        &Message::Reject {
                            reason: "wrong job token".into(),
                        },
                        peer,
                    );
                    return Err(Error::Authenticate {
                        peer: peer.to_owned(),
                        reason: format!("wrong job token (claimed rank {rank})"),
                    });
                }
                (rank, w, nonce)
            }
            other => {
                return Err(Error::Decode {
                    what: "bootstrap handshake",
                    reason: format!("expected Hello, got {other:?}"),
                });
            }
        };
    let refuse = |s: &mut TcpStream, reason: String| -> Error {
        let _ = send(
            s,
            &Message::Reject {
                reason: reason.clone(),
            },
            peer,
        );
        Error::Rendezvous { reason }
    };
    if claimed_world != world_size {
        return Err(refuse(
            &mut s,
            format!(
                "world size mismatch: rank 0 has {world_size}, rank {rank} at {peer} says {claimed_world}"
            ),
        ));
    }
    if rank == 0 || rank >= world_size {
        return Err(refuse(
            &mut s,
            format!("rank {rank} from {peer} is not a valid joining rank of {world_size}"),
        ));
    }
    send(
        &mut s,
        &Message::ServerProof {
            proof: token.server_proof(&theirs, rank, world_size),
        },
        peer,
    )?;
    // From here on every message is tagged with the session's keys.
    let mut keys = session(token, &ours, &theirs, rank, world_size, true);
    match read_sealed(&mut s, &mut keys.recv, step, peer)? {
        Message::Join(entry) if entry.rank == rank => Ok(Joined {
            stream: s,
            entry,
            peer: peer.to_owned(),
            keys,
        }),
        Message::Join(entry) => Err(refuse(
            &mut s,
            format!("{peer} proved rank {rank} but joins as rank {}", entry.rank),
        )),
        other => Err(Error::Decode {
            what: "bootstrap handshake",
            reason: format!("expected Join, got {other:?}"),
        }),
    }
}

/// Ranks 1..n: connect to rank 0, authenticate both ways, join, and receive the table.
fn join(
    addr: &str,
    rank: u32,
    world_size: u32,
    me: PeerEntry,
    token: &JobToken,
    deadline: Deadline,
) -> Result<Formed> {
    let peer = format!("rank 0 at {addr}");
    let mut s = nodetour_core::net::connect_retrying(addr, deadline, &|| Ok(()))?;
    s.set_nodelay(true).ok();
    let challenge = match read_message_capped(&mut s, deadline, &peer, UNAUTHENTICATED_MAX)? {
        Message::Challenge { nonce } => nonce,
        other => {
            return Err(Error::Decode {
                what: "bootstrap handshake",
                reason: format!("expected Challenge, got {other:?}"),
            });
        }
    };
    let ours = nonce();
    send(
        &mut s,
        &Message::Hello {
            rank,
            world_size,
            proof: token.client_proof(&challenge, rank, world_size),
            nonce: ours,
        },
        &peer,
    )?;
    match read_message_capped(&mut s, deadline, &peer, UNAUTHENTICATED_MAX)? {
        Message::ServerProof { proof } if token.verify_server(&ours, rank, world_size, &proof) => {}
        Message::ServerProof { .. } => {
            return Err(Error::Authenticate {
                peer,
                reason: "the rendezvous does not know the job token".into(),
            });
        }
        Message::Reject { reason } if reason.contains("token") => {
            return Err(Error::Authenticate { peer, reason });
        }
        Message::Reject { reason } => return Err(Error::Rendezvous { reason }),
        other => {
            return Err(Error::Decode {
                what: "bootstrap handshake",
                reason: format!("expected ServerProof, got {other:?}"),
            });
        }
    }
    // From here on every message is tagged with the session's keys.
    let mut keys = session(token, &challenge, &ours, rank, world_size, false);
    send_tagged(&mut s, &mut keys.send, &Message::Join(me), &peer)?;
    // Rank 0 answers at its own deadline, naming the ranks that never arrived: that answer is
    // worth a short grace past ours.
    let answer = Deadline::after(deadline.remaining() + Duration::from_secs(2));
    let table = match read_sealed(&mut s, &mut keys.recv, answer, &peer)? {
        Message::Table(t) => t,
        Message::Reject { reason } => return Err(Error::Rendezvous { reason }),
        other => {
            return Err(Error::Decode {
                what: "bootstrap table",
                reason: format!("expected Table, got {other:?}"),
            });
        }
    };
    if table.len() != world_size as usize
        || table.iter().enumerate().any(|(i, e)| e.rank != i as u32)
    {
        return Err(Error::Decode {
            what: "bootstrap table",
            reason: format!(
                "{} entries, not ranks 0..{world_size} in order",
                table.len()
            ),
        });
    }
    Ok((
        table,
        vec![Link {
            rank: 0,
            stream: s,
            keys,
        }],
    ))
}

/// The session keys of a mesh connection (rank 0 accepts, `rank` dials).
fn session(
    token: &JobToken,
    acceptor_nonce: &Nonce,
    dialer_nonce: &Nonce,
    rank: u32,
    world_size: u32,
    acceptor: bool,
) -> SessionKeys {
    token.session(acceptor_nonce, dialer_nonce, rank, world_size, acceptor)
}

/// The liveness watcher: reads the mesh's sockets until told to stop. On rank 0 a closed socket
/// is a lost rank, announced to every other rank, and barrier arrivals are collected; elsewhere
/// the messages come from rank 0.
fn watch(
    me: u32,
    mut streams: Vec<Sealed>,
    writers: &Writers,
    liveness: &Liveness,
    stop: &AtomicBool,
) {
    let mut open: Vec<bool> = vec![true; streams.len()];
    while !stop.load(Ordering::SeqCst) && open.iter().any(|o| *o) {
        let fds: Vec<Option<std::os::fd::RawFd>> = streams
            .iter()
            .zip(&open)
            .map(|(l, o)| o.then(|| l.stream.as_raw_fd()))
            .collect();
        let ready = nodetour_core::net::poll_readable(&fds, WATCH_TICK);
        if !ready.iter().any(|r| *r) {
            continue;
        }
        for i in 0..streams.len() {
            if !open[i] || !ready[i] {
                continue;
            }
            let Sealed {
                rank,
                stream: ref mut s,
                ref mut key,
            } = streams[i];
            let outcome = read_sealed(s, key, Deadline::after(STEP), &format!("rank {rank}"));
            if stop.load(Ordering::SeqCst) {
                return;
            }
            match outcome {
                Ok(Message::RankLost { rank: lost, reason }) if me != 0 => {
                    liveness.mark(lost, reason)
                }
                Ok(Message::BarrierRelease { generation }) if me != 0 => {
                    let mut st = liveness.lock();
                    st.released = st.released.max(generation);
                    liveness.changed.notify_all();
                }
                Ok(Message::Barrier { generation }) if me == 0 => {
                    let mut st = liveness.lock();
                    if let Some(a) = st.arrived.get_mut(rank as usize) {
                        *a = (*a).max(generation);
                    }
                    release_if_complete(&mut st, generation, writers, liveness);
                }
                Ok(Message::RankLeft { rank: left }) if me != 0 => liveness.mark_left(left),
                Ok(Message::Goodbye) => {
                    open[i] = false;
                    liveness.mark_left(rank);
                    if me == 0 {
                        // Tell the others: a collective that still needs this rank fails now,
                        // naming it, instead of at its deadline.
                        let msg = Message::RankLeft { rank };
                        for w in writers.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
                            if w.rank != rank {
                                let _ = send_sealed(w, &msg);
                            }
                        }
                    }
                }
                Ok(other) => {
                    tracing::warn!(rank, message = ?other, "unexpected bootstrap message after the rendezvous")
                }
                Err(e) => {
                    open[i] = false;
                    let reason = format!("its bootstrap connection broke ({e})");
                    liveness.mark(rank, reason.clone());
                    if me == 0 {
                        let msg = Message::RankLost { rank, reason };
                        for w in writers.lock().unwrap_or_else(|p| p.into_inner()).iter_mut() {
                            if w.rank != rank {
                                let _ = send_sealed(w, &msg);
                            }
                        }
                    }
                }
            }
        }
    }
}

//! The tcp transport: one-sided writes in software for machines without RDMA.
//!
//! Each connection has a receiver thread that reads write frames and, after checking the key,
//! offset and length against the regions granted on that connection, reads the payload straight
//! into the region (no intermediate buffer). A frame that names anything else closes the
//! connection before a byte of it is written; the sender's next call fails, and so does the
//! receiver's. Connections are authenticated with the job token in both directions before any
//! frame is sent or accepted: the connector answers the acceptor's nonce with its rank and an
//! HMAC, and the acceptor answers the connector's nonce with its own HMAC.

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread::JoinHandle;
use std::time::Duration;

use super::tcp_rx::{self, Receiver};
use super::wire::{CONTROL_MAX, HEADER_LEN, MAX_FRAME, WriteHeader};
use super::{Armed, Event, HostConnection, SlotGrant, SlotRegion, SlotTable, TransportKind};
use crate::auth::handshake;
use crate::auth::{Acceptor, JobToken};
use crate::auth::{SessionKey, SessionKeys, TAG_LEN, Tag};
use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// A tcp connection to one peer.
pub struct TcpConnection {
    // Shut down (waking the reader) and joined in Drop before the table releases the regions.
    stream: TcpStream,
    reader: Option<JoinHandle<()>>,
    rx: Arc<Receiver>,
    granted: SlotTable,
    peer: String,
    timeout: Duration,
    // Tags what this side sends (see `wire`): the session key of this direction.
    send: SessionKey,
    // Whole frames held back by `write_deferred` until the next flush (in order, tagged).
    pending: Vec<u8>,
}

/// Bytes of held-back frames that are sent at once.
const PENDING_MAX: usize = 64 << 10;

impl TcpConnection {
    /// Starts the connection with `regions` already granted: a peer that learned of them
    /// earlier (from the bootstrap) may write at once. `keys` are the session's (from the
    /// handshake that authenticated `stream`).
    fn start(
        stream: TcpStream,
        peer: String,
        timeout: Duration,
        regions: &[SlotRegion],
        keys: SessionKeys,
    ) -> Result<TcpConnection> {
        let setup = |source| Error::Exchange {
            op: "configure",
            peer: peer.clone(),
            source,
        };
        stream.set_nodelay(true).map_err(setup)?;
        stream.set_read_timeout(None).map_err(setup)?;
        // Writes block at most this long (set once: a write is one system call or a few).
        stream.set_write_timeout(Some(timeout)).map_err(setup)?;
        let granted = SlotTable::default();
        for r in regions {
            granted.insert(r)?;
        }
        let SessionKeys { send, recv } = keys;
        let rx = Arc::new(Receiver::new(
            stream.try_clone().map_err(setup)?,
            granted.clone(),
            recv,
        ));
        let reader = {
            let (rx, who) = (rx.clone(), peer.clone());
            std::thread::Builder::new()
                .name("nodetour-tcp-rx".into())
                .spawn(move || {
                    let why = rx.run();
                    tracing::debug!(peer = %who, reason = %why, "tcp receiver stopped");
                })
                .map_err(setup)?
        };
        Ok(TcpConnection {
            stream,
            reader: Some(reader),
            rx,
            granted,
            peer,
            timeout,
            send,
            pending: Vec::new(),
        })
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    fn failure(&self) -> Option<Error> {
        let ev = self.rx.events();
        ev.1.as_ref()
            .filter(|_| ev.0.is_empty())
            .map(|why| self.ended(why))
    }

    /// The checked source of a write of `src[range]` to `dst` at `dst_offset`: its address
    /// and length. A connection that already ended refuses it.
    fn source(
        &self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
    ) -> Result<(*const u8, usize)> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let len = range
            .end
            .checked_sub(range.start)
            .ok_or(Error::InvalidArgument {
                reason: "an inverted range".into(),
            })?;
        let end = dst_offset.checked_add(len as u64);
        if end.is_none_or(|e| e > dst.len) {
            return Err(Error::OutOfBounds {
                what: "tcp write",
                offset: dst_offset,
                len: len as u64,
                region_len: dst.len,
            });
        }
        Ok((
            src.ptr_at("write source", range.start, len)?.cast_const(),
            len,
        ))
    }

    /// Appends the whole frame of a control-sized write (`n <= CONTROL_MAX` bytes at
    /// `payload`, which the caller vouches for) to the queue: header, tag, payload.
    fn frame_into_pending(&mut self, h: &WriteHeader, payload: *const u8, n: usize) {
        let header = h.encode();
        let at = self.pending.len();
        self.pending.extend_from_slice(&header);
        self.pending.resize(at + HEADER_LEN + TAG_LEN + n, 0);
        let body = &mut self.pending[at + HEADER_LEN + TAG_LEN..];
        // SAFETY: `payload..payload + n` is readable (the caller's checked source); `body` is
        // this connection's own queue, n bytes long. A raw copy: the source may be memory
        // other agents write, which is never seen as a slice.
        unsafe { std::ptr::copy_nonoverlapping(payload, body.as_mut_ptr(), n) };
        let tag = self
            .send
            .seal(&[&header, &self.pending[at + HEADER_LEN + TAG_LEN..]]);
        self.pending[at + HEADER_LEN..at + HEADER_LEN + TAG_LEN].copy_from_slice(&tag);
    }

    fn io_error(&self, source: io::Error) -> Error {
        if matches!(
            source.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            Error::Timeout {
                what: format!("the tcp peer {} to take a write", self.peer),
                after: self.timeout,
            }
        } else {
            Error::Exchange {
                op: "write",
                peer: self.peer.clone(),
                source,
            }
        }
    }

    fn ended(&self, why: &str) -> Error {
        Error::Exchange {
            op: "receive",
            peer: self.peer.clone(),
            source: io::Error::new(io::ErrorKind::ConnectionAborted, why.to_owned()),
        }
    }
}

impl HostConnection for TcpConnection {
    fn kind(&self) -> TransportKind {
        TransportKind::Tcp
    }

    fn grant(&mut self, region: &SlotRegion) -> Result<SlotGrant> {
        self.granted.insert(region)?;
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
        self.flush()?;
        let (from, len) = self.source(src, range, dst, dst_offset)?;
        let mut sent = 0usize;
        loop {
            let n = (len - sent).min(MAX_FRAME as usize);
            let last = sent + n == len;
            let h = WriteHeader {
                key: dst.key,
                offset: dst_offset + sent as u64,
                len: n as u32,
                notify: if last { notify } else { None },
            };
            // SAFETY: from+sent..from+sent+n lies inside `src` (checked by `source`), which the
            // caller keeps alive until this returns; the kernel reads it, no slice is formed.
            let payload = unsafe { from.add(sent) };
            if n <= CONTROL_MAX as usize {
                // A control-sized payload is tagged too: framed into the queue first (a raw
                // copy), so the bytes sent are the bytes tagged.
                self.frame_into_pending(&h, payload, n);
                self.flush()?;
            } else {
                let header = h.encode();
                let mut head = [0u8; HEADER_LEN + TAG_LEN];
                head[..HEADER_LEN].copy_from_slice(&header);
                let tag = self.send.seal(&[&header]);
                head[HEADER_LEN..].copy_from_slice(&tag);
                write_all_raw(&self.stream, &head, payload, n).map_err(|e| self.io_error(e))?;
            }
            sent += n;
            if last {
                return Ok(());
            }
        }
    }

    fn write_deferred(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()> {
        let (from, len) = self.source(src, range.clone(), dst, dst_offset)?;
        if len > CONTROL_MAX as usize {
            return self.write(src, range, dst, dst_offset, notify);
        }
        let h = WriteHeader {
            key: dst.key,
            offset: dst_offset,
            len: len as u32,
            notify,
        };
        self.frame_into_pending(&h, from, len);
        if self.pending.len() >= PENDING_MAX {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let pending = std::mem::take(&mut self.pending);
        let sent = write_all_raw(&self.stream, &pending, std::ptr::null(), 0);
        self.pending = pending;
        self.pending.clear();
        sent.map_err(|e| self.io_error(e))
    }

    fn poll(&mut self, events: &mut Vec<Event>) -> Result<()> {
        self.flush()?;
        if self.rx.inline() {
            // The owner reads: whatever is on the socket lands now (a failure is recorded and
            // reported below, once the events before it are taken).
            let _ = self.rx.pump();
        }
        let mut ev = self.rx.events();
        if ev.0.is_empty()
            && let Some(why) = &ev.1
        {
            return Err(self.ended(why));
        }
        events.extend(ev.0.drain(..));
        Ok(())
    }

    fn wait(&mut self, events: &mut Vec<Event>, deadline: Deadline) -> Result<()> {
        let before = events.len();
        loop {
            self.poll(events)?;
            if events.len() > before {
                return Ok(());
            }
            deadline.check(|| format!("a notification from tcp peer {}", self.peer))?;
            if self.rx.inline() {
                // Woken by the kernel when bytes arrive, not by another thread.
                crate::net::wait_readable(
                    self.stream.as_raw_fd(),
                    deadline,
                    Duration::from_millis(100),
                );
                continue;
            }
            let ev = self.rx.events();
            if ev.0.is_empty() && ev.1.is_none() {
                // Counted under the queue's lock, which the receive thread takes before it
                // looks at the count: no wake-up is lost.
                let sleepers = &self.rx.received.sleepers;
                sleepers.fetch_add(1, Ordering::AcqRel);
                drop(
                    self.rx
                        .received
                        .arrived
                        .wait_timeout(ev, deadline.remaining().min(Duration::from_millis(100))),
                );
                sleepers.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    fn read_inline(&mut self, on: bool) {
        self.rx.read_inline(on);
    }

    fn arm(&mut self) -> Result<Armed> {
        // Readable whenever bytes wait on the socket (level-triggered): nothing to arm.
        Ok(if self.rx.inline() {
            Armed::Fds([self.rx.fd().as_raw_fd(), -1])
        } else {
            Armed::Unsupported
        })
    }
}

/// Writes `header`, then `len` bytes at `payload`, with `sendmsg(2)` (one system call for
/// small frames) until all are sent. The first attempt does not block; if the socket is full,
/// inline reading ends in this process ([`tcp_rx::revoke`]) before the write waits, so that a
/// peer blocked writing to us is read by our receive threads meanwhile. `payload..payload + len`
/// must stay mapped for the call.
fn write_all_raw(s: &TcpStream, header: &[u8], payload: *const u8, len: usize) -> io::Result<()> {
    let total = header.len() + len;
    let mut sent = 0usize;
    let mut flags = libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT;
    while sent < total {
        let mut iov = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2];
        let mut count = 0;
        if sent < header.len() {
            iov[0] = libc::iovec {
                iov_base: header[sent..].as_ptr() as *mut libc::c_void,
                iov_len: header.len() - sent,
            };
            count = 1;
        }
        let done = sent.saturating_sub(header.len());
        if done < len {
            iov[count] = libc::iovec {
                // SAFETY: done < len: inside the payload the caller vouches for.
                iov_base: unsafe { payload.add(done) } as *mut libc::c_void,
                iov_len: len - done,
            };
            count += 1;
        }
        // SAFETY: an all-zero msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = count as _;
        // SAFETY: every iovec names readable memory (the header slice, the caller's payload);
        // sendmsg(2) only reads it.
        let n = unsafe { libc::sendmsg(s.as_raw_fd(), &msg, flags) };
        match n {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "the connection took no bytes",
                ));
            }
            n if n > 0 => sent += n as usize,
            _ => {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => {}
                    io::ErrorKind::WouldBlock if flags & libc::MSG_DONTWAIT != 0 => {}
                    _ => return Err(e),
                }
            }
        }
        if sent < total && flags & libc::MSG_DONTWAIT != 0 {
            // The socket is full: from here on the write may wait (up to the write timeout).
            tcp_rx::revoke();
            flags = libc::MSG_NOSIGNAL;
        }
    }
    Ok(())
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        // Stop the receiver before the granted regions can be released: once it has joined, no
        // peer byte can land anywhere (and the owner, which reads inline, is this thread).
        self.rx.close();
        if !self.pending.is_empty() {
            // Best effort, without blocking: held-back notices (an end notice) still go.
            // SAFETY: `pending` is this connection's own buffer; send(2) only reads it.
            unsafe {
                libc::send(
                    self.stream.as_raw_fd(),
                    self.pending.as_ptr().cast(),
                    self.pending.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

/// The largest payload [`TcpEndpoint::exchange`] carries each way.
pub const EXCHANGE_MAX: usize = 64 << 10;

/// Connections a listener authenticates at once (each on its own thread); more wait in the
/// listener's backlog.
const HANDSHAKES_MAX: usize = 64;

/// Early connections kept per rank, at most (see [`TcpEndpoint`]'s `early`).
const EARLY_PER_RANK: usize = 2;

/// An authenticated connection, who it is from, and its keys.
type Accepted = (TcpStream, String, SessionKeys);

/// Authenticated connections that arrived before an accept expected their rank, by rank.
type EarlyConnections = Arc<std::sync::Mutex<HashMap<u32, VecDeque<Accepted>>>>;

/// A listening endpoint that accepts authenticated connections from ranks of the job.
pub struct TcpEndpoint {
    listener: TcpListener,
    token: JobToken,
    timeout: Duration,
    /// Connections from ranks of the job that proved themselves while this endpoint accepted
    /// for other ranks (a peer link formed on first use by a rank that reached this one first):
    /// kept in arrival order, at most [`EARLY_PER_RANK`] per rank, for the accept that expects
    /// them. One whose dialler gave up (closed) is dropped when taken.
    early: EarlyConnections,
}

impl TcpEndpoint {
    /// Listens on `addr` (port 0 picks one).
    pub fn bind(
        addr: impl ToSocketAddrs + std::fmt::Debug,
        token: JobToken,
        timeout: Duration,
    ) -> Result<TcpEndpoint> {
        let where_ = format!("{addr:?}");
        let listener = TcpListener::bind(&addr).map_err(|source| Error::Exchange {
            op: "listen",
            peer: where_.clone(),
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| Error::Exchange {
                op: "listen",
                peer: where_,
                source,
            })?;
        Ok(TcpEndpoint {
            listener,
            token,
            timeout,
            early: EarlyConnections::default(),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|source| Error::Exchange {
                op: "listen",
                peer: "local".into(),
                source,
            })
    }

    /// Connects this rank to every rank in `peers` once: dials the lower ranks (at
    /// `address(rank)`) while accepting the higher ones here, so every pair has one connection
    /// whoever starts first. Each connection starts with `grants(rank)` granted; `alive` is
    /// asked while waiting, as in [`Self::accept`].
    #[allow(clippy::too_many_arguments)]
    pub fn connect_mesh(
        &self,
        peers: &[u32],
        my_rank: u32,
        world_size: u32,
        address: &dyn Fn(u32) -> String,
        grants: &(dyn Fn(u32) -> Vec<SlotRegion> + Sync),
        alive: &(dyn Fn() -> Result<()> + Sync),
        deadline: Deadline,
    ) -> Result<HashMap<u32, TcpConnection>> {
        let streams = self.mesh_streams(peers, my_rank, world_size, address, alive, deadline)?;
        streams
            .into_iter()
            .map(|(p, (s, who, keys))| {
                Ok((
                    p,
                    TcpConnection::start(s, who, self.timeout, &grants(p), keys)?,
                ))
            })
            .collect()
    }

    /// Sends `payload(rank)` to every rank in `peers` and returns what each sent back, over
    /// one authenticated connection per pair (made as in [`Self::connect_mesh`], closed
    /// afterwards). What only a neighbour may learn (remote keys, queue pair numbers) goes
    /// this way instead of through the bootstrap, which every rank hears. Payloads are at most
    /// [`EXCHANGE_MAX`] bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn exchange(
        &self,
        peers: &[u32],
        my_rank: u32,
        world_size: u32,
        address: &dyn Fn(u32) -> String,
        payload: &dyn Fn(u32) -> Vec<u8>,
        alive: &(dyn Fn() -> Result<()> + Sync),
        deadline: Deadline,
    ) -> Result<HashMap<u32, Vec<u8>>> {
        // Every payload checked before anything is dialled or sent.
        let checked = |p: u32| -> Result<Vec<u8>> {
            let mine = payload(p);
            if mine.len() > EXCHANGE_MAX {
                return Err(Error::InvalidArgument {
                    reason: format!("a setup payload of {} bytes", mine.len()),
                });
            }
            Ok(mine)
        };
        let mut prepared = peers
            .iter()
            .map(|&p| Ok((p, checked(p)?)))
            .collect::<Result<HashMap<u32, Vec<u8>>>>()?;
        let mut streams =
            self.mesh_streams(peers, my_rank, world_size, address, alive, deadline)?;
        let io = |who: &str| {
            let who = who.to_owned();
            move |source| Error::Exchange {
                op: "exchange",
                peer: who,
                source,
            }
        };
        // Every payload out first, then every answer in: reading one neighbour's answer
        // before writing to the next would wait in a cycle around the ring. (A payload fits
        // in the socket's buffer, so the writes do not block.)
        for (p, (s, who, keys)) in streams.iter_mut() {
            let mine = match prepared.remove(p) {
                Some(mine) => mine,
                None => checked(*p)?,
            };
            let wait = Some(deadline.remaining().max(Duration::from_millis(1)));
            s.set_read_timeout(wait).map_err(io(who))?;
            s.set_write_timeout(wait).map_err(io(who))?;
            let len = (mine.len() as u32).to_be_bytes();
            let tag = keys.send.seal(&[&len, &mine]);
            s.write_all(&len).map_err(io(who))?;
            s.write_all(&tag).map_err(io(who))?;
            s.write_all(&mine).map_err(io(who))?;
        }
        let mut out = HashMap::new();
        for (p, (mut s, who, mut keys)) in streams {
            let mut len_bytes = [0u8; 4];
            s.read_exact(&mut len_bytes).map_err(io(&who))?;
            let mut tag: Tag = [0u8; TAG_LEN];
            s.read_exact(&mut tag).map_err(io(&who))?;
            let len = u32::from_be_bytes(len_bytes) as usize;
            if len > EXCHANGE_MAX {
                return Err(Error::Decode {
                    what: "setup payload",
                    reason: format!("{len} bytes from {who} (at most {EXCHANGE_MAX})"),
                });
            }
            let mut theirs = vec![0u8; len];
            s.read_exact(&mut theirs).map_err(io(&who))?;
            if !keys.recv.open(&[&len_bytes, &theirs], &tag) {
                return Err(Error::Authenticate {
                    peer: who,
                    reason: "its setup payload failed the session's authentication".into(),
                });
            }
            out.insert(p, theirs);
        }
        Ok(out)
    }

    /// One authenticated stream to every rank in `peers`: dials the lower ranks while
    /// accepting the higher ones.
    fn mesh_streams(
        &self,
        peers: &[u32],
        my_rank: u32,
        world_size: u32,
        address: &dyn Fn(u32) -> String,
        alive: &(dyn Fn() -> Result<()> + Sync),
        deadline: Deadline,
    ) -> Result<HashMap<u32, (TcpStream, String, SessionKeys)>> {
        let higher: Vec<u32> = peers.iter().copied().filter(|p| *p > my_rank).collect();
        // The proofs name the acceptor (its rank and the address it published in the table):
        // a dial redirected to another rank of the job fails on both sides.
        let mine = address(my_rank);
        let me = Acceptor {
            rank: my_rank,
            address: &mine,
        };
        std::thread::scope(|s| {
            let accepting =
                s.spawn(|| self.accept_streams(&higher, world_size, me, alive, deadline));
            let mut out = HashMap::new();
            let dialled: Result<()> = peers.iter().filter(|p| **p < my_rank).try_for_each(|&p| {
                let addr = address(p);
                let to = Acceptor {
                    rank: p,
                    address: &addr,
                };
                let (stream, keys) =
                    dial(&addr, my_rank, world_size, &self.token, to, alive, deadline)?;
                out.insert(p, (stream, addr, keys));
                Ok(())
            });
            // The accepting side ends by itself (all accepted, `alive` failed, or the deadline).
            let accepted = accepting.join().expect("the accept thread does not panic");
            dialled?;
            out.extend(accepted?);
            Ok(out)
        })
    }

    /// Accepts connections until every rank in `expected` has connected and proved itself;
    /// strangers and wrong tokens are refused and logged. Each connection starts with
    /// `grants(rank)` granted. `alive` is asked while waiting (the bootstrap's liveness check):
    /// its error ends the wait at once, so a rank that died is reported, not waited for.
    pub fn accept(
        &self,
        expected: &[u32],
        world_size: u32,
        grants: &(dyn Fn(u32) -> Vec<SlotRegion> + Sync),
        alive: &(dyn Fn() -> Result<()> + Sync),
        deadline: Deadline,
    ) -> Result<HashMap<u32, TcpConnection>> {
        let streams = self.accept_streams(expected, world_size, Acceptor::ANY, alive, deadline)?;
        streams
            .into_iter()
            .map(|(r, (s, who, keys))| {
                Ok((
                    r,
                    TcpConnection::start(s, who, self.timeout, &grants(r), keys)?,
                ))
            })
            .collect()
    }

    /// Accepts and authenticates connections (up to [`HANDSHAKES_MAX`] at once, each given
    /// [`handshake::ANSWER_WITHIN`] to answer the challenge, so silent strangers cannot hold up the ranks)
    /// until every rank in `expected` has connected and proved itself to be that rank and to
    /// mean this acceptor (`me`).
    fn accept_streams(
        &self,
        expected: &[u32],
        world_size: u32,
        me: Acceptor<'_>,
        alive: &(dyn Fn() -> Result<()> + Sync),
        deadline: Deadline,
    ) -> Result<HashMap<u32, Accepted>> {
        type Outcome = (String, Result<(TcpStream, u32, SessionKeys)>);
        let mut got: HashMap<u32, Accepted> = HashMap::new();
        for &r in expected {
            if let Some(a) = take_early(&self.early, r) {
                got.insert(r, a);
            }
        }
        let (tx, rx) = std::sync::mpsc::channel::<Outcome>();
        let mut pending = 0usize;
        let me_owned = (me.rank, me.address.to_owned());
        while got.len() < expected.len() {
            let accepted = (pending < HANDSHAKES_MAX).then(|| self.listener.accept());
            match accepted {
                Some(Ok((s, peer))) => {
                    let (tx, token, me) = (tx.clone(), self.token.clone(), me_owned.clone());
                    let early = self.early.clone();
                    let peer = peer.to_string();
                    pending += 1;
                    std::thread::spawn(move || {
                        let me = Acceptor {
                            rank: me.0,
                            address: &me.1,
                        };
                        let r = handshake::accept(s, &peer, &token, world_size, me, deadline);
                        // The accept that started it has returned: a rank's connection is kept
                        // for the next accept that expects it.
                        if let Err(std::sync::mpsc::SendError((peer, Ok((s, rank, keys))))) =
                            tx.send((peer, r))
                        {
                            keep_early(&early, rank, (s, format!("rank {rank} at {peer}"), keys));
                        }
                    });
                    continue;
                }
                Some(Err(e)) if e.kind() != io::ErrorKind::WouldBlock => {
                    return Err(Error::Exchange {
                        op: "accept",
                        peer: "tcp endpoint".into(),
                        source: e,
                    });
                }
                _ => {}
            }
            while let Ok((peer, r)) = rx.try_recv() {
                pending -= 1;
                match r {
                    Ok((s, rank, keys)) if expected.contains(&rank) && !got.contains_key(&rank) => {
                        got.insert(rank, (s, format!("rank {rank} at {peer}"), keys));
                    }
                    Ok((s, rank, keys)) => {
                        tracing::debug!(%peer, rank, "kept an early tcp connection for a later accept");
                        keep_early(
                            &self.early,
                            rank,
                            (s, format!("rank {rank} at {peer}"), keys),
                        );
                    }
                    Err(e) => tracing::warn!(%peer, error = %e, "refused a tcp connection"),
                }
            }
            // Kept by a handshake that finished after an earlier accept returned.
            for &r in expected {
                if !got.contains_key(&r)
                    && let Some(a) = take_early(&self.early, r)
                {
                    got.insert(r, a);
                }
            }
            if got.len() == expected.len() {
                break;
            }
            alive()?;
            let missing: Vec<u32> = expected
                .iter()
                .filter(|r| !got.contains_key(r))
                .copied()
                .collect();
            deadline.check(|| format!("tcp connections from rank(s) {missing:?}"))?;
            crate::net::wait_readable(
                self.listener.as_raw_fd(),
                deadline,
                Duration::from_millis(if pending > 0 { 5 } else { 200 }),
            );
        }
        Ok(got)
    }
}

/// Keeps `a`, an authenticated connection from `rank`, for the next accept that expects it
/// (the oldest goes past [`EARLY_PER_RANK`]).
fn keep_early(early: &EarlyConnections, rank: u32, a: Accepted) {
    let mut e = early.lock().unwrap_or_else(|p| p.into_inner());
    let q = e.entry(rank).or_default();
    if q.len() == EARLY_PER_RANK {
        q.pop_front();
    }
    q.push_back(a);
}

/// The oldest early connection from `rank` still open (its dialler may have given up and
/// closed it: those are dropped).
fn take_early(early: &EarlyConnections, rank: u32) -> Option<Accepted> {
    let mut e = early.lock().unwrap_or_else(|p| p.into_inner());
    let q = e.get_mut(&rank)?;
    while let Some(a) = q.pop_front() {
        if still_open(&a.0) {
            return Some(a);
        }
    }
    None
}

/// Whether the peer has not closed `s` (a look without blocking: bytes waiting, or none yet).
fn still_open(s: &TcpStream) -> bool {
    if s.set_nonblocking(true).is_err() {
        return false;
    }
    let mut b = [0u8; 1];
    let open = match s.peek(&mut b) {
        Ok(n) => n > 0,
        Err(e) => e.kind() == io::ErrorKind::WouldBlock,
    };
    open && s.set_nonblocking(false).is_ok()
}

/// Connects to the endpoint of a peer rank, proves this rank's identity, and starts the
/// connection with `regions` granted. `alive` is asked while the peer is not yet listening.
#[allow(clippy::too_many_arguments)]
pub fn connect(
    addr: &str,
    my_rank: u32,
    world_size: u32,
    token: &JobToken,
    regions: &[SlotRegion],
    alive: &dyn Fn() -> Result<()>,
    timeout: Duration,
    deadline: Deadline,
) -> Result<TcpConnection> {
    let (s, keys) = dial(
        addr,
        my_rank,
        world_size,
        token,
        Acceptor::ANY,
        alive,
        deadline,
    )?;
    TcpConnection::start(s, addr.to_owned(), timeout, regions, keys)
}

/// Dials `addr` and authenticates both ways. A peer that dies while we connect shows up as a
/// reset or EOF here; the liveness mesh knows why, and its answer (the lost rank) is the useful
/// error.
fn dial(
    addr: &str,
    my_rank: u32,
    world_size: u32,
    token: &JobToken,
    to: Acceptor<'_>,
    alive: &dyn Fn() -> Result<()>,
    deadline: Deadline,
) -> Result<(TcpStream, SessionKeys)> {
    let attempt = dial_authenticated(addr, my_rank, world_size, token, to, alive, deadline);
    if attempt.is_err() {
        std::thread::sleep(Duration::from_millis(300).min(deadline.remaining()));
        alive()?;
    }
    attempt
}

fn dial_authenticated(
    addr: &str,
    my_rank: u32,
    world_size: u32,
    token: &JobToken,
    to: Acceptor<'_>,
    alive: &dyn Fn() -> Result<()>,
    deadline: Deadline,
) -> Result<(TcpStream, SessionKeys)> {
    let mut s = crate::net::connect_retrying(addr, deadline, alive)?;
    let keys = handshake::dial(&mut s, addr, my_rank, world_size, token, to, deadline)?;
    Ok((s, keys))
}

/// Two connected ends on the loopback interface, in this process (rank 0 accepting, rank 1
/// connecting), for benches and tests: the accepting end is returned first.
pub fn loopback_pair(token: &JobToken) -> Result<(TcpConnection, TcpConnection)> {
    // The setup ends as soon as both ends proved the token; the ample deadline only matters on
    // a loaded machine (valgrind beside other tests on two CPUs once needed more than 5 s).
    loopback_pair_tokens(token.clone(), token.clone(), Duration::from_secs(60))
}

/// [`loopback_pair`] with a token per end and a deadline for the setup (an acceptor that
/// refuses the dialler waits for it until then).
fn loopback_pair_tokens(
    accept: JobToken,
    dial: JobToken,
    setup: Duration,
) -> Result<(TcpConnection, TcpConnection)> {
    // The connections' own timeout (each blocking call of theirs).
    let timeout = Duration::from_secs(5);
    let ep = TcpEndpoint::bind("127.0.0.1:0", accept, timeout)?;
    let addr = ep.local_addr()?.to_string();
    let t = std::thread::spawn(move || {
        connect(
            &addr,
            1,
            2,
            &dial,
            &[],
            &|| Ok(()),
            timeout,
            Deadline::after(setup),
        )
    });
    let accepted = ep.accept(&[1], 2, &|_| Vec::new(), &|| Ok(()), Deadline::after(setup));
    let connected = t.join().map_err(|_| Error::InvalidArgument {
        reason: "the connecting thread panicked".into(),
    })?;
    let mut accepted = accepted?;
    let a = accepted.remove(&1).ok_or_else(|| Error::InvalidArgument {
        reason: "rank 1 did not connect".into(),
    })?;
    Ok((a, connected?))
}

/// How long a test's wait that should end at once (an event, or an error on its way) may take:
/// ample, for valgrind beside other tests on two CPUs; it ends as soon as the event comes.
#[cfg(test)]
const AMPLE: Duration = Duration::from_secs(60);

#[cfg(test)]
mod inline_tests;

#[cfg(test)]
mod tests;

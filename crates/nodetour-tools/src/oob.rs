//! The out-of-band channel: a TCP connection over which two processes exchange endpoint
//! descriptions and small control messages before (and while) RDMA moves the data.
//!
//! Frames are `"NDTR" | version u8 | kind u8 | 0u16 | length u32 (big-endian) | payload`,
//! at most [`MAX_PAYLOAD`] bytes of payload. Every connect, accept and read has a deadline; a
//! peer that sends garbage, a truncated frame, or disconnects yields a typed error, never a hang
//! or a panic. Both ends prove the job token before anything is exchanged (the handshake of
//! [`nodetour_core::auth::handshake`]), and every frame after it carries a session tag (numbered: a
//! frame forged, altered, replayed or dropped on the way fails).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::time::Duration;

use nodetour_core::Deadline;
use nodetour_core::auth::{Acceptor, JobToken, SessionKeys, TAG_LEN, handshake};
use nodetour_core::verbs::EndpointDescription;
use nodetour_core::{Error, Result};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"NDTR";
/// Frame format version.
pub const FRAME_VERSION: u8 = 1;
/// Frame header length.
pub const HEADER_LEN: usize = 12;
/// Largest payload accepted.
pub const MAX_PAYLOAD: u32 = 64 * 1024;

/// What a frame carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum MessageKind {
    /// An encoded [`EndpointDescription`].
    Endpoint = 1,
    /// "My side is ready" (receives posted, regions registered).
    Ready = 2,
    /// "I am done"; the payload is the sender's result (e.g. a checksum).
    Done = 3,
    /// The sender failed; the payload is its error text.
    Failed = 4,
}

impl MessageKind {
    fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => MessageKind::Endpoint,
            2 => MessageKind::Ready,
            3 => MessageKind::Done,
            4 => MessageKind::Failed,
            _ => return None,
        })
    }
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// Its kind.
    pub kind: MessageKind,
    /// Its payload.
    pub payload: Vec<u8>,
}

/// Decodes a frame header: the kind and the payload length.
pub fn decode_header(header: &[u8]) -> Result<(MessageKind, u32)> {
    let bad = |reason: String| Error::Decode {
        what: "out-of-band frame header",
        reason,
    };
    if header.len() != HEADER_LEN {
        return Err(bad(format!(
            "{} bytes, expected {HEADER_LEN}",
            header.len()
        )));
    }
    if header[..4] != MAGIC {
        return Err(bad(format!(
            "bad magic {:02x?} (not a nodetour peer?)",
            &header[..4]
        )));
    }
    if header[4] != FRAME_VERSION {
        return Err(bad(format!(
            "frame version {}, this build speaks {FRAME_VERSION}",
            header[4]
        )));
    }
    let kind = MessageKind::from_code(header[5])
        .ok_or_else(|| bad(format!("unknown kind {}", header[5])))?;
    if header[6..8] != [0, 0] {
        return Err(bad("reserved bytes are not zero".into()));
    }
    let len = u32::from_be_bytes(header[8..12].try_into().expect("4 bytes"));
    if len > MAX_PAYLOAD {
        return Err(bad(format!("payload of {len} bytes exceeds {MAX_PAYLOAD}")));
    }
    Ok((kind, len))
}

/// Encodes a frame.
pub fn encode_frame(kind: MessageKind, payload: &[u8]) -> Result<Vec<u8>> {
    let len = u32::try_from(payload.len())
        .ok()
        .filter(|l| *l <= MAX_PAYLOAD)
        .ok_or_else(|| Error::InvalidArgument {
            reason: format!("a payload of {} bytes exceeds {MAX_PAYLOAD}", payload.len()),
        })?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.push(FRAME_VERSION);
    out.push(kind as u8);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// A listening socket for the out-of-band channel.
pub struct OobListener {
    listener: TcpListener,
}

impl OobListener {
    /// Listens on `addr` (port 0 picks a free port).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        let peer = format!("{addr:?}");
        let listener = TcpListener::bind(&addr).map_err(|source| Error::Exchange {
            op: "bind",
            peer,
            source,
        })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| Error::Exchange {
                op: "bind",
                peer: format!("{addr:?}"),
                source,
            })?;
        Ok(OobListener { listener })
    }

    /// The address actually bound.
    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.listener
            .local_addr()
            .map_err(|source| Error::Exchange {
                op: "bind",
                peer: "local".into(),
                source,
            })
    }

    /// Accepts one peer that proves `token` before `deadline` (others are refused, logged, and
    /// do not end the wait).
    pub fn accept(&self, token: &JobToken, deadline: Deadline) -> Result<OobChannel> {
        loop {
            match self.listener.accept() {
                Ok((stream, peer)) => {
                    let peer = peer.to_string();
                    match handshake::accept(stream, &peer, token, 2, Acceptor::ANY, deadline) {
                        Ok((stream, 1, keys)) => {
                            return OobChannel::from_stream(stream, peer, keys);
                        }
                        Ok((_, rank, _)) => {
                            tracing::warn!(%peer, rank, "refused an out-of-band peer claiming another rank")
                        }
                        Err(e) => tracing::warn!(%peer, error = %e, "refused an out-of-band peer"),
                    }
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(source) => {
                    return Err(Error::Exchange {
                        op: "accept",
                        peer: "listener".into(),
                        source,
                    });
                }
            }
            deadline.check(|| "a peer to connect to the out-of-band listener".into())?;
            nodetour_core::net::wait_readable(
                self.listener.as_raw_fd(),
                deadline,
                Duration::from_millis(200),
            );
        }
    }
}

/// A connected, authenticated out-of-band channel.
pub struct OobChannel {
    stream: TcpStream,
    peer: String,
    keys: SessionKeys,
}

impl OobChannel {
    /// Connects to `addr` ("host:port"), retrying while the peer is not listening yet, and
    /// proves `token` both ways, until `deadline`.
    pub fn connect(addr: &str, token: &JobToken, deadline: Deadline) -> Result<Self> {
        let mut stream = nodetour_core::net::connect_retrying(addr, deadline, &|| Ok(()))?;
        let keys = handshake::dial(&mut stream, addr, 1, 2, token, Acceptor::ANY, deadline)?;
        Self::from_stream(stream, addr.to_owned(), keys)
    }

    fn from_stream(stream: TcpStream, peer: String, keys: SessionKeys) -> Result<Self> {
        let setup = |source| Error::Exchange {
            op: "configure",
            peer: peer.clone(),
            source,
        };
        stream.set_nonblocking(false).map_err(setup)?;
        stream.set_nodelay(true).map_err(setup)?;
        Ok(OobChannel { stream, peer, keys })
    }

    /// The peer's address.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sends one frame.
    pub fn send(&mut self, kind: MessageKind, payload: &[u8], deadline: Deadline) -> Result<()> {
        let mut frame = encode_frame(kind, payload)?;
        let tag = self.keys.send.seal(&[&frame]);
        frame.extend_from_slice(&tag);
        self.stream
            .set_write_timeout(Some(deadline.remaining().max(Duration::from_millis(1))))
            .and_then(|()| self.stream.write_all(&frame))
            .map_err(|e| self.io_error("write", e, deadline))
    }

    /// Receives one frame before `deadline`.
    pub fn recv(&mut self, deadline: Deadline) -> Result<Message> {
        let mut header = [0u8; HEADER_LEN];
        self.read_exact(&mut header, deadline)?;
        let (kind, len) = decode_header(&header)?;
        let mut payload = vec![0u8; len as usize];
        self.read_exact(&mut payload, deadline)?;
        let mut tag = [0u8; TAG_LEN];
        self.read_exact(&mut tag, deadline)?;
        let mut frame = header.to_vec();
        frame.extend_from_slice(&payload);
        if !self.keys.recv.open(&[&frame], &tag) {
            return Err(Error::Authenticate {
                peer: self.peer.clone(),
                reason: "an out-of-band frame failed its session tag (forged, altered, replayed \
                         or reordered on the way)"
                    .into(),
            });
        }
        Ok(Message { kind, payload })
    }

    /// Receives one frame and checks it is of `kind`. A `Failed` frame from the peer becomes
    /// an error carrying the peer's message.
    pub fn expect(&mut self, kind: MessageKind, deadline: Deadline) -> Result<Vec<u8>> {
        let m = self.recv(deadline)?;
        match m.kind {
            k if k == kind => Ok(m.payload),
            MessageKind::Failed => Err(Error::PeerMismatch {
                reason: format!(
                    "peer {} failed: {}",
                    self.peer,
                    String::from_utf8_lossy(&m.payload)
                ),
            }),
            other => Err(Error::Decode {
                what: "out-of-band message",
                reason: format!("expected {kind:?}, got {other:?}"),
            }),
        }
    }

    /// Sends our endpoint description and receives the peer's.
    pub fn exchange_endpoints(
        &mut self,
        ours: &EndpointDescription,
        deadline: Deadline,
    ) -> Result<EndpointDescription> {
        self.send(MessageKind::Endpoint, &ours.encode()?, deadline)?;
        EndpointDescription::decode(&self.expect(MessageKind::Endpoint, deadline)?)
    }

    fn read_exact(&mut self, buf: &mut [u8], deadline: Deadline) -> Result<()> {
        let mut at = 0;
        while at < buf.len() {
            let left = deadline.remaining();
            if left.is_zero() {
                return Err(
                    deadline.timeout(format!("a message from out-of-band peer {}", self.peer))
                );
            }
            self.stream
                .set_read_timeout(Some(left))
                .map_err(|e| self.io_error("read", e, deadline))?;
            match self.stream.read(&mut buf[at..]) {
                Ok(0) => {
                    return Err(Error::Exchange {
                        op: "read",
                        peer: self.peer.clone(),
                        source: io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            format!(
                                "peer closed the connection after {at} of {} bytes",
                                buf.len()
                            ),
                        ),
                    });
                }
                Ok(n) => at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_error("read", e, deadline)),
            }
        }
        Ok(())
    }

    fn io_error(&self, op: &'static str, e: io::Error, deadline: Deadline) -> Error {
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            deadline.timeout(format!("out-of-band {op} with {}", self.peer))
        } else {
            Error::Exchange {
                op,
                peer: self.peer.clone(),
                source: e,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    fn pair() -> (OobChannel, OobChannel) {
        let l = OobListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = thread::spawn(move || {
            let token = JobToken::new("t");
            OobChannel::connect(&addr, &token, Deadline::after(Duration::from_secs(5))).unwrap()
        });
        let token = JobToken::new("t");
        let server = l
            .accept(&token, Deadline::after(Duration::from_secs(5)))
            .unwrap();
        (server, t.join().unwrap())
    }

    #[test]
    fn a_peer_without_the_token_is_refused_and_a_forged_frame_fails_its_tag() {
        let l = OobListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let t = thread::spawn(move || {
            let wrong = JobToken::new("not the job's");
            OobChannel::connect(&addr, &wrong, Deadline::after(Duration::from_secs(5)))
        });
        let waited = l.accept(
            &JobToken::new("t"),
            Deadline::after(Duration::from_millis(1500)),
        );
        assert!(
            matches!(waited, Err(Error::Timeout { .. })),
            "the stranger was refused and the wait went on"
        );
        assert!(matches!(t.join().unwrap(), Err(Error::Authenticate { .. })));
        // A frame written on the connection without the session's key.
        let (mut a, b) = pair();
        let mut raw = b.stream.try_clone().unwrap();
        let mut forged = encode_frame(MessageKind::Done, b"forged").unwrap();
        forged.extend_from_slice(&[0; TAG_LEN]);
        raw.write_all(&forged).unwrap();
        match a.recv(Deadline::after(Duration::from_secs(5))) {
            Err(Error::Authenticate { reason, .. }) => assert!(reason.contains("session tag")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn frames_round_trip() {
        let (mut a, mut b) = pair();
        let d = Deadline::after(Duration::from_secs(5));
        a.send(MessageKind::Done, b"checksum", d).unwrap();
        assert_eq!(
            b.recv(d).unwrap(),
            Message {
                kind: MessageKind::Done,
                payload: b"checksum".to_vec()
            }
        );
        b.send(MessageKind::Ready, &[], d).unwrap();
        assert_eq!(a.expect(MessageKind::Ready, d).unwrap(), Vec::<u8>::new());
    }

    #[test]
    fn header_checks() {
        let good = encode_frame(MessageKind::Ready, b"x").unwrap();
        assert!(decode_header(&good[..HEADER_LEN]).is_ok());
        let mut cases = vec![];
        let mut m = good.clone();
        m[0] = b'X';
        cases.push((m, "magic"));
        let mut m = good.clone();
        m[4] = 9;
        cases.push((m, "version"));
        let mut m = good.clone();
        m[5] = 77;
        cases.push((m, "unknown kind"));
        let mut m = good.clone();
        m[6] = 1;
        cases.push((m, "reserved"));
        let mut m = good.clone();
        m[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_be_bytes());
        cases.push((m, "exceeds"));
        for (bytes, expect) in cases {
            match decode_header(&bytes[..HEADER_LEN]) {
                Err(Error::Decode { reason, .. }) => assert!(reason.contains(expect), "{reason}"),
                other => panic!("{expect}: {other:?}"),
            }
        }
        assert!(decode_header(&good[..5]).is_err());
        assert!(encode_frame(MessageKind::Done, &vec![0; MAX_PAYLOAD as usize + 1]).is_err());
    }

    #[test]
    fn garbage_from_a_peer_is_a_decode_error() {
        let (mut a, b) = pair();
        let mut raw = b.stream.try_clone().unwrap();
        raw.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        assert!(matches!(
            a.recv(Deadline::after(Duration::from_secs(5))),
            Err(Error::Decode { .. })
        ));
    }

    #[test]
    fn disconnect_mid_frame_is_an_eof_error() {
        let (mut a, b) = pair();
        let mut raw = b.stream.try_clone().unwrap();
        let frame = encode_frame(MessageKind::Endpoint, &[1; 40]).unwrap();
        raw.write_all(&frame[..20]).unwrap();
        drop(raw);
        drop(b);
        match a.recv(Deadline::after(Duration::from_secs(5))) {
            Err(Error::Exchange {
                op: "read", source, ..
            }) => {
                assert_eq!(source.kind(), io::ErrorKind::UnexpectedEof);
                assert!(
                    source.to_string().contains("after 8 of 40 bytes"),
                    "{source}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_silent_peer_times_out() {
        let (mut a, _b) = pair();
        let start = std::time::Instant::now();
        match a.recv(Deadline::after(Duration::from_millis(200))) {
            Err(Error::Timeout { .. }) => {}
            other => panic!("{other:?}"),
        }
        assert!(start.elapsed() < Duration::from_secs(3));
    }

    #[test]
    fn nobody_listening_times_out() {
        // Bind then drop to get a port nobody listens on.
        let port = OobListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let r = OobChannel::connect(
            &format!("127.0.0.1:{port}"),
            &JobToken::new("t"),
            Deadline::after(Duration::from_millis(300)),
        );
        assert!(matches!(r, Err(Error::Timeout { .. })), "{:?}", r.err());
        let l = OobListener::bind("127.0.0.1:0").unwrap();
        assert!(matches!(
            l.accept(
                &JobToken::new("t"),
                Deadline::after(Duration::from_millis(100))
            ),
            Err(Error::Timeout { .. })
        ));
    }

    #[test]
    fn a_failed_peer_is_reported_with_its_message() {
        let (mut a, mut b) = pair();
        let d = Deadline::after(Duration::from_secs(5));
        b.send(MessageKind::Failed, b"registration refused", d)
            .unwrap();
        let e = a.expect(MessageKind::Endpoint, d).unwrap_err();
        assert!(e.to_string().contains("registration refused"), "{e}");
    }
}

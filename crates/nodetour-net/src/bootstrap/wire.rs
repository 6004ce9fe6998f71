//! Bootstrap messages and their wire form.
//!
//! Frame: `"NDTB" | version u8 | kind u8 | 0u16 | length u32 | payload`, big-endian. Every length
//! inside is bounded and checked before use; any input decodes or fails with
//! [`Error::Decode`] (a `cargo fuzz` target holds the decoder to that).

use super::host::HostIdentity;
use nodetour_core::auth::{Nonce, Proof};
use nodetour_core::{Error, Result};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"NDTB";
/// Protocol version (2: rank 0 relays a rank's departure, `RankLeft`; 3: every message after
/// the proofs carries a session tag).
pub const VERSION: u8 = 3;
/// Header length.
pub const HEADER_LEN: usize = 12;
/// Largest payload (a peer table of thousands of ranks fits).
pub const MAX_PAYLOAD: u32 = 4 << 20;
/// Largest string field.
pub const MAX_STRING: usize = 1024;
/// Largest opaque blob per rank (endpoint descriptions).
pub const MAX_BLOB: usize = 64 << 10;
/// Most ranks in a table.
pub const MAX_RANKS: u32 = 1 << 16;

/// What one rank tells the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerEntry {
    /// Its rank.
    pub rank: u32,
    /// Its host and namespaces.
    pub host: HostIdentity,
    /// Where it accepts transport connections (`host:port`).
    pub address: String,
    /// Transport-specific data (encoded endpoint descriptions, ...).
    pub blob: Vec<u8>,
}

/// A bootstrap message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Server → client: prove you know the token, over this nonce.
    Challenge {
        /// The server's nonce.
        nonce: Nonce,
    },
    /// Client → server: the claimed rank and world size, the proof, and the client's nonce.
    Hello {
        /// Claimed rank.
        rank: u32,
        /// Claimed world size.
        world_size: u32,
        /// HMAC over the server's nonce, rank and world size.
        proof: Proof,
        /// The client's nonce for the server's proof.
        nonce: Nonce,
    },
    /// Server → client: the server's proof over the client's nonce.
    ServerProof {
        /// HMAC over the client's nonce.
        proof: Proof,
    },
    /// Client → server (after both proofs): what the client tells the job.
    Join(PeerEntry),
    /// Server → client: every rank's entry, by rank.
    Table(Vec<PeerEntry>),
    /// Either way: refused, and why.
    Reject {
        /// Why.
        reason: String,
    },
    /// Either way, after the rendezvous: this rank leaves on purpose (not a failure).
    Goodbye,
    /// Client → server: this rank reached barrier `generation`.
    Barrier {
        /// Which barrier (1, 2, ...).
        generation: u64,
    },
    /// Server → client: every rank reached barrier `generation`.
    BarrierRelease {
        /// Which barrier.
        generation: u64,
    },
    /// Server → client: a rank left on purpose (it said goodbye).
    RankLeft {
        /// Which.
        rank: u32,
    },
    /// Server → client: a rank is gone.
    RankLost {
        /// Which.
        rank: u32,
        /// How it was noticed.
        reason: String,
    },
}

impl Message {
    fn kind(&self) -> u8 {
        match self {
            Message::Challenge { .. } => 1,
            Message::Hello { .. } => 2,
            Message::ServerProof { .. } => 3,
            Message::Join(_) => 4,
            Message::Table(_) => 5,
            Message::Reject { .. } => 6,
            Message::RankLost { .. } => 7,
            Message::Goodbye => 8,
            Message::Barrier { .. } => 9,
            Message::BarrierRelease { .. } => 10,
            Message::RankLeft { .. } => 11,
        }
    }

    /// Encodes the whole frame.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let mut p = Vec::new();
        match self {
            Message::Challenge { nonce } => p.extend_from_slice(nonce),
            Message::Hello {
                rank,
                world_size,
                proof,
                nonce,
            } => {
                p.extend_from_slice(&rank.to_be_bytes());
                p.extend_from_slice(&world_size.to_be_bytes());
                p.extend_from_slice(proof);
                p.extend_from_slice(nonce);
            }
            Message::ServerProof { proof } => p.extend_from_slice(proof),
            Message::Join(e) => put_entry(&mut p, e)?,
            Message::Table(entries) => {
                p.extend_from_slice(&(entries.len() as u32).to_be_bytes());
                for e in entries {
                    put_entry(&mut p, e)?;
                }
            }
            Message::Reject { reason } => put_str(&mut p, reason)?,
            Message::RankLost { rank, reason } => {
                p.extend_from_slice(&rank.to_be_bytes());
                put_str(&mut p, reason)?;
            }
            Message::Goodbye => {}
            Message::Barrier { generation } | Message::BarrierRelease { generation } => {
                p.extend_from_slice(&generation.to_be_bytes())
            }
            Message::RankLeft { rank } => p.extend_from_slice(&rank.to_be_bytes()),
        }
        let len = u32::try_from(p.len())
            .ok()
            .filter(|l| *l <= MAX_PAYLOAD)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!(
                    "a bootstrap message of {} bytes exceeds {MAX_PAYLOAD}",
                    p.len()
                ),
            })?;
        let mut out = Vec::with_capacity(HEADER_LEN + p.len());
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&[VERSION, self.kind(), 0, 0]);
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&p);
        Ok(out)
    }

    /// Decodes a header: the kind and the payload length.
    pub fn decode_header(h: &[u8]) -> Result<(u8, u32)> {
        if h.len() != HEADER_LEN {
            return Err(bad(format!("header of {} bytes", h.len())));
        }
        if h[..4] != MAGIC {
            return Err(bad(format!(
                "bad magic {:02x?}: not a nodetour bootstrap peer",
                &h[..4]
            )));
        }
        if h[4] != VERSION {
            return Err(bad(format!(
                "protocol version {}, this build speaks {VERSION}",
                h[4]
            )));
        }
        if !(1..=11).contains(&h[5]) {
            return Err(bad(format!("unknown message kind {}", h[5])));
        }
        if h[6..8] != [0, 0] {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let len = u32::from_be_bytes(h[8..12].try_into().expect("4 bytes"));
        if len > MAX_PAYLOAD {
            return Err(bad(format!("payload of {len} bytes exceeds {MAX_PAYLOAD}")));
        }
        Ok((h[5], len))
    }

    /// Decodes a payload of `kind`.
    pub fn decode_payload(kind: u8, payload: &[u8]) -> Result<Message> {
        let mut r = Reader(payload);
        let m = match kind {
            1 => Message::Challenge { nonce: r.array()? },
            2 => Message::Hello {
                rank: r.u32()?,
                world_size: r.u32()?,
                proof: r.array()?,
                nonce: r.array()?,
            },
            3 => Message::ServerProof { proof: r.array()? },
            4 => Message::Join(r.entry()?),
            5 => {
                let n = r.u32()?;
                if n > MAX_RANKS {
                    return Err(bad(format!("a table of {n} ranks exceeds {MAX_RANKS}")));
                }
                let mut entries = Vec::with_capacity(n.min(1024) as usize);
                for _ in 0..n {
                    entries.push(r.entry()?);
                }
                Message::Table(entries)
            }
            6 => Message::Reject {
                reason: r.string()?,
            },
            7 => Message::RankLost {
                rank: r.u32()?,
                reason: r.string()?,
            },
            8 => Message::Goodbye,
            9 => Message::Barrier {
                generation: r.u64()?,
            },
            10 => Message::BarrierRelease {
                generation: r.u64()?,
            },
            11 => Message::RankLeft { rank: r.u32()? },
            k => return Err(bad(format!("unknown message kind {k}"))),
        };
        if !r.0.is_empty() {
            return Err(bad(format!("{} trailing bytes", r.0.len())));
        }
        Ok(m)
    }

    /// Decodes a whole frame (header and payload).
    pub fn decode(frame: &[u8]) -> Result<Message> {
        if frame.len() < HEADER_LEN {
            return Err(bad(format!("frame of {} bytes", frame.len())));
        }
        let (kind, len) = Self::decode_header(&frame[..HEADER_LEN])?;
        if frame.len() - HEADER_LEN != len as usize {
            return Err(bad(format!(
                "header announces {len} bytes, frame carries {}",
                frame.len() - HEADER_LEN
            )));
        }
        Self::decode_payload(kind, &frame[HEADER_LEN..])
    }
}

fn bad(reason: String) -> Error {
    Error::Decode {
        what: "bootstrap message",
        reason,
    }
}

fn put_str(p: &mut Vec<u8>, s: &str) -> Result<()> {
    if s.len() > MAX_STRING {
        return Err(Error::InvalidArgument {
            reason: format!("a string of {} bytes exceeds {MAX_STRING}", s.len()),
        });
    }
    p.extend_from_slice(&(s.len() as u16).to_be_bytes());
    p.extend_from_slice(s.as_bytes());
    Ok(())
}

fn put_entry(p: &mut Vec<u8>, e: &PeerEntry) -> Result<()> {
    p.extend_from_slice(&e.rank.to_be_bytes());
    put_str(p, &e.host.boot_id)?;
    for ns in [e.host.net_ns, e.host.ipc_ns, e.host.mnt_ns] {
        p.extend_from_slice(&ns.to_be_bytes());
    }
    put_str(p, &e.address)?;
    if e.blob.len() > MAX_BLOB {
        return Err(Error::InvalidArgument {
            reason: format!("a blob of {} bytes exceeds {MAX_BLOB}", e.blob.len()),
        });
    }
    p.extend_from_slice(&(e.blob.len() as u32).to_be_bytes());
    p.extend_from_slice(&e.blob);
    Ok(())
}

/// A cursor that checks every length against what is left.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.0.len() {
            return Err(bad(format!(
                "truncated: needed {n} more bytes, {} left",
                self.0.len()
            )));
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Ok(head)
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_be_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_be_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u16()? as usize;
        if n > MAX_STRING {
            return Err(bad(format!("a string of {n} bytes exceeds {MAX_STRING}")));
        }
        String::from_utf8(self.take(n)?.to_vec()).map_err(|_| bad("a string is not UTF-8".into()))
    }
    fn entry(&mut self) -> Result<PeerEntry> {
        let rank = self.u32()?;
        let boot_id = self.string()?;
        let (net_ns, ipc_ns, mnt_ns) = (self.u64()?, self.u64()?, self.u64()?);
        let address = self.string()?;
        let n = self.u32()? as usize;
        if n > MAX_BLOB {
            return Err(bad(format!("a blob of {n} bytes exceeds {MAX_BLOB}")));
        }
        let blob = self.take(n)?.to_vec();
        Ok(PeerEntry {
            rank,
            host: HostIdentity {
                boot_id,
                net_ns,
                ipc_ns,
                mnt_ns,
            },
            address,
            blob,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn entry(rank: u32) -> PeerEntry {
        PeerEntry {
            rank,
            host: HostIdentity {
                boot_id: "b0a1-…".into(),
                net_ns: 1,
                ipc_ns: 2,
                mnt_ns: 3,
            },
            address: format!("10.0.0.{rank}:4000"),
            blob: vec![rank as u8; 40],
        }
    }

    pub(crate) fn samples() -> Vec<Message> {
        vec![
            Message::Challenge { nonce: [7; 32] },
            Message::Hello {
                rank: 3,
                world_size: 8,
                proof: [1; 32],
                nonce: [2; 32],
            },
            Message::ServerProof { proof: [9; 32] },
            Message::Join(entry(3)),
            Message::Table((0..4).map(entry).collect()),
            Message::Reject {
                reason: "wrong token".into(),
            },
            Message::RankLost {
                rank: 2,
                reason: "connection closed".into(),
            },
            Message::Goodbye,
            Message::Barrier { generation: 3 },
            Message::BarrierRelease { generation: 3 },
            Message::RankLeft { rank: 5 },
        ]
    }

    #[test]
    fn every_message_round_trips() {
        for m in samples() {
            assert_eq!(Message::decode(&m.encode().unwrap()).unwrap(), m);
        }
    }

    #[test]
    fn malformed_frames_are_typed_errors() {
        let good = samples()[4].encode().unwrap();
        let mut cases: Vec<Vec<u8>> = vec![
            vec![],
            good[..11].to_vec(),
            good[..good.len() - 1].to_vec(),
            [good.clone(), vec![0]].concat(),
        ];
        for (at, v) in [
            (0, b'X'),
            (4, VERSION + 1),
            (4, VERSION - 1),
            (5, 0),
            (5, 12),
            (6, 1),
        ] {
            let mut m = good.clone();
            m[at] = v;
            cases.push(m);
        }
        let mut huge = good.clone();
        huge[8..12].copy_from_slice(&(MAX_PAYLOAD + 1).to_be_bytes());
        cases.push(huge);
        let mut many = Message::Table(vec![]).encode().unwrap();
        many[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
        cases.push(many);
        for c in cases {
            assert!(
                matches!(Message::decode(&c), Err(Error::Decode { .. })),
                "{c:?}"
            );
        }
        assert!(
            Message::Reject {
                reason: "x".repeat(MAX_STRING + 1)
            }
            .encode()
            .is_err()
        );
    }

    proptest! {
        #[test]
        fn decoding_never_panics(kind in 0u8..12, payload in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = Message::decode_payload(kind, &payload);
        }
    }

    #[test]
    fn a_table_of_4096_ranks_encodes_within_the_limit_and_round_trips() {
        // What the communicator announces: a host identity, an address, 12 bytes of blob.
        let entries: Vec<PeerEntry> = (0..4096u32)
            .map(|r| PeerEntry {
                rank: r,
                host: HostIdentity {
                    boot_id: format!("{:08x}-7d1c-4e5f-9a0b-{:012x}", r / 8, r / 8),
                    net_ns: 4026531840,
                    ipc_ns: 4026531839,
                    mnt_ns: 4026531841,
                },
                address: format!(
                    "10.{}.{}.{}:{}",
                    r >> 16,
                    (r >> 8) & 255,
                    r & 255,
                    40000 + r % 1000
                ),
                blob: vec![b'n'; 12],
            })
            .collect();
        let frame = Message::Table(entries.clone()).encode().unwrap();
        assert!(
            frame.len() < MAX_PAYLOAD as usize / 8,
            "{} bytes",
            frame.len()
        );
        assert_eq!(Message::decode(&frame).unwrap(), Message::Table(entries));
        // Blobs at their limit on 4096 ranks exceed the frame limit: a typed error, no frame.
        let fat: Vec<PeerEntry> = (0..4096u32)
            .map(|r| PeerEntry {
                blob: vec![0; MAX_BLOB],
                ..entry(r)
            })
            .collect();
        assert!(Message::Table(fat).encode().is_err());
    }
}

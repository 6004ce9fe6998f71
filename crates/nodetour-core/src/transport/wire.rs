//! The tcp transport's write frames: `"NDTW" | flags u8 | 0 0 0 | key u32 | offset u64 | len u32
//! | notify u32 | tag [16] | payload`. The receiver decodes the header, checks key, offset and
//! length against the regions granted on that connection, then the tag (the session key of
//! that direction over the frame's number, the header, and the payload when it is at most
//! [`CONTROL_MAX`] bytes: notifications, grants and descriptors are authenticated before they
//! land), and only then lets the payload into the region.

use crate::error::{Error, Result};

/// Frame magic.
pub const MAGIC: [u8; 4] = *b"NDTW";
/// Header length.
pub const HEADER_LEN: usize = 28;
/// Largest payload of one frame; longer writes are split (the notification rides the last).
pub const MAX_FRAME: u32 = 1 << 30;
const HAS_NOTIFY: u8 = 1;
/// Payloads up to this size are covered by the frame's tag (and land only once it checks);
/// larger ones are data, whose header alone is tagged.
pub const CONTROL_MAX: u32 = 4096;

/// A decoded write header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteHeader {
    /// Destination region key.
    pub key: u32,
    /// Destination offset.
    pub offset: u64,
    /// Payload length.
    pub len: u32,
    /// Notification delivered after the payload.
    pub notify: Option<u32>,
}

impl WriteHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..4].copy_from_slice(&MAGIC);
        h[4] = if self.notify.is_some() { HAS_NOTIFY } else { 0 };
        h[8..12].copy_from_slice(&self.key.to_be_bytes());
        h[12..20].copy_from_slice(&self.offset.to_be_bytes());
        h[20..24].copy_from_slice(&self.len.to_be_bytes());
        h[24..28].copy_from_slice(&self.notify.unwrap_or(0).to_be_bytes());
        h
    }

    /// Decodes and validates a header.
    pub fn decode(h: &[u8]) -> Result<WriteHeader> {
        let bad = |reason: String| Error::Decode {
            what: "tcp write frame",
            reason,
        };
        if h.len() != HEADER_LEN {
            return Err(bad(format!("header of {} bytes", h.len())));
        }
        if h[..4] != MAGIC {
            return Err(bad(format!("bad magic {:02x?}", &h[..4])));
        }
        if h[4] & !HAS_NOTIFY != 0 || h[5..8] != [0, 0, 0] {
            return Err(bad("unknown flags or non-zero reserved bytes".into()));
        }
        let u32_at = |i: usize| u32::from_be_bytes(h[i..i + 4].try_into().expect("4 bytes"));
        let len = u32_at(20);
        if len > MAX_FRAME {
            return Err(bad(format!("payload of {len} bytes exceeds {MAX_FRAME}")));
        }
        let notify = u32_at(24);
        if h[4] & HAS_NOTIFY == 0 && notify != 0 {
            return Err(bad("a notification value without the flag".into()));
        }
        Ok(WriteHeader {
            key: u32_at(8),
            offset: u64::from_be_bytes(h[12..20].try_into().expect("8 bytes")),
            len,
            notify: (h[4] & HAS_NOTIFY != 0).then_some(notify),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_reject_garbage() {
        for h in [
            WriteHeader {
                key: 1,
                offset: 0,
                len: 0,
                notify: None,
            },
            WriteHeader {
                key: u32::MAX,
                offset: u64::MAX,
                len: MAX_FRAME,
                notify: Some(7),
            },
        ] {
            assert_eq!(WriteHeader::decode(&h.encode()).unwrap(), h);
        }
        let good = WriteHeader {
            key: 1,
            offset: 2,
            len: 3,
            notify: Some(4),
        }
        .encode();
        for (at, v) in [(0usize, b'X'), (4, 2), (5, 1), (20, 0x7f)] {
            let mut m = good;
            m[at] = v;
            assert!(WriteHeader::decode(&m).is_err(), "byte {at}");
        }
        let mut m = good;
        m[4] = 0;
        assert!(WriteHeader::decode(&m).is_err(), "value without flag");
        assert!(WriteHeader::decode(&good[..10]).is_err());
    }
}

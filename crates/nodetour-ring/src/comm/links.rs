//! What each rank announces about its links in the bootstrap (the wire-protocol version, the
//! transport it is told to use, whether it has an RDMA device, its GPU and process), which the
//! transport table ([`super::form::table`]) chooses each link's kind from.

use nodetour_core::transport::TransportKind;

use crate::comm::options::MUST_AGREE;
use crate::descriptor::PROTOCOL_VERSION;
use crate::error::{Error, Result};

const MAGIC: u8 = b'n';
const HAS_VERBS: u8 = 1;
const HAS_GPU: u8 = 2;
/// Bytes of an encoded announcement.
pub(crate) const ENCODED_LEN: usize = 12 + 1 + 8 * MUST_AGREE.len();

/// What a rank announces about its links (every rank hears it: no keys, no addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Announcement {
    /// The ring protocol version it speaks.
    pub version: u8,
    /// `NODETOUR_TRANSPORT` on that rank.
    pub forced: Option<TransportKind>,
    /// Whether it opened an RDMA device for host memory.
    pub has_verbs: bool,
    /// The GPU (ordinal on its host) whose memory it passes to collectives, if any.
    pub gpu: Option<u32>,
    /// Its process id (ranks that are threads of one process cannot map each other's GPU
    /// memory with cuda-ipc, and share one set of GPUs: `Communicator::from_devices`' case).
    pub pid: u32,
    /// Its values of the settings every rank must share ([`MUST_AGREE`]'s order).
    pub settings: [u64; MUST_AGREE.len()],
}

fn kind_code(k: Option<TransportKind>) -> u8 {
    match k {
        None => 0,
        Some(TransportKind::Verbs) => 1,
        Some(TransportKind::Tcp) => 2,
        Some(TransportKind::CudaIpc) => 3,
        Some(TransportKind::Shm) => 4,
        Some(TransportKind::Mem) => 5,
    }
}

impl Announcement {
    /// This rank's.
    pub(crate) fn ours(
        forced: Option<TransportKind>,
        has_verbs: bool,
        gpu: Option<u32>,
        settings: [u64; MUST_AGREE.len()],
    ) -> Announcement {
        Announcement {
            version: PROTOCOL_VERSION,
            forced,
            has_verbs,
            gpu,
            pid: std::process::id(),
            settings,
        }
    }

    /// `'n' | version | forced | flags | gpu (u32, big-endian; 0 without one) | pid (u32) |
    /// settings (count: u8, then each as u64, big-endian)`.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let flags = u8::from(self.has_verbs) * HAS_VERBS + u8::from(self.gpu.is_some()) * HAS_GPU;
        let mut b = vec![MAGIC, self.version, kind_code(self.forced), flags];
        b.extend_from_slice(&self.gpu.unwrap_or(0).to_be_bytes());
        b.extend_from_slice(&self.pid.to_be_bytes());
        b.push(MUST_AGREE.len() as u8);
        for v in self.settings {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b
    }

    /// What rank `rank` announced; another protocol version is [`Error::Version`].
    pub(crate) fn decode(rank: u32, b: &[u8]) -> Result<Announcement> {
        let bad = |reason: String| Error::Protocol {
            rank,
            reason: format!("its bootstrap announcement: {reason}"),
        };
        if b.len() < 2 || b[0] != MAGIC {
            return Err(bad(format!(
                "{} bytes, not a nodetour ring announcement",
                b.len()
            )));
        }
        if b[1] != PROTOCOL_VERSION {
            return Err(Error::Version {
                rank,
                theirs: b[1],
                ours: PROTOCOL_VERSION,
            });
        }
        if b.len() != ENCODED_LEN {
            return Err(bad(format!("{} bytes, expected {ENCODED_LEN}", b.len())));
        }
        let forced = match b[2] {
            0 => None,
            1 => Some(TransportKind::Verbs),
            2 => Some(TransportKind::Tcp),
            3 => Some(TransportKind::CudaIpc),
            4 => Some(TransportKind::Shm),
            5 => Some(TransportKind::Mem),
            v => return Err(bad(format!("transport code {v}"))),
        };
        if b[3] & !(HAS_VERBS | HAS_GPU) != 0 {
            return Err(bad(format!("unknown flags {:#04x}", b[3])));
        }
        let gpu = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
        if b[3] & HAS_GPU == 0 && gpu != 0 {
            return Err(bad("a GPU ordinal without a GPU".into()));
        }
        if usize::from(b[12]) != MUST_AGREE.len() {
            return Err(bad(format!(
                "{} shared settings, expected {}",
                b[12],
                MUST_AGREE.len()
            )));
        }
        let mut settings = [0u64; MUST_AGREE.len()];
        for (i, v) in settings.iter_mut().enumerate() {
            let at = 13 + 8 * i;
            *v = u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        }
        Ok(Announcement {
            version: b[1],
            forced,
            has_verbs: b[3] & HAS_VERBS != 0,
            gpu: (b[3] & HAS_GPU != 0).then_some(gpu),
            pid: u32::from_be_bytes([b[8], b[9], b[10], b[11]]),
            settings,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> [u64; MUST_AGREE.len()] {
        crate::comm::Options::default().must_agree()
    }

    #[test]
    fn announcements_round_trip_and_another_version_is_typed() {
        for forced in [None, Some(TransportKind::Tcp), Some(TransportKind::Shm)] {
            for has_verbs in [false, true] {
                for gpu in [None, Some(0), Some(7)] {
                    let a = Announcement::ours(forced, has_verbs, gpu, settings());
                    assert_eq!(Announcement::decode(3, &a.encode()), Ok(a));
                }
            }
        }
        let mut old = Announcement::ours(None, true, None, settings()).encode();
        old[1] = PROTOCOL_VERSION.wrapping_sub(1);
        assert!(matches!(
            Announcement::decode(3, &old),
            Err(Error::Version { rank: 3, .. })
        ));
        for bad in [
            &b""[..],
            b"x",
            b"n",
            &[b'n', PROTOCOL_VERSION, 9, 0],
            &[b'n', PROTOCOL_VERSION, 0, 2],
            &[b'n', PROTOCOL_VERSION, 0, 0, 0],
        ] {
            assert!(Announcement::decode(1, bad).is_err(), "{bad:?}");
        }
    }
}

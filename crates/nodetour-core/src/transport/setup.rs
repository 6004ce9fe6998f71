//! What a rank sends each ring neighbour at formation, over the authenticated connection
//! between the two ([`super::tcp::TcpEndpoint::exchange`]) rather than through the bootstrap
//! that every rank hears: the grants that neighbour writes through, and the queue pair made for
//! it alone (verbs), or, in the GPU ring, the cuda-ipc grants and shared-memory names of the
//! sender's flag pages and slots.

use super::SlotGrant;
use super::gpu::IpcGrant;
use crate::error::{Error, Result};
use crate::memory::ShmName;

/// One neighbour's setup, as sent (validated when decoded).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NeighbourSetup {
    /// The sender's receive slots (for its previous rank, which writes them).
    pub recv: Option<SlotGrant>,
    /// The sender's doorbell (for its next rank, which writes grants into it).
    pub bell: Option<SlotGrant>,
    /// The sender's queue pair for this neighbour, an encoded endpoint description (verbs).
    pub endpoint: Option<Vec<u8>>,
}

const HAS_RECV: u8 = 1;
const HAS_BELL: u8 = 2;

impl NeighbourSetup {
    /// Flags, the grants it holds, then the endpoint bytes (the rest).
    pub fn encode(&self) -> Vec<u8> {
        let flags =
            u8::from(self.recv.is_some()) * HAS_RECV + u8::from(self.bell.is_some()) * HAS_BELL;
        let mut b = vec![flags];
        for g in [&self.recv, &self.bell].into_iter().flatten() {
            b.extend_from_slice(&g.encode());
        }
        if let Some(e) = &self.endpoint {
            b.extend_from_slice(e);
        }
        b
    }

    /// Decodes what a neighbour sent: unknown flags, short grants and bad grants are refused.
    pub fn decode(b: &[u8]) -> Result<NeighbourSetup> {
        let bad = |reason: String| Error::Decode {
            what: "neighbour setup",
            reason,
        };
        let (&flags, mut rest) = b.split_first().ok_or_else(|| bad("empty".into()))?;
        if flags & !(HAS_RECV | HAS_BELL) != 0 {
            return Err(bad(format!("unknown flags {flags:#x}")));
        }
        let mut take = |on: bool| -> Result<Option<SlotGrant>> {
            if !on {
                return Ok(None);
            }
            let g = rest
                .get(..SlotGrant::ENCODED_LEN)
                .ok_or_else(|| bad(format!("{} bytes left for a grant", rest.len())))?;
            rest = &rest[SlotGrant::ENCODED_LEN..];
            SlotGrant::decode(g).map(Some)
        };
        let recv = take(flags & HAS_RECV != 0)?;
        let bell = take(flags & HAS_BELL != 0)?;
        let endpoint = (!rest.is_empty()).then(|| rest.to_vec());
        Ok(NeighbourSetup {
            recv,
            bell,
            endpoint,
        })
    }
}

/// How a GPU-ring rank cuts its links: slots, their sizes, and how many chunks a collective's
/// segment is cut into at least (its pipeline). Both ends of a link must have the same shape
/// (each rank compares its neighbours' with its own at formation), else sender and receiver
/// would plan different chunks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingShape {
    /// Slots per direct (cuda-ipc) link.
    pub ipc_slots: u32,
    /// Bytes per direct slot.
    pub ipc_slot_bytes: u64,
    /// Chunks per segment at least, on the direct path (1: one chunk per slot).
    pub ipc_pipeline: u32,
    /// Slots per staged (shm) link.
    pub shm_slots: u32,
    /// Bytes per staged slot.
    pub shm_slot_bytes: u64,
    /// Chunks per segment at least, on the staged path.
    pub shm_pipeline: u32,
}

impl RingShape {
    /// Bytes of [`RingShape::encode`].
    pub const ENCODED_LEN: usize = 32;

    /// Big-endian fields in declaration order.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[0..4].copy_from_slice(&self.ipc_slots.to_be_bytes());
        b[4..12].copy_from_slice(&self.ipc_slot_bytes.to_be_bytes());
        b[12..16].copy_from_slice(&self.ipc_pipeline.to_be_bytes());
        b[16..20].copy_from_slice(&self.shm_slots.to_be_bytes());
        b[20..28].copy_from_slice(&self.shm_slot_bytes.to_be_bytes());
        b[28..32].copy_from_slice(&self.shm_pipeline.to_be_bytes());
        b
    }

    /// The fields back (any values: the receiver compares them with its own).
    pub fn decode(b: &[u8; Self::ENCODED_LEN]) -> RingShape {
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        RingShape {
            ipc_slots: u32_at(0),
            ipc_slot_bytes: u64_at(4),
            ipc_pipeline: u32_at(12),
            shm_slots: u32_at(16),
            shm_slot_bytes: u64_at(20),
            shm_pipeline: u32_at(28),
        }
    }
}

/// What a GPU-ring rank sends a neighbour at formation (validated when decoded): how it cuts
/// its links, its flag pages, which both neighbours write (credits, notices), and, to the
/// previous rank only (which writes them), its slots. No other rank learns these handles and
/// names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuNeighbourSetup {
    /// The sender's slot shapes and pipelines (the receiver checks they are its own).
    pub shape: RingShape,
    /// The sender's host flag page (shared memory).
    pub flags: ShmName,
    /// The sender's flag page in GPU memory (cuda-ipc).
    pub device_flags: IpcGrant,
    /// The sender's receive slots: in GPU memory (cuda-ipc), and in shared host memory with
    /// its length (the staged path).
    pub slots: Option<(IpcGrant, ShmName, u64)>,
}

const HAS_SLOTS: u8 = 1;

impl GpuNeighbourSetup {
    /// A flag, the shape, the device-flag grant, the flag page's name, then the slots if held.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![u8::from(self.slots.is_some()) * HAS_SLOTS];
        b.extend_from_slice(&self.shape.encode());
        b.extend_from_slice(&self.device_flags.encode());
        b.extend_from_slice(&self.flags.encode());
        if let Some((grant, shm, len)) = &self.slots {
            b.extend_from_slice(&grant.encode());
            b.extend_from_slice(&len.to_be_bytes());
            b.extend_from_slice(&shm.encode());
        }
        b
    }

    /// Decodes what a neighbour sent: unknown flags, short or bad grants and names, and bytes
    /// left over are refused.
    pub fn decode(b: &[u8]) -> Result<GpuNeighbourSetup> {
        let mut r = Reader { b, at: 0 };
        let flags = r.take(1, "the flags")?[0];
        if flags & !HAS_SLOTS != 0 {
            return Err(r.bad(format!("unknown flags {flags:#x}")));
        }
        let shape = RingShape::decode(
            r.take(RingShape::ENCODED_LEN, "the ring's shape")?
                .try_into()
                .expect("ENCODED_LEN bytes"),
        );
        let device_flags = IpcGrant::decode(r.take(IpcGrant::ENCODED_LEN, "a grant")?)?;
        let flags_name = r.name()?;
        let slots = if flags & HAS_SLOTS != 0 {
            let grant = IpcGrant::decode(r.take(IpcGrant::ENCODED_LEN, "a grant")?)?;
            let len = u64::from_be_bytes(r.take(8, "a length")?.try_into().expect("8 bytes"));
            Some((grant, r.name()?, len))
        } else {
            None
        };
        if r.at != b.len() {
            return Err(r.bad(format!("{} bytes left over", b.len() - r.at)));
        }
        Ok(GpuNeighbourSetup {
            shape,
            flags: flags_name,
            device_flags,
            slots,
        })
    }
}

/// Reads fields off a GPU neighbour setup, bounds-checked.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn bad(&self, reason: String) -> Error {
        Error::Decode {
            what: "GPU neighbour setup",
            reason,
        }
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let b = self.b;
        let field = self
            .at
            .checked_add(n)
            .and_then(|end| b.get(self.at..end))
            .ok_or_else(|| {
                self.bad(format!(
                    "{} bytes left for {what}",
                    b.len().saturating_sub(self.at)
                ))
            })?;
        self.at += n;
        Ok(field)
    }

    /// A name: its directory tag and length, then that many bytes.
    fn name(&mut self) -> Result<ShmName> {
        let start = self.at;
        let len = self.take(2, "a name")?[1];
        self.take(len as usize, "a name")?;
        ShmName::decode(&self.b[start..self.at])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_setup_decodes_only_what_it_says_it_holds() {
        let g = SlotGrant {
            key: 7,
            len: 4096,
            remote: None,
        };
        let both = NeighbourSetup {
            recv: Some(g),
            bell: Some(g),
            endpoint: Some(b"qp".to_vec()),
        };
        assert_eq!(NeighbourSetup::decode(&both.encode()).unwrap(), both);
        let bell_only = NeighbourSetup {
            recv: None,
            bell: Some(g),
            endpoint: None,
        };
        assert_eq!(
            NeighbourSetup::decode(&bell_only.encode()).unwrap(),
            bell_only
        );
        let long = both.encode();
        for bad in [&[][..], &[4u8][..], &[1u8, 0, 0][..], &long[..10]] {
            assert!(
                matches!(NeighbourSetup::decode(bad), Err(Error::Decode { .. })),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_gpu_setup_round_trips_and_refuses_garbage() {
        use crate::memory::ShmDir;
        let name = |c: &str| ShmName::new(ShmDir::Tmpfs, c).unwrap();
        let grant = IpcGrant {
            handle: [9; 64],
            offset: 65536,
            len: 4096,
        };
        let to_next = GpuNeighbourSetup {
            shape: RingShape {
                ipc_slots: 2,
                ipc_slot_bytes: 32 << 20,
                ipc_pipeline: 1,
                shm_slots: 4,
                shm_slot_bytes: 8 << 20,
                shm_pipeline: u32::MAX,
            },
            flags: name("nodetour-12-0123456789abcdef"),
            device_flags: grant,
            slots: None,
        };
        let to_prev = GpuNeighbourSetup {
            slots: Some((grant, name("nodetour-12-fedcba9876543210"), 1 << 20)),
            ..to_next.clone()
        };
        for s in [&to_next, &to_prev] {
            assert_eq!(&GpuNeighbourSetup::decode(&s.encode()).unwrap(), s);
        }
        let full = to_prev.encode();
        let mut extra = full.clone();
        extra.push(0);
        let mut flags = full.clone();
        flags[0] = 3;
        let mut traversal = to_next.encode();
        let at = traversal.len() - 2;
        traversal[at..].copy_from_slice(b"..");
        for bad in [
            &[][..],
            &full[..full.len() - 1],
            &full[..100],
            &full[..20],
            &extra[..],
            &flags[..],
            &traversal[..],
        ] {
            assert!(
                matches!(GpuNeighbourSetup::decode(bad), Err(Error::Decode { .. })),
                "{bad:?}"
            );
        }
    }
}

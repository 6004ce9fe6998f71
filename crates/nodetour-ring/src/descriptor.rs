//! What a collective is, as every rank must agree on it before any rank writes a result from
//! it: the operation, element count, type, reduction, root, algorithm, sequence number and the
//! wire-protocol version. Pure: encoded in 32 bytes, and folded into a 15-bit tag that rides in
//! notifications the ring already sends (no added message).

use std::fmt;

use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};

/// The wire version of the ring protocols (grants, notifications, descriptors).
pub const PROTOCOL_VERSION: u8 = 6;

/// The collective operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collective {
    /// Allreduce.
    AllReduce,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-gather.
    AllGather,
    /// Broadcast.
    Broadcast,
}

/// How the collective runs (ranks that chose differently do not interoperate).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// The host-driven ring, reduced on the CPU.
    HostRing,
    /// The host-driven ring, staged through host slots and reduced on the GPU.
    HostRingGpuStaged,
    /// The stream-ordered GPU ring across processes (reduce-scatter + all-gather).
    StreamRing,
    /// The stream-ordered GPU ring's two-rank exchange step.
    StreamExchange,
    /// Small host allreduces: every rank's whole input gathered to every rank around the ring,
    /// reduced by each rank itself in ring order.
    HostGather,
    /// Small GPU allreduces of ranks on one host, one GPU each: one kernel per collective that
    /// reads every rank's input from its mapped scratch and reduces in rank order
    /// (`nodetour_core::cuda::one_kernel`).
    OneShot,
    /// The one-kernel path's two-shot kernel (reduce-scatter and all-gather in one kernel).
    TwoShot,
    /// The two-shot kernel in place on a symmetric buffer (every rank's part read directly).
    TwoShotSymmetric,
    /// The broadcast of the device job's id that forms a communicator's device side on the
    /// GPU of its first device collective's stream (never a caller's collective).
    DeviceFormation,
}

/// One collective as one rank sees it. Two descriptors are the same collective when their
/// encodings are: a `PreMulSum`'s scalar is each rank's own and is not encoded (its op
/// decodes as `PreMulSum(1)`).
#[derive(Clone, Copy, Debug)]
pub struct Descriptor {
    /// The operation.
    pub collective: Collective,
    /// Elements per rank.
    pub count: u64,
    /// Element type.
    pub dtype: DataType,
    /// Reduction (ignored by the hash for collectives that do not reduce: set `Sum`).
    pub op: ReduceOp,
    /// Root rank, for rooted collectives.
    pub root: Option<u32>,
    /// The algorithm.
    pub algorithm: Algorithm,
    /// The collective's sequence number on its ring.
    pub seq: u64,
    /// The collective's place among every collective of its communicator, host and device
    /// alike (wrapping): rings that run side by side (the host ring, the GPU ring) each see
    /// it, so ranks that interleave host and device collectives differently disagree.
    pub call: u32,
}

impl PartialEq for Descriptor {
    fn eq(&self, other: &Descriptor) -> bool {
        self.encode() == other.encode()
    }
}

impl Eq for Descriptor {}

/// Encoded size.
pub const ENCODED_LEN: usize = 32;

fn code<T: PartialEq + Copy>(all: &[T], v: T) -> u8 {
    all.iter().position(|x| *x == v).expect("listed") as u8
}

const COLLECTIVES: [Collective; 4] = [
    Collective::AllReduce,
    Collective::ReduceScatter,
    Collective::AllGather,
    Collective::Broadcast,
];
const ALGORITHMS: [Algorithm; 9] = [
    Algorithm::HostRing,
    Algorithm::HostRingGpuStaged,
    Algorithm::StreamRing,
    Algorithm::StreamExchange,
    Algorithm::HostGather,
    Algorithm::OneShot,
    Algorithm::TwoShot,
    Algorithm::TwoShotSymmetric,
    Algorithm::DeviceFormation,
];

impl Descriptor {
    /// An allreduce of `count` elements (no root).
    pub fn all_reduce(
        count: u64,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Algorithm,
        seq: u64,
    ) -> Descriptor {
        Descriptor {
            collective: Collective::AllReduce,
            count,
            dtype,
            op,
            root: None,
            algorithm,
            seq,
            call: 0,
        }
    }

    /// `version | collective | dtype | op | algorithm | has_root | 0 0 | count u64 | seq u64 |
    /// root u32 | call u32`, big-endian.
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut b = [0u8; ENCODED_LEN];
        b[0] = PROTOCOL_VERSION;
        b[1] = code(&COLLECTIVES, self.collective);
        b[2] = code(&DataType::ALL, self.dtype);
        b[3] = self.op.code();
        b[4] = code(&ALGORITHMS, self.algorithm);
        b[5] = u8::from(self.root.is_some());
        b[8..16].copy_from_slice(&self.count.to_be_bytes());
        b[16..24].copy_from_slice(&self.seq.to_be_bytes());
        b[24..28].copy_from_slice(&self.root.unwrap_or(0).to_be_bytes());
        b[28..32].copy_from_slice(&self.call.to_be_bytes());
        b
    }

    /// Decodes what a peer sent, validating every field (a newer or older protocol version is
    /// an error that says so).
    pub fn decode(b: &[u8]) -> Result<Descriptor> {
        let bad = |reason: String| Error::Protocol {
            rank: u32::MAX,
            reason: format!("a collective descriptor: {reason}"),
        };
        if b.len() != ENCODED_LEN {
            return Err(bad(format!("{} bytes", b.len())));
        }
        if b[0] != PROTOCOL_VERSION {
            return Err(bad(format!(
                "protocol version {}, this build speaks {PROTOCOL_VERSION}",
                b[0]
            )));
        }
        let pick = |i: usize, n: usize, what: &str| {
            let v = b[i] as usize;
            if v < n {
                Ok(v)
            } else {
                Err(bad(format!("{what} code {v}")))
            }
        };
        if b[6..8] != [0, 0] || b[5] > 1 {
            return Err(bad("reserved bytes are not zero".into()));
        }
        let root = u32::from_be_bytes(b[24..28].try_into().expect("4 bytes"));
        if b[5] == 0 && root != 0 {
            return Err(bad("a root without the has-root flag".into()));
        }
        Ok(Descriptor {
            collective: COLLECTIVES[pick(1, COLLECTIVES.len(), "collective")?],
            dtype: DataType::ALL[pick(2, DataType::ALL.len(), "type")?],
            op: ReduceOp::ALL[pick(3, ReduceOp::ALL.len(), "reduction")?],
            algorithm: ALGORITHMS[pick(4, ALGORITHMS.len(), "algorithm")?],
            root: (b[5] == 1).then_some(root),
            count: u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
            seq: u64::from_be_bytes(b[16..24].try_into().expect("8 bytes")),
            call: u32::from_be_bytes(b[28..32].try_into().expect("4 bytes")),
        })
    }

    /// A 32-bit digest of the descriptor without its sequence number: what the one-kernel
    /// path's ranks compare in the kernel (the sequence number travels beside it).
    pub fn digest(&self) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        for b in (Descriptor { seq: 0, ..*self }).encode() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
        h
    }

    /// A 15-bit tag of the whole descriptor (FNV-1a over the encoding, folded): carried in
    /// every grant so that a disagreement is caught before any data moves.
    pub fn tag(&self) -> u16 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.encode() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        ((h ^ (h >> 15) ^ (h >> 30) ^ (h >> 45)) & 0x7fff) as u16
    }
}

impl fmt::Display for Descriptor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} #{} of {} x {} ({}), {:?}",
            self.collective,
            self.seq,
            self.count,
            self.dtype.name(),
            self.op.name(),
            self.algorithm
        )?;
        if let Some(r) = self.root {
            write!(f, ", root {r}")?;
        }
        write!(f, ", collective {} of the communicator", self.call)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d() -> Descriptor {
        Descriptor {
            collective: Collective::AllReduce,
            count: 1 << 20,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            root: None,
            algorithm: Algorithm::HostRing,
            seq: 7,
            call: 41,
        }
    }

    #[test]
    fn round_trips_and_every_field_changes_the_tag() {
        let a = d();
        assert_eq!(Descriptor::decode(&a.encode()).unwrap(), a);
        let rooted = Descriptor {
            collective: Collective::Broadcast,
            root: Some(3),
            ..a
        };
        assert_eq!(Descriptor::decode(&rooted.encode()).unwrap(), rooted);
        for other in [
            Descriptor {
                count: 1 << 19,
                ..a
            },
            Descriptor {
                dtype: DataType::Bf16,
                ..a
            },
            Descriptor {
                op: ReduceOp::Max,
                ..a
            },
            Descriptor { seq: 8, ..a },
            Descriptor {
                algorithm: Algorithm::HostRingGpuStaged,
                ..a
            },
            Descriptor {
                collective: Collective::AllGather,
                ..a
            },
            Descriptor { root: Some(0), ..a },
            Descriptor { call: 42, ..a },
        ] {
            assert_ne!(other.tag(), a.tag(), "{other}");
            assert!(other.tag() < 1 << 15);
        }
    }

    #[test]
    fn garbage_and_other_versions_are_refused() {
        let good = d().encode();
        assert!(Descriptor::decode(&good[..31]).is_err());
        // (24, 7): a root without the has-root flag (found by the fuzzer).
        for (i, v) in [
            (24, 7u8),
            (0, 1),
            (1, 9),
            (2, 99),
            (3, 6),
            (4, 9),
            (5, 2),
            (6, 1),
        ] {
            let mut b = good;
            b[i] = v;
            assert!(Descriptor::decode(&b).is_err(), "byte {i} = {v}");
        }
    }

    #[test]
    fn the_digest_ignores_the_sequence_number_and_names_the_algorithm() {
        let d = |algorithm, seq| {
            Descriptor::all_reduce(4099, DataType::Bf16, ReduceOp::Sum, algorithm, seq)
        };
        assert_eq!(
            d(Algorithm::OneShot, 1).digest(),
            d(Algorithm::OneShot, 9).digest()
        );
        assert_ne!(
            d(Algorithm::OneShot, 1).digest(),
            d(Algorithm::TwoShot, 1).digest()
        );
        let other =
            Descriptor::all_reduce(4098, DataType::Bf16, ReduceOp::Sum, Algorithm::OneShot, 1);
        assert_ne!(other.digest(), d(Algorithm::OneShot, 1).digest());
        for a in [Algorithm::OneShot, Algorithm::TwoShot] {
            assert_eq!(Descriptor::decode(&d(a, 3).encode()).unwrap(), d(a, 3));
        }
    }
}

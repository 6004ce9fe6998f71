//! What two peers exchange out of band to connect queue pairs and write into each other's
//! memory, and its wire form.
//!
//! The decoder takes bytes from the network, so it is strict and total: every length is
//! checked before it is used, every field is validated, and any input yields a value or a typed
//! [`Error::Decode`], never a panic (a `cargo fuzz` target holds it to that, and the tests
//! replay its corpus).

use super::gid::LinkLayer;
use super::mr::RemoteRegion;
use super::port::Mtu;
use crate::error::{Error, Result};

/// Protocol version of the wire form.
pub const WIRE_VERSION: u8 = 1;
/// Most regions one endpoint description may advertise.
pub const MAX_REGIONS: usize = 16;
/// Size of the fixed part of an encoded endpoint.
const FIXED_LEN: usize = 4 + 4 + 2 + 16 + 1 + 1 + 1 + 1;
/// Size of one encoded region.
const REGION_LEN: usize = 8 + 8 + 4;
/// Largest encoded endpoint.
pub const MAX_ENCODED_LEN: usize = FIXED_LEN + MAX_REGIONS * REGION_LEN;

/// A queue pair's address: what the peer's `connect` needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number (24 bits).
    pub qpn: u32,
    /// First packet sequence number (24 bits).
    pub psn: u32,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// GID the queue pair sends from.
    pub gid: [u8; 16],
    /// Active MTU of the port.
    pub mtu: Mtu,
    /// Link layer of the port.
    pub link_layer: LinkLayer,
}

/// An endpoint plus the regions its owner lets the peer write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndpointDescription {
    /// The queue pair.
    pub endpoint: Endpoint,
    /// Writable regions.
    pub regions: Vec<RemoteRegion>,
}

impl EndpointDescription {
    /// Encodes to the wire form (big-endian).
    pub fn encode(&self) -> Result<Vec<u8>> {
        if self.regions.len() > MAX_REGIONS {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} regions; at most {MAX_REGIONS} fit one description",
                    self.regions.len()
                ),
            });
        }
        let e = &self.endpoint;
        let mut out = Vec::with_capacity(FIXED_LEN + self.regions.len() * REGION_LEN);
        out.extend_from_slice(&e.qpn.to_be_bytes());
        out.extend_from_slice(&e.psn.to_be_bytes());
        out.extend_from_slice(&e.lid.to_be_bytes());
        out.extend_from_slice(&e.gid);
        out.push(e.mtu.code() as u8);
        out.push(match e.link_layer {
            LinkLayer::InfiniBand => 1,
            LinkLayer::Ethernet => 2,
        });
        out.push(WIRE_VERSION);
        out.push(self.regions.len() as u8);
        for r in &self.regions {
            out.extend_from_slice(&r.addr.to_be_bytes());
            out.extend_from_slice(&r.len.to_be_bytes());
            out.extend_from_slice(&r.rkey.to_be_bytes());
        }
        Ok(out)
    }

    /// Decodes the wire form, validating every field.
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let bad = |reason: String| Error::Decode {
            what: "endpoint description",
            reason,
        };
        if bytes.len() < FIXED_LEN {
            return Err(bad(format!(
                "{} bytes, the fixed part alone is {FIXED_LEN}",
                bytes.len()
            )));
        }
        let mut r = Reader(bytes);
        let qpn = r.u32();
        let psn = r.u32();
        let lid = r.u16();
        let gid: [u8; 16] = r.take(16).try_into().expect("16 bytes taken");
        let mtu_code = r.u8();
        let link_code = r.u8();
        let version = r.u8();
        let count = r.u8() as usize;
        if version != WIRE_VERSION {
            return Err(bad(format!(
                "wire version {version}, this build speaks {WIRE_VERSION}"
            )));
        }
        if qpn > 0x00ff_ffff || qpn == 0 {
            return Err(bad(format!(
                "queue pair number {qpn:#x} is not a valid 24-bit QPN"
            )));
        }
        if psn > 0x00ff_ffff {
            return Err(bad(format!(
                "packet sequence number {psn:#x} exceeds 24 bits"
            )));
        }
        let mtu = Mtu::from_code(u32::from(mtu_code))
            .ok_or_else(|| bad(format!("MTU code {mtu_code}")))?;
        let link_layer = match link_code {
            1 => LinkLayer::InfiniBand,
            2 => LinkLayer::Ethernet,
            c => return Err(bad(format!("link layer code {c}"))),
        };
        if count > MAX_REGIONS {
            return Err(bad(format!("{count} regions, at most {MAX_REGIONS}")));
        }
        if r.0.len() != count * REGION_LEN {
            return Err(bad(format!(
                "{} bytes of regions for {count} region(s) of {REGION_LEN} bytes",
                r.0.len()
            )));
        }
        let mut regions = Vec::with_capacity(count);
        for i in 0..count {
            let region = RemoteRegion {
                addr: r.u64(),
                len: r.u64(),
                rkey: r.u32(),
            };
            if region.len == 0 || region.addr.checked_add(region.len).is_none() {
                return Err(bad(format!(
                    "region {i} is empty or wraps the address space"
                )));
            }
            regions.push(region);
        }
        Ok(EndpointDescription {
            endpoint: Endpoint {
                qpn,
                psn,
                lid,
                gid,
                mtu,
                link_layer,
            },
            regions,
        })
    }
}

/// A cursor whose callers have checked the length beforehand.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        head
    }
    fn u8(&mut self) -> u8 {
        self.take(1)[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.take(2).try_into().expect("2 bytes"))
    }
    fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.take(4).try_into().expect("4 bytes"))
    }
    fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.take(8).try_into().expect("8 bytes"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample() -> EndpointDescription {
        EndpointDescription {
            endpoint: Endpoint {
                qpn: 0x11,
                psn: 0xabcdef,
                lid: 0,
                gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 99, 0, 1],
                mtu: Mtu::Mtu1024,
                link_layer: LinkLayer::Ethernet,
            },
            regions: vec![RemoteRegion {
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                rkey: 0x1234,
            }],
        }
    }

    #[test]
    fn round_trip() {
        let d = sample();
        let bytes = d.encode().unwrap();
        assert_eq!(bytes.len(), FIXED_LEN + REGION_LEN);
        assert_eq!(EndpointDescription::decode(&bytes).unwrap(), d);
    }

    #[test]
    fn every_malformation_is_a_typed_error() {
        let good = sample().encode().unwrap();
        let mut cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "fixed part"),
            (good[..FIXED_LEN - 1].to_vec(), "fixed part"),
            (good[..good.len() - 1].to_vec(), "bytes of regions"),
            ([good.clone(), vec![0]].concat(), "bytes of regions"),
        ];
        let mut m = good.clone();
        m[0..4].copy_from_slice(&0x0100_0000u32.to_be_bytes());
        cases.push((m, "24-bit QPN"));
        let mut m = good.clone();
        m[0..4].copy_from_slice(&0u32.to_be_bytes());
        cases.push((m, "24-bit QPN"));
        let mut m = good.clone();
        m[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        cases.push((m, "exceeds 24 bits"));
        let mut m = good.clone();
        m[26] = 9;
        cases.push((m, "MTU code"));
        let mut m = good.clone();
        m[27] = 3;
        cases.push((m, "link layer"));
        let mut m = good.clone();
        m[28] = 2;
        cases.push((m, "wire version"));
        let mut m = good.clone();
        m[29] = 200;
        cases.push((m, "regions, at most"));
        let mut m = good.clone();
        m[FIXED_LEN + 8..FIXED_LEN + 16].copy_from_slice(&0u64.to_be_bytes());
        cases.push((m, "empty or wraps"));
        let mut m = good.clone();
        m[FIXED_LEN..FIXED_LEN + 8].copy_from_slice(&u64::MAX.to_be_bytes());
        cases.push((m, "empty or wraps"));
        for (bytes, expect) in cases {
            match EndpointDescription::decode(&bytes) {
                Err(Error::Decode { reason, .. }) => {
                    assert!(reason.contains(expect), "{reason} vs {expect}")
                }
                other => panic!("{expect}: {other:?}"),
            }
        }
    }

    #[test]
    fn too_many_regions_do_not_encode() {
        let mut d = sample();
        d.regions = vec![d.regions[0]; MAX_REGIONS + 1];
        assert!(d.encode().is_err());
    }

    proptest! {
        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = EndpointDescription::decode(&bytes);
        }

        #[test]
        fn decode_inverts_encode(qpn in 1u32..0x0100_0000, psn in 0u32..0x0100_0000, lid: u16,
                                 gid: [u8; 16], mtu in 1u32..=5, n in 0usize..=MAX_REGIONS, rkey: u32) {
            let regions = (0..n).map(|i| RemoteRegion { addr: 4096 * i as u64, len: 4096, rkey }).collect();
            let d = EndpointDescription {
                endpoint: Endpoint { qpn, psn, lid, gid, mtu: Mtu::from_code(mtu).unwrap(), link_layer: LinkLayer::Ethernet },
                regions,
            };
            prop_assert_eq!(EndpointDescription::decode(&d.encode().unwrap()).unwrap(), d);
        }
    }
}

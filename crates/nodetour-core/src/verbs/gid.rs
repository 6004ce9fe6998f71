//! Choosing the GID (the RoCE/InfiniBand source address) a queue pair sends from.
//!
//! The choice is a pure function of the port's GID table as sysfs shows it: on RoCE, a RoCE v2
//! GID that carries an IPv4-mapped address is preferred (routable, what every RoCE fabric is
//! configured for), then a global IPv6 RoCE v2 GID, then anything else non-empty.
//! `NODETOUR_IB_GID_INDEX` overrides the choice; it is validated against the table.

use crate::error::{Error, Result};

/// Kind of a GID table entry (`gid_attrs/types/N`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GidType {
    /// "IB/RoCE v1": InfiniBand, or RoCE v1 (Ethernet, not routable).
    IbRoceV1,
    /// "RoCE v2": RoCE over UDP/IP, routable.
    RoceV2,
}

impl GidType {
    /// Parses sysfs's spelling.
    pub fn from_sysfs(text: &str) -> Option<Self> {
        match text.trim() {
            "RoCE v2" => Some(GidType::RoceV2),
            "IB/RoCE v1" => Some(GidType::IbRoceV1),
            _ => None,
        }
    }
}

/// One non-empty GID table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the port's table.
    pub index: u32,
    /// The GID, network byte order.
    pub gid: [u8; 16],
    /// Its type, if sysfs says.
    pub kind: Option<GidType>,
}

impl GidEntry {
    fn is_ipv4_mapped(&self) -> bool {
        self.gid[..10].iter().all(|b| *b == 0) && self.gid[10] == 0xff && self.gid[11] == 0xff
    }

    fn is_link_local(&self) -> bool {
        self.gid[0] == 0xfe && (self.gid[1] & 0xc0) == 0x80
    }

    /// Lower is better.
    fn rank(&self) -> u8 {
        match (self.kind, self.is_ipv4_mapped(), self.is_link_local()) {
            (Some(GidType::RoceV2), true, _) => 0,
            (Some(GidType::RoceV2), false, false) => 1,
            (Some(GidType::RoceV2), false, true) => 2,
            (None, true, _) => 3,
            (Some(GidType::IbRoceV1), true, _) => 4,
            (_, _, false) => 5,
            _ => 6,
        }
    }

    /// A human-readable description ("RoCE v2 ::ffff:10.99.0.1").
    pub fn describe(&self) -> String {
        let kind = match self.kind {
            Some(GidType::RoceV2) => "RoCE v2",
            Some(GidType::IbRoceV1) => "IB/RoCE v1",
            None => "type unknown",
        };
        format!("{kind} {}", std::net::Ipv6Addr::from(self.gid))
    }
}

/// The GID a port will use, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GidChoice {
    /// Index in the GID table.
    pub index: u32,
    /// The GID.
    pub gid: [u8; 16],
    /// Why this one.
    pub reason: String,
}

/// Whether the port is InfiniBand or Ethernet (RoCE).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkLayer {
    /// Native InfiniBand: LID-routed, GID index 0.
    InfiniBand,
    /// RoCE: addressed by GID.
    Ethernet,
}

/// Chooses the GID for `device`/`port` from its table.
///
/// `table_len` is the port's `gid_tbl_len`; `override_index` is `NODETOUR_IB_GID_INDEX`.
pub fn choose_gid(
    device: &str,
    port: u8,
    link: LinkLayer,
    table: &[GidEntry],
    table_len: u32,
    override_index: Option<u32>,
) -> Result<GidChoice> {
    if let Some(index) = override_index {
        let out_of_range = |reason: &str| Error::GidIndexOutOfRange {
            device: device.to_owned(),
            port,
            index,
            table_len,
            reason: reason.to_owned(),
        };
        if index >= table_len {
            return Err(out_of_range("past the end of the table"));
        }
        let entry = table
            .iter()
            .find(|e| e.index == index)
            .ok_or_else(|| out_of_range("the entry is empty"))?;
        return Ok(GidChoice {
            index,
            gid: entry.gid,
            reason: format!("NODETOUR_IB_GID_INDEX={index} ({})", entry.describe()),
        });
    }
    if link == LinkLayer::InfiniBand {
        let gid = table
            .iter()
            .find(|e| e.index == 0)
            .map_or([0; 16], |e| e.gid);
        return Ok(GidChoice {
            index: 0,
            gid,
            reason: "InfiniBand link layer: GID 0".into(),
        });
    }
    let best = table
        .iter()
        .min_by_key(|e| (e.rank(), e.index))
        .ok_or_else(|| Error::NoUsableGid {
            device: device.to_owned(),
            port,
            reason: "the GID table is empty: give the RoCE network interface an IP address".into(),
        })?;
    let why = match best.rank() {
        0 => "preferred: RoCE v2 with an IPv4-mapped address",
        1 => "RoCE v2 with a global IPv6 address (no IPv4-mapped RoCE v2 GID)",
        2 => "only a link-local RoCE v2 GID: reaches peers on the same L2 segment only",
        _ => "no RoCE v2 GID: RoCE v1 reaches peers on the same L2 segment only",
    };
    Ok(GidChoice {
        index: best.index,
        gid: best.gid,
        reason: format!("{why} ({})", best.describe()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::sysfs::parse_gid;

    fn e(index: u32, gid: &str, kind: Option<GidType>) -> GidEntry {
        GidEntry {
            index,
            gid: parse_gid(gid).unwrap(),
            kind,
        }
    }

    const LL: &str = "fe80:0000:0000:0000:5054:00ff:fe12:3456";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:0a63:0001";
    const V6: &str = "2001:0db8:0000:0000:0000:0000:0000:0001";

    fn table() -> Vec<GidEntry> {
        vec![
            e(0, LL, Some(GidType::IbRoceV1)),
            e(1, LL, Some(GidType::RoceV2)),
            e(2, V4, Some(GidType::IbRoceV1)),
            e(3, V6, Some(GidType::RoceV2)),
            e(5, V4, Some(GidType::RoceV2)),
        ]
    }

    #[test]
    fn prefers_ipv4_mapped_roce_v2() {
        let c = choose_gid("mlx5_0", 1, LinkLayer::Ethernet, &table(), 8, None).unwrap();
        assert_eq!(c.index, 5);
        assert!(c.reason.contains("IPv4-mapped"), "{}", c.reason);
        assert!(c.reason.contains("::ffff:10.99.0.1"), "{}", c.reason);
    }

    #[test]
    fn falls_back_in_order() {
        let mut t = table();
        t.retain(|e| e.index != 5);
        assert_eq!(
            choose_gid("d", 1, LinkLayer::Ethernet, &t, 8, None)
                .unwrap()
                .index,
            3
        );
        t.retain(|e| e.index != 3);
        assert_eq!(
            choose_gid("d", 1, LinkLayer::Ethernet, &t, 8, None)
                .unwrap()
                .index,
            1
        );
        t.retain(|e| e.index != 1);
        let c = choose_gid("d", 1, LinkLayer::Ethernet, &t, 8, None).unwrap();
        assert_eq!(c.index, 2);
        assert!(c.reason.contains("RoCE v1"));
    }

    #[test]
    fn override_is_validated() {
        let t = table();
        let c = choose_gid("d", 1, LinkLayer::Ethernet, &t, 8, Some(3)).unwrap();
        assert_eq!(c.index, 3);
        assert!(c.reason.starts_with("NODETOUR_IB_GID_INDEX=3"));
        for bad in [4, 8, 200] {
            match choose_gid("d", 1, LinkLayer::Ethernet, &t, 8, Some(bad)) {
                Err(Error::GidIndexOutOfRange {
                    index,
                    table_len: 8,
                    ..
                }) => assert_eq!(index, bad),
                other => panic!("index {bad}: {other:?}"),
            }
        }
    }

    #[test]
    fn empty_table_is_a_typed_error() {
        assert!(matches!(
            choose_gid("d", 1, LinkLayer::Ethernet, &[], 16, None),
            Err(Error::NoUsableGid { .. })
        ));
    }

    #[test]
    fn infiniband_uses_index_zero() {
        let c = choose_gid("mlx5_0", 1, LinkLayer::InfiniBand, &table(), 128, None).unwrap();
        assert_eq!(c.index, 0);
    }
}

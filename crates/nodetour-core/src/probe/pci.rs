//! PCIe distance between a GPU and a NIC, classified the way `nvidia-smi topo -m` and NCCL do,
//! from canonical sysfs paths; the ACS state of the bridges in between, from config space.

use std::path::{Component, Path};

use crate::error::{Error, Result};

/// How far apart two PCI devices are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PciLevel {
    /// Behind the same PCIe switch port (at most one bridge between them).
    Pix,
    /// Behind one PCIe switch, through several bridges, without the host bridge.
    Pxb,
    /// Through the CPU's PCIe host bridge.
    Phb,
    /// Through host bridges of one NUMA node.
    Node,
    /// Across NUMA nodes (the inter-socket link).
    Sys,
}

impl PciLevel {
    /// The name as `nvidia-smi topo -m` prints it.
    pub fn name(self) -> &'static str {
        match self {
            PciLevel::Pix => "PIX",
            PciLevel::Pxb => "PXB",
            PciLevel::Phb => "PHB",
            PciLevel::Node => "NODE",
            PciLevel::Sys => "SYS",
        }
    }

    /// Parses a name (`NODETOUR_GDR_LEVEL`, topology files).
    pub fn parse(name: &str) -> Result<PciLevel> {
        Ok(match name.trim().to_ascii_uppercase().as_str() {
            "PIX" => PciLevel::Pix,
            "PXB" => PciLevel::Pxb,
            "PHB" => PciLevel::Phb,
            "NODE" => PciLevel::Node,
            "SYS" => PciLevel::Sys,
            _ => {
                return Err(Error::InvalidConfig {
                    name: "NODETOUR_GDR_LEVEL",
                    value: name.to_owned(),
                    reason: "expected PIX, PXB, PHB, NODE or SYS".into(),
                });
            }
        })
    }
}

/// The distance, or why it is unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Distance {
    /// Classified.
    Known(PciLevel),
    /// Not classifiable from sysfs, and why (a virtual machine's flattened tree, a software NIC).
    Unknown(String),
}

fn components(p: &Path) -> Vec<String> {
    p.components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect()
}

/// Classifies the path between two devices from their canonical sysfs paths
/// (`/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/...`) and NUMA nodes.
pub fn classify(a: &Path, b: &Path, numa_a: Option<i32>, numa_b: Option<i32>) -> Distance {
    let (ca, cb) = (components(a), components(b));
    let root = |c: &[String]| c.iter().position(|s| s.starts_with("pci"));
    let (Some(ra), Some(rb)) = (root(&ca), root(&cb)) else {
        return Distance::Unknown("a device has no PCI path (software device?)".into());
    };
    // Bridges above each device: the components between the root complex and the device.
    let (ba, bb) = (&ca[ra + 1..ca.len() - 1], &cb[rb + 1..cb.len() - 1]);
    if ca[ra] != cb[rb] {
        return match (numa_a, numa_b) {
            (Some(x), Some(y)) if x == y => Distance::Known(PciLevel::Node),
            (Some(_), Some(_)) => Distance::Known(PciLevel::Sys),
            _ => Distance::Known(PciLevel::Sys),
        };
    }
    if ba.is_empty() && bb.is_empty() {
        // Both hang directly off the root complex: what virtual machines show. Real servers put
        // GPUs and NICs behind root ports or switches.
        return Distance::Unknown("both devices sit directly on the root complex (a virtual machine's flattened PCI tree): the physical path is hidden".into());
    }
    let shared = ba.iter().zip(bb).take_while(|(x, y)| x == y).count();
    if shared == 0 {
        return Distance::Known(PciLevel::Phb);
    }
    // Bridges each side crosses below the deepest shared one.
    let below = (ba.len() - shared) + (bb.len() - shared);
    if below <= 2 && ba.len() == bb.len() && shared + 1 >= ba.len() {
        Distance::Known(PciLevel::Pix)
    } else {
        Distance::Known(PciLevel::Pxb)
    }
}

/// A topology file line (`NODETOUR_TOPOLOGY_FILE`): `<gpu pci bus id> <nic name> <LEVEL>`, for
/// virtual machines whose sysfs tree hides the physical path. `#` starts a comment.
pub fn parse_topology_file(text: &str) -> Result<Vec<(String, String, PciLevel)>> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 3 {
            return Err(Error::Decode {
                what: "topology file",
                reason: format!("line {}: expected `<gpu bus id> <nic> <LEVEL>`", n + 1),
            });
        }
        out.push((f[0].to_lowercase(), f[1].to_owned(), PciLevel::parse(f[2])?));
    }
    Ok(out)
}

/// ACS (Access Control Services) state of a bridge, from its config space.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcsState {
    /// No ACS capability: peer-to-peer traffic is not redirected here.
    Absent,
    /// ACS present, but P2P request/completion redirect and source validation are off.
    Disabled,
    /// ACS redirects peer-to-peer traffic up to the root complex (slower, and with an IOMMU in
    /// translation mode often broken): the bits that are on.
    Redirecting(String),
    /// Config space beyond 256 bytes is not readable (needs root).
    Unreadable,
}

/// Finds the ACS extended capability (ID 0x000D) in a config-space dump and decodes its control
/// register. `config` is the content of `/sys/bus/pci/devices/<bdf>/config`.
pub fn acs_state(config: &[u8]) -> AcsState {
    if config.len() <= 256 {
        return AcsState::Unreadable;
    }
    let mut at = 0x100usize;
    for _ in 0..64 {
        let Some(h) = config.get(at..at + 4) else {
            return AcsState::Absent;
        };
        let header = u32::from_le_bytes(h.try_into().expect("4 bytes"));
        if header == 0 || header == 0xffff_ffff {
            return AcsState::Absent;
        }
        if header & 0xffff == 0x000d {
            let Some(c) = config.get(at + 6..at + 8) else {
                return AcsState::Unreadable;
            };
            let control = u16::from_le_bytes(c.try_into().expect("2 bytes"));
            let bits = [
                (0x01, "SV"),
                (0x04, "RR"),
                (0x08, "CR"),
                (0x10, "UF"),
                (0x40, "DT"),
            ];
            let on: Vec<&str> = bits
                .iter()
                .filter(|(b, _)| control & b != 0)
                .map(|(_, n)| *n)
                .collect();
            return if control & (0x04 | 0x08) != 0 {
                AcsState::Redirecting(on.join("+"))
            } else {
                AcsState::Disabled
            };
        }
        let next = (header >> 20) as usize;
        if next < 0x100 {
            return AcsState::Absent;
        }
        at = next;
    }
    AcsState::Absent
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn p(s: &str) -> PathBuf {
        PathBuf::from(format!("/sys/devices/{s}"))
    }

    #[test]
    fn the_levels_of_a_real_server() {
        // GPU and NIC behind the same switch port pair: 00:01.0 → 01:00.0 (switch up) → 02:08.0 / 02:10.0 (down ports).
        let gpu = p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0");
        let nic_pix = p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.1");
        let nic_pix2 = p("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0");
        let nic_pxb = p(
            "pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:14.0/0000:05:00.0/0000:06:00.0/0000:07:00.0",
        );
        let nic_phb = p("pci0000:00/0000:00:03.0/0000:08:00.0");
        let nic_other_root = p("pci0000:40/0000:40:01.0/0000:41:00.0");
        assert_eq!(
            classify(&gpu, &nic_pix, Some(0), Some(0)),
            Distance::Known(PciLevel::Pix)
        );
        assert_eq!(
            classify(&gpu, &nic_pix2, Some(0), Some(0)),
            Distance::Known(PciLevel::Pix)
        );
        assert_eq!(
            classify(&gpu, &nic_pxb, Some(0), Some(0)),
            Distance::Known(PciLevel::Pxb)
        );
        assert_eq!(
            classify(&gpu, &nic_phb, Some(0), Some(0)),
            Distance::Known(PciLevel::Phb)
        );
        assert_eq!(
            classify(&gpu, &nic_other_root, Some(0), Some(0)),
            Distance::Known(PciLevel::Node)
        );
        assert_eq!(
            classify(&gpu, &nic_other_root, Some(0), Some(1)),
            Distance::Known(PciLevel::Sys)
        );
        assert!(PciLevel::Pix < PciLevel::Pxb && PciLevel::Phb < PciLevel::Sys);
    }

    #[test]
    fn flattened_and_virtual_trees_are_unknown_not_sys() {
        let gpu = p("pci0000:00/0000:00:06.0");
        let nic = p("pci0000:00/0000:00:07.0");
        assert!(
            matches!(classify(&gpu, &nic, None, None), Distance::Unknown(r) if r.contains("flattened"))
        );
        assert!(matches!(
            classify(
                &gpu,
                Path::new("/sys/devices/virtual/net/veth0"),
                None,
                None
            ),
            Distance::Unknown(_)
        ));
    }

    #[test]
    fn levels_and_topology_files_parse() {
        assert_eq!(PciLevel::parse("pxb").unwrap(), PciLevel::Pxb);
        assert!(PciLevel::parse("far").is_err());
        let t = parse_topology_file(
            "# gpu nic level\n0000:00:06.0 mlx5_0 PIX\n\n0000:00:07.0 mlx5_1 sys # far\n",
        )
        .unwrap();
        assert_eq!(
            t,
            [
                ("0000:00:06.0".into(), "mlx5_0".into(), PciLevel::Pix),
                ("0000:00:07.0".into(), "mlx5_1".into(), PciLevel::Sys)
            ]
        );
        assert!(parse_topology_file("0000:00:06.0 mlx5_0").is_err());
    }

    fn config_with_acs(control: u16) -> Vec<u8> {
        let mut c = vec![0u8; 4096];
        // 0x100: AER (id 1) → next 0x140; 0x140: ACS (id 0xd), no next.
        c[0x100..0x104].copy_from_slice(&(0x0001u32 | (1 << 16) | (0x140 << 20)).to_le_bytes());
        c[0x140..0x144].copy_from_slice(&(0x000du32 | (1 << 16)).to_le_bytes());
        c[0x146..0x148].copy_from_slice(&control.to_le_bytes());
        c
    }

    #[test]
    fn acs_is_read_from_config_space() {
        assert_eq!(acs_state(&[0u8; 64]), AcsState::Unreadable);
        assert_eq!(acs_state(&config_with_acs(0)), AcsState::Disabled);
        assert_eq!(
            acs_state(&config_with_acs(0x1d)),
            AcsState::Redirecting("SV+RR+CR+UF".into())
        );
        let mut none = vec![0u8; 4096];
        none[0x100..0x104].copy_from_slice(&0x0001_0001u32.to_le_bytes());
        assert_eq!(acs_state(&none), AcsState::Absent);
    }
}

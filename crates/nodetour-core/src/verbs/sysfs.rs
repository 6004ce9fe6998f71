//! What the kernel says about RDMA devices under `/sys/class/infiniband`.
//!
//! Every reader takes the root of the tree ([`SysfsRoot`]) so tests run them on fixture trees;
//! nothing here needs libibverbs. The readers are forgiving: an unreadable attribute is `None`,
//! because containers and VMs hide parts of sysfs and the callers decide what that means.

use std::fs;
use std::path::{Path, PathBuf};

use super::gid::{GidEntry, GidType};

/// The root under which `sys/class/infiniband` is read ("/" on a live system).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysfsRoot(PathBuf);

impl Default for SysfsRoot {
    fn default() -> Self {
        SysfsRoot(PathBuf::from("/"))
    }
}

impl SysfsRoot {
    /// A tree rooted at `root` (a fixture directory in tests).
    pub fn new(root: impl Into<PathBuf>) -> Self {
        SysfsRoot(root.into())
    }

    fn class(&self) -> PathBuf {
        self.0.join("sys/class/infiniband")
    }

    fn port_dir(&self, device: &str, port: u8) -> PathBuf {
        self.class()
            .join(device)
            .join("ports")
            .join(port.to_string())
    }

    /// Names of the RDMA devices the kernel has, sorted.
    pub fn devices(&self) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(self.class())
            .map(|dir| {
                dir.filter_map(|e| e.ok()?.file_name().into_string().ok())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// Port numbers of `device`, sorted.
    pub fn ports(&self, device: &str) -> Vec<u8> {
        let mut ports: Vec<u8> = fs::read_dir(self.class().join(device).join("ports"))
            .map(|dir| {
                dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        ports.sort();
        ports
    }

    /// Whether the port's state file says ACTIVE (`None` if unreadable).
    pub fn port_active(&self, device: &str, port: u8) -> Option<bool> {
        read_trimmed(&self.port_dir(device, port).join("state")).map(|s| s.contains("ACTIVE"))
    }

    /// The port's link layer as sysfs spells it ("Ethernet", "InfiniBand").
    pub fn link_layer(&self, device: &str, port: u8) -> Option<String> {
        read_trimmed(&self.port_dir(device, port).join("link_layer"))
    }

    /// The canonical PCI path of the device (`/sys/devices/pci0000:00/.../0000:03:00.0`), the
    /// input of PCIe distance computations. `None` for virtual devices (rxe, siw).
    pub fn pci_path(&self, device: &str) -> Option<PathBuf> {
        let path = fs::canonicalize(self.class().join(device).join("device")).ok()?;
        path.components()
            .any(|c| c.as_os_str().to_string_lossy().starts_with("pci"))
            .then_some(path)
    }

    /// The NUMA node of the device, if the kernel knows it.
    pub fn numa_node(&self, device: &str) -> Option<i32> {
        read_trimmed(&self.class().join(device).join("device/numa_node"))?
            .parse()
            .ok()
            .filter(|n: &i32| *n >= 0)
    }

    /// The non-empty entries of the port's GID table with their types, by index.
    pub fn gid_table(&self, device: &str, port: u8) -> Vec<GidEntry> {
        let dir = self.port_dir(device, port);
        let mut entries: Vec<GidEntry> = fs::read_dir(dir.join("gids"))
            .map(|d| {
                d.filter_map(|e| {
                    let e = e.ok()?;
                    let index: u32 = e.file_name().to_str()?.parse().ok()?;
                    let gid = parse_gid(&read_trimmed(&e.path())?)?;
                    if gid == [0; 16] {
                        return None;
                    }
                    let kind = read_trimmed(&dir.join("gid_attrs/types").join(index.to_string()))
                        .and_then(|t| GidType::from_sysfs(&t));
                    Some(GidEntry { index, gid, kind })
                })
                .collect()
            })
            .unwrap_or_default();
        entries.sort_by_key(|e| e.index);
        entries
    }
}

fn read_trimmed(path: &Path) -> Option<String> {
    fs::read_to_string(path).ok().map(|s| s.trim().to_owned())
}

/// Parses sysfs's GID text (`fe80:0000:0000:0000:5054:00ff:fe12:3456`).
pub fn parse_gid(text: &str) -> Option<[u8; 16]> {
    let groups: Vec<&str> = text.split(':').collect();
    if groups.len() != 8 {
        return None;
    }
    let mut gid = [0u8; 16];
    for (i, g) in groups.iter().enumerate() {
        if g.len() != 4 {
            return None;
        }
        let v = u16::from_str_radix(g, 16).ok()?;
        gid[2 * i..2 * i + 2].copy_from_slice(&v.to_be_bytes());
    }
    Some(gid)
}

#[cfg(test)]
pub(crate) mod fixture {
    //! Builds small sysfs trees for tests.
    use std::fs;
    use std::path::Path;

    /// Writes `contents` to `root/rel`, creating directories.
    pub(crate) fn write(root: &Path, rel: &str, contents: &str) {
        let p = root.join(rel);
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, contents).unwrap();
    }

    /// A RoCE device `name` with one port and the given (index, gid, type) entries.
    pub(crate) fn roce_device(root: &Path, name: &str, state: &str, gids: &[(u32, &str, &str)]) {
        let port = format!("sys/class/infiniband/{name}/ports/1");
        write(root, &format!("{port}/state"), state);
        write(root, &format!("{port}/link_layer"), "Ethernet");
        for (i, gid, kind) in gids {
            write(root, &format!("{port}/gids/{i}"), gid);
            write(root, &format!("{port}/gid_attrs/types/{i}"), kind);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_gids() {
        let g = parse_gid("0000:0000:0000:0000:0000:ffff:0a63:0001").unwrap();
        assert_eq!(&g[10..], &[0xff, 0xff, 10, 99, 0, 1]);
        assert!(parse_gid("fe80::1").is_none());
        assert!(parse_gid("zzzz:0000:0000:0000:0000:ffff:0a63:0001").is_none());
    }

    #[test]
    fn reads_a_fixture_tree() {
        let dir = tempfile::tempdir().unwrap();
        fixture::roce_device(
            dir.path(),
            "rxe0",
            "4: ACTIVE",
            &[
                (0, "fe80:0000:0000:0000:5054:00ff:fe12:3456", "IB/RoCE v1"),
                (1, "0000:0000:0000:0000:0000:ffff:0a63:0001", "RoCE v2"),
                (2, "0000:0000:0000:0000:0000:0000:0000:0000", "RoCE v2"),
            ],
        );
        fixture::roce_device(dir.path(), "mlx5_1", "1: DOWN", &[]);
        let sys = SysfsRoot::new(dir.path());
        assert_eq!(sys.devices(), ["mlx5_1", "rxe0"]);
        assert_eq!(sys.ports("rxe0"), [1]);
        assert_eq!(sys.port_active("rxe0", 1), Some(true));
        assert_eq!(sys.port_active("mlx5_1", 1), Some(false));
        assert_eq!(sys.link_layer("rxe0", 1).as_deref(), Some("Ethernet"));
        assert_eq!(sys.pci_path("rxe0"), None);
        let table = sys.gid_table("rxe0", 1);
        assert_eq!(table.len(), 2, "the all-zero entry is skipped");
        assert_eq!(table[1].kind, Some(GidType::RoceV2));
    }

    #[test]
    fn a_missing_tree_reads_as_empty() {
        let sys = SysfsRoot::new("/nonexistent-root");
        assert!(sys.devices().is_empty());
        assert!(sys.gid_table("x", 1).is_empty());
        assert_eq!(sys.port_active("x", 1), None);
    }
}

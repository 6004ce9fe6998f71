//! What the doctor reads of the operating system: kernel, IOMMU, hugepages, limits, device nodes,
//! containers, the NVIDIA driver. Every reader takes the root of the tree, so fixture trees test
//! them; unreadable things read as unknown, never as an error.

use std::path::{Path, PathBuf};

/// Hugepages of one size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HugepagePool {
    /// Page size in KiB.
    pub size_kib: u64,
    /// Pages configured.
    pub total: u64,
    /// Pages free.
    pub free: u64,
}

/// The IOMMU as the kernel configured it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IommuMode {
    /// No IOMMU active (no /sys/class/iommu entries).
    Off,
    /// Active in passthrough mode (`iommu=pt`, `iommu.passthrough=1`): peer-to-peer DMA is fine.
    Passthrough,
    /// Active, translating DMA: peer-to-peer between a NIC and a GPU needs ACS/ATS set up right
    /// and often fails or crawls.
    Translating,
}

/// The operating system facts the verdicts depend on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemFacts {
    /// `uname -r`.
    pub kernel: String,
    /// (major, minor) of the kernel.
    pub kernel_version: Option<(u32, u32)>,
    /// The IOMMU.
    pub iommu: IommuMode,
    /// IOMMU groups present.
    pub iommu_groups: usize,
    /// Hugepage pools.
    pub hugepages: Vec<HugepagePool>,
    /// `vm.max_map_count`.
    pub max_map_count: Option<u64>,
    /// `/dev/infiniband` entries and whether this process may open them read-write.
    pub infiniband_nodes: Vec<(String, bool)>,
    /// Whether this looks like a container, and the evidence.
    pub container: Option<String>,
    /// `/proc/driver/nvidia/version` first line, if the NVIDIA driver is loaded.
    pub nvidia_driver: Option<String>,
    /// Whether that driver is the open kernel module (dma-buf export needs it).
    pub nvidia_open_module: Option<bool>,
    /// The `nvidia` module's parameters that matter here (`PeerMappingOverride`), if readable.
    pub peer_mapping_override: Option<String>,
}

fn read(root: &Path, rel: &str) -> Option<String> {
    std::fs::read_to_string(root.join(rel))
        .ok()
        .map(|s| s.trim().to_owned())
}

/// Reads the facts under `root` ("/" on a live system).
pub fn read_system(root: &Path) -> SystemFacts {
    let kernel = read(root, "proc/sys/kernel/osrelease").unwrap_or_default();
    let kernel_version = {
        let mut it = kernel
            .split(|c: char| !c.is_ascii_digit())
            .filter(|s| !s.is_empty());
        match (
            it.next().and_then(|a| a.parse().ok()),
            it.next().and_then(|b| b.parse().ok()),
        ) {
            (Some(a), Some(b)) => Some((a, b)),
            _ => None,
        }
    };
    let cmdline = read(root, "proc/cmdline").unwrap_or_default();
    let iommu_units = std::fs::read_dir(root.join("sys/class/iommu"))
        .map(|d| d.count())
        .unwrap_or(0);
    let iommu_groups = std::fs::read_dir(root.join("sys/kernel/iommu_groups"))
        .map(|d| d.count())
        .unwrap_or(0);
    let passthrough = cmdline
        .split_whitespace()
        .any(|w| w == "iommu=pt" || w == "iommu.passthrough=1" || w == "amd_iommu=pt");
    let iommu = if iommu_units == 0 && iommu_groups == 0 {
        IommuMode::Off
    } else if passthrough {
        IommuMode::Passthrough
    } else {
        IommuMode::Translating
    };
    let mut hugepages: Vec<HugepagePool> = std::fs::read_dir(root.join("sys/kernel/mm/hugepages"))
        .map(|d| {
            d.filter_map(|e| {
                let e = e.ok()?;
                let name = e.file_name().into_string().ok()?;
                let size_kib = name
                    .strip_prefix("hugepages-")?
                    .strip_suffix("kB")?
                    .parse()
                    .ok()?;
                let num = |f: &str| {
                    std::fs::read_to_string(e.path().join(f))
                        .ok()?
                        .trim()
                        .parse()
                        .ok()
                };
                Some(HugepagePool {
                    size_kib,
                    total: num("nr_hugepages").unwrap_or(0),
                    free: num("free_hugepages").unwrap_or(0),
                })
            })
            .collect()
        })
        .unwrap_or_default();
    hugepages.sort_by_key(|h| h.size_kib);
    let infiniband_nodes = {
        let dir = root.join("dev/infiniband");
        let mut v: Vec<(String, bool)> = std::fs::read_dir(&dir)
            .map(|d| {
                d.filter_map(|e| {
                    let e = e.ok()?;
                    let name = e.file_name().into_string().ok()?;
                    let ok = std::fs::OpenOptions::new()
                        .read(true)
                        .write(true)
                        .open(e.path())
                        .is_ok();
                    Some((name, ok))
                })
                .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    let container = if root.join(".dockerenv").exists() {
        Some("/.dockerenv exists".to_owned())
    } else if root.join("run/.containerenv").exists() {
        Some("/run/.containerenv exists (podman)".to_owned())
    } else {
        read(root, "proc/1/cgroup")
            .filter(|c| {
                ["docker", "kubepods", "containerd", "libpod"]
                    .iter()
                    .any(|k| c.contains(k))
            })
            .map(|_| "/proc/1/cgroup names a container runtime".to_owned())
    };
    let nvidia_version = read(root, "proc/driver/nvidia/version");
    let nvidia_driver = nvidia_version
        .as_ref()
        .and_then(|v| v.lines().next().map(str::to_owned));
    let nvidia_open_module = nvidia_version
        .as_ref()
        .map(|v| v.contains("Open Kernel Module"));
    let peer_mapping_override = read(root, "proc/driver/nvidia/params").and_then(|p| {
        p.lines()
            .find(|l| l.contains("PeerMappingOverride"))
            .map(str::to_owned)
    });
    SystemFacts {
        kernel,
        kernel_version,
        iommu,
        iommu_groups,
        hugepages,
        max_map_count: read(root, "proc/sys/vm/max_map_count").and_then(|s| s.parse().ok()),
        infiniband_nodes,
        container,
        nvidia_driver,
        nvidia_open_module,
        peer_mapping_override,
    }
}

/// Size of a PCI device's BAR `index` from sysfs's `resource` file (a GPU's BAR1 bounds how much
/// of its memory peers and NICs can map at once).
pub fn pci_bar_bytes(root: &Path, bus_id: &str, index: usize) -> Option<u64> {
    let text = read(root, &format!("sys/bus/pci/devices/{bus_id}/resource"))?;
    let line = text.lines().nth(index)?;
    let f: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| u64::from_str_radix(x.trim_start_matches("0x"), 16).ok())
        .collect();
    match f.as_slice() {
        [start, end, ..] if end > start => Some(end - start + 1),
        _ => None,
    }
}

/// rdma-core's version, from the file name the `libibverbs.so.1` link resolves to
/// (`libibverbs.so.1.14.44.0` → `44.0`).
pub fn rdma_core_version(root: &Path) -> Option<String> {
    for dir in [
        "usr/lib/x86_64-linux-gnu",
        "usr/lib/aarch64-linux-gnu",
        "usr/lib64",
        "usr/lib",
        "lib/x86_64-linux-gnu",
    ] {
        let link = root.join(dir).join("libibverbs.so.1");
        if let Ok(target) = std::fs::read_link(&link) {
            let name = target.file_name()?.to_string_lossy().into_owned();
            let parts: Vec<&str> = name
                .trim_start_matches("libibverbs.so.1.")
                .split('.')
                .collect();
            if parts.len() >= 3 {
                return Some(parts[1..].join("."));
            }
        }
    }
    None
}

/// NUMA node of a PCI device by bus id, if the kernel knows it.
pub fn pci_numa_node(root: &Path, bus_id: &str) -> Option<i32> {
    read(root, &format!("sys/bus/pci/devices/{bus_id}/numa_node"))
        .and_then(|s| s.parse().ok())
        .filter(|n: &i32| *n >= 0)
}

/// The PCI bridges between the root complex and a device (canonical sysfs path), as bus ids.
pub fn bridges_above(device_path: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut p = device_path.parent();
    while let Some(dir) = p {
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.starts_with("pci") || name.is_empty() {
            break;
        }
        out.push(dir.to_owned());
        p = dir.parent();
    }
    out
}

/// The installed provider libraries of rdma-core (`/etc/libibverbs.d/*.driver` names whose
/// library exists), e.g. `mlx5`, `rxe`.
pub fn verbs_providers(root: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root.join("etc/libibverbs.d"))
        .map(|d| {
            d.filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                name.strip_suffix(".driver").map(str::to_owned)
            })
            .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// The provider a device needs, from its kernel driver name (`mlx5_0` → `mlx5`, `rxe0` → `rxe`).
pub fn provider_for(device: &str) -> String {
    device
        .trim_end_matches(|c: char| c.is_ascii_digit())
        .trim_end_matches('_')
        .to_owned()
}

#[cfg(test)]
pub(crate) mod fixture {
    use std::path::Path;

    pub(crate) fn write(root: &Path, rel: &str, contents: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, contents).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::write;
    use super::*;

    #[test]
    fn a_bare_metal_server_with_iommu_translation() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        write(r, "proc/sys/kernel/osrelease", "5.15.0-91-generic\n");
        write(
            r,
            "proc/cmdline",
            "BOOT_IMAGE=/vmlinuz root=/dev/sda1 intel_iommu=on\n",
        );
        std::fs::create_dir_all(r.join("sys/class/iommu/dmar0")).unwrap();
        std::fs::create_dir_all(r.join("sys/kernel/iommu_groups/0")).unwrap();
        write(
            r,
            "sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages",
            "512\n",
        );
        write(
            r,
            "sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages",
            "0\n",
        );
        write(r, "proc/sys/vm/max_map_count", "65530\n");
        write(
            r,
            "proc/driver/nvidia/version",
            "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.15\nGCC version: gcc 12\n",
        );
        write(r, "etc/libibverbs.d/mlx5.driver", "driver mlx5\n");
        let f = read_system(r);
        assert_eq!(f.kernel_version, Some((5, 15)));
        assert_eq!(f.iommu, IommuMode::Translating);
        assert_eq!(
            f.hugepages,
            [HugepagePool {
                size_kib: 2048,
                total: 512,
                free: 0
            }]
        );
        assert_eq!(f.max_map_count, Some(65530));
        assert_eq!(f.nvidia_open_module, Some(true));
        assert!(f.container.is_none() && f.infiniband_nodes.is_empty());
        assert_eq!(verbs_providers(r), ["mlx5"]);
    }

    #[test]
    fn passthrough_containers_and_an_empty_tree() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        write(r, "proc/cmdline", "quiet iommu=pt");
        std::fs::create_dir_all(r.join("sys/class/iommu/dmar0")).unwrap();
        write(r, ".dockerenv", "");
        let f = read_system(r);
        assert_eq!(f.iommu, IommuMode::Passthrough);
        assert!(f.container.as_deref().unwrap().contains("dockerenv"));
        let empty = read_system(Path::new("/nonexistent"));
        assert_eq!(empty.iommu, IommuMode::Off);
        assert!(empty.nvidia_driver.is_none() && empty.kernel_version.is_none());
    }

    #[test]
    fn bars_and_rdma_core_versions() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        write(
            r,
            "sys/bus/pci/devices/0000:03:00.0/resource",
            "0x00000000fb000000 0x00000000fbffffff 0x0000000000040200\n0x0000380000000000 0x0000381fffffffff 0x000000000014220c\n0x0000000000000000 0x0000000000000000 0x0000000000000000\n",
        );
        assert_eq!(pci_bar_bytes(r, "0000:03:00.0", 0), Some(16 << 20));
        assert_eq!(pci_bar_bytes(r, "0000:03:00.0", 1), Some(128 << 30));
        assert_eq!(pci_bar_bytes(r, "0000:03:00.0", 2), None);
        std::fs::create_dir_all(r.join("usr/lib/x86_64-linux-gnu")).unwrap();
        std::os::unix::fs::symlink(
            "libibverbs.so.1.14.44.0",
            r.join("usr/lib/x86_64-linux-gnu/libibverbs.so.1"),
        )
        .unwrap();
        assert_eq!(rdma_core_version(r).as_deref(), Some("44.0"));
        assert_eq!(rdma_core_version(Path::new("/nonexistent")), None);
    }

    #[test]
    fn provider_names_and_bridges() {
        assert_eq!(provider_for("mlx5_0"), "mlx5");
        assert_eq!(provider_for("rxe1"), "rxe");
        assert_eq!(provider_for("bnxt_re0"), "bnxt_re");
        let b = bridges_above(Path::new(
            "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0",
        ));
        assert_eq!(b.len(), 2);
        assert!(b[0].ends_with("0000:01:00.0"));
    }
}

pub use crate::memlock::{
    exempt_memlock_warning, has_ipc_lock, memlock_limit, status_has_ipc_lock,
    warn_exempt_memlock_once,
};

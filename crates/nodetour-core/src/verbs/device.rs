//! The RDMA devices of this machine, and which one to use.
//!
//! Listing goes through libibverbs (what the process can open); the choice among them is a pure
//! function ([`choose_device`]) of names, port states and PCIe positions from sysfs, so every
//! branch is unit-tested. The rule: `NODETOUR_IB_DEVICE` if set; for GPU memory the NIC
//! nearest to the GPU on PCIe; for host memory the first device with an ACTIVE port.

use std::path::{Path, PathBuf};

use super::result;
use super::sysfs::SysfsRoot;
use crate::error::{Error, Result};

/// One RDMA device as listed by libibverbs, with what sysfs says of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Kernel name (`mlx5_0`, `rxe0`).
    pub name: String,
    /// Node GUID (host byte order).
    pub guid: u64,
    /// Canonical PCI path, `None` for software devices.
    pub pci_path: Option<PathBuf>,
    /// NUMA node, if known.
    pub numa_node: Option<i32>,
    /// Whether some port is ACTIVE (`None`: sysfs does not say).
    pub active: Option<bool>,
}

/// Lists the RDMA devices libibverbs can open. An empty list is not an error; a missing
/// libibverbs is [`Error::Unsupported`].
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let lib = result::lib()?;
    let sys = SysfsRoot::default();
    // SAFETY: lib is loaded; the list is freed below after names and GUIDs are copied out.
    let (list, n) = match unsafe { result::get_device_list(lib) } {
        Ok(v) => v,
        // No RDMA subsystem in the kernel (no /sys/class/infiniband): no devices.
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => return Ok(Vec::new()),
        Err(e) => {
            return Err(Error::NoDevice {
                reason: format!("ibv_get_device_list failed: {e}"),
            });
        }
    };
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        // SAFETY: list has n valid entries until freed.
        let dev = unsafe { *list.add(i) };
        // SAFETY: dev is a live device of the list.
        let name = unsafe { result::device_name(lib, dev) };
        // SAFETY: as above.
        let guid = u64::from_be(unsafe { result::device_guid(lib, dev) });
        out.push(describe(&sys, name, guid));
    }
    // SAFETY: list came from get_device_list and is no longer used.
    unsafe { result::free_device_list(lib, list) };
    Ok(out)
}

fn describe(sys: &SysfsRoot, name: String, guid: u64) -> DeviceInfo {
    let ports = sys.ports(&name);
    let states: Vec<Option<bool>> = ports.iter().map(|p| sys.port_active(&name, *p)).collect();
    let active = if states.contains(&Some(true)) {
        Some(true)
    } else if !states.is_empty() && states.iter().all(|s| *s == Some(false)) {
        Some(false)
    } else {
        None
    };
    DeviceInfo {
        pci_path: sys.pci_path(&name),
        numa_node: sys.numa_node(&name),
        guid,
        active,
        name,
    }
}

/// A chosen device and why it was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceChoice {
    /// The device.
    pub device: DeviceInfo,
    /// Why (for the log line and the doctor).
    pub reason: String,
}

/// What the memory to be moved is: host memory, or a GPU at a PCI path.
#[derive(Clone, Copy, Debug)]
pub enum Near<'a> {
    /// Host memory: any device with an active port.
    Host,
    /// GPU memory of the GPU at this canonical PCI path: the nearest NIC.
    Gpu(&'a Path),
}

/// Chooses a device among `devices`.
pub fn choose_device(
    devices: &[DeviceInfo],
    requested: Option<&str>,
    near: Near<'_>,
) -> Result<DeviceChoice> {
    if let Some(name) = requested {
        return devices
            .iter()
            .find(|d| d.name == name)
            .map(|d| DeviceChoice {
                device: d.clone(),
                reason: format!("NODETOUR_IB_DEVICE={name}"),
            })
            .ok_or_else(|| Error::DeviceNotFound {
                name: name.to_owned(),
                available: list_names(devices),
            });
    }
    if devices.is_empty() {
        return Err(Error::NoDevice {
            reason: "libibverbs lists no device (no RDMA NIC, its driver is not loaded, or /dev/infiniband is not visible in this container)".into(),
        });
    }
    let usable: Vec<&DeviceInfo> = devices.iter().filter(|d| d.active != Some(false)).collect();
    if usable.is_empty() {
        return Err(Error::NoDevice {
            reason: format!(
                "devices exist ({}) but no port is ACTIVE",
                list_names(devices)
            ),
        });
    }
    match near {
        Near::Host => {
            let d = usable
                .iter()
                .find(|d| d.active == Some(true))
                .unwrap_or(&usable[0]);
            Ok(DeviceChoice {
                device: (*d).clone(),
                reason: "host memory: the first device with an ACTIVE port".into(),
            })
        }
        Near::Gpu(gpu) => {
            let best = usable
                .iter()
                .filter_map(|d| Some((pci_hops(d.pci_path.as_deref()?, gpu), *d)))
                .min_by_key(|(hops, _)| *hops);
            Ok(match best {
                Some((hops, d)) => DeviceChoice {
                    device: d.clone(),
                    reason: format!("nearest NIC to the GPU at {}: {hops} PCIe hops", gpu.display()),
                },
                None => DeviceChoice {
                    device: usable[0].clone(),
                    reason: "no NIC has a known PCIe position (virtual devices?): the first usable device, distance unknown".into(),
                },
            })
        }
    }
}

/// Number of PCIe links between two devices through their closest common bridge (canonical
/// sysfs paths). Devices under different root complexes count all their links plus one for the
/// CPU interconnect.
pub fn pci_hops(a: &Path, b: &Path) -> usize {
    let ca: Vec<_> = a.components().collect();
    let cb: Vec<_> = b.components().collect();
    let common = ca.iter().zip(&cb).take_while(|(x, y)| x == y).count();
    let root_pos = ca
        .iter()
        .position(|c| c.as_os_str().to_string_lossy().starts_with("pci"))
        .unwrap_or(0);
    let root_shared = common > root_pos;
    (ca.len() - common) + (cb.len() - common) + usize::from(!root_shared)
}

fn list_names(devices: &[DeviceInfo]) -> String {
    if devices.is_empty() {
        "none".into()
    } else {
        devices
            .iter()
            .map(|d| d.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(name: &str, pci: Option<&str>, active: Option<bool>) -> DeviceInfo {
        DeviceInfo {
            name: name.into(),
            guid: 0,
            pci_path: pci.map(PathBuf::from),
            numa_node: None,
            active,
        }
    }

    #[test]
    fn requested_device_must_exist_and_the_error_lists_the_others() {
        let devs = [
            dev("mlx5_0", None, Some(true)),
            dev("mlx5_1", None, Some(true)),
        ];
        let c = choose_device(&devs, Some("mlx5_1"), Near::Host).unwrap();
        assert_eq!(c.device.name, "mlx5_1");
        match choose_device(&devs, Some("mlx5_7"), Near::Host) {
            Err(Error::DeviceNotFound { name, available }) => {
                assert_eq!(name, "mlx5_7");
                assert_eq!(available, "mlx5_0, mlx5_1");
            }
            other => panic!("{other:?}"),
        }
        match choose_device(&[], Some("rxe0"), Near::Host) {
            Err(Error::DeviceNotFound { available, .. }) => assert_eq!(available, "none"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn no_devices_or_no_active_port_is_no_device() {
        assert!(matches!(
            choose_device(&[], None, Near::Host),
            Err(Error::NoDevice { .. })
        ));
        let down = [dev("mlx5_0", None, Some(false))];
        match choose_device(&down, None, Near::Host) {
            Err(Error::NoDevice { reason }) => assert!(reason.contains("no port is ACTIVE")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn host_memory_takes_the_first_active_device() {
        let devs = [
            dev("a", None, Some(false)),
            dev("b", None, None),
            dev("c", None, Some(true)),
        ];
        assert_eq!(
            choose_device(&devs, None, Near::Host).unwrap().device.name,
            "c"
        );
    }

    #[test]
    fn gpu_memory_takes_the_nearest_nic() {
        let gpu = Path::new(
            "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:04.0/0000:05:00.0",
        );
        let devs = [
            dev(
                "far",
                Some("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"),
                Some(true),
            ),
            dev(
                "near",
                Some("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:06:00.0"),
                Some(true),
            ),
            dev(
                "host_bridge",
                Some("/sys/devices/pci0000:00/0000:00:03.0/0000:07:00.0"),
                Some(true),
            ),
        ];
        let c = choose_device(&devs, None, Near::Gpu(gpu)).unwrap();
        assert_eq!(c.device.name, "near");
        assert!(c.reason.contains("4 PCIe hops"), "{}", c.reason);
        let virt = [dev("rxe0", None, Some(true))];
        let c = choose_device(&virt, None, Near::Gpu(gpu)).unwrap();
        assert!(c.reason.contains("distance unknown"), "{}", c.reason);
    }

    #[test]
    fn hops_across_root_complexes_cost_more() {
        let a = Path::new("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        let b = Path::new("/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0");
        let c = Path::new("/sys/devices/pci0000:00/0000:00:02.0/0000:02:00.0");
        assert!(pci_hops(a, b) > pci_hops(a, c));
        assert_eq!(pci_hops(a, a), 0);
    }
}

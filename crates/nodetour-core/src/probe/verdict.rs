//! The doctor's verdict for one GPU: does the direct path (NIC writes straight into this GPU's
//! memory) work here, and if not, why and how to fix it. A pure function of probed facts, so
//! every branch is unit-tested from fixtures and injected probe results.

use std::path::PathBuf;

use super::pci::{AcsState, Distance, PciLevel, classify};
use super::system::{IommuMode, SystemFacts, provider_for};
use crate::cuda::GdrAttributes;
use crate::gdr::registration::{PeermemState, Rung};
use crate::verbs::DmabufSupport;

pub use crate::memlock::MIN_MEMLOCK;

/// One GPU as probed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuFacts {
    /// CUDA ordinal.
    pub ordinal: usize,
    /// Product name.
    pub name: String,
    /// PCI bus id.
    pub bus_id: String,
    /// Canonical sysfs path.
    pub pci_path: Option<PathBuf>,
    /// NUMA node.
    pub numa: Option<i32>,
    /// GPUDirect attributes.
    pub gdr: GdrAttributes,
    /// Whether a dma-buf export of a test buffer worked, or why not.
    pub dmabuf_export: Result<(), String>,
    /// BAR1 size in bytes (how much GPU memory peers can map at once), if sysfs says.
    pub bar1_bytes: Option<u64>,
}

/// One RDMA device as probed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NicFacts {
    /// Device name.
    pub name: String,
    /// Canonical sysfs path (`None` for software devices).
    pub pci_path: Option<PathBuf>,
    /// NUMA node.
    pub numa: Option<i32>,
    /// Some port ACTIVE (`None`: unknown).
    pub active: Option<bool>,
    /// Link layer of its first port.
    pub link_layer: Option<String>,
    /// Whether its provider library is installed.
    pub provider_installed: bool,
    /// The dma-buf registration probe.
    pub dmabuf: DmabufSupport,
}

/// Everything the verdict depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Facts {
    /// The operating system.
    pub system: SystemFacts,
    /// `RLIMIT_MEMLOCK` soft limit in bytes (`None`: unlimited).
    pub memlock: Option<u64>,
    /// Whether the process holds `CAP_IPC_LOCK` (exempt from the memlock limit: root).
    pub ipc_lock: bool,
    /// Whether `NODETOUR_JOB_TOKEN` is set (else anyone who reaches the port can join).
    pub job_token: bool,
    /// nvidia-peermem.
    pub peermem: PeermemState,
    /// libibverbs: loaded (with or without `ibv_reg_dmabuf_mr`), or why not.
    pub verbs: Result<bool, String>,
    /// The RDMA devices (empty if none or no libibverbs).
    pub nics: Vec<NicFacts>,
    /// `NODETOUR_GDR_LEVEL` (default PXB): the farthest NIC the direct path is used for.
    pub gdr_level: PciLevel,
    /// Topology file entries (gpu bus id, nic, level) that override sysfs.
    pub topology: Vec<(String, String, PciLevel)>,
    /// ACS state of the bridges above each device (by sysfs path), where read.
    pub acs: Vec<(PathBuf, AcsState)>,
}

/// A failed (or doubtful) condition and its fix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// What is wrong.
    pub what: String,
    /// How to fix it.
    pub fix: String,
    /// Whether it rules out the direct path (else a warning).
    pub blocking: bool,
}

/// The verdict for one GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The GPU's ordinal.
    pub gpu: usize,
    /// The NIC the GPU would use.
    pub nic: Option<String>,
    /// Their PCIe distance.
    pub distance: Option<Distance>,
    /// The registration rung the direct path would use, if it is available.
    pub rung: Option<Rung>,
    /// Everything found, blocking first.
    pub problems: Vec<Problem>,
}

impl Verdict {
    /// Whether the direct path is available.
    pub fn direct(&self) -> bool {
        self.rung.is_some()
    }

    /// `direct (dma-buf) via mlx5_0, PIX` or `staged: <first blocking reason>`.
    pub fn headline(&self) -> String {
        let level = match &self.distance {
            Some(Distance::Known(l)) => l.name().to_owned(),
            Some(Distance::Unknown(_)) => "distance unknown".to_owned(),
            None => "no NIC".to_owned(),
        };
        match (self.rung, &self.nic) {
            (Some(rung), Some(nic)) => format!("direct ({rung}) via {nic}, {level}"),
            _ => {
                let why = self
                    .problems
                    .iter()
                    .find(|p| p.blocking)
                    .map_or("unknown".to_owned(), |p| p.what.clone());
                format!("staged: {why}")
            }
        }
    }
}

fn problem(
    problems: &mut Vec<Problem>,
    blocking: bool,
    what: impl Into<String>,
    fix: impl Into<String>,
) {
    problems.push(Problem {
        what: what.into(),
        fix: fix.into(),
        blocking,
    });
}

/// Host-memory RDMA (what the staged path and CPU buffers use): the NIC it would take and the
/// problems that do not depend on a GPU. For machines without GPUs, and as the first part of
/// every GPU verdict.
pub fn host_verdict(facts: &Facts) -> (Option<String>, Vec<Problem>) {
    let mut problems = Vec::new();
    let nic = host_side(facts, &mut problems)
        .first()
        .map(|n| n.name.clone());
    (nic, sorted(problems))
}

/// The limits and the NIC side: returns the usable NICs.
fn host_side<'a>(facts: &'a Facts, problems: &mut Vec<Problem>) -> Vec<&'a NicFacts> {
    let sys = &facts.system;
    let in_container = sys.container.is_some();

    if !facts.job_token {
        problem(
            problems,
            false,
            "NODETOUR_JOB_TOKEN is not set: any process that reaches the rendezvous or transport \
             ports can join the job and write into its slots",
            "export NODETOUR_JOB_TOKEN=<a secret shared by the job's ranks> (e.g. `openssl rand -hex 16`)",
        );
    }
    // Limits that break any registration (root is exempt, but warned).
    if let Some(w) =
        super::system::exempt_memlock_warning(facts.memlock, facts.ipc_lock, MIN_MEMLOCK)
    {
        problem(
            problems,
            false,
            w,
            if in_container {
                "run the container with --ulimit memlock=-1 anyway"
            } else {
                "ulimit -l unlimited anyway (or raise memlock in /etc/security/limits.conf)"
            },
        );
    } else if let Some(limit) = facts.memlock.filter(|l| *l < MIN_MEMLOCK) {
        problem(
            problems,
            true,
            format!(
                "RLIMIT_MEMLOCK is {} KiB: too small to register communication buffers",
                limit / 1024
            ),
            if in_container {
                "run the container with --ulimit memlock=-1 (Docker's default is 8 MiB)"
            } else {
                "ulimit -l unlimited (or raise memlock in /etc/security/limits.conf)"
            },
        );
    }
    if sys.max_map_count.is_some_and(|m| m < 65530) {
        problem(
            problems,
            false,
            format!(
                "vm.max_map_count is {}: many registrations can fail with ENOMEM",
                sys.max_map_count.unwrap_or(0)
            ),
            "sysctl -w vm.max_map_count=1048576",
        );
    }
    if sys
        .hugepages
        .iter()
        .find(|h| h.size_kib == 2048)
        .is_none_or(|h| h.free == 0)
    {
        problem(
            problems,
            false,
            "no free 2 MiB hugepages: staging buffers fall back to 4 KiB pages",
            "as root: echo 1024 > /proc/sys/vm/nr_hugepages",
        );
    }

    // The NIC side.
    match &facts.verbs {
        Err(why) => {
            problem(
                problems,
                true,
                format!("libibverbs is not usable: {why}"),
                "install rdma-core: libibverbs1 and ibverbs-providers",
            );
            Vec::new()
        }
        Ok(_) if facts.nics.is_empty() => {
            let fix = if in_container && sys.infiniband_nodes.is_empty() {
                "the container has no /dev/infiniband: run it with --device=/dev/infiniband (and --cap-add=IPC_LOCK)"
            } else if !sys.infiniband_nodes.is_empty()
                && sys.infiniband_nodes.iter().all(|(_, ok)| !ok)
            {
                "no permission on /dev/infiniband/*: add the user to the rdma group or run with access to the device nodes"
            } else {
                "no RDMA NIC found: install one and load its driver (mlx5_core + mlx5_ib for ConnectX)"
            };
            problem(problems, true, "no RDMA device", fix);
            Vec::new()
        }
        Ok(_) => {
            let usable: Vec<&NicFacts> = facts
                .nics
                .iter()
                .filter(|n| n.active != Some(false) && n.provider_installed)
                .collect();
            for n in facts.nics.iter().filter(|n| !n.provider_installed) {
                problem(
                    problems,
                    usable.is_empty(),
                    format!(
                        "{}: its rdma-core provider ({}) is not installed",
                        n.name,
                        provider_for(&n.name)
                    ),
                    "install ibverbs-providers",
                );
            }
            if usable.is_empty() && facts.nics.iter().all(|n| n.provider_installed) {
                problem(
                    problems,
                    true,
                    "no RDMA port is ACTIVE",
                    "check the cable and the switch; `ibv_devinfo` shows the port state",
                );
            }
            usable
        }
    }
}

/// The verdict for `gpu` given `facts`.
pub fn verdict(gpu: &GpuFacts, facts: &Facts) -> Verdict {
    let mut problems = Vec::new();
    let sys = &facts.system;
    let nic_choice = host_side(facts, &mut problems)
        .into_iter()
        .map(|n| (n, distance(gpu, n, facts)))
        .min_by_key(|(_, d)| match d {
            Distance::Known(l) => *l as u8,
            Distance::Unknown(_) => 100,
        });

    let Some((nic, dist)) = nic_choice else {
        return Verdict {
            gpu: gpu.ordinal,
            nic: None,
            distance: None,
            rung: None,
            problems: sorted(problems),
        };
    };

    // Distance and what sits between.
    match &dist {
        Distance::Known(level) if *level > facts.gdr_level => problem(
            &mut problems,
            true,
            format!(
                "{} is {} from the GPU: the direct path is used up to {} (a NIC across {} is slower than staging)",
                nic.name,
                level.name(),
                facts.gdr_level.name(),
                level.name()
            ),
            format!(
                "use a NIC under the same PCIe switch as the GPU, or NODETOUR_GDR_LEVEL={} to use it anyway",
                level.name()
            ),
        ),
        Distance::Known(_) => {}
        Distance::Unknown(why) => problem(
            &mut problems,
            false,
            format!("PCIe distance to {} is unknown: {why}", nic.name),
            "give the physical topology in NODETOUR_TOPOLOGY_FILE (`<gpu bus id> <nic> <PIX|PXB|PHB|NODE|SYS>`), and trust the live check",
        ),
    }
    for (bridge, state) in &facts.acs {
        let on_path = [gpu.pci_path.as_deref(), nic.pci_path.as_deref()]
            .iter()
            .flatten()
            .any(|p| p.starts_with(bridge));
        match state {
            AcsState::Redirecting(bits) if on_path => problem(
                &mut problems,
                true,
                format!(
                    "ACS redirects peer-to-peer traffic at bridge {} ({bits})",
                    bridge.display()
                ),
                format!(
                    "disable ACS on that bridge: setpci -s {} ECAP_ACS+0x6.w=0000 (as root, at every boot), or in the BIOS",
                    bridge
                        .file_name()
                        .map_or("<bridge>".into(), |n| n.to_string_lossy().into_owned())
                ),
            ),
            AcsState::Unreadable if on_path => problem(
                &mut problems,
                false,
                format!(
                    "ACS state of bridge {} needs root to read",
                    bridge.display()
                ),
                "run the doctor as root to check ACS",
            ),
            _ => {}
        }
    }
    if sys.iommu == IommuMode::Translating {
        problem(
            &mut problems,
            false,
            "the IOMMU translates DMA: NIC-to-GPU peer-to-peer may fail or crawl",
            "boot with iommu=pt (intel_iommu=on iommu=pt, or amd_iommu=pt)",
        );
    }

    // Registration: dma-buf, then peermem.
    let mut dmabuf_no = Vec::new();
    if !gpu.gdr.dma_buf {
        dmabuf_no.push(
            "the GPU cannot export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0)".to_owned(),
        );
    } else if let Err(e) = &gpu.dmabuf_export {
        dmabuf_no.push(format!("exporting GPU memory as dma-buf failed: {e}"));
    }
    if sys.nvidia_open_module == Some(false) {
        dmabuf_no.push("the NVIDIA driver is the proprietary kernel module (dma-buf export needs the open module)".into());
    }
    if sys.kernel_version.is_some_and(|v| v < (5, 12)) {
        dmabuf_no.push(format!(
            "Linux {} predates dma-buf registration (5.12)",
            sys.kernel
        ));
    }
    if facts.verbs == Ok(false) {
        dmabuf_no.push("rdma-core predates ibv_reg_dmabuf_mr (34)".into());
    }
    if let DmabufSupport::Unsupported(why) = &nic.dmabuf {
        dmabuf_no.push(why.clone());
    }
    let mut peermem_no = Vec::new();
    if !gpu.gdr.gpu_direct_rdma {
        peermem_no.push("the GPU reports no GPUDirect RDMA support".to_owned());
    }
    if !facts.peermem.loaded {
        peermem_no.push(format!(
            "nvidia-peermem is not loaded ({})",
            facts.peermem.evidence
        ));
    }
    let rung = if dmabuf_no.is_empty() {
        Some(Rung::DmaBuf)
    } else if peermem_no.is_empty() {
        Some(Rung::PeerMem)
    } else {
        problem(
            &mut problems,
            true,
            format!(
                "no way to register GPU memory with {}: dma-buf: {}; peermem: {}",
                nic.name,
                dmabuf_no.join(", "),
                peermem_no.join(", ")
            ),
            "either use dma-buf (NVIDIA open kernel module 515+, Linux 5.12+, rdma-core 34+, a provider with dma-buf such as mlx5) or `modprobe nvidia-peermem`",
        );
        None
    };
    let problems = sorted(problems);
    let blocked = problems.iter().any(|p| p.blocking);
    Verdict {
        gpu: gpu.ordinal,
        nic: Some(nic.name.clone()),
        distance: Some(dist),
        rung: if blocked { None } else { rung },
        problems,
    }
}

fn distance(gpu: &GpuFacts, nic: &NicFacts, facts: &Facts) -> Distance {
    if let Some((_, _, level)) = facts
        .topology
        .iter()
        .find(|(g, n, _)| *g == gpu.bus_id && *n == nic.name)
    {
        return Distance::Known(*level);
    }
    match (&gpu.pci_path, &nic.pci_path) {
        (Some(g), Some(n)) => classify(g, n, gpu.numa, nic.numa),
        (None, _) => Distance::Unknown("the GPU's PCI path is not in sysfs".into()),
        (_, None) => Distance::Unknown(format!(
            "{} is a software device without a PCI path",
            nic.name
        )),
    }
}

fn sorted(mut problems: Vec<Problem>) -> Vec<Problem> {
    problems.sort_by_key(|p| !p.blocking);
    problems
}

#[cfg(test)]
mod tests {
    use super::super::system::{HugepagePool, read_system};
    use super::*;
    use std::path::Path;

    fn gdr() -> GdrAttributes {
        GdrAttributes {
            gpu_direct_rdma: true,
            flush_writes_options: 1,
            writes_ordering: 100,
            dma_buf: true,
            host_register: true,
            gdr_with_vmm: true,
            stream_wait_value: true,
        }
    }

    fn gpu(path: &str, numa: i32) -> GpuFacts {
        GpuFacts {
            ordinal: 0,
            name: "H100".into(),
            bus_id: "0000:03:00.0".into(),
            pci_path: Some(PathBuf::from(path)),
            numa: Some(numa),
            gdr: gdr(),
            dmabuf_export: Ok(()),
            bar1_bytes: Some(128 << 30),
        }
    }

    fn nic(name: &str, path: Option<&str>, numa: i32) -> NicFacts {
        NicFacts {
            name: name.into(),
            pci_path: path.map(PathBuf::from),
            numa: Some(numa),
            active: Some(true),
            link_layer: Some("Ethernet".into()),
            provider_installed: true,
            dmabuf: DmabufSupport::Supported,
        }
    }

    fn system() -> SystemFacts {
        let mut s = read_system(Path::new("/nonexistent"));
        s.kernel = "6.5.0".into();
        s.kernel_version = Some((6, 5));
        s.hugepages = vec![HugepagePool {
            size_kib: 2048,
            total: 1024,
            free: 1024,
        }];
        s.nvidia_open_module = Some(true);
        s
    }

    fn facts(nics: Vec<NicFacts>) -> Facts {
        Facts {
            system: system(),
            memlock: None,
            ipc_lock: false,
            job_token: true,
            peermem: PeermemState {
                loaded: false,
                evidence: "fixture".into(),
            },
            verbs: Ok(true),
            nics,
            gdr_level: PciLevel::Pxb,
            topology: vec![],
            acs: vec![],
        }
    }

    const GPU: &str = "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0";
    const NIC_SAME_SWITCH: &str =
        "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:10.0/0000:04:00.0";
    const NIC_OTHER_SOCKET: &str = "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0";

    #[test]
    fn gpu_and_nic_under_one_switch_go_direct_with_dmabuf() {
        let v = verdict(
            &gpu(GPU, 0),
            &facts(vec![nic("mlx5_0", Some(NIC_SAME_SWITCH), 0)]),
        );
        assert!(v.direct(), "{v:?}");
        assert_eq!(v.headline(), "direct (dma-buf) via mlx5_0, PIX");
    }

    #[test]
    fn the_nearest_nic_wins_and_peermem_is_the_second_rung() {
        let mut f = facts(vec![
            nic("mlx5_far", Some(NIC_OTHER_SOCKET), 1),
            nic("mlx5_near", Some(NIC_SAME_SWITCH), 0),
        ]);
        f.nics[1].dmabuf = DmabufSupport::Unsupported("old provider".into());
        f.peermem.loaded = true;
        let v = verdict(&gpu(GPU, 0), &f);
        assert_eq!(v.headline(), "direct (peermem) via mlx5_near, PIX");
    }

    #[test]
    fn two_socket_server_with_the_nic_on_the_other_socket_stages() {
        let v = verdict(
            &gpu(GPU, 0),
            &facts(vec![nic("mlx5_0", Some(NIC_OTHER_SOCKET), 1)]),
        );
        assert!(!v.direct());
        assert!(
            v.headline()
                .starts_with("staged: mlx5_0 is SYS from the GPU"),
            "{}",
            v.headline()
        );
        assert!(v.problems[0].fix.contains("NODETOUR_GDR_LEVEL=SYS"));
        let mut f = facts(vec![nic("mlx5_0", Some(NIC_OTHER_SOCKET), 1)]);
        f.gdr_level = PciLevel::Sys;
        assert!(
            verdict(&gpu(GPU, 0), &f).direct(),
            "the override lifts the limit"
        );
    }

    #[test]
    fn acs_on_a_bridge_between_them_blocks_with_the_setpci_fix() {
        let mut f = facts(vec![nic("mlx5_0", Some(NIC_SAME_SWITCH), 0)]);
        f.acs = vec![(
            PathBuf::from("/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0"),
            AcsState::Redirecting("SV+RR+CR".into()),
        )];
        let v = verdict(&gpu(GPU, 0), &f);
        assert!(!v.direct());
        assert!(
            v.problems[0]
                .fix
                .contains("setpci -s 0000:02:08.0 ECAP_ACS+0x6.w=0000"),
            "{:?}",
            v.problems[0]
        );
    }

    #[test]
    fn containers_without_dev_infiniband_are_told_how() {
        let mut f = facts(vec![]);
        f.system.container = Some("/.dockerenv exists".into());
        let v = verdict(&gpu(GPU, 0), &f);
        assert_eq!(v.headline(), "staged: no RDMA device");
        assert!(v.problems[0].fix.contains("--device=/dev/infiniband"));
        f.system.infiniband_nodes = vec![("uverbs0".into(), false)];
        let v = verdict(&gpu(GPU, 0), &f);
        assert!(v.problems[0].fix.contains("permission"), "{:?}", v.problems);
    }

    #[test]
    fn a_flattened_vm_tree_is_unknown_distance_not_sys() {
        let v = verdict(
            &gpu("/sys/devices/pci0000:00/0000:00:06.0", 0),
            &facts(vec![nic(
                "mlx5_0",
                Some("/sys/devices/pci0000:00/0000:00:07.0"),
                0,
            )]),
        );
        assert!(
            v.direct(),
            "unknown distance warns, it does not block: {v:?}"
        );
        assert!(v.headline().ends_with("distance unknown"));
        assert!(
            v.problems
                .iter()
                .any(|p| !p.blocking && p.fix.contains("NODETOUR_TOPOLOGY_FILE"))
        );
        let mut f = facts(vec![nic(
            "mlx5_0",
            Some("/sys/devices/pci0000:00/0000:00:07.0"),
            0,
        )]);
        f.topology = vec![("0000:03:00.0".into(), "mlx5_0".into(), PciLevel::Sys)];
        assert!(
            !verdict(&gpu("/sys/devices/pci0000:00/0000:00:06.0", 0), &f).direct(),
            "the topology file overrides"
        );
    }

    #[test]
    fn no_nic_no_libibverbs_missing_provider_and_down_ports() {
        let v = verdict(&gpu(GPU, 0), &facts(vec![]));
        assert!(v.problems[0].fix.contains("load its driver"));
        let mut f = facts(vec![]);
        f.verbs = Err("cannot load libibverbs.so.1".into());
        assert!(
            verdict(&gpu(GPU, 0), &f).problems[0]
                .fix
                .contains("ibverbs-providers")
        );
        let mut f = facts(vec![nic("mlx5_0", Some(NIC_SAME_SWITCH), 0)]);
        f.nics[0].provider_installed = false;
        assert!(
            verdict(&gpu(GPU, 0), &f)
                .headline()
                .contains("provider (mlx5) is not installed")
        );
        let mut f = facts(vec![nic("mlx5_0", Some(NIC_SAME_SWITCH), 0)]);
        f.nics[0].active = Some(false);
        assert!(
            verdict(&gpu(GPU, 0), &f)
                .headline()
                .contains("no RDMA port is ACTIVE")
        );
    }

    #[test]
    fn soft_roce_and_no_peermem_stage_with_both_reasons() {
        let mut n = nic("rxe0", None, 0);
        n.dmabuf =
            DmabufSupport::Unsupported("rxe0 refuses dma-buf registration (EOPNOTSUPP)".into());
        let v = verdict(&gpu(GPU, 0), &facts(vec![n]));
        assert!(!v.direct());
        let text = v.headline();
        assert!(
            text.contains("rxe0 refuses dma-buf") && text.contains("nvidia-peermem is not loaded"),
            "{text}"
        );
    }

    #[test]
    fn tiny_memlock_exhausted_hugepages_and_iommu_translation() {
        let mut f = facts(vec![nic("mlx5_0", Some(NIC_SAME_SWITCH), 0)]);
        f.memlock = Some(8 << 20);
        f.system.container = Some("docker".into());
        f.system.hugepages[0].free = 0;
        f.system.iommu = IommuMode::Translating;
        let v = verdict(&gpu(GPU, 0), &f);
        assert!(!v.direct());
        assert!(v.problems[0].fix.contains("--ulimit memlock=-1"));
        assert!(
            v.problems
                .iter()
                .any(|p| !p.blocking && p.fix.contains("nr_hugepages"))
        );
        assert!(
            v.problems
                .iter()
                .any(|p| !p.blocking && p.fix.contains("iommu=pt"))
        );
    }

    #[test]
    fn root_is_warned_about_memlock_and_everyone_about_a_missing_token() {
        let mut f = facts(vec![nic_named("rxe0")]);
        f.memlock = Some(8 << 20);
        f.ipc_lock = true;
        f.job_token = false;
        let (_, problems) = host_verdict(&f);
        assert!(problems.iter().all(|p| !p.blocking), "{problems:?}");
        assert!(problems.iter().any(|p| p.what.contains("CAP_IPC_LOCK")));
        assert!(
            problems
                .iter()
                .any(|p| p.what.contains("NODETOUR_JOB_TOKEN"))
        );
        f.ipc_lock = false;
        let (_, problems) = host_verdict(&f);
        assert!(
            problems
                .iter()
                .any(|p| p.blocking && p.what.contains("RLIMIT_MEMLOCK"))
        );
    }

    #[test]
    fn without_a_gpu_the_host_verdict_still_names_the_problems() {
        let mut f = facts(vec![]);
        f.memlock = Some(64 << 10);
        let (nic, problems) = host_verdict(&f);
        assert_eq!(nic, None);
        assert!(
            problems.iter().filter(|p| p.blocking).count() == 2,
            "{problems:?}"
        );
        assert!(problems.iter().any(|p| p.fix.contains("ulimit -l")));
        let (nic, problems) = host_verdict(&facts(vec![nic_named("rxe0")]));
        assert_eq!(nic.as_deref(), Some("rxe0"));
        assert!(problems.iter().all(|p| !p.blocking));
    }

    fn nic_named(name: &str) -> NicFacts {
        nic(name, None, 0)
    }

    #[test]
    fn old_kernels_proprietary_drivers_and_failed_exports_rule_out_dmabuf() {
        let mut f = facts(vec![nic("mlx5_0", Some(NIC_SAME_SWITCH), 0)]);
        f.system.kernel_version = Some((5, 4));
        f.system.kernel = "5.4.0".into();
        f.system.nvidia_open_module = Some(false);
        let mut g = gpu(GPU, 0);
        g.dmabuf_export = Err("CUDA_ERROR_NOT_SUPPORTED".into());
        let v = verdict(&g, &f);
        let text = v.headline();
        assert!(
            text.contains("5.4.0 predates")
                && text.contains("proprietary")
                && text.contains("CUDA_ERROR_NOT_SUPPORTED"),
            "{text}"
        );
        f.peermem.loaded = true;
        assert_eq!(verdict(&g, &f).rung, Some(Rung::PeerMem));
    }
}

//! The registration ladder for GPU memory: dma-buf, then nvidia-peermem, then staging through
//! host memory, as a decision with recorded reasons.
//!
//! [`plan`] is a pure function of probed capabilities ([`Probe`]): which rungs to try, and why
//! each skipped rung was skipped. [`register_gpu`] tries the planned rungs in order, records the
//! errno or CUDA error of every rung that refuses ([`refusal_reason`] says what each means), and
//! ends on the first that works, or on staging (the buffer is handed back for the staged path).
//! The outcome says which path was taken and why; it is logged and shown by the doctor.
//!
//! Not verified on hardware here: no machine of this project has an RDMA NIC that reaches GPU
//! memory. Soft-RoCE refuses dma-buf (tested), and the GPU machines have no RDMA device
//! (tested). To check the direct path on your NICs, run `two_node_smoke --gpu` between two nodes
//! beside `ib_write_bw --use_cuda_dmabuf` (see docs/internals.md).

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::sync::Arc;

use crate::cuda::GdrAttributes;
use crate::error::Error;
use crate::gdr::read_flush::Alias;
use crate::memory::{DeviceBuffer, RdmaBuffer};
use crate::verbs::{Access, DmabufSupport, MemoryRegion, ProtectionDomain};

/// Said with every direct-path outcome until the project's own hardware has run it.
pub const NOT_VERIFIED: &str =
    "NIC-to-GPU path not verified on hardware by nodetour's CI: check it with two_node_smoke --gpu";

/// A way to make GPU memory reachable by the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rung {
    /// `ibv_reg_dmabuf_mr` on a dma-buf exported by the CUDA driver (Linux 5.12+, rdma-core 34+).
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer, translated by the nvidia-peermem kernel module.
    PeerMem,
    /// No registration of GPU memory: data goes through registered host memory and GPU copies.
    Staged,
}

impl fmt::Display for Rung {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Rung::DmaBuf => "dma-buf",
            Rung::PeerMem => "peermem",
            Rung::Staged => "staged",
        })
    }
}

pub use crate::config::GdrMode;

/// Whether the nvidia-peermem module (or its predecessor nv_peer_mem) is loaded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeermemState {
    /// Loaded.
    pub loaded: bool,
    /// What was looked at.
    pub evidence: String,
}

/// Reads peermem's presence under `root` ("/" on a live system).
pub fn peermem_state(root: &Path) -> PeermemState {
    for rel in [
        "sys/module/nvidia_peermem",
        "sys/module/nv_peer_mem",
        "sys/kernel/mm/memory_peers/nv_mem",
    ] {
        if root.join(rel).exists() {
            return PeermemState {
                loaded: true,
                evidence: format!("/{rel} exists"),
            };
        }
    }
    PeermemState {
        loaded: false,
        evidence: "neither /sys/module/nvidia_peermem, /sys/module/nv_peer_mem nor /sys/kernel/mm/memory_peers/nv_mem exists".into(),
    }
}

/// What the ladder decides on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// The GPU's GPUDirect attributes, or why there is no usable GPU.
    pub gpu: Result<GdrAttributes, String>,
    /// The RDMA device to register with, or why there is none.
    pub nic: Result<String, String>,
    /// Whether that device registers dma-bufs ([`ProtectionDomain::probe_dmabuf`]).
    pub nic_dmabuf: DmabufSupport,
    /// Whether nvidia-peermem is loaded.
    pub peermem: PeermemState,
}

impl Probe {
    /// Probes a live system: `gpu` from [`crate::cuda::gpus`], `pd` on the chosen RDMA device
    /// (or why there is none).
    pub fn gather(
        gpu: Result<GdrAttributes, String>,
        pd: Result<&ProtectionDomain, String>,
    ) -> Probe {
        let (nic, nic_dmabuf) = match pd {
            Ok(pd) => (Ok(pd.context().name().to_owned()), pd.probe_dmabuf()),
            Err(reason) => (Err(reason.clone()), DmabufSupport::Unknown(reason)),
        };
        Probe {
            gpu,
            nic,
            nic_dmabuf,
            peermem: peermem_state(Path::new("/")),
        }
    }
}

/// A rung that was not used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The rung.
    pub rung: Rung,
    /// Why: the probe that ruled it out, or the error of the attempt, with the fix.
    pub reason: String,
}

/// Which rungs to try, in order, and why the others are out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Rungs to attempt, best first (never `Staged`: staging is what remains).
    pub attempts: Vec<Rung>,
    /// Rungs ruled out by the probe.
    pub refused: Vec<Refusal>,
}

/// Decides the ladder from the probe. Pure.
pub fn plan(probe: &Probe, mode: GdrMode) -> Plan {
    let mut attempts = Vec::new();
    let mut refused = Vec::new();
    let mut refuse = |rung, reason: String| refused.push(Refusal { rung, reason });
    let common = if mode == GdrMode::Off {
        Some("NODETOUR_GDR=off".to_owned())
    } else if let Err(why) = &probe.gpu {
        Some(format!("no usable GPU: {why}"))
    } else if let Err(why) = &probe.nic {
        Some(format!("no RDMA device: {why}"))
    } else {
        None
    };
    if let Some(reason) = common {
        refuse(Rung::DmaBuf, reason.clone());
        refuse(Rung::PeerMem, reason);
        return Plan { attempts, refused };
    }
    let gpu = probe.gpu.as_ref().expect("checked above");
    let nic = probe.nic.as_ref().expect("checked above");
    // dma-buf: the GPU must export, and the NIC's provider and kernel must import.
    if !gpu.dma_buf {
        refuse(
            Rung::DmaBuf,
            "the GPU driver cannot export dma-buf (CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED=0: needs the NVIDIA open kernel module, driver 515+, and Linux 5.12+)".into(),
        );
    } else {
        match &probe.nic_dmabuf {
            DmabufSupport::Supported | DmabufSupport::Unknown(_) => attempts.push(Rung::DmaBuf),
            DmabufSupport::Unsupported(why) => refuse(Rung::DmaBuf, why.clone()),
        }
    }
    // peermem: the kernel module must be loaded and the GPU must allow GPUDirect RDMA.
    if !gpu.gpu_direct_rdma {
        refuse(Rung::PeerMem, "the GPU reports no GPUDirect RDMA support (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED=0)".into());
    } else if !probe.peermem.loaded {
        refuse(
            Rung::PeerMem,
            format!(
                "nvidia-peermem is not loaded ({}): `modprobe nvidia-peermem` to enable it for {nic}",
                probe.peermem.evidence
            ),
        );
    } else {
        attempts.push(Rung::PeerMem);
    }
    Plan { attempts, refused }
}

/// What an error from trying `rung` means, with the fix. Pure.
pub fn refusal_reason(rung: Rung, e: &Error) -> String {
    let meaning = match (rung, e.errno(), e) {
        (_, _, Error::Cuda { code, .. }) if code == "CUDA_ERROR_NOT_SUPPORTED" => {
            "the GPU side refused (CUDA_ERROR_NOT_SUPPORTED): this GPU, driver or kernel cannot export the range".to_owned()
        }
        (_, Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT), _) => {
            "the RDMA provider or kernel driver has no dma-buf support (EOPNOTSUPP/EPROTONOSUPPORT)".to_owned()
        }
        (Rung::PeerMem, Some(libc::EFAULT), _) => {
            "the kernel could not pin the GPU address (EFAULT): nvidia-peermem is missing or not working".to_owned()
        }
        (_, Some(libc::ENOMEM), _) => {
            "out of pinnable memory (ENOMEM): RLIMIT_MEMLOCK (`ulimit -l unlimited`, Docker --ulimit memlock=-1), vm.max_map_count, or the GPU's BAR1 is exhausted".to_owned()
        }
        (_, Some(libc::EPERM) | Some(libc::EACCES), _) => {
            "not permitted (EPERM/EACCES): raise RLIMIT_MEMLOCK or grant CAP_IPC_LOCK".to_owned()
        }
        _ => String::new(),
    };
    if meaning.is_empty() {
        e.to_string()
    } else {
        format!("{meaning} [{e}]")
    }
}

/// Buffers the ladder can register: GPU memory, or a test double.
pub trait LadderBuffer: RdmaBuffer + Sized {
    /// Registers through dma-buf, giving the buffer back on failure.
    fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        buffer: Self,
        access: Access,
    ) -> Result<MemoryRegion<Self>, (Error, Self)>;

    /// Registers the memory of a dma-buf registration a second time, in `pd` (the flush by
    /// read's own domain, [`crate::gdr::read_flush`]). Buffers without a dma-buf of their
    /// own cannot.
    #[allow(clippy::type_complexity)]
    fn register_dmabuf_again(
        pd: &Arc<ProtectionDomain>,
        alias: Alias<Self>,
        access: Access,
    ) -> Result<MemoryRegion<Alias<Self>>, (Error, Alias<Self>)> {
        let _ = (pd, access);
        Err((
            Error::Unsupported {
                what: "a second dma-buf registration",
                reason: format!("{} memory exports no dma-buf", alias.kind()),
            },
            alias,
        ))
    }
}

impl LadderBuffer for DeviceBuffer {
    fn register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        buffer: Self,
        access: Access,
    ) -> Result<MemoryRegion<Self>, (Error, Self)> {
        MemoryRegion::try_register_dmabuf(pd, buffer, access)
    }

    fn register_dmabuf_again(
        pd: &Arc<ProtectionDomain>,
        alias: Alias<Self>,
        access: Access,
    ) -> Result<MemoryRegion<Alias<Self>>, (Error, Alias<Self>)> {
        let export = match alias.first().device_buffer().export_dmabuf() {
            Ok(x) => x,
            Err(e) => return Err((e, alias)),
        };
        MemoryRegion::try_register_dmabuf_fd(pd, alias, export.fd.as_fd(), export.offset, access)
    }
}

/// Where GPU memory ended up.
pub enum Registration<B: RdmaBuffer> {
    /// The NIC reaches the memory directly.
    Direct {
        /// How.
        rung: Rung,
        /// The registered region.
        region: MemoryRegion<B>,
        /// The rungs tried or ruled out before it.
        refused: Vec<Refusal>,
    },
    /// Not registered: use the staged path; the buffer is handed back.
    Staged {
        /// The buffer.
        buffer: B,
        /// Why every direct rung was refused.
        refused: Vec<Refusal>,
    },
}

impl<B: RdmaBuffer> Registration<B> {
    /// The rung taken.
    pub fn rung(&self) -> Rung {
        match self {
            Registration::Direct { rung, .. } => *rung,
            Registration::Staged { .. } => Rung::Staged,
        }
    }

    /// Why the better rungs were not taken.
    pub fn refused(&self) -> &[Refusal] {
        match self {
            Registration::Direct { refused, .. } | Registration::Staged { refused, .. } => refused,
        }
    }

    /// One line: `direct (dma-buf)` or `staged`, then each refused rung with its reason.
    pub fn describe(&self) -> String {
        let head = match self {
            Registration::Direct { rung, .. } => {
                format!("direct ({rung}; {NOT_VERIFIED})")
            }
            Registration::Staged { .. } => "staged".to_owned(),
        };
        let reasons: Vec<String> = self
            .refused()
            .iter()
            .map(|r| format!("{}: {}", r.rung, r.reason))
            .collect();
        if reasons.is_empty() {
            head
        } else {
            format!("{head}; {}", reasons.join("; "))
        }
    }
}

/// Runs the ladder for `buffer`: tries the planned rungs in order and records every refusal.
/// In [`GdrMode::Force`], ending on staging is an [`Error::Unsupported`] carrying every reason.
pub fn register_gpu<B: LadderBuffer>(
    pd: &Arc<ProtectionDomain>,
    buffer: B,
    probe: &Probe,
    mode: GdrMode,
    access: Access,
) -> Result<Registration<B>, Error> {
    let Plan {
        attempts,
        mut refused,
    } = plan(probe, mode);
    let mut buffer = buffer;
    for rung in attempts {
        let attempt = match rung {
            Rung::DmaBuf => B::register_dmabuf(pd, buffer, access),
            Rung::PeerMem => MemoryRegion::try_register(pd, buffer, access),
            Rung::Staged => unreachable!("staging is never planned as an attempt"),
        };
        match attempt {
            Ok(region) => {
                tracing::info!(path = %rung, device = %pd.context().name(), "GPU memory registered for the direct path");
                return Ok(Registration::Direct {
                    rung,
                    region,
                    refused,
                });
            }
            Err((e, back)) => {
                refused.push(Refusal {
                    rung,
                    reason: refusal_reason(rung, &e),
                });
                buffer = back;
            }
        }
    }
    let outcome = Registration::Staged { buffer, refused };
    if mode == GdrMode::Force {
        return Err(Error::Unsupported {
            what: "the direct GPU path (NODETOUR_GDR=force)",
            reason: outcome.describe(),
        });
    }
    tracing::info!(path = %outcome.describe(), "GPU memory takes the staged path");
    Ok(outcome)
}

/// Registers a buffer through a caller-supplied dma-buf descriptor (for buffers that export
/// their own dma-bufs).
pub fn register_with_dmabuf_fd<B: RdmaBuffer>(
    pd: &Arc<ProtectionDomain>,
    buffer: B,
    fd: BorrowedFd<'_>,
    offset: u64,
    access: Access,
) -> Result<MemoryRegion<B>, (Error, B)> {
    MemoryRegion::try_register_dmabuf_fd(pd, buffer, fd, offset, access)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gdr(dma_buf: bool, rdma: bool) -> GdrAttributes {
        GdrAttributes {
            gpu_direct_rdma: rdma,
            flush_writes_options: 1,
            writes_ordering: 100,
            dma_buf,
            host_register: true,
            gdr_with_vmm: true,
            stream_wait_value: true,
        }
    }

    fn probe(dma_buf: bool, nic: DmabufSupport, peermem: bool) -> Probe {
        Probe {
            gpu: Ok(gdr(dma_buf, true)),
            nic: Ok("mlx5_0".into()),
            nic_dmabuf: nic,
            peermem: PeermemState {
                loaded: peermem,
                evidence: "fixture".into(),
            },
        }
    }

    #[test]
    fn everything_available_tries_dmabuf_then_peermem() {
        let p = plan(&probe(true, DmabufSupport::Supported, true), GdrMode::Auto);
        assert_eq!(p.attempts, [Rung::DmaBuf, Rung::PeerMem]);
        assert!(p.refused.is_empty());
    }

    #[test]
    fn provider_without_dmabuf_leaves_peermem() {
        let p = plan(
            &probe(
                true,
                DmabufSupport::Unsupported("rxe0 refuses (EOPNOTSUPP)".into()),
                true,
            ),
            GdrMode::Auto,
        );
        assert_eq!(p.attempts, [Rung::PeerMem]);
        assert_eq!(
            p.refused,
            [Refusal {
                rung: Rung::DmaBuf,
                reason: "rxe0 refuses (EOPNOTSUPP)".into()
            }]
        );
    }

    #[test]
    fn gpu_without_dmabuf_export_is_named() {
        let p = plan(&probe(false, DmabufSupport::Supported, true), GdrMode::Auto);
        assert_eq!(p.attempts, [Rung::PeerMem]);
        assert!(p.refused[0].reason.contains("DMA_BUF_SUPPORTED=0"));
    }

    #[test]
    fn no_peermem_module_says_how_to_load_it() {
        let p = plan(
            &probe(false, DmabufSupport::Supported, false),
            GdrMode::Auto,
        );
        assert!(p.attempts.is_empty());
        let peer = p.refused.iter().find(|r| r.rung == Rung::PeerMem).unwrap();
        assert!(
            peer.reason.contains("modprobe nvidia-peermem"),
            "{}",
            peer.reason
        );
    }

    #[test]
    fn gpu_without_gdr_support_rules_out_peermem() {
        let mut pr = probe(true, DmabufSupport::Supported, true);
        pr.gpu = Ok(gdr(true, false));
        let p = plan(&pr, GdrMode::Auto);
        assert_eq!(p.attempts, [Rung::DmaBuf]);
        assert!(p.refused[0].reason.contains("GPU_DIRECT_RDMA_SUPPORTED=0"));
    }

    #[test]
    fn unknown_dmabuf_probe_still_tries() {
        let p = plan(
            &probe(true, DmabufSupport::Unknown("odd answer".into()), false),
            GdrMode::Auto,
        );
        assert_eq!(p.attempts, [Rung::DmaBuf]);
    }

    #[test]
    fn off_no_gpu_and_no_nic_rule_out_both_rungs_with_the_same_reason() {
        let mut pr = probe(true, DmabufSupport::Supported, true);
        let p = plan(&pr, GdrMode::Off);
        assert!(p.attempts.is_empty() && p.refused.iter().all(|r| r.reason == "NODETOUR_GDR=off"));
        pr.gpu = Err("libcuda.so is not loadable".into());
        let p = plan(&pr, GdrMode::Auto);
        assert!(
            p.refused
                .iter()
                .all(|r| r.reason.starts_with("no usable GPU: libcuda"))
        );
        pr.gpu = Ok(gdr(true, true));
        pr.nic = Err("libibverbs lists no device".into());
        let p = plan(&pr, GdrMode::Force);
        assert_eq!(p.refused.len(), 2);
        assert!(
            p.refused
                .iter()
                .all(|r| r.reason == "no RDMA device: libibverbs lists no device")
        );
    }

    fn errno(e: i32) -> Error {
        Error::RegisterMemory {
            kind: "gpu",
            len: 1,
            source: std::io::Error::from_raw_os_error(e),
            hint: "",
        }
    }

    #[test]
    fn every_refusal_errno_is_explained() {
        assert!(
            refusal_reason(Rung::DmaBuf, &errno(libc::EOPNOTSUPP)).contains("no dma-buf support")
        );
        assert!(
            refusal_reason(Rung::DmaBuf, &errno(libc::EPROTONOSUPPORT))
                .contains("no dma-buf support")
        );
        assert!(refusal_reason(Rung::PeerMem, &errno(libc::EFAULT)).contains("nvidia-peermem"));
        assert!(refusal_reason(Rung::PeerMem, &errno(libc::ENOMEM)).contains("BAR1"));
        assert!(refusal_reason(Rung::DmaBuf, &errno(libc::ENOMEM)).contains("memlock"));
        assert!(refusal_reason(Rung::PeerMem, &errno(libc::EPERM)).contains("CAP_IPC_LOCK"));
        let cuda = Error::Cuda {
            op: "cuMemGetHandleForAddressRange",
            code: "CUDA_ERROR_NOT_SUPPORTED".into(),
            hint: "",
        };
        assert!(refusal_reason(Rung::DmaBuf, &cuda).contains("GPU side refused"));
        assert!(refusal_reason(Rung::DmaBuf, &errno(libc::EIO)).contains("registering 1 bytes"));
    }

    #[test]
    fn peermem_is_read_from_sysfs() {
        let dir = tempfile::tempdir().unwrap();
        assert!(!peermem_state(dir.path()).loaded);
        std::fs::create_dir_all(dir.path().join("sys/module/nvidia_peermem")).unwrap();
        let s = peermem_state(dir.path());
        assert!(s.loaded && s.evidence.contains("nvidia_peermem"));
    }

    #[test]
    fn gdr_mode_parses() {
        for (word, mode) in [
            ("auto", GdrMode::Auto),
            ("force", GdrMode::Force),
            ("off", GdrMode::Off),
        ] {
            assert_eq!(GdrMode::parse(word), mode);
        }
    }
}

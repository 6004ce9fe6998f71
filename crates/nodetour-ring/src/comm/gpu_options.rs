//! The GPU ring's options: which paths it builds (`NODETOUR_TRANSPORT`, [`GpuPaths`]), where
//! network links land ([`NetLanding`]), the one-kernel path ([`OneKernelMode`]), slot shapes,
//! pipelines and thresholds, with their measured defaults; and the shape check both ends of a
//! link make. Formation ([`super::form`]) reads them.

use nodetour_core::transport::TransportKind;
use nodetour_core::transport::setup::{GpuNeighbourSetup, RingShape};

use crate::error::{Error, Result};
use crate::gpu_ring::{IPC_SLOT_BYTES, IPC_SLOTS, SHM_SLOT_BYTES, SLOT_MEMORY_MAX, SLOTS};

/// Which paths a GPU ring builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuPaths {
    /// Direct where the next GPU's memory can be mapped, else staged (the default).
    Auto,
    /// Direct only (an error where cuda-ipc cannot map the peer's memory).
    Direct,
    /// Staged only.
    Staged,
}

/// Where a network link lands the previous rank's chunks (a ring across hosts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetLanding {
    /// The direct path where the registration ladder allows it (a verbs link: RDMA writes into
    /// GPU slots, from GPU send slots), else host slots (the default).
    Auto,
    /// Host slots; the receive stream copies each chunk in (the staged path).
    Host,
    /// GPU slots the receive stream reduces from directly: over verbs the NIC writes them where
    /// the ladder allows; else (tcp, or the ladder refused) the progress thread lands each chunk
    /// in a host bounce slot and copies it in on a stream of its own.
    Gpu,
}

impl NetLanding {
    /// Parses `NODETOUR_NET_LANDING` (`auto`, `host` or `gpu`).
    pub fn parse(v: &str) -> Option<NetLanding> {
        match v.trim() {
            "" | "auto" => Some(NetLanding::Auto),
            "host" => Some(NetLanding::Host),
            "gpu" => Some(NetLanding::Gpu),
            _ => None,
        }
    }
}

/// Whether small allreduces run as one kernel per collective (`nodetour_core::cuda::one_kernel`:
/// every rank reads every rank's mapped scratch) where every rank of the host has a GPU of its
/// own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OneKernelMode {
    /// Where every rank has its own GPU and every peer's memory can be mapped (the default).
    Auto,
    /// Never: every collective runs on the stream-ordered ring.
    Off,
    /// Always (an error where the peers' memory cannot be mapped), even between ranks that
    /// share a GPU: for tests only. Ranks sharing a GPU are time-sliced, so each wait lasts
    /// until the driver switches contexts (milliseconds, not microseconds).
    Force,
}

impl OneKernelMode {
    /// Parses `NODETOUR_ONE_KERNEL` (`auto`, `off` or `force`).
    pub fn parse(v: &str) -> Option<OneKernelMode> {
        match v.trim() {
            "" | "auto" => Some(OneKernelMode::Auto),
            "off" => Some(OneKernelMode::Off),
            "force" => Some(OneKernelMode::Force),
            _ => None,
        }
    }

    pub(crate) fn code(self) -> u8 {
        match self {
            OneKernelMode::Auto => 0,
            OneKernelMode::Off => 1,
            OneKernelMode::Force => 2,
        }
    }
}

/// Default for [`GpuRingOptions::one_kernel_max`]: allreduces of at most this many bytes run
/// as one kernel.
pub const ONE_KERNEL_MAX: usize = 1 << 20;

/// Slot shapes and paths of a GPU ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GpuRingOptions {
    /// Slots per link on the staged path.
    pub slots: u32,
    /// Bytes per slot on the direct path.
    pub ipc_slot_bytes: usize,
    /// Bytes per slot on the staged path.
    pub shm_slot_bytes: usize,
    /// Slots per link on the direct path.
    pub ipc_slots: u32,
    /// Direct path: flags in GPU memory (polled locally, set over NVLink/PCIe) rather than in
    /// shared host memory.
    pub device_flags: bool,
    /// Which paths to build (`NODETOUR_TRANSPORT=cuda-ipc|shm` overrides it).
    pub paths: GpuPaths,
    /// Where network links land (`NODETOUR_NET_LANDING`).
    pub net_landing: NetLanding,
    /// Small allreduces as one kernel (`NODETOUR_ONE_KERNEL`).
    pub one_kernel: OneKernelMode,
    /// The largest allreduce, in bytes, that runs as one kernel (`NODETOUR_ONE_KERNEL_MAX`;
    /// also the size of each of the two halves of every rank's scratch). Every rank must use
    /// the same value (checked at formation).
    pub one_kernel_max: usize,
    /// The most blocks one reduce, copy or send kernel of the stream-ordered ring launches
    /// (`NODETOUR_RING_BLOCKS`; 0: `4 × SMs`, the default): a cap leaves SMs to compute that
    /// runs beside large collectives (measure with `nodetour perf --gpu --beside-compute`).
    /// A rank's own choice: ranks need not agree.
    pub max_blocks: u32,
    /// Direct path: cut each collective's segment into at least this many chunks where the
    /// slots allow (none smaller than [`crate::plan::PIPELINE_MIN_CHUNK`]), so that a chunk's
    /// transfer overlaps the previous chunk's reduce (`NODETOUR_IPC_PIPELINE`, 1 to 64;
    /// 1: chunks of a whole slot). Every rank must use the same value (checked at formation).
    pub ipc_pipeline: u32,
    /// Staged path: the same (`NODETOUR_SHM_PIPELINE`): a chunk's copy out of one GPU then
    /// overlaps the previous chunk's copy into the next.
    pub shm_pipeline: u32,
    /// Staged path: chunks of at most this many bytes are reduced straight out of the host
    /// slot by the reduce kernel (its loads cross PCIe), larger ones copied into GPU scratch
    /// by the copy engine first (`NODETOUR_SHM_READ_MAX`; 0: always the copy engine). A rank's
    /// own choice: ranks need not agree.
    pub shm_read_max: usize,
    /// Direct path: received chunks that are only copied (the all-gather's steps) of at most
    /// this many bytes are copied out of the slot by one kernel that then credits the slot,
    /// larger ones by the copy engine and a credit kernel (`NODETOUR_SLOT_COPY_KERNEL_MAX`; 0:
    /// always the copy engine). A rank's own choice: ranks need not agree.
    pub copy_kernel_max: usize,
}

/// Default for [`GpuRingOptions::shm_read_max`]. On one H200 with two processes under MPS
/// (bf16 sum, the exchange of two ranks: one chunk per collective up to a slot), reading the
/// host slot in the reduce kernel ran 1.19× faster than copying it in first at 64 KiB, 1.10× at
/// 256 KiB, the same at 1-4 MiB, and 0.88-0.94× at 16-256 MiB (chunks of 8 MiB: the copy
/// engine reads PCIe faster than the SMs) (`docs/measurements/2026-12-03-pipelines-wide-loads/`).
pub(crate) const SHM_READ_MAX: usize = 1 << 20;

/// Default for [`GpuRingOptions::copy_kernel_max`]. On one H200 with two processes under MPS
/// (bf16 sum, two ranks: the all-gather step copies half the buffer), copying out of the GPU
/// slot by the copy engine and a credit kernel ran 0.88× of the one kernel at 64 KiB, 0.91× at
/// 256 KiB, 0.87× at 1 MiB; the kernel up to 16 MiB ran 0.98-1.02× of this default from 1 to
/// 256 MiB (3 rounds, interleaved). The staged path's host slots always take the copy engine:
/// the same kernel reading a host slot over PCIe ran 0.89× of it at 64 KiB and 0.92× at 1 MiB
/// (`docs/measurements/2026-12-03-copy-kernel/`). Reducing out of a host slot is another
/// matter ([`SHM_READ_MAX`]): there one kernel replaces three operations.
pub(crate) const COPY_KERNEL_MAX: usize = 1 << 20;

/// Default for [`GpuRingOptions::ipc_pipeline`]: whole slots. Each chunk pays a hand-off of
/// several µs that more, smaller chunks do not hide: on two H200s (host flags) 16 × 4 MiB
/// slots ran 0.64× and 2 × 32 MiB 1.05× of NCCL at 1 GiB; on one H200 with two processes
/// under MPS (a substitute: HBM for NVLink), depth 2 ran 0.79-0.83× of whole slots at 1-16 MiB
/// and depth 4 0.48-0.54× (`docs/measurements/2026-12-03-pipelines-wide-loads/`).
pub(crate) const IPC_PIPELINE: u32 = 1;
/// Default for [`GpuRingOptions::shm_pipeline`]: whole slots. On one H200 under MPS (both
/// ranks share one PCIe link, so a chunk's copy out cannot overlap the peer's copy in as it
/// would on two GPUs) depth 4 ran 0.59× of whole slots at 1 MiB and 0.90× at 4 MiB, and no
/// depth won at any size; the run on two GPUs decides (`onehost-reference.sh OUT pipeline`).
pub(crate) const SHM_PIPELINE: u32 = 1;

impl Default for GpuRingOptions {
    fn default() -> Self {
        GpuRingOptions {
            slots: SLOTS,
            ipc_slot_bytes: IPC_SLOT_BYTES,
            shm_slot_bytes: SHM_SLOT_BYTES,
            ipc_slots: IPC_SLOTS,
            device_flags: true,
            paths: GpuPaths::Auto,
            net_landing: NetLanding::Auto,
            one_kernel: OneKernelMode::Auto,
            one_kernel_max: ONE_KERNEL_MAX,
            max_blocks: 0,
            ipc_pipeline: IPC_PIPELINE,
            shm_pipeline: SHM_PIPELINE,
            shm_read_max: SHM_READ_MAX,
            copy_kernel_max: COPY_KERNEL_MAX,
        }
    }
}

/// The most chunks a pipeline cuts a segment into.
pub(crate) const PIPELINE_MAX: u32 = 64;

impl GpuRingOptions {
    /// How this rank cuts its links: what its neighbours must match.
    pub(crate) fn shape(&self) -> RingShape {
        RingShape {
            ipc_slots: self.ipc_slots,
            ipc_slot_bytes: self.ipc_slot_bytes as u64,
            ipc_pipeline: self.ipc_pipeline,
            shm_slots: self.slots,
            shm_slot_bytes: self.shm_slot_bytes as u64,
            shm_pipeline: self.shm_pipeline,
        }
    }

    /// The in-host paths to build: `NODETOUR_TRANSPORT=shm|cuda-ipc` (`forced`) overrides
    /// [`Self::paths`].
    pub(crate) fn paths_under(&self, forced: Option<TransportKind>) -> GpuPaths {
        match forced {
            Some(TransportKind::Shm) => GpuPaths::Staged,
            Some(TransportKind::CudaIpc) => GpuPaths::Direct,
            _ => self.paths,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.one_kernel_max == 0 || self.one_kernel_max > SLOT_MEMORY_MAX / 2 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "one-kernel collectives of up to {} bytes: between 1 and {} (two halves of \
                     scratch are bounded by the slot memory bound)",
                    self.one_kernel_max,
                    SLOT_MEMORY_MAX / 2
                ),
            });
        }
        for (what, depth) in [("ipc", self.ipc_pipeline), ("shm", self.shm_pipeline)] {
            if !(1..=PIPELINE_MAX).contains(&depth) {
                return Err(Error::InvalidArgument {
                    reason: format!(
                        "a {what} pipeline of {depth} chunks: between 1 and {PIPELINE_MAX}"
                    ),
                });
            }
        }
        for (what, slots, bytes) in [
            ("cuda-ipc", self.ipc_slots, self.ipc_slot_bytes),
            ("shm", self.slots, self.shm_slot_bytes),
        ] {
            let total = bytes.saturating_mul(slots as usize);
            if total > SLOT_MEMORY_MAX || slots == 0 || bytes == 0 {
                return Err(Error::InvalidArgument {
                    reason: format!(
                        "{what}: {slots} slots of {bytes} bytes: slot memory is bounded by {} MiB",
                        SLOT_MEMORY_MAX >> 20
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Refuses neighbours whose links are cut differently from this rank's (`mine`): they would
/// plan other chunks for the same collective. Both ends of a link check it, so a ring forms
/// only where every rank has the same shape.
pub(crate) fn check_shape(
    mine: &RingShape,
    me: u32,
    neighbours: &[(u32, &GpuNeighbourSetup)],
) -> Result<()> {
    match neighbours.iter().find(|(_, s)| s.shape != *mine) {
        None => Ok(()),
        Some((r, s)) => Err(Error::InvalidArgument {
            reason: format!(
                "rank {r} cuts its GPU links differently from rank {me} ({:?} against {mine:?}): \
                 the slot shapes, NODETOUR_IPC_PIPELINE and NODETOUR_SHM_PIPELINE must be the \
                 same on every rank",
                s.shape
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn neighbours_must_cut_their_links_the_same_way() {
        use nodetour_core::memory::{ShmDir, ShmName};
        use nodetour_core::transport::gpu::IpcGrant;
        let mine = GpuRingOptions::default();
        let setup = |o: &GpuRingOptions| GpuNeighbourSetup {
            shape: o.shape(),
            flags: ShmName::new(ShmDir::Tmpfs, "nodetour-1-0123456789abcdef").unwrap(),
            device_flags: IpcGrant {
                handle: [0; 64],
                offset: 0,
                len: 4096,
            },
            slots: None,
        };
        let same = setup(&mine);
        assert!(check_shape(&mine.shape(), 0, &[(1, &same), (2, &same)]).is_ok());
        let deeper = setup(&GpuRingOptions {
            shm_pipeline: mine.shm_pipeline + 1,
            ..mine
        });
        let e = check_shape(&mine.shape(), 0, &[(1, &same), (2, &deeper)]).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { reason } if reason.contains("rank 2")
                && reason.contains("NODETOUR_SHM_PIPELINE")),
            "{e}"
        );
        for bad in [0, PIPELINE_MAX + 1] {
            let o = GpuRingOptions {
                ipc_pipeline: bad,
                ..mine
            };
            assert!(matches!(o.validate(), Err(Error::InvalidArgument { .. })));
        }
    }

    #[test]
    fn one_kernel_modes_parse_and_thresholds_are_bounded() {
        assert_eq!(OneKernelMode::parse(""), Some(OneKernelMode::Auto));
        assert_eq!(OneKernelMode::parse(" off "), Some(OneKernelMode::Off));
        assert_eq!(OneKernelMode::parse("force"), Some(OneKernelMode::Force));
        assert_eq!(OneKernelMode::parse("on"), None);
        let codes: Vec<u8> = [
            OneKernelMode::Auto,
            OneKernelMode::Off,
            OneKernelMode::Force,
        ]
        .iter()
        .map(|m| m.code())
        .collect();
        assert_eq!(codes, [0, 1, 2]);
        assert!(GpuRingOptions::default().validate().is_ok());
        for max in [0, SLOT_MEMORY_MAX / 2 + 1] {
            let o = GpuRingOptions {
                one_kernel_max: max,
                ..GpuRingOptions::default()
            };
            assert!(matches!(o.validate(), Err(Error::InvalidArgument { .. })));
        }
    }
}

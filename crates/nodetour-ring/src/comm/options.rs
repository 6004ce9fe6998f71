//! The one options type of a communicator, read from the environment or built by hand.

use std::time::Duration;

use nodetour_core::Config;
use nodetour_core::knobs::Env;
use nodetour_core::transport::{TransportKind, forced};

use crate::error::{Error, Result};

/// Default bytes of one slot (one chunk on the wire).
pub const DEFAULT_SLOT_BYTES: usize = 1 << 20;
/// Default slots each rank grants its previous rank.
pub const DEFAULT_SLOTS: u32 = 4;
/// Default bytes of the staging region a host collective runs through at a time; larger
/// buffers go through it in pieces.
pub const DEFAULT_PIECE_BYTES: usize = 16 << 20;

/// How a communicator forms and runs.
///
/// [`Options::from_env`] reads every `NODETOUR_*` setting ([`Options::default`]: the declared
/// defaults, no environment read); the `with_*` methods set the settings a runtime usually
/// sets itself, and every field may be changed after:
///
/// ```
/// use std::time::Duration;
/// use nodetour_ring::comm::Options;
/// let o = Options::default()
///     .with_gpu(0)
///     .with_join_timeout(Duration::from_secs(900))
///     .with_timeout(Duration::from_secs(60));
/// assert_eq!((o.gpu, o.timeout()), (Some(0), Duration::from_secs(60)));
/// ```
///
/// New settings may be added in minor releases (`#[non_exhaustive]`): build one from
/// [`Options::default`] or [`Options::from_env`], not a struct literal.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Options {
    /// Device, GID, traffic class, and `timeout`: no progress in a collective for this long
    /// fails it, and formation must finish within it (`NODETOUR_TIMEOUT_MS`).
    pub config: Config,
    /// The link kind to use for every link (`NODETOUR_TRANSPORT`); `None` chooses per link.
    pub transport: Option<TransportKind>,
    /// RDMA devices to spread the ranks of a host over (`NODETOUR_IB_DEVICES`, comma
    /// separated: rank `r` uses `devices[r mod len]`); empty: the device chosen for host
    /// memory (`NODETOUR_IB_DEVICE`, else the nearest).
    pub devices: Vec<String>,
    /// Bytes per slot (`NODETOUR_SLOT_BYTES`).
    pub slot_bytes: usize,
    /// Slots per receiver, 1 to 256 (`NODETOUR_SLOTS`).
    pub slots: u32,
    /// Bytes of the registered staging region of host collectives (`NODETOUR_PIECE_BYTES`):
    /// a buffer of any size goes through it in pieces of at most this many bytes, so the
    /// memory a communicator holds does not grow with the buffers it is given.
    pub piece_bytes: usize,
    /// The GPU (ordinal) whose memory this rank passes to collectives: the host staging memory
    /// is pinned under its primary context for fast copies, and no context is made on any
    /// other GPU. `None`: host buffers only (no CUDA at all).
    pub gpu: Option<usize>,
    /// GPUs of one process ([`super::Communicator::from_devices`]): the largest all-gather
    /// segment copied by a kernel rather than the copy engine (`NODETOUR_GATHER_KERNEL_MAX`;
    /// default [`super::KERNEL_COPY_MAX`]; 0: always the copy engine).
    pub kernel_copy_max: usize,
    /// GPUs of one process: the largest two-GPU allreduce run in one step
    /// (`NODETOUR_ONE_STEP_MAX`; default [`super::ONE_STEP_MAX`]; 0: always the ring).
    pub one_step_max: usize,
    /// GPU rings of processes (one host, one GPU each): slot shapes, where the direct path's
    /// flags live, and which path to build (`Auto`, `Direct` or `Staged`).
    pub gpu_ring: super::gpu_options::GpuRingOptions,
    /// GPU rings of two processes: run the allreduce as one exchange step (the default) rather
    /// than the two-step ring.
    pub two_rank_exchange: bool,
    /// Host-memory allreduces of at most this many bytes gather every rank's whole input to
    /// every rank and reduce there (`world − 1` hops instead of the ring's `2 (world − 1)`)
    /// (`NODETOUR_HOST_GATHER_MAX`; default [`DEFAULT_HOST_GATHER_MAX`]; 0: always the ring).
    /// Part of what the ranks agree on: every rank must use the same value.
    pub host_gather_max: usize,
    /// Point-to-point links held at once, at most (`NODETOUR_P2P_MAX_LINKS`): each holds
    /// `slots × slot_bytes` of slots the peer writes, a 64-byte bell and a staging slot of
    /// `slot_bytes` (5 MiB with the defaults); a batch that needs more fails typed.
    pub p2p_max_links: usize,
}

/// The settings every rank must share: each shapes the chunks on the wire (a sender writes at
/// its slot size, a receiver reads at its own) or chooses the algorithm a size takes, so ranks
/// that differ would read each other's slots at the wrong offsets or run different
/// collectives. Formation compares them across every rank and fails on every rank, naming the
/// setting and both values ([`Error::SettingDiffers`]). Every other setting is a rank's own
/// choice (local): the timeout and spin, `NODETOUR_RING_BLOCKS`, `NODETOUR_SHM_READ_MAX` and
/// `NODETOUR_SLOT_COPY_KERNEL_MAX` (how a receiver consumes its own slot),
/// `NODETOUR_NET_LANDING` (where a receiver's slots live: each link agrees on it in its setup),
/// and the GPUs of one process' `NODETOUR_GATHER_KERNEL_MAX` and `NODETOUR_ONE_STEP_MAX` (one
/// process: one value). The knob table's agreement column ([`nodetour_core::knobs`]) and this
/// list are checked against each other by a test.
pub const MUST_AGREE: [&str; 14] = [
    "NODETOUR_SLOT_BYTES",
    "NODETOUR_SLOTS",
    "NODETOUR_PIECE_BYTES",
    "NODETOUR_HOST_GATHER_MAX",
    "NODETOUR_ONE_KERNEL",
    "NODETOUR_ONE_KERNEL_MAX",
    "NODETOUR_IPC_PIPELINE",
    "NODETOUR_SHM_PIPELINE",
    "GpuRingOptions::slots (staged slots per link)",
    "GpuRingOptions::shm_slot_bytes",
    "GpuRingOptions::ipc_slots (direct slots per link)",
    "GpuRingOptions::ipc_slot_bytes",
    "GpuRingOptions::device_flags",
    "Options::two_rank_exchange",
];

/// Checks rank `peer`'s announced [`Options::must_agree`] values against this rank's.
pub(crate) fn check_agreement(
    ours: &[u64; MUST_AGREE.len()],
    theirs: &[u64; MUST_AGREE.len()],
    peer: u32,
) -> Result<()> {
    match (0..MUST_AGREE.len()).find(|&i| ours[i] != theirs[i]) {
        None => Ok(()),
        Some(i) => Err(Error::SettingDiffers {
            setting: MUST_AGREE[i],
            ours: ours[i],
            peer,
            theirs: theirs[i],
        }),
    }
}

/// Default for [`Options::host_gather_max`].
pub const DEFAULT_HOST_GATHER_MAX: usize = 32 << 10;

impl Default for Options {
    /// The declared defaults ([`nodetour_core::knobs::KNOBS`]); no environment read.
    fn default() -> Self {
        Self::from_knobs(&Env::empty()).expect("the declared defaults parse")
    }
}

impl Options {
    /// Reads the `NODETOUR_*` settings of the process environment; a malformed value is an
    /// error naming it.
    pub fn from_env() -> Result<Options> {
        Self::from_knobs(&Env::process())
    }

    /// Reads the settings through `lookup` (a variable name to its value).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Options> {
        Self::from_knobs(&Env::from_lookup(lookup))
    }

    /// Reads the settings from `env` (each declared in [`nodetour_core::knobs`]: range,
    /// default, meaning).
    pub fn from_knobs(env: &Env<'_>) -> Result<Options> {
        use super::gpu_options::{GpuRingOptions, NetLanding, OneKernelMode};
        let config = Config::from_knobs(env)?;
        let size = |k: &str| env.count(k).map(|n| n as usize);
        let word = |k: &str| env.choice(k);
        Ok(Options {
            config,
            transport: forced(env)?,
            devices: env.list("NODETOUR_IB_DEVICES"),
            slot_bytes: size("NODETOUR_SLOT_BYTES")?,
            slots: size("NODETOUR_SLOTS")? as u32,
            piece_bytes: size("NODETOUR_PIECE_BYTES")?,
            gpu: None,
            kernel_copy_max: size("NODETOUR_GATHER_KERNEL_MAX")?,
            one_step_max: size("NODETOUR_ONE_STEP_MAX")?,
            host_gather_max: size("NODETOUR_HOST_GATHER_MAX")?,
            p2p_max_links: size("NODETOUR_P2P_MAX_LINKS")?,
            gpu_ring: GpuRingOptions {
                net_landing: NetLanding::parse(word("NODETOUR_NET_LANDING")?)
                    .expect("declared words"),
                one_kernel: OneKernelMode::parse(word("NODETOUR_ONE_KERNEL")?)
                    .expect("declared words"),
                one_kernel_max: size("NODETOUR_ONE_KERNEL_MAX")?,
                max_blocks: size("NODETOUR_RING_BLOCKS")? as u32,
                ipc_pipeline: size("NODETOUR_IPC_PIPELINE")? as u32,
                shm_read_max: size("NODETOUR_SHM_READ_MAX")?,
                copy_kernel_max: size("NODETOUR_SLOT_COPY_KERNEL_MAX")?,
                shm_pipeline: size("NODETOUR_SHM_PIPELINE")? as u32,
                ..GpuRingOptions::default()
            },
            two_rank_exchange: true,
        })
    }

    /// The settings every rank must share, with this rank's values, in the order of
    /// [`MUST_AGREE`]: the bootstrap announces them and formation compares every rank's with
    /// this rank's ([`SettingDiffers`](Error::SettingDiffers) on every rank where one differs).
    pub(crate) fn must_agree(&self) -> [u64; MUST_AGREE.len()] {
        let g = &self.gpu_ring;
        [
            self.slot_bytes as u64,
            u64::from(self.slots),
            self.piece_bytes as u64,
            self.host_gather_max as u64,
            u64::from(g.one_kernel.code()),
            g.one_kernel_max as u64,
            u64::from(g.ipc_pipeline),
            u64::from(g.shm_pipeline),
            u64::from(g.slots),
            g.shm_slot_bytes as u64,
            u64::from(g.ipc_slots),
            g.ipc_slot_bytes as u64,
            u64::from(g.device_flags),
            u64::from(self.two_rank_exchange),
        ]
    }

    /// The collective timeout: no progress in a collective for this long fails it
    /// (`NODETOUR_TIMEOUT_MS`).
    pub fn timeout(&self) -> Duration {
        self.config.timeout
    }

    /// The joining timeout: forming the communicator must finish within this long
    /// (`NODETOUR_JOIN_TIMEOUT_MS`; default 10 minutes).
    pub fn join_timeout(&self) -> Duration {
        self.config.join_timeout
    }

    /// These options, passing the memory of GPU `ordinal` (see [`Options::gpu`]).
    pub fn with_gpu(mut self, ordinal: usize) -> Options {
        self.gpu = Some(ordinal);
        self
    }

    /// These options with the collective timeout `timeout` (see [`Options::timeout`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Options {
        self.config.timeout = timeout;
        self
    }

    /// These options with the joining timeout `timeout` (see [`Options::join_timeout`]).
    pub fn with_join_timeout(mut self, timeout: Duration) -> Options {
        self.config.join_timeout = timeout;
        self
    }

    /// These options with every link of kind `kind` (see [`Options::transport`]).
    pub fn with_transport(mut self, kind: TransportKind) -> Options {
        self.transport = Some(kind);
        self
    }

    /// These options spreading the ranks of a host over the RDMA devices `devices` (see
    /// [`Options::devices`]).
    pub fn with_devices(mut self, devices: impl IntoIterator<Item = String>) -> Options {
        self.devices = devices.into_iter().collect();
        self
    }

    /// Checks the sizes (what [`Options::from_lookup`] checks for values it reads).
    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::InvalidArgument { reason });
        if !(1..=256).contains(&self.slots) {
            return bad(format!("{} slots: between 1 and 256", self.slots));
        }
        if self.slot_bytes < 64 {
            return bad(format!("slots of {} bytes: at least 64", self.slot_bytes));
        }
        if self.piece_bytes < 4096 {
            return bad(format!(
                "pieces of {} bytes: at least 4096",
                self.piece_bytes
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_constants_are_the_declared_defaults() {
        use super::super::gpu_options::GpuRingOptions;
        let o = Options::default();
        assert_eq!(o.gpu_ring, GpuRingOptions::default());
        assert_eq!((o.slot_bytes, o.slots), (DEFAULT_SLOT_BYTES, DEFAULT_SLOTS));
        assert_eq!(o.piece_bytes, DEFAULT_PIECE_BYTES);
        assert_eq!(o.host_gather_max, DEFAULT_HOST_GATHER_MAX);
        assert_eq!(o.kernel_copy_max, crate::gpu::KERNEL_COPY_MAX);
        assert_eq!(o.one_step_max, crate::gpu::ONE_STEP_MAX);
        assert_eq!(
            nodetour_core::knobs::knob_named("NODETOUR_ONE_KERNEL_MAX").kind,
            nodetour_core::knobs::Kind::Count {
                min: 1,
                max: (crate::gpu_ring::SLOT_MEMORY_MAX / 2) as u64
            }
        );
        let pipeline = nodetour_core::knobs::knob_named("NODETOUR_IPC_PIPELINE").kind;
        assert_eq!(
            pipeline,
            nodetour_core::knobs::Kind::Count {
                min: 1,
                max: u64::from(super::super::gpu_options::PIPELINE_MAX)
            }
        );
    }
}

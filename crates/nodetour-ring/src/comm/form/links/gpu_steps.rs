//! Each in-host GPU link kind's own formation steps (the GPU rows of the transport table,
//! [`super::super::table`]): how this rank's GPU connects to the next rank's, and the stream
//! ring's links once it has. Formation (`gpu.rs`) tries the kinds in the table's order; the
//! first that connects carries the link, and the kinds refused say why.
//!
//! | kind | connect (to the next rank) | bytes land in |
//! |---|---|---|
//! | cuda-ipc ([`super::cuda_ipc`]) | maps the next GPU's slots into this GPU | the next rank's GPU slots (direct) |
//! | shm ([`super::shm`]) | maps the host slots the next rank shares | shared host memory, copied to the GPU (staged) |
//!
//! The receiving side allocates every kind's slots before the exchange (the sender chooses,
//! and announces its choice in the receiver's flag page), and keeps the chosen kind's.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::memory::ShmName;
use nodetour_core::transport::gpu::IpcGrant;
use nodetour_core::transport::gpu::{DeviceFlags, GpuSlot, ShmSlot};

use crate::comm::gpu_options::{GpuPaths, GpuRingOptions};
use crate::error::Result;
use crate::gpu_ring::{EndPages, Outgoing, StreamLinks};

/// What connecting to the next rank uses: what its setup granted this rank.
pub(crate) struct GpuConnecting<'a> {
    /// This rank's GPU.
    pub context: &'a Arc<CudaContext>,
    /// The next rank's host flag page.
    pub flags: &'a ShmName,
    /// The next rank's GPU slots (cuda-ipc).
    pub gpu_slots: &'a IpcGrant,
    /// The next rank's shared host slots and their length (shm).
    pub shm_slots: (&'a ShmName, usize),
}

/// What this rank allocated to receive into, every kind's (the previous rank chooses).
pub(crate) struct Receiving {
    /// Flags in this GPU's memory (the direct path's, where asked).
    pub device_flags: DeviceFlags,
    /// GPU slots (cuda-ipc).
    pub gpu_slots: GpuSlot,
    /// Shared host slots (shm).
    pub shm_slots: ShmSlot,
}

/// What the stream ring's links are built from, once connected.
pub(crate) struct Linking<'a> {
    pub context: &'a Arc<CudaContext>,
    /// The host flag pages: this rank's and its neighbours' (end notices on every path).
    pub ends: EndPages,
    /// What this rank receives into (the unused kinds are freed as the links are built).
    pub receiving: Receiving,
    /// The next rank's setup and the previous rank's.
    pub setups: (
        &'a nodetour_core::transport::setup::GpuNeighbourSetup,
        &'a nodetour_core::transport::setup::GpuNeighbourSetup,
    ),
    pub options: &'a GpuRingOptions,
}

/// One in-host GPU link kind's formation steps.
pub(crate) trait GpuLinkSteps: Sync {
    /// What `paths()` calls the path ("direct (cuda-ipc)", "staged (shm)").
    fn path(&self) -> &'static str;

    /// Whether the kind maps the next GPU's memory (skipped when the staged path is asked
    /// for).
    fn direct(&self) -> bool;

    /// The word announced in the next rank's flag page (both ends must agree).
    fn mode(&self) -> u32;

    /// Why the kind carries the link when it is the first tried (nothing refused before it).
    fn chosen(&self, paths: GpuPaths, forced_shm: bool) -> &'static str;

    /// Connect: a sender into the next rank's slots, or why not.
    fn connect(&self, at: &GpuConnecting<'_>) -> nodetour_core::Result<Outgoing>;

    /// The stream ring's links over `out` (what [`Self::connect`] made).
    fn links(&self, out: Outgoing, at: Linking<'_>) -> Result<StreamLinks>;
}

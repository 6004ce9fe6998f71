//! shm, the staged in-host GPU link: this GPU writes host slots it shares with the next rank,
//! which copies them into its GPU; its flags in the shared host pages.

use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::gpu::{Flags, ShmSender};

use super::gpu_steps::{GpuConnecting, GpuLinkSteps, Linking};
use crate::comm::gpu_options::GpuPaths;
use crate::error::Result;
use crate::gpu_ring::{Incoming, Outgoing, StreamLinks, flag};

/// The kind (its row's steps).
pub(crate) struct Shm;

impl GpuLinkSteps for Shm {
    fn path(&self) -> &'static str {
        "staged (shm)"
    }

    fn direct(&self) -> bool {
        false
    }

    fn mode(&self) -> u32 {
        2
    }

    fn chosen(&self, _: GpuPaths, forced_shm: bool) -> &'static str {
        if forced_shm {
            "NODETOUR_TRANSPORT=shm"
        } else {
            "requested"
        }
    }

    fn connect(&self, at: &GpuConnecting<'_>) -> nodetour_core::Result<Outgoing> {
        let flags = Flags::open(at.context, at.flags, flag::WORDS)?;
        let (name, len) = at.shm_slots;
        ShmSender::open(at.context, name, len, flags, flag::READY).map(Outgoing::Shm)
    }

    fn links(&self, out: Outgoing, at: Linking<'_>) -> Result<StreamLinks> {
        let Linking {
            context,
            ends,
            receiving,
            options,
            ..
        } = at;
        let [mine, next_page, prev_page] = ends.host_pages();
        Ok(StreamLinks {
            flags: mine,
            next_flags: next_page,
            prev_flags: prev_page,
            outgoing: out,
            incoming: Incoming::Shm {
                slots: receiving.shm_slots,
                scratch: DeviceBuffer::new(context, options.shm_slot_bytes)?,
            },
            slots: options.slots,
            slot_bytes: options.shm_slot_bytes,
            pipeline: options.shm_pipeline,
            host_read_max: options.shm_read_max,
            // Host slots: the copy engine (see COPY_KERNEL_MAX).
            copy_kernel_max: 0,
            ends,
            desc_half: 0,
            net: None,
        })
    }
}

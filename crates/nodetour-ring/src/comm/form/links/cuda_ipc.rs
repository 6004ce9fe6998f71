//! cuda-ipc, the direct in-host GPU link: this GPU writes the next GPU's slots, mapped into
//! it with CUDA IPC; its flags in GPU memory (each GPU polls its own) where asked, else in the
//! shared host pages.

use std::sync::Arc;

use nodetour_core::transport::gpu::{CudaIpcSender, FlagPage, Flags, PeerDeviceFlags};

use super::gpu_steps::{GpuConnecting, GpuLinkSteps, Linking};
use crate::comm::gpu_options::GpuPaths;
use crate::error::Result;
use crate::gpu_ring::{Incoming, Outgoing, StreamLinks, flag};

/// The kind (its row's steps).
pub(crate) struct CudaIpc;

impl GpuLinkSteps for CudaIpc {
    fn path(&self) -> &'static str {
        "direct (cuda-ipc)"
    }

    fn direct(&self) -> bool {
        true
    }

    fn mode(&self) -> u32 {
        1
    }

    fn chosen(&self, _: GpuPaths, _: bool) -> &'static str {
        "the next rank's GPU slots are mapped into this GPU"
    }

    fn connect(&self, at: &GpuConnecting<'_>) -> nodetour_core::Result<Outgoing> {
        let flags = Flags::open(at.context, at.flags, flag::WORDS)?;
        CudaIpcSender::open(at.context, at.gpu_slots, flags, flag::READY).map(Outgoing::CudaIpc)
    }

    fn links(&self, out: Outgoing, at: Linking<'_>) -> Result<StreamLinks> {
        let Linking {
            context,
            ends,
            receiving,
            setups: (next, prev),
            options,
        } = at;
        let [mine, next_page, prev_page]: [Arc<dyn FlagPage>; 3] = if options.device_flags {
            let open = |s: &nodetour_core::transport::setup::GpuNeighbourSetup| {
                PeerDeviceFlags::open(context, &s.device_flags, flag::WORDS)
            };
            [
                Arc::new(receiving.device_flags),
                Arc::new(open(next)?),
                Arc::new(open(prev)?),
            ]
        } else {
            ends.host_pages()
        };
        Ok(StreamLinks {
            flags: mine,
            next_flags: next_page,
            prev_flags: prev_page,
            outgoing: out,
            incoming: Incoming::CudaIpc(receiving.gpu_slots),
            slots: options.ipc_slots,
            slot_bytes: options.ipc_slot_bytes,
            pipeline: options.ipc_pipeline,
            host_read_max: 0,
            copy_kernel_max: options.copy_kernel_max,
            ends,
            desc_half: 0,
            net: None,
        })
    }
}

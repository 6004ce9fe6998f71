//! What a rank's two links are made of: where it writes (to the next rank), where the
//! previous rank's chunks land, and the host pages that carry end notices.

use super::*;

/// How this rank writes to the next one.
pub(crate) enum Outgoing {
    /// Into the next rank's GPU slots.
    CudaIpc(CudaIpcSender),
    /// Into host slots shared with the next rank.
    Shm(ShmSender),
    /// Into this rank's host send slots, which the network link's progress thread writes to
    /// the next rank (on another host).
    Net(LinkSlots),
}

/// Where the previous rank's chunks land.
pub(crate) enum Incoming {
    /// This rank's GPU slots.
    CudaIpc(GpuSlot),
    /// Host slots shared with the previous rank, and one chunk of GPU scratch to reduce from.
    Shm {
        /// The slots.
        slots: ShmSlot,
        /// Scratch of one slot's size on this rank's GPU.
        scratch: DeviceBuffer,
    },
    /// This rank's GPU slots, where the network link's progress thread lands the previous
    /// rank's chunks (over tcp: through host bounce slots, copied in on a stream of its own).
    NetGpu(Arc<GpuSlot>),
    /// This rank's GPU slots registered with the RDMA device: the previous rank's NIC writes
    /// its chunks straight into them (the direct path), and the receive stream reduces from
    /// them once the progress thread released each chunk (after a flush where the GPU needs
    /// one).
    NetDirect(LinkSlots),
    /// This rank's host slots, where the network link lands the previous rank's chunks, and
    /// one chunk of GPU scratch to reduce from.
    Net {
        /// The slots.
        slots: LinkSlots,
        /// Scratch of one slot's size on this rank's GPU.
        scratch: DeviceBuffer,
    },
}

/// The host flag pages of this rank and its neighbours, through which ranks tell each other
/// that they ended the ring (host stores and loads only: they work while streams are stuck).
#[derive(Clone)]
pub(crate) struct EndPages {
    /// This rank's page: its neighbours write [`flag::ENDED_BY_PREV`] / [`flag::ENDED_BY_NEXT`].
    pub mine: Arc<Flags>,
    /// The next rank's page.
    pub next: Arc<Flags>,
    /// The previous rank's page.
    pub prev: Arc<Flags>,
}

impl EndPages {
    /// The pages as the stream ring's flag pages (this rank's, the next's, the previous's),
    /// where its flags are the host pages.
    pub(crate) fn host_pages(&self) -> [Arc<dyn FlagPage>; 3] {
        [self.mine.clone(), self.next.clone(), self.prev.clone()]
    }
}

/// This rank's two links, set up by whoever formed the ring (the bootstrap exchange).
pub(crate) struct StreamLinks {
    /// This rank's flag page ([`flag::READY`] and [`flag::RELEASED`] are waited on here).
    pub flags: Arc<dyn FlagPage>,
    /// The next rank's flag page (to set [`flag::READY`]).
    pub next_flags: Arc<dyn FlagPage>,
    /// The previous rank's flag page (to set [`flag::RELEASED`]).
    pub prev_flags: Arc<dyn FlagPage>,
    /// To the next rank.
    pub outgoing: Outgoing,
    /// From the previous rank.
    pub incoming: Incoming,
    /// Slots per link (the same on every rank).
    pub slots: u32,
    /// Bytes per slot (the same on every rank).
    pub slot_bytes: usize,
    /// Chunks each segment is cut into at least, slots allowing
    /// ([`crate::plan::pipelined_chunk_bytes`]; the same on every rank; 1: whole slots).
    pub pipeline: u32,
    /// Host slots (the staged path): chunks of at most this many bytes are reduced straight
    /// out of the slot, larger ones copied into GPU scratch first (0: always copied).
    pub host_read_max: usize,
    /// GPU slots: received chunks that are only copied, of at most this many bytes, are
    /// copied out of the slot by one kernel that then credits the slot; larger ones by the
    /// copy engine and a credit kernel (0: always that). Host slots always take the copy
    /// engine (see [`crate::comm::gpu_options::COPY_KERNEL_MAX`]).
    pub copy_kernel_max: usize,
    /// Where end notices go and come from.
    pub ends: EndPages,
    /// Which half of the descriptor cells this ring uses (0 or 1): two rings over the same
    /// host pages (the facade's `GpuPaths::Both`) use one half each.
    pub desc_half: u32,
    /// The network links (to a neighbour on another host) and their progress thread, where
    /// there are any: `next_flags` / `prev_flags` are then this rank's outboxes.
    pub net: Option<NetLink>,
}

impl StreamLinks {
    pub(super) fn out_kind(&self) -> TransportKind {
        match self.outgoing {
            Outgoing::CudaIpc(_) => TransportKind::CudaIpc,
            Outgoing::Shm(_) => TransportKind::Shm,
            Outgoing::Net(_) => self.net_kind(),
        }
    }

    pub(super) fn net_kind(&self) -> TransportKind {
        self.net.as_ref().map_or(TransportKind::Tcp, NetLink::kind)
    }

    pub(super) fn describe(&self) -> String {
        let out = self.out_kind();
        let inc = match self.incoming {
            Incoming::CudaIpc(_) => TransportKind::CudaIpc,
            Incoming::Shm { .. } => TransportKind::Shm,
            Incoming::Net { .. } | Incoming::NetGpu(_) | Incoming::NetDirect(_) => self.net_kind(),
        };
        let landing = match self.incoming {
            Incoming::NetGpu(_) => "network, landing in GPU slots",
            Incoming::NetDirect(_) => "network, written by the NIC into GPU slots",
            _ => "network, landing in host slots",
        };
        let path = |k| match k {
            TransportKind::CudaIpc => "direct",
            TransportKind::Shm => "staged",
            _ => landing,
        };
        let mut pipeline = if self.pipeline > 1 {
            format!(", segments cut into {} chunks or more", self.pipeline)
        } else {
            String::new()
        };
        if self.host_read_max > 0 && matches!(self.incoming, Incoming::Shm { .. }) {
            pipeline += &format!(
                ", chunks of up to {} KiB reduced straight out of the host slots",
                self.host_read_max >> 10
            );
        }
        let gpu_slots = !matches!(self.incoming, Incoming::Shm { .. } | Incoming::Net { .. });
        if self.copy_kernel_max > 0 && gpu_slots {
            pipeline += &format!(
                ", copies of up to {} KiB out of the slots by one kernel that credits them",
                self.copy_kernel_max >> 10
            );
        }
        format!(
            "to next: {} ({out}), from previous: {} ({inc}); {} slots of {} MiB{pipeline}",
            path(out),
            path(inc),
            self.slots,
            self.slot_bytes >> 20
        )
    }
}

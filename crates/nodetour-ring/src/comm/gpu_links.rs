//! The GPU ring of a communicator whose ranks all share one host, one GPU each: for the link to
//! the next rank, the direct path (cuda-ipc: this GPU writes the next GPU's slots) where the
//! next GPU's memory can be mapped, else the staged path (shm: through shared host memory),
//! with the reason. `NODETOUR_TRANSPORT=cuda-ipc` makes a failed mapping an error,
//! `NODETOUR_TRANSPORT=shm` forces the staged path. The sender chooses, and announces its
//! choice in the receiver's flag page before a barrier, so both ends agree without another
//! exchange. Handles and names go only to the neighbours that use them.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::Deadline;
use nodetour_core::bootstrap::Bootstrap;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::TransportKind;
use nodetour_core::transport::gpu::{
    CudaIpcSender, DeviceFlags, FlagPage, Flags, GpuSlot, PeerDeviceFlags, ShmSender, ShmSlot,
};
use nodetour_core::transport::setup::GpuNeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;

use crate::error::{Error, Result};
use crate::gpu_ring::{
    EndPages, GpuRing, IPC_SLOT_BYTES, IPC_SLOTS, Incoming, Outgoing, SHM_SLOT_BYTES, SLOTS,
    StreamLinks, flag,
};

const MODE_IPC: u32 = 1;
const MODE_SHM: u32 = 2;

/// Where this rank sits and what it may use.
pub(crate) struct Seat<'a> {
    pub job: &'a Bootstrap,
    pub endpoint: &'a TcpEndpoint,
    pub context: &'a Arc<CudaContext>,
    pub me: u32,
    pub world: u32,
    pub position: u32,
    pub prev: u32,
    pub next: u32,
    /// `NODETOUR_TRANSPORT` (cuda-ipc or shm here; anything else means "choose").
    pub forced: Option<TransportKind>,
    pub deadline: Deadline,
}

/// Forms the GPU ring; returns it and why its link to the next rank takes its path.
pub(crate) fn form(seat: Seat<'_>) -> Result<(GpuRing, String)> {
    let Seat {
        job,
        endpoint,
        context,
        me,
        world,
        position,
        prev,
        next,
        forced,
        deadline,
    } = seat;
    if world == 1 {
        return Ok((GpuRing::new(context, 0, 1, None)?, "a ring of one".into()));
    }
    let (ipc_slots, ipc_slot_bytes) = (IPC_SLOTS, IPC_SLOT_BYTES);
    let (shm_slots_n, shm_slot_bytes) = (SLOTS, SHM_SLOT_BYTES);
    // What this rank receives into; the unused kind is freed once the previous rank has said
    // which it chose.
    let flags = Flags::create(context, flag::WORDS)?;
    let device_flags = DeviceFlags::create(context, flag::WORDS)?;
    let gpu_slots = GpuSlot::new(context, ipc_slots as usize * ipc_slot_bytes)?;
    let shm_slots = ShmSlot::create(context, shm_slots_n as usize * shm_slot_bytes)?;
    let (shm_path, shm_len) = shm_slots.grant();
    // To each neighbour, and to no one else: this rank's flag pages (both write them); to the
    // previous rank also the slots it writes into.
    let my_device_flags = device_flags.ipc_grant()?;
    let my_slots = gpu_slots.ipc_grant()?;
    let setup_for = |p: u32| {
        GpuNeighbourSetup {
            flags: flags.name().clone(),
            device_flags: my_device_flags,
            slots: (p == prev).then(|| (my_slots, shm_path.clone(), shm_len as u64)),
        }
        .encode()
    };
    let linked: Vec<u32> = if next == prev {
        vec![next]
    } else {
        vec![next, prev]
    };
    let alive = || job.check_present();
    let address = |p: u32| job.peers()[p as usize].address.clone();
    let setups = endpoint.exchange(&linked, me, world, &address, &setup_for, &alive, deadline)?;
    let setup_of = |p: u32| -> Result<GpuNeighbourSetup> {
        let bytes = setups.get(&p).ok_or_else(|| Error::Protocol {
            rank: p,
            reason: "sent no GPU setup".into(),
        })?;
        GpuNeighbourSetup::decode(bytes).map_err(|e| Error::Protocol {
            rank: p,
            reason: format!("its GPU setup: {e}"),
        })
    };
    let (theirs, from_prev) = (setup_of(next)?, setup_of(prev)?);
    let (grant, next_shm, next_shm_len) = theirs.slots.clone().ok_or_else(|| Error::Protocol {
        rank: next,
        reason: "sent no slots".into(),
    })?;
    let next_shm_len = usize::try_from(next_shm_len).map_err(|_| Error::Protocol {
        rank: next,
        reason: format!("slots of {next_shm_len} bytes"),
    })?;
    let prev_flags = Flags::open(context, &from_prev.flags, flag::WORDS)?;
    let open_flags = || Flags::open(context, &theirs.flags, flag::WORDS);
    let mut choice = Vec::new();
    let mut out_ipc = None;
    if forced != Some(TransportKind::Shm) {
        match CudaIpcSender::open(context, &grant, open_flags()?, flag::READY) {
            Ok(s) => {
                out_ipc = Some(s);
                choice.push(
                    "direct (cuda-ipc): the next rank's GPU slots are mapped into this GPU"
                        .to_owned(),
                );
            }
            Err(e) if forced != Some(TransportKind::CudaIpc) => {
                choice.push(format!("staged (shm): {e}"));
            }
            Err(e) => return Err(e.into()),
        }
    } else {
        choice.push("staged (shm): NODETOUR_TRANSPORT=shm".to_owned());
    }
    let out_shm = match out_ipc {
        Some(_) => None,
        None => Some(ShmSender::open(
            context,
            &next_shm,
            next_shm_len,
            open_flags()?,
            flag::READY,
        )?),
    };
    let mode = if out_ipc.is_some() {
        MODE_IPC
    } else {
        MODE_SHM
    };
    // Opened now: the name goes away after the barrier.
    let next_host_flags = open_flags()?;
    next_host_flags.store(flag::MODE, mode)?;
    job.barrier(deadline)?;
    // Every peer has mapped our files and announced its choice: remove the names (nothing is
    // left behind on a crash).
    flags.unlink()?;
    shm_slots.unlink()?;
    let incoming_mode = flags.read(flag::MODE)?;
    if incoming_mode != mode {
        return Err(Error::Unsupported {
            reason: format!(
                "mixed paths in one GPU ring (to rank {next}: {}; from rank {prev}: mode \
                 {incoming_mode}): set NODETOUR_TRANSPORT=shm",
                choice.join("; ")
            ),
        });
    }
    // The host pages carry end notices on every path; the staged path's streams use them for
    // their flags too.
    let ends = EndPages {
        mine: Arc::new(flags),
        next: Arc::new(next_host_flags),
        prev: Arc::new(prev_flags),
    };
    let host_page = |f: &Arc<Flags>| -> Arc<dyn FlagPage> { f.clone() };
    let links = match (out_ipc, out_shm) {
        (Some(out), _) => {
            // Direct links keep their flags in GPU memory (each GPU polls its own memory); the
            // pages of both neighbours are mapped before anyone's names go away.
            StreamLinks {
                flags: Arc::new(device_flags),
                next_flags: Arc::new(PeerDeviceFlags::open(
                    context,
                    &theirs.device_flags,
                    flag::WORDS,
                )?),
                prev_flags: Arc::new(PeerDeviceFlags::open(
                    context,
                    &from_prev.device_flags,
                    flag::WORDS,
                )?),
                outgoing: Outgoing::CudaIpc(out),
                incoming: Incoming::CudaIpc(gpu_slots),
                slots: ipc_slots,
                slot_bytes: ipc_slot_bytes,
                ends: ends.clone(),
                desc_half: 0,
            }
        }
        (None, Some(out)) => StreamLinks {
            flags: host_page(&ends.mine),
            next_flags: host_page(&ends.next),
            prev_flags: host_page(&ends.prev),
            outgoing: Outgoing::Shm(out),
            incoming: Incoming::Shm {
                slots: shm_slots,
                scratch: DeviceBuffer::new(context, shm_slot_bytes)?,
            },
            slots: shm_slots_n,
            slot_bytes: shm_slot_bytes,
            ends: ends.clone(),
            desc_half: 0,
        },
        (None, None) => unreachable!("one of the two senders is always opened"),
    };
    job.barrier(deadline)?;
    let ring = GpuRing::new(context, position, world, Some(links))?;
    let choice = choice.join("; ");
    tracing::info!(rank = me, path = ring.path(), reason = %choice, "GPU ring formed");
    Ok((ring, choice))
}

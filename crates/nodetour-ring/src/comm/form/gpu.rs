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
use nodetour_core::transport::TransportKind;
use nodetour_core::transport::gpu::{DeviceFlags, Flags, GpuSlot, ShmSlot};
use nodetour_core::transport::setup::GpuNeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_net::bootstrap::Bootstrap;

use super::links::gpu_steps::{GpuConnecting, GpuLinkSteps, Linking, Receiving};
use super::one_kernel::{OneKernelChoice, OneKernelSeat};
use super::setups::{Received, missing};
use super::table;
use crate::comm::gpu_options::{GpuPaths, GpuRingOptions, OneKernelMode, check_shape};
use crate::error::{Error, Result};
use crate::gpu_ring::{EndPages, GpuRing, Outgoing, StreamLinks, flag};
/// A formed GPU ring (direct where cuda-ipc works), and why the link to the next rank takes
/// its path.
pub(crate) struct FormedGpuRing {
    /// The ring.
    pub ring: GpuRing,
    /// Why.
    pub choice: String,
}

/// Where this rank sits in a job whose ranks all share this host, and what it may use.
pub(crate) struct Seat<'a> {
    /// The job's bootstrap (barriers, liveness, every rank's address).
    pub job: &'a Bootstrap,
    /// This rank's authenticated endpoint (the neighbours' setups travel over it).
    pub endpoint: &'a TcpEndpoint,
    /// This rank's GPU.
    pub context: &'a Arc<CudaContext>,
    /// This rank.
    pub me: u32,
    /// Ranks in the job.
    pub world: u32,
    /// This rank's position in the ring order.
    pub position: u32,
    /// The previous rank in the ring.
    pub prev: u32,
    /// The next rank in the ring.
    pub next: u32,
    /// `NODETOUR_TRANSPORT` (cuda-ipc or shm here; anything else means "choose").
    pub forced: Option<TransportKind>,
    /// Formation's deadline.
    pub deadline: Deadline,
    /// The collective timeout (how long a one-kernel collective waits for a peer).
    pub timeout: std::time::Duration,
}

/// What an in-host GPU ring's rank receives into: its host flag page, and every link kind's
/// flags and slots (the previous rank chooses the kind; the others are freed once it has said
/// which, as the links are built).
struct InHostMemory {
    flags: Flags,
    receiving: Receiving,
}

impl InHostMemory {
    /// Allocate.
    fn allocate(context: &Arc<CudaContext>, options: &GpuRingOptions) -> Result<InHostMemory> {
        let ipc_total = options.ipc_slots as usize * options.ipc_slot_bytes;
        let shm_total = options.slots as usize * options.shm_slot_bytes;
        Ok(InHostMemory {
            flags: Flags::create(context, flag::WORDS)?,
            receiving: Receiving {
                device_flags: DeviceFlags::create(context, flag::WORDS)?,
                gpu_slots: GpuSlot::new(context, ipc_total)?,
                shm_slots: ShmSlot::create(context, shm_total)?,
            },
        })
    }

    /// Exchange: to each neighbour, and to no one else, this rank's flag pages (both write
    /// them); to the previous rank also the slots it writes into. Returns the next rank's
    /// setup and the previous rank's, their shapes checked against this rank's.
    fn exchange(
        &self,
        seat: &Seat<'_>,
        options: &GpuRingOptions,
    ) -> Result<(GpuNeighbourSetup, GpuNeighbourSetup)> {
        let (shm_path, shm_len) = self.receiving.shm_slots.grant();
        let my_device_flags = self.receiving.device_flags.ipc_grant()?;
        let my_slots = self.receiving.gpu_slots.ipc_grant()?;
        let setup_for = |p: u32| {
            GpuNeighbourSetup {
                shape: options.shape(),
                flags: self.flags.name().clone(),
                device_flags: my_device_flags,
                slots: (p == seat.prev).then(|| (my_slots, shm_path.clone(), shm_len as u64)),
            }
            .encode()
        };
        let (next, prev) = (seat.next, seat.prev);
        let linked = if next == prev {
            vec![next]
        } else {
            vec![next, prev]
        };
        let received =
            Received::exchange(seat.job, seat.endpoint, &linked, &setup_for, seat.deadline)?;
        let (theirs, from_prev) = (received.gpu(next)?, received.gpu(prev)?);
        check_shape(
            &options.shape(),
            seat.me,
            &[(next, &theirs), (prev, &from_prev)],
        )?;
        Ok((theirs, from_prev))
    }
}

/// How this rank sends to the next: by the first in-host GPU kind of the table that connects
/// (the direct kinds skipped when the staged path is asked for), and why (a kind refused falls
/// back under [`GpuPaths::Auto`] and is an error under [`GpuPaths::Direct`]).
struct ToNext {
    steps: &'static dyn GpuLinkSteps,
    out: Outgoing,
    said: Vec<String>,
}

fn connect_next(
    context: &Arc<CudaContext>,
    theirs: &GpuNeighbourSetup,
    next: u32,
    paths: GpuPaths,
    forced: Option<TransportKind>,
) -> Result<ToNext> {
    let (gpu_slots, shm_name, shm_len) = theirs
        .slots
        .as_ref()
        .ok_or_else(|| missing(next, "slots"))?;
    let shm_len = usize::try_from(*shm_len).map_err(|_| Error::Protocol {
        rank: next,
        reason: format!("slots of {shm_len} bytes"),
    })?;
    let at = GpuConnecting {
        context,
        flags: &theirs.flags,
        gpu_slots,
        shm_slots: (shm_name, shm_len),
    };
    let kinds: Vec<_> = table::gpu_steps()
        .filter(|(_, k)| paths != GpuPaths::Staged || !k.direct())
        .collect();
    let mut refused = Vec::new();
    for (i, (_, steps)) in kinds.iter().enumerate() {
        match steps.connect(&at) {
            Ok(out) => {
                let said = if refused.is_empty() {
                    let forced_shm = forced == Some(TransportKind::Shm);
                    vec![format!(
                        "{}: {}",
                        steps.path(),
                        steps.chosen(paths, forced_shm)
                    )]
                } else {
                    refused
                        .iter()
                        .map(|e| format!("{}: {e}", steps.path()))
                        .collect()
                };
                return Ok(ToNext {
                    steps: *steps,
                    out,
                    said,
                });
            }
            Err(e) if paths == GpuPaths::Auto && i + 1 < kinds.len() => refused.push(e),
            Err(e) => return Err(e.into()),
        }
    }
    Err(Error::Unsupported {
        reason: "no in-host GPU link kind".into(),
    })
}

/// The stream ring's links from what formation connected: the chosen kind builds them (its
/// flags where it keeps them; the host pages carry end notices on every path).
fn stream_links(
    context: &Arc<CudaContext>,
    memory: InHostMemory,
    to_next: ToNext,
    [next, prev]: [Flags; 2],
    setups: (&GpuNeighbourSetup, &GpuNeighbourSetup),
    options: &GpuRingOptions,
) -> Result<StreamLinks> {
    let ends = EndPages {
        mine: Arc::new(memory.flags),
        next: Arc::new(next),
        prev: Arc::new(prev),
    };
    to_next.steps.links(
        to_next.out,
        Linking {
            context,
            ends,
            receiving: memory.receiving,
            setups,
            options,
        },
    )
}

/// Forms the GPU ring of `seat`'s job with `options` (every rank calls it, with the same
/// options): the communicator's device path on one host. Allocate, exchange, connect the
/// link to the next rank (its choice announced in the next rank's flag page before a
/// barrier, so both ends agree without another exchange), then the stream ring and the
/// one-kernel path.
pub(crate) fn form(seat: Seat<'_>, options: GpuRingOptions) -> Result<FormedGpuRing> {
    options.validate()?;
    let (context, me, prev, next) = (seat.context, seat.me, seat.prev, seat.next);
    if seat.world == 1 {
        return Ok(FormedGpuRing {
            ring: GpuRing::new(context, 0, 1, None)?,
            choice: "a ring of one".into(),
        });
    }
    let paths = options.paths_under(seat.forced);
    let memory = InHostMemory::allocate(context, &options)?;
    let (theirs, from_prev) = memory.exchange(&seat, &options)?;
    let prev_flags = Flags::open(context, &from_prev.flags, flag::WORDS)?;
    let to_next = connect_next(context, &theirs, next, paths, seat.forced)?;
    let mode = to_next.steps.mode();
    // Opened now: the name goes away after the barrier.
    let next_flags = Flags::open(context, &theirs.flags, flag::WORDS)?;
    next_flags.store(flag::MODE, mode)?;
    seat.job.barrier(seat.deadline)?;
    // Every peer has mapped our files and announced its choice: remove the names (nothing is
    // left behind on a crash).
    memory.flags.unlink()?;
    memory.receiving.shm_slots.unlink()?;
    let incoming_mode = memory.flags.read(flag::MODE)?;
    if incoming_mode != mode {
        return Err(Error::Unsupported {
            reason: format!(
                "mixed paths in one GPU ring (to rank {next}: {}; from rank {prev}: mode \
                 {incoming_mode}): set NODETOUR_TRANSPORT=shm",
                to_next.said.join("; ")
            ),
        });
    }
    let flags_where = if options.device_flags {
        "flags in GPU memory (direct), shared host memory (staged)"
    } else {
        "flags in shared host memory"
    };
    let choice = format!("{}; {flags_where}", to_next.said.join("; "));
    let links = stream_links(
        context,
        memory,
        to_next,
        [next_flags, prev_flags],
        (&theirs, &from_prev),
        &options,
    )?;
    seat.job.barrier(seat.deadline)?;
    let mut ring = GpuRing::new(context, seat.position, seat.world, Some(links))?;
    ring.set_neighbours(prev, next);
    // Each guarded wait gives up at the job's timeout, inside CUDA graphs too.
    ring.set_wait_timeout(seat.timeout);
    ring.set_max_blocks(options.max_blocks);
    // Small allreduces as one kernel, where every rank can map every rank's memory. The
    // staged path asked for (`NODETOUR_TRANSPORT=shm`, `GpuPaths::Staged`) maps no peer GPU
    // memory: no one-kernel path either.
    let mode = match paths {
        GpuPaths::Staged => OneKernelMode::Off,
        _ => options.one_kernel,
    };
    let one = one_kernel(&seat, &ring, mode, options.one_kernel_max)?;
    let choice = format!("{choice}; {}", one.reason);
    ring.set_one_kernel(one.kernel, options.one_kernel_max, one.reason);
    tracing::info!(rank = me, path = ring.path(), reason = %choice, "GPU ring formed");
    Ok(FormedGpuRing { ring, choice })
}

/// The one-kernel path of `ring` (its stop word polled by the kernels).
fn one_kernel(
    seat: &Seat<'_>,
    ring: &GpuRing,
    mode: OneKernelMode,
    max: usize,
) -> Result<OneKernelChoice> {
    let stop = ring.stop_word().ok_or_else(|| Error::InvalidArgument {
        reason: "a GPU ring with links has a stop word".into(),
    })?;
    super::one_kernel::form(OneKernelSeat {
        seat,
        mode,
        max,
        stop,
    })
}

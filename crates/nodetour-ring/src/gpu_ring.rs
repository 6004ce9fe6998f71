//! Ring allreduce with one GPU per process, over the in-host stream-ordered transports:
//! **direct** (cuda-ipc: the previous rank's copy engine writes into this rank's GPU slots, this
//! rank's reduce kernel reads them) or **staged** (shm: the previous rank's GPU copies into host
//! slots shared by both processes, this rank's GPU copies them in). The whole collective is
//! queued at once from [`crate::stream_plan::program`]; nothing waits on the host.
//!
//! Each rank uses two streams of its own (a send stream and a receive stream, so that a copy
//! out and a copy in run at once on the two copy engines); the collective starts after the work
//! already queued on the caller's stream, and the caller's stream waits for its end.
//!
//! Memory: slot memory is `slots × slot_bytes` on the receiving side, whatever the buffer size
//! (GPU memory for cuda-ipc, shared host memory plus one GPU scratch chunk for shm). Nothing of
//! the user's buffer is exported: senders copy out of it into the peer's slots.
//!
//! Failure: a peer that stops leaves this rank's streams waiting on a flag. [`GpuRing::wait`]
//! has a deadline; on expiry, or on [`GpuRing::abort`], the ring first tells both neighbours
//! (an end notice with the first collective it cannot vouch for, a plain store into their host
//! flag pages: no CUDA call), then sets its **stop word** (a word of its own host flag page
//! that nothing clears), and refuses further collectives. Every hand-off on the streams is a
//! guarded kernel: waits poll their flag *and* the stop word, so they all end once it is set,
//! whatever a live peer's stream stores into the flag later, and latch which of the two ended
//! them; writes into a peer's slots and stores into a peer's flags run only when the wait before
//! them reached its flag (the peer's credit or data), never because of the stop. So an aborted rank's streams drain, touch
//! only this rank's own memory while they do (a reduce of whatever its slots hold into the
//! user's buffer, whose contents are then undefined), and never write a peer's slot that the
//! peer has not released. A neighbour's [`GpuRing::wait`] reads the notices while it polls and
//! once more after its streams finished: a collective from the notice's sequence number on is
//! never reported as `Ok`, and the neighbour passes the notice on (aborting itself), so the
//! whole ring ends within a few polls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::cuda::{GpuEvent, GpuStream};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::TransportKind;
use nodetour_core::transport::gpu::{
    ChunkSource, CudaIpcSender, FlagPage, FlagValue, Flags, GpuSlot, LinkSlots, ShmSender, ShmSlot,
    StagedReceive, StagedSend, StopWord, StreamGuard, enqueue_copy_then_signal,
    enqueue_reduce_then_signal, enqueue_signal, enqueue_wait,
};
use nodetour_core::transport::one_kernel::{OneKernel, OneKernelFailure};

use crate::cause::{CauseKind, RootCause};
use crate::descriptor::{Algorithm, Collective, Descriptor};
use crate::error::{Error, Result};
use crate::net_link::NetLink;
use crate::plan::{Plan, Shape, pipelined_chunk_bytes};
use crate::reduce::{DataType, ReduceOp};
use crate::stream_plan::{
    LinkCounters, RecvKind, RecvOp, Replayable, StreamProgram, program_exchange_on, program_on,
};

/// How long a wait whose deadline passed lets the aborted streams drain before it names the
/// cause from what the GPU latched.
const DEADLINE_DRAIN: Duration = Duration::from_millis(500);

/// Words of each rank's flag page.
pub mod flag {
    /// Chunks that have landed in this rank's slots (written by the previous rank's stream).
    pub const READY: u32 = 0;
    /// Chunks of the next rank's slots this rank may overwrite again (written by the next
    /// rank's stream once it has read them).
    pub const RELEASED: u32 = 1;
    /// The transport the previous rank chose for writing to this rank (written once at setup:
    /// 1 = cuda-ipc, 2 = shm).
    pub const MODE: u32 = 2;
    /// Host page only: the previous rank ended the ring from collective `value - 1` on
    /// (`0`: it did not), written by that rank's host.
    pub const ENDED_BY_PREV: u32 = 3;
    /// Host page only: the same from the next rank.
    pub const ENDED_BY_NEXT: u32 = 4;
    /// Host page only: the first of the cells that carry the previous rank's collective
    /// descriptors, cell `seq mod (slots + 2)` for collective `seq`. Its word is
    /// `seq:16 | 1 | tag:15`, set by the previous rank's send stream just before its first
    /// chunk's ready flag and waited for (equal) by this rank's receive stream before it reads
    /// any chunk of the collective;
    /// bytes 32..64 hold the encoded descriptor, stored by the previous rank's host when it
    /// queued the collective (read only to word an error).
    pub const DESC_BASE: u32 = 5;
    /// Descriptor cells: two halves (two rings over the same pages), each for at most 127
    /// slots + 2.
    pub const DESC_CELLS: u32 = 258;
    /// Host page only: this rank's stop words (one per half, see
    /// `StreamLinks::desc_half`), set by this rank's host when it aborts and never
    /// cleared: every wait its streams queued ends, and no guarded write or signal starts
    /// (`nodetour_core::transport::gpu::StopWord`).
    pub const STOPPED: u32 = DESC_BASE + DESC_CELLS;
    /// Host page only: the previous rank closed its mappings of this rank's memory (stored by
    /// its host at teardown, after its streams drained): this rank may free what it exported
    /// to it.
    pub const CLOSED_BY_PREV: u32 = STOPPED + 2;
    /// Host page only: the same from the next rank.
    pub const CLOSED_BY_NEXT: u32 = STOPPED + 3;
    /// Host page only: why the previous rank ended the ring ([`crate::RootCause`]'s word:
    /// the rank at fault, in ring positions, and what happened there), stored before
    /// [`ENDED_BY_PREV`].
    pub const CAUSE_BY_PREV: u32 = STOPPED + 4;
    /// Host page only: the same from the next rank.
    pub const CAUSE_BY_NEXT: u32 = STOPPED + 5;
    /// Words in the page.
    pub const WORDS: u32 = STOPPED + 6;
}

/// Default slot size for cuda-ipc: large chunks keep the per-chunk hand-off small beside a
/// chunk's transfer at NVLink speed. Measured on two H200s (two processes, f32 sum, 1 GiB,
/// against NCCL in the same run): 2 × 32 MiB 1.05x, 4 × 16 MiB 0.98x, 8 × 8 MiB 0.82x,
/// 16 × 4 MiB 0.64x (host-memory flags).
pub const IPC_SLOT_BYTES: usize = 32 << 20;
/// Default slots per cuda-ipc link.
pub const IPC_SLOTS: u32 = 2;
/// Default slot size for shm (host memory is slower: 8 MiB is ~200 µs of PCIe).
pub const SHM_SLOT_BYTES: usize = 8 << 20;
/// Default slots per shm link.
pub const SLOTS: u32 = 4;
/// The bound on slot memory per communicator (GPU and host each), by default.
pub const SLOT_MEMORY_MAX: usize = 64 << 20;

/// How this rank writes to the next one.
pub enum Outgoing {
    /// Into the next rank's GPU slots.
    CudaIpc(CudaIpcSender),
    /// Into host slots shared with the next rank.
    Shm(ShmSender),
    /// Into this rank's host send slots, which the network link's progress thread writes to
    /// the next rank (on another host).
    Net(LinkSlots),
}

/// Where the previous rank's chunks land.
pub enum Incoming {
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
pub struct EndPages {
    /// This rank's page: its neighbours write [`flag::ENDED_BY_PREV`] / [`flag::ENDED_BY_NEXT`].
    pub mine: Arc<Flags>,
    /// The next rank's page.
    pub next: Arc<Flags>,
    /// The previous rank's page.
    pub prev: Arc<Flags>,
}

/// This rank's two links, set up by whoever formed the ring (the bootstrap exchange).
pub struct StreamLinks {
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
    /// engine (see [`crate::comm::gpu_links::COPY_KERNEL_MAX`]).
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
    fn out_kind(&self) -> TransportKind {
        match self.outgoing {
            Outgoing::CudaIpc(_) => TransportKind::CudaIpc,
            Outgoing::Shm(_) => TransportKind::Shm,
            Outgoing::Net(_) => self.net_kind(),
        }
    }

    fn net_kind(&self) -> TransportKind {
        self.net.as_ref().map_or(TransportKind::Tcp, NetLink::kind)
    }

    fn describe(&self) -> String {
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

fn gpu_error(what: &str, e: nodetour_core::Error) -> Error {
    Error::Gpu {
        reason: format!("{what}: {e}"),
    }
}

/// One rank of a ring of processes, one GPU each.
///
/// The layer below [`crate::comm::Communicator`] (its device path on one host); runtimes use
/// the communicator, tools that compare paths side by side form this through
/// [`crate::comm::gpu_links::form`].
pub struct GpuRing {
    // What queued work uses: taken by the teardown, and dropped only once the streams have
    // drained (else leaked: see `shut_down`).
    held: Option<Held>,
    // What this rank exported to its neighbours, kept after `close_imports` until `close`.
    exports: Option<Exports>,
    // The events that order the streams of eager collectives (`end` is what `wait` polls),
    // and those of collectives captured into CUDA graphs (never queried: an event last
    // recorded under capture cannot be).
    marks: Marks,
    capture_marks: Marks,
    context: Arc<CudaContext>,
    rank: u32,
    world: u32,
    counters: LinkCounters,
    abort: AbortHandle,
    /// Collectives queued so far (the next one's sequence number).
    queued: u64,
    /// Ring collectives queued eagerly so far: while no ring collective was captured, the
    /// collective counter of the streams' guards (which names the descriptor cells).
    ring_queued: u64,
    /// Whether a ring collective was captured into a CUDA graph: replays move the guards'
    /// counters past what the host knows, so the host no longer reads descriptor cells.
    ring_captured: bool,
    /// How long a guarded wait of the streams waits (inside graphs too); `None`: until stopped.
    wait_timeout: Option<Duration>,
    path: String,
    exchange: bool,
    // The largest allreduce (bytes) the one-kernel path takes (0: none), and why it is on or
    // off (for the log).
    one_kernel_max: usize,
    one_kernel_path: String,
    // The one-kernel collectives queued (to name the one that failed).
    one_kernel_log: OneKernelLog,
    // The neighbours' job ranks (previous, next), for the teardown's confirmations.
    neighbours: Option<(u32, u32)>,
}

/// The one-kernel collectives a rank queued, by their number on its GPU (what a failed block
/// latches), to name the failed one.
#[derive(Default)]
struct OneKernelLog {
    /// Eager launches queued.
    launched: u32,
    /// Some were captured into a graph: replays count on the GPU, not here.
    captured: bool,
    /// The last few eager ones: (number on the GPU modulo 2^16, descriptor).
    recent: std::collections::VecDeque<(u16, Descriptor)>,
}

impl OneKernelLog {
    const KEPT: usize = 64;

    fn queued(&mut self, what: Descriptor, capturing: bool) {
        if capturing {
            self.captured = true;
            return;
        }
        self.launched = self.launched.wrapping_add(1);
        if self.recent.len() == Self::KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back((self.launched as u16, what));
    }

    /// The failed collective, in words.
    fn name(&self, collective: u16) -> String {
        match self.recent.iter().find(|(n, _)| *n == collective) {
            Some((_, d)) if !self.captured => d.to_string(),
            _ => format!(
                "one-kernel collective #{collective} of this rank's GPU (counted modulo 65536,                  graph replays included)"
            ),
        }
    }
}

/// The events that order one collective's streams: the caller's stream to both, the send
/// stream's chunks to the receive stream's and back, both back to the caller's.
struct Marks {
    start: GpuEvent,
    sends: Vec<GpuEvent>,
    recvs: Vec<GpuEvent>,
    end: [GpuEvent; 2],
}

impl Marks {
    fn new(context: &Arc<CudaContext>) -> nodetour_core::Result<Marks> {
        Ok(Marks {
            start: GpuEvent::marker(context)?,
            sends: Vec::new(),
            recvs: Vec::new(),
            end: [GpuEvent::marker(context)?, GpuEvent::marker(context)?],
        })
    }

    /// At least `sends` and `recvs` chunk events.
    fn grow(
        &mut self,
        context: &Arc<CudaContext>,
        sends: usize,
        recvs: usize,
    ) -> nodetour_core::Result<()> {
        while self.sends.len() < sends {
            self.sends.push(GpuEvent::marker(context)?);
        }
        while self.recvs.len() < recvs {
            self.recvs.push(GpuEvent::marker(context)?);
        }
        Ok(())
    }
}

/// The streams and what their queued work touches, dropped once the streams have drained (or
/// leaked, past the deadline). Drop order: the streams (destroyed by the driver once idle),
/// then the links (cuda-ipc mappings are closed after the work queued on them; GPU memory is
/// freed in stream order; shared host memory is unregistered), then the kernel handle (the
/// kernels stay loaded while the context lives).
struct Held {
    send: GpuStream,
    recv: GpuStream,
    links: Option<StreamLinks>,
    kernels: ReduceKernels,
    // Each stream's guard words (its latch and completion counter): see StreamGuard.
    guards: Option<[StreamGuard; 2]>,
    // Small allreduces as one kernel on the caller's stream, where formation enabled it.
    one_kernel: Option<OneKernel>,
}

/// The memory a rank exported (its slots, its flag pages): freed only once its neighbours have
/// closed their mappings of it.
struct Exports {
    // Closed first (its thread holds the slots it reads and lands in until it ends).
    net: Option<NetLink>,
    _incoming: Incoming,
    _flags: Arc<dyn FlagPage>,
    _ends: EndPages,
    // The one-kernel path's scratch and signal page (its mappings of the peers' are closed).
    _one_kernel: Option<OneKernel>,
}

/// How long dropping a ring waits for its collectives in flight (after aborting them) before
/// it leaks its streams and slot memory rather than free what a GPU may still use.
pub const TEARDOWN_DEADLINE: Duration = Duration::from_secs(10);

impl GpuRing {
    /// This rank (`rank` of `world`) on `context`'s GPU, with its links (`None` only for a
    /// ring of one). Compiles or loads the reduction kernels.
    pub fn new(
        context: &Arc<CudaContext>,
        rank: u32,
        world: u32,
        links: Option<StreamLinks>,
    ) -> Result<GpuRing> {
        if rank >= world || (world > 1) != links.is_some() {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "rank {rank} of {world} with{} links",
                    if links.is_some() { "" } else { "out" }
                ),
            });
        }
        if let Some(l) = &links {
            let bytes = l.slot_bytes.saturating_mul(l.slots as usize);
            if l.slots == 0 || l.slot_bytes == 0 || l.slots > 127 {
                return Err(Error::InvalidArgument {
                    reason: format!("{} slots of {} bytes", l.slots, l.slot_bytes),
                });
            }
            let small_scratch = |scratch: &DeviceBuffer| {
                if scratch.len() < l.slot_bytes {
                    return Err(Error::InvalidArgument {
                        reason: "the GPU scratch is smaller than a slot".into(),
                    });
                }
                Ok(())
            };
            let have = match &l.incoming {
                Incoming::CudaIpc(s) => s.buffer().len(),
                Incoming::NetGpu(s) => s.buffer().len(),
                Incoming::NetDirect(s) => match s.region().device_buffer() {
                    Some(b) => b.len(),
                    None => {
                        return Err(Error::InvalidArgument {
                            reason: "direct network slots that are not GPU memory".into(),
                        });
                    }
                },
                Incoming::Shm { slots, scratch } => {
                    small_scratch(scratch)?;
                    slots.grant().1
                }
                Incoming::Net { slots, scratch } => {
                    small_scratch(scratch)?;
                    slots.region().len()
                }
            };
            if have < bytes {
                return Err(Error::InvalidArgument {
                    reason: format!("slot memory of {have} bytes for {bytes}"),
                });
            }
        }
        let g = |e| gpu_error("setting up the GPU ring", e);
        let path = match &links {
            None => "a ring of one: nothing moves".to_owned(),
            Some(l) => l.describe(),
        };
        let ends = links.as_ref().map(|l| l.ends.clone());
        let stop = match &links {
            Some(l) => Some(
                StopWord::new(l.ends.mine.clone(), flag::STOPPED + l.desc_half.min(1))
                    .map_err(g)?,
            ),
            None => None,
        };
        let cells = links
            .as_ref()
            .map_or((0, 1), |l| desc_cells(l.slots, l.desc_half));
        let guards = match &stop {
            Some(stop) => Some([
                StreamGuard::new(context, stop.clone()).map_err(g)?,
                StreamGuard::new(context, stop.clone()).map_err(g)?,
            ]),
            None => None,
        };
        Ok(GpuRing {
            held: Some(Held {
                send: GpuStream::new(context).map_err(g)?,
                recv: GpuStream::new(context).map_err(g)?,
                links,
                kernels: ReduceKernels::load(context).map_err(g)?,
                guards,
                one_kernel: None,
            }),
            exports: None,
            marks: Marks::new(context).map_err(g)?,
            capture_marks: Marks::new(context).map_err(g)?,
            context: context.clone(),
            rank,
            world,
            counters: LinkCounters::default(),
            abort: AbortHandle {
                shared: Arc::new(AbortState {
                    failed: Mutex::new(None),
                    confirmed: AtomicU64::new(0),
                    stop,
                    ends,
                    position: (rank, world),
                    pending: Mutex::new(std::collections::VecDeque::new()),
                    desc_cells: cells,
                }),
            },
            queued: 0,
            ring_queued: 0,
            ring_captured: false,
            wait_timeout: None,
            path,
            exchange: true,
            one_kernel_max: 0,
            one_kernel_path: String::new(),
            one_kernel_log: OneKernelLog::default(),
            neighbours: None,
        })
    }

    fn h(&self) -> &Held {
        self.held
            .as_ref()
            .expect("present until the ring is closed (callers check)")
    }

    /// Ends the ring: waits for the collectives in flight, at most `timeout` (aborting them
    /// first if they have not finished: peers are told), then frees the streams, slot memory
    /// and kernels. Past the deadline it leaks them (never frees memory a GPU may still use)
    /// and says so; `Drop` does the same with [`TEARDOWN_DEADLINE`] and can only log. The
    /// ring refuses collectives afterwards.
    pub fn close(&mut self, timeout: Duration) -> Result<()> {
        self.shut_down(timeout)
    }

    fn drained(&self) -> bool {
        self.marks.end[0].is_complete().unwrap_or(false)
            && self.marks.end[1].is_complete().unwrap_or(false)
    }

    /// The first half of the teardown handshake: drains the streams (aborting collectives in
    /// flight, at most `timeout`), then closes this rank's mappings of its neighbours' memory
    /// (their cuda-ipc slots and flag pages, their shared files) while keeping the memory it
    /// exported itself, which a neighbour may still have mapped. Once every rank has done this
    /// (a barrier, or the liveness mesh saying who is gone), [`GpuRing::close`] frees the rest.
    /// The ring refuses collectives afterwards.
    pub fn close_imports(&mut self, timeout: Duration) -> Result<()> {
        if self.held.is_none() {
            return Ok(());
        }
        if self.captured() {
            self.keep_for_replays();
            return Ok(());
        }
        let held = self.drained_held(timeout)?;
        let Held {
            send,
            recv,
            links,
            kernels,
            guards,
            one_kernel,
        } = held;
        // Drained: nothing queued uses any of it.
        drop((send, recv, kernels, guards));
        let one_kernel = one_kernel.map(|mut k| {
            k.close_imports();
            k
        });
        if let Some(l) = links {
            let StreamLinks {
                flags,
                next_flags,
                prev_flags,
                outgoing,
                incoming,
                ends,
                net,
                ..
            } = l;
            drop((outgoing, next_flags, prev_flags));
            // Tell both neighbours that nothing of this rank maps their memory any more (their
            // host pages: shared files, which stay valid while either side maps them).
            let _ = ends.next.store(flag::CLOSED_BY_PREV, 1);
            let _ = ends.prev.store(flag::CLOSED_BY_NEXT, 1);
            // The network links stay up until every rank has drained (the caller's handshake):
            // a neighbour still finishing its last collective must not see its link cut.
            self.exports = Some(Exports {
                net,
                _incoming: incoming,
                _flags: flags,
                _ends: ends,
                _one_kernel: one_kernel,
            });
        }
        Ok(())
    }

    /// The neighbours' job ranks (previous, next): whose confirmations the teardown reads.
    pub(crate) fn set_neighbours(&mut self, prev: u32, next: u32) {
        self.neighbours = Some((prev, next));
    }

    /// Whether every neighbour that maps this rank's memory has said it closed its mappings
    /// ([`flag::CLOSED_BY_PREV`] / [`flag::CLOSED_BY_NEXT`] in this rank's page) or is
    /// `absent` (lost or gone: its mappings went with its process): only then may the
    /// memory this rank exported be freed. The one-kernel path's scratch is mapped by every
    /// rank of the host, which write no confirmation: it is freed only after the handshake.
    pub(crate) fn neighbours_closed(&self, absent: &dyn Fn(u32) -> bool) -> bool {
        let Some(e) = &self.exports else { return true };
        if e._one_kernel.is_some() {
            return false;
        }
        let Some((prev, next)) = self.neighbours else {
            return false;
        };
        [(flag::CLOSED_BY_PREV, prev), (flag::CLOSED_BY_NEXT, next)]
            .into_iter()
            .all(|(word, rank)| absent(rank) || e._ends.mine.read(word).is_ok_and(|v| v != 0))
    }

    /// Leaks the memory this rank exported (a neighbour that may still map it did not confirm
    /// it closed its mapping before the deadline): never freed, never reused.
    pub fn leak_exports(&mut self) {
        if let Some(mut e) = self.exports.take() {
            // The link's thread owns what it uses: ending it frees nothing a neighbour maps.
            if let Some(mut net) = e.net.take() {
                if let Err(err) = net.close(TEARDOWN_DEADLINE) {
                    tracing::warn!(error = %err, "closing the GPU ring's network links");
                }
            }
            tracing::error!(
                "a neighbour did not confirm it unmapped this rank's slots: leaking them"
            );
            std::mem::forget(e);
        }
    }

    /// Drains the streams (aborting first if work is in flight) and hands back what they
    /// used, or leaks it all past the deadline.
    fn drained_held(&mut self, timeout: Duration) -> Result<Held> {
        let deadline = Instant::now() + timeout;
        if !self.drained() {
            self.abort
                .abort("the ring was closed with collectives in flight");
            let mut nap = Duration::from_micros(10);
            while !self.drained() && Instant::now() < deadline {
                std::thread::sleep(nap);
                nap = (nap * 2).min(Duration::from_millis(1));
            }
        }
        let held = self.held.take().expect("checked by the callers");
        if self.drained() {
            return Ok(held);
        }
        // A stream still runs: freeing its slots or unloading its kernels could corrupt
        // memory, and synchronising could hang. Leak them.
        std::mem::forget(held);
        let e = Error::Timeout {
            waiting_for: "the GPU ring's streams to drain at teardown (leaked its streams \
                          and slot memory)"
                .into(),
            rank: None,
            after: timeout,
        };
        tracing::error!(error = %e, "GPU ring teardown");
        Err(e)
    }

    /// A ring whose collectives were captured into CUDA graphs: a replay may be in flight, or
    /// be launched after the ring closed (the graphs are the caller's), and each touches this
    /// rank's slots, flag pages, guard words and scratch and its mappings of the peers'. So
    /// the ring stops for good (its stop word: every replay's waits end at once and it writes
    /// nothing into a peer's memory; a one-kernel replay returns before it writes anything)
    /// and keeps all of that memory for the life of the process, leaked and logged, rather
    /// than free what a replay may still use: no deadline bounds when a graph runs.
    /// The stop word is set without end notices: the neighbours may still be finishing their
    /// last collectives (the close's handshake comes after this), and a notice would fail
    /// them; a neighbour's own replay after the close ends by its guarded waits' deadline.
    fn keep_for_replays(&mut self) {
        self.abort.stop_quietly();
        let (held, exports) = (self.held.take(), self.exports.take());
        if held.is_some() || exports.is_some() {
            tracing::warn!(
                "the GPU ring was captured into CUDA graphs: its streams, slots, flag pages and \
                 scratch stay allocated (leaked) so that a replay after the close finds them; \
                 its stop word makes every such replay a no-op"
            );
        }
        std::mem::forget((held, exports));
    }

    fn shut_down(&mut self, timeout: Duration) -> Result<()> {
        if self.captured() {
            self.keep_for_replays();
            return Ok(());
        }
        let result = if self.held.is_some() {
            self.drained_held(timeout).map(drop)
        } else {
            Ok(())
        };
        // Exports are dropped here only after close_imports and the caller's handshake, or
        // when the ring never split them (then the peers' mappings are the caller's business:
        // GpuRingJob always does the handshake).
        self.exports = None;
        result
    }

    /// How long each guarded wait of the streams waits for a peer's word (`timeout`, the job's
    /// collective timeout): past it the wait sets the stop word itself, every later wait ends,
    /// and the next call or [`Self::wait_alive`] reports the timeout. The deadline that holds
    /// inside CUDA graphs, where no host waits; eager collectives have the host's too.
    pub fn set_wait_timeout(&mut self, timeout: Duration) {
        self.wait_timeout = Some(timeout);
        if let Some(guards) = self.held.as_mut().and_then(|h| h.guards.as_mut()) {
            for g in guards {
                g.set_timeout(Some(timeout));
            }
        }
    }

    /// Caps the blocks of the stream-ordered ring's reduce, copy and send kernels (0: none;
    /// see `ReduceKernels::with_max_blocks`). For collectives queued from now on.
    pub fn set_max_blocks(&mut self, blocks: u32) {
        if let Some(h) = self.held.as_mut() {
            h.kernels = h.kernels.clone().with_max_blocks(blocks);
        }
    }

    /// Two ranks run the allreduce as one exchange step ([`program_exchange_on`], the default)
    /// or, with `false`, as the two-step ring. Every rank must choose the same.
    pub fn set_two_rank_exchange(&mut self, on: bool) {
        self.exchange = on;
    }

    /// The stop word the ring's waits poll (`None` for a ring of one): what the one-kernel
    /// path's kernels poll too.
    pub(crate) fn stop_word(&self) -> Option<nodetour_core::transport::gpu::StopWord> {
        self.abort.shared.stop.clone()
    }

    /// Runs allreduces of at most `max` bytes as one kernel on the caller's stream (formed by
    /// `comm::one_kernel_links`; every rank must have it on with the same `max`), or, with
    /// `None`, on the ring; `why` says which and why (for [`Self::path`]).
    pub(crate) fn set_one_kernel(&mut self, kernel: Option<OneKernel>, max: usize, why: String) {
        if let Some(h) = self.held.as_mut() {
            self.one_kernel_max = if kernel.is_some() {
                max.min(kernel.as_ref().map_or(0, OneKernel::max_bytes))
            } else {
                0
            };
            h.one_kernel = kernel;
        }
        self.one_kernel_path = why;
    }

    /// The transport of the link to the next rank (`None` for a ring of one).
    pub fn kind(&self) -> Option<TransportKind> {
        let links = self.held.as_ref().and_then(|h| h.links.as_ref());
        links.map(StreamLinks::out_kind)
    }

    /// Which path each link takes and why it is shaped so (for the log).
    pub fn path(&self) -> String {
        let algo = match (self.world, self.exchange) {
            (1, _) => "",
            (2, true) => "; two ranks: one exchange step",
            _ => "; ring: reduce-scatter + all-gather",
        };
        // What the ring's kernels occupy (the honest cost: SMs taken from the caller's work).
        let blocks = self.held.as_ref().map_or(String::new(), |h| {
            format!(
                "; kernels of up to {} blocks of 512 threads ({} SMs)",
                h.kernels.max_blocks(),
                h.kernels.sms()
            )
        });
        if self.one_kernel_path.is_empty() {
            format!("{}{algo}{blocks}", self.path)
        } else {
            format!("{}{algo}{blocks}; {}", self.path, self.one_kernel_path)
        }
    }

    /// Queues `shape` in place on the first `count` elements of `buffer` (in ring positions:
    /// reduce-scatter leaves segment `p` of position `p` reduced, all-gather starts from it,
    /// broadcast copies position `root`'s buffer), after the work already queued on `stream`; work
    /// queued on `stream` afterwards sees the result. Every rank must queue the same
    /// collectives in the same order with the same arguments. Keep `buffer` alive until
    /// `stream` has passed the collective.
    pub fn collective(
        &mut self,
        buffer: &DeviceBuffer,
        shape: Shape,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        self.ready_to_queue()?;
        let capturing = self.check(buffer, count, dtype, stream)?;
        let Some(links) = &self.h().links else {
            return Ok(()); // one rank: the sum, min, max, product and average of one value
        };
        let bytes = count * dtype.size(); // checked by self.check
        let one_kernel = shape == Shape::AllReduce && bytes <= self.one_kernel_max && bytes > 0;
        if one_kernel {
            return self.one_kernel(buffer, count, dtype, op, stream, capturing);
        }
        if capturing && links.net.is_some() {
            return Err(Error::Unsupported {
                reason: format!(
                    "the stream is being captured into a CUDA graph: this {shape:?} of {bytes} \
                     bytes takes a ring with a network link, whose progress thread cannot \
                     follow replays (only allreduces on the one-kernel path, at most {} bytes, \
                     or rings of one host can be captured)",
                    self.one_kernel_max
                ),
            });
        }
        let exchange = self.world == 2 && self.exchange && shape == Shape::AllReduce;
        // The largest piece one chunk sequence covers: the whole buffer for an exchange or a
        // broadcast, else a segment (the ring's blocks).
        let segment_bytes = match shape {
            _ if exchange => bytes as u64,
            Shape::Broadcast { .. } => bytes as u64,
            _ => (count as u64).div_ceil(u64::from(self.world)) * dtype.size() as u64,
        };
        let chunk_bytes =
            pipelined_chunk_bytes(links.slot_bytes as u64, links.pipeline, segment_bytes);
        let plan = Plan::new(
            self.world,
            count as u64,
            dtype.size() as u32,
            chunk_bytes,
            links.slots,
        )?
        .with_shape(shape)?;
        let average = op == ReduceOp::Avg;
        let seq = self.queued;
        let algorithm = if exchange {
            Algorithm::StreamExchange
        } else {
            Algorithm::StreamRing
        };
        let (collective, root) = match shape {
            Shape::AllReduce => (Collective::AllReduce, None),
            Shape::ReduceScatter => (Collective::ReduceScatter, None),
            Shape::AllGather => (Collective::AllGather, None),
            Shape::Broadcast { root } => (Collective::Broadcast, Some(root)),
        };
        let reduces = matches!(shape, Shape::AllReduce | Shape::ReduceScatter);
        let what = Descriptor {
            collective,
            root,
            op: if reduces { op } else { ReduceOp::Sum },
            ..Descriptor::all_reduce(count as u64, dtype, op, algorithm, seq)
        };
        // The descriptor cell and word: the guards' collective counters name them on the GPU.
        // The host reads the cells (to explain a disagreement) only while it knows those
        // counters: until a ring collective is captured (replays move them unseen).
        let cells = desc_cells(links.slots, links.desc_half);
        let desc = (cells, 0x8000 | u32::from(what.tag() & 0x7fff));
        if !capturing && !self.ring_captured {
            let ring_seq = self.ring_queued;
            let cell = desc_cell(cells, ring_seq);
            // For the next rank's error message, should it disagree (a host store, no CUDA call).
            let _ = links.ends.next.store_bytes(cell, 32, &what.encode());
            self.abort
                .expect(ring_seq, desc_word(ring_seq, what.tag()), what);
        }
        let replayable = Replayable {
            send: !matches!(links.outgoing, Outgoing::Net(_)),
            recv: matches!(links.incoming, Incoming::CudaIpc(_) | Incoming::Shm { .. }),
        };
        let (prog, steps) = if exchange {
            let p = program_exchange_on(&plan, average, &mut self.counters, replayable);
            (p, 1)
        } else {
            let p = program_on(&plan, self.rank, average, &mut self.counters, replayable);
            (p, plan.steps())
        };
        if let Some(net) = &self.h().links.as_ref().and_then(|l| l.net.as_ref()) {
            // Before the streams can run: the progress thread learns each chunk's length.
            let size = dtype.size();
            let bytes = |e: &std::ops::Range<u64>| (e.end - e.start) as usize * size;
            net.plan(
                prog.sends.iter().map(|s| bytes(&s.elements)),
                prog.recvs.iter().map(|r| bytes(&r.elements)),
            );
        }
        self.ring_captured |= capturing;
        // From here the peers count these chunks: a failure to queue breaks the ring.
        let queued = self.queue(
            buffer, dtype, op, stream, steps, &prog, desc, capturing, replayable,
        );
        // A captured collective is counted by its replays, on the GPU (as on the one-kernel
        // path, the host's count names eager collectives only).
        if !capturing {
            self.queued += 1;
            self.ring_queued += 1;
        }
        if let Err(e) = &queued {
            self.abort
                .abort(&format!("queueing a collective failed: {e}"));
        }
        queued
    }

    /// Whether a collective may be queued: the ring is open, not aborted, no neighbour ended it
    /// since the last call, and no one-kernel collective (a graph replay's, which no wait saw)
    /// failed.
    fn ready_to_queue(&mut self) -> Result<()> {
        if let Some(e) = self.abort.error() {
            return Err(e);
        }
        if self.held.is_none() {
            return Err(Error::Aborted {
                reason: "the ring was closed".into(),
            });
        }
        if let Some((e, _)) = self.abort.read_notice(self.queued, self.captured()) {
            self.abort.abort_with(e.clone());
            return Err(e);
        }
        if let Some(e) = self.one_kernel_failure().or_else(|| self.guard_timeout()) {
            self.abort.abort_with(e.clone());
            return Err(e);
        }
        Ok(())
    }

    /// The one-kernel path, where formation turned it on (to allocate symmetric buffers).
    pub(crate) fn one_kernel_mut(&mut self) -> Option<&mut OneKernel> {
        self.held.as_mut()?.one_kernel.as_mut()
    }

    /// This rank's part of symmetric buffer `id`, for `f` (under the caller's lock).
    pub(crate) fn symmetric_buffer(&self, id: usize) -> Option<&DeviceBuffer> {
        self.held
            .as_ref()?
            .one_kernel
            .as_ref()?
            .symmetric_buffer(id)
    }

    /// Queues the allreduce in place of the first `count` elements of symmetric buffer `id`
    /// on `stream`: one two-shot kernel reading every rank's part directly. Captured like the
    /// other one-kernel collectives.
    pub(crate) fn symmetric_all_reduce(
        &mut self,
        id: usize,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        self.ready_to_queue()?;
        let buffer = self
            .symmetric_buffer(id)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("no symmetric buffer {id} on this communicator"),
            })?;
        let capturing = self.check(buffer, count, dtype, stream)?;
        if count == 0 {
            return Ok(());
        }
        // The buffer is part of what the ranks agree on.
        let salt = (id as u32 + 1).wrapping_mul(0x9e37_79b9);
        self.queue_one_kernel(
            count,
            dtype,
            op,
            Algorithm::TwoShotSymmetric,
            salt,
            stream,
            capturing,
            &|kernel, kernels, digest| {
                kernel.enqueue_all_reduce_symmetric(kernels, stream, dtype, op, id, count, digest)
            },
        )
    }

    /// Queues an allreduce as one kernel on `stream` (the caller's): see
    /// `nodetour_core::cuda::one_kernel`. The kernel checks that every rank's descriptor
    /// digest (the algorithm in it) is the same.
    ///
    /// Into a CUDA graph (`capturing`): only the kernel is captured. Its sequence numbers live
    /// in GPU memory and are advanced by the kernel itself, so every replay is the next
    /// collective; the host's count of collectives (what end notices name) counts eager ones
    /// only. A replay that fails latches its status, which the next [`Self::wait_alive`] or
    /// collective reports.
    fn one_kernel(
        &mut self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
        capturing: bool,
    ) -> Result<()> {
        let kernel = self.held.as_ref().and_then(|h| h.one_kernel.as_ref());
        let two_shot = kernel
            .expect("checked by the caller")
            .two_shot(count * dtype.size());
        let algorithm = if two_shot {
            Algorithm::TwoShot
        } else {
            Algorithm::OneShot
        };
        self.queue_one_kernel(
            count,
            dtype,
            op,
            algorithm,
            0,
            stream,
            capturing,
            &|kernel, kernels, digest| {
                kernel.enqueue_all_reduce(kernels, stream, dtype, op, buffer, buffer, count, digest)
            },
        )
    }

    /// Queues one one-kernel collective through `enqueue` (given the path, the kernels and the
    /// descriptor's digest, `salt` folded in), then, unless `capturing`, the end markers that
    /// `wait` polls.
    #[allow(clippy::too_many_arguments)]
    fn queue_one_kernel(
        &mut self,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        algorithm: Algorithm,
        salt: u32,
        stream: &GpuStream,
        capturing: bool,
        enqueue: &dyn Fn(&OneKernel, &ReduceKernels, u32) -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let seq = self.queued;
        let what = Descriptor::all_reduce(count as u64, dtype, op, algorithm, seq);
        let g = |e| gpu_error("queueing the collective", e);
        let held = self.held.as_ref().expect("checked by the caller");
        let kernel = held.one_kernel.as_ref().ok_or_else(|| Error::Unsupported {
            reason: "the one-kernel path is off on this communicator".into(),
        })?;
        // From here the peers count this collective: a failure to queue breaks the ring.
        let queued = enqueue(kernel, &held.kernels, what.digest() ^ salt)
            .map_err(g)
            .and_then(|()| {
                if capturing {
                    return Ok(());
                }
                // What `wait` polls: both ends of the collective are the caller's stream.
                stream.record_marker(&self.marks.end[0]).map_err(g)?;
                stream.record_marker(&self.marks.end[1]).map_err(g)
            });
        if !capturing {
            self.queued += 1;
        }
        self.one_kernel_log.queued(what, capturing);
        if let Err(e) = &queued {
            self.abort
                .abort(&format!("queueing a collective failed: {e}"));
        }
        queued
    }

    /// A guarded wait of the streams that gave up at its deadline (it set the stop word
    /// itself: inside a CUDA graph no host waits), as the error to report.
    fn guard_timeout(&self) -> Option<Error> {
        let stop = self.abort.shared.stop.as_ref()?;
        stop.timed_out().then(|| Error::Timeout {
            waiting_for: "a peer's flag inside a ring collective (a guarded wait on this \
                          rank's GPU gave up; its stop word now ends every wait)"
                .into(),
            rank: None,
            after: self.wait_timeout.unwrap_or_default(),
        })
    }

    /// What the one-kernel path's blocks latched, as the error to report (once the streams
    /// have passed every collective queued).
    fn one_kernel_failure(&self) -> Option<Error> {
        let kernel = self.held.as_ref()?.one_kernel.as_ref()?;
        let failed = kernel.failure()?;
        let what = self.one_kernel_log.name(failed.collective);
        // The kernels name job ranks; on one host (the only place the path runs) the ring
        // order is the rank order, so `self.rank` is this rank's too.
        Some(match failed.failure {
            OneKernelFailure::Aborted { peer } if peer == self.rank => Error::Aborted {
                reason: format!("{what}: this rank had aborted before it arrived"),
            },
            OneKernelFailure::Aborted { peer } => Error::Aborted {
                reason: format!("{what}: stopped while waiting for rank {peer}"),
            },
            OneKernelFailure::Timeout { peer } => Error::Timeout {
                waiting_for: format!("its arrival at {what}"),
                rank: Some(peer),
                after: kernel.timeout(),
            },
            OneKernelFailure::Disagreement { peer } => Error::Disagreement {
                rank: self.rank,
                peer,
                ours: what,
                theirs: "another collective (its descriptor or its number differs)".into(),
            },
        })
    }

    /// Queues `prog` on the send and receive streams between the caller's `stream` and back.
    /// Every flag value is relative to the streams' guard counters (see
    /// `nodetour_core::transport::gpu::Counted`), which each stream advances at its end of the
    /// collective: so `capturing` (into a CUDA graph) changes only which events order the
    /// streams; each replay is then the next collective.
    #[allow(clippy::too_many_arguments)]
    fn queue(
        &mut self,
        buffer: &DeviceBuffer,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
        steps: u32,
        prog: &StreamProgram,
        (cells, desc_value): ((u32, u32), u32),
        capturing: bool,
        replayable: Replayable,
    ) -> Result<()> {
        let (sends, recvs) = (&prog.sends, &prog.recvs);
        let g = |e| gpu_error("queueing the collective", e);
        let context = self.context.clone();
        let marks = if capturing {
            &mut self.capture_marks
        } else {
            &mut self.marks
        };
        marks.grow(&context, sends.len(), recvs.len()).map_err(g)?;
        let marks = if capturing {
            &self.capture_marks
        } else {
            &self.marks
        };
        let h = self.held.as_ref().expect("checked by the caller");
        let links = h.links.as_ref().expect("checked by the caller");
        let kernels = &h.kernels;
        let [send_guard, recv_guard] = h.guards.as_ref().expect("a ring with links has guards");
        let slots = links.slots;
        let (send_align, recv_align) = (
            if replayable.send { slots } else { 1 },
            if replayable.recv { slots } else { 1 },
        );
        // Values relative to where the collective's counters start (the guards add theirs).
        let (s0, r0) = (prog.start.sent as u32, prog.start.received as u32);
        stream.record_marker(&marks.start).map_err(g)?;
        h.send.wait_marker(&marks.start).map_err(g)?;
        h.recv.wait_marker(&marks.start).map_err(g)?;
        // Agreement before anything is used: the send stream tells the next rank what this
        // collective is just before its first chunk's ready flag (so the next rank's wait for
        // it costs no extra hand-off), and the receive stream reads no chunk of the previous
        // rank's before it said the same (see queue_recv). A rank that sends nothing says it
        // at the start. Every hand-off is guarded by the stop word (see the module's doc).
        let tell = FlagValue::cell(&*links.ends.next, cells.0, cells.1, desc_value);
        if sends.is_empty() {
            enqueue_wait(&h.send, kernels, send_guard, None, false, None).map_err(g)?;
            enqueue_signal(&h.send, kernels, send_guard, tell, None).map_err(g)?;
        }
        let size = dtype.size();
        let slot_at = |slot: u32| slot as usize * links.slot_bytes;
        // Step by step, so that every marker wait is queued after the record it refers to.
        let (mut si, mut ri) = (0, 0);
        for step in 0..steps {
            while let Some(s) = sends.get(si).filter(|s| s.step == step) {
                if let Some(j) = s.after_recv {
                    h.send.wait_marker(&marks.recvs[j]).map_err(g)?;
                }
                let send = &h.send;
                let off = s.elements.start as usize * size;
                let len = (s.elements.end - s.elements.start) as usize * size;
                let at = slot_at(s.slot);
                let ready = FlagValue::chunks(
                    &*links.next_flags,
                    flag::READY,
                    s.ready.wrapping_sub(s0),
                    send_align,
                );
                // Wait for the slot's credit (or, for a slot never used, only read the stop
                // word), then one kernel copies and stores the ready flag (the first chunk's
                // carries the descriptor word just before it).
                let credit = s.wait_released.map(|v| {
                    FlagValue::chunks(
                        &*links.flags as &dyn FlagPage,
                        flag::RELEASED,
                        v.wrapping_sub(s0),
                        send_align,
                    )
                });
                enqueue_wait(send, kernels, send_guard, credit, false, None).map_err(g)?;
                let (first, second) = if si == 0 {
                    (tell, Some(ready))
                } else {
                    (ready, None)
                };
                let guard = send_guard;
                match &links.outgoing {
                    Outgoing::CudaIpc(o) => o.enqueue_send(
                        send, kernels, guard, buffer, off, at as u64, len, first, second,
                    ),
                    staged => {
                        let o: &dyn StagedSend = match staged {
                            Outgoing::Shm(o) => o,
                            Outgoing::Net(o) => o,
                            Outgoing::CudaIpc(_) => unreachable!("matched above"),
                        };
                        o.enqueue_send(send, kernels, guard, buffer, off, at, len, first, second)
                    }
                }
                .map_err(g)?;
                send.record_marker(&marks.sends[si]).map_err(g)?;
                si += 1;
            }
            while let Some(r) = recvs.get(ri).filter(|r| r.step == step) {
                // Nothing of the previous rank's lands in this rank's buffer before it has said
                // it calls the same collective: the first receive waits for its descriptor word
                // too.
                let desc = (ri == 0)
                    .then(|| FlagValue::cell(&*links.ends.mine, cells.0, cells.1, desc_value));
                self.queue_recv(links, r, buffer, dtype, op, desc, marks, (r0, recv_align))?;
                h.recv.record_marker(&marks.recvs[ri]).map_err(g)?;
                ri += 1;
            }
        }
        // Each stream's end of the collective: its counters move past it (for the next
        // collective, or the next replay).
        let chunks = |n: usize| {
            u32::try_from(n).map_err(|_| Error::InvalidArgument {
                reason: format!("{n} chunks in one collective"),
            })
        };
        send_guard
            .enqueue_advance(&h.send, kernels, send_align, chunks(sends.len())?)
            .map_err(g)?;
        recv_guard
            .enqueue_advance(&h.recv, kernels, recv_align, chunks(recvs.len())?)
            .map_err(g)?;
        h.send.record_marker(&marks.end[0]).map_err(g)?;
        h.recv.record_marker(&marks.end[1]).map_err(g)?;
        stream.wait_marker(&marks.end[0]).map_err(g)?;
        stream.wait_marker(&marks.end[1]).map_err(g)
    }

    /// Queues receive `r` (values relative to `r0`, the guard's chunk counter rounded up to
    /// `align` added on the GPU).
    #[allow(clippy::too_many_arguments)]
    fn queue_recv(
        &self,
        links: &StreamLinks,
        r: &RecvOp,
        buffer: &DeviceBuffer,
        dtype: DataType,
        op: ReduceOp,
        desc: Option<FlagValue>,
        marks: &Marks,
        (r0, align): (u32, u32),
    ) -> Result<()> {
        let g = |e| gpu_error("queueing the collective", e);
        let s = &self.h().recv;
        let kernels = &self.h().kernels;
        let [_, guard] = self
            .h()
            .guards
            .as_ref()
            .expect("a ring with links has guards");
        let size = dtype.size();
        if let Some(i) = r.after_send {
            s.wait_marker(&marks.sends[i]).map_err(g)?;
        }
        let ready = FlagValue::chunks(
            &*links.flags,
            flag::READY,
            r.wait_ready.wrapping_sub(r0),
            align,
        );
        match desc {
            Some(d) => enqueue_wait(s, kernels, guard, Some(d), true, Some(ready)),
            None => enqueue_wait(s, kernels, guard, Some(ready), false, None),
        }
        .map_err(g)?;
        let off = r.elements.start as usize * size;
        let n = (r.elements.end - r.elements.start) as usize;
        let at = r.slot as usize * links.slot_bytes;
        // Credit back to the previous rank (skipped when the wait ended on the stop word: what
        // an aborted rank's streams write is only its own memory).
        let credit = FlagValue::chunks(
            &*links.prev_flags,
            flag::RELEASED,
            r.released.wrapping_sub(r0),
            align,
        );
        let release = |s: &GpuStream| enqueue_signal(s, kernels, guard, credit, None).map_err(g);
        // The last reduce-scatter step of an average divides what it reduced.
        let divide = |average: bool| {
            if !average {
                return Ok(());
            }
            kernels
                .average(s, dtype, buffer, off, n, self.world)
                .map_err(g)
        };
        let gpu_slots: Option<&DeviceBuffer> = match &links.incoming {
            Incoming::CudaIpc(slot) => Some(slot.buffer()),
            Incoming::NetGpu(slot) => Some(slot.buffer()),
            Incoming::NetDirect(slots) => slots.region().device_buffer(),
            _ => None,
        };
        match (gpu_slots, &links.incoming, r.kind) {
            (Some(src), _, RecvKind::Reduce { average }) => {
                let src = ChunkSource::Gpu(src, at);
                enqueue_reduce_then_signal(
                    s, kernels, guard, dtype, op, buffer, off, src, n, credit,
                )
                .map_err(g)?;
                divide(average)?;
            }
            (Some(src), _, RecvKind::Copy) if n * size <= links.copy_kernel_max => {
                let src = ChunkSource::Gpu(src, at);
                enqueue_copy_then_signal(s, kernels, guard, buffer, off, src, n * size, credit)
                    .map_err(g)?;
            }
            (Some(src), _, RecvKind::Copy) => {
                s.copy(buffer, off, src, at, n * size).map_err(g)?;
                release(s)?;
            }
            (None, staged, kind) => {
                let (slots, scratch): (&dyn StagedReceive, &DeviceBuffer) = match staged {
                    Incoming::Shm { slots, scratch } => (slots, scratch),
                    Incoming::Net { slots, scratch } => (slots, scratch),
                    Incoming::CudaIpc(_) | Incoming::NetGpu(_) | Incoming::NetDirect(_) => {
                        unreachable!("matched above (direct slots are checked GPU memory)")
                    }
                };
                match kind {
                    RecvKind::Reduce { average } if n * size <= links.host_read_max => {
                        // One kernel reads the slot over PCIe, reduces, and credits the slot.
                        let src = ChunkSource::Slots(slots, at);
                        enqueue_reduce_then_signal(
                            s, kernels, guard, dtype, op, buffer, off, src, n, credit,
                        )
                        .map_err(g)?;
                        divide(average)?;
                    }
                    RecvKind::Reduce { average } => {
                        slots
                            .enqueue_copy_out(s, scratch, 0, at, n * size)
                            .map_err(g)?;
                        release(s)?;
                        kernels
                            .reduce(s, dtype, op, buffer, off, scratch, 0, n)
                            .map_err(g)?;
                        divide(average)?;
                    }
                    RecvKind::Copy => {
                        slots
                            .enqueue_copy_out(s, buffer, off, at, n * size)
                            .map_err(g)?;
                        release(s)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits until every collective queued so far has finished on this rank, at most `timeout`
    /// (spins briefly, then sleeps in growing steps up to 1 ms; on expiry the ring is aborted),
    /// asking `alive` (the job's liveness check, e.g. the bootstrap's `check`) between polls: a lost rank aborts the ring at once and is named in the error.
    pub fn wait_alive(
        &mut self,
        timeout: Duration,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        self.wait_until(None, timeout, alive)
    }

    /// [`Self::wait_alive`], and first until `stream` has run everything queued on it so far:
    /// graph replays of this ring's collectives included, which the host does not see
    /// launched. Their outcome is what the GPU latched (a guarded wait that timed out, a
    /// one-kernel block that failed: the stop word keeps it) and the neighbours' notices, each
    /// of which taints every replay not yet confirmed by a wait.
    pub fn wait_stream(
        &mut self,
        stream: &GpuStream,
        timeout: Duration,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let g = |e| gpu_error("marking the caller's stream", e);
        let done = GpuEvent::marker(stream.context()).map_err(g)?;
        stream.record_marker(&done).map_err(g)?;
        self.wait_until(Some(&done), timeout, alive)
    }

    /// Whether any collective of this ring was captured into a CUDA graph.
    fn captured(&self) -> bool {
        self.ring_captured || self.one_kernel_log.captured
    }

    fn wait_until(
        &mut self,
        stream_done: Option<&GpuEvent>,
        timeout: Duration,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let g = |e| gpu_error("waiting for the collective", e);
        let spin_until = Instant::now() + Duration::from_micros(50);
        let mut nap = Duration::from_micros(10);
        let mut lost = None;
        loop {
            // A network link's thread may still be carrying the streams' last chunks (unless it
            // stopped: a failure or an abort, which the error says).
            let carried = self.net().is_none_or(|n| {
                n.all_sent() || n.failure().is_some() || self.abort.error().is_some()
            });
            if carried
                && self.marks.end[0].is_complete().map_err(g)?
                && self.marks.end[1].is_complete().map_err(g)?
                && stream_done
                    .map_or(Ok(true), GpuEvent::is_complete)
                    .map_err(g)?
            {
                // Read the neighbours' notices once more after the streams finished: a
                // neighbour that aborted told us before its stop word ended its waits.
                let failed = self.abort.error();
                let ended = self.abort.read_notice(self.queued, self.captured());
                if let Some((e, _)) = &ended {
                    // Ended by a neighbour: nothing more runs on this ring.
                    self.abort.abort_with(e.clone());
                }
                // The first error this ring ended with (its own abort, a lost rank, a
                // neighbour's notice) names the cause; later ones are its echoes. A notice for
                // a collective after the ones queued here leaves them correct.
                let tainted = ended.and_then(|(e, tainted)| tainted.then_some(e));
                // A peer that broke the link's protocol may have written a slot it held no
                // credit for: nothing it sent is trusted.
                let broke = self
                    .net()
                    .filter(|n| n.broke_protocol())
                    .and_then(NetLink::failure);
                // A one-kernel collective that a block gave up on (its peers learn through the
                // end notices of the abort below).
                let kernel = self.one_kernel_failure().or_else(|| self.guard_timeout());
                if let Some(e) = &kernel {
                    self.abort.abort_with(e.clone());
                }
                return match failed.or(lost).or(tainted).or(broke).or(kernel) {
                    Some(e) => Err(e),
                    None => {
                        self.abort.confirm(self.queued);
                        Ok(())
                    }
                };
            }
            if lost.is_none() {
                if let Some(e) = self.abort.read_disagreement() {
                    // Nothing of the previous rank's collective has landed (the receive stream
                    // waits for an equal descriptor): abort, tell the neighbours, drain.
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                } else if let Some((e, true)) = self.abort.read_notice(self.queued, self.captured())
                {
                    // A collective queued here is tainted: abort (which tells the other
                    // neighbour) and keep polling; the streams drain now that the stop word
                    // ends every wait. (A notice for a later collective waits for these.)
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                } else if let Some(e) = self.net().and_then(NetLink::failure) {
                    // A network link failed (its peer is gone, or broke the protocol).
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                } else if let Err(e) = alive() {
                    let e = Error::from(e);
                    self.abort.abort_with(e.clone());
                    lost = Some(e);
                }
            }
            let now = Instant::now();
            if now >= deadline {
                self.abort
                    .abort("a collective did not finish before its deadline");
                if let Some(e) = lost {
                    return Err(e);
                }
                return Err(self.name_the_deadline(timeout));
            }
            if now >= spin_until {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(Duration::from_millis(1));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// The error of a wait whose deadline passed (the ring already aborted): the stop word now
    /// ends every wait on the GPU, so the streams drain within moments; once they have (at
    /// most [`DEADLINE_DRAIN`]), what the GPU saw names the cause: a one-kernel block that
    /// timed out, or was stopped while it waited, names the rank it waited for and the
    /// collective.
    fn name_the_deadline(&self, timeout: Duration) -> Error {
        let until = Instant::now() + DEADLINE_DRAIN;
        while Instant::now() < until
            && !(self.marks.end[0].is_complete().unwrap_or(true)
                && self.marks.end[1].is_complete().unwrap_or(true))
        {
            std::thread::sleep(Duration::from_millis(1));
        }
        let generic = Error::Timeout {
            waiting_for: "the GPU ring's streams (aborted: a peer stopped?)".into(),
            rank: None,
            after: timeout,
        };
        let Some(kernel) = self.held.as_ref().and_then(|h| h.one_kernel.as_ref()) else {
            return generic;
        };
        let Some(failed) = kernel.failure() else {
            return generic;
        };
        let what = self.one_kernel_log.name(failed.collective);
        match failed.failure {
            OneKernelFailure::Timeout { peer } | OneKernelFailure::Aborted { peer }
                if peer != self.rank =>
            {
                Error::Timeout {
                    waiting_for: format!("its arrival at {what}"),
                    rank: Some(peer),
                    after: timeout,
                }
            }
            _ => self.one_kernel_failure().unwrap_or(generic),
        }
    }

    fn net(&self) -> Option<&NetLink> {
        self.held.as_ref()?.links.as_ref()?.net.as_ref()
    }

    /// A handle that aborts this ring from another thread (a watchdog, the training loop).
    pub fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }

    /// Checks the arguments; whether `stream` is being captured into a CUDA graph.
    fn check(
        &self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        stream: &GpuStream,
    ) -> Result<bool> {
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("{count} elements of {dtype:?} overflow the address space"),
            })?;
        if buffer.len() < bytes {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "the buffer holds {} bytes, the collective needs {bytes}",
                    buffer.len()
                ),
            });
        }
        if !nodetour_core::cuda::same_context(buffer.context(), &self.context) {
            return Err(Error::InvalidArgument {
                reason: format!("the buffer is not on rank {}'s GPU", self.rank),
            });
        }
        if !nodetour_core::cuda::same_context(stream.context(), &self.context) {
            return Err(Error::InvalidArgument {
                reason: format!("the stream is not on rank {}'s GPU", self.rank),
            });
        }
        stream
            .is_capturing()
            .map_err(|e| gpu_error("asking about stream capture", e))
    }
}

/// Aborts a [`GpuRing`] from any thread. Cheap to clone.
#[derive(Clone)]
pub struct AbortHandle {
    shared: Arc<AbortState>,
}

struct AbortState {
    failed: Mutex<Option<Error>>,
    // The first collective this rank has not seen finish (what an end notice names).
    confirmed: AtomicU64,
    // Set once on abort (after the notices): ends every queued wait, skips every guarded write.
    stop: Option<StopWord>,
    ends: Option<EndPages>,
    // (ring position, ranks in the ring)
    position: (u32, u32),
    // Queued, not yet confirmed collectives: (sequence number, descriptor word, descriptor).
    pending: Mutex<std::collections::VecDeque<(u64, u32, Descriptor)>>,
    desc_cells: (u32, u32),
}

/// The descriptor cells a ring with `slots` slots per link uses, as (first, count), in half
/// `half` of the cells: the previous rank's send stream is at most `slots` collectives ahead of
/// this rank's receive stream (each collective takes a slot), so `slots + 2` cells are never
/// overwritten before they are read.
pub(crate) fn desc_cells(slots: u32, half: u32) -> (u32, u32) {
    let per_half = flag::DESC_CELLS / 2;
    (
        flag::DESC_BASE + half.min(1) * per_half,
        (slots + 2).min(per_half),
    )
}

/// The cell of collective `seq` among `cells` (first, count).
fn desc_cell((first, count): (u32, u32), seq: u64) -> u32 {
    first + (seq % u64::from(count)) as u32
}

/// The word a descriptor cell holds for collective `seq` with tag `tag` (never 0).
fn desc_word(seq: u64, tag: u16) -> u32 {
    ((seq as u32 & 0xffff) << 16) | 0x8000 | u32::from(tag & 0x7fff)
}

/// The value of an end notice for collective `seq` (never 0, which means "none").
fn notice_value(seq: u64) -> u32 {
    (seq as u32).wrapping_add(1).max(1)
}

impl AbortHandle {
    /// Gives up on every collective in flight. First tells both neighbours (an end notice in
    /// their host flag pages naming the first collective this rank has not seen finish), then
    /// sets the ring's stop word: every wait its streams queued ends (for good: nothing clears
    /// the word, whatever a peer stores later), and no write into a peer's memory starts. The
    /// streams drain, writing only this rank's own memory (the buffers of the collectives in
    /// flight hold garbage); the ring then refuses further collectives (the first error,
    /// typed). Neighbours stop at their next poll and pass the notice on. Plain host stores
    /// only: no CUDA call, nothing that waits.
    pub fn abort(&self, reason: &str) {
        self.abort_with(Error::Aborted {
            reason: reason.to_owned(),
        });
    }

    fn abort_with(&self, error: Error) {
        if let Ok(mut f) = self.shared.failed.lock() {
            f.get_or_insert(error.clone());
        }
        if let Some(ends) = &self.shared.ends {
            // Before the stop word ends the waits: from here on the neighbours know not to
            // trust any collective from the named one on, and why (the cause first: a
            // neighbour reads it once it sees the notice).
            let cause = error.cause_to_tell(self.shared.position.0).to_word();
            let _ = ends.next.store(flag::CAUSE_BY_PREV, cause);
            let _ = ends.prev.store(flag::CAUSE_BY_NEXT, cause);
            std::sync::atomic::fence(Ordering::SeqCst);
            let v = notice_value(self.shared.confirmed.load(Ordering::Acquire));
            let _ = ends.next.store(flag::ENDED_BY_PREV, v);
            let _ = ends.prev.store(flag::ENDED_BY_NEXT, v);
            std::sync::atomic::fence(Ordering::SeqCst);
        }
        if let Some(stop) = &self.shared.stop {
            if let Err(e) = stop.set() {
                tracing::error!(error = %e, "could not set the GPU ring's stop word");
            }
        }
    }

    /// Sets the stop word (unless the GPU set it first) and nothing else: no end notice, no
    /// error recorded. For a ring closing in order.
    fn stop_quietly(&self) {
        if let Some(stop) = &self.shared.stop {
            if let Err(e) = stop.set() {
                tracing::error!(error = %e, "could not set the GPU ring's stop word");
            }
        }
    }

    /// The error the ring ended with, if it did.
    pub fn error(&self) -> Option<Error> {
        self.shared.failed.lock().ok().and_then(|f| f.clone())
    }

    /// Reads the neighbours' end notices (no side effect): the error, and whether it names a
    /// collective before `queued` (one this rank has queued and not seen finish, whose result
    /// may be garbage) rather than a later one (the ones queued here finish correctly: the
    /// neighbour saw its part of them finish before it ended).
    /// With `captured` (collectives of this ring were captured into CUDA graphs, whose replays
    /// the host does not count) every notice taints: the host cannot tell which replays it
    /// covers.
    fn read_notice(&self, queued: u64, captured: bool) -> Option<(Error, bool)> {
        let ends = self.shared.ends.as_ref()?;
        let (me, world) = self.shared.position;
        let confirmed = self.shared.confirmed.load(Ordering::Acquire);
        for (word, cause_word, peer) in [
            (
                flag::ENDED_BY_PREV,
                flag::CAUSE_BY_PREV,
                (me + world - 1) % world,
            ),
            (flag::ENDED_BY_NEXT, flag::CAUSE_BY_NEXT, (me + 1) % world),
        ] {
            let v = ends.mine.read(word).unwrap_or(0);
            if v == 0 {
                continue;
            }
            // The named collective (32 bits on the wire), placed near the first one not yet
            // confirmed here: a neighbour is never 2^31 collectives away.
            let delta = i64::from(v.wrapping_sub(1).wrapping_sub(confirmed as u32) as i32);
            let seq = (confirmed as i64 + delta).max(0) as u64;
            std::sync::atomic::fence(Ordering::SeqCst);
            let cause = ends
                .mine
                .read(cause_word)
                .ok()
                .and_then(RootCause::from_word)
                .filter(|c| c.rank < world)
                .unwrap_or(RootCause::new(peer, CauseKind::Failed));
            let e = Error::PeerFailed { peer, seq, cause };
            return Some((e, seq < queued || captured));
        }
        None
    }

    fn confirm(&self, queued: u64) {
        self.shared.confirmed.store(queued, Ordering::Release);
        if let Ok(mut p) = self.shared.pending.lock() {
            while p.front().is_some_and(|(seq, _, _)| *seq < queued) {
                p.pop_front();
            }
        }
    }

    /// Records collective `seq` as queued, with its descriptor word.
    fn expect(&self, seq: u64, word: u32, what: Descriptor) {
        if let Ok(mut p) = self.shared.pending.lock() {
            p.push_back((seq, word, what));
        }
    }

    /// A collective queued here whose descriptor cell holds the previous rank's word for the
    /// same sequence number with another tag: the ranks disagree on what it is.
    fn read_disagreement(&self) -> Option<Error> {
        let ends = self.shared.ends.as_ref()?;
        let pending = self.shared.pending.lock().ok()?;
        let (me, world) = self.shared.position;
        for (seq, word, ours) in pending.iter() {
            let cell = desc_cell(self.shared.desc_cells, *seq);
            let got = ends.mine.read(cell).unwrap_or(0);
            if got == 0 || got == *word || got >> 16 != word >> 16 {
                continue;
            }
            let mut b = [0u8; crate::descriptor::ENCODED_LEN];
            let theirs = match ends
                .mine
                .read_bytes(cell, 32, &mut b)
                .map(|()| Descriptor::decode(&b))
            {
                Ok(Ok(d)) if d.seq == ours.seq => d.to_string(),
                _ => format!(
                    "collective #{seq} with descriptor tag {:#06x}",
                    got & 0x7fff
                ),
            };
            return Some(Error::Disagreement {
                rank: me,
                peer: (me + world - 1) % world,
                ours: ours.to_string(),
                theirs,
            });
        }
        None
    }
}

impl Drop for GpuRing {
    fn drop(&mut self) {
        if let Err(e) = self.shut_down(TEARDOWN_DEADLINE) {
            tracing::warn!(error = %e, "dropping a GPU ring");
        }
    }
}

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
use nodetour_core::cuda::reduce::{At, NtScale, PreMul, ReduceKernels, Reduction};
use nodetour_core::cuda::{GpuEvent, GpuStream};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::TransportKind;
use nodetour_core::transport::gpu::{
    ChunkSource, CudaIpcSender, FlagPage, FlagValue, Flags, GpuSlot, Guarded, LinkSlots, ShmSender,
    ShmSlot, StagedReceive, StagedSend, StopWord, StreamGuard, enqueue_copy_then_signal,
    enqueue_reduce_then_signal, enqueue_signal, enqueue_wait,
};
use nodetour_core::transport::one_kernel::{OneKernel, OneKernelFailure};

use crate::call::RingCall;
use crate::cause::{CauseKind, RootCause};
use crate::descriptor::{Algorithm, Descriptor};
use crate::error::{Error, Result};
use crate::net_link::NetLink;
use crate::plan::{Plan, Shape, pipelined_chunk_bytes};
use crate::reduce::ReduceOp;
use crate::stream_plan::{
    LinkCounters, RecvKind, RecvOp, Replayable, SendOp, StreamProgram, program_exchange_on,
    program_on,
};

mod abort;
mod links;
mod one_kernel;
mod queue;
mod teardown;
mod wait;

pub(crate) use crate::flag;
pub(crate) use abort::{AbortHandle, desc_cells};
use abort::{AbortState, desc_cell, desc_word};
pub(crate) use links::{EndPages, Incoming, Outgoing, StreamLinks};
use one_kernel::OneKernelLog;
pub(crate) use teardown::TEARDOWN_DEADLINE;

/// Default slot size for cuda-ipc: large chunks keep the per-chunk hand-off small beside a
/// chunk's transfer at NVLink speed. Measured on two H200s (two processes, f32 sum, 1 GiB,
/// against NCCL in the same run): 2 × 32 MiB 1.05x, 4 × 16 MiB 0.98x, 8 × 8 MiB 0.82x,
/// 16 × 4 MiB 0.64x (host-memory flags).
pub(crate) const IPC_SLOT_BYTES: usize = 32 << 20;
/// Default slots per cuda-ipc link.
pub(crate) const IPC_SLOTS: u32 = 2;
/// Default slot size for shm (host memory is slower: 8 MiB is ~200 µs of PCIe).
pub(crate) const SHM_SLOT_BYTES: usize = 8 << 20;
/// Default slots per shm link.
pub(crate) const SLOTS: u32 = 4;
/// The bound on slot memory per communicator (GPU and host each), by default.
pub(crate) const SLOT_MEMORY_MAX: usize = 64 << 20;

/// One rank of a ring of processes, one GPU each.
///
/// The layer below [`crate::comm::Communicator`] (its device path on one host); runtimes use
/// the communicator, tools that compare paths side by side form this through
/// [`crate::comm::form`].
pub(crate) struct GpuRing {
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
    /// The next collective's number among every collective of its communicator
    /// ([`Descriptor::call`]), given by the communicator ([`GpuRing::number_next`]).
    call: u32,
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

/// `InvalidArgument` unless `l`'s slots are 1-127 of some bytes each, and its slot memory
/// (and, for staged links, its GPU scratch) holds them.
fn check_links(l: &StreamLinks) -> Result<()> {
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
    Ok(())
}

impl GpuRing {
    /// This rank (`rank` of `world`) on `context`'s GPU, with its links (`None` only for a
    /// ring of one). Compiles or loads the reduction kernels.
    pub(crate) fn new(
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
            check_links(l)?;
        }
        let g = |e| Error::gpu("setting up the GPU ring", e);
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
            call: 0,
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

    /// How long each guarded wait of the streams waits for a peer's word (`timeout`, the job's
    /// collective timeout): past it the wait sets the stop word itself, every later wait ends,
    /// and the next call or [`Self::wait_alive`] reports the timeout. The deadline that holds
    /// inside CUDA graphs, where no host waits; eager collectives have the host's too.
    pub(crate) fn set_wait_timeout(&mut self, timeout: Duration) {
        self.wait_timeout = Some(timeout);
        if let Some(guards) = self.held.as_mut().and_then(|h| h.guards.as_mut()) {
            for g in guards {
                g.set_timeout(Some(timeout));
            }
        }
    }

    /// Caps the blocks of the stream-ordered ring's reduce, copy and send kernels (0: none;
    /// see `ReduceKernels::with_max_blocks`). For collectives queued from now on.
    pub(crate) fn set_max_blocks(&mut self, blocks: u32) {
        if let Some(h) = self.held.as_mut() {
            h.kernels = h.kernels.clone().with_max_blocks(blocks);
        }
    }

    /// Two ranks run the allreduce as one exchange step ([`program_exchange_on`], the default)
    /// or, with `false`, as the two-step ring. Every rank must choose the same.
    pub(crate) fn set_two_rank_exchange(&mut self, on: bool) {
        self.exchange = on;
    }

    /// The stop word the ring's waits poll (`None` for a ring of one): what the one-kernel
    /// path's kernels poll too.
    pub(crate) fn stop_word(&self) -> Option<nodetour_core::transport::gpu::StopWord> {
        self.abort.shared.stop.clone()
    }

    /// The transport of the link to the next rank (`None` for a ring of one).
    pub(crate) fn kind(&self) -> Option<TransportKind> {
        let links = self.held.as_ref().and_then(|h| h.links.as_ref());
        links.map(StreamLinks::out_kind)
    }

    /// Which path each link takes and why it is shaped so (for the log).
    pub(crate) fn path(&self) -> String {
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
    /// Numbers the next collective queued here among every collective of the communicator
    /// (its descriptor carries it, so ranks that interleave host and device collectives
    /// differently disagree here).
    pub(crate) fn number_next(&mut self, call: u32) {
        self.call = call;
    }

    pub(crate) fn collective(
        &mut self,
        buffer: &DeviceBuffer,
        call: RingCall,
        stream: &GpuStream,
    ) -> Result<()> {
        self.ready_to_queue()?;
        let capturing = self.check(buffer, &call, stream)?;
        let bytes = call.bytes()?;
        let Some(links) = &self.h().links else {
            return self.one_rank(buffer, &call, stream);
        };
        if call.shape == Shape::AllReduce && bytes <= self.one_kernel_max && bytes > 0 {
            return self.one_kernel(buffer, &call, stream, capturing);
        }
        if capturing && links.net.is_some() {
            return Err(Error::Unsupported {
                reason: format!(
                    "the stream is being captured into a CUDA graph: this {:?} of {bytes} \
                     bytes takes a ring with a network link, whose progress thread cannot \
                     follow replays (only allreduces on the one-kernel path, at most {} bytes, \
                     or rings of one host can be captured)",
                    call.shape, self.one_kernel_max
                ),
            });
        }
        let exchange = self.world == 2 && self.exchange && call.shape == Shape::AllReduce;
        let plan = self.plan(&call, exchange)?;
        let algorithm = if exchange {
            Algorithm::StreamExchange
        } else {
            Algorithm::StreamRing
        };
        let what = call.descriptor(algorithm, self.queued, self.call);
        let desc = self.announce(&what, capturing);
        let links = self.h().links.as_ref().expect("checked above");
        let replayable = Replayable {
            send: !matches!(links.outgoing, Outgoing::Net(_)),
            recv: matches!(links.incoming, Incoming::CudaIpc(_) | Incoming::Shm { .. }),
        };
        let average = call.op == ReduceOp::Avg;
        let (prog, steps) = if exchange {
            let p = program_exchange_on(&plan, average, &mut self.counters, replayable);
            (p, 1)
        } else {
            let p = program_on(&plan, self.rank, average, &mut self.counters, replayable);
            (p, plan.steps())
        };
        if let Some(net) = self.net() {
            // Before the streams can run: the progress thread learns each chunk's length.
            let size = call.dtype.size();
            let bytes = |e: &std::ops::Range<u64>| (e.end - e.start) as usize * size;
            net.plan(
                prog.sends.iter().map(|s| bytes(&s.elements)),
                prog.recvs.iter().map(|r| bytes(&r.elements)),
            );
        }
        self.ring_captured |= capturing;
        // From here the peers count these chunks: a failure to queue breaks the ring.
        let queued = self.queue(
            buffer, &call, stream, steps, &prog, desc, capturing, replayable,
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

    /// A ring of one rank: the sum, min, max, product and average of one value; a
    /// PreMulSum's is the value multiplied.
    fn one_rank(&self, buffer: &DeviceBuffer, call: &RingCall, stream: &GpuStream) -> Result<()> {
        match call.op.scalar().filter(|_| call.reduces()) {
            Some(scalar) => {
                let whole = At::new(buffer, 0);
                self.h()
                    .kernels
                    .scale(stream, call.dtype, scalar, whole, whole, call.count)
                    .map_err(|e| Error::gpu("queueing a PreMulSum of one rank", e))
            }
            None => Ok(()),
        }
    }

    /// The chunks of `call` on this ring's links: the largest piece one chunk sequence
    /// covers is the whole buffer for an exchange or a broadcast, else a segment (the ring's
    /// blocks).
    fn plan(&self, call: &RingCall, exchange: bool) -> Result<Plan> {
        let links = self.h().links.as_ref().expect("a ring of several ranks");
        let (count, size) = (call.count as u64, call.dtype.size() as u64);
        let segment_bytes = match call.shape {
            _ if exchange => count * size,
            Shape::Broadcast { .. } => count * size,
            _ => count.div_ceil(u64::from(self.world)) * size,
        };
        let chunk_bytes =
            pipelined_chunk_bytes(links.slot_bytes as u64, links.pipeline, segment_bytes);
        Plan::new(self.world, count, size as u32, chunk_bytes, links.slots)?.with_shape(call.shape)
    }

    /// The descriptor cell and word of the collective `what` (the guards' collective counters
    /// name them on the GPU). The host reads the cells (to explain a disagreement) only while
    /// it knows those counters: until a ring collective is captured (replays move them
    /// unseen); until then `what` is stored for the next rank and expected from the previous.
    fn announce(&mut self, what: &Descriptor, capturing: bool) -> ((u32, u32), u32) {
        let links = self.h().links.as_ref().expect("a ring of several ranks");
        let cells = desc_cells(links.slots, links.desc_half);
        if !capturing && !self.ring_captured {
            let ring_seq = self.ring_queued;
            let cell = desc_cell(cells, ring_seq);
            // For the next rank's error message, should it disagree (a host store, no CUDA call).
            let _ = links.ends.next.store_bytes(cell, 32, &what.encode());
            self.abort
                .expect(ring_seq, desc_word(ring_seq, what.tag()), *what);
        }
        (cells, 0x8000 | u32::from(what.tag() & 0x7fff))
    }

    fn net(&self) -> Option<&NetLink> {
        self.held.as_ref()?.links.as_ref()?.net.as_ref()
    }

    /// A handle that aborts this ring from another thread (a watchdog, the training loop).
    pub(crate) fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }
}

//! The ring allreduce over host memory, on any host-driven transport (verbs, tcp, mem): the
//! schedule's actions become one-sided writes, CPU reductions and grants.
//!
//! Memory: the caller's buffer is copied into a registered work region (so nothing of the
//! caller's memory is registered or exposed) and back at the end; each rank receives into a slot
//! region of `slots × slot_bytes` it granted its previous rank. Notifications carry the
//! schedule's immediates (data) or, with the top bit set, a grant or an end notice (see
//! [`Notice`]).
//!
//! Slots: with two or more slots, collectives of even and odd epochs use separate halves, and a
//! rank that finishes a collective *releases* its half for the collective two later
//! ([`Notice::Release`], sent with its next write to that neighbour, which needs it only after
//! this rank started its next collective; after a failure, when that collective starts): a
//! collective starts with its first slots granted, and its first chunks leave without waiting a
//! round trip for grants, in the same system call as the rank's description. Slots reused within a collective are granted as they free up, each grant tagged with
//! a 15-bit tag of the collective's [`Descriptor`].
//!
//! Agreement: a rank that receives writes its whole descriptor to its previous rank first thing
//! ([`Notice::Describe`], 32 bytes into that rank's doorbell region), and a rank that sends
//! checks it against its own. Before the check only first-step chunks (the rank's own input)
//! may leave, and only in shapes where every rank's completion waits for a later chunk of every
//! other rank but one, each sent only after its sender's check (an allreduce, reduce-scatter or
//! all-gather whose segments all hold data): a rank that finishes then knows that every pair of
//! neighbours but one checked each other, which chains them all. Otherwise nothing leaves
//! before the check. A rank also finishes only after its own check. On a disagreement no rank
//! writes its buffer; chunks that landed early stay in slots.
//!
//! Waiting: the rank's thread reads its sockets itself while it runs a collective (no receive
//! thread between it and the kernel, see [`HostConnection::read_inline`]), holds small writes
//! back until it next looks for events (one system call for several), polls without blocking
//! for `NODETOUR_RING_SPIN_US` after each notification (yielding its CPU between looks where its
//! host has more ranks than CPUs), then blocks on both neighbours at once (one `poll(2)` over
//! their sockets or completion channels).
//!
//! Ending: a rank whose collective fails for any reason (a disagreement, an abort, a lost peer, a
//! timeout) sends an end notice with the collective's epoch to both neighbours, and a rank that
//! receives one fails the collective too and passes it on, so the whole ring learns within a
//! few notification latencies instead of at its deadline. Nothing is written to the caller's
//! buffer unless the collective finished.

use std::time::{Duration, Instant};

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::{At, ReduceKernels, Reduction};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::{Event, HostConnection, SlotGrant, SlotRegion, wait_any};

use crate::cause::{CauseKind, RootCause};
use crate::descriptor::{self, Descriptor};
use crate::error::{Error, Result};
use crate::plan::{Plan, Shape};
use crate::reduce::{DataType, ReduceOp, copy_scaled, finish_avg, reduce_into};
use crate::schedule::{Action, RingSchedule};

mod ending;
mod ops;
mod schedule;

pub(crate) use ops::GpuStaging;
use ops::{Chunk, ChunkOps, GpuOps, HostOps, REDUCE_BLOCK, gpu};

const GRANT_BIT: u32 = 1 << 31;
const END_BIT: u32 = 1 << 30;
const RELEASE: u32 = 4;
/// How long a rank that timed out waits for the rank it blames to say what it knows.
const END_GRACE: Duration = Duration::from_millis(250);
const DESCRIBE: u32 = 5;

/// Where a rank's next rank writes its descriptor in the rank's doorbell region (by epoch
/// parity: the next collective's description may land while this one runs).
const DESCRIPTOR_AT: usize = 0;
/// Where a rank keeps its own descriptor as the source of that write.
const DESCRIPTOR_SOURCE_AT: usize = 2 * descriptor::ENCODED_LEN;
/// The doorbell region holds both.
pub(crate) const BELL_BYTES: usize = 4 * descriptor::ENCODED_LEN;

/// A notification with the top bit set: `1 | 0 | tag_hi:7 | epoch:7 | tag_lo:8 | slot:8` for a
/// grant; `1 | 1 | tag_hi:7 | epoch:7 | tag_lo:8 | kind:8` for the others (a release's kind is 4,
/// a description's 5 with its tag; an end notice's kind is `0x10` + its cause's kind (1-5), and
/// its tag the rank at fault, [`END_RANKS`] of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Notice {
    /// The sender's descriptor of collective `epoch` was written with this notice (into our
    /// doorbell region); `tag` is its [`Descriptor::tag`].
    Describe {
        /// Collective generation.
        epoch: u8,
        /// [`Descriptor::tag`] of the sender's collective.
        tag: u16,
    },
    /// The sender's standing slots (its half of the slots for collectives of `epoch`'s parity)
    /// are free for collective `epoch`: it finished reading them two collectives before.
    Release {
        /// Collective generation the slots are released for.
        epoch: u8,
    },
    /// The sender may write our slot `slot`; `tag` is our descriptor's.
    Grant {
        /// Collective generation.
        epoch: u8,
        /// The slot.
        slot: u8,
        /// [`Descriptor::tag`] of the granting rank's collective.
        tag: u16,
    },
    /// The sender ended collective `epoch`: its own failure, or one it was told of and passes
    /// on (the rank at fault and what happened there, in ring positions).
    End {
        /// Collective generation.
        epoch: u8,
        /// The rank at fault and what happened there.
        cause: RootCause,
    },
}

/// Ring positions an end notice can name (15 bits); a ring of more ranks names the ones beyond
/// as [`CauseKind::Failed`] at the sender.
pub(crate) const END_RANKS: u32 = 1 << 15;
const END_KIND: u32 = 0x10;

impl Notice {
    /// Packs into a notification value.
    pub(crate) fn encode(self) -> u32 {
        match self {
            Notice::Grant { epoch, slot, tag } => {
                GRANT_BIT
                    | (u32::from(tag >> 8) & 0x7f) << 23
                    | (u32::from(epoch) & 0x7f) << 16
                    | u32::from(tag & 0xff) << 8
                    | u32::from(slot)
            }
            Notice::End { epoch, cause } => {
                let rank = cause.rank & (END_RANKS - 1);
                GRANT_BIT
                    | END_BIT
                    | (rank >> 8) << 23
                    | (u32::from(epoch) & 0x7f) << 16
                    | (rank & 0xff) << 8
                    | (END_KIND + cause.kind.code())
            }
            Notice::Release { epoch } => {
                GRANT_BIT | END_BIT | (u32::from(epoch) & 0x7f) << 16 | RELEASE
            }
            Notice::Describe { epoch, tag } => {
                GRANT_BIT
                    | END_BIT
                    | (u32::from(tag >> 8) & 0x7f) << 23
                    | (u32::from(epoch) & 0x7f) << 16
                    | u32::from(tag & 0xff) << 8
                    | DESCRIBE
            }
        }
    }

    /// Unpacks a notification with the top bit set (`None`: a data immediate, or an end notice
    /// with an unknown cause).
    pub(crate) fn decode(v: u32) -> Option<Notice> {
        if v & GRANT_BIT == 0 {
            return None;
        }
        let epoch = ((v >> 16) & 0x7f) as u8;
        let tag = (((v >> 23) & 0x7f) << 8 | ((v >> 8) & 0xff)) as u16;
        if v & END_BIT != 0 {
            return match v & 0xff {
                DESCRIBE => Some(Notice::Describe { epoch, tag }),
                RELEASE if tag == 0 => Some(Notice::Release { epoch }),
                k if k > END_KIND => {
                    let kind = CauseKind::from_code(k - END_KIND)?;
                    let cause = RootCause::new(u32::from(tag), kind);
                    Some(Notice::End { epoch, cause })
                }
                _ => None,
            };
        }
        Some(Notice::Grant {
            epoch,
            slot: v as u8,
            tag,
        })
    }
}

/// Sizes and limits of the host ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostRingOptions {
    /// Bytes per slot (one chunk).
    pub slot_bytes: usize,
    /// Slots per receiver.
    pub slots: u32,
    /// No progress for this long fails the collective.
    pub timeout: Duration,
    /// After each notification, how long the rank looks for the next without blocking
    /// (`NODETOUR_RING_SPIN_US`) before it waits in the kernel.
    pub spin: Duration,
    /// While it looks, the rank gives up its CPU after each look (`sched_yield`): where its
    /// host runs more ranks than CPUs, the neighbour it waits for may need that CPU (as MPI
    /// yields when oversubscribed), and a rank that blocked would need a wake-up instead.
    pub spin_yields: bool,
}

impl HostRingOptions {
    /// The default slots, with the timeout of `config` (`NODETOUR_TIMEOUT_MS`).
    pub(crate) fn from_config(config: &nodetour_core::Config) -> Self {
        HostRingOptions {
            slot_bytes: 1 << 20,
            slots: 4,
            timeout: config.timeout,
            spin: config.ring_spin,
            spin_yields: false,
        }
    }
}

impl Default for HostRingOptions {
    /// The default slots, timeout and spin (the declared defaults; no environment read).
    fn default() -> Self {
        Self::from_config(&nodetour_core::Config::default())
    }
}

/// What one host collective moves: its shape, the ring buffer's element count (the whole buffer,
/// every rank's blocks together), type and reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Staged {
    /// The collective.
    pub shape: Shape,
    /// Elements in the ring's buffer.
    pub count: u64,
    /// Their type.
    pub dtype: DataType,
    /// The reduction (reduce-scatter and allreduce; ignored otherwise).
    pub op: ReduceOp,
}

#[cfg(test)]
fn whole_elements(len: usize, dtype: DataType) -> Result<()> {
    if !len.is_multiple_of(dtype.size()) {
        return Err(Error::Plan {
            reason: format!("{len} bytes is not a whole number of {dtype:?} elements"),
        });
    }
    Ok(())
}

/// The connections of one rank to its ring neighbours.
pub(crate) enum Links<'a> {
    /// Two ranks: one connection carries both directions.
    One(&'a mut dyn HostConnection),
    /// Three or more ranks (or two with a connection per direction).
    Two {
        /// To rank + 1 (we write its slots, it grants us slots).
        next: &'a mut dyn HostConnection,
        /// To rank − 1 (it writes our slots, we grant it slots).
        prev: &'a mut dyn HostConnection,
    },
}

/// One rank's side of the ring.
///
/// The executor below [`crate::comm::Communicator`]'s host collectives; runtimes use the
/// communicator. A ring's collectives are numbered from 0 (the first two find every slot
/// free); every number is run or given up ([`Self::owe_release`]) on every rank.
pub(crate) struct HostRing<'a> {
    /// This rank.
    pub rank: u32,
    /// Ranks in the ring.
    pub world: u32,
    /// The neighbours.
    pub links: Links<'a>,
    /// The next rank's slot region, granted to us.
    pub next_slots: SlotGrant,
    /// The previous rank's slot region granted to us (target of our zero-length grant writes).
    pub prev_slots: SlotGrant,
    /// Our slot region, granted to the previous rank (`slots × slot_bytes`).
    pub recv: SlotRegion,
    /// Our doorbell region (at least [`BELL_BYTES`]), granted to the next rank: its grants
    /// land here, with its descriptor.
    pub bell: SlotRegion,
    /// A registered work region at least as large as the buffer.
    pub work: SlotRegion,
    /// Sizes and limits.
    pub options: HostRingOptions,
    /// Notifications of later collectives that arrived while this one ran (a neighbour that
    /// finished first already released its slots or described the next one): kept, not
    /// dropped.
    pub backlog: Vec<u32>,
    /// Epochs for which this rank still owes its previous rank the release of their half of
    /// the slots (the collective two before failed): sent when that collective starts.
    pub owed: Vec<u8>,
}

fn epoch_of(v: u32) -> u32 {
    if v & GRANT_BIT != 0 {
        (v >> 16) & 0x7f
    } else {
        (v >> 24) & 0x7f
    }
}

/// Rank `rank`'s collective `ours` against what its next rank (`next`) granted with: `tag` in
/// every grant, the whole descriptor (read from `bell`) with the first.
fn agree(
    ours: &Descriptor,
    bell: &SlotRegion,
    epoch: u8,
    tag: u16,
    first: bool,
    (rank, next): (u32, u32),
) -> Result<()> {
    if !first && tag == ours.tag() {
        return Ok(());
    }
    let mut b = [0u8; descriptor::ENCODED_LEN];
    bell.read_at(
        DESCRIPTOR_AT + usize::from(epoch & 1) * descriptor::ENCODED_LEN,
        &mut b,
    )?;
    let theirs = Descriptor::decode(&b);
    match theirs {
        Ok(t) if t == *ours && tag == ours.tag() => Ok(()),
        other => Err(Error::Disagreement {
            rank,
            peer: next,
            ours: ours.to_string(),
            theirs: match other {
                Ok(t) => t.to_string(),
                Err(e) => e.to_string(),
            },
        }),
    }
}

/// The bytes of the ring's buffer of `staged`, overflow-checked.
fn staged_bytes(staged: Staged) -> Result<usize> {
    usize::try_from(staged.count)
        .ok()
        .and_then(|c| c.checked_mul(staged.dtype.size()))
        .ok_or_else(|| Error::InvalidArgument {
            reason: format!("{} elements of {:?} overflow", staged.count, staged.dtype),
        })
}

/// Every output lies inside a buffer of `bytes`.
fn check_outputs(outputs: &[(usize, &mut [u8])], bytes: usize) -> Result<()> {
    let fits = |at: usize, n: usize| at.checked_add(n).is_some_and(|end| end <= bytes);
    match outputs.iter().find(|(at, b)| !fits(*at, b.len())) {
        Some((at, b)) => Err(Error::InvalidArgument {
            reason: format!(
                "an output of {} bytes at {at} in a {bytes}-byte buffer",
                b.len()
            ),
        }),
        None => Ok(()),
    }
}

impl HostRing<'_> {
    /// Allreduces `data` (elements of `dtype`) with `op` across the ring, as collective number
    /// `seq` of the communicator (every rank counts the same; its low 7 bits are the epoch on
    /// the wire). `alive` is the job's liveness check (the bootstrap's); a lost rank fails the
    /// collective at once. `data` is written only when the collective finished, with the same
    /// result on every rank.
    #[cfg(test)]
    pub(crate) fn all_reduce(
        &mut self,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
        seq: u64,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let es = dtype.size();
        whole_elements(data.len(), dtype)?;
        let what = Descriptor::all_reduce(
            (data.len() / es) as u64,
            dtype,
            op,
            crate::descriptor::Algorithm::HostRing,
            seq,
        );
        let count = (data.len() / es) as u64;
        let staged = Staged {
            shape: Shape::AllReduce,
            count,
            dtype,
            op,
        };
        self.all_reduce_from(staged, &what, data, alive)?;
        self.read_out(staged, &mut [(0, data)])
    }

    /// Copies `bytes` into the work region at byte offset `at`: the input of the next
    /// [`Self::collective`].
    pub(crate) fn stage_in(&mut self, at: usize, bytes: &[u8]) -> Result<()> {
        if at
            .checked_add(bytes.len())
            .is_none_or(|end| end > self.work.len())
        {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} bytes at {at} in a work region of {}",
                    bytes.len(),
                    self.work.len()
                ),
            });
        }
        Ok(self.work.write_at(at, bytes)?)
    }

    /// [`Self::stage_in`] of this rank's own values for a reduction `op`: a PreMulSum
    /// multiplies them by its scalar in the same pass (block by block, through a buffer that
    /// stays in cache).
    pub(crate) fn stage_in_as(
        &mut self,
        at: usize,
        bytes: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        if op.scalar().is_none() {
            return self.stage_in(at, bytes);
        }
        let block = REDUCE_BLOCK.min(bytes.len());
        let mut scaled = vec![0u8; block];
        for (i, piece) in bytes.chunks(REDUCE_BLOCK).enumerate() {
            let out = &mut scaled[..piece.len()];
            copy_scaled(dtype, op, out, piece)?;
            self.stage_in(at + i * REDUCE_BLOCK, out)?;
        }
        Ok(())
    }

    /// Runs one collective of `staged.shape` over host memory staged in the work region (by
    /// [`Self::stage_in`]; the ring's buffer is its first `staged.count` elements, laid out by
    /// ring position: segment `p` is position `p`'s block), then fills each
    /// `(offset, destination)` of `outputs` from the work region at that byte offset (an
    /// average divided by the world size). `what` is the collective as every rank must agree on
    /// it (sequence number `what.seq`, as in [`Self::all_reduce`]). No output is written unless
    /// the collective finished on this rank, with its answer.
    pub(crate) fn collective(
        &mut self,
        staged: Staged,
        what: &Descriptor,
        outputs: &mut [(usize, &mut [u8])],
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let bytes = staged_bytes(staged)?;
        let plan = self.plan(bytes, staged.dtype)?.with_shape(staged.shape)?;
        check_outputs(outputs, bytes)?;
        self.run_host(plan, staged, what, None, alive)?;
        self.read_out(staged, outputs)
    }

    /// An allreduce of `input` (the whole buffer, this rank's values), as [`Self::collective`]
    /// with `staged.shape` [`Shape::AllReduce`] would run it after staging `input`, but staging
    /// only the ranges this rank sends before it reduces them (its first step's segment): every
    /// other range is reduced once, from `input` itself into the work region (one copy of the
    /// buffer less). The result stays in the work region until [`Self::read_out`] (which the
    /// caller calls only after this returned `Ok`: nothing of its output is written before).
    pub(crate) fn all_reduce_from(
        &mut self,
        staged: Staged,
        what: &Descriptor,
        input: &[u8],
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let bytes = staged_bytes(staged)?;
        if staged.shape != Shape::AllReduce || input.len() != bytes {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "an allreduce of {bytes} bytes from an input of {} ({:?})",
                    input.len(),
                    staged.shape
                ),
            });
        }
        let es = staged.dtype.size();
        let plan = self
            .plan(bytes, staged.dtype)?
            .with_shape(Shape::AllReduce)?;
        // Segments this rank reduces into during the reduce-scatter read the input itself;
        // the others (its first step's) are sent as they are and are staged now.
        let reduced: Vec<u32> = (0..plan.world.saturating_sub(1))
            .filter_map(|s| plan.recv_segment(self.rank, s))
            .collect();
        for seg in (0..plan.world).filter(|s| !reduced.contains(s)) {
            let r = plan.segment(seg);
            let (a, b) = (r.start as usize * es, r.end as usize * es);
            self.stage_in_as(a, &input[a..b], staged.dtype, staged.op)?;
        }
        self.run_host(plan, staged, what, Some(input), alive)
    }

    /// Runs collective `staged`, laid out by `plan`, over the work region; reductions read this
    /// rank's values from `input` where given ([`Self::all_reduce_from`]).
    fn run_host(
        &mut self,
        plan: Plan,
        staged: Staged,
        what: &Descriptor,
        input: Option<&[u8]>,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let bytes = plan.count as usize * plan.elem_size as usize;
        // Reduced block by block (a chunk is at most a slot and at most the collective): no
        // collective pays for zeroing whole slots.
        let block = REDUCE_BLOCK.min(self.options.slot_bytes).min(bytes).max(1);
        let mut ops = HostOps {
            dtype: staged.dtype,
            op: staged.op,
            scratch: vec![0u64; block.div_ceil(8)],
            mine: vec![0u64; block.div_ceil(8)],
            input,
        };
        self.run(plan, what, alive, &mut ops)
    }

    /// Fills each `(offset, destination)` of `outputs` from the work region at that byte
    /// offset (an average divided by the world size): the result of the collective `staged`
    /// that just finished on this rank.
    pub(crate) fn read_out(
        &mut self,
        staged: Staged,
        outputs: &mut [(usize, &mut [u8])],
    ) -> Result<()> {
        check_outputs(outputs, staged_bytes(staged)?)?;
        let average = staged.op == ReduceOp::Avg
            && matches!(staged.shape, Shape::AllReduce | Shape::ReduceScatter);
        for (at, b) in outputs.iter_mut() {
            self.work.read_at(*at, b)?;
            if average {
                finish_avg(staged.dtype, b, self.world)?;
            }
        }
        Ok(())
    }

    /// One piece of a staged GPU allreduce: elements `piece` of `buffer` (at most the work
    /// region), as collective `what` (its count is the whole call's, its type and reduction
    /// this piece's). Like [`Self::all_reduce_gpu`], but returns with the piece's last copies
    /// and kernels queued on `staging.stream` (the next piece's first copy queues after them;
    /// the caller synchronises that stream once, after the last piece).
    pub(crate) fn all_reduce_gpu_piece(
        &mut self,
        buffer: &DeviceBuffer,
        piece: std::ops::Range<usize>,
        what: &Descriptor,
        staging: &GpuStaging<'_>,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let (dtype, op) = (what.dtype, what.op);
        let es = dtype.size();
        let range = piece
            .start
            .checked_mul(es)
            .zip(piece.end.checked_mul(es))
            .filter(|(a, b)| a <= b && *b <= buffer.len())
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!(
                    "elements {piece:?} of {dtype:?} in a buffer of {} bytes",
                    buffer.len()
                ),
            })?;
        let (base, bytes) = (range.0, range.1 - range.0);
        let count = piece.len();
        if staging.scratch.len() < self.options.slot_bytes
            || !nodetour_core::cuda::same_context(staging.scratch.context(), buffer.context())
            || !nodetour_core::cuda::same_context(staging.stream.context(), buffer.context())
        {
            return Err(Error::InvalidArgument {
                reason: "the staging scratch (at least one slot) and stream must be on the \
                         buffer's GPU"
                    .into(),
            });
        }
        let plan = self.plan(bytes, dtype)?;
        // A PreMulSum: this rank's values are sent from the work region, which the GPU's copy
        // fills; they are multiplied on the GPU first (one pass over the piece, beside its
        // copy to the host), and the ring sums.
        let op = match op.scalar() {
            Some(scalar) => {
                let at = At::new(buffer, base);
                staging
                    .kernels
                    .scale(staging.stream, dtype, scalar, at, at, count)
                    .map_err(gpu)?;
                ReduceOp::Sum
            }
            None => op,
        };
        self.work
            .copy_from_gpu(0, buffer, base, bytes, staging.stream)
            .map_err(gpu)?;
        let mut ops = GpuOps {
            staging,
            buffer,
            base,
            dtype,
            op,
            bounce: vec![0u8; self.options.slot_bytes.min(bytes)],
        };
        self.run(plan, what, alive, &mut ops)?;
        if op == ReduceOp::Avg {
            staging
                .kernels
                .average(staging.stream, dtype, buffer, base, count, self.world)
                .map_err(gpu)?;
        }
        Ok(())
    }

    fn plan(&self, bytes: usize, dtype: DataType) -> Result<Plan> {
        if self.work.len() < bytes {
            return Err(Error::Plan {
                reason: format!(
                    "the work region holds {} bytes, the buffer has {bytes}",
                    self.work.len()
                ),
            });
        }
        let (slot_bytes, slots) = (self.options.slot_bytes, self.options.slots);
        if (self.recv.len() as u64) < u64::from(slots) * slot_bytes as u64 {
            return Err(Error::Plan {
                reason: "the slot region is smaller than slots × slot_bytes".into(),
            });
        }
        let es = dtype.size();
        Plan::new(
            self.world,
            (bytes / es) as u64,
            es as u32,
            slot_bytes as u64,
            self.slots_per_collective(),
        )
    }

    /// Whether the slots are split by the parity of the collective's epoch (two or more
    /// slots): each half is released for the collective two later as soon as this one is done
    /// with it, so a collective starts with its first slots already granted.
    fn halves(&self) -> bool {
        self.options.slots >= 2
    }

    fn slots_per_collective(&self) -> u32 {
        if self.halves() {
            self.options.slots / 2
        } else {
            self.options.slots
        }
    }

    fn run(
        &mut self,
        plan: Plan,
        what: &Descriptor,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
        ops: &mut dyn ChunkOps,
    ) -> Result<()> {
        let epoch = (what.seq & 0x7f) as u8;
        // Until this collective's half of the slots is released for the one two later (when
        // it is done with them), the release is owed: a failure sends it when that collective
        // starts instead.
        self.owe_release(what.seq);
        // This thread receives the neighbours' writes itself while it drives the collective
        // (one wake-up per message). It keeps doing so between collectives when this one
        // succeeds: a neighbour then writes us only small notices until we grant slots again.
        self.read_inline(true);
        let mut result = self.run_until_end(plan, what, alive, ops);
        match &result {
            Ok(()) => {
                // What this rank held back (its last chunks) leaves now: a neighbour may wait
                // for it to finish.
                result = self.flush();
                if result.is_ok() && self.halves() && self.world > 1 {
                    // The release waits for this rank's next write to its previous rank (its
                    // next collective's description or first chunk, one system call for
                    // them): that rank needs it only for the collective after next, which it
                    // reaches only after this rank started the next one (its first poll sends
                    // what is held; TCP keeps the order). Dropping the connection still sends
                    // it, best effort.
                    let later = epoch.wrapping_add(2) & 0x7f;
                    self.owed.retain(|e| *e != later);
                    result = self.notify_prev(Notice::Release { epoch: later }.encode());
                }
            }
            Err(e) => {
                // A neighbour may still be writing data we granted: the transport's threads
                // take it.
                self.read_inline(false);
                let e = e.clone();
                let cause = self.settle_cause(epoch, what.seq, &mut result, &e);
                // Tell both neighbours, so that the ring ends this collective now rather than
                // at its deadline. Best effort: a neighbour that is gone cannot be told.
                self.send_end(epoch, cause, true, true);
                let _ = self.flush();
            }
        }
        result
    }

    fn flush(&mut self) -> Result<()> {
        match &mut self.links {
            Links::One(c) => c.flush()?,
            Links::Two { next, prev } => {
                let n = next.flush();
                prev.flush()?;
                n?;
            }
        }
        Ok(())
    }

    /// Records that the release of collective `seq`'s half of the slots (for the collective two
    /// later) is owed until it is sent. Callers that consume a sequence number without running
    /// the collective (an abort before it starts, a refused argument) call it too.
    pub(crate) fn owe_release(&mut self, seq: u64) {
        let later = (seq.wrapping_add(2) & 0x7f) as u8;
        if self.halves() && self.world > 1 && !self.owed.contains(&later) {
            self.owed.push(later);
        }
    }

    fn read_inline(&mut self, on: bool) {
        match &mut self.links {
            Links::One(c) => c.read_inline(on),
            Links::Two { next, prev } => {
                next.read_inline(on);
                prev.read_inline(on);
            }
        }
    }

    /// A notice to the previous rank (the rank that writes our slots).
    fn notify_prev(&mut self, value: u32) -> Result<()> {
        let prev = match &mut self.links {
            Links::One(c) => &mut **c,
            Links::Two { prev, .. } => &mut **prev,
        };
        Ok(prev.write_deferred(&self.work, 0..0, &self.prev_slots, 0, Some(value))?)
    }
}

/// How many collectives `e` is ahead of `current` (7-bit epochs): 0 for this one, 1..=63 for a
/// later one, more for an earlier (stale) one.
fn ahead(e: u32, current: u8) -> u32 {
    e.wrapping_sub(u32::from(current)) & 0x7f
}

/// Marks, in the backlog only, an end notice that came from the previous rank (bit 7 of the
/// reason byte, which the wire never sets). Data comes from the previous rank and grants from
/// the next, so only end notices need it.
const FROM_PREV: u32 = 0x80;

fn is_end(v: u32) -> bool {
    matches!(Notice::decode(v & !FROM_PREV), Some(Notice::End { .. }))
}

fn mark(from_prev: bool, v: u32) -> u32 {
    if from_prev && is_end(v) {
        v | FROM_PREV
    } else {
        v
    }
}

/// A backlog entry: (from the previous rank?, the value as it came).
fn unmark(v: u32) -> (bool, u32) {
    if is_end(v) {
        (v & FROM_PREV != 0, v & !FROM_PREV)
    } else {
        (v & GRANT_BIT == 0, v)
    }
}

/// Between two looks while spinning: a pause of the core, or where ranks outnumber CPUs
/// the rest of this time slice to whoever is runnable.
fn pause(yields: bool) {
    if yields {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// Waits up to 200 µs for an event (the caller loops, checking deadlines and liveness).
fn wait_slice(c: &mut dyn HostConnection, events: &mut Vec<Event>) -> Result<()> {
    match c.wait(events, Deadline::after(Duration::from_micros(200))) {
        Ok(()) | Err(nodetour_core::Error::Timeout { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_notices_carry_the_rank_at_fault_and_the_cause_and_round_trip() {
        use crate::cause::CauseKind::*;
        for kind in [Timeout, Lost, Aborted, Disagreement, Failed] {
            for rank in [0, 1, 300, END_RANKS - 1] {
                for epoch in [0u8, 1, 127] {
                    let n = Notice::End {
                        epoch,
                        cause: RootCause::new(rank, kind),
                    };
                    assert_eq!(Notice::decode(n.encode()), Some(n));
                    // The backlog's mark stays clear of the cause.
                    assert!(is_end(mark(true, n.encode())));
                    assert_eq!(unmark(mark(true, n.encode())), (true, n.encode()));
                }
            }
        }
        for n in [
            Notice::Release { epoch: 5 },
            Notice::Describe {
                epoch: 9,
                tag: 0x7fff,
            },
            Notice::Grant {
                epoch: 3,
                slot: 7,
                tag: 0x1234,
            },
        ] {
            assert_eq!(Notice::decode(n.encode()), Some(n));
        }
        // An end notice of an unknown cause is not read as any notice.
        assert_eq!(Notice::decode(GRANT_BIT | END_BIT | (END_KIND + 6)), None);
    }

    #[test]
    fn the_options_take_their_timeout_from_the_configuration() {
        let config = nodetour_core::Config::from_lookup(|k| {
            (k == "NODETOUR_TIMEOUT_MS").then(|| "1500".to_owned())
        })
        .unwrap();
        let options = HostRingOptions::from_config(&config);
        assert_eq!(options.timeout, Duration::from_millis(1500));
        assert_eq!(
            HostRingOptions::from_config(&nodetour_core::Config::default()).timeout,
            nodetour_core::config::DEFAULT_TIMEOUT
        );
    }
}

#[cfg(test)]
mod ring_tests;

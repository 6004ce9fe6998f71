//! The ring allreduce over host memory, on any host-driven transport (verbs, tcp, mem): the
//! schedule's actions become one-sided writes, CPU reductions and grants.
//!
//! Memory: the caller's buffer is copied into a registered work region (so nothing of the
//! caller's memory is registered or exposed) and back at the end; each rank receives into a slot
//! region of `slots × slot_bytes` it granted its previous rank. Notifications carry the
//! schedule's immediates (data) or, with the top bit set, a grant (`epoch:7 | slot:8`), sent as a
//! zero-length write.

use std::time::{Duration, Instant};

use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::{DeviceBuffer, RdmaBuffer};
use nodetour_core::transport::{Event, HostConnection, SlotGrant, SlotRegion};

use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::reduce::{DataType, ReduceOp, finish_avg, reduce_into};
use crate::schedule::{Action, RingSchedule};

const GRANT_BIT: u32 = 1 << 31;

/// Sizes and limits of the host ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostRingOptions {
    /// Bytes per slot (one chunk).
    pub slot_bytes: usize,
    /// Slots per receiver.
    pub slots: u32,
    /// No progress for this long fails the collective.
    pub timeout: Duration,
}

impl Default for HostRingOptions {
    fn default() -> Self {
        HostRingOptions {
            slot_bytes: 1 << 20,
            slots: 4,
            timeout: Duration::from_secs(30),
        }
    }
}

/// The connections of one rank to its ring neighbours.
pub enum Links<'a> {
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
pub struct HostRing<'a> {
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
    /// A registered work region at least as large as the buffer.
    pub work: SlotRegion,
    /// Sizes and limits.
    pub options: HostRingOptions,
    /// Notifications of the next collective that arrived while this one ran (a neighbour that
    /// finished first already granted its slots for the next epoch): kept, not dropped.
    pub backlog: Vec<u32>,
}

fn epoch_of(v: u32) -> u32 {
    if v & GRANT_BIT != 0 {
        (v >> 16) & 0x7f
    } else {
        (v >> 24) & 0x7f
    }
}

/// A landed chunk: byte offset `slot` in the slot region, `n` bytes, for byte offset `at` of
/// the buffer.
#[derive(Clone, Copy)]
struct Chunk {
    slot: usize,
    at: usize,
    n: usize,
}

/// What a rank does with a chunk that landed in its slot; the work region always holds the
/// values this rank sends on.
trait ChunkOps {
    /// `local[at..at + n] = op(local[at..at + n], recv[slot..slot + n])`.
    fn reduce(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()>;
    /// `local[at..at + n] = recv[slot..slot + n]`.
    fn copy(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()>;
}

/// Host buffers: the work region is the local buffer, reduced by the CPU.
struct HostOps {
    dtype: DataType,
    op: ReduceOp,
    scratch: Vec<u8>,
    mine: Vec<u8>,
}

impl ChunkOps for HostOps {
    fn reduce(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        recv.read_at(slot, &mut self.scratch[..n])?;
        work.read_at(at, &mut self.mine[..n])?;
        reduce_into(self.dtype, self.op, &mut self.mine[..n], &self.scratch[..n])?;
        work.write_at(at, &self.mine[..n])?;
        Ok(())
    }

    fn copy(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        recv.read_at(slot, &mut self.scratch[..n])?;
        work.write_at(at, &self.scratch[..n])?;
        Ok(())
    }
}

/// What the staged GPU path needs on this rank's GPU: its reduction kernels, a stream, and a
/// scratch buffer of at least one slot.
pub struct GpuStaging<'a> {
    /// The kernels of the buffer's GPU.
    pub kernels: &'a ReduceKernels,
    /// A stream of the buffer's GPU.
    pub stream: &'a GpuStream,
    /// At least `slot_bytes` of GPU memory.
    pub scratch: &'a DeviceBuffer,
}

/// GPU buffers staged through host slots: chunks land in host memory, are copied to the GPU and
/// reduced there; the reduced chunk is copied back to the work region, from which it is sent on.
struct GpuOps<'a> {
    staging: &'a GpuStaging<'a>,
    buffer: &'a DeviceBuffer,
    dtype: DataType,
    op: ReduceOp,
    bounce: Vec<u8>,
}

fn gpu(e: nodetour_core::Error) -> Error {
    Error::Gpu {
        reason: e.to_string(),
    }
}

impl ChunkOps for GpuOps<'_> {
    fn reduce(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        let st = self.staging;
        recv.copy_to_gpu(slot, st.scratch, 0, n).map_err(gpu)?;
        let count = n / self.dtype.size();
        st.kernels
            .reduce(
                st.stream,
                self.dtype,
                self.op,
                self.buffer,
                at,
                st.scratch,
                0,
                count,
            )
            .map_err(gpu)?;
        // Waits for the reduce (the copy synchronises the GPU first).
        work.copy_from_gpu(at, self.buffer, at, n).map_err(gpu)
    }

    fn copy(&mut self, work: &SlotRegion, recv: &SlotRegion, c: Chunk) -> Result<()> {
        let Chunk { slot, at, n } = c;
        recv.copy_to_gpu(slot, self.buffer, at, n).map_err(gpu)?;
        recv.read_at(slot, &mut self.bounce[..n])?;
        work.write_at(at, &self.bounce[..n])?;
        Ok(())
    }
}

impl HostRing<'_> {
    /// Allreduces `data` (elements of `dtype`) with `op` across the ring, in collective
    /// generation `epoch`. `alive` is the job's liveness check (the bootstrap's); a lost rank
    /// fails the collective at once.
    pub fn all_reduce(
        &mut self,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
        epoch: u8,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let es = dtype.size();
        if data.len() % es != 0 {
            return Err(Error::Plan {
                reason: format!(
                    "{} bytes is not a whole number of {dtype:?} elements",
                    data.len()
                ),
            });
        }
        let plan = self.plan(data.len(), dtype)?;
        self.work.write_at(0, data)?;
        let slot_bytes = self.options.slot_bytes;
        let mut ops = HostOps {
            dtype,
            op,
            scratch: vec![0u8; slot_bytes],
            mine: vec![0u8; slot_bytes],
        };
        self.run(plan, epoch, alive, &mut ops)?;
        self.work.read_at(0, data)?;
        if op == ReduceOp::Avg {
            finish_avg(dtype, data, self.world);
        }
        Ok(())
    }

    /// Allreduces the first `count` elements of GPU memory `buffer` in place, staged through
    /// host slots: the buffer is copied to the work region, every chunk that lands is copied to
    /// the GPU and reduced there by `staging`'s kernels, and reduced chunks go back to the work
    /// region to be sent on. Synchronous: starts after all work queued on the buffer's GPU and
    /// returns with the result in `buffer`.
    #[allow(clippy::too_many_arguments)]
    pub fn all_reduce_gpu(
        &mut self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        epoch: u8,
        staging: &GpuStaging<'_>,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
    ) -> Result<()> {
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| *b <= buffer.len())
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!(
                    "{count} elements of {dtype:?} in a buffer of {} bytes",
                    buffer.len()
                ),
            })?;
        if staging.scratch.len() < self.options.slot_bytes
            || !std::sync::Arc::ptr_eq(staging.scratch.context(), buffer.context())
            || !std::sync::Arc::ptr_eq(staging.stream.context(), buffer.context())
        {
            return Err(Error::InvalidArgument {
                reason: "the staging scratch (at least one slot) and stream must be on the \
                         buffer's GPU"
                    .into(),
            });
        }
        let plan = self.plan(bytes, dtype)?;
        self.work.copy_from_gpu(0, buffer, 0, bytes).map_err(gpu)?;
        let mut ops = GpuOps {
            staging,
            buffer,
            dtype,
            op,
            bounce: vec![0u8; self.options.slot_bytes],
        };
        self.run(plan, epoch, alive, &mut ops)?;
        if op == ReduceOp::Avg {
            staging
                .kernels
                .average(staging.stream, dtype, buffer, 0, count, self.world)
                .map_err(gpu)?;
        }
        staging.stream.synchronize().map_err(gpu)
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
            slots,
        )
    }

    fn run(
        &mut self,
        plan: Plan,
        epoch: u8,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
        ops: &mut dyn ChunkOps,
    ) -> Result<()> {
        let es = plan.elem_size as usize;
        let slot_bytes = self.options.slot_bytes;
        let epoch = epoch & 0x7f;
        let mut sched =
            RingSchedule::new(plan, self.rank, epoch, self.options.timeout, Instant::now());
        let mut events: Vec<Event> = Vec::new();
        // What neighbours already sent for this collective while the previous one ran.
        let early: Vec<u32> = std::mem::take(&mut self.backlog);
        let mut replay: Vec<Event> = early
            .into_iter()
            .filter(|v| epoch_of(*v) == u32::from(epoch))
            .map(Event::Notified)
            .collect();
        loop {
            while let Some(action) = sched.poll_action() {
                let now = Instant::now();
                let reduce = matches!(action, Action::Reduce { .. });
                match action {
                    Action::Send {
                        unit,
                        elements,
                        slot,
                        imm,
                    } => {
                        let bytes = (elements.start as usize * es)..(elements.end as usize * es);
                        let next = match &mut self.links {
                            Links::One(c) => &mut **c,
                            Links::Two { next, .. } => &mut **next,
                        };
                        next.write(
                            &self.work,
                            bytes,
                            &self.next_slots,
                            u64::from(slot) * slot_bytes as u64,
                            Some(imm),
                        )?;
                        sched.handle_sent(unit, now)?;
                    }
                    Action::Reduce {
                        unit,
                        elements,
                        slot,
                    }
                    | Action::Copy {
                        unit,
                        elements,
                        slot,
                    } => {
                        let c = Chunk {
                            slot: slot as usize * slot_bytes,
                            at: elements.start as usize * es,
                            n: (elements.end - elements.start) as usize * es,
                        };
                        if reduce {
                            ops.reduce(&self.work, &self.recv, c)?;
                        } else {
                            ops.copy(&self.work, &self.recv, c)?;
                        }
                        sched.handle_processed(unit, now)?;
                    }
                    Action::Grant { slot } => {
                        let value = GRANT_BIT | (u32::from(epoch) << 16) | u32::from(slot);
                        let prev = match &mut self.links {
                            Links::One(c) => &mut **c,
                            Links::Two { prev, .. } => &mut **prev,
                        };
                        prev.write(&self.work, 0..0, &self.prev_slots, 0, Some(value))?;
                    }
                    Action::Done => return Ok(()),
                    Action::Failed(e) => return Err(e),
                }
            }
            if let Err(e) = alive() {
                match Error::from(e) {
                    Error::PeerLost { rank } => sched.handle_peer_lost(rank),
                    // Anything else the caller's check reports (an abort from another thread)
                    // ends the collective; its epoch is spent, so its late writes are stale.
                    other => sched.abort(other.to_string()),
                }
                continue;
            }
            // Collect notifications: spin on polls briefly, then wait in short slices so that
            // both neighbours are served and the deadline is checked.
            events.clear();
            events.append(&mut replay);
            match &mut self.links {
                Links::One(c) => {
                    c.poll(&mut events)?;
                    if events.is_empty() {
                        wait_slice(&mut **c, &mut events)?;
                    }
                }
                Links::Two { next, prev } => {
                    // Grants come from next, data from prev: wait on each in turn, briefly, so
                    // neither waits behind the other for long. (A progress engine blocking on
                    // both at once comes with the GPU executors.)
                    next.poll(&mut events)?;
                    prev.poll(&mut events)?;
                    if events.is_empty() {
                        wait_slice(&mut **prev, &mut events)?;
                        next.poll(&mut events)?;
                    }
                    if events.is_empty() {
                        wait_slice(&mut **next, &mut events)?;
                        prev.poll(&mut events)?;
                    }
                }
            }
            let now = Instant::now();
            for e in &events {
                let Event::Notified(v) = *e;
                let e_epoch = epoch_of(v);
                if e_epoch != u32::from(epoch) {
                    // The next collective's (kept for it), or a stale one's (dropped).
                    if e_epoch == (u32::from(epoch) + 1) & 0x7f {
                        self.backlog.push(v);
                    }
                    continue;
                }
                if v & GRANT_BIT != 0 {
                    sched.handle_granted(v as u8, now)?;
                } else {
                    sched.handle_arrived(v, now)?;
                }
            }
            sched.handle_timeout(now);
        }
    }
}

/// Waits up to 200 µs for an event (the caller loops, checking deadlines and liveness).
fn wait_slice(c: &mut dyn HostConnection, events: &mut Vec<Event>) -> Result<()> {
    match c.wait(events, Deadline::after(Duration::from_micros(200))) {
        Ok(()) | Err(nodetour_core::Error::Timeout { .. }) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

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
        if self.work.len() < data.len() {
            return Err(Error::Plan {
                reason: format!(
                    "the work region holds {} bytes, the buffer has {}",
                    self.work.len(),
                    data.len()
                ),
            });
        }
        let (slot_bytes, slots) = (self.options.slot_bytes, self.options.slots);
        if (self.recv.len() as u64) < u64::from(slots) * slot_bytes as u64 {
            return Err(Error::Plan {
                reason: "the slot region is smaller than slots × slot_bytes".into(),
            });
        }
        let plan = Plan::new(
            self.world,
            (data.len() / es) as u64,
            es as u32,
            slot_bytes as u64,
            slots,
        )?;
        let epoch = epoch & 0x7f;
        self.work.write_at(0, data)?;
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
        let mut scratch = vec![0u8; slot_bytes];
        let mut mine = vec![0u8; slot_bytes];
        loop {
            while let Some(action) = sched.poll_action() {
                let now = Instant::now();
                let action_kind = if matches!(action, Action::Reduce { .. }) {
                    Kind::Reduce
                } else {
                    Kind::Other
                };
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
                        let reduce = matches!(action_kind, Kind::Reduce);
                        let n = (elements.end - elements.start) as usize * es;
                        let at = elements.start as usize * es;
                        self.recv
                            .read_at(slot as usize * slot_bytes, &mut scratch[..n])?;
                        if reduce {
                            self.work.read_at(at, &mut mine[..n])?;
                            reduce_into(dtype, op, &mut mine[..n], &scratch[..n])?;
                            self.work.write_at(at, &mine[..n])?;
                        } else {
                            self.work.write_at(at, &scratch[..n])?;
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
                    Action::Done => {
                        self.work.read_at(0, data)?;
                        if op == ReduceOp::Avg {
                            finish_avg(dtype, data, self.world);
                        }
                        return Ok(());
                    }
                    Action::Failed(e) => return Err(e),
                }
            }
            if let Err(e) = alive() {
                if let Error::PeerLost { rank } = Error::from(e) {
                    sched.handle_peer_lost(rank);
                    continue;
                }
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

enum Kind {
    Reduce,
    Other,
}

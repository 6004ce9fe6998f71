//! The ring allreduce schedule of one rank, as a pure state machine.
//!
//! Reduce-scatter then all-gather over `world` ranks: at step `s` rank `r` sends a segment to
//! `r + 1` and receives one from `r − 1`; each segment moves in chunks through slots. The
//! receiver grants slots (clear-to-send); the sender writes a chunk into a granted slot and rings
//! the doorbell with an [`Immediate`] naming slot, sequence number and epoch; the receiver
//! reduces (or, in the all-gather, copies) the chunk out of the slot and only then grants the
//! slot again. Chunks flow in a pipeline: while one is in flight the previous one is reduced.
//!
//! Nothing here does I/O or reads a clock. Inputs: [`RingSchedule::handle_granted`],
//! [`RingSchedule::handle_arrived`], [`RingSchedule::handle_sent`],
//! [`RingSchedule::handle_processed`], [`RingSchedule::handle_peer_lost`],
//! [`RingSchedule::handle_timeout`] (time passed in), [`RingSchedule::abort`]. Outputs:
//! [`RingSchedule::poll_action`] and [`RingSchedule::poll_timeout`].
//!
//! Rules it enforces: data is sent only from chunks whose inputs are final (the reduce or copy
//! that produced them finished); a chunk is copied into a range only after every send from that
//! range completed locally; a slot is granted again only after the reduce that reads it finished;
//! immediates of another epoch (late writes of an aborted collective) are ignored, and anything
//! else out of protocol (ungranted slot, out-of-order sequence, surplus data or grants) fails the
//! collective naming the peer.

use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::plan::Plan;

/// The 32-bit doorbell of a chunk: `epoch:8 | slot:8 | sequence:16`, big-endian on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Immediate {
    /// Collective generation (changes with every collective and every abort).
    pub epoch: u8,
    /// The receiver's slot the data was written into.
    pub slot: u8,
    /// The chunk's sequence number on this connection (mod 2^16).
    pub seq: u16,
}

impl Immediate {
    /// Packs into 32 bits.
    pub fn encode(self) -> u32 {
        (u32::from(self.epoch) << 24) | (u32::from(self.slot) << 16) | u32::from(self.seq)
    }

    /// Unpacks 32 bits (every value is some immediate; validity is the schedule's business).
    pub fn decode(v: u32) -> Immediate {
        Immediate {
            epoch: (v >> 24) as u8,
            slot: (v >> 16) as u8,
            seq: v as u16,
        }
    }
}

/// What the schedule wants done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write `elements` of the local buffer into slot `slot` of the next rank, with immediate
    /// `imm`; report the local completion with [`RingSchedule::handle_sent`]`(unit)`.
    Send {
        /// Send unit index.
        unit: u32,
        /// Element range of the local buffer.
        elements: Range<u64>,
        /// The next rank's slot.
        slot: u8,
        /// The immediate to carry.
        imm: u32,
    },
    /// `local[elements] = op(local[elements], our slot)`; report with
    /// [`RingSchedule::handle_processed`]`(unit)`.
    Reduce {
        /// Receive unit index.
        unit: u32,
        /// Element range of the local buffer.
        elements: Range<u64>,
        /// Our slot holding the peer's chunk.
        slot: u8,
    },
    /// `local[elements] = our slot`; report with [`RingSchedule::handle_processed`]`(unit)`.
    Copy {
        /// Receive unit index.
        unit: u32,
        /// Element range of the local buffer.
        elements: Range<u64>,
        /// Our slot holding the peer's chunk.
        slot: u8,
    },
    /// Tell the previous rank it may write our slot `slot` (a clear-to-send entry).
    Grant {
        /// The slot.
        slot: u8,
    },
    /// The collective finished on this rank.
    Done,
    /// The collective failed on this rank.
    Failed(Error),
}

/// What [`RingSchedule::handle_arrived`] made of an immediate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// Accepted: the chunk will be reduced or copied.
    Accepted,
    /// From another epoch: a late write of an earlier collective, ignored.
    Stale,
}

#[derive(Clone, Copy, Debug)]
struct Unit {
    step: u32,
    segment: u32,
    chunk: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Running,
    Done,
    Failed,
}

/// One rank's schedule for one allreduce.
pub struct RingSchedule {
    plan: Plan,
    rank: u32,
    epoch: u8,
    timeout: Duration,
    last_progress: Instant,
    state: State,
    actions: VecDeque<Action>,
    sends: Vec<Unit>,
    send_dep: Vec<Option<usize>>,
    sent: Vec<bool>,
    sent_count: usize,
    next_send: usize,
    free_remote: VecDeque<u8>,
    grants_received: usize,
    recvs: Vec<Unit>,
    copy_dep: Vec<Option<usize>>,
    arrived_slot: Vec<Option<u8>>,
    emitted: Vec<bool>,
    processed: Vec<bool>,
    processed_count: usize,
    next_recv: usize,
    granted: [bool; 256],
    grants_issued: usize,
    released: bool,
    stale: u64,
}

impl RingSchedule {
    /// The schedule of `rank` for `plan`, in collective generation `epoch`, failing after
    /// `timeout` without progress. The first actions (the initial grants) are ready at once.
    pub fn new(plan: Plan, rank: u32, epoch: u8, timeout: Duration, now: Instant) -> RingSchedule {
        Self::build(plan, rank, epoch, timeout, now, false)
    }

    /// Like [`Self::new`], with *standing* grants: the previous rank already holds our first
    /// `min(slots, chunks we receive)` slots (we released them to it before this collective
    /// began), so none are granted now; and our first sends wait for
    /// [`Self::handle_released`], the next rank's release of its slots to us.
    pub fn new_standing(
        plan: Plan,
        rank: u32,
        epoch: u8,
        timeout: Duration,
        now: Instant,
    ) -> RingSchedule {
        Self::build(plan, rank, epoch, timeout, now, true)
    }

    fn build(
        plan: Plan,
        rank: u32,
        epoch: u8,
        timeout: Duration,
        now: Instant,
        standing: bool,
    ) -> RingSchedule {
        let mut sends = Vec::new();
        let mut recvs = Vec::new();
        if plan.world > 1 {
            for step in 0..plan.steps() {
                if let Some(seg) = plan.send_segment(rank, step) {
                    sends.extend((0..plan.chunks_in(seg)).map(|chunk| Unit {
                        step,
                        segment: seg,
                        chunk,
                    }));
                }
                if let Some(seg) = plan.recv_segment(rank, step) {
                    recvs.extend((0..plan.chunks_in(seg)).map(|chunk| Unit {
                        step,
                        segment: seg,
                        chunk,
                    }));
                }
            }
        }
        let find = |list: &[Unit], step: u32, chunk: u32| {
            list.iter().position(|u| u.step == step && u.chunk == chunk)
        };
        // A send at step s ships what the receive at step s − 1 produced (same segment).
        let send_dep = sends
            .iter()
            .map(|u| {
                if u.step == 0 {
                    None
                } else {
                    find(&recvs, u.step - 1, u.chunk)
                }
            })
            .collect();
        // A copy that overwrites a range this rank sent earlier waits for that send (an
        // allreduce's all-gather copies over what its reduce-scatter sent).
        let copy_dep = recvs
            .iter()
            .map(|u| {
                plan.overwrites_send_of(u.step)
                    .and_then(|s| find(&sends, s, u.chunk))
            })
            .collect();
        let (ns, nr) = (sends.len(), recvs.len());
        let mut s = RingSchedule {
            plan,
            rank,
            epoch,
            timeout,
            last_progress: now,
            state: State::Running,
            actions: VecDeque::new(),
            sends,
            send_dep,
            sent: vec![false; ns],
            sent_count: 0,
            next_send: 0,
            free_remote: VecDeque::new(),
            grants_received: 0,
            recvs,
            copy_dep,
            arrived_slot: vec![None; nr],
            emitted: vec![false; nr],
            processed: vec![false; nr],
            processed_count: 0,
            next_recv: 0,
            granted: [false; 256],
            grants_issued: 0,
            released: false,
            stale: 0,
        };
        for slot in 0..(plan.slots as usize).min(nr) {
            if standing {
                s.granted[slot] = true;
                s.grants_issued += 1;
            } else {
                s.grant(slot as u8);
            }
        }
        s.progress();
        s
    }

    /// The next rank released its standing slots to us (see [`Self::new_standing`]): the first
    /// `min(slots, chunks we send)` of them may be written now.
    pub fn handle_released(&mut self, now: Instant) -> Result<()> {
        self.running()?;
        let next = (self.rank + 1) % self.plan.world;
        let k = (self.plan.slots as usize).min(self.sends.len());
        if self.released || self.grants_received + k > self.sends.len() {
            return self.violation(next, "released its slots twice".into());
        }
        self.released = true;
        self.grants_received += k;
        self.free_remote.extend((0..k).map(|s| s as u8));
        self.last_progress = now;
        self.progress();
        Ok(())
    }

    /// The step of send unit `unit` (0: it carries only this rank's own input).
    pub fn send_step(&self, unit: u32) -> Option<u32> {
        self.sends.get(unit as usize).map(|u| u.step)
    }

    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// When [`Self::handle_timeout`] should next be called (while running).
    pub fn poll_timeout(&self) -> Option<Instant> {
        (self.state == State::Running).then(|| self.last_progress + self.timeout)
    }

    /// Whether the collective finished here.
    pub fn is_done(&self) -> bool {
        self.state == State::Done
    }

    /// Whether it failed here.
    pub fn is_failed(&self) -> bool {
        self.state == State::Failed
    }

    /// Immediates of other epochs ignored so far.
    pub fn stale_arrivals(&self) -> u64 {
        self.stale
    }

    /// Chunks this rank sends and receives.
    pub fn units(&self) -> (usize, usize) {
        (self.sends.len(), self.recvs.len())
    }

    /// The next rank granted us its slot `slot`.
    pub fn handle_granted(&mut self, slot: u8, now: Instant) -> Result<()> {
        self.running()?;
        let next = (self.rank + 1) % self.plan.world;
        if u32::from(slot) >= self.plan.slots {
            return self.violation(
                next,
                format!("granted slot {slot}, it has {} slots", self.plan.slots),
            );
        }
        if self.free_remote.contains(&slot) {
            return self.violation(next, format!("granted slot {slot} twice"));
        }
        if self.grants_received >= self.sends.len() {
            return self.violation(
                next,
                "granted more slots than this collective has chunks".into(),
            );
        }
        self.grants_received += 1;
        self.free_remote.push_back(slot);
        self.last_progress = now;
        self.progress();
        Ok(())
    }

    /// The previous rank's chunk landed in one of our slots, announced by immediate `imm`.
    pub fn handle_arrived(&mut self, imm: u32, now: Instant) -> Result<Arrival> {
        self.running()?;
        let prev = (self.rank + self.plan.world - 1) % self.plan.world;
        let i = Immediate::decode(imm);
        if i.epoch != self.epoch {
            self.stale += 1;
            return Ok(Arrival::Stale);
        }
        if self.next_recv >= self.recvs.len() {
            self.violation(prev, "sent more chunks than this collective has".into())?;
        }
        if i.seq != self.next_recv as u16 {
            self.violation(
                prev,
                format!(
                    "sent chunk {} where {} was due",
                    i.seq, self.next_recv as u16
                ),
            )?;
        }
        if !self.granted[i.slot as usize] {
            self.violation(prev, format!("wrote slot {} without a grant", i.slot))?;
        }
        self.granted[i.slot as usize] = false;
        self.arrived_slot[self.next_recv] = Some(i.slot);
        self.next_recv += 1;
        self.last_progress = now;
        self.progress();
        Ok(Arrival::Accepted)
    }

    /// Our write of send unit `unit` completed locally (its source may be changed).
    pub fn handle_sent(&mut self, unit: u32, now: Instant) -> Result<()> {
        self.running()?;
        let u = unit as usize;
        if u >= self.next_send || self.sent[u] {
            return Err(self.fail(Error::Aborted {
                reason: format!("local completion for send {unit}, which is not in flight"),
            }));
        }
        self.sent[u] = true;
        self.sent_count += 1;
        self.last_progress = now;
        self.progress();
        Ok(())
    }

    /// Our reduce or copy of receive unit `unit` finished (its slot may be reused).
    pub fn handle_processed(&mut self, unit: u32, now: Instant) -> Result<()> {
        self.running()?;
        let u = unit as usize;
        if u >= self.recvs.len() || !self.emitted[u] || self.processed[u] {
            return Err(self.fail(Error::Aborted {
                reason: format!("completion for receive {unit}, which is not being processed"),
            }));
        }
        self.processed[u] = true;
        self.processed_count += 1;
        if self.grants_issued < self.recvs.len() {
            let slot = self.arrived_slot[u].expect("processed units arrived");
            self.grant(slot);
        }
        self.last_progress = now;
        self.progress();
        Ok(())
    }

    /// Some rank of the job is gone: the ring cannot complete.
    pub fn handle_peer_lost(&mut self, rank: u32) {
        if self.state == State::Running {
            self.fail(Error::PeerLost { rank });
        }
    }

    /// Time has passed: fails if nothing moved for the timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.state == State::Running
            && now.saturating_duration_since(self.last_progress) >= self.timeout
        {
            let (waiting_for, rank) = self.waiting_for();
            self.fail(Error::Timeout {
                waiting_for,
                rank,
                after: self.timeout,
            });
        }
    }

    /// Aborts from outside (another thread asked, the communicator is shutting down).
    pub fn abort(&mut self, reason: impl Into<String>) {
        if self.state == State::Running {
            self.fail(Error::Aborted {
                reason: reason.into(),
            });
        }
    }

    fn grant(&mut self, slot: u8) {
        self.granted[slot as usize] = true;
        self.grants_issued += 1;
        self.actions.push_back(Action::Grant { slot });
    }

    fn progress(&mut self) {
        if self.state != State::Running {
            return;
        }
        // Sends, in order, as their inputs become final and slots are granted.
        while self.next_send < self.sends.len() {
            let ready = self.send_dep[self.next_send].is_none_or(|d| self.processed[d]);
            if !ready {
                break;
            }
            let Some(slot) = self.free_remote.pop_front() else {
                break;
            };
            let u = self.sends[self.next_send];
            let imm = Immediate {
                epoch: self.epoch,
                slot,
                seq: self.next_send as u16,
            }
            .encode();
            self.actions.push_back(Action::Send {
                unit: self.next_send as u32,
                elements: self.plan.chunk(u.segment, u.chunk),
                slot,
                imm,
            });
            self.next_send += 1;
        }
        // Reduces and copies of arrived chunks whose target range is free.
        for i in 0..self.next_recv {
            if self.emitted[i] || !self.copy_dep[i].is_none_or(|d| self.sent[d]) {
                continue;
            }
            let u = self.recvs[i];
            let (elements, slot) = (
                self.plan.chunk(u.segment, u.chunk),
                self.arrived_slot[i].expect("arrived"),
            );
            self.emitted[i] = true;
            self.actions.push_back(if self.plan.reduces_at(u.step) {
                Action::Reduce {
                    unit: i as u32,
                    elements,
                    slot,
                }
            } else {
                Action::Copy {
                    unit: i as u32,
                    elements,
                    slot,
                }
            });
        }
        if self.sent_count == self.sends.len() && self.processed_count == self.recvs.len() {
            self.state = State::Done;
            self.actions.push_back(Action::Done);
        }
    }

    /// What the schedule waits for, and the neighbour it waits on (none where it waits for
    /// local work).
    fn waiting_for(&self) -> (String, Option<u32>) {
        let (prev, next) = (
            (self.rank + self.plan.world - 1) % self.plan.world,
            (self.rank + 1) % self.plan.world,
        );
        if self.next_send < self.sends.len() && self.free_remote.is_empty() {
            return (
                format!(
                    "a slot grant (send {} of {})",
                    self.next_send,
                    self.sends.len()
                ),
                Some(next),
            );
        }
        if self.next_recv < self.recvs.len() {
            return (
                format!(
                    "chunk {} of {} (step {})",
                    self.next_recv,
                    self.recvs.len(),
                    self.recvs[self.next_recv].step
                ),
                Some(prev),
            );
        }
        ("local completions of sends and reduces".into(), None)
    }

    /// While running: the neighbour the schedule waits on and how long nothing has moved.
    pub fn waiting_on(&self, now: Instant) -> Option<(u32, Duration)> {
        if self.state != State::Running {
            return None;
        }
        let (_, rank) = self.waiting_for();
        Some((rank?, now.saturating_duration_since(self.last_progress)))
    }

    fn running(&self) -> Result<()> {
        match self.state {
            State::Running => Ok(()),
            State::Done => Err(Error::Aborted {
                reason: "the collective already finished".into(),
            }),
            State::Failed => Err(Error::Aborted {
                reason: "the collective already failed".into(),
            }),
        }
    }

    fn violation<T>(&mut self, rank: u32, reason: String) -> Result<T> {
        Err(self.fail(Error::Protocol { rank, reason }))
    }

    fn fail(&mut self, e: Error) -> Error {
        if self.state == State::Running {
            self.state = State::Failed;
            self.actions.push_back(Action::Failed(e.clone()));
        }
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn immediates_round_trip() {
        let i = Immediate {
            epoch: 7,
            slot: 200,
            seq: 65535,
        };
        assert_eq!(Immediate::decode(i.encode()), i);
        assert_eq!(
            Immediate::decode(0x0102_0304),
            Immediate {
                epoch: 1,
                slot: 2,
                seq: 0x0304
            }
        );
    }

    #[test]
    fn a_single_rank_or_an_empty_buffer_is_done_at_once() {
        let now = Instant::now();
        for (world, count) in [(1, 100), (4, 0)] {
            let plan = Plan::new(world, count, 4, 64, 2).unwrap();
            let mut s = RingSchedule::new(plan, 0, 0, Duration::from_secs(1), now);
            assert_eq!(
                s.poll_action(),
                Some(Action::Done),
                "world {world} count {count}"
            );
            assert!(s.is_done());
        }
    }

    #[test]
    fn standing_grants_start_without_grants_and_sends_wait_for_the_release() {
        let now = Instant::now();
        let plan = Plan::new(2, 64, 4, 64, 2).unwrap(); // 2 chunks per segment
        let mut s = RingSchedule::new_standing(plan, 0, 3, Duration::from_secs(1), now);
        assert_eq!(s.poll_action(), None, "no grants, and nothing to send yet");
        s.handle_released(now).unwrap();
        assert!(matches!(
            s.poll_action(),
            Some(Action::Send { slot: 0, .. })
        ));
        assert!(matches!(
            s.poll_action(),
            Some(Action::Send { slot: 1, .. })
        ));
        assert_eq!(s.send_step(0), Some(0));
        // Our slots were standing too: the peer's first chunk lands without a grant from us.
        let imm = Immediate {
            epoch: 3,
            slot: 0,
            seq: 0,
        };
        assert_eq!(s.handle_arrived(imm.encode(), now), Ok(Arrival::Accepted));
        // A second release is the peer's protocol violation.
        assert!(matches!(
            s.handle_released(now),
            Err(Error::Protocol { rank: 1, .. })
        ));
    }

    #[test]
    fn the_first_actions_are_grants_then_sends_wait_for_grants() {
        let now = Instant::now();
        let plan = Plan::new(2, 64, 4, 64, 2).unwrap(); // 16 elements per chunk, 2 chunks per segment
        let mut s = RingSchedule::new(plan, 0, 3, Duration::from_secs(1), now);
        assert_eq!(s.poll_action(), Some(Action::Grant { slot: 0 }));
        assert_eq!(s.poll_action(), Some(Action::Grant { slot: 1 }));
        assert_eq!(
            s.poll_action(),
            None,
            "nothing to send before the peer grants"
        );
        s.handle_granted(1, now).unwrap();
        match s.poll_action() {
            Some(Action::Send {
                unit: 0,
                slot: 1,
                imm,
                elements,
            }) => {
                assert_eq!(
                    Immediate::decode(imm),
                    Immediate {
                        epoch: 3,
                        slot: 1,
                        seq: 0
                    }
                );
                assert_eq!(elements, 0..16);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn protocol_violations_fail_naming_the_peer() {
        let now = Instant::now();
        let plan = Plan::new(3, 30, 4, 40, 2).unwrap();
        let mut s = RingSchedule::new(plan, 1, 0, Duration::from_secs(1), now);
        assert!(matches!(
            s.handle_granted(9, now),
            Err(Error::Protocol { rank: 2, .. })
        ));
        let mut s = RingSchedule::new(plan, 1, 0, Duration::from_secs(1), now);
        let wrong_seq = Immediate {
            epoch: 0,
            slot: 0,
            seq: 5,
        }
        .encode();
        assert!(matches!(
            s.handle_arrived(wrong_seq, now),
            Err(Error::Protocol { rank: 0, .. })
        ));
        let mut s = RingSchedule::new(plan, 1, 0, Duration::from_secs(1), now);
        let ungranted = Immediate {
            epoch: 0,
            slot: 7,
            seq: 0,
        }
        .encode();
        assert!(
            matches!(s.handle_arrived(ungranted, now), Err(Error::Protocol { rank: 0, reason }) if reason.contains("without a grant"))
        );
        assert!(s.is_failed());
        assert!(
            s.handle_granted(0, now).is_err(),
            "a failed collective takes no more input"
        );
    }

    #[test]
    fn stale_epochs_are_ignored_and_silence_times_out() {
        let now = Instant::now();
        let plan = Plan::new(2, 8, 4, 64, 1).unwrap();
        let mut s = RingSchedule::new(plan, 0, 5, Duration::from_millis(100), now);
        assert_eq!(
            s.handle_arrived(
                Immediate {
                    epoch: 4,
                    slot: 0,
                    seq: 0
                }
                .encode(),
                now
            ),
            Ok(Arrival::Stale)
        );
        assert_eq!(s.stale_arrivals(), 1);
        s.handle_timeout(now + Duration::from_millis(50));
        assert!(!s.is_failed());
        assert_eq!(s.poll_timeout(), Some(now + Duration::from_millis(100)));
        s.handle_timeout(now + Duration::from_millis(100));
        let failed =
            std::iter::from_fn(|| s.poll_action()).find(|a| matches!(a, Action::Failed(_)));
        match failed {
            Some(Action::Failed(Error::Timeout {
                waiting_for, rank, ..
            })) => {
                assert!(waiting_for.contains("slot grant"), "{waiting_for}");
                assert_eq!(rank, Some(1), "the rank waited on");
            }
            other => panic!("{other:?}"),
        }
    }
}

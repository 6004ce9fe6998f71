//! Running one collective's schedule: first chunks out early where that is safe, the
//! descriptor check, landed chunks reduced or copied, slots granted as they free up.

use super::*;

impl HostRing<'_> {
    /// Whether first-step chunks (this rank's own input) may go before the next rank's
    /// descriptor matched ours: only in shapes where every rank's completion
    /// waits for a later chunk of every other rank but one, each sent only after its sender's
    /// check (an allreduce, reduce-scatter or all-gather whose segments all hold data): a rank
    /// then finishes only where every pair of neighbours but one checked each other, which
    /// chains them all. Every other chunk waits for the check.
    pub(super) fn first_steps_may_go_early(plan: &Plan) -> bool {
        matches!(
            plan.shape,
            Shape::AllReduce | Shape::ReduceScatter | Shape::AllGather
        ) && (0..plan.world).all(|s| plan.chunks_in(s) > 0)
    }

    /// Runs `plan` (the collective `what`) to its end: actions out of the schedule, then, until
    /// it is done and agreed, the neighbours' notifications into it.
    pub(super) fn run_until_end(
        &mut self,
        plan: Plan,
        what: &Descriptor,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
        ops: &mut dyn ChunkOps,
    ) -> Result<()> {
        let mut run = self.begin(plan, what)?;
        loop {
            self.act(&mut run, ops)?;
            if run.done && run.agreed {
                return Ok(());
            }
            if let Err(e) = alive() {
                run.stop(e)?;
                continue;
            }
            let now = self.collect(&mut run)?;
            self.handle_events(&mut run, now)?;
            run.sched.handle_timeout(now);
        }
    }

    /// The collective's schedule, and its agreement begun: a rank that sends checks its next
    /// rank's descriptor, which a rank that receives writes to its previous rank first thing
    /// (with a release it owes, if any).
    fn begin<'w>(&mut self, plan: Plan, what: &'w Descriptor) -> Result<Run<'w>> {
        let epoch = (what.seq & 0x7f) as u8;
        let parity = usize::from(epoch & 1) * descriptor::ENCODED_LEN;
        if self.bell.len() < BELL_BYTES || self.prev_slots.len < BELL_BYTES as u64 {
            return Err(Error::InvalidArgument {
                reason: format!("doorbell regions must hold {BELL_BYTES} bytes"),
            });
        }
        let halves = self.halves();
        // This collective's slots: its parity's half (or all of them).
        let per = self.slots_per_collective() as usize;
        let base = if halves {
            usize::from(epoch & 1) * per
        } else {
            0
        };
        let now = Instant::now();
        let first_steps_early = Self::first_steps_may_go_early(&plan);
        let es = plan.elem_size as usize;
        let mut sched = if halves {
            RingSchedule::new_standing(plan, self.rank, epoch, self.options.timeout, now)
        } else {
            RingSchedule::new(plan, self.rank, epoch, self.options.timeout, now)
        };
        if halves && what.seq < 2 && !sched.is_done() {
            // The first two collectives find every slot free.
            sched.handle_released(now)?;
        }
        let (sends, recvs) = sched.units();
        if self.world > 1 {
            if let Some(i) = self.owed.iter().position(|e| *e == epoch) {
                self.owed.swap_remove(i);
                self.notify_prev(Notice::Release { epoch }.encode())?;
            }
            if recvs > 0 {
                self.describe(what, epoch, parity)?;
            }
        }
        // What neighbours already sent for this collective while the previous ones ran.
        let mut replay = Vec::new();
        for v in std::mem::take(&mut self.backlog) {
            match ahead(epoch_of(v), epoch) {
                0 => replay.push(unmark(v)),
                1..=63 => self.backlog.push(v),
                _ => {}
            }
        }
        Ok(Run {
            sched,
            what,
            epoch,
            halves,
            base,
            per,
            es,
            first_steps_early,
            agreed: self.world == 1 || sends == 0,
            done: false,
            held: std::collections::VecDeque::new(),
            events: Vec::new(),
            polled: Vec::new(),
            polled_any: Vec::new(),
            last_event: Instant::now(),
            replay,
        })
    }

    /// Writes `what` into the previous rank's descriptor cell of `parity`, announced with a
    /// description notice.
    fn describe(&mut self, what: &Descriptor, epoch: u8, parity: usize) -> Result<()> {
        let at = DESCRIPTOR_SOURCE_AT + parity;
        self.bell.write_at(at, &what.encode())?;
        let prev = match &mut self.links {
            Links::One(c) => &mut **c,
            Links::Two { prev, .. } => &mut **prev,
        };
        prev.write_deferred(
            &self.bell,
            at..at + descriptor::ENCODED_LEN,
            &self.prev_slots,
            (DESCRIPTOR_AT + parity) as u64,
            Some(
                Notice::Describe {
                    epoch,
                    tag: what.tag(),
                }
                .encode(),
            ),
        )?;
        Ok(())
    }

    /// Carries out every action the schedule has now (sends held back until the agreement
    /// go once it came).
    fn act(&mut self, run: &mut Run<'_>, ops: &mut dyn ChunkOps) -> Result<()> {
        loop {
            let action = match run.held.front() {
                Some(_) if run.agreed => run.held.pop_front(),
                _ => run.sched.poll_action(),
            };
            let Some(action) = action else {
                return Ok(());
            };
            let now = Instant::now();
            match action {
                Action::Send { unit, .. } if !run.may_send(unit) => run.held.push_back(action),
                Action::Send {
                    unit,
                    elements,
                    slot,
                    imm,
                } => {
                    let es = run.es;
                    let bytes = (elements.start as usize * es)..(elements.end as usize * es);
                    let next = match &mut self.links {
                        Links::One(c) => &mut **c,
                        Links::Two { next, .. } => &mut **next,
                    };
                    // Held back with the other small writes until this rank next looks for
                    // events (one system call for them all); larger ones go at once.
                    next.write_deferred(
                        &self.work,
                        bytes,
                        &self.next_slots,
                        ((run.base + usize::from(slot)) * self.options.slot_bytes) as u64,
                        Some(imm),
                    )?;
                    run.sched.handle_sent(unit, now)?;
                }
                Action::Reduce {
                    unit,
                    ref elements,
                    slot,
                }
                | Action::Copy {
                    unit,
                    ref elements,
                    slot,
                } => {
                    let chunk = run.chunk(elements.clone(), slot, self);
                    if matches!(action, Action::Reduce { .. }) {
                        ops.reduce(&self.work, &self.recv, chunk)?;
                    } else {
                        ops.copy(&self.work, &self.recv, chunk)?;
                    }
                    run.sched.handle_processed(unit, now)?;
                }
                Action::Grant { slot } => {
                    let slot = (run.base + usize::from(slot)) as u8;
                    let (epoch, tag) = (run.epoch, run.what.tag());
                    self.notify_prev(Notice::Grant { epoch, slot, tag }.encode())?;
                }
                Action::Done => run.done = true,
                Action::Failed(e) => return Err(e),
            }
        }
    }

    /// Collects notifications: what came early first, else polls without blocking for `spin`
    /// after the last one, then waits in short slices so that both neighbours are served and
    /// the deadline is checked. When it collected them.
    fn collect(&mut self, run: &mut Run<'_>) -> Result<Instant> {
        let spinning = run.last_event.elapsed() < self.options.spin;
        run.events.clear();
        if !run.replay.is_empty() {
            // What came early (a release, a description) is handled before this rank looks
            // for more: the first chunks it unblocks then leave with its description, in one
            // write.
            run.events.append(&mut run.replay);
        } else {
            match &mut self.links {
                Links::One(c) => {
                    run.polled.clear();
                    c.poll(&mut run.polled)?;
                    if run.polled.is_empty() && spinning {
                        pause(self.options.spin_yields);
                    } else if run.polled.is_empty() {
                        wait_slice(&mut **c, &mut run.polled)?;
                    }
                    // One peer is both neighbours: data and end notices count as its.
                    let polled = run.polled.iter();
                    run.events
                        .extend(polled.map(|Event::Notified(v)| (true, *v)));
                }
                Links::Two { next, prev } => {
                    // Grants come from next, data from prev: wait on both at once.
                    run.polled_any.clear();
                    let slice = if spinning {
                        Duration::ZERO
                    } else {
                        Duration::from_micros(200)
                    };
                    let d = Deadline::after(slice);
                    // (The previous rank first: where a transport is waited on in turn, the
                    // data it sends matters more than the next rank's rarer grants.)
                    match wait_any(&mut [&mut **prev, &mut **next], &mut run.polled_any, d) {
                        Ok(()) | Err(nodetour_core::Error::Timeout { .. }) => {}
                        Err(e) => return Err(e.into()),
                    }
                    if run.polled_any.is_empty() && spinning {
                        pause(self.options.spin_yields);
                    }
                    let polled = run.polled_any.iter();
                    run.events
                        .extend(polled.map(|(i, Event::Notified(v))| (*i == 0, *v)));
                }
            }
        }
        let now = Instant::now();
        if !run.events.is_empty() {
            run.last_event = now;
        }
        Ok(now)
    }

    /// Hands the notifications collected to the schedule. Later collectives' notices first
    /// (kept for them: a neighbour that finished first already released or described them),
    /// so that none is lost when one of this collective's ends it; a stale one's are dropped.
    fn handle_events(&mut self, run: &mut Run<'_>, now: Instant) -> Result<()> {
        let epoch = run.epoch;
        for &(from_prev, v) in &run.events {
            if (1..=63).contains(&ahead(epoch_of(v), epoch)) {
                self.backlog.push(mark(from_prev, v));
            }
        }
        for i in 0..run.events.len() {
            let (from_prev, v) = run.events[i];
            if ahead(epoch_of(v), epoch) != 0 {
                continue;
            }
            if v & GRANT_BIT == 0 {
                run.sched.handle_arrived(v, now)?;
            } else {
                self.handle_notice(run, from_prev, v, now)?;
            }
        }
        Ok(())
    }

    /// One notice `v` of this collective from a neighbour (the previous rank's if
    /// `from_prev`).
    fn handle_notice(
        &mut self,
        run: &mut Run<'_>,
        from_prev: bool,
        v: u32,
        now: Instant,
    ) -> Result<()> {
        let next_rank = (self.rank + 1) % self.world;
        let from = if from_prev {
            (self.rank + self.world - 1) % self.world
        } else {
            next_rank
        };
        let (what, epoch, me) = (run.what, run.epoch, (self.rank, next_rank));
        match Notice::decode(v) {
            Some(Notice::Describe { tag, .. }) if !from_prev || self.world == 2 => {
                // Before anything but first chunks is sent: does the next rank call the same
                // collective?
                agree(what, &self.bell, epoch, tag, true, me)?;
                run.agreed = true;
            }
            Some(Notice::Grant { slot, tag, .. }) if run.agreed => {
                agree(what, &self.bell, epoch, tag, false, me)?;
                let Some(s) = usize::from(slot)
                    .checked_sub(run.base)
                    .filter(|s| *s < run.per)
                else {
                    return Err(Error::Protocol {
                        rank: next_rank,
                        reason: format!("granted slot {slot}, outside this collective's"),
                    });
                };
                run.sched.handle_granted(s as u8, now)?;
            }
            Some(Notice::Release { .. }) if run.halves && (!from_prev || self.world == 2) => {
                // (A rank with nothing to send may be done before it comes.)
                if !run.sched.is_done() {
                    run.sched.handle_released(now)?;
                }
            }
            Some(Notice::End { cause, .. }) => {
                return Err(Error::PeerFailed {
                    peer: from,
                    seq: what.seq,
                    cause: self.blame(run, cause, now),
                });
            }
            _ => {
                return Err(Error::Protocol {
                    rank: from,
                    reason: format!("an unexpected notice {v:#010x}"),
                });
            }
        }
        Ok(())
    }

    /// The cause an end notice gives, corrected: blamed for not responding while this rank
    /// itself has waited on a neighbour for most of the timeout, that neighbour is the one
    /// (the accuser waited on this rank because this rank waited on it). A rank that waited
    /// little (it was stopped, or late) keeps the blame.
    fn blame(&self, run: &Run<'_>, cause: RootCause, now: Instant) -> RootCause {
        match run.sched.waiting_on(now) {
            Some((w, waited))
                if cause == RootCause::new(self.rank, CauseKind::Timeout)
                    && w != self.rank
                    && waited >= self.options.timeout / 2 =>
            {
                RootCause::new(w, CauseKind::Timeout)
            }
            _ => cause,
        }
    }
}

/// One collective running on a host ring: its schedule and what the loop that drives it keeps
/// between turns.
struct Run<'w> {
    sched: RingSchedule,
    what: &'w Descriptor,
    epoch: u8,
    /// Whether collectives alternate between two halves of the slots; this one's first slot,
    /// and its slots.
    halves: bool,
    base: usize,
    per: usize,
    /// Element size.
    es: usize,
    first_steps_early: bool,
    /// Whether the next rank's descriptor matched (or there is nothing to check).
    agreed: bool,
    done: bool,
    /// Sends that wait for the agreement, in the schedule's order.
    held: std::collections::VecDeque<Action>,
    /// Notifications collected this turn: (from the previous rank?, value).
    events: Vec<(bool, u32)>,
    polled: Vec<Event>,
    polled_any: Vec<(usize, Event)>,
    last_event: Instant,
    /// What neighbours sent for this collective before it began, handled first.
    replay: Vec<(bool, u32)>,
}

impl Run<'_> {
    /// Whether send `unit` may go now: once agreed, or, first in line, a first-step chunk
    /// where those may go early.
    fn may_send(&self, unit: u32) -> bool {
        self.agreed
            || self.held.is_empty()
                && self.first_steps_early
                && self.sched.send_step(unit) == Some(0)
    }

    /// The chunk of `elements` landed in `slot` of this collective.
    fn chunk(&self, elements: std::ops::Range<u64>, slot: u8, ring: &HostRing<'_>) -> Chunk {
        Chunk {
            slot: (self.base + usize::from(slot)) * ring.options.slot_bytes,
            at: elements.start as usize * self.es,
            n: (elements.end - elements.start) as usize * self.es,
        }
    }

    /// Ends the collective on `failed` (the caller's liveness check: a lost peer, an abort
    /// from another thread, anything else it reports); its epoch is spent, so its late writes
    /// are stale. Finished here but never agreed with the next rank is not a success.
    fn stop(&mut self, failed: nodetour_core::Error) -> Result<()> {
        match Error::from(failed) {
            Error::PeerLost { rank } => self.sched.handle_peer_lost(rank),
            Error::Aborted { reason } => self.sched.abort(reason),
            other => self.sched.abort(other.to_string()),
        }
        if self.done {
            return Err(Error::Aborted {
                reason: "the collective ended before the next rank's descriptor came".into(),
            });
        }
        Ok(())
    }
}

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

    pub(super) fn run_until_end(
        &mut self,
        plan: Plan,
        what: &Descriptor,
        alive: &dyn Fn() -> nodetour_core::Result<()>,
        ops: &mut dyn ChunkOps,
    ) -> Result<()> {
        let es = plan.elem_size as usize;
        let slot_bytes = self.options.slot_bytes;
        let epoch = (what.seq & 0x7f) as u8;
        let parity = usize::from(epoch & 1) * descriptor::ENCODED_LEN;
        let tag = what.tag();
        let (next_rank, prev_rank) = (
            (self.rank + 1) % self.world,
            (self.rank + self.world - 1) % self.world,
        );
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
        // Agreement: a rank that sends checks its next rank's descriptor, which a rank that
        // receives writes to its previous rank first thing (with a release it owes, if any).
        let mut agreed = self.world == 1 || sends == 0;
        if self.world > 1 {
            if let Some(i) = self.owed.iter().position(|e| *e == epoch) {
                self.owed.swap_remove(i);
                self.notify_prev(Notice::Release { epoch }.encode())?;
            }
            if recvs > 0 {
                self.bell
                    .write_at(DESCRIPTOR_SOURCE_AT + parity, &what.encode())?;
                let prev = match &mut self.links {
                    Links::One(c) => &mut **c,
                    Links::Two { prev, .. } => &mut **prev,
                };
                let at = DESCRIPTOR_SOURCE_AT + parity;
                prev.write_deferred(
                    &self.bell,
                    at..at + descriptor::ENCODED_LEN,
                    &self.prev_slots,
                    (DESCRIPTOR_AT + parity) as u64,
                    Some(Notice::Describe { epoch, tag }.encode()),
                )?;
            }
        }
        let first_steps_early = Self::first_steps_may_go_early(&plan);
        let mut done = false;
        // Sends that wait for the agreement, in the schedule's order.
        let mut held: std::collections::VecDeque<Action> = std::collections::VecDeque::new();
        // (from the previous rank?, value)
        let mut events: Vec<(bool, u32)> = Vec::new();
        let mut polled: Vec<Event> = Vec::new();
        let mut polled_any: Vec<(usize, Event)> = Vec::new();
        let mut last_event = Instant::now();
        // What neighbours already sent for this collective while the previous ones ran.
        let early: Vec<u32> = std::mem::take(&mut self.backlog);
        let mut replay: Vec<(bool, u32)> = Vec::new();
        for v in early {
            match ahead(epoch_of(v), epoch) {
                0 => replay.push(unmark(v)),
                1..=63 => self.backlog.push(v),
                _ => {}
            }
        }
        loop {
            loop {
                let action = match held.front() {
                    Some(_) if agreed => held.pop_front(),
                    _ => sched.poll_action(),
                };
                let Some(action) = action else { break };
                let now = Instant::now();
                let reduce = matches!(action, Action::Reduce { .. });
                match action {
                    Action::Send { unit, .. }
                        if !(agreed
                            || held.is_empty()
                                && first_steps_early
                                && sched.send_step(unit) == Some(0)) =>
                    {
                        held.push_back(action);
                    }
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
                        // Held back with the other small writes until this rank next looks for
                        // events (one system call for them all); larger ones go at once.
                        next.write_deferred(
                            &self.work,
                            bytes,
                            &self.next_slots,
                            ((base + usize::from(slot)) * slot_bytes) as u64,
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
                            slot: (base + usize::from(slot)) * slot_bytes,
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
                        let slot = (base + usize::from(slot)) as u8;
                        self.notify_prev(Notice::Grant { epoch, slot, tag }.encode())?;
                    }
                    Action::Done => done = true,
                    Action::Failed(e) => return Err(e),
                }
            }
            if done && agreed {
                return Ok(());
            }
            if let Err(e) = alive() {
                match Error::from(e) {
                    Error::PeerLost { rank } => sched.handle_peer_lost(rank),
                    // An abort from another thread, or anything else the caller's check
                    // reports, ends the collective; its epoch is spent, so its late writes are
                    // stale.
                    Error::Aborted { reason } => sched.abort(reason),
                    other => sched.abort(other.to_string()),
                }
                if done {
                    // Finished here but never agreed with the next rank: not a success.
                    return Err(Error::Aborted {
                        reason: "the collective ended before the next rank's descriptor came"
                            .into(),
                    });
                }
                continue;
            }
            // Collect notifications: poll without blocking for `spin` after the last one, then
            // wait in short slices so that both neighbours are served and the deadline is
            // checked.
            let spinning = last_event.elapsed() < self.options.spin;
            events.clear();
            if !replay.is_empty() {
                // What came early (a release, a description) is handled before this rank
                // looks for more: the first chunks it unblocks then leave with its
                // description, in one write.
                events.append(&mut replay);
            } else {
                match &mut self.links {
                    Links::One(c) => {
                        polled.clear();
                        c.poll(&mut polled)?;
                        if polled.is_empty() && spinning {
                            pause(self.options.spin_yields);
                        } else if polled.is_empty() {
                            wait_slice(&mut **c, &mut polled)?;
                        }
                        // One peer is both neighbours: data and end notices count as its.
                        events.extend(polled.iter().map(|Event::Notified(v)| (true, *v)));
                    }
                    Links::Two { next, prev } => {
                        // Grants come from next, data from prev: wait on both at once.
                        polled_any.clear();
                        let slice = if spinning {
                            Duration::ZERO
                        } else {
                            Duration::from_micros(200)
                        };
                        let d = Deadline::after(slice);
                        // (The previous rank first: where a transport is waited on in turn, the
                        // data it sends matters more than the next rank's rarer grants.)
                        match wait_any(&mut [&mut **prev, &mut **next], &mut polled_any, d) {
                            Ok(()) | Err(nodetour_core::Error::Timeout { .. }) => {}
                            Err(e) => return Err(e.into()),
                        }
                        if polled_any.is_empty() && spinning {
                            pause(self.options.spin_yields);
                        }
                        events.extend(
                            polled_any
                                .iter()
                                .map(|(i, Event::Notified(v))| (*i == 0, *v)),
                        );
                    }
                }
            }
            let now = Instant::now();
            if !events.is_empty() {
                last_event = now;
            }
            // Later collectives' notices first (kept for them: a neighbour that finished first
            // already released or described them), so that none is lost when one of this
            // collective's ends it; a stale one's are dropped.
            for &(from_prev, v) in &events {
                if (1..=63).contains(&ahead(epoch_of(v), epoch)) {
                    self.backlog.push(mark(from_prev, v));
                }
            }
            for &(from_prev, v) in &events {
                if ahead(epoch_of(v), epoch) != 0 {
                    continue;
                }
                if v & GRANT_BIT == 0 {
                    sched.handle_arrived(v, now)?;
                    continue;
                }
                let from = if from_prev { prev_rank } else { next_rank };
                match Notice::decode(v) {
                    Some(Notice::Describe { tag, .. }) if !from_prev || self.world == 2 => {
                        // Before anything but first chunks is sent: does the next rank call the
                        // same collective?
                        agree(what, &self.bell, epoch, tag, true, (self.rank, next_rank))?;
                        agreed = true;
                    }
                    Some(Notice::Grant { slot, tag, .. }) if agreed => {
                        agree(what, &self.bell, epoch, tag, false, (self.rank, next_rank))?;
                        let Some(s) = usize::from(slot).checked_sub(base).filter(|s| *s < per)
                        else {
                            return Err(Error::Protocol {
                                rank: next_rank,
                                reason: format!("granted slot {slot}, outside this collective's"),
                            });
                        };
                        sched.handle_granted(s as u8, now)?;
                    }
                    Some(Notice::Release { .. }) if halves && (!from_prev || self.world == 2) => {
                        // (A rank with nothing to send may be done before it comes.)
                        if !sched.is_done() {
                            sched.handle_released(now)?;
                        }
                    }
                    Some(Notice::End { cause, .. }) => {
                        // Blamed for not responding while this rank itself has waited on a
                        // neighbour for most of the timeout: that neighbour is the one (the
                        // accuser waited on this rank because this rank waited on it). A rank
                        // that waited little (it was stopped, or late) keeps the blame.
                        let cause = match sched.waiting_on(now) {
                            Some((w, waited))
                                if cause == RootCause::new(self.rank, CauseKind::Timeout)
                                    && w != self.rank
                                    && waited >= self.options.timeout / 2 =>
                            {
                                RootCause::new(w, CauseKind::Timeout)
                            }
                            _ => cause,
                        };
                        return Err(Error::PeerFailed {
                            peer: from,
                            seq: what.seq,
                            cause,
                        });
                    }
                    _ => {
                        return Err(Error::Protocol {
                            rank: from,
                            reason: format!("an unexpected notice {v:#010x}"),
                        });
                    }
                }
            }
            sched.handle_timeout(now);
        }
    }
}

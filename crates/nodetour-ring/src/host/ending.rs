//! Ending a collective: the end notices a failing rank sends both neighbours, and the cause
//! a rank reports (what it was told beats a departure that overtook the telling).

use super::*;

impl HostRing<'_> {
    /// What this rank tells its neighbours for its error `e` (the rank at fault, in ring
    /// positions). A timeout blames the neighbour waited on, but that neighbour may itself be
    /// waiting on another rank (the ranks of a ring that stalls time out together): it is told
    /// first, alone, and given a short grace to answer with what it knows; its answer, where it
    /// names another rank, becomes this rank's error and cause. A rank that does not answer
    /// (frozen, stopped) keeps the blame.
    pub(super) fn settle_cause(
        &mut self,
        epoch: u8,
        seq: u64,
        result: &mut Result<()>,
        e: &Error,
    ) -> RootCause {
        let me = self.rank;
        let cause = e.cause_to_tell(me);
        if matches!(e, Error::PeerLost { .. } | Error::Transport { .. }) {
            // A rank that disagreed or aborted tells its neighbours, then leaves: its departure
            // (seen on the liveness mesh or as a closed link) can overtake what it told, which
            // travels on another connection or through a neighbour. What it told is the cause.
            let grace = (self.options.timeout / 4).min(END_GRACE);
            if let Some((peer, theirs)) = self.wait_for_told_cause(epoch, Deadline::after(grace)) {
                *result = Err(Error::PeerFailed {
                    peer,
                    seq,
                    cause: theirs,
                });
                return theirs;
            }
            return cause;
        }
        let Error::Timeout { rank: Some(x), .. } = *e else {
            return cause;
        };
        let prev = (me + self.world - 1) % self.world;
        let next = (me + 1) % self.world;
        if self.world < 2 || x == me || (x != prev && x != next) {
            return cause;
        }
        self.send_end(epoch, cause, x == next, x == prev);
        let _ = self.flush();
        let grace = (self.options.timeout / 4).min(END_GRACE);
        match self.wait_for_end(epoch, x == prev, cause, Deadline::after(grace)) {
            Some(theirs) if theirs.rank != me && theirs != cause => {
                *result = Err(Error::PeerFailed {
                    peer: x,
                    seq,
                    cause: theirs,
                });
                theirs
            }
            _ => cause,
        }
    }

    /// Waits until `deadline` for the end notice of collective `epoch` from one neighbour (the
    /// previous rank's with `from_prev`; with one link, the one peer's); notices of later
    /// collectives are kept for them, everything else of this one is dropped (it ended). A
    /// neighbour that timed out on this rank meanwhile (it blames this rank) is answered at
    /// once with `ours`, what this rank knows, rather than after the wait.
    pub(super) fn wait_for_end(
        &mut self,
        epoch: u8,
        from_prev: bool,
        ours: RootCause,
        deadline: Deadline,
    ) -> Option<RootCause> {
        let accused = RootCause::new(self.rank, CauseKind::Timeout);
        let mut polled: Vec<Event> = Vec::new();
        let mut polled_any: Vec<(usize, Event)> = Vec::new();
        loop {
            let mut events: Vec<(bool, u32)> = Vec::new();
            let slice = Deadline::after(Duration::from_millis(2).min(deadline.remaining()));
            match &mut self.links {
                Links::One(c) => {
                    polled.clear();
                    let _ = c.wait(&mut polled, slice);
                    events.extend(polled.iter().map(|Event::Notified(v)| (from_prev, *v)));
                }
                Links::Two { next, prev } => {
                    polled_any.clear();
                    let _ = wait_any(&mut [&mut **prev, &mut **next], &mut polled_any, slice);
                    events.extend(
                        polled_any
                            .iter()
                            .map(|(i, Event::Notified(v))| (*i == 0, *v)),
                    );
                }
            }
            for (side, v) in events {
                match ahead(epoch_of(v), epoch) {
                    0 => {
                        if let Some(Notice::End { cause, .. }) = Notice::decode(v) {
                            if side == from_prev {
                                return Some(cause);
                            }
                            if cause == accused {
                                self.send_end(epoch, ours, !side, side);
                                let _ = self.flush();
                            }
                        }
                    }
                    1..=63 => self.backlog.push(mark(side, v)),
                    _ => {}
                }
            }
            if deadline.expired() {
                return None;
            }
        }
    }

    /// Waits until `deadline` for an end notice of collective `epoch` from either neighbour
    /// that names a deliberate cause (a disagreement or an abort): `(the neighbour, the
    /// cause)`. A link that has ended gives what arrived on it before it ended and is then
    /// left alone; with every link ended, or at the deadline, `None`. Notices of later
    /// collectives are kept for them.
    pub(super) fn wait_for_told_cause(
        &mut self,
        epoch: u8,
        deadline: Deadline,
    ) -> Option<(u32, RootCause)> {
        let world = self.world;
        let prev_rank = (self.rank + world - 1) % world;
        let next_rank = (self.rank + 1) % world;
        let mut ended = [false; 2];
        let mut got: Vec<Event> = Vec::new();
        loop {
            let mut events: Vec<(bool, u32)> = Vec::new();
            let live = ended.iter().filter(|e| !**e).count().max(1) as u32;
            let slice = Duration::from_millis(2) / live;
            let mut links: Vec<(usize, bool, &mut dyn HostConnection)> = match &mut self.links {
                Links::One(c) => vec![(0, true, &mut **c)],
                Links::Two { next, prev } => vec![(0, true, &mut **prev), (1, false, &mut **next)],
            };
            for (i, from_prev, c) in links.iter_mut() {
                if ended[*i] {
                    continue;
                }
                got.clear();
                let d = Deadline::after(slice.min(deadline.remaining()));
                match c.wait(&mut got, d) {
                    Ok(()) | Err(nodetour_core::Error::Timeout { .. }) => {}
                    Err(_) => ended[*i] = true,
                }
                events.extend(got.iter().map(|Event::Notified(v)| (*from_prev, *v)));
            }
            drop(links);
            for (from_prev, v) in events {
                match ahead(epoch_of(v), epoch) {
                    0 => {
                        if let Some(Notice::End { cause, .. }) = Notice::decode(v)
                            && matches!(cause.kind, CauseKind::Disagreement | CauseKind::Aborted)
                        {
                            let from = if from_prev { prev_rank } else { next_rank };
                            return Some((from, cause));
                        }
                    }
                    1..=63 => self.backlog.push(mark(from_prev, v)),
                    _ => {}
                }
            }
            let links = if matches!(self.links, Links::One(_)) {
                1
            } else {
                2
            };
            if ended[..links].iter().all(|e| *e) || deadline.expired() {
                return None;
            }
        }
    }

    /// An end notice with `cause` to the next and/or the previous rank (one write where one
    /// link is both).
    pub(super) fn send_end(&mut self, epoch: u8, cause: RootCause, to_next: bool, to_prev: bool) {
        // A position beyond what a notice can name: the sender's own failure.
        let cause = if cause.rank < END_RANKS {
            cause
        } else {
            RootCause::new(self.rank.min(END_RANKS - 1), CauseKind::Failed)
        };
        let value = Notice::End { epoch, cause }.encode();
        let (work, next_slots, prev_slots) = (&self.work, self.next_slots, self.prev_slots);
        match &mut self.links {
            Links::One(c) => {
                let _ = c.write_deferred(work, 0..0, &next_slots, 0, Some(value));
            }
            Links::Two { next, prev } => {
                if to_next {
                    let _ = next.write_deferred(work, 0..0, &next_slots, 0, Some(value));
                }
                if to_prev {
                    let _ = prev.write_deferred(work, 0..0, &prev_slots, 0, Some(value));
                }
            }
        }
    }
}

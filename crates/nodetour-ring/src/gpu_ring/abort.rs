//! Aborting a ring from any thread, and the end notices and descriptor cells through which
//! neighbours learn that a collective failed or that the ranks disagree on it.

use super::*;

/// Aborts a [`GpuRing`] from any thread. Cheap to clone.
#[derive(Clone)]
pub(crate) struct AbortHandle {
    pub(super) shared: Arc<AbortState>,
}

pub(super) struct AbortState {
    pub(super) failed: Mutex<Option<Error>>,
    // The first collective this rank has not seen finish (what an end notice names).
    pub(super) confirmed: AtomicU64,
    // Set once on abort (after the notices): ends every queued wait, skips every guarded write.
    pub(super) stop: Option<StopWord>,
    pub(super) ends: Option<EndPages>,
    // (ring position, ranks in the ring)
    pub(super) position: (u32, u32),
    // Queued, not yet confirmed collectives: (sequence number, descriptor word, descriptor).
    pub(super) pending: Mutex<std::collections::VecDeque<(u64, u32, Descriptor)>>,
    pub(super) desc_cells: (u32, u32),
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
pub(super) fn desc_cell((first, count): (u32, u32), seq: u64) -> u32 {
    first + (seq % u64::from(count)) as u32
}

/// The word a descriptor cell holds for collective `seq` with tag `tag` (never 0).
pub(super) fn desc_word(seq: u64, tag: u16) -> u32 {
    ((seq as u32 & 0xffff) << 16) | 0x8000 | u32::from(tag & 0x7fff)
}

/// The value of an end notice for collective `seq` (never 0, which means "none").
pub(super) fn notice_value(seq: u64) -> u32 {
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
    pub(crate) fn abort(&self, reason: &str) {
        self.abort_with(Error::Aborted {
            reason: reason.to_owned(),
        });
    }

    pub(super) fn abort_with(&self, error: Error) {
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
        if let Some(stop) = &self.shared.stop
            && let Err(e) = stop.set()
        {
            tracing::error!(error = %e, "could not set the GPU ring's stop word");
        }
    }

    /// Sets the stop word (unless the GPU set it first) and nothing else: no end notice, no
    /// error recorded. For a ring closing in order.
    pub(super) fn stop_quietly(&self) {
        if let Some(stop) = &self.shared.stop
            && let Err(e) = stop.set()
        {
            tracing::error!(error = %e, "could not set the GPU ring's stop word");
        }
    }

    /// The error the ring ended with, if it did.
    pub(crate) fn error(&self) -> Option<Error> {
        self.shared.failed.lock().ok().and_then(|f| f.clone())
    }

    /// Reads the neighbours' end notices (no side effect): the error, and whether it names a
    /// collective before `queued` (one this rank has queued and not seen finish, whose result
    /// may be garbage) rather than a later one (the ones queued here finish correctly: the
    /// neighbour saw its part of them finish before it ended).
    /// With `captured` (collectives of this ring were captured into CUDA graphs, whose replays
    /// the host does not count) every notice taints: the host cannot tell which replays it
    /// covers.
    pub(super) fn read_notice(&self, queued: u64, captured: bool) -> Option<(Error, bool)> {
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

    pub(super) fn confirm(&self, queued: u64) {
        self.shared.confirmed.store(queued, Ordering::Release);
        if let Ok(mut p) = self.shared.pending.lock() {
            while p.front().is_some_and(|(seq, _, _)| *seq < queued) {
                p.pop_front();
            }
        }
    }

    /// Records collective `seq` as queued, with its descriptor word.
    pub(super) fn expect(&self, seq: u64, word: u32, what: Descriptor) {
        if let Ok(mut p) = self.shared.pending.lock() {
            p.push_back((seq, word, what));
        }
    }

    /// A collective queued here whose descriptor cell holds the previous rank's word for the
    /// same sequence number with another tag: the ranks disagree on what it is.
    pub(super) fn read_disagreement(&self) -> Option<Error> {
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

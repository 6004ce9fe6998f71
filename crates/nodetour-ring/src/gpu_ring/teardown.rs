//! Closing a ring in order: stop, drain (every wait with a deadline), close the mappings of
//! the neighbours' memory, and free what this rank exported once they closed theirs; past
//! the deadline, leak rather than free what a GPU may still use.

use super::*;

/// How long dropping a ring waits for its collectives in flight (after aborting them) before
/// it leaks its streams and slot memory rather than free what a GPU may still use.
pub(crate) const TEARDOWN_DEADLINE: Duration = Duration::from_secs(10);

impl GpuRing {
    /// Ends the ring: waits for the collectives in flight, at most `timeout` (aborting them
    /// first if they have not finished: peers are told), then frees the streams, slot memory
    /// and kernels. Past the deadline it leaks them (never frees memory a GPU may still use)
    /// and says so; `Drop` does the same with [`TEARDOWN_DEADLINE`] and can only log. The
    /// ring refuses collectives afterwards.
    pub(crate) fn close(&mut self, timeout: Duration) -> Result<()> {
        self.shut_down(timeout)
    }

    pub(super) fn drained(&self) -> bool {
        self.marks.end[0].is_complete().unwrap_or(false)
            && self.marks.end[1].is_complete().unwrap_or(false)
    }

    /// The first half of the teardown handshake: drains the streams (aborting collectives in
    /// flight, at most `timeout`), then closes this rank's mappings of its neighbours' memory
    /// (their cuda-ipc slots and flag pages, their shared files) while keeping the memory it
    /// exported itself, which a neighbour may still have mapped. Once every rank has done this
    /// (a barrier, or the liveness mesh saying who is gone), [`GpuRing::close`] frees the rest.
    /// The ring refuses collectives afterwards.
    pub(crate) fn close_imports(&mut self, timeout: Duration) -> Result<()> {
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
    pub(crate) fn leak_exports(&mut self) {
        if let Some(mut e) = self.exports.take() {
            // The link's thread owns what it uses: ending it frees nothing a neighbour maps.
            if let Some(mut net) = e.net.take()
                && let Err(err) = net.close(TEARDOWN_DEADLINE)
            {
                tracing::warn!(error = %err, "closing the GPU ring's network links");
            }
            tracing::error!(
                "a neighbour did not confirm it unmapped this rank's slots: leaking them"
            );
            std::mem::forget(e);
        }
    }

    /// Drains the streams (aborting first if work is in flight) and hands back what they
    /// used, or leaks it all past the deadline.
    pub(super) fn drained_held(&mut self, timeout: Duration) -> Result<Held> {
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
    pub(super) fn keep_for_replays(&mut self) {
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

    pub(super) fn shut_down(&mut self, timeout: Duration) -> Result<()> {
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
}

impl Drop for GpuRing {
    fn drop(&mut self) {
        if let Err(e) = self.shut_down(TEARDOWN_DEADLINE) {
            tracing::warn!(error = %e, "dropping a GPU ring");
        }
    }
}

//! How a buffer is laid out for a ring of `world` ranks: `world` segments (the last ones one
//! element longer when the count does not divide), each cut into chunks of at most one slot.
//! Pure arithmetic, shared by every rank so that sender and receiver agree without talking.

use std::ops::Range;

use crate::error::{Error, Result};

/// The layout of one collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Ranks in the ring.
    pub world: u32,
    /// Elements in the buffer.
    pub count: u64,
    /// Bytes per element.
    pub elem_size: u32,
    /// Elements per chunk (one slot's worth).
    pub chunk_elems: u64,
    /// Slots each receiver grants its previous rank.
    pub slots: u32,
}

impl Plan {
    /// Plans `count` elements of `elem_size` bytes over `world` ranks, with `slots` slots of
    /// `slot_bytes` each.
    pub fn new(
        world: u32,
        count: u64,
        elem_size: u32,
        slot_bytes: u64,
        slots: u32,
    ) -> Result<Plan> {
        let bad = |reason: String| Error::Plan { reason };
        if world == 0 {
            return Err(bad("a ring of zero ranks".into()));
        }
        if elem_size == 0 {
            return Err(bad("elements of zero bytes".into()));
        }
        if slots == 0 || slots > 256 {
            return Err(bad(format!("{slots} slots: between 1 and 256")));
        }
        let chunk_elems = slot_bytes / u64::from(elem_size);
        if chunk_elems == 0 {
            return Err(bad(format!(
                "a slot of {slot_bytes} bytes holds no {elem_size}-byte element"
            )));
        }
        Ok(Plan {
            world,
            count,
            elem_size,
            chunk_elems,
            slots,
        })
    }

    /// Element range of segment `s` (`s < world`).
    pub fn segment(&self, s: u32) -> Range<u64> {
        let n = u64::from(self.world);
        let s = u64::from(s % self.world);
        // Spread the remainder over the last segments: start(s) = floor(s * count / n).
        let start = (u128::from(s) * u128::from(self.count) / u128::from(n)) as u64;
        let end = (u128::from(s + 1) * u128::from(self.count) / u128::from(n)) as u64;
        start..end
    }

    /// Number of chunks of segment `s`.
    pub fn chunks_in(&self, s: u32) -> u32 {
        let r = self.segment(s);
        (r.end - r.start).div_ceil(self.chunk_elems) as u32
    }

    /// Element range of chunk `c` of segment `s`.
    pub fn chunk(&self, s: u32, c: u32) -> Range<u64> {
        let r = self.segment(s);
        let start = (r.start + u64::from(c) * self.chunk_elems).min(r.end);
        start..(start + self.chunk_elems).min(r.end)
    }

    /// Steps of an allreduce: `world − 1` of reduce-scatter, then `world − 1` of all-gather.
    pub fn steps(&self) -> u32 {
        2 * (self.world - 1)
    }

    /// The segment rank `rank` sends at `step`.
    pub fn send_segment(&self, rank: u32, step: u32) -> u32 {
        let n = self.world;
        let rs = n - 1;
        if step < rs {
            (rank + n - step % n) % n // reduce-scatter: (r − s) mod n
        } else {
            (rank + 1 + n - (step - rs) % n) % n // all-gather: (r + 1 − s') mod n
        }
    }

    /// The segment rank `rank` receives (from `rank − 1`) at `step`: what that rank sends.
    pub fn recv_segment(&self, rank: u32, step: u32) -> u32 {
        self.send_segment((rank + self.world - 1) % self.world, step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn bad_plans_are_typed_errors() {
        assert!(Plan::new(0, 10, 4, 64, 2).is_err());
        assert!(Plan::new(2, 10, 0, 64, 2).is_err());
        assert!(Plan::new(2, 10, 4, 2, 2).is_err());
        assert!(Plan::new(2, 10, 4, 64, 0).is_err());
        assert!(Plan::new(2, 10, 4, 64, 257).is_err());
    }

    #[test]
    fn the_ring_moves_each_segment_around_once_per_phase() {
        let p = Plan::new(4, 100, 4, 40, 2).unwrap();
        // Reduce-scatter: rank r ends owning segment (r + 1) mod n after n − 1 steps.
        for r in 0..4 {
            assert_eq!(p.recv_segment(r, 2), (r + 1) % 4);
            // All-gather starts by sending the segment just completed.
            assert_eq!(p.send_segment(r, 3), (r + 1) % 4);
        }
    }

    proptest! {
        #[test]
        fn segments_and_chunks_tile_the_buffer(world in 1u32..17, count in 0u64..10_000, slot in 1u64..5000, elem in 1u32..9) {
            prop_assume!(slot >= u64::from(elem));
            let p = Plan::new(world, count, elem, slot, 4).unwrap();
            let mut next = 0;
            for s in 0..world {
                let seg = p.segment(s);
                prop_assert_eq!(seg.start, next);
                prop_assert!(seg.end - seg.start <= count / u64::from(world) + 1);
                let mut at = seg.start;
                for c in 0..p.chunks_in(s) {
                    let ch = p.chunk(s, c);
                    prop_assert_eq!(ch.start, at);
                    prop_assert!(ch.end > ch.start && ch.end - ch.start <= p.chunk_elems);
                    at = ch.end;
                }
                prop_assert_eq!(at, seg.end);
                next = seg.end;
            }
            prop_assert_eq!(next, count);
        }
    }
}

//! How a buffer is laid out for a ring of `world` ranks: `world` segments (the last ones one
//! element longer when the count does not divide), each cut into chunks of at most one slot,
//! and which segment each rank sends and receives at each step of a collective's [`Shape`].
//! Pure arithmetic, shared by every rank so that sender and receiver agree without talking.
//!
//! Ranks here are ring positions (the executors map job ranks to positions).

use std::ops::Range;

use crate::error::{Error, Result};

/// What moves around the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// Reduce-scatter (`world − 1` steps), then all-gather (`world − 1` steps): every rank ends
    /// with the whole buffer reduced.
    AllReduce,
    /// Reduce-scatter alone (`world − 1` steps): the rank at position `p` ends with segment `p`
    /// reduced (the other segments hold partial sums). The count divides by `world`.
    ReduceScatter,
    /// All-gather alone (`world − 1` steps): the rank at position `p` starts with segment `p`
    /// and ends with every segment. The count divides by `world`.
    AllGather,
    /// Broadcast from position `root` (`world − 1` steps): the buffer is one segment (segment
    /// 0), passed along the ring chunk by chunk (pipelined: a rank forwards a chunk as soon as
    /// it has copied it in).
    Broadcast {
        /// The sending position.
        root: u32,
    },
}

/// The smallest chunk a pipeline cuts a segment into: each chunk pays a hand-off of a few
/// microseconds whatever its size.
pub const PIPELINE_MIN_CHUNK: u64 = 256 << 10;

/// The chunk size, in bytes, for a segment of `segment_bytes` moved through slots of
/// `slot_bytes`, cut into at least `depth` chunks (a pipeline: one chunk's transfer overlaps
/// the previous one's reduce or second copy): the segment's `1 / depth`, but never below
/// [`PIPELINE_MIN_CHUNK`] (nor above a slot), rounded up to 4 KiB so that chunks stay aligned
/// for wide loads. `depth` 1 (or 0): a whole slot. Pure: every rank computes the same value
/// from what it agreed (the count, the type, the ring's shape).
pub fn pipelined_chunk_bytes(slot_bytes: u64, depth: u32, segment_bytes: u64) -> u64 {
    if depth <= 1 {
        return slot_bytes;
    }
    segment_bytes
        .div_ceil(u64::from(depth))
        .max(PIPELINE_MIN_CHUNK)
        .next_multiple_of(4096)
        .min(slot_bytes)
}

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
    /// The collective.
    pub shape: Shape,
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
            shape: Shape::AllReduce,
        })
    }

    /// This plan for `shape` instead of an allreduce: reduce-scatter and all-gather need a
    /// count that divides by `world` (the segments are the ranks' blocks), a broadcast a root
    /// in the ring.
    pub fn with_shape(self, shape: Shape) -> Result<Plan> {
        let bad = |reason: String| Error::Plan { reason };
        match shape {
            Shape::ReduceScatter | Shape::AllGather
                if !self.count.is_multiple_of(u64::from(self.world)) =>
            {
                return Err(bad(format!(
                    "{} elements do not split into {} equal blocks",
                    self.count, self.world
                )));
            }
            Shape::Broadcast { root } if root >= self.world => {
                return Err(bad(format!(
                    "root {root} in a ring of {} ranks",
                    self.world
                )));
            }
            _ => {}
        }
        Ok(Plan { shape, ..self })
    }

    /// Element range of segment `s` (`s < world`).
    pub fn segment(&self, s: u32) -> Range<u64> {
        if let Shape::Broadcast { .. } = self.shape {
            // One segment: the whole buffer.
            return if s == 0 {
                0..self.count
            } else {
                self.count..self.count
            };
        }
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

    /// Steps: an allreduce has `world − 1` of reduce-scatter, then `world − 1` of all-gather;
    /// the other shapes `world − 1`.
    pub fn steps(&self) -> u32 {
        match self.shape {
            Shape::AllReduce => 2 * (self.world - 1),
            _ => self.world - 1,
        }
    }

    /// The segment rank `rank` sends at `step` (none: it sends nothing at that step).
    pub fn send_segment(&self, rank: u32, step: u32) -> Option<u32> {
        let n = self.world;
        let rs = n - 1;
        let back = |by: u32| (rank + n - by % n) % n; // (r − by) mod n
        match self.shape {
            Shape::AllReduce if step < rs => Some(back(step)), // (r − s) mod n
            Shape::AllReduce => Some((back(step - rs) + 1) % n), // (r + 1 − s') mod n
            // (r − s − 1) mod n: the last step delivers segment r to rank r.
            Shape::ReduceScatter => Some(back(step + 1)),
            // (r − s) mod n: the first step sends the rank's own block.
            Shape::AllGather => Some(back(step)),
            Shape::Broadcast { root } => (step < rs && rank == (root + step) % n).then_some(0),
        }
    }

    /// The segment rank `rank` receives (from `rank − 1`) at `step`: what that rank sends.
    pub fn recv_segment(&self, rank: u32, step: u32) -> Option<u32> {
        self.send_segment((rank + self.world - 1) % self.world, step)
    }

    /// Whether what arrives at `step` is reduced into the local buffer (else copied over it).
    pub fn reduces_at(&self, step: u32) -> bool {
        match self.shape {
            Shape::AllReduce => step < self.world - 1,
            Shape::ReduceScatter => true,
            Shape::AllGather | Shape::Broadcast { .. } => false,
        }
    }

    /// The step whose send reads the range that what arrives at `step` overwrites, where such a
    /// send came first (the copy must wait for it to complete locally): an allreduce's
    /// all-gather copies over the segments its reduce-scatter sent.
    pub fn overwrites_send_of(&self, step: u32) -> Option<u32> {
        let rs = self.world - 1;
        match self.shape {
            Shape::AllReduce if step >= rs => Some(step - rs),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_pipeline_cuts_segments_into_aligned_chunks_of_at_least_the_floor() {
        let mib = 1u64 << 20;
        // Depth 1: whole slots, whatever the segment.
        assert_eq!(pipelined_chunk_bytes(8 * mib, 1, mib), 8 * mib);
        assert_eq!(pipelined_chunk_bytes(8 * mib, 0, 64 * mib), 8 * mib);
        // A quarter of the segment, within the floor and a slot.
        assert_eq!(pipelined_chunk_bytes(8 * mib, 4, 16 * mib), 4 * mib);
        assert_eq!(pipelined_chunk_bytes(8 * mib, 4, 64 * mib), 8 * mib);
        assert_eq!(
            pipelined_chunk_bytes(8 * mib, 4, 512 << 10),
            PIPELINE_MIN_CHUNK
        );
        // Rounded up to 4 KiB.
        assert_eq!(pipelined_chunk_bytes(8 * mib, 3, 4 * mib + 1), 1_400_832);
        assert_eq!(1_400_832 % 4096, 0);
        // A slot smaller than the floor caps it.
        assert_eq!(pipelined_chunk_bytes(64 << 10, 8, 64 * mib), 64 << 10);
    }

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
            assert_eq!(p.recv_segment(r, 2), Some((r + 1) % 4));
            // All-gather starts by sending the segment just completed.
            assert_eq!(p.send_segment(r, 3), Some((r + 1) % 4));
        }
    }

    #[test]
    fn shapes_need_equal_blocks_or_a_root_in_the_ring() {
        let p = Plan::new(4, 10, 4, 40, 2).unwrap();
        assert!(p.with_shape(Shape::ReduceScatter).is_err());
        assert!(p.with_shape(Shape::AllGather).is_err());
        assert!(p.with_shape(Shape::Broadcast { root: 4 }).is_err());
        assert!(p.with_shape(Shape::Broadcast { root: 3 }).is_ok());
        assert!(
            Plan::new(4, 12, 4, 40, 2)
                .unwrap()
                .with_shape(Shape::AllGather)
                .is_ok()
        );
    }

    #[test]
    fn reduce_scatter_delivers_each_rank_its_own_block_and_all_gather_starts_from_it() {
        for n in 1..9u32 {
            let p = Plan::new(n, u64::from(n) * 3, 4, 40, 2).unwrap();
            let rs = p.with_shape(Shape::ReduceScatter).unwrap();
            let ag = p.with_shape(Shape::AllGather).unwrap();
            for r in 0..n {
                if n > 1 {
                    assert_eq!(rs.recv_segment(r, n - 2), Some(r));
                }
                assert_eq!(ag.send_segment(r, 0), Some(r));
                // Over the all-gather a rank receives every block but its own, once.
                let mut got: Vec<u32> = (0..ag.steps())
                    .filter_map(|s| ag.recv_segment(r, s))
                    .collect();
                got.sort();
                let want: Vec<u32> = (0..n).filter(|b| *b != r).collect();
                assert_eq!(got, want);
            }
        }
    }

    #[test]
    fn a_broadcast_passes_one_segment_from_the_root_around_once() {
        let p = Plan::new(5, 100, 4, 40, 2)
            .unwrap()
            .with_shape(Shape::Broadcast { root: 3 })
            .unwrap();
        assert_eq!(p.segment(0), 0..100);
        assert_eq!(p.chunks_in(1), 0);
        for r in 0..5 {
            let sends = (0..p.steps())
                .filter(|s| p.send_segment(r, *s).is_some())
                .count();
            let recvs = (0..p.steps())
                .filter(|s| p.recv_segment(r, *s).is_some())
                .count();
            // The root only sends, the rank before it only receives, the rest do both.
            assert_eq!(
                (sends, recvs),
                match r {
                    3 => (1, 0),
                    2 => (0, 1),
                    _ => (1, 1),
                },
                "rank {r}"
            );
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

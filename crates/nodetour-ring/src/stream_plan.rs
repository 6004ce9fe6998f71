//! The ring collectives of one rank (every [`crate::plan::Shape`]) on a stream-ordered transport (cuda-ipc, shm), planned once
//! when the collective is queued. Pure: no I/O, no clocks, no CUDA.
//!
//! Each rank runs two CUDA streams: a **send** stream that writes chunks into the next rank's
//! slots, and a **receive** stream that takes chunks out of its own slots (reduce or copy), so a
//! transfer out and a transfer in overlap (the staged path needs both copy engines busy). The
//! two ranks of a link meet through two counters in shared host memory, both growing by one per
//! chunk:
//! - **ready** (written by the sender's stream after a chunk's bytes, with a memory barrier):
//!   the receiver's stream waits for `ready ≥ seq + 1` before it reads the slot;
//! - **released** (written by the receiver's stream after it has finished reading a slot: after
//!   the reduce, or after the copy out of host memory): the sender waits for
//!   `released ≥ seq + 1 − slots` before it overwrites the slot `seq mod slots`.
//!
//! Inside a rank two dependencies cross between the streams: a send of step `s ≥ 1` carries
//! what the receive of step `s − 1` produced (same segment, same chunk), and an all-gather
//! receive at step `s` overwrites the range the reduce-scatter sent at step `s − (n − 1)`, so it
//! waits for that send (write after read).
//!
//! Sequence numbers run on across collectives ([`LinkCounters`]), so slots are reused without a
//! handshake between collectives; flag values are those numbers mod 2^32 and the transports
//! compare them cyclically.
//!
//! **Replayable links** ([`Replayable`]; on the GPU ring, every link but a network link):
//! each collective starts at the link's next multiple of `slots` (slot 0), and waits for the
//! slot's credit even for a slot never used. Then a program's flag values, taken relative to
//! [`StreamProgram::start`], and its slot indices are the same whatever collectives ran
//! before: the GPU resolves the values against counters it keeps itself, so a program captured
//! into a CUDA graph is the right program at every replay (no slot is written before the
//! receiver released it, whatever the counters are by then).

use std::ops::Range;

use crate::plan::Plan;

/// One chunk written into the next rank's slot (send stream).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendOp {
    /// Ring step.
    pub step: u32,
    /// Element range of the local buffer.
    pub elements: Range<u64>,
    /// The next rank's slot.
    pub slot: u32,
    /// Before writing, wait until the next rank's `released` counter is at least this
    /// (`None` while the slot has never been used).
    pub wait_released: Option<u32>,
    /// After writing, set the next rank's `ready` counter to this.
    pub ready: u32,
    /// Wait for this receive (index into [`StreamProgram::recvs`]) first: it produced the data.
    pub after_recv: Option<usize>,
}

/// What a receive does with the chunk in its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecvKind {
    /// `local[elements] = op(local[elements], slot)` (reduce-scatter).
    Reduce {
        /// Divide by the ring size afterwards (the last reduce-scatter step of an average).
        average: bool,
    },
    /// `local[elements] = slot` (all-gather).
    Copy,
}

/// One chunk taken out of this rank's slot (receive stream).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecvOp {
    /// Ring step.
    pub step: u32,
    /// Element range of the local buffer.
    pub elements: Range<u64>,
    /// Our slot the previous rank wrote.
    pub slot: u32,
    /// Wait until our `ready` counter is at least this before reading the slot.
    pub wait_ready: u32,
    /// Reduce or copy.
    pub kind: RecvKind,
    /// Wait for this send (index into [`StreamProgram::sends`]) first: it reads the range this
    /// receive overwrites.
    pub after_send: Option<usize>,
    /// When the slot has been read, set the previous rank's `released` counter to this.
    pub released: u32,
}

/// The queued work of one rank for one allreduce.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamProgram {
    /// In send-stream order.
    pub sends: Vec<SendOp>,
    /// In receive-stream order.
    pub recvs: Vec<RecvOp>,
    /// The counters the collective started from (on a replayable link, rounded up to a
    /// multiple of `slots`): flag values minus these are the same at every replay.
    pub start: LinkCounters,
}

/// Which of a rank's two links are replayable (see the module's doc): the link to the next
/// rank (`send`) and the link from the previous rank (`recv`). Both ends of a link must agree
/// (the link's kind decides).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replayable {
    /// The link this rank sends on.
    pub send: bool,
    /// The link this rank receives on.
    pub recv: bool,
}

impl Replayable {
    /// Neither link.
    pub const NONE: Replayable = Replayable {
        send: false,
        recv: false,
    };
    /// Both links.
    pub const BOTH: Replayable = Replayable {
        send: true,
        recv: true,
    };
}

/// `counters` rounded up to multiples of `slots` on the replayable links.
fn align(counters: &mut LinkCounters, slots: u64, replayable: Replayable) {
    if replayable.send {
        counters.sent = counters.sent.next_multiple_of(slots);
    }
    if replayable.recv {
        counters.received = counters.received.next_multiple_of(slots);
    }
}

/// The credit a send of chunk `seq` waits for (`None`: the slot was never used; only on a
/// link that is not replayable, where the counters are the whole history).
fn credit(seq: u64, slots: u64, replayable: bool) -> Option<u32> {
    (replayable || seq >= slots).then(|| seq.wrapping_add(1).wrapping_sub(slots) as u32)
}

/// Chunks moved so far on this rank's two links, carried from one collective to the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LinkCounters {
    /// Chunks this rank has written to the next rank.
    pub sent: u64,
    /// Chunks this rank has received from the previous rank.
    pub received: u64,
}

/// The chunks of `segment`, as element ranges.
fn chunks(plan: &Plan, segment: u32) -> impl Iterator<Item = Range<u64>> + '_ {
    (0..plan.chunks_in(segment)).map(move |c| plan.chunk(segment, c))
}

/// Plans one collective of `plan` (any [`crate::plan::Shape`]) for ring position `rank` and
/// advances `counters` past it (no link replayable).
///
/// Every rank of the ring must plan the same collectives in the same order with the same plan
/// (then the sequence numbers of both ends of each link agree without messages).
pub fn program(
    plan: &Plan,
    rank: u32,
    average: bool,
    counters: &mut LinkCounters,
) -> StreamProgram {
    program_on(plan, rank, average, counters, Replayable::NONE)
}

/// [`program`] on links of which `replayable` are replayable (see the module's doc).
pub fn program_on(
    plan: &Plan,
    rank: u32,
    average: bool,
    counters: &mut LinkCounters,
    replayable: Replayable,
) -> StreamProgram {
    let n = plan.world;
    let mut p = StreamProgram::default();
    if n < 2 {
        p.start = *counters;
        return p;
    }
    let slots = u64::from(plan.slots);
    align(counters, slots, replayable);
    p.start = *counters;
    let reduce_steps = (0..plan.steps()).filter(|&s| plan.reduces_at(s)).count() as u32;
    // First receive / send index of each step, for the cross-stream dependencies.
    let mut recv_start = Vec::with_capacity(plan.steps() as usize);
    let mut send_start = Vec::with_capacity(plan.steps() as usize);
    for step in 0..plan.steps() {
        send_start.push(p.sends.len());
        if let Some(segment) = plan.send_segment(rank, step) {
            // What this step sends, the previous step received (same segment, same chunks),
            // where this rank received at all (a broadcast's root did not).
            let carried = step > 0 && plan.recv_segment(rank, step - 1) == Some(segment);
            for (c, elements) in chunks(plan, segment).enumerate() {
                let seq = counters.sent;
                counters.sent += 1;
                p.sends.push(SendOp {
                    step,
                    elements,
                    slot: (seq % slots) as u32,
                    wait_released: credit(seq, slots, replayable.send),
                    ready: (seq + 1) as u32,
                    after_recv: carried.then(|| recv_start[step as usize - 1] + c),
                });
            }
        }
        recv_start.push(p.recvs.len());
        if let Some(segment) = plan.recv_segment(rank, step) {
            let overwrites = plan.overwrites_send_of(step);
            for (c, elements) in chunks(plan, segment).enumerate() {
                let seq = counters.received;
                counters.received += 1;
                let kind = if plan.reduces_at(step) {
                    RecvKind::Reduce {
                        average: average && step + 1 == reduce_steps,
                    }
                } else {
                    RecvKind::Copy
                };
                p.recvs.push(RecvOp {
                    step,
                    elements,
                    slot: (seq % slots) as u32,
                    wait_ready: (seq + 1) as u32,
                    kind,
                    after_send: overwrites.map(|s| send_start[s as usize] + c),
                    released: (seq + 1) as u32,
                });
            }
        }
    }
    p
}

/// Plans one allreduce of two ranks as an **exchange** and advances `counters` past it: each
/// rank writes its whole buffer, chunk by chunk, into the other's slots and combines every
/// chunk into its own (`local = op(local, peer)`; the operations are commutative, so both ranks
/// compute the same values). The same bytes cross the link as in the two-rank ring (the whole
/// buffer each way) in one step instead of two, with no all-gather copy: lower latency, and
/// the copy engines stream without a phase change. The receive of a chunk waits for the send
/// that reads the same range (write after read). `plan.world` must be 2.
pub fn program_exchange(plan: &Plan, average: bool, counters: &mut LinkCounters) -> StreamProgram {
    program_exchange_on(plan, average, counters, Replayable::NONE)
}

/// [`program_exchange`] on links of which `replayable` are replayable (see the module's doc).
pub fn program_exchange_on(
    plan: &Plan,
    average: bool,
    counters: &mut LinkCounters,
    replayable: Replayable,
) -> StreamProgram {
    debug_assert_eq!(plan.world, 2);
    let slots = u64::from(plan.slots);
    let mut p = StreamProgram::default();
    align(counters, slots, replayable);
    p.start = *counters;
    let mut start = 0;
    while start < plan.count {
        let elements = start..(start + plan.chunk_elems).min(plan.count);
        start = elements.end;
        let seq = counters.sent;
        counters.sent += 1;
        p.sends.push(SendOp {
            step: 0,
            elements: elements.clone(),
            slot: (seq % slots) as u32,
            wait_released: credit(seq, slots, replayable.send),
            ready: (seq + 1) as u32,
            after_recv: None,
        });
        let seq = counters.received;
        counters.received += 1;
        p.recvs.push(RecvOp {
            step: 0,
            elements,
            slot: (seq % slots) as u32,
            wait_ready: (seq + 1) as u32,
            kind: RecvKind::Reduce { average },
            after_send: Some(p.sends.len() - 1),
            released: (seq + 1) as u32,
        });
    }
    p
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Shape;

    #[test]
    fn two_ranks_two_chunks_each() {
        // 8 elements, 2 ranks: segments of 4, chunks of 2 elements, 2 slots.
        let plan = Plan::new(2, 8, 4, 8, 2).unwrap();
        let mut c = LinkCounters::default();
        let p = program(&plan, 0, false, &mut c);
        assert_eq!(
            c,
            LinkCounters {
                sent: 4,
                received: 4
            }
        );
        // Rank 0 sends segment 0 (reduce-scatter), then its final segment 1 (all-gather).
        let sent: Vec<_> = p.sends.iter().map(|s| s.elements.clone()).collect();
        assert_eq!(sent, vec![0..2, 2..4, 4..6, 6..8]);
        assert_eq!(p.sends[0].wait_released, None);
        assert_eq!(p.sends[2].wait_released, Some(1));
        assert_eq!(p.sends[2].after_recv, Some(0));
        assert_eq!(p.recvs[0].kind, RecvKind::Reduce { average: false });
        assert_eq!(p.recvs[2].kind, RecvKind::Copy);
        // The all-gather overwrites segment 0, which the first step sent.
        assert_eq!(p.recvs[2].after_send, Some(0));
        // The next collective goes on counting.
        let q = program(&plan, 0, true, &mut c);
        assert_eq!(q.sends[0].ready, 5);
        assert_eq!(q.sends[0].wait_released, Some(3));
        assert_eq!(q.recvs[1].kind, RecvKind::Reduce { average: true });
    }

    /// Runs every rank's program on `f64` buffers as the GPU ring does for a PreMulSum: a send
    /// that carries nothing received multiplies by the rank's scalar, a reducing receive does
    /// `local = scalar · local + slot`, a copying one `local = slot`. Returns the buffers.
    fn run_premul(
        plan: &Plan,
        progs: &[StreamProgram],
        input: &[Vec<f64>],
        scalar: &[f64],
    ) -> Vec<Vec<f64>> {
        let n = progs.len();
        let mut buf = input.to_vec();
        let mut mail: Vec<std::collections::HashMap<u32, Vec<f64>>> = vec![Default::default(); n];
        let (mut si, mut ri) = (vec![0usize; n], vec![0usize; n]);
        let range = |e: &Range<u64>| e.start as usize..e.end as usize;
        loop {
            let mut moved = false;
            for r in 0..n {
                let p = &progs[r];
                while let Some(s) = p.sends.get(si[r]) {
                    if s.after_recv.is_some_and(|j| ri[r] <= j) {
                        break;
                    }
                    let k = if s.after_recv.is_none() {
                        scalar[r]
                    } else {
                        1.0
                    };
                    let data = buf[r][range(&s.elements)].iter().map(|x| k * x).collect();
                    mail[(r + 1) % n].insert(s.ready, data);
                    si[r] += 1;
                    moved = true;
                }
                while let Some(v) = p.recvs.get(ri[r]) {
                    if v.after_send.is_some_and(|j| si[r] <= j) {
                        break;
                    }
                    let Some(data) = mail[r].remove(&v.wait_ready) else {
                        break;
                    };
                    for (x, d) in buf[r][range(&v.elements)].iter_mut().zip(data) {
                        *x = match v.kind {
                            RecvKind::Reduce { .. } => scalar[r] * *x + d,
                            RecvKind::Copy => d,
                        };
                    }
                    ri[r] += 1;
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        for r in 0..n {
            assert_eq!(
                (si[r], ri[r]),
                (progs[r].sends.len(), progs[r].recvs.len()),
                "rank {r} stalled ({plan:?})"
            );
        }
        buf
    }

    /// PreMulSum on the GPU ring: each rank's own values are multiplied exactly once, where
    /// they are first read (a send that carries nothing received, or a reducing receive), so
    /// every reduced element is `Σ scalar_r · x_r`: the allreduce and the exchange everywhere,
    /// the reduce-scatter in each rank's final segment. Every world size 1-8, chunks that cut
    /// the segments unevenly.
    #[test]
    fn a_premulsum_multiplies_each_ranks_values_once_where_first_read() {
        for world in 1..=8u32 {
            for (count, chunk_elems) in [(1u64, 1u64), (37, 2), (64, 64), (100, 3)] {
                let scalar: Vec<f64> = (0..world).map(|r| 0.5 + f64::from(r)).collect();
                let input: Vec<Vec<f64>> = (0..world)
                    .map(|r| {
                        (0..count)
                            .map(|i| (i * 7 + u64::from(r) * 3) as f64)
                            .collect()
                    })
                    .collect();
                let want: Vec<f64> = (0..count as usize)
                    .map(|i| (0..world as usize).map(|r| scalar[r] * input[r][i]).sum())
                    .collect();
                for shape in [Shape::AllReduce, Shape::ReduceScatter] {
                    let Ok(plan) = Plan::new(world, count, 8, chunk_elems * 8, 2)
                        .and_then(|p| p.with_shape(shape))
                    else {
                        continue;
                    };
                    if world == 1 {
                        continue; // no program: the GPU ring multiplies in place
                    }
                    let c = LinkCounters::default();
                    let progs: Vec<_> = (0..world)
                        .map(|r| program(&plan, r, false, &mut c.clone()))
                        .collect();
                    let out = run_premul(&plan, &progs, &input, &scalar);
                    for r in 0..world as usize {
                        let mine: Vec<Range<u64>> = match shape {
                            Shape::AllReduce => std::iter::once(0..count).collect(),
                            // The segment its last reducing step finished.
                            _ => {
                                let reduced = || {
                                    progs[r]
                                        .recvs
                                        .iter()
                                        .filter(|v| matches!(v.kind, RecvKind::Reduce { .. }))
                                };
                                let last = reduced().map(|v| v.step).max().expect("a reduce");
                                reduced()
                                    .filter(|v| v.step == last)
                                    .map(|v| v.elements.clone())
                                    .collect()
                            }
                        };
                        for e in mine {
                            for i in e.start as usize..e.end as usize {
                                assert_eq!(
                                    out[r][i], want[i],
                                    "{shape:?} world {world} count {count} rank {r} element {i}"
                                );
                            }
                        }
                    }
                }
                if world == 2 {
                    let plan = Plan::new(2, count, 8, chunk_elems * 8, 2).unwrap();
                    let progs: Vec<_> = (0..2)
                        .map(|_| program_exchange(&plan, false, &mut LinkCounters::default()))
                        .collect();
                    let out = run_premul(&plan, &progs, &input, &scalar);
                    assert_eq!(
                        out,
                        vec![want.clone(), want.clone()],
                        "exchange, count {count}"
                    );
                }
            }
        }
    }

    #[test]
    fn the_exchange_sends_everything_once_and_reduces_after_sending() {
        let plan = Plan::new(2, 5, 4, 8, 2).unwrap();
        let mut c = LinkCounters::default();
        let p = program_exchange(&plan, true, &mut c);
        assert_eq!(
            c,
            LinkCounters {
                sent: 3,
                received: 3
            }
        );
        let sent: Vec<_> = p.sends.iter().map(|s| s.elements.clone()).collect();
        assert_eq!(sent, vec![0..2, 2..4, 4..5]);
        assert!(
            p.recvs
                .iter()
                .enumerate()
                .all(|(i, r)| r.after_send == Some(i)
                    && r.kind == RecvKind::Reduce { average: true })
        );
        assert_eq!(p.sends[2].wait_released, Some(1));
    }

    #[test]
    fn replayable_links_start_every_collective_at_slot_zero_and_always_wait_for_credit() {
        let plan = Plan::new(3, 10, 4, 8, 4).unwrap();
        let mut c = LinkCounters {
            sent: 5,
            received: 6,
        };
        let p = program_on(&plan, 1, false, &mut c, Replayable::BOTH);
        assert_eq!(
            p.start,
            LinkCounters {
                sent: 8,
                received: 8
            }
        );
        assert_eq!(p.sends[0].slot, 0);
        assert_eq!(p.recvs[0].slot, 0);
        assert_eq!(p.sends[0].wait_released, Some(5)); // 8 + 1 - 4
        assert_eq!(p.sends[0].ready, 9);
        // The same collective from other counters: the same slots, the same relative values.
        let mut d = LinkCounters {
            sent: 1 << 40,
            received: (1 << 40) - 3,
        };
        let q = program_on(&plan, 1, false, &mut d, Replayable::BOTH);
        let rel = |p: &StreamProgram| {
            let (s0, r0) = (p.start.sent as u32, p.start.received as u32);
            (
                p.sends
                    .iter()
                    .map(|s| {
                        (
                            s.slot,
                            s.ready.wrapping_sub(s0),
                            s.wait_released.map(|v| v.wrapping_sub(s0)),
                        )
                    })
                    .collect::<Vec<_>>(),
                p.recvs
                    .iter()
                    .map(|r| {
                        (
                            r.slot,
                            r.wait_ready.wrapping_sub(r0),
                            r.released.wrapping_sub(r0),
                        )
                    })
                    .collect::<Vec<_>>(),
            )
        };
        assert_eq!(rel(&p), rel(&q));
        // From the very start, the first slot's credit is a value the zeroed word has reached.
        let mut z = LinkCounters::default();
        let f = program_on(&plan, 0, false, &mut z, Replayable::BOTH);
        let v = f.sends[0].wait_released.unwrap();
        assert!((0u32.wrapping_sub(v) as i32) >= 0);
    }

    #[test]
    fn one_rank_has_nothing_to_move() {
        let plan = Plan::new(1, 100, 4, 64, 2).unwrap();
        let mut c = LinkCounters::default();
        assert_eq!(program(&plan, 0, true, &mut c), StreamProgram::default());
    }
}

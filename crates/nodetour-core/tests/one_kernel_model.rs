//! A model of the one-kernel allreduce's protocol (`nodetour_core::cuda::one_kernel`), run
//! under random interleavings: what the CUDA kernels do to memory, step by step, for one block
//! index (blocks of different indices never meet, so one stands for all), with every rank's
//! steps interleaved by a random scheduler. Each value in memory carries the collective it
//! belongs to; every read checks that it sees the data of the collective reading it, so a
//! rank that overwrites a half a peer still reads, or reads a peer's data before it landed, is
//! caught. Collectives of both kernels follow each other in random order, as eager calls and
//! graph replays do (the model's sequence words live "on the device": each launch reads them).
//!
//! What it checks: the two halves of scratch by parity, the per-block ticks (one barrier for
//! one-shot, two for two-shot), the cyclic comparison across the 32-bit wrap, and that every
//! read sees the data of its own collective. It also models the in-place two-shot on symmetric
//! buffers (the design on branch `wip/symmetric-buffers`, not on main: no halves, a closing
//! barrier), which passes here; without the closing barrier, or with one half for the
//! scratch, the checks fail (the second test, and a mutation tried by hand).

use std::collections::VecDeque;

/// A value in memory: (collective, what it holds) — `what` is an input of rank `r` (`r`) or a
/// reduced segment (`REDUCED`).
type Cell = Option<(u32, u32)>;
const REDUCED: u32 = 1000;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    OneShot,
    TwoShot,
    /// Two-shot in place on a symmetric buffer (the design on branch `wip/symmetric-buffers`:
    /// no copy in, no halves, a third barrier at the end).
    Symmetric,
}

/// One step of a rank's kernel for one collective.
#[derive(Clone, Debug)]
enum Step {
    /// Copy this rank's input (of collective `call`) into segment(s) of its half.
    CopyIn,
    /// Store `tick` into every peer's word for this rank.
    Signal,
    /// Wait until every peer's word for this rank reached `tick` (cyclically).
    Wait,
    /// One-shot: read every rank's half (all segments) and write the output.
    ReduceAll,
    /// Two-shot: read segment `rank` of every rank's half, write it reduced into this half.
    ReduceOwn,
    /// Two-shot: read segment `q` of rank q's half (reduced) for every q.
    Gather,
    /// Symmetric: the caller's input lands in its buffer (before the launch, stream-ordered).
    UserWrite,
    /// Symmetric: read segment `rank` of every rank's buffer, write it reduced in place.
    SymReduceOwn,
    /// Symmetric: read segment `q` of rank q's buffer (reduced) into this rank's buffer.
    SymGather,
    /// The kernel ends: the sequence words advance.
    End,
}

struct Rank {
    /// Scratch: two halves of `world` segments.
    half: [Vec<Cell>; 2],
    /// A symmetric buffer of `world` segments.
    buf: Vec<Cell>,
    /// Words peers store into (by peer).
    words: Vec<u32>,
    /// Device sequence words: last tick, collectives run.
    tick: u32,
    calls: u32,
    /// The current launch: (kind, this launch's tick so far, parity, steps left).
    running: Option<(Kind, u32, usize, VecDeque<Step>)>,
    /// Launches still to run (the stream).
    queue: VecDeque<Kind>,
    /// Collectives finished, with their kinds.
    done: u32,
}

fn steps(kind: Kind) -> VecDeque<Step> {
    use Step::*;
    match kind {
        Kind::OneShot => [CopyIn, Signal, Wait, ReduceAll, End].into(),
        Kind::TwoShot => [CopyIn, Signal, Wait, ReduceOwn, Signal, Wait, Gather, End].into(),
        Kind::Symmetric => [
            UserWrite,
            Signal,
            Wait,
            SymReduceOwn,
            Signal,
            Wait,
            SymGather,
            Signal,
            Wait,
            End,
        ]
        .into(),
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Runs `program` (the same collectives on every rank, in order) on `world` ranks under the
/// scheduler seeded with `seed`; panics on a read of the wrong data or a deadlock. The initial
/// sequence words are `start` (to cross the 32-bit wrap).
fn run(world: usize, program: &[Kind], seed: u64, start: u32) {
    run_with(world, program, seed, start, |calls| (calls & 1) as usize);
}

/// [`run`] with the half a collective uses given by `parity` (of its count).
fn run_with(world: usize, program: &[Kind], seed: u64, start: u32, half_of: impl Fn(u32) -> usize) {
    let mut ranks: Vec<Rank> = (0..world)
        .map(|_| Rank {
            half: [vec![None; world], vec![None; world]],
            buf: vec![None; world],
            words: vec![start; world],
            tick: start,
            calls: start,
            running: None,
            queue: program.iter().copied().collect(),
            done: 0,
        })
        .collect();
    let mut rng = Rng(seed | 1);
    let reached = |w: u32, tick: u32| (w.wrapping_sub(tick) as i32) >= 0;
    let mut idle = 0;
    loop {
        if ranks
            .iter()
            .all(|r| r.running.is_none() && r.queue.is_empty())
        {
            break;
        }
        let me = (rng.next() % world as u64) as usize;
        // Start the next launch where the stream is free.
        if ranks[me].running.is_none() {
            if let Some(kind) = ranks[me].queue.pop_front() {
                let r = &mut ranks[me];
                let calls = r.calls.wrapping_add(1);
                r.running = Some((kind, r.tick, half_of(calls), steps(kind)));
            } else {
                idle += 1;
                assert!(idle < 100_000, "nothing can run");
                continue;
            }
        }
        let (kind, mut tick, parity, mut left) = ranks[me].running.take().expect("running");
        let call = ranks[me].calls.wrapping_add(1);
        let step = left.front().cloned().expect("a kernel ends with End");
        let mut progressed = true;
        match step {
            Step::CopyIn => {
                for q in 0..world {
                    ranks[me].half[parity][q] = Some((call, me as u32));
                }
            }
            Step::Signal => {
                tick = tick.wrapping_add(1);
                for (p, peer) in ranks.iter_mut().enumerate() {
                    if p != me {
                        peer.words[me] = tick;
                    }
                }
            }
            Step::Wait => {
                progressed = (0..world).all(|p| p == me || reached(ranks[me].words[p], tick));
            }
            Step::ReduceAll => {
                for (r, rank) in ranks.iter().enumerate() {
                    for q in 0..world {
                        assert_eq!(
                            rank.half[parity][q],
                            Some((call, r as u32)),
                            "rank {me} (one-shot #{call}) read rank {r}'s segment {q} wrong: \
                             seed {seed}"
                        );
                    }
                }
            }
            Step::ReduceOwn => {
                for (r, rank) in ranks.iter().enumerate() {
                    assert_eq!(
                        rank.half[parity][me],
                        Some((call, r as u32)),
                        "rank {me} (two-shot #{call}) reduced rank {r}'s input: seed {seed}"
                    );
                }
                ranks[me].half[parity][me] = Some((call, REDUCED));
            }
            Step::Gather => {
                for (q, rank) in ranks.iter().enumerate() {
                    assert_eq!(
                        rank.half[parity][q],
                        Some((call, REDUCED)),
                        "rank {me} (two-shot #{call}) gathered segment {q}: seed {seed}"
                    );
                }
            }
            Step::UserWrite => {
                for q in 0..world {
                    ranks[me].buf[q] = Some((call, me as u32));
                }
            }
            Step::SymReduceOwn => {
                for (r, rank) in ranks.iter().enumerate() {
                    assert_eq!(
                        rank.buf[me],
                        Some((call, r as u32)),
                        "rank {me} (symmetric #{call}) reduced rank {r}'s input: seed {seed}"
                    );
                }
                ranks[me].buf[me] = Some((call, REDUCED));
            }
            Step::SymGather => {
                for q in (0..world).filter(|q| *q != me) {
                    let got = ranks[q].buf[q];
                    assert_eq!(
                        got,
                        Some((call, REDUCED)),
                        "rank {me} (symmetric #{call}) gathered segment {q}: seed {seed}"
                    );
                    ranks[me].buf[q] = got;
                }
            }
            Step::End => {
                let r = &mut ranks[me];
                r.tick = tick;
                r.calls = call;
                r.done += 1;
                idle = 0;
                continue; // the launch is over: nothing to put back
            }
        }
        if progressed {
            left.pop_front();
            idle = 0;
        } else {
            idle += 1;
            assert!(idle < 100_000, "deadlock: seed {seed}, {kind:?}");
        }
        ranks[me].running = Some((kind, tick, parity, left));
    }
    for (i, r) in ranks.iter().enumerate() {
        assert_eq!(r.done as usize, program.len(), "rank {i}");
    }
}

#[test]
fn random_interleavings_of_one_shot_two_shot_and_symmetric_collectives_read_only_their_own_data() {
    let mut rng = Rng(0x5eed);
    for case in 0..400u64 {
        let world = 2 + (rng.next() % 7) as usize;
        let program: Vec<Kind> = (0..(1 + rng.next() % 12))
            .map(|_| match rng.next() % 3 {
                0 => Kind::OneShot,
                1 => Kind::TwoShot,
                _ => Kind::Symmetric,
            })
            .collect();
        // Some cases start just below the 32-bit wrap of the sequence words.
        let start = if case % 3 == 0 { u32::MAX - 5 } else { 0 };
        run(world, &program, rng.next(), start);
    }
}

#[test]
#[should_panic(expected = "read rank")]
fn the_model_catches_a_single_half() {
    // The same protocol with one half (the parity ignored) must fail for some interleaving: a
    // fast rank's next copy overwrites what a slow peer still reads. Shows the checks can fail.
    let mut rng = Rng(7);
    for _ in 0..2000 {
        run_with(3, &[Kind::OneShot; 4], rng.next(), 0, |_| 0);
    }
}

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
//! buffers (no halves, a closing barrier); with one half for the scratch the checks fail (the
//! second test). With faults (waits that give up, host aborts, launches queued ahead) every
//! read is checked against the index of the collective the host called, and a launch that read
//! another collective's data and still ended is a wrong `Ok`: the protocol before the fix of
//! issue 34 (no stop word set by a failed block, none read at entry) is caught.

use std::collections::VecDeque;

/// A value in memory: (collective, what it holds) — `what` is an input of rank `r` (`r`) or a
/// reduced segment (`REDUCED`).
type Cell = Option<(u32, u32)>;
const REDUCED: u32 = 1000;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    OneShot,
    TwoShot,
    /// Two-shot in place on a symmetric buffer (no copy in, no halves, a third barrier at the
    /// end).
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
    /// Words peers store into (by peer): (tick, digest).
    words: Vec<(u32, u32)>,
    /// Device sequence words: last tick, collectives run.
    tick: u32,
    calls: u32,
    /// The current launch.
    running: Option<Launch>,
    /// Launches still to run (the stream): (kind, the collective's index in the program).
    queue: VecDeque<(Kind, u32)>,
    /// Collectives finished, with their kinds.
    done: u32,
    /// The rank's stop word (host memory: its abort, or with the fix a block that failed).
    stop: bool,
    /// A block failed and the host has not reacted yet (today's protocol: the host sets the
    /// stop word when its wait returns, some steps later).
    failed_unseen: bool,
    /// What each collective returned on this rank, by index: Ok (checked) or failed.
    outcomes: Vec<Option<bool>>,
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

/// A running launch of one block index.
struct Launch {
    kind: Kind,
    /// Its index in the program (what the host called it as).
    index: u32,
    /// The tick so far, the half, the steps left.
    tick: u32,
    parity: usize,
    left: VecDeque<Step>,
    /// The collective number its sequence words gave it.
    call: u32,
    /// It read data of another collective (an Ok from it is a wrong answer).
    wrong: Option<String>,
}

/// The protocol's rules about failures (the fix of issue 34, item 3, or today's).
#[derive(Clone, Copy, Debug)]
struct Rules {
    /// A launch reads the stop word before it writes anything, and ends at once if it is set.
    stop_at_entry: bool,
    /// A block whose barrier fails sets its rank's stop word itself.
    stop_on_failure: bool,
    /// The arrival word carries the collective's number: another collective's arrival at the
    /// same tick is a disagreement, never accepted.
    sequence_in_word: bool,
}

/// What the fix does.
const FIXED: Rules = Rules {
    stop_at_entry: true,
    stop_on_failure: true,
    sequence_in_word: true,
};

/// What a run may inject: a wait that gives up (a peer later than the timeout), a host abort.
#[derive(Clone, Copy, Debug)]
struct Faults {
    /// 1 in this many looks of a blocked wait gives up (0: never).
    timeout_one_in: u64,
    /// 1 in this many steps aborts a random rank from its host (0: never).
    abort_one_in: u64,
}

const NO_FAULTS: Faults = Faults {
    timeout_one_in: 0,
    abort_one_in: 0,
};

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
    let outcomes = run_faulty(world, program, seed, start, half_of, FIXED, NO_FAULTS)
        .unwrap_or_else(|wrong| panic!("{wrong}"));
    for (r, o) in outcomes.iter().enumerate() {
        assert!(o.iter().all(|x| *x == Some(true)), "rank {r}: {o:?}");
    }
}

/// The digest a rank's arrival word carries for `kind` as collective number `call`.
fn digest(kind: Kind, call: u32, rules: Rules) -> u32 {
    let d = kind as u32 + 1;
    if rules.sequence_in_word {
        d ^ call.wrapping_mul(0x9e37_79b1)
    } else {
        d
    }
}

/// The engine: `program` on `world` ranks, each launch queued ahead on every rank's stream,
/// interleaved by the scheduler seeded with `seed`, with `faults` injected under `rules`.
/// Returns every rank's outcome per collective (`Some(true)`: Ok, `Some(false)`: failed), or
/// the first wrong `Ok`: a launch that read another collective's data and still ended.
fn run_faulty(
    world: usize,
    program: &[Kind],
    seed: u64,
    start: u32,
    half_of: impl Fn(u32) -> usize,
    rules: Rules,
    faults: Faults,
) -> Result<Vec<Vec<Option<bool>>>, String> {
    let mut ranks: Vec<Rank> = (0..world)
        .map(|_| Rank {
            half: [vec![None; world], vec![None; world]],
            buf: vec![None; world],
            words: vec![(start, 0); world],
            tick: start,
            calls: start,
            running: None,
            queue: program.iter().copied().zip(0..).collect(),
            done: 0,
            stop: false,
            failed_unseen: false,
            outcomes: vec![None; program.len()],
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
        if faults.abort_one_in > 0 && rng.next() % faults.abort_one_in == 0 {
            let r = (rng.next() % world as u64) as usize;
            ranks[r].stop = true;
        }
        let me = (rng.next() % world as u64) as usize;
        // Today: the host sets the stop word some time after a block failed (when its wait
        // for the failed collective returns).
        if ranks[me].failed_unseen && rng.next() % 8 == 0 {
            ranks[me].stop = true;
            ranks[me].failed_unseen = false;
        }
        // Start the next launch where the stream is free.
        if ranks[me].running.is_none() {
            let Some((kind, index)) = ranks[me].queue.pop_front() else {
                idle += 1;
                assert!(idle < 100_000, "nothing can run");
                continue;
            };
            let r = &mut ranks[me];
            if rules.stop_at_entry && r.stop {
                // Stopped: this launch writes nothing and arrives nowhere.
                r.outcomes[index as usize] = Some(false);
                continue;
            }
            let call = r.calls.wrapping_add(1);
            // The caller's input of a symmetric collective lands before the launch, whatever
            // the stop word says (the caller's own copy).
            let mut left = steps(kind);
            if left.front().is_some_and(|s| matches!(s, Step::UserWrite)) {
                left.pop_front();
                for q in 0..world {
                    r.buf[q] = Some((index, me as u32));
                }
            }
            r.running = Some(Launch {
                kind,
                index,
                tick: r.tick,
                parity: half_of(call),
                left,
                call,
                wrong: None,
            });
        }
        let mut l = ranks[me].running.take().expect("running");
        let (index, parity) = (l.index, l.parity);
        let step = l.left.front().cloned().expect("a kernel ends with End");
        let mut progressed = true;
        // Where a read of another collective's data is noted (the launch goes on: what
        // matters is whether it then returns Ok).
        let mut check = |got: Cell, want: Cell, what: String| {
            if got != want && l.wrong.is_none() {
                l.wrong = Some(format!(
                    "rank {me} (collective {index}, {:?}) {what}: {got:?}, want {want:?}; seed {seed}",
                    l.kind
                ));
            }
        };
        let mut fail = false;
        match step {
            Step::CopyIn => {
                for q in 0..world {
                    ranks[me].half[parity][q] = Some((index, me as u32));
                }
            }
            Step::Signal => {
                if ranks[me].stop {
                    // A stopped rank arrives nowhere.
                    fail = true;
                } else {
                    l.tick = l.tick.wrapping_add(1);
                    let word = (l.tick, digest(l.kind, l.call, rules));
                    for (p, peer) in ranks.iter_mut().enumerate() {
                        if p != me {
                            peer.words[me] = word;
                        }
                    }
                }
            }
            Step::Wait => {
                let mine = digest(l.kind, l.call, rules);
                let words = &ranks[me].words;
                let disagree =
                    (0..world).any(|p| p != me && words[p].0 == l.tick && words[p].1 != mine);
                progressed = (0..world).all(|p| p == me || reached(words[p].0, l.tick));
                // Another collective's arrival at this tick, or (still waiting) the stop word
                // or the deadline.
                fail = disagree
                    || !progressed
                        && (ranks[me].stop
                            || faults.timeout_one_in > 0
                                && rng.next() % faults.timeout_one_in == 0);
            }
            Step::ReduceAll => {
                for (r, rank) in ranks.iter().enumerate() {
                    for q in 0..world {
                        check(
                            rank.half[parity][q],
                            Some((index, r as u32)),
                            format!("read rank {r}'s segment {q}"),
                        );
                    }
                }
            }
            Step::ReduceOwn => {
                for (r, rank) in ranks.iter().enumerate() {
                    check(
                        rank.half[parity][me],
                        Some((index, r as u32)),
                        format!("reduced rank {r}'s input"),
                    );
                }
                ranks[me].half[parity][me] = Some((index, REDUCED));
            }
            Step::Gather => {
                for (q, rank) in ranks.iter().enumerate() {
                    check(
                        rank.half[parity][q],
                        Some((index, REDUCED)),
                        format!("gathered segment {q}"),
                    );
                }
            }
            Step::UserWrite => unreachable!("taken before the launch"),
            Step::SymReduceOwn => {
                for (r, rank) in ranks.iter().enumerate() {
                    check(
                        rank.buf[me],
                        Some((index, r as u32)),
                        format!("reduced rank {r}'s input"),
                    );
                }
                ranks[me].buf[me] = Some((index, REDUCED));
            }
            Step::SymGather => {
                for q in (0..world).filter(|q| *q != me) {
                    let got = ranks[q].buf[q];
                    check(got, Some((index, REDUCED)), format!("gathered segment {q}"));
                    ranks[me].buf[q] = got;
                }
            }
            Step::End => {
                if let Some(wrong) = l.wrong {
                    return Err(format!("a wrong Ok: {wrong}"));
                }
                let r = &mut ranks[me];
                r.tick = l.tick;
                r.calls = l.call;
                r.done += 1;
                r.outcomes[index as usize] = Some(true);
                idle = 0;
                continue; // the launch is over: nothing to put back
            }
        }
        if fail {
            // The block latches its status and stops: no sequence words advance.
            let r = &mut ranks[me];
            r.outcomes[index as usize] = Some(false);
            if rules.stop_on_failure {
                r.stop = true;
            } else {
                r.failed_unseen = true;
            }
            idle = 0;
            continue;
        }
        if progressed {
            l.left.pop_front();
            idle = 0;
        } else {
            idle += 1;
            assert!(idle < 100_000, "deadlock: seed {seed}, {:?}", l.kind);
        }
        ranks[me].running = Some(l);
    }
    if faults.timeout_one_in == 0 && faults.abort_one_in == 0 {
        for (i, r) in ranks.iter().enumerate() {
            assert_eq!(r.done as usize, program.len(), "rank {i}");
        }
    }
    Ok(ranks.into_iter().map(|r| r.outcomes).collect())
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

/// Programs of random kinds, with faults: waits that give up (a peer later than the timeout)
/// and host aborts, launches queued ahead on every rank. Returns the first wrong `Ok`.
fn faulty_cases(rules: Rules, cases: u64, seed: u64) -> Result<(u64, u64), String> {
    let mut rng = Rng(seed);
    let (mut ok, mut failed) = (0, 0);
    for case in 0..cases {
        let world = 2 + (rng.next() % 3) as usize;
        let program: Vec<Kind> = (0..(2 + rng.next() % 8))
            .map(|_| match rng.next() % 3 {
                0 => Kind::OneShot,
                1 => Kind::TwoShot,
                _ => Kind::Symmetric,
            })
            .collect();
        let faults = Faults {
            timeout_one_in: [0, 20, 200][(case % 3) as usize],
            abort_one_in: if case % 4 == 0 { 3000 } else { 0 },
        };
        let start = if case % 5 == 0 { u32::MAX - 3 } else { 0 };
        let outcomes = run_faulty(
            world,
            &program,
            rng.next(),
            start,
            |calls| (calls & 1) as usize,
            rules,
            faults,
        )?;
        for o in outcomes.iter().flatten() {
            match o {
                Some(true) => ok += 1,
                _ => failed += 1,
            }
        }
    }
    Ok((ok, failed))
}

/// Timeouts, aborts, stop words, late peers and launches queued ahead: with the fix no launch
/// that read another collective's data returns Ok (every read is checked against the index of
/// the collective the host called), and a rank whose barrier failed arrives nowhere again.
#[test]
fn failures_late_peers_and_launches_queued_ahead_never_give_a_wrong_ok() {
    let (ok, failed) = faulty_cases(FIXED, 3000, 0xfa11).unwrap_or_else(|e| panic!("{e}"));
    println!("ONE_KERNEL_MODEL fixed: {ok} Ok (each checked), {failed} failed, 0 wrong");
    assert!(
        ok > 1000 && failed > 1000,
        "faults and successes both happened"
    );
}

/// Today's protocol before the fix (issue 34, item 3): a block whose barrier failed neither
/// set the stop word nor advanced the sequence words, the next launch copied its input before
/// it looked at the stop word, and the arrival word left the collective's number out. The
/// model finds the wrong Ok the GPU drill found: a late peer pairs its collective with this
/// rank's next one.
#[test]
fn the_model_catches_the_protocol_before_the_fix() {
    let before = Rules {
        stop_at_entry: false,
        stop_on_failure: false,
        sequence_in_word: false,
    };
    let e = faulty_cases(before, 3000, 0xfa11).expect_err("a wrong Ok before the fix");
    println!("ONE_KERNEL_MODEL before the fix: {e}");
    assert!(e.contains("a wrong Ok"), "{e}");
    // The collective's number in the arrival word alone does not close it: the number comes
    // from the failed rank's sequence words, which the failure did not advance, so its next
    // launch arrives with the failed one's number. The stop word (set by the failing block,
    // read before any write) does.
    let sequence_only = Rules {
        sequence_in_word: true,
        ..before
    };
    let e = faulty_cases(sequence_only, 3000, 0xfa11).expect_err("the number alone");
    println!("ONE_KERNEL_MODEL the number in the word alone: {e}");
    let stop_only = Rules {
        stop_at_entry: true,
        stop_on_failure: true,
        ..before
    };
    let (ok, failed) = faulty_cases(stop_only, 3000, 0xfa11).unwrap_or_else(|e| panic!("{e}"));
    println!("ONE_KERNEL_MODEL the stop word alone: {ok} Ok, {failed} failed, 0 wrong");
}

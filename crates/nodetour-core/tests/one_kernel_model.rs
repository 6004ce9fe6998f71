//! A model of the one-kernel allreduce's protocol (`nodetour_core::cuda::one_kernel`), run
//! under random interleavings: what the CUDA kernels do to memory, step by step, for one block
//! index (blocks of different indices never meet, so one stands for all), with every rank's
//! steps interleaved by a random scheduler. Each value in memory carries the collective it
//! belongs to; every read checks that it sees the data of the collective reading it, so a
//! rank that overwrites a half a peer still reads, or reads a peer's data before it landed, is
//! caught. Collectives of both kernels follow each other in random order, as eager calls and
//! graph replays do (the model's sequence words live "on the device": each launch reads them).
//!
//! **Streams.** Every rank has three queues that run at once, as CUDA streams do: the
//! communicator's own stream (queue 0) and two streams of the caller's (1 and 2). A program
//! is the same list of calls on every rank, each naming the caller's stream it is queued on
//! and whether it is an eager call or the replay of a captured graph (which nodetour never
//! sees launched). What the host queues for a call depends on the rules: before issue 48 the
//! kernel went on the caller's stream; with the fix an eager call joins the communicator's
//! stream from the caller's (a wait on the caller's tail), queues its kernel there, and joins
//! back (the caller's stream waits for it), so eager calls run in call order whatever stream
//! each names; a replay runs where the caller launches its graph. The caller's writes of its
//! symmetric buffer are operations of its stream too: before each call (its input), and after
//! each call (reusing the buffer) whether the collective ended `Ok` or failed.
//!
//! What it checks: the two halves of scratch by parity, the per-block ticks (one barrier for
//! one-shot, two for two-shot, three for the symmetric kernel), the cyclic comparison across
//! the wrap, and that every read sees the data of its own collective. With faults (waits that
//! give up, host aborts, launches queued ahead, late peers, replays unordered against eager
//! calls) every read is checked against the index of the collective the host called, and a
//! launch that read another collective's data and still ended is a wrong `Ok`. The tests at
//! the end show, for each rule of the protocol, a run of the rules without it that the model
//! catches.

use std::collections::VecDeque;

/// A value in memory: (collective, what it holds) — `what` is an input of rank `r` (`r`), a
/// reduced segment (`REDUCED`), or what the caller wrote into its buffer after a collective
/// (`CALLER`: no collective's data).
type Cell = Option<(u32, u32)>;
const REDUCED: u32 = 1000;
const CALLER: u32 = 2000;

/// Queues per rank: the communicator's own stream, then the caller's streams.
const QUEUES: usize = 3;
/// The communicator's own stream (where the fix queues every eager launch).
const LANE: usize = 0;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    OneShot,
    TwoShot,
    /// Two-shot in place on a symmetric buffer (no copy in, no halves, a third barrier at the
    /// end).
    Symmetric,
}

/// One call of the program: its kernel, the caller's stream it names (1 or 2), whether it is
/// a graph replay, and whether the caller ordered it after everything before it (its stream
/// waits for the caller's other streams first, as a careful runtime does around replays).
#[derive(Clone, Copy, Debug)]
struct Call {
    kind: Kind,
    stream: usize,
    replay: bool,
    ordered: bool,
}

impl Call {
    fn eager(kind: Kind, stream: usize) -> Call {
        Call {
            kind,
            stream,
            replay: false,
            ordered: false,
        }
    }
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
    /// Symmetric: read segment `rank` of every rank's buffer, write it reduced in place.
    SymReduceOwn,
    /// Symmetric: read segment `q` of rank q's buffer (reduced) into this rank's buffer.
    SymGather,
    /// The kernel ends: the sequence words advance.
    End,
}

/// An operation on one of a rank's queues.
#[derive(Clone, Copy, Debug)]
enum Op {
    /// A kernel: collective `index` of the program.
    Launch(Kind, u32),
    /// The caller writes its symmetric buffer: collective `index`'s input, or (`None`) its own
    /// data after a collective.
    Write(Option<u32>),
    /// Waits until queue `queue` has finished `ops` operations (an event recorded there).
    Join { queue: usize, ops: usize },
}

/// An arrival word a rank stores into a peer's signal page.
#[derive(Clone, Copy, Debug, Default)]
struct Word {
    tick: u32,
    /// The collective's number on the rank's GPU (its sequence words).
    calls: u32,
    digest: u32,
    /// The rank gave up at this barrier after arriving, and took its arrival back.
    withdrawn: bool,
}

struct Rank {
    /// Scratch: two halves of `world` segments.
    half: [Vec<Cell>; 2],
    /// A symmetric buffer of `world` segments.
    buf: Vec<Cell>,
    /// Words peers store into (by peer).
    words: Vec<Word>,
    /// Device sequence words: last tick, collectives run.
    tick: u32,
    calls: u32,
    /// A launch holds the block's claim on the sequence words.
    busy: bool,
    /// Each queue: its operations, the one running (a launch), and how many have finished.
    queues: [VecDeque<Op>; QUEUES],
    running: [Option<Launch>; QUEUES],
    finished: [usize; QUEUES],
    /// Collectives that ended Ok.
    done: u32,
    /// The rank's stop word (host memory: its abort, or a block that failed).
    stop: bool,
    /// A block failed and the host has not reacted yet (the protocol before issue 34: the
    /// host sets the stop word when its wait returns, some steps later).
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
    /// It holds the block's claim (released at its end).
    claimed: bool,
    /// It read data of another collective (an Ok from it is a wrong answer).
    wrong: Option<String>,
}

impl Launch {
    /// Whether the barrier at the front is the launch's last.
    fn last_barrier(&self) -> bool {
        self.left.iter().skip(1).all(|s| !matches!(s, Step::Wait))
    }
}

/// The protocol's rules: what the fix of issue 34 and the fix of issue 48 each added.
#[derive(Clone, Copy, Debug)]
struct Rules {
    /// A launch reads the stop word before it writes anything, and ends at once if it is set.
    stop_at_entry: bool,
    /// A block whose barrier fails sets its rank's stop word itself.
    stop_on_failure: bool,
    /// The arrival word's digest mixes in the collective's number: another collective's
    /// arrival at the same tick is a disagreement, never accepted.
    sequence_in_word: bool,
    /// Issue 48: eager launches queue on the communicator's own stream, joined from and to the
    /// caller's, so they run in call order whatever stream each names.
    eager_in_call_order: bool,
    /// Issue 48: a launch claims its block's sequence words at entry (released at its end);
    /// a second launch of the rank running at once fails at entry, before it writes anything.
    exclusive: bool,
    /// Issue 48: the arrival word carries the collective's number, so a peer already one tick
    /// ahead is checked too: in the same collective (same digest, and this is not its last
    /// barrier) or in the next one (and this is the last).
    count_checked: bool,
    /// Issue 48: a block that gives up at a barrier after arriving takes its arrival back
    /// (before its kernel ends and the caller may reuse its buffer), so a late peer never
    /// passes on it.
    withdraw: bool,
    /// Not a rule but what the descriptors are: every call's differs (the code's: each
    /// carries the communicator's call number), or (false) equal kinds have equal descriptors,
    /// as the replays of one graph do.
    per_call_descriptors: bool,
}

/// The protocol after issue 34's fix (what issue 48 found wanting).
const FIXED_34: Rules = Rules {
    stop_at_entry: true,
    stop_on_failure: true,
    sequence_in_word: true,
    eager_in_call_order: false,
    exclusive: false,
    count_checked: false,
    withdraw: false,
    per_call_descriptors: true,
};

/// What the code does now.
const FIXED: Rules = Rules {
    eager_in_call_order: true,
    exclusive: true,
    count_checked: true,
    withdraw: true,
    ..FIXED_34
};

/// What a run may inject: a wait that gives up (a peer later than the timeout), a host abort.
/// With faults a stall ends at the deadline (every wait has one); without, a stall is a
/// deadlock and fails the run.
#[derive(Clone, Copy, Debug)]
struct Faults {
    /// 1 in this many looks of a blocked wait gives up (0: never).
    timeout_one_in: u64,
    /// 1 in this many steps aborts a random rank from its host (0: never).
    abort_one_in: u64,
    /// A stall ends at the deadline (the waits give up) instead of failing the run.
    deadline: bool,
}

const NO_FAULTS: Faults = Faults {
    timeout_one_in: 0,
    abort_one_in: 0,
    deadline: false,
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

/// What the host queues for `calls` (the same on every rank), on each queue.
fn host_queues(calls: &[Call], rules: Rules) -> [VecDeque<Op>; QUEUES] {
    let mut q: [VecDeque<Op>; QUEUES] = Default::default();
    for (index, c) in calls.iter().enumerate() {
        let s = c.stream;
        if c.ordered {
            // The caller orders this call after everything of its other streams.
            for other in 1..QUEUES {
                if other != s {
                    let ops = q[other].len();
                    q[s].push_back(Op::Join { queue: other, ops });
                }
            }
        }
        let symmetric = c.kind == Kind::Symmetric;
        if symmetric {
            q[s].push_back(Op::Write(Some(index as u32)));
        }
        let launch = Op::Launch(c.kind, index as u32);
        if rules.eager_in_call_order && !c.replay {
            let ops = q[s].len();
            q[LANE].push_back(Op::Join { queue: s, ops });
            q[LANE].push_back(launch);
            let ops = q[LANE].len();
            q[s].push_back(Op::Join { queue: LANE, ops });
        } else {
            q[s].push_back(launch);
        }
        if symmetric {
            // The caller reuses its buffer once the collective has ended, Ok or failed.
            q[s].push_back(Op::Write(None));
        }
    }
    q
}

/// Runs `program` (eager calls on one stream, in order) on `world` ranks under the scheduler
/// seeded with `seed`; panics on a read of the wrong data or a deadlock. The initial sequence
/// words are `start` (to cross the wrap).
fn run(world: usize, program: &[Kind], seed: u64, start: u32) {
    let calls: Vec<Call> = program.iter().map(|k| Call::eager(*k, 1)).collect();
    run_calls(world, &calls, seed, start, FIXED);
}

/// Runs `calls` without faults: every collective must end Ok on every rank.
fn run_calls(world: usize, calls: &[Call], seed: u64, start: u32, rules: Rules) {
    let outcomes = run_faulty(
        world,
        calls,
        seed,
        start,
        |c| (c & 1) as usize,
        rules,
        NO_FAULTS,
    )
    .unwrap_or_else(|wrong| panic!("{wrong}"));
    for (r, o) in outcomes.iter().enumerate() {
        assert!(o.iter().all(|x| *x == Some(true)), "rank {r}: {o:?}");
    }
}

/// The digest a rank's arrival word carries for `kind`, program entry `index`, as collective
/// number `call`.
fn digest(kind: Kind, index: u32, call: u32, rules: Rules) -> u32 {
    let mut d = kind as u32 + 1;
    if rules.per_call_descriptors {
        d ^= (index + 1).wrapping_mul(0x85eb_ca6b);
    }
    if rules.sequence_in_word {
        d ^ call.wrapping_mul(0x9e37_79b1)
    } else {
        d
    }
}

/// What a waiting launch makes of a peer's word.
#[derive(PartialEq)]
enum Look {
    Wait,
    Pass,
    Fail,
}

/// How a launch at the front of a barrier reads peer word `w` (the kernel's check).
fn look(w: Word, l: &Launch, rules: Rules) -> Look {
    let mine = digest(l.kind, l.index, l.call, rules);
    let ahead = w.tick.wrapping_sub(l.tick) as i32;
    if ahead < 0 {
        return Look::Wait;
    }
    if ahead == 0 && w.withdrawn {
        return Look::Fail;
    }
    if !rules.count_checked {
        // Before issue 48: a peer past the tick is taken on trust.
        return if ahead == 0 && w.digest != mine {
            Look::Fail
        } else {
            Look::Pass
        };
    }
    let same = w.calls == l.call && w.digest == mine;
    let last = l.last_barrier();
    match ahead {
        0 if same => Look::Pass,
        1 if same && !last => Look::Pass,
        1 if last && w.calls == l.call.wrapping_add(1) => Look::Pass,
        _ => Look::Fail,
    }
}

/// The engine: `calls` on `world` ranks, every operation queued ahead on every rank's
/// queues, interleaved by the scheduler seeded with `seed`, with `faults` injected under
/// `rules`. Returns every rank's outcome per collective (`Some(true)`: Ok, `Some(false)`:
/// failed), or the first wrong `Ok`: a launch that read another collective's data and still
/// ended.
fn run_faulty(
    world: usize,
    calls: &[Call],
    seed: u64,
    start: u32,
    half_of: impl Fn(u32) -> usize,
    rules: Rules,
    faults: Faults,
) -> Result<Vec<Vec<Option<bool>>>, String> {
    let start_word = Word {
        tick: start,
        calls: start,
        ..Word::default()
    };
    let mut ranks: Vec<Rank> = (0..world)
        .map(|_| Rank {
            half: [vec![None; world], vec![None; world]],
            buf: vec![None; world],
            words: vec![start_word; world],
            tick: start,
            calls: start,
            busy: false,
            queues: host_queues(calls, rules),
            running: Default::default(),
            finished: [0; QUEUES],
            done: 0,
            stop: false,
            failed_unseen: false,
            outcomes: vec![None; calls.len()],
        })
        .collect();
    let mut rng = Rng(seed | 1);
    let mut idle = 0u64;
    // Set once everything stalled (with faults): every blocked wait gives up, as at its
    // deadline.
    let mut deadline = false;
    loop {
        if ranks
            .iter()
            .all(|r| r.running.iter().all(Option::is_none) && r.queues.iter().all(|q| q.is_empty()))
        {
            break;
        }
        if idle > 20_000 {
            assert!(faults.deadline, "deadlock: seed {seed}");
            deadline = true;
        }
        if faults.abort_one_in > 0 && rng.next().is_multiple_of(faults.abort_one_in) {
            let r = (rng.next() % world as u64) as usize;
            ranks[r].stop = true;
        }
        let me = (rng.next() % world as u64) as usize;
        let qi = (rng.next() % QUEUES as u64) as usize;
        // Before issue 34: the host sets the stop word some time after a block failed.
        if ranks[me].failed_unseen && rng.next().is_multiple_of(8) {
            ranks[me].stop = true;
            ranks[me].failed_unseen = false;
        }
        // Start the queue's next operation where it is free.
        if ranks[me].running[qi].is_none() {
            let r = &mut ranks[me];
            let Some(op) = r.queues[qi].front().copied() else {
                idle += 1;
                continue;
            };
            match op {
                Op::Join { queue, ops } => {
                    if r.finished[queue] >= ops {
                        r.queues[qi].pop_front();
                        r.finished[qi] += 1;
                        idle = 0;
                    } else {
                        idle += 1;
                    }
                    continue;
                }
                Op::Write(what) => {
                    r.queues[qi].pop_front();
                    r.finished[qi] += 1;
                    let value = match what {
                        Some(index) => Some((index, me as u32)),
                        None => Some((CALLER, me as u32)),
                    };
                    r.buf.iter_mut().for_each(|c| *c = value);
                    idle = 0;
                    continue;
                }
                Op::Launch(kind, index) => {
                    r.queues[qi].pop_front();
                    idle = 0;
                    let stopped = rules.stop_at_entry && r.stop;
                    let taken = rules.exclusive && r.busy;
                    if stopped || taken {
                        // Stopped, or another launch of this rank runs now: this one writes
                        // nothing and arrives nowhere (a claim refused stops the rank).
                        r.outcomes[index as usize] = Some(false);
                        r.finished[qi] += 1;
                        if taken && rules.stop_on_failure {
                            r.stop = true;
                        }
                        continue;
                    }
                    r.busy |= rules.exclusive;
                    let call = r.calls.wrapping_add(1);
                    r.running[qi] = Some(Launch {
                        kind,
                        index,
                        tick: r.tick,
                        parity: half_of(call),
                        left: steps(kind),
                        call,
                        claimed: rules.exclusive,
                        wrong: None,
                    });
                }
            }
        }
        let mut l = ranks[me].running[qi].take().expect("running");
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
        let mut arrived = false;
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
                    let word = Word {
                        tick: l.tick,
                        calls: l.call,
                        digest: digest(l.kind, l.index, l.call, rules),
                        withdrawn: false,
                    };
                    for (p, peer) in ranks.iter_mut().enumerate() {
                        if p != me {
                            peer.words[me] = word;
                        }
                    }
                }
            }
            Step::Wait => {
                arrived = true;
                let looks: Vec<Look> = (0..world)
                    .filter(|p| *p != me)
                    .map(|p| look(ranks[me].words[p], &l, rules))
                    .collect();
                progressed = looks.iter().all(|x| *x == Look::Pass);
                // A peer's word that fails the check, or (still waiting) the stop word or
                // the deadline.
                fail = looks.contains(&Look::Fail)
                    || !progressed
                        && (ranks[me].stop
                            || deadline
                            || faults.timeout_one_in > 0
                                && rng.next().is_multiple_of(faults.timeout_one_in));
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
                r.busy &= !l.claimed;
                r.done += 1;
                r.outcomes[index as usize] = Some(true);
                r.finished[qi] += 1;
                idle = 0;
                continue; // the launch is over: nothing to put back
            }
        }
        if fail {
            // The block latches its status and stops: no sequence words advance.
            if arrived && rules.withdraw {
                // Its arrival at this tick is taken back before the kernel ends.
                let gone = Word {
                    tick: l.tick,
                    calls: l.call,
                    digest: 0,
                    withdrawn: true,
                };
                for (p, peer) in ranks.iter_mut().enumerate() {
                    if p != me {
                        peer.words[me] = gone;
                    }
                }
            }
            let r = &mut ranks[me];
            r.outcomes[index as usize] = Some(false);
            r.busy &= !l.claimed;
            r.finished[qi] += 1;
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
        }
        ranks[me].running[qi] = Some(l);
    }
    if !faults.deadline {
        // No fault could happen: every collective ran to its end on every rank.
        for (i, r) in ranks.iter().enumerate() {
            assert_eq!(r.done as usize, calls.len(), "rank {i}");
        }
    }
    Ok(ranks.into_iter().map(|r| r.outcomes).collect())
}

fn random_kind(rng: &mut Rng) -> Kind {
    match rng.next() % 3 {
        0 => Kind::OneShot,
        1 => Kind::TwoShot,
        _ => Kind::Symmetric,
    }
}

#[test]
fn random_interleavings_of_one_shot_two_shot_and_symmetric_collectives_read_only_their_own_data() {
    let mut rng = Rng(0x5eed);
    for case in 0..400u64 {
        let world = 2 + (rng.next() % 7) as usize;
        let program: Vec<Kind> = (0..(1 + rng.next() % 12))
            .map(|_| random_kind(&mut rng))
            .collect();
        // Some cases start just below the wrap of the sequence words.
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
        let calls = [Call::eager(Kind::OneShot, 1); 4];
        let _ = run_faulty(3, &calls, rng.next(), 0, |_| 0, FIXED, NO_FAULTS)
            .map_err(|e| panic!("{e}"));
    }
}

/// A random program of `len` calls on the caller's two streams: eager calls on either, and
/// (with `replays`) graph replays, `ordered` by the caller against its other streams or
/// (where `unordered_replays`) not.
fn random_calls(rng: &mut Rng, len: u64, replays: bool, unordered_replays: bool) -> Vec<Call> {
    let mut calls: Vec<Call> = Vec::new();
    for _ in 0..len {
        let replay = replays && rng.next().is_multiple_of(3);
        // A careful caller orders a replay, and the call after one, against its other streams.
        // The caller's writes of its symmetric buffer are ordered after the collectives
        // before (else it races with them itself, whatever nodetour does).
        let after_replay = calls.last().is_some_and(|c| c.replay);
        let kind = random_kind(rng);
        let ordered = kind == Kind::Symmetric
            || (replay || after_replay) && !(unordered_replays && rng.next().is_multiple_of(2));
        calls.push(Call {
            kind,
            stream: 1 + (rng.next() % 2) as usize,
            replay,
            ordered,
        });
    }
    calls
}

/// Eager calls on two of the caller's streams, and graph replays the caller orders: every
/// collective ends Ok with its own data on every rank (the communicator's own stream orders
/// the eager calls; the claim, the counts and the digests accept every legal order).
#[test]
fn eager_calls_on_two_streams_and_ordered_replays_read_only_their_own_data() {
    let mut rng = Rng(0x48);
    for case in 0..600u64 {
        let world = 2 + (rng.next() % 5) as usize;
        let len = 1 + rng.next() % 10;
        let calls = random_calls(&mut rng, len, true, false);
        let start = if case % 3 == 0 { u32::MAX - 4 } else { 0 };
        run_calls(world, &calls, rng.next(), start, FIXED);
    }
}

/// Programs of random calls with faults: waits that give up (a peer later than the timeout),
/// host aborts, every launch queued ahead, eager calls on two streams, replays that the caller
/// ordered or not. Returns the Ok (each checked) and failed outcomes, or the first wrong Ok.
fn faulty_cases(
    rules: Rules,
    cases: u64,
    seed: u64,
    shape: impl Fn(&mut Rng) -> Vec<Call>,
) -> Result<(u64, u64), String> {
    let mut rng = Rng(seed);
    let (mut ok, mut failed) = (0, 0);
    for case in 0..cases {
        let world = 2 + (rng.next() % 3) as usize;
        let calls = shape(&mut rng);
        let faults = Faults {
            timeout_one_in: [0, 20, 200][(case % 3) as usize],
            abort_one_in: if case % 4 == 0 { 3000 } else { 0 },
            deadline: true,
        };
        let start = if case % 5 == 0 { u32::MAX - 3 } else { 0 };
        let outcomes = run_faulty(
            world,
            &calls,
            rng.next(),
            start,
            |c| (c & 1) as usize,
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

/// Eager calls on one stream (the shape issue 34 drilled).
fn one_stream(rng: &mut Rng) -> Vec<Call> {
    let len = 2 + rng.next() % 8;
    (0..len).map(|_| Call::eager(random_kind(rng), 1)).collect()
}

/// Eager calls on two streams, replays ordered or not.
fn two_streams_and_replays(rng: &mut Rng) -> Vec<Call> {
    let len = 2 + rng.next() % 8;
    random_calls(rng, len, true, true)
}

/// Timeouts, aborts, stop words, late peers, launches queued ahead, eager calls on two
/// streams and replays unordered against them: with the fix no launch that read another
/// collective's data returns Ok (every read is checked against the index of the collective
/// the host called), and a rank whose barrier failed arrives nowhere again.
#[test]
fn failures_late_peers_streams_and_replays_never_give_a_wrong_ok() {
    let (ok, failed) = faulty_cases(FIXED, 3000, 0xfa11, two_streams_and_replays)
        .unwrap_or_else(|e| panic!("{e}"));
    println!(
        "ONE_KERNEL_MODEL fixed, two streams and replays: {ok} Ok (each checked), {failed} failed, 0 wrong"
    );
    assert!(
        ok > 1000 && failed > 1000,
        "faults and successes both happened"
    );
    let (ok, failed) =
        faulty_cases(FIXED, 3000, 0xfa11, one_stream).unwrap_or_else(|e| panic!("{e}"));
    println!(
        "ONE_KERNEL_MODEL fixed, one stream: {ok} Ok (each checked), {failed} failed, 0 wrong"
    );
    assert!(ok > 1000 && failed > 1000);
}

/// Issue 48, item 1: the code before it (issue 34's protocol, each launch on the stream the
/// caller names) gives a wrong Ok once eager calls name two streams: two launches of one rank
/// read the same tick and half and overwrite each other's scratch.
#[test]
fn the_model_catches_eager_calls_on_two_streams_before_issue_48() {
    let two_streams = |rng: &mut Rng| {
        let len = 2 + rng.next() % 8;
        random_calls(rng, len, false, false)
    };
    let e = faulty_cases(FIXED_34, 3000, 0xfa11, two_streams).expect_err("a wrong Ok");
    println!("ONE_KERNEL_MODEL issue 34's protocol, eager calls on two streams: {e}");
    assert!(e.contains("a wrong Ok"), "{e}");
    // Even without a fault: two streams alone.
    let mut rng = Rng(0x2);
    let found = (0..3000).find_map(|_| {
        let calls = two_streams(&mut rng);
        let faults = Faults {
            deadline: true,
            ..NO_FAULTS
        };
        run_faulty(
            3,
            &calls,
            rng.next(),
            0,
            |c| (c & 1) as usize,
            FIXED_34,
            faults,
        )
        .err()
    });
    println!("ONE_KERNEL_MODEL issue 34's protocol, two streams, no fault: {found:?}");
    assert!(found.is_some_and(|e| e.contains("a wrong Ok")));
}

/// Issue 48, item 1: with eager calls in call order, a replay unordered against them still
/// runs beside an eager launch. Without the claim and the counted word the model finds a
/// wrong Ok; each of the two alone is checked too.
#[test]
fn the_model_catches_replays_beside_eager_calls_without_the_claim() {
    let ordered_only = Rules {
        exclusive: false,
        count_checked: false,
        ..FIXED
    };
    let e =
        faulty_cases(ordered_only, 3000, 0xfa11, two_streams_and_replays).expect_err("a wrong Ok");
    println!("ONE_KERNEL_MODEL call order without the claim: {e}");
    assert!(e.contains("a wrong Ok"), "{e}");
    let claim_only = Rules {
        count_checked: false,
        ..FIXED
    };
    let got = faulty_cases(claim_only, 3000, 0xfa11, two_streams_and_replays);
    println!("ONE_KERNEL_MODEL the claim without the counted word: {got:?}");
    let count_only = Rules {
        exclusive: false,
        ..FIXED
    };
    let got = faulty_cases(count_only, 3000, 0xfa11, two_streams_and_replays);
    println!("ONE_KERNEL_MODEL the counted word without the claim: {got:?}");
    assert!(
        got.is_err(),
        "the count alone cannot stop two launches sharing a half"
    );
}

/// Issue 48, item 3: a rank that gives up at the symmetric kernel's closing barrier after
/// arriving returns its buffer to the caller while a peer still reads it, and a late peer
/// passes on its stale arrival. The model (which now has the caller write its buffer after
/// every kernel end, failed or not) catches issue 34's protocol; taking the arrival back
/// closes it.
#[test]
fn the_model_catches_a_stale_arrival_at_the_closing_barrier() {
    let no_withdraw = Rules {
        withdraw: false,
        ..FIXED
    };
    let symmetric = |rng: &mut Rng| {
        let len = 2 + rng.next() % 6;
        (0..len)
            .map(|_| Call::eager(Kind::Symmetric, 1))
            .collect::<Vec<_>>()
    };
    let e = faulty_cases(no_withdraw, 6000, 0x3, symmetric).expect_err("a wrong Ok");
    println!("ONE_KERNEL_MODEL without taking arrivals back: {e}");
    assert!(e.contains("a wrong Ok"), "{e}");
    let (ok, failed) = faulty_cases(FIXED, 6000, 0x3, symmetric).unwrap_or_else(|e| panic!("{e}"));
    println!("ONE_KERNEL_MODEL taking arrivals back: {ok} Ok, {failed} failed, 0 wrong");
}

/// Issue 34's protocol before its fix: a block whose barrier failed neither set the stop word
/// nor advanced the sequence words, the next launch copied its input before it looked at the
/// stop word, and the arrival word left the collective's number out. The model finds the
/// wrong Ok the GPU drill found: a late peer pairs its collective with this rank's next one.
#[test]
fn the_model_catches_the_protocol_before_issue_34() {
    // As the GPU drill of issue 34 ran it: replays of one graph, whose descriptors are
    // equal.
    let before = Rules {
        stop_at_entry: false,
        stop_on_failure: false,
        sequence_in_word: false,
        per_call_descriptors: false,
        ..FIXED_34
    };
    let e = faulty_cases(before, 3000, 0xfa11, one_stream).expect_err("a wrong Ok");
    println!("ONE_KERNEL_MODEL before issue 34: {e}");
    assert!(e.contains("a wrong Ok"), "{e}");
    // The collective's number in the arrival word alone does not close it: the number comes
    // from the failed rank's sequence words, which the failure did not advance, so its next
    // launch arrives with the failed one's number. The stop word (set by the failing block,
    // read before any write) does.
    let sequence_only = Rules {
        sequence_in_word: true,
        ..before
    };
    let e = faulty_cases(sequence_only, 3000, 0xfa11, one_stream).expect_err("the number alone");
    println!("ONE_KERNEL_MODEL the number in the word alone: {e}");
    let stop_only = Rules {
        stop_at_entry: true,
        stop_on_failure: true,
        ..before
    };
    let got = faulty_cases(stop_only, 3000, 0xfa11, one_stream);
    println!(
        "ONE_KERNEL_MODEL the stop word alone (one stream, the caller's writes modelled): {got:?}"
    );
}

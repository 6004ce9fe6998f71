//! A simulated ring: N schedules, real data, a transport that delivers each connection's writes
//! in order but interleaves connections and completions at random, and faults (lost peers,
//! frozen ranks, stale epochs, forged immediates). Every run must end with the exact sum on
//! every rank, or with every surviving rank failed and naming the fault: never a hang.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use nodetour_ring::plan::Shape;
use nodetour_ring::schedule::Arrival;
use nodetour_ring::{Action, Error, Immediate, Plan, RingSchedule};
use proptest::prelude::*;

mod common;
use common::Rng;

struct Write {
    imm: u32,
    slot: u8,
    data: Vec<i64>,
    // What the sender's buffer held at post time, to check it was not changed before delivery.
    from: std::ops::Range<u64>,
    unit: u32,
}

struct Rank {
    sched: RingSchedule,
    data: Vec<i64>,
    slots: Vec<Vec<i64>>,
    // Writes on the connection to the next rank, in order.
    wire: VecDeque<Write>,
    // Grants on their way to the previous rank, in order.
    grants: VecDeque<u8>,
    // Sends delivered, awaiting their local completion (any order).
    sent: Vec<u32>,
    // Reduces/copies queued (any order): (unit, range, slot, reduce?).
    work: Vec<(u32, std::ops::Range<u64>, u8, bool)>,
    outcome: Option<Result<(), Error>>,
    alive: bool,
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    /// Rank k dies after `at` events; the others learn it from the liveness mesh.
    Lost {
        k: usize,
        at: usize,
    },
    /// Rank k stops processing after `at` events; nobody tells the others (only timeouts).
    Frozen {
        k: usize,
        at: usize,
    },
    /// A late write of the previous epoch reaches rank k after `at` events.
    Stale {
        k: usize,
        at: usize,
    },
    /// A forged immediate (an ungranted slot) reaches rank k after `at` events.
    Forged {
        k: usize,
        at: usize,
    },
}

struct Outcome {
    ranks: Vec<Rank>,
    initial: Vec<Vec<i64>>,
    shape: Shape,
}

fn run(world: u32, count: u64, slot_elems: u64, slots: u32, seed: u64, fault: Fault) -> Outcome {
    run_shaped(
        Shape::AllReduce,
        world,
        count,
        slot_elems,
        slots,
        seed,
        fault,
    )
}

fn run_shaped(
    shape: Shape,
    world: u32,
    count: u64,
    slot_elems: u64,
    slots: u32,
    seed: u64,
    fault: Fault,
) -> Outcome {
    let plan = Plan::new(world, count, 8, slot_elems * 8, slots)
        .unwrap()
        .with_shape(shape)
        .unwrap();
    let t0 = Instant::now();
    let timeout = Duration::from_secs(10);
    let epoch = 9;
    let initial: Vec<Vec<i64>> = (0..world)
        .map(|r| {
            (0..count)
                .map(|i| (i as i64 * 7 + r as i64 * 1_000_003) % 1_000_033 - 500_000)
                .collect()
        })
        .collect();
    let mut ranks: Vec<Rank> = (0..world)
        .map(|r| Rank {
            // Half the runs with standing grants: the first slots were released before the
            // collective began (no initial grants; the sender starts on the release).
            sched: if seed & 2 != 0 {
                let mut s = RingSchedule::new_standing(plan, r, epoch, timeout, t0);
                if !s.is_done() {
                    s.handle_released(t0).unwrap();
                }
                s
            } else {
                RingSchedule::new(plan, r, epoch, timeout, t0)
            },
            data: initial[r as usize].clone(),
            slots: vec![Vec::new(); slots as usize],
            wire: VecDeque::new(),
            grants: VecDeque::new(),
            sent: Vec::new(),
            work: Vec::new(),
            outcome: None,
            alive: true,
        })
        .collect();
    let mut rng = Rng(seed | 1);
    let n = world as usize;
    let mut events = 0usize;
    let mut now = t0;
    loop {
        // Turn every rank's new actions into simulated state.
        for rank in ranks.iter_mut() {
            while let Some(a) = rank.sched.poll_action() {
                match a {
                    Action::Send {
                        unit,
                        elements,
                        slot,
                        imm,
                    } => {
                        let data =
                            rank.data[elements.start as usize..elements.end as usize].to_vec();
                        rank.wire.push_back(Write {
                            imm,
                            slot,
                            data,
                            from: elements,
                            unit,
                        });
                    }
                    Action::Reduce {
                        unit,
                        elements,
                        slot,
                    } => rank.work.push((unit, elements, slot, true)),
                    Action::Copy {
                        unit,
                        elements,
                        slot,
                    } => rank.work.push((unit, elements, slot, false)),
                    Action::Grant { slot } => rank.grants.push_back(slot),
                    Action::Done => rank.outcome = Some(Ok(())),
                    Action::Failed(e) => rank.outcome = Some(Err(e)),
                }
            }
        }
        // Faults that strike at a point in time.
        match fault {
            Fault::Lost { k, at } | Fault::Frozen { k, at } if events == at && ranks[k].alive => {
                ranks[k].alive = false;
                if let Fault::Lost { .. } = fault {
                    for (r, rank) in ranks.iter_mut().enumerate() {
                        if r != k {
                            rank.sched.handle_peer_lost(k as u32);
                        }
                    }
                }
                continue;
            }
            Fault::Stale { k, at } if events == at => {
                let imm = Immediate {
                    epoch: epoch - 1,
                    slot: 0,
                    seq: 0,
                }
                .encode();
                if ranks[k].outcome.is_none() {
                    assert_eq!(ranks[k].sched.handle_arrived(imm, now), Ok(Arrival::Stale));
                }
            }
            Fault::Forged { k, at } if events == at && ranks[k].outcome.is_none() => {
                let imm = Immediate {
                    epoch,
                    slot: 255,
                    seq: 0,
                }
                .encode();
                let r = ranks[k].sched.handle_arrived(imm, now);
                assert!(r.is_err(), "a forged immediate must be refused");
            }
            _ => {}
        }
        // Enabled events of live, running ranks.
        let mut enabled: Vec<(usize, u8)> = Vec::new();
        for r in 0..n {
            let rank = &ranks[r];
            if !rank.alive || rank.outcome.is_some() {
                continue;
            }
            let next = (r + 1) % n;
            let prev = (r + n - 1) % n;
            if !rank.wire.is_empty() && ranks[next].alive && ranks[next].outcome.is_none() {
                enabled.push((r, 0));
            }
            if !rank.grants.is_empty() && ranks[prev].alive && ranks[prev].outcome.is_none() {
                enabled.push((r, 1));
            }
            if !rank.sent.is_empty() {
                enabled.push((r, 2));
            }
            if !rank.work.is_empty() {
                enabled.push((r, 3));
            }
        }
        if enabled.is_empty() {
            let running: Vec<usize> = (0..n)
                .filter(|r| ranks[*r].alive && ranks[*r].outcome.is_none())
                .collect();
            if running.is_empty() {
                break;
            }
            // Nothing can move: only time passing can end it.
            now += timeout;
            for r in running {
                ranks[r].sched.handle_timeout(now);
            }
            continue;
        }
        events += 1;
        now += Duration::from_micros(1);
        let (r, kind) = enabled[rng.below(enabled.len())];
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        match kind {
            0 => {
                // Deliver the oldest write on r → r + 1 (RC delivers in order).
                let w = ranks[r].wire.pop_front().unwrap();
                assert_eq!(
                    &ranks[r].data[w.from.start as usize..w.from.end as usize],
                    &w.data[..],
                    "rank {r} changed a chunk before its send completed"
                );
                ranks[next].slots[w.slot as usize] = w.data;
                let _ = ranks[next].sched.handle_arrived(w.imm, now);
                ranks[r].sent.push(w.unit);
            }
            1 => {
                let slot = ranks[r].grants.pop_front().unwrap();
                let _ = ranks[prev].sched.handle_granted(slot, now);
            }
            2 => {
                let i = rng.below(ranks[r].sent.len());
                let unit = ranks[r].sent.swap_remove(i);
                ranks[r].sched.handle_sent(unit, now).unwrap();
            }
            _ => {
                let i = rng.below(ranks[r].work.len());
                let (unit, range, slot, reduce) = ranks[r].work.swap_remove(i);
                let rank = &mut ranks[r];
                let src = rank.slots[slot as usize].clone();
                assert_eq!(src.len() as u64, range.end - range.start);
                for (d, s) in rank.data[range.start as usize..range.end as usize]
                    .iter_mut()
                    .zip(&src)
                {
                    *d = if reduce { d.wrapping_add(*s) } else { *s };
                }
                rank.sched.handle_processed(unit, now).unwrap();
            }
        }
        assert!(events < 5_000_000, "runaway simulation");
    }
    Outcome {
        ranks,
        initial,
        shape: plan.shape,
    }
}

/// Whether rank `r` holds what the collective promises it: the sum everywhere (allreduce), the
/// sum of its own block (reduce-scatter), every rank's own block (all-gather), the root's buffer
/// (broadcast).
fn holds_the_answer(o: &Outcome, r: usize) -> bool {
    let n = o.initial.len();
    let count = o.initial[0].len();
    let block = count / n.max(1);
    let sum = |i: usize| o.initial.iter().fold(0i64, |a, v| a.wrapping_add(v[i]));
    let data = &o.ranks[r].data;
    match o.shape {
        Shape::AllReduce => (0..count).all(|i| data[i] == sum(i)),
        Shape::ReduceScatter => (r * block..(r + 1) * block).all(|i| data[i] == sum(i)),
        Shape::AllGather => (0..count).all(|i| data[i] == o.initial[i / block][i]),
        Shape::Broadcast { root } => *data == o.initial[root as usize],
    }
}

fn assert_every_rank_right(o: &Outcome) {
    for (r, rank) in o.ranks.iter().enumerate() {
        assert_eq!(rank.outcome, Some(Ok(())), "rank {r} ({:?})", o.shape);
        assert!(
            holds_the_answer(o, r),
            "rank {r} has the wrong result ({:?})",
            o.shape
        );
    }
}

fn shape_of(pick: u8, root: u32) -> Shape {
    match pick % 4 {
        0 => Shape::AllReduce,
        1 => Shape::ReduceScatter,
        2 => Shape::AllGather,
        _ => Shape::Broadcast { root },
    }
}

fn assert_exact_sum(o: &Outcome) {
    let count = o.initial[0].len();
    let want: Vec<i64> = (0..count)
        .map(|i| o.initial.iter().fold(0i64, |a, v| a.wrapping_add(v[i])))
        .collect();
    for (r, rank) in o.ranks.iter().enumerate() {
        assert_eq!(rank.outcome, Some(Ok(())), "rank {r}");
        assert_eq!(rank.data, want, "rank {r} has the wrong result");
    }
}

const PRIMES: [u64; 6] = [1, 2, 3, 97, 1009, 7919];

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn every_interleaving_gives_the_exact_sum(world in 1u32..=16, count_pick in 0usize..9, raw_count in 0u64..3000,
                                              slot_elems in 1u64..300, slots in 1u32..5, seed: u64) {
        let count = match count_pick { 0 => 0, 1..=6 => PRIMES[count_pick - 1], _ => raw_count };
        let o = run(world, count, slot_elems, slots, seed, Fault::None);
        assert_exact_sum(&o);
    }

    #[test]
    fn a_lost_peer_fails_every_survivor_naming_it(world in 2u32..=8, seed: u64, at in 0usize..200, k_pick: usize) {
        let k = k_pick % world as usize;
        let o = run(world, 500, 16, 2, seed, Fault::Lost { k, at });
        for (r, rank) in o.ranks.iter().enumerate() {
            if r == k {
                continue;
            }
            // Either it finished before the loss could matter, or it failed naming k.
            match &rank.outcome {
                Some(Ok(())) => {}
                Some(Err(Error::PeerLost { rank })) => prop_assert_eq!(*rank as usize, k),
                other => prop_assert!(false, "rank {} ended with {:?}", r, other),
            }
        }
    }

    #[test]
    fn a_frozen_rank_is_caught_by_timeouts_not_a_hang(world in 2u32..=6, seed: u64, at in 0usize..100, k_pick: usize) {
        let k = k_pick % world as usize;
        let o = run(world, 300, 16, 2, seed, Fault::Frozen { k, at });
        for (r, rank) in o.ranks.iter().enumerate() {
            if r != k {
                prop_assert!(matches!(rank.outcome, Some(Ok(())) | Some(Err(Error::Timeout { .. }))), "rank {} {:?}", r, rank.outcome);
            }
        }
    }

    #[test]
    fn every_shape_gives_the_exact_answer_on_every_rank(world in 1u32..=9, block in 0u64..200, slot_elems in 1u64..64,
                                                        slots in 1u32..5, seed: u64, pick: u8, root_pick: u32) {
        let shape = shape_of(pick, root_pick % world);
        let o = run_shaped(shape, world, block * u64::from(world), slot_elems, slots, seed, Fault::None);
        assert_every_rank_right(&o);
    }

    #[test]
    fn a_lost_peer_in_any_shape_leaves_every_survivor_right_or_failed_naming_it(world in 2u32..=7, seed: u64, at in 0usize..150,
                                                                              k_pick: usize, pick: u8, root_pick: u32) {
        let k = k_pick % world as usize;
        let shape = shape_of(pick, root_pick % world);
        let o = run_shaped(shape, world, 40 * u64::from(world), 8, 2, seed, Fault::Lost { k, at });
        for (r, rank) in o.ranks.iter().enumerate() {
            if r == k {
                continue;
            }
            match &rank.outcome {
                Some(Ok(())) => prop_assert!(holds_the_answer(&o, r), "rank {} returned Ok with a wrong answer", r),
                Some(Err(Error::PeerLost { rank })) => prop_assert_eq!(*rank as usize, k),
                other => prop_assert!(false, "rank {} ended with {:?}", r, other),
            }
        }
    }

    #[test]
    fn late_writes_of_an_old_epoch_change_nothing(world in 2u32..=6, seed: u64, at in 0usize..100, k_pick: usize) {
        let k = k_pick % world as usize;
        let o = run(world, 257, 16, 3, seed, Fault::Stale { k, at });
        assert_exact_sum(&o);
    }
}

#[test]
fn a_forged_immediate_fails_the_victim_and_the_rest_stop_cleanly() {
    let o = run(4, 400, 16, 2, 42, Fault::Forged { k: 2, at: 10 });
    assert!(
        matches!(
            o.ranks[2].outcome,
            Some(Err(Error::Protocol { rank: 1, .. }))
        ),
        "{:?}",
        o.ranks[2].outcome
    );
    for rank in &o.ranks {
        assert!(rank.outcome.is_some(), "nobody hangs");
    }
}

#[test]
fn sixteen_ranks_with_one_slot_and_tiny_chunks() {
    assert_exact_sum(&run(16, 1009, 1, 1, 7, Fault::None));
}

//! The stream-ordered ring program, executed by a simulator: every rank has a send and a receive
//! queue that run in order, queues of all ranks interleave at random, counters and slots behave
//! like the shared host words and slot memory of cuda-ipc / shm. Several collectives are queued
//! back to back on the same counters and overlap (each rank's streams run on into the next
//! collective; slots reused across collectives), starting near 2^32 so that the flag values
//! wrap; with replays, a captured program runs again between eager ones on counters only the
//! GPU knows. Every run must end with the exact result on every rank and never deadlock;
//! and removing the slot-reuse or the data dependency must be caught (some interleaving corrupts
//! the result), which shows the simulator sees the hazards the dependencies prevent.

use nodetour_ring::Plan;
use nodetour_ring::plan::Shape;
use nodetour_ring::stream_plan::{
    LinkCounters, RecvKind, RecvOp, Replayable, SendOp, StreamProgram, program_exchange_on,
    program_on,
};
use proptest::prelude::*;

mod common;
use common::Rng;

/// The cyclic comparison of cuStreamWaitValue32 (GEQ): `(int32)(word − value) ≥ 0`.
fn reached(word: u32, value: u32) -> bool {
    (word.wrapping_sub(value) as i32) >= 0
}

#[derive(Clone, Copy, Default)]
struct Drop_ {
    released: bool,
    after_send: bool,
    after_recv: bool,
    /// Two ranks: the exchange program instead of the ring.
    exchange: bool,
    /// The collective (`None`: allreduce).
    shape: Option<Shape>,
    /// Replays: the first collective is captured (planned once on replayable links) and run
    /// again at every odd collective, the others planned eagerly; the GPU's counters resolve
    /// every value (the host's counters do not see the replays).
    replay: bool,
    /// With `replay`: plan on links that are not replayable (must be caught).
    unaligned: bool,
    /// Each eager collective cut into chunks of its own size, at most a slot (a pipeline
    /// sized by the collective, as the GPU ring cuts them): the slots are reused by chunks of
    /// other sizes.
    pipelined: bool,
}

/// The GPU's view of a program planned from counters `start`: its values moved to the
/// device's counters `dev` (rounded up to `slots` on replayable links), as the guarded kernels
/// resolve them; slots unchanged.
fn resolve(
    p: &StreamProgram,
    dev: LinkCounters,
    slots: u64,
    aligned: bool,
) -> (Vec<SendOp>, Vec<RecvOp>) {
    let up = |c: u64| {
        if aligned {
            c.next_multiple_of(slots)
        } else {
            c
        }
    };
    let (s0, r0) = (up(dev.sent) as u32, up(dev.received) as u32);
    let (ps, pr) = (p.start.sent as u32, p.start.received as u32);
    let sends = p
        .sends
        .iter()
        .map(|s| SendOp {
            ready: s0.wrapping_add(s.ready.wrapping_sub(ps)),
            wait_released: s.wait_released.map(|v| s0.wrapping_add(v.wrapping_sub(ps))),
            ..s.clone()
        })
        .collect();
    let recvs = p
        .recvs
        .iter()
        .map(|r| RecvOp {
            wait_ready: r0.wrapping_add(r.wait_ready.wrapping_sub(pr)),
            released: r0.wrapping_add(r.released.wrapping_sub(pr)),
            ..r.clone()
        })
        .collect();
    (sends, recvs)
}

struct Rank {
    /// Each collective's buffer.
    data: Vec<Vec<i64>>,
    slots: Vec<Vec<i64>>,
    ready: u32,
    released: u32,
    /// Every collective's sends and receives, in stream order (a stream runs on into the
    /// next collective as soon as its own order allows), each with its collective.
    sends: Vec<(usize, SendOp)>,
    recvs: Vec<(usize, RecvOp)>,
    next_send: usize,
    next_recv: usize,
}

/// Runs `collectives` allreduces (sum, or average when `avg`) over `world` ranks, queued back
/// to back (each rank's streams run on into the next collective, as on the GPU); returns
/// whether every rank got the right answer. Panics on a deadlock or an out-of-slot write.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
fn run(
    world: u32,
    count: u64,
    slot_elems: u64,
    slots: u32,
    collectives: usize,
    avg: bool,
    seed: u64,
    drop: Drop_,
) -> bool {
    let plan = Plan::new(world, count, 8, slot_elems * 8, slots)
        .unwrap()
        .with_shape(drop.shape.unwrap_or(Shape::AllReduce))
        .unwrap();
    let n = world as usize;
    let mut rng = Rng(seed | 1);
    // Start the counters near 2^32 so that flag values wrap during the run, as if that many
    // chunks had moved and been consumed before.
    let start = u32::MAX - 3;
    let mut counters = vec![
        LinkCounters {
            sent: u64::from(start),
            received: u64::from(start),
        };
        n
    ];
    let mut inputs: Vec<Vec<Vec<i64>>> = vec![Vec::new(); collectives];
    for (k, input) in inputs.iter_mut().enumerate() {
        for r in 0..n {
            input.push(
                (0..count)
                    .map(|i| {
                        ((i as i64 * 7 + r as i64 * 13 + k as i64) % 1000 - 500) * world as i64
                    })
                    .collect(),
            );
        }
    }
    let mut ranks: Vec<Rank> = (0..n)
        .map(|r| Rank {
            data: inputs.iter().map(|input| input[r].clone()).collect(),
            slots: vec![vec![0; slot_elems as usize]; slots as usize],
            ready: start,
            released: start,
            sends: Vec::new(),
            recvs: Vec::new(),
            next_send: 0,
            next_recv: 0,
        })
        .collect();
    let replayable = if drop.replay && !drop.unaligned {
        Replayable::BOTH
    } else {
        Replayable::NONE
    };
    // The counters the GPU keeps (advanced by every collective run, replays too).
    let mut dev = counters.clone();
    let mut captured: Vec<Option<StreamProgram>> = vec![None; n];
    for k in 0..collectives {
        for r in 0..n {
            let replayed = drop.replay && k % 2 == 1;
            let p = if replayed {
                captured[r]
                    .clone()
                    .expect("captured at the first collective")
            } else {
                // Every rank cuts collective k the same way.
                let chunk = if drop.pipelined {
                    1 + (k as u64 * 5 + (seed >> 8)) % slot_elems
                } else {
                    slot_elems
                };
                let plan = Plan::new(world, count, 8, chunk * 8, slots)
                    .unwrap()
                    .with_shape(plan.shape)
                    .unwrap();
                if drop.exchange {
                    program_exchange_on(&plan, avg, &mut counters[r], replayable)
                } else {
                    program_on(&plan, r as u32, avg, &mut counters[r], replayable)
                }
            };
            if drop.replay && k == 0 {
                captured[r] = Some(p.clone());
            }
            let (mut sends, mut recvs) = if drop.replay {
                resolve(&p, dev[r], u64::from(slots), replayable.send)
            } else {
                (p.sends.clone(), p.recvs.clone())
            };
            if drop.replay {
                let up = |c: u64| {
                    if replayable.send {
                        c.next_multiple_of(u64::from(slots))
                    } else {
                        c
                    }
                };
                dev[r].sent = up(dev[r].sent) + p.sends.len() as u64;
                dev[r].received = up(dev[r].received) + p.recvs.len() as u64;
            }
            if drop.released {
                sends.iter_mut().for_each(|s| s.wait_released = None);
            }
            if drop.after_send {
                recvs.iter_mut().for_each(|s| s.after_send = None);
            }
            if drop.after_recv {
                sends.iter_mut().for_each(|s| s.after_recv = None);
            }
            // Indices into this rank's whole queues.
            let (s_base, r_base) = (ranks[r].sends.len(), ranks[r].recvs.len());
            for mut o in sends {
                o.after_recv = o.after_recv.map(|i| i + r_base);
                ranks[r].sends.push((k, o));
            }
            for mut o in recvs {
                o.after_send = o.after_send.map(|i| i + s_base);
                ranks[r].recvs.push((k, o));
            }
        }
    }
    loop {
        // Runnable queue heads: (rank, is_send).
        let mut runnable = Vec::new();
        let mut remaining = false;
        for r in 0..n {
            let me = &ranks[r];
            if let Some((_, s)) = me.sends.get(me.next_send) {
                remaining = true;
                let data_ready = s.after_recv.is_none_or(|i| i < me.next_recv);
                // `released` of the link to `next` lives at this rank (written by `next`).
                let slot_free = s.wait_released.is_none_or(|v| reached(me.released, v));
                if data_ready && slot_free {
                    runnable.push((r, true));
                }
            }
            if let Some((_, o)) = me.recvs.get(me.next_recv) {
                remaining = true;
                let landed = reached(me.ready, o.wait_ready);
                let war = o.after_send.is_none_or(|i| i < me.next_send);
                if landed && war {
                    runnable.push((r, false));
                }
            }
        }
        if !remaining {
            break;
        }
        if runnable.is_empty() && drop.unaligned {
            return false; // caught: a replay waits for a value that never comes
        }
        assert!(!runnable.is_empty(), "deadlock");
        let (r, is_send) = runnable[rng.below(runnable.len())];
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        if is_send {
            let (k, s) = ranks[r].sends[ranks[r].next_send].clone();
            let (a, b) = (s.elements.start as usize, s.elements.end as usize);
            assert!(b - a <= slot_elems as usize, "a chunk larger than a slot");
            let chunk = ranks[r].data[k][a..b].to_vec();
            let slot = &mut ranks[next].slots[s.slot as usize];
            slot[..chunk.len()].copy_from_slice(&chunk);
            assert!(reached(s.ready, ranks[next].ready), "ready went backwards");
            ranks[next].ready = s.ready;
            ranks[r].next_send += 1;
        } else {
            let (k, o) = ranks[r].recvs[ranks[r].next_recv].clone();
            let (a, b) = (o.elements.start as usize, o.elements.end as usize);
            let slot = ranks[r].slots[o.slot as usize][..b - a].to_vec();
            match o.kind {
                RecvKind::Reduce { average } => {
                    for (x, y) in ranks[r].data[k][a..b].iter_mut().zip(&slot) {
                        *x += y;
                        if average {
                            *x /= world as i64;
                        }
                    }
                }
                RecvKind::Copy => ranks[r].data[k][a..b].copy_from_slice(&slot),
            }
            // Released goes to the previous rank: it is the word the sender waits on.
            ranks[prev].released = o.released;
            ranks[r].next_recv += 1;
        }
    }
    let mut all_ok = true;
    for (k, input) in inputs.iter().enumerate() {
        let reduced: Vec<i64> = (0..count as usize)
            .map(|i| {
                let s: i64 = input.iter().map(|v| v[i]).sum();
                if avg && n > 1 { s / world as i64 } else { s }
            })
            .collect();
        for r in 0..n {
            let seg = |s: usize| {
                let x = plan.segment(s as u32);
                x.start as usize..x.end as usize
            };
            let data = &ranks[r].data[k];
            let ok = match plan.shape {
                Shape::AllReduce => *data == reduced,
                // Rank r's own block is reduced (the others hold partial sums).
                Shape::ReduceScatter => data[seg(r)] == reduced[seg(r)],
                // Block s comes from rank s.
                Shape::AllGather => (0..n).all(|s| data[seg(s)] == input[s][seg(s)]),
                Shape::Broadcast { root } => *data == input[root as usize],
            };
            if !ok {
                all_ok = false;
            }
        }
    }
    all_ok
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn every_interleaving_gives_the_exact_result(
        world in 1u32..9,
        count in prop::sample::select(vec![0u64, 1, 2, 7, 13, 31, 64, 97, 250]),
        slot_elems in 1u64..9,
        slots in 1u32..5,
        avg in any::<bool>(),
        seed in any::<u64>(),
    ) {
        prop_assert!(run(world, count, slot_elems, slots, 3, avg, seed, Drop_::default()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    #[test]
    fn every_interleaving_of_every_shape_gives_the_exact_result(
        world in 1u32..7,
        blocks in prop::sample::select(vec![0u64, 1, 2, 5, 13]),
        slot_elems in 1u64..7,
        slots in 1u32..4,
        avg in any::<bool>(),
        pick in 0u32..3,
        root in 0u32..7,
        seed in any::<u64>(),
    ) {
        let shape = match pick {
            0 => Shape::ReduceScatter,
            1 => Shape::AllGather,
            _ => Shape::Broadcast { root: root % world },
        };
        let count = blocks * u64::from(world);
        let v = Drop_ { shape: Some(shape), ..Drop_::default() };
        prop_assert!(run(world, count, slot_elems, slots, 3, avg, seed, v), "{shape:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]
    #[test]
    fn the_two_rank_exchange_gives_the_exact_result(
        count in prop::sample::select(vec![0u64, 1, 2, 7, 13, 64, 97]),
        slot_elems in 1u64..9,
        slots in 1u32..5,
        avg in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let exchange = Drop_ { exchange: true, ..Drop_::default() };
        prop_assert!(run(2, count, slot_elems, slots, 3, avg, seed, exchange));
    }
}

/// What `pick` (0 to 4) runs: an allreduce (0, and 4 where the exchange does not apply), a
/// reduce-scatter, an all-gather, a broadcast from a root taken from `seed`, or (4, two ranks)
/// the exchange; and the count, a multiple of `world` for the shapes that need one.
fn variant(pick: u32, world: u32, count: u64, seed: u64) -> (Drop_, u64) {
    let shape = match pick {
        1 => Some(Shape::ReduceScatter),
        2 => Some(Shape::AllGather),
        3 => Some(Shape::Broadcast {
            root: seed as u32 % world,
        }),
        _ => None,
    };
    let count = if shape.is_some() {
        count * u64::from(world)
    } else {
        count
    };
    let exchange = world == 2 && pick == 4;
    (
        Drop_ {
            shape,
            exchange,
            ..Drop_::default()
        },
        count,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// A collective captured into a CUDA graph and replayed between eager ones: on replayable
    /// links every replay gives the exact result (the GPU resolves the values against its own
    /// counters, which the host does not know after a replay).
    #[test]
    fn replays_between_eager_collectives_give_the_exact_result(
        world in 1u32..7,
        count in prop::sample::select(vec![0u64, 1, 2, 7, 13, 31, 64, 97]),
        slot_elems in 1u64..7,
        slots in 1u32..5,
        avg in any::<bool>(),
        pick in 0u32..5,
        seed in any::<u64>(),
    ) {
        let (v, count) = variant(pick, world, count, seed);
        let (shape, v) = (v.shape, Drop_ { replay: true, ..v });
        prop_assert!(run(world, count, slot_elems, slots, 6, avg, seed, v), "{shape:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]
    /// Collectives cut into chunks of their own sizes (pipelines sized by the collective),
    /// eager and replayed, ring and exchange, every shape: the exact result.
    #[test]
    fn pipelines_of_any_chunk_size_give_the_exact_result(
        world in 1u32..7,
        count in prop::sample::select(vec![0u64, 1, 2, 7, 13, 31, 64, 97]),
        slot_elems in 1u64..9,
        slots in 1u32..5,
        avg in any::<bool>(),
        pick in 0u32..5,
        replay in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let (v, count) = variant(pick, world, count, seed);
        let (shape, v) = (v.shape, Drop_ { replay, pipelined: true, ..v });
        prop_assert!(run(world, count, slot_elems, slots, 6, avg, seed, v), "{shape:?}");
    }
}

/// Replays need replayable links: planned on plain links (slots from the host's counters,
/// no credit wait for a slot the host thinks unused), some interleaving goes wrong.
#[test]
fn replays_need_replayable_links() {
    let drop = Drop_ {
        replay: true,
        unaligned: true,
        ..Drop_::default()
    };
    let caught = (0..400u64).any(|seed| !run(3, 31, 2, 5, 6, false, seed * 7919 + 1, drop));
    assert!(caught, "replays on plain links were never caught");
}

/// In the exchange, the write-after-read wait is what keeps a rank from combining into a range
/// before its send has read it.
#[test]
fn the_exchange_needs_its_write_after_read_wait() {
    let drop = Drop_ {
        exchange: true,
        after_send: true,
        ..Drop_::default()
    };
    assert!((0..400u64).any(|seed| !run(2, 31, 2, 2, 2, false, seed * 7919 + 1, drop)));
    let drop = Drop_ {
        exchange: true,
        released: true,
        ..Drop_::default()
    };
    assert!((0..400u64).any(|seed| !run(2, 31, 2, 2, 2, false, seed * 7919 + 1, drop)));
}

/// The slot-reuse and data dependencies are necessary: without either, some interleaving
/// corrupts the result.
#[test]
fn each_dependency_is_needed() {
    for (name, drop) in [
        (
            "released (slot reuse)",
            Drop_ {
                released: true,
                ..Drop_::default()
            },
        ),
        (
            "after_recv (send only final data)",
            Drop_ {
                after_recv: true,
                ..Drop_::default()
            },
        ),
    ] {
        let caught = (0..400u64).any(|seed| !run(3, 31, 2, 2, 2, false, seed * 7919 + 1, drop));
        assert!(caught, "dropping {name} was never caught");
    }
    // A broadcast relays what it received: without that wait a rank forwards stale data.
    let relay = Drop_ {
        after_recv: true,
        shape: Some(Shape::Broadcast { root: 1 }),
        ..Drop_::default()
    };
    assert!((0..400u64).any(|seed| !run(4, 30, 2, 2, 2, false, seed * 7919 + 1, relay)));
    // The write-after-read wait is implied by the data flow (the chunk an all-gather receive
    // brings has gone once around the ring since this rank sent that range), so dropping it
    // alone never corrupts; the program keeps it as a guard that costs one event wait.
    let fine = (0..200u64).all(|seed| {
        let drop = Drop_ {
            after_send: true,
            ..Drop_::default()
        };
        run(3, 31, 2, 2, 2, false, seed * 7919 + 1, drop)
    });
    assert!(fine);
}

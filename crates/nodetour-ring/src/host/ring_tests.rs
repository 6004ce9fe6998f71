//! The host ring over the in-process transport: ranks in threads, every data type and
//! operation, checked against a float64 reference (exact for integers).

use std::thread;
use std::time::Duration;

use crate::error::Error;
use crate::host::{BELL_BYTES, HostRing, HostRingOptions, Links};
use crate::reduce::{DataType, ReduceOp};
use crate::seeded;
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::{HostConnection, MemConnection, SlotGrant, SlotRegion};

/// Runs one allreduce over `world` ranks in threads; returns every rank's result.
fn all_reduce(
    world: u32,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    options: HostRingOptions,
) -> Vec<Vec<u8>> {
    all_reduce_repeated(world, count, dtype, op, options, 1)
}

/// `repeats` collectives back to back on the same rings (seq 0, 1, ...), with ranks
/// deliberately out of step, each on an input of its own (seeded by seq and rank) and each
/// result checked; returns the last results.
fn all_reduce_repeated(
    world: u32,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    options: HostRingOptions,
    repeats: u32,
) -> Vec<Vec<u8>> {
    let inputs: Vec<Vec<u8>> = (0..world)
        .map(|r| seeded::input(dtype, op, r, count, 0))
        .collect();
    run_ring(
        world,
        count * dtype.size(),
        options,
        inputs,
        &|r, ring, data| {
            for seq in 0..u64::from(repeats) {
                if r % 2 == 1 {
                    std::thread::sleep(Duration::from_micros(200 * (seq % 3)));
                }
                data.copy_from_slice(&seeded::input(dtype, op, r as u32, count, seq));
                let mine = seeded::rank_op(op, dtype, r as u32);
                ring.all_reduce(data, dtype, mine, seq, &|| Ok(()))?;
                if let Err(e) = seeded::verify(dtype, op, world, data, seq) {
                    panic!("world {world} rank {r}: {e}");
                }
            }
            Ok(())
        },
    )
    .into_iter()
    .map(|(result, data)| {
        result.unwrap();
        data
    })
    .collect()
}

/// What one rank's thread does with its ring and its data.
type RankBody<'a> =
    dyn Fn(usize, &mut HostRing<'_>, &mut Vec<u8>) -> crate::error::Result<()> + Sync + 'a;

/// A ring of `world` ranks in threads over the in-memory transport, work regions of
/// `max_bytes`; each rank runs `body` on its own data. Returns every rank's result and data.
fn run_ring(
    world: u32,
    max_bytes: usize,
    options: HostRingOptions,
    inputs: Vec<Vec<u8>>,
    body: &RankBody<'_>,
) -> Vec<(crate::error::Result<()>, Vec<u8>)> {
    let n = world as usize;
    // Connection r: rank r (its "next" side) ↔ rank r + 1 (its "prev" side).
    let mut nexts = Vec::new();
    let mut prevs: Vec<Option<MemConnection>> = (0..n).map(|_| None).collect();
    for r in 0..n {
        let (a, b) = MemConnection::pair();
        nexts.push(a);
        prevs[(r + 1) % n] = Some(b);
    }
    let mut prevs: Vec<MemConnection> = prevs.into_iter().map(Option::unwrap).collect();
    let region = |len: usize| SlotRegion::host(HostBuffer::new(len.max(1)).unwrap());
    let recv: Vec<SlotRegion> = (0..n)
        .map(|_| region(options.slots as usize * options.slot_bytes))
        .collect();
    let bell: Vec<SlotRegion> = (0..n).map(|_| region(BELL_BYTES)).collect();
    let work: Vec<SlotRegion> = (0..n).map(|_| region(max_bytes)).collect();
    // Rank r grants its slots on its prev connection, and a doorbell on its next connection.
    let recv_grants: Vec<SlotGrant> = (0..n).map(|r| prevs[r].grant(&recv[r]).unwrap()).collect();
    let bell_grants: Vec<SlotGrant> = (0..n).map(|r| nexts[r].grant(&bell[r]).unwrap()).collect();
    thread::scope(|s| {
        let handles: Vec<_> = nexts
            .iter_mut()
            .zip(prevs.iter_mut())
            .zip(inputs)
            .enumerate()
            .map(|(r, ((next, prev), mut data))| {
                let (recv, bell, work) = (recv[r].clone(), bell[r].clone(), work[r].clone());
                let next_slots = recv_grants[(r + 1) % n];
                let prev_slots = bell_grants[(r + n - 1) % n];
                s.spawn(move || {
                    let mut ring = HostRing {
                        rank: r as u32,
                        world,
                        links: Links::Two { next, prev },
                        next_slots,
                        prev_slots,
                        recv,
                        bell,
                        work,
                        options,
                        backlog: Vec::new(),
                        owed: Vec::new(),
                    };
                    let result = body(r, &mut ring, &mut data);
                    (result, data)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn check(world: u32, count: usize, dtype: DataType, op: ReduceOp, options: HostRingOptions) {
    for (r, out) in all_reduce(world, count, dtype, op, options)
        .iter()
        .enumerate()
    {
        if let Err(e) = seeded::verify(dtype, op, world, out, 0) {
            panic!("world {world} rank {r}: {e}");
        }
    }
}

fn small_slots() -> HostRingOptions {
    HostRingOptions {
        slot_bytes: 256,
        slots: 2,
        timeout: Duration::from_secs(20),
        spin: Duration::ZERO,
        spin_yields: false,
    }
}

#[test]
fn every_type_and_operation_matches_the_reference() {
    for dtype in DataType::ALL {
        for op in ReduceOp::ALL {
            check(3, 257, dtype, op, small_slots());
        }
    }
}

#[test]
fn ring_sizes_counts_and_slot_shapes() {
    for world in [1, 2, 4, 5, 8] {
        for count in [0usize, 1, 7, 1009] {
            check(world, count, DataType::F32, ReduceOp::Sum, small_slots());
        }
    }
    check(
        4,
        100_000,
        DataType::I64,
        ReduceOp::Sum,
        HostRingOptions {
            slot_bytes: 4096,
            slots: 1,
            timeout: Duration::from_secs(20),
            spin: Duration::ZERO,
            spin_yields: false,
        },
    );
    check(
        2,
        65_536,
        DataType::Bf16,
        ReduceOp::Avg,
        HostRingOptions::default(),
    );
    // Spinning between looks, as ranks that outnumber their CPUs do (yielding) and as ranks
    // that each have one do (pausing the core).
    for spin_yields in [true, false] {
        check(
            3,
            1_009,
            DataType::I32,
            ReduceOp::Max,
            HostRingOptions {
                spin: Duration::from_micros(100),
                spin_yields,
                ..small_slots()
            },
        );
    }
}

#[test]
fn back_to_back_collectives_keep_the_next_epochs_early_notifications() {
    // 150 collectives: the 7-bit epochs wrap. 800 elements: a few dozen chunks per collective
    // (a neighbour that finishes first sends the next collective's notices while this one still
    // runs), cheap enough to run under valgrind.
    const COUNT: usize = 800;
    for world in [2, 3, 5] {
        // Every one of the 150 results is checked against its own input's answer.
        all_reduce_repeated(
            world,
            COUNT,
            DataType::I64,
            ReduceOp::Sum,
            small_slots(),
            150,
        );
    }
}

/// Small integers: every result is exact, so any wrong byte shows.
fn ints(world: u32, count: usize) -> Vec<Vec<u8>> {
    (0..world)
        .map(|r| {
            (0..count)
                .flat_map(|i| ((i as i32 % 7) + r as i32).to_ne_bytes())
                .collect()
        })
        .collect()
}

#[test]
fn ranks_that_disagree_fail_everywhere_and_write_nothing() {
    let world = 3;
    let options = small_slots();
    // Rank 1 calls a different collective each time; everyone else the same one.
    type Call = (usize, DataType, ReduceOp, u64);
    let cases: [(Call, Call); 4] = [
        (
            (4000, DataType::I32, ReduceOp::Sum, 0),
            (2000, DataType::I32, ReduceOp::Sum, 0),
        ),
        (
            (4000, DataType::I32, ReduceOp::Sum, 0),
            (4000, DataType::F32, ReduceOp::Sum, 0),
        ),
        (
            (4000, DataType::I32, ReduceOp::Sum, 0),
            (4000, DataType::I32, ReduceOp::Max, 0),
        ),
        // The same epoch on the wire (seq mod 128), another sequence number.
        (
            (4000, DataType::I32, ReduceOp::Sum, 5),
            (4000, DataType::I32, ReduceOp::Sum, 133),
        ),
    ];
    for (everyone, odd) in cases {
        let inputs = ints(world, 4000);
        let start = std::time::Instant::now();
        let out = run_ring(
            world,
            4000 * 4,
            options,
            inputs.clone(),
            &|r, ring, data| {
                let (count, dtype, op, seq) = if r == 1 { odd } else { everyone };
                ring.all_reduce(&mut data[..count * 4], dtype, op, seq, &|| Ok(()))
            },
        );
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "ended at once, not at the deadline"
        );
        let mut disagreements = 0;
        for (r, (result, data)) in out.iter().enumerate() {
            match result {
                Err(Error::Disagreement { ours, theirs, .. }) => {
                    disagreements += 1;
                    assert_ne!(ours, theirs);
                }
                Err(Error::PeerFailed { .. }) => {}
                other => panic!("rank {r} with {odd:?}: {other:?}"),
            }
            assert_eq!(data, &inputs[r], "rank {r} wrote nothing");
        }
        assert!(disagreements >= 1, "someone named the disagreement");
    }
}

#[test]
fn an_abort_on_one_rank_ends_the_collective_everywhere_at_once() {
    let world = 4;
    let options = HostRingOptions {
        slot_bytes: 1024,
        slots: 2,
        timeout: Duration::from_secs(30),
        spin: Duration::ZERO,
        spin_yields: false,
    };
    let count = 200_000;
    let inputs = ints(world, count);
    let polls = std::sync::atomic::AtomicU32::new(0);
    let start = std::time::Instant::now();
    let out = run_ring(
        world,
        count * 4,
        options,
        inputs.clone(),
        &|r, ring, data| {
            // Rank 2 is aborted from outside (its liveness check says so) in the middle.
            let alive = || {
                if r == 2 && polls.fetch_add(1, std::sync::atomic::Ordering::Relaxed) > 50 {
                    return Err(nodetour_core::Error::Aborted {
                        reason: "aborted by the test".into(),
                    });
                }
                Ok(())
            };
            ring.all_reduce(data, DataType::I32, ReduceOp::Sum, 0, &alive)
        },
    );
    let elapsed = start.elapsed();
    assert!(
        elapsed < Duration::from_secs(5),
        "the others learned at once, not at their 30 s deadline ({elapsed:?})"
    );
    for (r, (result, data)) in out.iter().enumerate() {
        match (r, result) {
            // The abort arrives typed, with the caller's reason as it was given.
            (2, Err(Error::Aborted { reason })) if reason == "aborted by the test" => {}
            (_, Err(Error::PeerFailed { .. })) if r != 2 => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(data, &inputs[r], "rank {r} wrote nothing");
    }
}

/// A collective that fails (a disagreement, an abort) does not give its half of the slots back
/// at its end; the release it owes goes when the collective two later starts. Checked over the
/// collectives after it, with data: every one of them succeeds, right on every rank.
#[test]
fn collectives_after_a_failed_one_run_and_are_right() {
    for (world, slots) in [(2, 2), (3, 4), (4, 2)] {
        let options = HostRingOptions {
            slots,
            ..small_slots()
        };
        let count = 3000;
        let inputs = ints(world, count);
        let out = run_ring(
            world,
            count * 4,
            options,
            inputs.clone(),
            &|r, ring, data| {
                for seq in 0..8u64 {
                    // Each collective's own input: an Ok on an earlier one's data fails.
                    let input = seeded::input(DataType::I32, ReduceOp::Sum, r as u32, count, seq);
                    data.copy_from_slice(&input);
                    let result = match seq {
                        // Rank 1 calls another count (its first chunks may already be out).
                        2 => {
                            let n = if r == 1 { count / 2 } else { count };
                            ring.all_reduce(
                                &mut data[..n * 4],
                                DataType::I32,
                                ReduceOp::Sum,
                                seq,
                                &|| Ok(()),
                            )
                        }
                        // Rank 0 is aborted before anything moves; the others fail with it.
                        5 => ring.all_reduce(data, DataType::I32, ReduceOp::Sum, seq, &|| {
                            if r == 0 {
                                Err(nodetour_core::Error::Aborted {
                                    reason: "the test".into(),
                                })
                            } else {
                                Ok(())
                            }
                        }),
                        _ => ring.all_reduce(data, DataType::I32, ReduceOp::Sum, seq, &|| Ok(())),
                    };
                    match (seq, result) {
                        (2 | 5, Err(_)) => {
                            assert_eq!(data, &input, "rank {r} seq {seq}: untouched")
                        }
                        (2 | 5, Ok(())) => panic!("rank {r}: seq {seq} must fail"),
                        (_, Err(e)) => panic!("rank {r} seq {seq}: {e}"),
                        (_, Ok(())) => {
                            if let Err(e) =
                                seeded::verify(DataType::I32, ReduceOp::Sum, world, data, seq)
                            {
                                panic!("world {world} rank {r} seq {seq}: {e}");
                            }
                        }
                    }
                }
                Ok(())
            },
        );
        for (r, (result, _)) in out.into_iter().enumerate() {
            result.unwrap_or_else(|e| panic!("world {world} rank {r}: {e}"));
        }
    }
}

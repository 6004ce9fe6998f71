//! The communicator across ranks: threads of this process, each forming its own communicator
//! from one unique id over tcp on loopback (the bootstrap, the authenticated links and the
//! ring are the ones separate processes use). Every collective, in place and out of place, with
//! buffers cut into several pieces; the answers checked exactly on every rank; and the drills:
//! disagreement, a lost rank, an abort, all checked on the data as well as the errors.

use std::time::Duration;

use nodetour_core::Deadline;
use nodetour_core::transport::TransportKind;
use nodetour_net::bootstrap::UniqueId;
use nodetour_ring::comm::{Communicator, Host, Options};
use nodetour_ring::{DataType, Error, ReduceOp};

/// Small slots and staging memory: every buffer here goes through the ring in several pieces.
fn options() -> Options {
    let mut o = Options::default()
        .with_transport(TransportKind::Tcp)
        .with_timeout(Duration::from_secs(20));
    (o.slot_bytes, o.slots, o.piece_bytes) = (256, 2, 4096);
    o
}

/// Runs `body` on `world` ranks (threads), each with its own communicator; returns what each
/// returned, by rank.
fn ranks<R: Send>(world: u32, options: Options, body: impl Fn(Communicator) -> R + Sync) -> Vec<R> {
    ranks_with(world, |_| options.clone(), body)
}

/// [`ranks`] with each rank's own options.
fn ranks_with<R: Send>(
    world: u32,
    options: impl Fn(u32) -> Options,
    body: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    // Rank 0's listener is bound here, before any rank forms (the port cannot be taken).
    let id = UniqueId::create().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (id, options, body) = (&id, options(r), &body);
                s.spawn(move || {
                    let comm = Communicator::from_unique_id(id, r, world, options)
                        .unwrap_or_else(|e| panic!("rank {r} formation: {e}"));
                    assert_eq!((comm.rank(), comm.world()), (r, world));
                    // Ranks as threads of one process: one host, local ranks as ranks.
                    assert_eq!((comm.local_rank(), comm.local_world()), (r, world));
                    body(comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn input(rank: u32, n: usize) -> Vec<i64> {
    (0..n)
        .map(|i| ((i as i64 * 7 + i64::from(rank) * 1_000_003) % 1_000_033) - 500_000)
        .collect()
}

/// What one rank computed: allreduce (out of place, in place), reduce-scatter (both),
/// all-gather (both), broadcast (both).
type Results = [Vec<i64>; 8];

#[test]
fn every_collective_in_and_out_of_place_gives_the_exact_answer_on_every_rank() {
    for world in 1..=4u32 {
        // 1500 elements per rank: three pieces of the allreduce, more of the others.
        let n = 1500usize;
        let root = world - 1;
        let got: Vec<Results> = ranks(world, options(), |comm| {
            let r = comm.rank();
            let mine = input(r, n);
            let whole: Vec<i64> = (0..world).flat_map(|q| input(q + 10 * r, n)).collect();
            let mut out: Results = Default::default();
            out[0] = vec![0; n];
            comm.all_reduce(&mine, &mut out[0], ReduceOp::Sum, Host)
                .unwrap();
            out[1] = mine.clone();
            comm.all_reduce_in_place(&mut out[1], ReduceOp::Sum, Host)
                .unwrap();
            out[2] = vec![0; n];
            comm.reduce_scatter(&whole, &mut out[2], ReduceOp::Sum, Host)
                .unwrap();
            out[3] = whole.clone();
            comm.reduce_scatter_in_place(&mut out[3], ReduceOp::Sum, Host)
                .unwrap();
            out[4] = vec![0; n * world as usize];
            comm.all_gather(&mine, &mut out[4], Host).unwrap();
            out[5] = vec![-1; n * world as usize];
            out[5][r as usize * n..(r as usize + 1) * n].copy_from_slice(&mine);
            comm.all_gather_in_place(&mut out[5], Host).unwrap();
            out[6] = vec![0; n];
            let send = if r == root { mine.clone() } else { vec![] };
            comm.broadcast(&send, &mut out[6], root, Host).unwrap();
            out[7] = if r == root { mine.clone() } else { vec![7; n] };
            comm.broadcast_in_place(&mut out[7], root, Host).unwrap();
            comm.close(Deadline::after(Duration::from_secs(10)))
                .unwrap();
            out
        });
        let sum: Vec<i64> = (0..n)
            .map(|i| (0..world).map(|q| input(q, n)[i]).sum())
            .collect();
        let gathered: Vec<i64> = (0..world).flat_map(|q| input(q, n)).collect();
        for (r, out) in got.iter().enumerate() {
            let r32 = r as u32;
            assert_eq!(out[0], sum, "world {world} rank {r}: allreduce");
            assert_eq!(out[1], sum, "world {world} rank {r}: allreduce in place");
            // Block r of every rank q's input (q's input is blocks input(b + 10 q)).
            let rs: Vec<i64> = (0..n)
                .map(|i| (0..world).map(|q| input(r32 + 10 * q, n)[i]).sum())
                .collect();
            assert_eq!(out[2], rs, "world {world} rank {r}: reduce-scatter");
            assert_eq!(
                &out[3][r * n..(r + 1) * n],
                &rs[..],
                "world {world} rank {r}: reduce-scatter in place"
            );
            let untouched: Vec<i64> = (0..world).flat_map(|q| input(q + 10 * r32, n)).collect();
            for q in (0..world as usize).filter(|q| *q != r) {
                assert_eq!(
                    &out[3][q * n..(q + 1) * n],
                    &untouched[q * n..(q + 1) * n],
                    "other blocks keep their input"
                );
            }
            assert_eq!(out[4], gathered, "world {world} rank {r}: all-gather");
            assert_eq!(
                out[5], gathered,
                "world {world} rank {r}: all-gather in place"
            );
            assert_eq!(out[6], input(root, n), "world {world} rank {r}: broadcast");
            assert_eq!(
                out[7],
                input(root, n),
                "world {world} rank {r}: broadcast in place"
            );
        }
    }
}

#[test]
fn a_unique_id_holds_its_port_until_rank_0_forms_and_round_trips_as_text() {
    let id = UniqueId::create().unwrap();
    let port: u16 = id.address.rsplit(':').next().unwrap().parse().unwrap();
    assert!(
        std::net::TcpListener::bind(("0.0.0.0", port)).is_err(),
        "the port is held for rank 0"
    );
    let text = id.encode();
    let back = UniqueId::decode(&text).unwrap();
    let got = std::thread::scope(|s| {
        let other = s.spawn(|| {
            Communicator::from_unique_id(&back, 1, 2, options()).map(|c| {
                let w = c.world();
                c.close(Deadline::after(Duration::from_secs(10))).unwrap();
                w
            })
        });
        let zero = Communicator::from_unique_id(&id, 0, 2, options()).unwrap();
        zero.close(Deadline::after(Duration::from_secs(10)))
            .unwrap();
        other.join().unwrap()
    });
    assert_eq!(got.unwrap(), 2);
}

#[test]
fn floating_point_results_are_the_same_bits_on_every_rank() {
    let world = 3;
    let n = 2000;
    let got = ranks(world, options(), |comm| {
        let r = comm.rank() as f32;
        let mut a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37 + r).sin() * 1e3).collect();
        comm.all_reduce_in_place(&mut a, ReduceOp::Avg, Host)
            .unwrap();
        let mut b: Vec<half::bf16> = (0..n)
            .map(|i| half::bf16::from_f32(i as f32 * 0.01 - r))
            .collect();
        comm.all_reduce_in_place(&mut b, ReduceOp::Sum, Host)
            .unwrap();
        comm.close(Deadline::after(Duration::from_secs(10)))
            .unwrap();
        (a, b)
    });
    for (r, (a, b)) in got.iter().enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(&got[0].0), "rank {r}: f32 average");
        assert_eq!(b, &got[0].1, "rank {r}: bf16 sum");
    }
    // The average is close to the exact one.
    for i in (0..n).step_by(97) {
        let want: f64 = (0..world)
            .map(|q| ((i as f32 * 0.37 + q as f32).sin() * 1e3) as f64)
            .sum::<f64>()
            / 3.0;
        assert!((f64::from(got[0].0[i]) - want).abs() < 1e-3, "element {i}");
    }
}

#[test]
fn ranks_that_disagree_fail_with_a_disagreement_write_nothing_and_break() {
    let got = ranks(2, options(), |comm| {
        let r = comm.rank();
        // Rank 1 passes one element more: the same collective with another count.
        let mut data = input(r, 100 + r as usize);
        let before = data.clone();
        let e = comm
            .all_reduce_in_place(&mut data, ReduceOp::Sum, Host)
            .unwrap_err();
        let next = comm
            .all_reduce_in_place(&mut data, ReduceOp::Sum, Host)
            .unwrap_err();
        (e, data == before, next)
    });
    for (r, (e, untouched, next)) in got.into_iter().enumerate() {
        // The rank that sees the other's descriptor first fails with the disagreement, tells
        // its neighbour and (here) leaves; the neighbour hears the notice, or the departure
        // first when the liveness mesh is faster (seen once in 19 runs): both fail, neither
        // writes.
        assert!(
            matches!(
                e,
                Error::Disagreement { .. } | Error::PeerFailed { .. } | Error::PeerLost { .. }
            ),
            "rank {r}: {e}"
        );
        assert!(untouched, "rank {r} wrote a result");
        assert!(matches!(next, Error::Broken { .. }), "rank {r}: {next}");
    }
}

#[test]
fn arguments_that_cannot_make_a_collective_fail_here_and_break_nothing() {
    ranks(2, options(), |comm| {
        let mut out = vec![0i64; 3];
        let e = comm
            .all_reduce(&[1i64, 2], &mut out, ReduceOp::Sum, Host)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let e = comm
            .reduce_scatter(&[1i64; 5], &mut out, ReduceOp::Sum, Host)
            .unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        let e = comm.broadcast_in_place(&mut out, 2, Host).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        // Nothing was sent: the next collective runs.
        let mut ok = vec![comm.rank() as i64; 10];
        comm.all_reduce_in_place(&mut ok, ReduceOp::Sum, Host)
            .unwrap();
        assert_eq!(ok, vec![1i64; 10]);
        assert!(comm.error().is_none());
        comm.wait(Deadline::after(Duration::from_secs(1))).unwrap();
    });
}

#[test]
fn a_lost_rank_fails_every_survivor_naming_it() {
    let mut o = options();
    o.config.timeout = Duration::from_secs(30);
    let got = ranks(3, o, |comm| {
        let r = comm.rank();
        if r == 2 {
            // Gone without a word: its links and its bootstrap close.
            drop(comm);
            return None;
        }
        let mut data = input(r, 3000);
        let before = data.clone();
        let t = std::time::Instant::now();
        let e = comm
            .all_reduce_in_place(&mut data, ReduceOp::Sum, Host)
            .unwrap_err();
        Some((e, data[..512] == before[..512], t.elapsed()))
    });
    for (r, got) in got.into_iter().enumerate().take(2) {
        let (e, first_piece_untouched, took) = got.unwrap();
        assert!(matches!(e, Error::PeerLost { rank: 2 }), "rank {r}: {e}");
        assert!(
            first_piece_untouched,
            "rank {r}: no piece can finish without rank 2"
        );
        assert!(
            took < Duration::from_secs(10),
            "rank {r} took {took:?}: found by the liveness mesh, not the timeout"
        );
    }
}

#[test]
fn an_abort_ends_the_collective_on_every_rank_with_the_reason() {
    // Both ranks stay in the job until both have their answer (a rank that leaves is reported
    // as gone, which is not what this drill checks).
    let both_done = std::sync::Barrier::new(2);
    let got = ranks(2, options(), |comm| {
        let r = comm.rank();
        let mut data = input(r, 1000);
        let before = data.clone();
        let e = if r == 0 {
            let handle = comm.abort_handle();
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                handle.abort("the runtime gave up");
            });
            // Rank 1 never joins this collective: only the abort ends it.
            let e = comm
                .all_reduce_in_place(&mut data, ReduceOp::Sum, Host)
                .unwrap_err();
            t.join().unwrap();
            e
        } else {
            std::thread::sleep(Duration::from_millis(600));
            comm.all_reduce_in_place(&mut data, ReduceOp::Sum, Host)
                .unwrap_err()
        };
        both_done.wait();
        (e, data == before)
    });
    assert!(
        matches!(&got[0].0, Error::Aborted { reason } if reason == "the runtime gave up"),
        "{}",
        got[0].0
    );
    assert!(
        matches!(got[1].0, Error::PeerFailed { peer: 0, .. }),
        "{}",
        got[1].0
    );
    assert!(got[0].1 && got[1].1, "nothing was written");
}

/// Small allreduces gather every input to every rank and reduce there (`host_gather_max`):
/// every type's answer is right (exact for integers), the same bits on every rank, with every
/// operation, for 2-4 ranks, in pieces and whole; and ranks that choose differently (another
/// threshold) disagree and write nothing, rather than mixing algorithms.
#[test]
fn small_allreduces_gather_and_are_the_same_bits_on_every_rank() {
    for world in 2..=4u32 {
        for gather_max in [0usize, 64 << 10] {
            let mut o = options();
            (o.host_gather_max, o.piece_bytes) = (gather_max, 64 << 10);
            let got = ranks(world, o, |comm| {
                let r = comm.rank();
                let mut results = Vec::new();
                for op in ReduceOp::ALL {
                    // A PreMulSum: each rank its own scalar (the seeded drills' choice).
                    let mine = |d| nodetour_ring::seeded::rank_op(op, d, r);
                    let mut ints = input(r, 700);
                    comm.all_reduce_in_place(&mut ints, mine(DataType::I64), Host)
                        .unwrap();
                    let mut floats: Vec<f32> = (0..1000)
                        .map(|i| (i as f32 * 0.37 + r as f32).sin() * 1e3)
                        .collect();
                    comm.all_reduce_in_place(&mut floats, mine(DataType::F32), Host)
                        .unwrap();
                    let mut halves: Vec<half::bf16> = (0..333)
                        .map(|i| half::bf16::from_f32(i as f32 * 0.01 - r as f32))
                        .collect();
                    comm.all_reduce_in_place(&mut halves, mine(DataType::Bf16), Host)
                        .unwrap();
                    results.push((
                        op,
                        ints,
                        floats.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                        halves.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    ));
                }
                comm.close(Deadline::after(Duration::from_secs(10)))
                    .unwrap();
                results
            });
            for (r, results) in got.iter().enumerate() {
                assert_eq!(
                    results, &got[0],
                    "world {world} gather_max {gather_max} rank {r}"
                );
            }
            for (op, ints, _, _) in &got[0] {
                for (i, got) in ints.iter().enumerate() {
                    let all = (0..world).map(|q| input(q, 700)[i]);
                    let want = match op {
                        ReduceOp::Sum => all.sum::<i64>(),
                        ReduceOp::Avg => all.sum::<i64>() / i64::from(world),
                        ReduceOp::Prod => all.fold(1i64, i64::wrapping_mul),
                        ReduceOp::Min => all.min().unwrap(),
                        ReduceOp::Max => all.max().unwrap(),
                        ReduceOp::PreMulSum(_) => (0..world)
                            .map(|q| {
                                let s = nodetour_ring::seeded::scalar(DataType::I64, q);
                                (s as i64).wrapping_mul(input(q, 700)[i])
                            })
                            .fold(0i64, i64::wrapping_add),
                        other => panic!("no reference for {other:?}"),
                    };
                    assert_eq!(*got, want, "world {world} {op:?} element {i}");
                }
            }
        }
    }
    // A rank that would run the ring where the others gather is refused at formation, on
    // every rank: a_rank_with_another_chunk_shape_fails_formation_on_every_rank.
}

/// Every setting that shapes a chunk or chooses an algorithm, set differently on one rank: a
/// formation error on every rank, naming the setting and both values. Before the settings were
/// agreed at formation, a sender wrote at its own slot size and a receiver read at its own, and
/// the ring failed (or not) only after collectives had run, depending on which links happened
/// to join a larger region to a smaller one.
#[test]
fn a_rank_with_another_chunk_shape_fails_formation_on_every_rank() {
    type Change = fn(&mut Options);
    let cases: [(&str, Change); 4] = [
        ("NODETOUR_SLOT_BYTES", |o| o.slot_bytes = 512),
        ("NODETOUR_SLOTS", |o| o.slots = 4),
        ("NODETOUR_PIECE_BYTES", |o| o.piece_bytes = 8192),
        ("NODETOUR_HOST_GATHER_MAX", |o| o.host_gather_max = 0),
    ];
    for world in [2u32, 3] {
        for (setting, change) in cases {
            for odd in [0, world - 1] {
                let id = UniqueId::create().unwrap();
                let results: Vec<nodetour_ring::Result<()>> = std::thread::scope(|s| {
                    let handles: Vec<_> = (0..world)
                        .map(|r| {
                            let mut o = options();
                            o.config.timeout = Duration::from_secs(10);
                            if r == odd {
                                change(&mut o);
                            }
                            let id = &id;
                            s.spawn(move || {
                                let comm = Communicator::from_unique_id(id, r, world, o)?;
                                // Formed anyway: run collectives (each checked) until one fails.
                                let n = 3000;
                                for k in 0..4u64 {
                                    let mut x: Vec<i64> =
                                        input(r, n).into_iter().map(|v| v + k as i64).collect();
                                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)?;
                                    for (i, got) in x.iter().enumerate() {
                                        let want: i64 =
                                            (0..world).map(|q| input(q, n)[i] + k as i64).sum();
                                        assert_eq!(*got, want, "rank {r} collective {k}");
                                    }
                                }
                                Ok(())
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (r, result) in results.iter().enumerate() {
                    match result {
                        Err(Error::SettingDiffers {
                            setting: named,
                            ours,
                            theirs,
                            ..
                        }) if *named == setting && ours != theirs => {}
                        other => panic!(
                            "{world} ranks, {setting} differs on rank {odd}: rank {r} got {other:?}"
                        ),
                    }
                }
            }
        }
    }
}

/// `close` after the other ranks have gone fails at once, naming them, instead of waiting out
/// its deadline; `Ok` from `close` means every rank closed in order.
#[test]
fn close_after_the_peers_have_gone_fails_at_once() {
    let world = 3;
    let id = UniqueId::create().unwrap();
    let results: Vec<(u32, nodetour_ring::Result<()>, Duration)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let id = &id;
                s.spawn(move || {
                    let comm = Communicator::from_unique_id(id, r, world, options()).unwrap();
                    let mut x = input(r, 100);
                    comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                        .unwrap();
                    let started = std::time::Instant::now();
                    let closed = if r == 0 {
                        // The others are gone (dropped) by the time rank 0 closes.
                        std::thread::sleep(Duration::from_millis(1500));
                        comm.close(Deadline::after(Duration::from_secs(15)))
                    } else {
                        // Once every rank is out of the collective: then gone.
                        std::thread::sleep(Duration::from_millis(300));
                        drop(comm);
                        Ok(())
                    };
                    (r, closed, started.elapsed())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (_, closed, took) = &results[0];
    println!("CLOSE_AFTER_PEERS_GONE rank 0: {closed:?} after {took:?}");
    assert!(
        closed.is_err(),
        "rank 0's close said Ok though its peers left without closing"
    );
    assert!(
        *took < Duration::from_millis(1500 + 3000),
        "rank 0's close waited {took:?} for peers that were gone"
    );
}

/// Every kind of host memory the verbs take: vectors, slices, arrays, and bytes typed at run
/// time (`HostBytes`); a read-only `HostBytes` as an output, send and recv of different types,
/// and a wrong length are `InvalidArgument` before anything is sent (the communicator stays
/// usable), and every `Ok` is checked.
#[test]
fn every_kind_of_host_memory_and_its_refusals() {
    use nodetour_ring::DataType;
    use nodetour_ring::comm::HostBytes;
    let got = ranks(2, options(), |comm| -> Result<(), Error> {
        let r = comm.rank();
        let invalid = |e: Result<(), Error>| matches!(e, Err(Error::InvalidArgument { .. }));
        // A vector, a slice of it, an array.
        let mut v = vec![1.0f32 + r as f32; 5];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum, Host)?;
        assert_eq!(v, [3.0; 5]);
        comm.all_reduce_in_place(&mut v[1..3], ReduceOp::Max, Host)?;
        assert_eq!(v, [3.0; 5]);
        let mut a = [i64::from(r) * 10; 3];
        comm.broadcast_in_place(&mut a, 1, Host)?;
        assert_eq!(a, [10; 3]);
        // Bytes typed at run time, in and out.
        let send: Vec<u8> = (0..4)
            .flat_map(|i| (i as f64 + f64::from(r)).to_ne_bytes())
            .collect();
        let mut recv = vec![0u8; send.len() * 2];
        comm.all_gather(
            &HostBytes::new(&send, DataType::F64)?,
            &mut HostBytes::new_mut(&mut recv, DataType::F64)?,
            Host,
        )?;
        let got: Vec<f64> = recv
            .chunks_exact(8)
            .map(|b| f64::from_ne_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(got, [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]);
        // Refused, locally, before anything is sent.
        let mut ro = [0u8; 8];
        let read_only = HostBytes::new(&ro, DataType::F32)?;
        let mut read_only_out = read_only;
        assert!(invalid(comm.all_reduce_in_place(
            &mut read_only_out,
            ReduceOp::Sum,
            Host
        )));
        assert!(
            HostBytes::new_mut(&mut ro[..7], DataType::F32).is_err(),
            "7 bytes of f32"
        );
        let (f, mut d) = ([1.0f32; 4], [0.0f64; 4]);
        assert!(invalid(comm.all_reduce(
            &HostBytes::new(nodetour_ring::element::bytes(&f), DataType::F32)?,
            &mut HostBytes::new_mut(nodetour_ring::element::bytes_mut(&mut d), DataType::F64)?,
            ReduceOp::Sum,
            Host
        )));
        let mut short = [0i64; 3];
        assert!(invalid(comm.all_reduce(
            &[1i64; 4],
            &mut short,
            ReduceOp::Sum,
            Host
        )));
        // Still usable, and right.
        let mut x = [i64::from(r) + 1; 7];
        comm.all_reduce_in_place(&mut x, ReduceOp::Prod, Host)?;
        assert_eq!(x, [2; 7]);
        Ok(())
    });
    for (r, result) in got.into_iter().enumerate() {
        result.unwrap_or_else(|e| panic!("rank {r}: {e}"));
    }
}

/// A rank that never joins: the others' joining deadline passes, and forming fails with
/// `Error::Timeout` (what was awaited, after how long), not a transport error.
#[test]
fn a_joining_deadline_that_passes_is_a_timeout() {
    let id = UniqueId::create().unwrap();
    let options = options().with_join_timeout(Duration::from_millis(1500));
    let t = std::time::Instant::now();
    let e = Communicator::from_unique_id(&id, 0, 2, options).unwrap_err();
    assert!(
        matches!(e, Error::Timeout { .. }),
        "a join that timed out: {e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
}

/// The types added for issue 49 (`i8`, `u32`, `u64`, `i16`, fp8 E4M3 and E5M2), every
/// operation, 1 to 8 ranks over tcp: every rank's result checked against the seeded
/// reference (exact in every order: integers bit for bit, wrapping; fp8 sums of values in
/// {-1, 0, 1}, products saturating; averages within their one rounding), both the ring and the
/// host gather path (`host_gather_max` 0 and the default), every collective's input its own.
#[test]
fn the_added_types_over_tcp_at_1_to_8_ranks() {
    use nodetour_ring::seeded;
    fn one<T: nodetour_ring::Element>(world: u32, gather: bool) {
        let d = T::DATA_TYPE;
        let mut o = options();
        if !gather {
            o.host_gather_max = 0;
        }
        let got = ranks(world, o, |comm| {
            let mut out = Vec::new();
            for (k, op) in ReduceOp::ALL.into_iter().enumerate() {
                let seed = 1000 + k as u64;
                let bytes = seeded::input(d, op, comm.rank(), 301, seed);
                let mut x = vec![T::zeroed(); bytes.len() / d.size()];
                bytemuck::cast_slice_mut::<T, u8>(&mut x).copy_from_slice(&bytes);
                let mine = seeded::rank_op(op, d, comm.rank());
                comm.all_reduce_in_place(&mut x, mine, Host).unwrap();
                out.push((op, seed, bytemuck::cast_slice::<T, u8>(&x).to_vec()));
            }
            comm.close(Deadline::after(Duration::from_secs(10)))
                .unwrap();
            out
        });
        for (r, results) in got.iter().enumerate() {
            assert_eq!(
                results, &got[0],
                "{d:?}, {world} ranks: rank {r} differs from rank 0"
            );
            for (op, seed, data) in results {
                seeded::verify(d, *op, world, data, *seed)
                    .unwrap_or_else(|e| panic!("{world} ranks (gather {gather}), rank {r}: {e}"));
            }
        }
    }
    for world in 1..=8u32 {
        for gather in [false, true] {
            one::<i8>(world, gather);
            one::<u32>(world, gather);
            one::<u64>(world, gather);
            one::<i16>(world, gather);
            one::<float8::F8E4M3>(world, gather);
            one::<float8::F8E5M2>(world, gather);
        }
    }
}

/// fp8 (issue 49) with values whose sums round, 1 to 8 ranks over tcp: every rank's result has
/// the same bits, and they are a CPU reference's that reduces in the path's own order with one
/// f32 computation and one rounding per step (`reduce_into`): the host gather path folds in
/// rank order; the ring folds segment `j` (elements `j·count/n ..`) starting at rank `j`, each
/// next rank adding its own (a single f32 addition or product is commutative, so the side
/// does not matter). Sums are also within the recursive-summation bound of the exact sum:
/// `|got − Σx| ≤ γ·Σ|x|`, `γ = (n−1)u / (1 − (n−1)u)`, `u` the format's unit roundoff (2⁻⁴
/// for E4M3, 2⁻³ for E5M2), no partial sum reaching the largest finite value here.
#[test]
fn fp8_rounds_once_per_step_in_the_paths_order() {
    use float8::{F8E4M3, F8E5M2};
    use nodetour_ring::DataType;
    use nodetour_ring::reduce::{finish_avg, reduce_into};
    fn value(dtype: DataType, rank: u32, i: usize, seed: u64) -> u8 {
        let mut x =
            (seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (u64::from(rank) << 40) ^ i as u64) | 1;
        for _ in 0..3 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        let v = (x % 2001) as f64 / 100.0 - 10.0; // -10 .. 10
        match dtype {
            DataType::F8E4M3 => F8E4M3::from_f64(v).to_bits(),
            _ => F8E5M2::from_f64(v).to_bits(),
        }
    }
    fn decode(dtype: DataType, b: u8) -> f64 {
        match dtype {
            DataType::F8E4M3 => F8E4M3::from_bits(b).to_f64(),
            _ => F8E5M2::from_bits(b).to_f64(),
        }
    }
    fn one<T: nodetour_ring::Element>(world: u32, gather: bool) {
        let d = T::DATA_TYPE;
        let count = 301;
        let mut o = options();
        if !gather {
            o.host_gather_max = 0;
        }
        let ops = [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Avg, ReduceOp::Min];
        let got = ranks(world, o, |comm| {
            let mut out = Vec::new();
            for (k, op) in ops.into_iter().enumerate() {
                let bytes: Vec<u8> = (0..count)
                    .map(|i| value(d, comm.rank(), i, k as u64))
                    .collect();
                let mut x = vec![T::zeroed(); count];
                bytemuck::cast_slice_mut::<T, u8>(&mut x).copy_from_slice(&bytes);
                comm.all_reduce_in_place(&mut x, op, Host).unwrap();
                out.push(bytemuck::cast_slice::<T, u8>(&x).to_vec());
            }
            comm.close(Deadline::after(Duration::from_secs(10)))
                .unwrap();
            out
        });
        let n = world as usize;
        for (k, op) in ops.into_iter().enumerate() {
            let input = |r: usize, i: usize| value(d, r as u32, i, k as u64);
            let want: Vec<u8> = (0..count)
                .map(|i| {
                    // The rank that starts element i's fold.
                    let first = if gather {
                        0
                    } else {
                        (0..n)
                            .find(|&j| i < (j + 1) * count / n)
                            .expect("a segment")
                    };
                    let mut acc = [input(first, i)];
                    for step in 1..n {
                        reduce_into(d, op, &mut acc, &[input((first + step) % n, i)]).unwrap();
                    }
                    if op == ReduceOp::Avg {
                        finish_avg(d, &mut acc, world).unwrap();
                    }
                    acc[0]
                })
                .collect();
            for (r, results) in got.iter().enumerate() {
                assert_eq!(
                    results[k], want,
                    "{d:?} {op:?}, {world} ranks (gather {gather}): rank {r} differs from the \
                     reference in the path's order"
                );
            }
            if op == ReduceOp::Sum {
                let u: f64 = if d == DataType::F8E4M3 {
                    1.0 / 16.0
                } else {
                    1.0 / 8.0
                };
                let nu = (n as f64 - 1.0) * u;
                let gamma = nu / (1.0 - nu).max(f64::MIN_POSITIVE);
                for (i, b) in want.iter().enumerate() {
                    let exact: f64 = (0..n).map(|r| decode(d, input(r, i))).sum();
                    let size: f64 = (0..n).map(|r| decode(d, input(r, i)).abs()).sum();
                    let err = (decode(d, *b) - exact).abs();
                    assert!(
                        err <= gamma * size,
                        "{d:?}, {world} ranks, element {i}: {} is {err} from {exact}",
                        decode(d, *b)
                    );
                }
            }
        }
    }
    for world in 1..=8u32 {
        for gather in [false, true] {
            one::<F8E4M3>(world, gather);
            one::<F8E5M2>(world, gather);
        }
    }
}

/// PreMulSum (issue 49): `Σ s_r · x_r`, each rank its own scalar, 1 to 8 ranks over tcp, the
/// ring and the host gather path, allreduce out of place and in place and reduce-scatter, in
/// f32, f64, f16, bf16 and fp8 E4M3, with the data-parallel average's scalar `1 / world` and
/// with a different scalar on every rank. Every rank's allreduce has the same bits; every
/// result is within `γ_n · Σ|s_r x_r|` of the float64 sum (`γ_n = n·u / (1 − n·u)`, `u` the
/// type's unit roundoff: one rounding for the product and `n − 1` for the sum), and
/// `PreMulSum(1)` is bitwise `Sum`. An integer type takes whole scalars only: a fraction is
/// refused (`InvalidArgument`) on every rank that passes it, before anything moves.
#[test]
fn pre_mul_sum_is_each_ranks_scaled_sum_within_rounding() {
    use float8::F8E4M3;
    use half::{bf16, f16};
    use nodetour_ring::comm::HostBytes;
    fn encode(d: DataType, v: f64) -> Vec<u8> {
        match d {
            DataType::F32 => (v as f32).to_ne_bytes().to_vec(),
            DataType::F64 => v.to_ne_bytes().to_vec(),
            DataType::F16 => f16::from_f64(v).to_ne_bytes().to_vec(),
            DataType::Bf16 => bf16::from_f64(v).to_ne_bytes().to_vec(),
            _ => vec![F8E4M3::from_f64(v).to_bits()],
        }
    }
    fn decode(d: DataType, b: &[u8]) -> f64 {
        match d {
            DataType::F32 => f64::from(f32::from_ne_bytes(b.try_into().unwrap())),
            DataType::F64 => f64::from_ne_bytes(b.try_into().unwrap()),
            DataType::F16 => f16::from_ne_bytes(b.try_into().unwrap()).to_f64(),
            DataType::Bf16 => bf16::from_ne_bytes(b.try_into().unwrap()).to_f64(),
            _ => F8E4M3::from_bits(b[0]).to_f64(),
        }
    }
    fn unit_roundoff(d: DataType) -> f64 {
        match d {
            DataType::F32 => 2f64.powi(-24),
            DataType::F64 => 2f64.powi(-53),
            DataType::F16 => 2f64.powi(-11),
            DataType::Bf16 => 2f64.powi(-8),
            _ => 2f64.powi(-4),
        }
    }
    // Element i of rank r's input to case k: a value of the type in -10 .. 10.
    fn x(d: DataType, r: u32, i: usize, k: usize) -> f64 {
        let v = ((i * 37 + r as usize * 101 + k * 7) % 2001) as f64 / 100.0 - 10.0;
        decode(d, &encode(d, v))
    }
    const TYPES: [DataType; 5] = [
        DataType::F32,
        DataType::F64,
        DataType::F16,
        DataType::Bf16,
        DataType::F8E4M3,
    ];
    // Case k's scalar on rank r: the average's, or one of its own.
    let scalar = |k: usize, r: u32, world: u32| {
        if k.is_multiple_of(2) {
            1.0 / f64::from(world)
        } else {
            0.25 + 0.375 * f64::from(r)
        }
    };
    let count = 97;
    for world in 1..=8u32 {
        for gather in [false, true] {
            let mut o = options();
            if !gather {
                o.host_gather_max = 0;
            }
            let got = ranks(world, o, |comm| {
                let r = comm.rank();
                let mut out = Vec::new();
                for (t, d) in TYPES.into_iter().enumerate() {
                    for k in 2 * t..2 * t + 2 {
                        let op = ReduceOp::pre_mul_sum(scalar(k, r, world));
                        let send: Vec<u8> =
                            (0..count).flat_map(|i| encode(d, x(d, r, i, k))).collect();
                        let mut recv = vec![0u8; send.len()];
                        comm.all_reduce(
                            &HostBytes::new(&send, d).unwrap(),
                            &mut HostBytes::new_mut(&mut recv, d).unwrap(),
                            op,
                            Host,
                        )
                        .unwrap();
                        let mut in_place = send.clone();
                        comm.all_reduce_in_place(
                            &mut HostBytes::new_mut(&mut in_place, d).unwrap(),
                            op,
                            Host,
                        )
                        .unwrap();
                        assert_eq!(in_place, recv, "{d:?}: in place differs from out of place");
                        // Reduce-scatter: block q of the input is elements q·count ..
                        let whole: Vec<u8> = (0..count * world as usize)
                            .flat_map(|i| encode(d, x(d, r, i, k)))
                            .collect();
                        let mut block = vec![0u8; send.len()];
                        comm.reduce_scatter(
                            &HostBytes::new(&whole, d).unwrap(),
                            &mut HostBytes::new_mut(&mut block, d).unwrap(),
                            op,
                            Host,
                        )
                        .unwrap();
                        // PreMulSum(1) is Sum, bit for bit.
                        let (mut one, mut sum) = (send.clone(), send.clone());
                        comm.all_reduce_in_place(
                            &mut HostBytes::new_mut(&mut one, d).unwrap(),
                            ReduceOp::pre_mul_sum(1.0),
                            Host,
                        )
                        .unwrap();
                        comm.all_reduce_in_place(
                            &mut HostBytes::new_mut(&mut sum, d).unwrap(),
                            ReduceOp::Sum,
                            Host,
                        )
                        .unwrap();
                        assert_eq!(one, sum, "{d:?}: PreMulSum(1) is not Sum");
                        out.push((recv, block));
                    }
                }
                // A fraction for an integer type: refused here, nothing sent.
                let mut ints = vec![3i32; 8];
                let e = comm
                    .all_reduce_in_place(&mut ints, ReduceOp::pre_mul_sum(0.5), Host)
                    .unwrap_err();
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
                comm.all_reduce_in_place(&mut ints, ReduceOp::pre_mul_sum(-2.0), Host)
                    .unwrap();
                assert_eq!(ints, vec![-6 * world as i32; 8]);
                comm.close(Deadline::after(Duration::from_secs(10)))
                    .unwrap();
                out
            });
            let n = world as usize;
            for (t, d) in TYPES.into_iter().enumerate() {
                let nu = n as f64 * unit_roundoff(d);
                let gamma = nu / (1.0 - nu);
                for k in 2 * t..2 * t + 2 {
                    // The scalar as the reduction rounds it (f32 but for f64).
                    let s = |q: u32| match d {
                        DataType::F64 => scalar(k, q, world),
                        _ => f64::from(scalar(k, q, world) as f32),
                    };
                    let check = |got: &[u8], at: usize, what: &str, rank: usize| {
                        for (j, b) in got.chunks_exact(d.size()).enumerate() {
                            let i = at + j;
                            let exact: f64 = (0..world).map(|q| s(q) * x(d, q, i, k)).sum();
                            let size: f64 = (0..world).map(|q| (s(q) * x(d, q, i, k)).abs()).sum();
                            let err = (decode(d, b) - exact).abs();
                            assert!(
                                err <= gamma * size + 1e-300,
                                "{d:?} case {k}, {world} ranks (gather {gather}), rank {rank} \
                                 {what} element {i}: {} is {err:e} from {exact} (bound {:e})",
                                decode(d, b),
                                gamma * size
                            );
                        }
                    };
                    for (r, results) in got.iter().enumerate() {
                        let (recv, block) = &results[k];
                        assert_eq!(recv, &got[0][k].0, "{d:?}: rank {r} differs from rank 0");
                        check(recv, 0, "allreduce", r);
                        check(block, r * count, "reduce-scatter", r);
                    }
                }
            }
        }
    }
}

//! Point-to-point across ranks (threads of this process, each with its own communicator over
//! tcp on loopback): batches of sends and receives to random peers, sizes and list orders,
//! every byte checked; a two-stage pipeline checked against one process; disagreements and a
//! send without its receive failing typed; the barrier; what `paths()` says of peer links.

use std::time::Duration;

use nodetour_core::Deadline;
use nodetour_core::transport::TransportKind;
use nodetour_net::bootstrap::UniqueId;
use nodetour_ring::Error;
use nodetour_ring::comm::{Communicator, Options};

mod common;
use common::Rng;

/// Small slots: every message of more than a few hundred bytes goes in several chunks.
fn options(timeout: Duration) -> Options {
    let mut o = Options::default()
        .with_transport(TransportKind::Tcp)
        .with_timeout(timeout);
    (o.slot_bytes, o.slots, o.piece_bytes) = (256, 2, 4096);
    o
}

/// Runs `body` on `world` ranks (threads), each with its own communicator, then closes it
/// (every rank waits for every other before it leaves).
fn ranks<R: Send>(
    world: u32,
    options: Options,
    body: impl Fn(&Communicator) -> R + Sync,
) -> Vec<R> {
    ranks_closing(world, options, Closing::Checked, body)
}

/// How a rank leaves once its body returns.
#[derive(Clone, Copy, PartialEq)]
enum Closing {
    /// `close`, checked where the communicator is healthy.
    Checked,
    /// `close`, not checked (a drill where one rank's communicator broke: the others' close
    /// may then fail too).
    Unchecked,
    /// Rank `r` drops its communicator without `close` (a rank that vanishes); the others'
    /// closes are not checked.
    DropRank(u32),
}

/// [`ranks`], leaving as `closing` says.
fn ranks_closing<R: Send>(
    world: u32,
    options: Options,
    closing: Closing,
    body: impl Fn(&Communicator) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::create().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (id, options, body) = (&id, options.clone(), &body);
                s.spawn(move || {
                    let comm = Communicator::from_unique_id(id, r, world, options)
                        .unwrap_or_else(|e| panic!("rank {r} formation: {e}"));
                    let out = body(&comm);
                    if closing == Closing::DropRank(r) {
                        drop(comm);
                        return out;
                    }
                    let healthy = comm.error().is_none();
                    let closed = comm.close(Deadline::after(Duration::from_secs(60)));
                    if healthy && closing == Closing::Checked {
                        closed.unwrap_or_else(|e| panic!("rank {r} close: {e}"));
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// One message of a case: from, to, elements.
type Message = (u32, u32, usize);

/// Case `case` of a job of `world`: every rank derives the same messages from the seed.
fn messages(world: u32, case: u64) -> Vec<Message> {
    let mut rng = Rng(0x2545_F491_4F6C_DD1D ^ (case * 0x9E37 + u64::from(world)));
    (0..rng.below(3 * world as usize) as u64 + 1)
        .map(|_| {
            let from = rng.below(world as usize) as u32;
            let to = rng.below(world as usize) as u32;
            let n = [0, 1, 7, 64, 333, 2000][rng.below(6)];
            (from, to, n)
        })
        .collect()
}

/// Message `index` of case `case`: its values (every message differs).
fn payload(case: u64, index: usize, n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| (case as u32).wrapping_mul(1_000_003) ^ (index as u32 * 7919 + i as u32))
        .collect()
}

#[test]
fn batches_to_random_peers_in_any_order_arrive_whole_on_every_rank() {
    // 1 to 8 ranks; 210 cases in all, each a batch on every rank, every byte checked.
    let plan = [
        (1u32, 20u64),
        (2, 50),
        (3, 40),
        (4, 40),
        (5, 20),
        (6, 15),
        (8, 25),
    ];
    for (world, cases) in plan {
        let checked: Vec<usize> = ranks(world, options(Duration::from_secs(30)), |comm| {
            let me = comm.rank();
            let mut checked = 0;
            for case in 0..cases {
                let all = messages(world, case);
                let mut sends = Vec::new();
                let mut recvs = Vec::new();
                for (index, &(from, to, n)) in all.iter().enumerate() {
                    if from == me {
                        sends.push((index, to, payload(case, index, n)));
                    }
                    if to == me {
                        recvs.push((index, from, vec![u32::MAX; n]));
                    }
                }
                // This rank's own order of its parts: sends and receives interleaved at
                // random, the order within each pair of ranks kept (messages match in order).
                let mut rng = Rng(case * 31 + u64::from(me) + 1);
                let mut batch = comm.batch();
                let (mut si, mut ri) = (sends.iter(), recvs.iter_mut());
                let (mut s, mut r) = (si.next(), ri.next());
                while s.is_some() || r.is_some() {
                    if r.is_none() || (s.is_some() && rng.below(2) == 0) {
                        let (_, to, data) = s.unwrap();
                        batch.send(data, *to);
                        s = si.next();
                    } else {
                        let (_, from, data) = r.unwrap();
                        batch.recv(data, *from);
                        r = ri.next();
                    }
                }
                batch
                    .run()
                    .unwrap_or_else(|e| panic!("world {world} case {case} rank {me}: {e}"));
                for (index, _, got) in &recvs {
                    let n = got.len();
                    assert_eq!(
                        got,
                        &payload(case, *index, n),
                        "case {case} message {index}"
                    );
                    checked += 1;
                }
            }
            assert!(comm.paths().peers.len() < world as usize);
            checked
        });
        let expected: usize = (0..cases).map(|c| messages(world, c).len()).sum();
        assert_eq!(checked.iter().sum::<usize>(), expected, "world {world}");
    }
}

#[test]
fn a_two_stage_pipeline_matches_one_process() {
    // Stage 0 holds w0, stage 1 holds w1; activations go forward, gradients back, over
    // several micro-batches; integer arithmetic so one process gives the same bits.
    const N: usize = 300;
    let x = |mb: usize| -> Vec<i64> { (0..N).map(|i| (i as i64 % 17) - 8 + mb as i64).collect() };
    let target =
        |mb: usize| -> Vec<i64> { (0..N).map(|i| (i as i64 * 3 + mb as i64) % 11).collect() };
    let (w0, w1): (Vec<i64>, Vec<i64>) = (
        (0..N).map(|i| (i % 5) as i64 - 2).collect(),
        (0..N).map(|i| (i % 3) as i64 + 1).collect(),
    );
    // One process: dL/dw0 and dL/dw1 summed over the micro-batches.
    let mut want = (vec![0i64; N], vec![0i64; N]);
    for mb in 0..4 {
        let (x, t) = (x(mb), target(mb));
        for i in 0..N {
            let a = x[i] * w0[i];
            let g = a * w1[i] - t[i];
            want.1[i] += g * a;
            want.0[i] += g * w1[i] * x[i];
        }
    }
    let got = ranks(2, options(Duration::from_secs(30)), |comm| {
        let mut grad = vec![0i64; N];
        for mb in 0..4 {
            if comm.rank() == 0 {
                let xs = x(mb);
                let a: Vec<i64> = (0..N).map(|i| xs[i] * w0[i]).collect();
                comm.send(&a, 1).unwrap();
                let mut back = vec![0i64; N];
                comm.recv(&mut back, 1).unwrap();
                for i in 0..N {
                    grad[i] += back[i] * xs[i];
                }
            } else {
                let mut a = vec![0i64; N];
                comm.recv(&mut a, 0).unwrap();
                let t = target(mb);
                let g: Vec<i64> = (0..N).map(|i| a[i] * w1[i] - t[i]).collect();
                let back: Vec<i64> = (0..N).map(|i| g[i] * w1[i]).collect();
                comm.send(&back, 0).unwrap();
                for i in 0..N {
                    grad[i] += g[i] * a[i];
                }
            }
        }
        grad
    });
    assert_eq!(got[0], want.0);
    assert_eq!(got[1], want.1);
}

#[test]
fn a_send_and_receive_that_disagree_fail_typed_on_both_and_write_nothing() {
    let got = ranks(2, options(Duration::from_secs(20)), |comm| {
        let r = if comm.rank() == 0 {
            comm.send(&[1.0f32; 100], 1)
        } else {
            let mut into = vec![7.0f32; 101];
            let r = comm.recv(&mut into, 0);
            assert!(into.iter().all(|v| *v == 7.0), "nothing written");
            r
        };
        let later = comm.send(&[0u8], 1 - comm.rank());
        (r, later)
    });
    for (rank, (r, later)) in got.iter().enumerate() {
        match r {
            Err(Error::Disagreement { ours, theirs, .. }) => {
                assert!(
                    ours.contains("100") || theirs.contains("100"),
                    "rank {rank}: {ours} / {theirs}"
                );
                assert!(
                    ours.contains("101") || theirs.contains("101"),
                    "rank {rank}: {ours} / {theirs}"
                );
            }
            other => panic!("rank {rank}: {other:?}"),
        }
        assert!(
            matches!(later, Err(Error::Broken { .. })),
            "rank {rank}: {later:?}"
        );
    }
}

#[test]
fn a_send_whose_receive_never_comes_fails_at_the_timeout() {
    let got = ranks_closing(
        2,
        options(Duration::from_secs(2)),
        Closing::Unchecked,
        |comm| {
            let other = 1 - comm.rank();
            if comm.rank() == 0 {
                let mut first = [0u64; 4];
                comm.recv(&mut first, other).unwrap();
                let started = std::time::Instant::now();
                let r = comm.send(&vec![3u64; 5000], other);
                Some((r, started.elapsed()))
            } else {
                comm.send(&[9u64; 4], other).unwrap();
                // Never receives: rank 0's second send fills this rank's slots and waits.
                std::thread::sleep(Duration::from_secs(4));
                None
            }
        },
    );
    let (r, took) = got[0].as_ref().unwrap();
    assert!(
        matches!(r, Err(Error::Timeout { rank: Some(1), .. })),
        "{r:?}"
    );
    assert!(
        *took >= Duration::from_secs(2) && *took < Duration::from_secs(10),
        "{took:?}"
    );
}

#[test]
fn sends_to_this_rank_itself_pair_with_its_receives_and_the_barrier_joins_every_rank() {
    let got = ranks(3, options(Duration::from_secs(20)), |comm| {
        let me = comm.rank();
        let mine = vec![me as i16 + 1; 10];
        let mut back = vec![0i16; 10];
        let mut b = comm.batch();
        b.send(&mine, me).recv(&mut back, me);
        b.run().unwrap();
        comm.barrier().unwrap();
        back
    });
    for (r, back) in got.iter().enumerate() {
        assert_eq!(back, &vec![r as i16 + 1; 10]);
    }
}

#[test]
fn paths_names_each_peer_link_with_its_transport_memory_and_reason() {
    let got = ranks(3, options(Duration::from_secs(20)), |comm| {
        let me = comm.rank();
        assert!(comm.paths().peers.is_empty(), "no link before first use");
        // Rank 0 and rank 2 only (not ring neighbours' links: a link of its own).
        if me != 1 {
            let mut x = [me as u8; 3];
            let peer = 2 - me;
            let mut b = comm.batch();
            let mine = [me as u8; 3];
            b.send(&mine, peer).recv(&mut x, peer);
            b.run().unwrap();
            assert_eq!(x, [peer as u8; 3]);
        }
        comm.paths()
    });
    assert!(got[1].peers.is_empty(), "rank 1 formed nothing");
    for r in [0usize, 2] {
        let p = &got[r].peers;
        assert_eq!(p.len(), 1, "{}", got[r]);
        assert_eq!(p[0].peer, 2 - r as u32);
        assert_eq!(p[0].transport, TransportKind::Tcp);
        assert_eq!(p[0].memory_bytes, 2 * 256 + 64 + 256);
        assert!(
            got[r].to_string().contains("peer link to rank"),
            "{}",
            got[r]
        );
    }
}

/// This machine's RDMA devices for the ranks (`NODETOUR_VM_DEV0/1` in the VM), or `None`
/// after printing `SKIP <reason>` (a failure with `NODETOUR_REQUIRE_RDMA=1`).
fn verbs_devices() -> Option<Vec<String>> {
    let skip = |reason: String| {
        if std::env::var("NODETOUR_REQUIRE_RDMA").as_deref() == Ok("1") {
            panic!("NODETOUR_REQUIRE_RDMA=1 but {reason}");
        }
        println!("SKIP {reason}");
        None
    };
    let found = match nodetour_core::verbs::devices() {
        Ok(list) if !list.is_empty() => list,
        Ok(_) => return skip("no RDMA device on this machine".into()),
        Err(e) => return skip(e.to_string()),
    };
    let d0 = std::env::var("NODETOUR_VM_DEV0").unwrap_or(found[0].name.clone());
    let d1 = std::env::var("NODETOUR_VM_DEV1").unwrap_or(d0.clone());
    Some(vec![d0, d1])
}

#[test]
#[ignore = "needs an RDMA device (the VM tier runs it over soft-RoCE)"]
fn batches_over_verbs_arrive_whole_on_every_rank() {
    let Some(devices) = verbs_devices() else {
        return;
    };
    for (world, cases) in [(2u32, 30u64), (3, 30), (4, 20)] {
        let mut o = options(Duration::from_secs(60)).with_transport(TransportKind::Verbs);
        o.devices = devices.clone();
        let checked: Vec<usize> = ranks(world, o, |comm| {
            let me = comm.rank();
            let mut checked = 0;
            for case in 0..cases {
                let all = messages(world, case);
                let mut recvs: Vec<(usize, u32, Vec<u32>)> = all
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.1 == me)
                    .map(|(i, m)| (i, m.0, vec![u32::MAX; m.2]))
                    .collect();
                let sends: Vec<(u32, Vec<u32>)> = all
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.0 == me)
                    .map(|(i, m)| (m.1, payload(case, i, m.2)))
                    .collect();
                let mut batch = comm.batch();
                for (to, data) in &sends {
                    batch.send(data, *to);
                }
                for (_, from, data) in recvs.iter_mut() {
                    batch.recv(data, *from);
                }
                batch
                    .run()
                    .unwrap_or_else(|e| panic!("world {world} case {case} rank {me}: {e}"));
                for (index, _, got) in &recvs {
                    assert_eq!(got, &payload(case, *index, got.len()), "case {case}");
                    checked += 1;
                }
            }
            for p in &comm.paths().peers {
                assert_eq!(p.transport, TransportKind::Verbs, "{}", comm.paths());
            }
            checked
        });
        let expected: usize = (0..cases).map(|c| messages(world, c).len()).sum();
        assert_eq!(checked.iter().sum::<usize>(), expected, "world {world}");
        println!("P2P_VERBS OK world={world} cases={cases} messages={expected}");
    }
}

#[test]
fn an_abort_or_a_lost_peer_mid_batch_fails_every_rank_typed_before_the_timeout() {
    // Rank 0 aborts while its batch waits for rank 1's message (rank 1 sends only after it
    // has seen rank 0's); rank 1's receive learns of it from the link's end notice.
    let started = std::time::Instant::now();
    let got = ranks_closing(
        2,
        options(Duration::from_secs(30)),
        Closing::Unchecked,
        |comm| {
            let me = comm.rank();
            if me == 0 {
                let abort = comm.abort_handle();
                let aborter = std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(500));
                    abort.abort("the drill's abort");
                });
                let mut never = vec![0u8; 10];
                let mut b = comm.batch();
                let mine = [1u8; 10];
                b.send(&mine, 1).recv(&mut never, 1);
                let r = b.run();
                aborter.join().unwrap();
                r
            } else {
                let mut first = vec![0u8; 10];
                comm.recv(&mut first, 0).unwrap();
                assert_eq!(
                    first, [1u8; 10],
                    "the Ok before the abort holds rank 0's bytes"
                );
                // Rank 0 is aborted before this: the receive below meets the end notice.
                let mut more = vec![0u8; 10];
                comm.recv(&mut more, 0)
            }
        },
    );
    assert!(
        matches!(&got[0], Err(Error::Aborted { reason }) if reason.contains("drill")),
        "{:?}",
        got[0]
    );
    assert!(
        matches!(&got[1], Err(Error::Aborted { reason }) if reason.contains("rank 0")),
        "{:?}",
        got[1]
    );
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );

    // Rank 1 leaves (its communicator dropped) while rank 0 waits for its message.
    let started = std::time::Instant::now();
    let got = ranks_closing(
        2,
        options(Duration::from_secs(30)),
        Closing::DropRank(1),
        |comm| {
            if comm.rank() == 0 {
                let mut x = [0u8; 4];
                comm.recv(&mut x, 1).unwrap();
                assert_eq!(x, [5u8; 4], "the Ok before the loss holds rank 1's bytes");
                let mut y = [0u8; 4];
                Some(comm.recv(&mut y, 1))
            } else {
                comm.send(&[5u8; 4], 0).unwrap();
                None
            }
        },
    );
    let r = got[0].as_ref().unwrap();
    assert!(
        matches!(
            r,
            Err(Error::PeerLost { rank: 1 }) | Err(Error::Transport { .. })
        ),
        "{r:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(25),
        "{:?}",
        started.elapsed()
    );
}

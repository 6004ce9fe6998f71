//! Errors name the root cause on every rank: a collective that ends because one rank froze,
//! disagreed, or left is reported by every rank of the ring (threads of this process over tcp on
//! loopback, as in `communicator.rs`) as the same rank and the same reason, also by ranks two
//! hops from it and by the faulty rank itself.

use std::sync::Barrier;
use std::time::Duration;

use nodetour_core::transport::TransportKind;
use nodetour_net::bootstrap::UniqueId;
use nodetour_ring::comm::{Communicator, Host, Options};
use nodetour_ring::{CauseKind, Error, ReduceOp, RootCause};

/// The tests here time out ranks on purpose (1.5 s): run one at a time, so that another test's
/// ranks do not starve a live rank past its deadline on a small machine.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn options(timeout: Duration) -> Options {
    let mut o = Options::default()
        .with_transport(TransportKind::Tcp)
        .with_timeout(timeout);
    (o.slot_bytes, o.slots, o.piece_bytes) = (256, 2, 4096);
    // Every allreduce here runs on the ring (no gather).
    o.host_gather_max = 0;
    o
}

/// Runs `body(comm, rank)` on `world` ranks (threads over tcp), each with its own communicator.
fn ranks<R: Send>(
    world: u32,
    options: impl Fn(u32) -> Options + Sync,
    body: impl Fn(Communicator) -> R + Sync,
) -> Vec<R> {
    let id = UniqueId::create().unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let (id, options, body) = (&id, &options, &body);
                s.spawn(move || {
                    let comm = Communicator::from_unique_id(id, r, world, options(r))
                        .unwrap_or_else(|e| panic!("rank {r} formation: {e}"));
                    body(comm)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn input(rank: u32, k: u64, n: usize) -> Vec<i64> {
    (0..n)
        .map(|i| (i as i64 * 7 + i64::from(rank) * 1_000_003 + k as i64 * 31) % 1_000_033)
        .collect()
}

fn sum(world: u32, k: u64, n: usize) -> Vec<i64> {
    (0..n)
        .map(|i| (0..world).map(|q| input(q, k, n)[i]).sum())
        .collect()
}

/// A rank frozen past the timeout mid-stream, in a ring of 4: its two neighbours, the rank
/// two hops away (which waits on live ranks), and the frozen rank once it wakes all report
/// "rank 1 did not respond within the timeout".
#[test]
fn a_frozen_rank_is_named_by_every_rank_even_two_hops_away() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let world = 4;
    let n = 3000;
    let all_done = Barrier::new(world as usize);
    let got = ranks(
        world,
        |_| options(Duration::from_millis(1500)),
        |comm| {
            let r = comm.rank();
            // Mid-stream: collectives ran (each checked) before the freeze.
            for k in 0..3 {
                let mut x = input(r, k, n);
                comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                    .unwrap();
                assert_eq!(x, sum(world, k, n), "rank {r} collective {k}");
            }
            if r == 1 {
                std::thread::sleep(Duration::from_millis(4500));
            }
            let mut x = input(r, 3, n);
            let e = comm
                .all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                .unwrap_err();
            // Nobody leaves before every rank has its error (a departure is another cause).
            all_done.wait();
            e
        },
    );
    for (r, e) in got.iter().enumerate() {
        println!("FROZEN rank {r}: {e}");
    }
    for (r, e) in got.iter().enumerate() {
        assert!(
            e.to_string()
                .contains("rank 1 did not respond within the timeout"),
            "rank {r}: {e}"
        );
        assert_eq!(
            e.root_cause(),
            Some(RootCause {
                rank: 1,
                kind: CauseKind::Timeout
            }),
            "rank {r}: {e}"
        );
    }
}

/// A rank that finds its neighbour calls another collective, and leaves: every other rank
/// reports the disagreement (not the departure that followed it).
#[test]
fn a_rank_that_disagreed_and_left_is_reported_as_a_disagreement() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let world = 3;
    let got = ranks(
        world,
        |_| options(Duration::from_secs(20)),
        |comm| {
            let r = comm.rank();
            let mut x = input(r, 0, 3000);
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                .unwrap();
            assert_eq!(x, sum(world, 0, 3000), "rank {r}: the collective before");
            // Rank 2 passes one element more.
            let mut x = input(r, 1, 3000 + usize::from(r == 2));
            let e = comm
                .all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                .unwrap_err();
            // Each rank leaves as soon as it has its error (a process that exits).
            drop(comm);
            e
        },
    );
    for (r, e) in got.iter().enumerate() {
        println!("DISAGREED rank {r}: {e}");
        assert!(
            matches!(
                e.root_cause(),
                Some(RootCause {
                    kind: CauseKind::Disagreement,
                    ..
                })
            ),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("disagree"), "rank {r}: {e}");
    }
}

/// A rank that aborts mid-collective: every other rank, two hops away and late ones included,
/// names it and says it aborted.
#[test]
fn an_abort_is_named_by_every_rank() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let world = 4;
    let all_done = Barrier::new(world as usize);
    let got = ranks(
        world,
        |_| options(Duration::from_secs(20)),
        |comm| {
            let r = comm.rank();
            let mut x = input(r, 0, 3000);
            comm.all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                .unwrap();
            assert_eq!(x, sum(world, 0, 3000), "rank {r}: the collective before");
            let aborter = (r == 2).then(|| {
                let handle = comm.abort_handle();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(300));
                    handle.abort("the runtime gave up");
                })
            });
            if r == 3 {
                // Late: the collective cannot finish before rank 2 aborts it.
                std::thread::sleep(Duration::from_millis(1000));
            }
            let mut x = input(r, 1, 3000);
            let e = comm
                .all_reduce_in_place(&mut x, ReduceOp::Sum, Host)
                .unwrap_err();
            if let Some(t) = aborter {
                t.join().unwrap();
            }
            all_done.wait();
            e
        },
    );
    for (r, e) in got.iter().enumerate() {
        println!("ABORTED rank {r}: {e}");
    }
    assert!(
        matches!(&got[2], Error::Aborted { reason } if reason == "the runtime gave up"),
        "{}",
        got[2]
    );
    for (r, e) in got.iter().enumerate().filter(|(r, _)| *r != 2) {
        assert_eq!(
            e.root_cause(),
            Some(RootCause {
                rank: 2,
                kind: CauseKind::Aborted
            }),
            "rank {r}: {e}"
        );
        assert!(e.to_string().contains("rank 2 aborted"), "rank {r}: {e}");
    }
}

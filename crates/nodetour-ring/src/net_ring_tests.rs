//! The network ring without a GPU: ranks as threads, each with the CPU executor of the stream
//! program ([`crate::cpu_streams`]) and its progress thread ([`crate::net_link`]), linked over
//! the real tcp transport (loopback) and the in-process one. Every result is checked.

use std::sync::Arc;
use std::time::Duration;

use nodetour_core::auth::JobToken;
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::tcp::loopback_pair;
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::transport::{HostConnection, MemConnection, SlotGrant, SlotRegion};
use nodetour_core::verbs::{
    Access, EndpointDescription, LocalSide, MemoryRegion, Near, PathOptions, QueuePairOptions,
};

use crate::comm::form::net_direct::Reveal;
use crate::cpu_streams::{CpuLander, CpuRank, HostPage};
use crate::error::Error;
use crate::flag;
use crate::net_link::{MAILBOX_BYTES, NetLink, NetLinkSetup, NetOptions};
use crate::plan::{Plan, Shape};
use crate::reduce::ReduceOp;
use crate::stream_plan::LinkCounters;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Wire {
    Tcp,
    Mem,
    /// Real verbs (the soft-RoCE VM, or a NIC): RDMA WRITE_WITH_IMM into registered regions.
    Verbs,
}

fn region(len: usize) -> SlotRegion {
    SlotRegion::host(HostBuffer::new(len.max(64)).unwrap())
}

/// A region registered on `side` (remote write only where a peer writes it), or a plain one.
fn region_on(len: usize, side: Option<&LocalSide>, peers_write: bool) -> SlotRegion {
    let Some(side) = side else {
        return region(len);
    };
    let access = if peers_write {
        Access::REMOTE
    } else {
        Access::LOCAL
    };
    let buf = HostBuffer::new(len.max(4096)).unwrap();
    SlotRegion::registered(Arc::new(
        MemoryRegion::register(&side.pd, buf, access).unwrap(),
    ))
}

/// This process's RDMA devices for the test's ranks (`NODETOUR_VM_DEV0/1` in the VM, else the
/// first device for all), or `None` after printing `SKIP <reason>` (a failure with
/// `NODETOUR_REQUIRE_RDMA=1`).
fn verbs_devices() -> Option<[String; 2]> {
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
    let first = found[0].name.clone();
    let d0 = std::env::var("NODETOUR_VM_DEV0").unwrap_or(first);
    let d1 = std::env::var("NODETOUR_VM_DEV1").unwrap_or(d0.clone());
    Some([d0, d1])
}

fn open_side(device: &str) -> LocalSide {
    let config = nodetour_core::Config {
        ib_device: Some(device.to_owned()),
        ..nodetour_core::Config::default()
    };
    LocalSide::open(&config, Near::Host).unwrap()
}

/// A connected pair of verbs queue pairs between `a` and `b`, deep enough for a network link.
fn verbs_pair(
    a: &LocalSide,
    b: &LocalSide,
    slots: u32,
) -> (Box<dyn HostConnection>, Box<dyn HostConnection>) {
    let options = QueuePairOptions {
        send_depth: 64,
        recv_depth: crate::net_link::receive_depth(slots),
        max_inline: 0,
    };
    let (qa, ea) = PreparedVerbs::for_peer_with(a, options).unwrap();
    let (qb, eb) = PreparedVerbs::for_peer_with(b, options).unwrap();
    let endpoint = |e: &[u8]| EndpointDescription::decode(e).unwrap().endpoint;
    // A short transport timeout: a write to a queue pair that went away fails after its
    // retries (derived from it), which is how a lost peer shows on verbs without a liveness
    // mesh.
    let timeout = Duration::from_secs(3);
    let config = nodetour_core::Config {
        timeout,
        ..nodetour_core::Config::default()
    };
    let ca = qa
        .connect(
            &endpoint(&eb),
            &PathOptions::new(a.port.port, &a.gid, &config),
            "b".into(),
            timeout,
        )
        .unwrap();
    let cb = qb
        .connect(
            &endpoint(&ea),
            &PathOptions::new(b.port.port, &b.gid, &config),
            "a".into(),
            timeout,
        )
        .unwrap();
    (Box::new(ca), Box::new(cb))
}

fn pair(wire: Wire) -> (Box<dyn HostConnection>, Box<dyn HostConnection>) {
    match wire {
        Wire::Verbs => unreachable!("verbs pairs are made from the ranks' devices"),
        Wire::Tcp => {
            let (a, b) = loopback_pair(&JobToken::new(b"net-ring-test".to_vec())).unwrap();
            (Box::new(a), Box::new(b))
        }
        Wire::Mem => {
            let (a, b) = MemConnection::pair();
            (Box::new(a), Box::new(b))
        }
    }
}

struct Parts {
    mine: Arc<HostPage>,
    out_next: Arc<HostPage>,
    out_prev: Arc<HostPage>,
    send: SlotRegion,
    recv: SlotRegion,
    from_prev: SlotRegion,
    from_next: SlotRegion,
    cells: SlotRegion,
    to_next: Option<Box<dyn HostConnection>>,
    to_prev: Option<Box<dyn HostConnection>>,
    // Grants this rank made for its neighbours: (recv slots, mailbox from prev) to prev,
    // (mailbox from next) to next.
    recv_grant: Option<SlotGrant>,
    from_prev_grant: Option<SlotGrant>,
    from_next_grant: Option<SlotGrant>,
}

const DESC: (u32, u32) = (flag::DESC_BASE, 6);

/// `n` ranks in a ring over `wire`.
fn ring(n: u32, wire: Wire, slots: u32, slot_bytes: usize) -> Vec<CpuRank> {
    ring_landing(n, wire, slots, slot_bytes, Landing::Plain)
}

/// What happens to a chunk once it landed in a rank's receive slots.
#[derive(Clone)]
enum Landing {
    /// The thread releases it (host slots).
    Plain,
    /// A lander moves it on first (GPU slots over a host-landing wire).
    Copied,
    /// A lander flushes it first, then releases it in place (GPU slots the NIC writes): by an
    /// RDMA read on the rank's own loopback queue pair (verbs only), or by a host call (here a
    /// counter standing in for `cuFlushGPUDirectRDMAWrites`).
    FlushedByRead,
    FlushedByCall(Arc<std::sync::atomic::AtomicUsize>),
}

/// [`ring`], each rank's chunks handled as `landing` says.
fn ring_landing(
    n: u32,
    wire: Wire,
    slots: u32,
    slot_bytes: usize,
    landing: Landing,
) -> Vec<CpuRank> {
    // Verbs: each rank on a device of its own (alternating between the two), its regions
    // registered there.
    let sides: Vec<Option<LocalSide>> = (0..n)
        .map(|i| {
            (wire == Wire::Verbs).then(|| {
                let devices = verbs_devices().expect("checked by the caller");
                open_side(&devices[i as usize % 2])
            })
        })
        .collect();
    let mut parts: Vec<Parts> = sides
        .iter()
        .map(|side| Parts {
            mine: HostPage::new(),
            out_next: HostPage::new(),
            out_prev: HostPage::new(),
            send: region_on(slots as usize * slot_bytes, side.as_ref(), false),
            recv: region_on(slots as usize * slot_bytes, side.as_ref(), true),
            from_prev: region_on(MAILBOX_BYTES, side.as_ref(), true),
            from_next: region_on(MAILBOX_BYTES, side.as_ref(), true),
            cells: region_on(MAILBOX_BYTES, side.as_ref(), false),
            to_next: None,
            to_prev: None,
            recv_grant: None,
            from_prev_grant: None,
            from_next_grant: None,
        })
        .collect();
    let links = if n == 2 { 1 } else { n };
    for i in 0..links {
        let j = (i + 1) % n;
        let (a, b) = match (&sides[i as usize], &sides[j as usize]) {
            (Some(x), Some(y)) => verbs_pair(x, y, slots),
            _ => pair(wire),
        };
        parts[i as usize].to_next = Some(a);
        if n == 2 {
            parts[j as usize].to_next = Some(b);
        } else {
            parts[j as usize].to_prev = Some(b);
        }
    }
    for p in parts.iter_mut() {
        // What the previous rank writes is granted on the connection from it; what the next
        // rank writes, on the connection to it.
        let from_prev_conn = if n == 2 {
            p.to_next.as_mut()
        } else {
            p.to_prev.as_mut()
        }
        .unwrap();
        p.recv_grant = Some(from_prev_conn.grant(&p.recv).unwrap());
        p.from_prev_grant = Some(from_prev_conn.grant(&p.from_prev).unwrap());
        let to_next = p.to_next.as_mut().unwrap();
        p.from_next_grant = Some(to_next.grant(&p.from_next).unwrap());
    }
    let grants: Vec<(SlotGrant, SlotGrant, SlotGrant)> = parts
        .iter()
        .map(|p| {
            (
                p.recv_grant.unwrap(),
                p.from_prev_grant.unwrap(),
                p.from_next_grant.unwrap(),
            )
        })
        .collect();
    parts
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let (next, prev) = ((i as u32 + 1) % n, (i as u32 + n - 1) % n);
            let landed =
                matches!(landing, Landing::Copied).then(|| region(slots as usize * slot_bytes));
            let page = p.mine.clone() as Arc<dyn crate::net_link::WordPage>;
            let lander: Option<Box<dyn crate::net_link::Lander>> = match &landing {
                Landing::Plain => None,
                Landing::Copied => Some(Box::new(CpuLander {
                    from: p.recv.clone(),
                    to: landed.clone().expect("made above"),
                    mine: p.mine.clone(),
                })),
                Landing::FlushedByRead => {
                    let side = sides[i].as_ref().expect("a read flush needs verbs");
                    let mut read = p
                        .recv
                        .read_flush(
                            &side.context,
                            &side.port,
                            &side.gid,
                            &nodetour_core::Config::default(),
                            Duration::from_secs(5),
                        )
                        .unwrap();
                    Some(Box::new(Reveal {
                        flush: move |offset: usize, len: usize| read.flush(offset, len),
                        page,
                    }))
                }
                Landing::FlushedByCall(calls) => {
                    let calls = calls.clone();
                    Some(Box::new(Reveal {
                        flush: move |_: usize, _: usize| {
                            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            Ok(())
                        },
                        page,
                    }))
                }
            };
            let link = NetLink::start(NetLinkSetup {
                next,
                prev,
                to_next: p.to_next,
                to_prev: p.to_prev,
                same_peer: n == 2,
                send_slots: Some(p.send.clone()),
                recv_slots: Some(p.recv.clone()),
                next_recv: Some(grants[next as usize].0),
                next_mailbox: Some(grants[next as usize].1),
                prev_mailbox: Some(grants[prev as usize].2),
                mailbox_from_prev: Some(p.from_prev),
                mailbox_from_next: Some(p.from_next),
                cells: p.cells,
                slots,
                slot_bytes,
                mine: p.mine.clone(),
                out_next: p.out_next.clone(),
                out_prev: p.out_prev.clone(),
                desc_cells: DESC,
                stop_word: flag::STOPPED,
                options: NetOptions::default(),
                lander,
            })
            .unwrap();
            CpuRank {
                landed,
                position: i as u32,
                world: n,
                slots,
                slot_bytes,
                mine: p.mine,
                out_next: p.out_next,
                out_prev: p.out_prev,
                send_slots: p.send,
                recv_slots: p.recv,
                link: Some(link),
                desc_cells: DESC,
                counters: LinkCounters::default(),
                queued: 0,
                exchange: true,
                tag: 1,
                broken: None,
            }
        })
        .collect()
}

/// Element `i` of `rank`'s input to the collective numbered `seed` (sums stay exact in f32).
fn value(rank: u32, i: usize, seed: u64) -> f32 {
    (rank * 1000 + ((i as u64 + seed * 389) % 997) as u32) as f32
}

/// A number of its own for every checked collective: an `Ok` computed from another
/// collective's data (a stale slot) fails the check.
fn next_seed() -> u64 {
    static SEED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    SEED.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// Runs `f` on every rank at once, each on its own thread; the results in rank order.
fn on_every_rank<T: Send>(ranks: &mut [CpuRank], f: impl Fn(&mut CpuRank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks.iter_mut().map(|r| s.spawn(move || f(r))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// An allreduce (sum) of `count` elements of `fill(rank)` on every rank, with `timeout`.
fn all_reduce_everywhere(
    ranks: &mut [CpuRank],
    count: usize,
    timeout: Duration,
) -> Vec<crate::Result<()>> {
    let seed = next_seed();
    on_every_rank(ranks, |r| {
        let mut data: Vec<f32> = (0..count).map(|i| value(r.position, i, seed)).collect();
        r.collective(&mut data, Shape::AllReduce, ReduceOp::Sum, timeout)
    })
}

/// Runs `shape` on every rank at once and checks every rank's result.
fn run_checked(ranks: &mut [CpuRank], count: usize, shape: Shape, op: ReduceOp) {
    let n = ranks.len() as u32;
    let plan = Plan::new(
        n,
        count as u64,
        4,
        ranks[0].slot_bytes as u64,
        ranks[0].slots,
    )
    .unwrap()
    .with_shape(shape)
    .unwrap();
    let seed = next_seed();
    let results: Vec<(u32, Vec<f32>, crate::Result<()>)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .map(|r| {
                s.spawn(move || {
                    let mut data: Vec<f32> =
                        (0..count).map(|i| value(r.position, i, seed)).collect();
                    let res = r.collective(&mut data, shape, op, Duration::from_secs(20));
                    (r.position, data, res)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let errors: Vec<String> = results
        .iter()
        .filter_map(|(p, _, r)| r.as_ref().err().map(|e| format!("rank {p}: {e}")))
        .collect();
    assert!(
        errors.is_empty(),
        "{shape:?}, {count} elements, {n} ranks: {}",
        errors.join("; ")
    );
    for (p, data, _) in results {
        for (i, got) in data.iter().enumerate() {
            let sum: f32 = (0..n).map(|r| value(r, i, seed)).sum();
            let owner = (0..n).find(|&s| plan.segment(s).contains(&(i as u64)));
            let want = match shape {
                Shape::AllReduce => Some(match op {
                    ReduceOp::Avg => sum / n as f32,
                    _ => sum,
                }),
                Shape::ReduceScatter => (owner == Some(p)).then_some(sum),
                Shape::AllGather => owner.map(|s| value(s, i, seed)),
                Shape::Broadcast { root } => Some(value(root, i, seed)),
            };
            if let Some(want) = want {
                assert_eq!(
                    *got, want,
                    "rank {p}, {shape:?}, {count} elements, element {i}"
                );
            }
        }
    }
}

/// Every shape (and an average) at each of `counts`, checked on every rank.
fn every_shape(ranks: &mut [CpuRank], counts: &[usize]) {
    let n = ranks.len() as u32;
    for &count in counts {
        for shape in [
            Shape::AllReduce,
            Shape::ReduceScatter,
            Shape::AllGather,
            Shape::Broadcast { root: n - 1 },
        ] {
            // Reduce-scatter and all-gather take equal blocks.
            let blocks = matches!(shape, Shape::ReduceScatter | Shape::AllGather);
            let elements = if blocks { count * n as usize } else { count };
            run_checked(ranks, elements, shape, ReduceOp::Sum);
        }
        run_checked(ranks, count, Shape::AllReduce, ReduceOp::Avg);
    }
}

#[test]
fn every_shape_over_tcp_and_in_process_with_slots_reused() {
    for wire in [Wire::Tcp, Wire::Mem] {
        for n in [2u32, 3, 4] {
            // Small slots: many chunks per collective, every slot reused many times.
            let mut ranks = ring(n, wire, 3, 64);
            every_shape(&mut ranks, &[0, 1, 13, 257, 1031]);
        }
    }
}

/// The network ring over real verbs: RDMA WRITE_WITH_IMM into the neighbours' registered slots
/// and mailboxes, credits as immediates, every shape checked; then a rank's queue pairs go away
/// mid-collective and its neighbours fail typed.
#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/test.sh's vm tier)"]
fn verbs_network_ring_every_shape_and_a_lost_peer() {
    if verbs_devices().is_none() {
        return;
    }
    for n in [2u32, 3] {
        let mut ranks = ring(n, Wire::Verbs, 3, 4096);
        every_shape(&mut ranks, &[0, 1, 1031, 20_011]);
        println!("VERBS_NET_RING OK ranks={n}");
    }
    let mut ranks = ring(3, Wire::Verbs, 2, 4096);
    run_checked(&mut ranks, 5000, Shape::AllReduce, ReduceOp::Sum);
    let mut gone = ranks.pop().unwrap();
    if let Some(mut l) = gone.link.take() {
        l.close(Duration::from_secs(5)).unwrap();
    }
    let started = std::time::Instant::now();
    let results = all_reduce_everywhere(&mut ranks, 50_000, Duration::from_secs(60));
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "failed by the deadline, not the loss: {results:?}"
    );
    println!("VERBS_NET_RING LOST_PEER {results:?}");
}

/// The GPU-slot variant's control flow over real verbs: chunks the NIC wrote are released only
/// after their flush, by an RDMA read on each rank's own loopback queue pair (its own
/// protection domain and readable registration) or by a host call; every shape checked.
#[test]
#[ignore = "needs an RDMA device: runs in the soft-RoCE VM (scripts/test.sh's vm tier)"]
fn verbs_network_ring_releases_chunks_after_each_flush() {
    if verbs_devices().is_none() {
        return;
    }
    for n in [2u32, 3] {
        let mut ranks = ring_landing(n, Wire::Verbs, 3, 4096, Landing::FlushedByRead);
        every_shape(&mut ranks, &[1, 1031, 20_011]);
        println!("VERBS_NET_RING FLUSH_BY_READ OK ranks={n}");
    }
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut ranks = ring_landing(
        3,
        Wire::Verbs,
        3,
        4096,
        Landing::FlushedByCall(calls.clone()),
    );
    every_shape(&mut ranks, &[1, 1031, 20_011]);
    let calls = calls.load(std::sync::atomic::Ordering::Relaxed);
    assert!(calls > 0, "no chunk was flushed");
    println!("VERBS_NET_RING FLUSH_BY_CALL OK ranks=3 flushes={calls}");
}

#[test]
fn chunks_released_after_a_flush_arrive_whole_and_every_chunk_is_flushed() {
    // The direct landing's control flow on any wire: each chunk flushed, then released in
    // place (the count is every chunk each rank received).
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut ranks = ring_landing(3, Wire::Mem, 3, 64, Landing::FlushedByCall(calls.clone()));
    every_shape(&mut ranks, &[1, 257]);
    assert!(calls.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[test]
fn chunks_moved_on_by_a_lander_arrive_whole_and_in_order() {
    // The GPU-slot landing's control flow: every chunk copied on before its `ready`.
    for n in [2u32, 3] {
        let mut ranks = ring_landing(n, Wire::Tcp, 3, 64, Landing::Copied);
        every_shape(&mut ranks, &[1, 257, 1031]);
    }
}

#[test]
fn two_ranks_run_the_ring_as_well_as_the_exchange() {
    let mut ranks = ring(2, Wire::Tcp, 2, 4096);
    for r in ranks.iter_mut() {
        r.exchange = false;
    }
    for count in [1usize, 5000, 70_001] {
        run_checked(&mut ranks, count, Shape::AllReduce, ReduceOp::Sum);
    }
}

#[test]
fn an_abort_fails_the_collective_on_every_rank_and_no_rank_returns_wrong_data() {
    let mut ranks = ring(3, Wire::Tcp, 2, 256);
    run_checked(&mut ranks, 500, Shape::AllReduce, ReduceOp::Sum);
    // Rank 1 aborts before it calls: the others must not report Ok.
    ranks[1].abort(Error::Aborted {
        reason: "drill".into(),
    });
    let results = all_reduce_everywhere(&mut ranks, 5000, Duration::from_secs(10));
    for (p, r) in results.iter().enumerate() {
        assert!(r.is_err(), "rank {p} returned Ok after rank 1 aborted");
    }
}

#[test]
fn a_lost_peer_fails_its_neighbours_typed_within_the_deadline() {
    let mut ranks = ring(3, Wire::Tcp, 2, 256);
    run_checked(&mut ranks, 100, Shape::AllReduce, ReduceOp::Sum);
    // Rank 2's links go away (its process died): its neighbours' collective fails.
    let mut gone = ranks.pop().unwrap();
    if let Some(mut l) = gone.link.take() {
        l.close(Duration::from_secs(5)).unwrap();
    }
    let started = std::time::Instant::now();
    let results = all_reduce_everywhere(&mut ranks, 4000, Duration::from_secs(10));
    assert!(results.iter().all(|r| r.is_err()), "{results:?}");
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(Error::PeerLost { rank: 2 }))),
        "{results:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "failed by the deadline, not the loss"
    );
}

#[test]
fn ranks_that_disagree_fail_and_write_no_result() {
    let mut ranks = ring(2, Wire::Mem, 2, 256);
    ranks[1].tag = 2;
    let results: Vec<(Vec<f32>, crate::Result<()>)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter_mut()
            .map(|r| {
                s.spawn(move || {
                    let mut data = vec![r.position as f32; 100];
                    let res = r.collective(
                        &mut data,
                        Shape::AllReduce,
                        ReduceOp::Sum,
                        Duration::from_millis(500),
                    );
                    (data, res)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (p, (data, res)) in results.iter().enumerate() {
        assert!(res.is_err(), "rank {p}");
        assert!(
            data.iter().all(|v| *v == p as f32),
            "rank {p}'s buffer was written"
        );
    }
}

/// One rank's link whose only neighbour is the test, which writes what it likes.
fn against_a_hostile_peer() -> (
    NetLink,
    Box<dyn HostConnection>,
    SlotGrant,
    SlotGrant,
    SlotGrant,
) {
    let (mut ours, mut theirs) = pair(Wire::Mem);
    let (recv, from_prev, from_next) =
        (region(4 * 64), region(MAILBOX_BYTES), region(MAILBOX_BYTES));
    let recv_grant = ours.grant(&recv).unwrap();
    let prev_box = ours.grant(&from_prev).unwrap();
    let next_box = ours.grant(&from_next).unwrap();
    // The peer's own regions, granted to us (where our writes go).
    let (peer_recv, peer_box) = (region(4 * 64), region(MAILBOX_BYTES));
    let (pr, pb) = (
        theirs.grant(&peer_recv).unwrap(),
        theirs.grant(&peer_box).unwrap(),
    );
    let link = NetLink::start(NetLinkSetup {
        next: 1,
        prev: 1,
        to_next: Some(ours),
        to_prev: None,
        same_peer: true,
        send_slots: Some(region(4 * 64)),
        recv_slots: Some(recv),
        next_recv: Some(pr),
        next_mailbox: Some(pb),
        prev_mailbox: Some(pb),
        mailbox_from_prev: Some(from_prev),
        mailbox_from_next: Some(from_next),
        cells: region(MAILBOX_BYTES),
        slots: 4,
        slot_bytes: 64,
        mine: HostPage::new(),
        out_next: HostPage::new(),
        out_prev: HostPage::new(),
        desc_cells: DESC,
        stop_word: flag::STOPPED,
        options: NetOptions::default(),
        lander: None,
    })
    .unwrap();
    std::mem::forget(peer_recv);
    std::mem::forget(peer_box);
    (link, theirs, recv_grant, prev_box, next_box)
}

fn failure_within(link: &NetLink) -> Option<Error> {
    let until = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < until {
        if let Some(e) = link.failure() {
            return Some(e);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    None
}

#[test]
fn a_peer_that_breaks_the_protocol_is_named_and_stops_the_link() {
    let src = region(MAILBOX_BYTES);
    let kind = |k: u32, v: u32| (k << 29) | v;
    // Data out of order, a cell it may not write, credit for chunks never sent, an unknown
    // kind, data into a slot that was never released (chunk 4 of 4 slots without credit).
    let cases: Vec<(&str, Vec<(u32, bool)>)> = vec![
        ("out of order", vec![(kind(1, 3), true)]),
        ("forbidden cell", vec![(kind(3, flag::READY), false)]),
        ("credit", vec![(kind(2, 1), false)]),
        ("unknown", vec![(kind(7, 0), false)]),
        (
            "no credit",
            (0..5).map(|s| (kind(1, s), true)).collect::<Vec<_>>(),
        ),
    ];
    for (what, notes) in cases {
        let (link, mut peer, recv, prev_box, _) = against_a_hostile_peer();
        link.plan([], [64; 100]);
        for (note, data) in notes {
            let dst = if data { &recv } else { &prev_box };
            peer.write(&src, 0..4, dst, 0, Some(note)).unwrap();
        }
        let e = failure_within(&link);
        assert!(
            matches!(e, Some(Error::Protocol { rank: 1, .. })),
            "{what}: {e:?}"
        );
    }
}

//! What the `ring_notifications` fuzz target and its corpus replay test run: arbitrary
//! notifications from peers (immediates, grants, completions, timeouts, losses) against one
//! rank's schedule. Whatever the bytes, the schedule answers with actions or typed errors; it
//! never panics and never produces an unbounded stream of actions.

use std::time::{Duration, Instant};

use crate::descriptor::{self, Descriptor};
use crate::host::Notice;
use crate::plan::{Plan, Shape};
use crate::schedule::{Action, Immediate, RingSchedule};

/// Drives a schedule with the events encoded in `data`: 5 header bytes (ranks, rank, slots,
/// element count), then 5-byte events (kind, 32-bit value). Returns how many actions came out.
pub fn drive(data: &[u8]) -> usize {
    let Some(head) = data.get(..5) else {
        return 0;
    };
    let world = u32::from(head[0] % 16) + 1;
    let rank = u32::from(head[1]) % world;
    let slots = u32::from(head[2] % 4) + 1;
    let count = u64::from(u16::from_be_bytes([head[3], head[4]]) % 1024);
    // The upper bits of the first bytes pick the shape and a broadcast's root.
    let shape = match (head[0] >> 4) & 3 {
        0 => Shape::AllReduce,
        1 => Shape::ReduceScatter,
        2 => Shape::AllGather,
        _ => Shape::Broadcast {
            root: u32::from(head[2] >> 2) % world,
        },
    };
    let Ok(plan) = Plan::new(world, count, 4, 64, slots).and_then(|p| p.with_shape(shape)) else {
        return 0;
    };
    let start = Instant::now();
    let mut sched = RingSchedule::new(plan, rank, 1, Duration::from_secs(1), start);
    let mut actions = 0;
    for ev in data[5..].chunks_exact(5) {
        let v = u32::from_be_bytes([ev[1], ev[2], ev[3], ev[4]]);
        assert_eq!(Immediate::decode(v).encode(), v, "immediates round trip");
        // Grants and end notices: what decodes re-encodes to the same value.
        if let Some(n) = Notice::decode(v) {
            assert_eq!(Notice::decode(n.encode()), Some(n), "notices round trip");
        }
        let now = start + Duration::from_micros(u64::from(v % 4_000_000));
        // Errors are the schedule's typed answers to out-of-protocol input: fine here.
        let _ = match ev[0] % 6 {
            0 => sched.handle_arrived(v, now).map(|_| ()),
            1 => sched.handle_granted(v as u8, now),
            2 => sched.handle_sent(v % 256, now),
            3 => sched.handle_processed(v % 256, now),
            4 => {
                sched.handle_timeout(now);
                Ok(())
            }
            _ => {
                sched.handle_peer_lost(v % world);
                Ok(())
            }
        };
        let mut burst = 0;
        while let Some(a) = sched.poll_action() {
            burst += 1;
            assert!(burst <= 100_000, "an unbounded stream of actions");
            if matches!(a, Action::Done | Action::Failed(_)) {
                actions += burst;
                return actions;
            }
        }
        actions += burst;
    }
    actions
}

/// The descriptor a rank's next rank sends with its description: any 32 bytes decode to a
/// descriptor that re-encodes to them, or fail with a typed error. Run on every 32-byte window
/// of `data` by the fuzz target and the corpus replay.
pub fn descriptors(data: &[u8]) -> usize {
    let mut accepted = 0;
    for w in data.windows(descriptor::ENCODED_LEN).step_by(7) {
        if let Ok(d) = Descriptor::decode(w) {
            assert_eq!(&d.encode()[..], w, "descriptors round trip");
            let _ = d.tag();
            accepted += 1;
        }
    }
    accepted
}

/// What the `comm_announcement` fuzz target runs: every 12-byte window of `data` (and `data`
/// whole) as the bootstrap announcement of a peer. What decodes re-encodes to the same bytes;
/// the link chosen with it is the same from both ends (or a typed error from both). Returns
/// how many decoded.
pub fn announcements(data: &[u8]) -> usize {
    use crate::comm::form::table::{Pair, device_ring, host_link};
    use crate::comm::links::Announcement;
    let mut accepted = 0;
    let whole = std::iter::once(data);
    for w in whole.chain(data.windows(crate::comm::links::ENCODED_LEN).step_by(5)) {
        let Ok(theirs) = Announcement::decode(1, w) else {
            continue;
        };
        assert_eq!(theirs.encode(), w, "announcements round trip");
        for ours in [
            Announcement::ours(None, true, Some(0), theirs.settings),
            Announcement::ours(theirs.forced, false, None, theirs.settings),
            Announcement::ours(theirs.forced, true, Some(3), theirs.settings),
        ] {
            for same_host in [true, false] {
                let pair = |o, t, me, peer| Pair {
                    ours: (o, me),
                    theirs: (t, peer),
                    same_host,
                    why_no_verbs: "none",
                };
                let here = host_link(&pair(&ours, &theirs, 0, 1));
                let there = host_link(&pair(&theirs, &ours, 1, 0));
                assert_eq!(
                    here.is_ok(),
                    there.is_ok(),
                    "both ends agree whether the link exists"
                );
                if let (Ok(a), Ok(b)) = (&here, &there) {
                    assert_eq!((a.0, a.1), (b.0, b.1), "both ends choose the same link");
                }
                let ring = |a, b| device_ring(&[pair(a, b, 0, 1)], ours.forced, true).is_ok();
                assert_eq!(
                    ring(&ours, &theirs),
                    ring(&theirs, &ours),
                    "both ends agree on the GPU ring"
                );
            }
        }
        accepted += 1;
    }
    accepted
}

/// What the `net_notes` fuzz target and its corpus replay test run: a network link's two ends
/// ([`crate::progress`]) fed arbitrary notifications from their neighbours (read by
/// [`crate::net_link::classify`]) interleaved with what the streams store, completions,
/// flushes, aborts and losses. Whatever the bytes: no panic; no write without credit or past
/// what the stream made ready; no `ready` past what landed (and, with a flush, was flushed); no
/// credit past what the stream released; cells only where the neighbour's role allows; nothing
/// after a stop. Returns how many actions came out.
///
/// Layout: 2 header bytes (slots, flags: same peer, flush), then 5-byte events (kind, 32-bit
/// value).
pub fn net_notes(data: &[u8]) -> usize {
    use crate::net_link::{Note, classify, encode_note, words};
    use crate::progress::{RecvAction, RecvEnd, SendAction, SendEnd};
    let Some(head) = data.get(..2) else {
        return 0;
    };
    let slots = u32::from(head[0] % 8) + 1;
    let same_peer = head[1] & 1 != 0;
    let flush = head[1] & 2 != 0;
    let desc = (words::DESC_BASE, slots + 2);
    let (mut send, mut recv) = (SendEnd::new(slots), RecvEnd::new(slots, flush));
    // What the harness knows: the stream's counters, what landed, what was flushed.
    let (mut made_ready, mut released_by_stream) = (0u64, 0u64);
    let (mut ready, mut posted, mut flushing) = (0u64, 0u64, None::<u64>);
    let (mut send_stopped, mut recv_stopped) = (false, false);
    let mut actions = 0;
    for ev in data[2..].chunks_exact(5) {
        let v = u32::from_be_bytes([ev[1], ev[2], ev[3], ev[4]]);
        match ev[0] % 10 {
            // A neighbour's notification, as the previous rank, the next rank or both.
            k @ 0..=2 => {
                let (from_prev, from_next) = match k {
                    0 => (true, same_peer),
                    1 => (same_peer, true),
                    _ => (true, true),
                };
                let note = classify(v, from_prev, from_next, desc);
                if let Some(e) = encode_note(&note) {
                    assert_eq!(e, v, "a note that is read encodes back to itself");
                }
                match note {
                    Note::Data(low) => {
                        assert!(from_prev, "chunks only from the previous rank");
                        recv.landed(unwrap_low(recv.landed_count(), low));
                    }
                    Note::Credit(low) => {
                        assert!(from_next, "credit only from the next rank");
                        send.credit(unwrap_low(send.credited(), low));
                    }
                    Note::Cell {
                        index,
                        from_prev: p,
                    } => {
                        let prev_cell = index == words::ENDED_BY_PREV
                            || (desc.0..desc.0 + desc.1).contains(&index);
                        assert!(
                            (p && from_prev && prev_cell)
                                || (!p && from_next && index == words::ENDED_BY_NEXT),
                            "cell {index} accepted from the wrong role"
                        );
                    }
                    Note::Refused(_) => {}
                }
            }
            3 => {
                made_ready += u64::from(v % 4);
                send.stream_sent(made_ready);
            }
            4 => {
                // The stream releases only what was made ready to it.
                released_by_stream = (released_by_stream + u64::from(v % 4)).min(ready);
                recv.stream_released(released_by_stream);
            }
            5 => send.write_completed(send.completed(), v % 16 != 0),
            6 => {
                if flushing.take().is_some() {
                    recv.flushed(v % 16 != 0);
                }
            }
            7 => send.abort(),
            8 => recv.abort(),
            _ => {
                send.peer_lost();
                recv.peer_lost();
            }
        }
        while let Some(a) = send.poll() {
            actions += 1;
            assert!(!send_stopped, "nothing after a stop");
            match a {
                SendAction::Write { seq, .. } => {
                    assert_eq!(seq, posted, "writes in order");
                    assert!(seq < made_ready, "a write of a chunk the stream made ready");
                    assert!(
                        seq < send.credited() + u64::from(slots),
                        "a write into a slot the receiver released"
                    );
                    posted += 1;
                }
                SendAction::Stop(_) => send_stopped = true,
            }
            assert!(actions < 1 << 20, "a bounded stream of actions");
        }
        while let Some(a) = recv.poll() {
            actions += 1;
            assert!(!recv_stopped, "nothing after a stop");
            match a {
                RecvAction::Flush { upto } => {
                    assert!(flush, "a flush only where the GPU needs one");
                    assert!(upto <= recv.landed_count());
                    flushing = Some(upto);
                }
                RecvAction::Ready(n) => {
                    assert!(n <= recv.landed_count(), "ready only for what landed");
                    assert!(n > ready, "ready grows");
                    ready = n;
                }
                RecvAction::Credit(n) => {
                    assert!(n <= released_by_stream, "credit only for released slots");
                }
                RecvAction::Stop(_) => recv_stopped = true,
            }
            assert!(actions < 1 << 20, "a bounded stream of actions");
        }
    }
    actions
}

/// The smallest value ≥ `base` that is `low` mod 2^29 (as the link unwraps notifications).
fn unwrap_low(base: u64, low: u32) -> u64 {
    base + u64::from(low.wrapping_sub(base as u32) & ((1 << 29) - 1))
}

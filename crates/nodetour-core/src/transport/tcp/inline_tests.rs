//! The tcp connection's inline receive mode: the owner reads its socket itself; a write that
//! would block hands reading back to the receive threads.

use std::time::Duration;

use super::{AMPLE, TcpConnection, loopback_pair};
use crate::auth::JobToken;
use crate::deadline::Deadline;
use crate::memory::HostBuffer;
use crate::transport::{Event, HostConnection, SlotRegion, wait_any};

fn pair() -> (TcpConnection, TcpConnection) {
    loopback_pair(&JobToken::new("t")).unwrap()
}

fn region(len: usize) -> SlotRegion {
    SlotRegion::host(HostBuffer::new(len).unwrap())
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ seed.wrapping_mul(37))
        .collect()
}

/// Waits for `n` notifications on `c`, in order. The deadline only stops a hung test: what is
/// tested is the order and the bytes, and under valgrind (one thread at a time, 3 MiB through
/// the socket) a notification has taken longer than 10 s.
fn notifications(c: &mut dyn HostConnection, n: usize) -> Vec<u32> {
    let mut ev = Vec::new();
    while ev.len() < n {
        c.wait(&mut ev, Deadline::after(AMPLE)).unwrap();
    }
    ev.iter().map(|Event::Notified(v)| *v).collect()
}

/// Small frames many to a read, a body larger than the read buffer (partly buffered, the rest
/// straight from the socket), then small frames again: every byte and notification lands, in
/// order, read by the waiting thread.
#[test]
fn the_owner_reading_inline_lands_small_and_large_frames_in_order() {
    let (mut a, mut b) = pair();
    // (Tests in this process that block a write revoke the mode now and then: landing is the
    // same either way, which is the point.)
    a.read_inline(true);
    let big = 3 << 20;
    let target = region(big + 4096);
    let grant = a.grant(&target).unwrap();
    let src = region(big + 4096);
    let data = pattern(big + 4096, 1);
    src.write_at(0, &data).unwrap();
    for i in 0..100u32 {
        b.write(
            &src,
            i as usize..i as usize + 8,
            &grant,
            u64::from(i) * 8,
            Some(i),
        )
        .unwrap();
    }
    let sender = std::thread::spawn(move || {
        b.write(&src, 4096..4096 + big, &grant, 4096, Some(1000))
            .unwrap();
        b.write(&src, 0..16, &grant, 800, Some(1001)).unwrap();
        b
    });
    let got = notifications(&mut a, 102);
    let mut want: Vec<u32> = (0..100).collect();
    want.extend([1000, 1001]);
    assert_eq!(got, want);
    let _b = sender.join().unwrap();
    let mut out = vec![0u8; big + 4096];
    target.read_at(0, &mut out).unwrap();
    for i in 0..100 {
        assert_eq!(&out[i * 8..i * 8 + 8], &data[i..i + 8], "small frame {i}");
    }
    assert_eq!(&out[800..816], &data[..16]);
    assert_eq!(&out[4096..], &data[4096..]);
}

/// Both ends read inline and both write far more than the sockets hold before either reads: the
/// first write that would block hands reading back to the receive threads (in this process:
/// both ends), so neither waits for the other.
#[test]
fn writers_blocked_on_each_other_while_reading_inline_still_finish() {
    let (mut a, mut b) = pair();
    let len = 64 << 20;
    let (ta, tb) = (region(len), region(len));
    let (ga, gb) = (a.grant(&ta).unwrap(), b.grant(&tb).unwrap());
    let (sa, sb) = (region(len), region(len));
    let (da, db) = (pattern(len, 2), pattern(len, 3));
    sa.write_at(0, &da).unwrap();
    sb.write_at(0, &db).unwrap();
    a.read_inline(true);
    b.read_inline(true);
    let other = std::thread::spawn(move || {
        b.write(&sb, 0..len, &ga, 0, Some(7)).unwrap();
        assert_eq!(notifications(&mut b, 1), [8]);
        b
    });
    a.write(&sa, 0..len, &gb, 0, Some(8)).unwrap();
    assert_eq!(notifications(&mut a, 1), [7]);
    let b = other.join().unwrap();
    assert!(
        !a.rx.inline() && !b.rx.inline(),
        "the blocked writes ended inline reading"
    );
    let mut out = vec![0u8; len];
    ta.read_at(0, &mut out).unwrap();
    assert!(out == db, "b's bytes landed in a's region");
    tb.read_at(0, &mut out).unwrap();
    assert!(out == da, "a's bytes landed in b's region");
}

/// One wait covers two connections that read inline: a notification on either ends it, tagged
/// with the connection it came from.
#[test]
fn one_wait_serves_two_inline_connections() {
    let (mut a1, mut b1) = pair();
    let (mut a2, mut b2) = pair();
    a1.read_inline(true);
    a2.read_inline(true);
    let (t1, t2) = (region(4096), region(4096));
    let (g1, g2) = (a1.grant(&t1).unwrap(), a2.grant(&t2).unwrap());
    let src = region(4096);
    let mut ev = Vec::new();
    let quiet = wait_any(
        &mut [&mut a1, &mut a2],
        &mut ev,
        Deadline::after(Duration::from_millis(50)),
    );
    assert!(quiet.is_ok() && ev.is_empty(), "nothing came: {quiet:?}");
    b2.write(&src, 0..8, &g2, 0, Some(22)).unwrap();
    while ev.is_empty() {
        wait_any(&mut [&mut a1, &mut a2], &mut ev, Deadline::after(AMPLE)).unwrap();
    }
    assert_eq!(ev, [(1, Event::Notified(22))]);
    ev.clear();
    b1.write(&src, 0..8, &g1, 0, Some(11)).unwrap();
    while ev.is_empty() {
        wait_any(&mut [&mut a1, &mut a2], &mut ev, Deadline::after(AMPLE)).unwrap();
    }
    assert_eq!(ev, [(0, Event::Notified(11))]);
}

/// A peer that goes away is an error for a waiter reading inline, not a hang; a receive
/// thread parked meanwhile is joined when the connection drops.
#[test]
fn an_inline_waiter_sees_the_peer_close() {
    let (mut a, b) = pair();
    a.read_inline(true);
    drop(b);
    let mut ev = Vec::new();
    let r = a.wait(&mut ev, Deadline::after(AMPLE));
    assert!(
        matches!(r, Err(crate::error::Error::Exchange { op: "receive", .. })),
        "{r:?}"
    );
    let start = std::time::Instant::now();
    drop(a);
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "the drop is prompt"
    );
}

/// Deferred writes leave in order, with the immediate ones, when the writer flushes (or polls,
/// waits, or writes at once); nothing is sent before.
#[test]
fn deferred_writes_leave_together_and_in_order() {
    let (mut a, mut b) = pair();
    let target = region(1 << 20);
    let grant = a.grant(&target).unwrap();
    let src = region(1 << 20);
    let data = pattern(1 << 20, 4);
    src.write_at(0, &data).unwrap();
    for i in 0..10u32 {
        b.write_deferred(
            &src,
            i as usize * 8..i as usize * 8 + 8,
            &grant,
            u64::from(i) * 8,
            Some(i),
        )
        .unwrap();
    }
    let mut ev = Vec::new();
    let quiet = a.wait(&mut ev, Deadline::after(Duration::from_millis(100)));
    assert!(quiet.is_err() && ev.is_empty(), "held back until flushed");
    b.flush().unwrap();
    assert_eq!(notifications(&mut a, 10), (0..10).collect::<Vec<_>>());
    // A large deferred write goes at once, after what was held back before it.
    b.write_deferred(&src, 0..8, &grant, 4096, Some(20))
        .unwrap();
    b.write_deferred(&src, 8192..(1 << 20), &grant, 8192, Some(21))
        .unwrap();
    assert_eq!(notifications(&mut a, 2), [20, 21]);
    // A poll flushes too.
    b.write_deferred(&src, 0..16, &grant, 100, Some(30))
        .unwrap();
    b.poll(&mut Vec::new()).unwrap();
    assert_eq!(notifications(&mut a, 1), [30]);
    let mut out = vec![0u8; 1 << 20];
    target.read_at(0, &mut out).unwrap();
    assert_eq!(&out[..80], &data[..80]);
    assert_eq!(&out[100..116], &data[..16]);
    assert_eq!(&out[4096..4104], &data[..8]);
    assert_eq!(&out[8192..], &data[8192..]);
}

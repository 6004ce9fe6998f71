//! Tests of the tcp transport (private items: beside the code).
use super::*;
use crate::memory::HostBuffer;

fn pair(token_a: &str, token_b: &str) -> Result<(TcpConnection, TcpConnection)> {
    // Ample where both ends should connect; short where the acceptor waits out a stranger.
    let setup = Duration::from_secs(if token_a == token_b { 60 } else { 5 });
    loopback_pair_tokens(JobToken::new(token_a), JobToken::new(token_b), setup)
}

#[test]
fn writes_land_in_the_granted_region_with_their_notification() {
    let (mut a, mut b) = pair("t", "t").unwrap();
    let target = SlotRegion::host(HostBuffer::new(1 << 20).unwrap());
    let grant = a.grant(&target).unwrap();
    let src = SlotRegion::host(HostBuffer::new(1 << 20).unwrap());
    let data: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    src.write_at(0, &data).unwrap();
    b.write(&src, 0..(1 << 20), &grant, 0, None).unwrap();
    b.write(&src, 10..20, &grant, 4096, Some(77)).unwrap();
    let mut ev = Vec::new();
    a.wait(&mut ev, Deadline::after(AMPLE)).unwrap();
    assert_eq!(ev, [Event::Notified(77)]);
    let mut got = vec![0u8; 1 << 20];
    target.read_at(0, &mut got).unwrap();
    assert_eq!(&got[..4096], &data[..4096]);
    assert_eq!(&got[4096..4106], &data[10..20]);
    assert_eq!(&got[4106..], &data[4106..]);
}

#[test]
fn a_wrong_token_is_refused() {
    assert!(pair("right", "wrong").is_err());
}

/// A listener that plays the acceptor's part with `answer` in place of its proof.
fn impostor(answer: &'static [u8]) -> Result<TcpConnection> {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.write_all(&crate::auth::nonce()).unwrap();
        let mut got = [0u8; 68];
        let _ = s.read_exact(&mut got);
        let _ = s.write_all(answer);
    });
    let timeout = Duration::from_secs(5);
    let r = connect(
        &addr,
        1,
        2,
        &JobToken::new("t"),
        &[],
        &|| Ok(()),
        timeout,
        Deadline::after(timeout),
    );
    t.join().unwrap();
    r
}

#[test]
fn the_dialler_authenticates_the_acceptor() {
    // What an acceptor without the token could send: one byte (all the old client
    // needed), or 32 bytes that are not the proof.
    for answer in [&[1u8][..], &[0u8; 32][..]] {
        match impostor(answer) {
            Err(Error::Authenticate { .. }) => {}
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("connected to an acceptor that did not prove the token"),
        }
    }
}

/// Runs `exchange` between rank 0 (accepting) and rank 1 (dialling) with the given tokens
/// and payloads, each side with `wait` to finish; returns each side's result.
#[allow(clippy::type_complexity)]
fn exchange_pair(
    tokens: (&str, &str),
    payloads: (Vec<u8>, Vec<u8>),
    wait: Duration,
) -> (Result<HashMap<u32, Vec<u8>>>, Result<HashMap<u32, Vec<u8>>>) {
    let timeout = Duration::from_secs(5);
    let e0 = TcpEndpoint::bind("127.0.0.1:0", JobToken::new(tokens.0), timeout).unwrap();
    let e1 = TcpEndpoint::bind("127.0.0.1:0", JobToken::new(tokens.1), timeout).unwrap();
    let a0 = e0.local_addr().unwrap().to_string();
    let (p0, p1) = payloads;
    std::thread::scope(|s| {
        let t = s.spawn(|| {
            e1.exchange(
                &[0],
                1,
                2,
                &|_| a0.clone(),
                &|_| p1.clone(),
                &|| Ok(()),
                Deadline::after(wait),
            )
        });
        let r0 = e0.exchange(
            &[1],
            0,
            2,
            &|r| {
                assert_eq!(r, 0, "rank 0 dials no one");
                a0.clone()
            },
            &|_| p0.clone(),
            &|| Ok(()),
            Deadline::after(wait),
        );
        (r0, t.join().unwrap())
    })
}

/// An on-path redirect: rank 2 dials "rank 1" at an address that leads to rank 0, which
/// holds the same token and waits for rank 2. The proofs name the acceptor, so both refuse
/// instead of pairing the wrong ranks.
#[test]
fn a_dial_redirected_to_another_rank_of_the_job_fails_on_both_sides() {
    let timeout = Duration::from_secs(5);
    let token = JobToken::new("t");
    let e0 = TcpEndpoint::bind("127.0.0.1:0", token.clone(), timeout).unwrap();
    let e2 = TcpEndpoint::bind("127.0.0.1:0", token, timeout).unwrap();
    let a0 = e0.local_addr().unwrap().to_string();
    let a2 = e2.local_addr().unwrap().to_string();
    let wait = Duration::from_secs(3);
    let (r0, r2) = std::thread::scope(|s| {
        let t = s.spawn(|| {
            // Rank 2's table says rank 1 is at a0 (the redirect).
            e2.exchange(
                &[1],
                2,
                3,
                &|r| if r == 2 { a2.clone() } else { a0.clone() },
                &|_| b"from rank 2".to_vec(),
                &|| Ok(()),
                Deadline::after(wait),
            )
        });
        let r0 = e0.exchange(
            &[2],
            0,
            3,
            &|r| if r == 0 { a0.clone() } else { a2.clone() },
            &|_| b"from rank 0".to_vec(),
            &|| Ok(()),
            Deadline::after(wait),
        );
        (r0, t.join().unwrap())
    });
    println!("REDIRECT rank 0: {r0:?}");
    println!("REDIRECT rank 2: {r2:?}");
    assert!(
        r0.is_err(),
        "rank 0 paired with a dial meant for rank 1: {r0:?}"
    );
    assert!(r2.is_err(), "rank 2 took rank 0 for rank 1: {r2:?}");
}

/// Strangers that connect and say nothing cost the listener a bounded wait each, in
/// parallel: the rank behind them is authenticated at once.
#[test]
fn silent_strangers_do_not_hold_up_the_ranks() {
    let timeout = Duration::from_secs(5);
    let e0 = TcpEndpoint::bind("127.0.0.1:0", JobToken::new("t"), timeout).unwrap();
    let e1 = TcpEndpoint::bind("127.0.0.1:0", JobToken::new("t"), timeout).unwrap();
    let a0 = e0.local_addr().unwrap().to_string();
    let strangers: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(&a0).unwrap()).collect();
    let wait = Duration::from_secs(8);
    let started = std::time::Instant::now();
    let (r0, r1) = std::thread::scope(|s| {
        let t = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(100));
            e1.exchange(
                &[0],
                1,
                2,
                &|_| a0.clone(),
                &|_| b"one".to_vec(),
                &|| Ok(()),
                Deadline::after(wait),
            )
        });
        let r0 = e0.exchange(
            &[1],
            0,
            2,
            &|_| a0.clone(),
            &|_| b"zero".to_vec(),
            &|| Ok(()),
            Deadline::after(wait),
        );
        (r0, t.join().unwrap())
    });
    let took = started.elapsed();
    println!(
        "STRANGERS: rank 0 {:?} rank 1 {:?} after {took:?}",
        r0.is_ok(),
        r1.is_ok()
    );
    assert_eq!(r0.unwrap()[&1], b"one");
    assert_eq!(r1.unwrap()[&0], b"zero");
    assert!(
        took < Duration::from_secs(3),
        "held up {took:?} by silent strangers"
    );
    drop(strangers);
}

#[test]
fn neighbours_exchange_setup_payloads_only_with_the_job_token() {
    // Generous where both sides should succeed: under valgrind, beside the other tests on
    // two CPUs, a 2 s deadline once expired mid-exchange (the side that gave up closed its
    // socket with the other's payload unread, and the other saw a reset).
    let ample = Duration::from_secs(60);
    let (r0, r1) = exchange_pair(("t", "t"), (b"from 0".to_vec(), b"from 1".to_vec()), ample);
    assert_eq!(r0.unwrap()[&1], b"from 1");
    assert_eq!(r1.unwrap()[&0], b"from 0");
    // A stranger (wrong token) learns nothing and gets nothing: the acceptor refuses it and
    // reaches its deadline; the dialler is refused.
    let (r0, r1) = exchange_pair(
        ("t", "wrong"),
        (b"secret".to_vec(), b"x".to_vec()),
        Duration::from_secs(2),
    );
    assert!(matches!(r0, Err(Error::Timeout { .. })), "{r0:?}");
    assert!(r1.is_err());
    // An oversized payload is refused before anything is dialled or sent (so however slow
    // the run, the handshake cannot fail first).
    let (_, r1) = exchange_pair(
        ("t", "t"),
        (vec![], vec![0; EXCHANGE_MAX + 1]),
        Duration::from_secs(2),
    );
    assert!(matches!(r1, Err(Error::InvalidArgument { .. })), "{r1:?}");
}

#[test]
fn writes_outside_the_grant_are_refused_locally() {
    let (mut a, mut b) = pair("t", "t").unwrap();
    let target = SlotRegion::host(HostBuffer::new(4096).unwrap());
    let grant = a.grant(&target).unwrap();
    let src = SlotRegion::host(HostBuffer::new(8192).unwrap());
    assert!(matches!(
        b.write(&src, 0..8192, &grant, 0, None),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        b.write(&src, 0..1, &grant, 4096, None),
        Err(Error::OutOfBounds { .. })
    ));
}

#[test]
fn a_hostile_frame_closes_the_connection_and_writes_nothing() {
    let (mut a, b) = pair("t", "t").unwrap();
    let target = SlotRegion::host(HostBuffer::new(4096).unwrap());
    let other = SlotRegion::host(HostBuffer::new(4096).unwrap());
    let grant = a.grant(&target).unwrap();
    let mut raw = b.stream.try_clone().unwrap();
    // Past the end of the granted region, then an ungranted key, then an in-bounds write
    // that must never be processed.
    for h in [
        WriteHeader {
            key: grant.key,
            offset: 4000,
            len: 200,
            notify: Some(1),
        },
        WriteHeader {
            key: other.key(),
            offset: 0,
            len: 16,
            notify: Some(2),
        },
        WriteHeader {
            key: grant.key,
            offset: 0,
            len: 16,
            notify: Some(3),
        },
    ] {
        let _ = raw.write_all(&h.encode());
        let _ = raw.write_all(&[0xee; 200][..h.len as usize]);
    }
    let mut ev = Vec::new();
    match a.wait(&mut ev, Deadline::after(AMPLE)) {
        Err(Error::Exchange {
            op: "receive",
            source,
            ..
        }) => assert!(
            source.to_string().contains("refused the peer's write"),
            "{source}"
        ),
        other => panic!("{other:?} {ev:?}"),
    }
    assert!(ev.is_empty());
    let mut got = vec![0u8; 4096];
    target.read_at(0, &mut got).unwrap();
    assert!(got.iter().all(|x| *x == 0), "no byte written");
    other.read_at(0, &mut got).unwrap();
    assert!(
        got.iter().all(|x| *x == 0),
        "no byte written in the other region"
    );
    // The sender learns too: its next write fails once the socket is closed.
    let mut b = b;
    let src = SlotRegion::host(HostBuffer::new(1 << 20).unwrap());
    let mut failed = false;
    for _ in 0..50 {
        if b.write(&src, 0..(1 << 20), &grant, 0, None).is_err() {
            failed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(failed, "the sender sees the closed connection");
}

/// Each hostile frame on a fresh connection: refused with a typed error, and guard bytes
/// all around the granted window (the slot's neighbours in one region, and another region
/// of the same connection) are untouched.
#[test]
fn hostile_offsets_lengths_keys_and_replays_are_refused_and_guards_hold() {
    const GUARD: u8 = 0xa5;
    // (what, the frame made from the grant and another region)
    type Hostile = (&'static str, fn(&SlotGrant, &SlotRegion) -> Vec<u8>);
    let cases: [Hostile; 7] = [
        ("offset past the end", |g, _| {
            frame(g.key, g.len, 1, Some(1))
        }),
        ("offset + length overflows u64", |g, _| {
            frame(g.key, u64::MAX - 3, 16, Some(1))
        }),
        ("offset + length just past the end", |g, _| {
            frame(g.key, g.len - 8, 9, Some(1))
        }),
        ("a length beyond MAX_FRAME", |g, _| {
            let mut h = frame(g.key, 0, 16, Some(1));
            h[20..24].copy_from_slice(&(MAX_FRAME + 1).to_be_bytes());
            h
        }),
        (
            "a forged key (a region granted on no connection)",
            |_, other| frame(other.key().wrapping_add(1000), 0, 16, Some(1)),
        ),
        ("another region's key, not granted here", |_, other| {
            frame(other.key(), 0, 16, Some(1))
        }),
        (
            "a corrupted magic (a replayed handshake, garbage)",
            |g, _| {
                let mut h = frame(g.key, 0, 16, Some(1));
                h[..4].copy_from_slice(b"NDTB");
                h
            },
        ),
    ];
    fn frame(key: u32, offset: u64, len: u32, notify: Option<u32>) -> Vec<u8> {
        let mut v = WriteHeader {
            key,
            offset: 0,
            len: 0,
            notify,
        }
        .encode()
        .to_vec();
        v[12..20].copy_from_slice(&offset.to_be_bytes());
        v[20..24].copy_from_slice(&len.to_be_bytes());
        v.extend(std::iter::repeat_n(0xee, len.min(64) as usize));
        v
    }
    for ((what, make), inline) in cases.into_iter().flat_map(|c| [(c, false), (c, true)]) {
        let (mut a, b) = pair("t", "t").unwrap();
        // Both ways of receiving: the receive thread, and the owner reading inline.
        a.read_inline(inline);
        let target = SlotRegion::host(HostBuffer::new(3 * 4096).unwrap());
        let other = SlotRegion::host(HostBuffer::new(4096).unwrap());
        target.write_at(0, &[GUARD; 3 * 4096]).unwrap();
        other.write_at(0, &[GUARD; 4096]).unwrap();
        let grant = a.grant(&target).unwrap();
        let mut raw = b.stream.try_clone().unwrap();
        let _ = raw.write_all(&make(&grant, &other));
        let mut ev = Vec::new();
        match a.wait(&mut ev, Deadline::after(AMPLE)) {
            Err(Error::Exchange { op: "receive", .. }) => {}
            other => panic!("{what} (inline: {inline}): {other:?} {ev:?}"),
        }
        assert!(ev.is_empty(), "{what} (inline: {inline}): no notification");
        let mut got = vec![0u8; 3 * 4096];
        target.read_at(0, &mut got).unwrap();
        assert!(
            got.iter().all(|x| *x == GUARD),
            "{what} (inline: {inline}): the region is untouched"
        );
        other.read_at(0, &mut got[..4096]).unwrap();
        assert!(
            got[..4096].iter().all(|x| *x == GUARD),
            "{what} (inline: {inline}): the other region is untouched"
        );
    }
}

/// After the handshake, a frame that does not carry the session's tag for its place in the
/// stream (forged without the key, or an authentic frame sent again) is refused, and its
/// payload and notification never land.
#[test]
fn forged_and_replayed_frames_fail_the_session_and_land_nothing() {
    const GUARD: u8 = 0x5a;
    for (case, inline) in [
        ("forged", false),
        ("replayed", false),
        ("forged", true),
        ("replayed", true),
    ] {
        let (mut a, mut b) = pair("t", "t").unwrap();
        a.read_inline(inline);
        let target = SlotRegion::host(HostBuffer::new(4096).unwrap());
        target.write_at(0, &[GUARD; 4096]).unwrap();
        let grant = a.grant(&target).unwrap();
        let src = SlotRegion::host(HostBuffer::new(4096).unwrap());
        src.write_at(0, &[7; 64]).unwrap();
        let header = WriteHeader {
            key: grant.key,
            offset: 0,
            len: 64,
            notify: Some(5),
        }
        .encode();
        let mut raw = b.stream.try_clone().unwrap();
        let mut ev = Vec::new();
        if case == "replayed" {
            // The key as it stood before the authentic frame: it tags that frame again.
            let mut before = b.send.clone();
            b.write(&src, 0..64, &grant, 0, Some(5)).unwrap();
            a.wait(&mut ev, Deadline::after(AMPLE)).unwrap();
            assert_eq!(ev, vec![Event::Notified(5)]);
            ev.clear();
            target.write_at(0, &[GUARD; 64]).unwrap();
            let tag = before.seal(&[&header, &[7; 64]]);
            raw.write_all(&header).unwrap();
            raw.write_all(&tag).unwrap();
            raw.write_all(&[7; 64]).unwrap();
        } else {
            raw.write_all(&header).unwrap();
            raw.write_all(&[0u8; TAG_LEN]).unwrap();
            raw.write_all(&[9; 64]).unwrap();
        }
        match a.wait(&mut ev, Deadline::after(AMPLE)) {
            Err(Error::Exchange {
                op: "receive",
                source,
                ..
            }) => assert!(
                source.to_string().contains("authentication"),
                "{case}: {source}"
            ),
            other => panic!("{case}: {other:?} {ev:?}"),
        }
        assert!(ev.is_empty(), "{case}: no notification");
        let mut got = vec![0u8; 4096];
        target.read_at(0, &mut got).unwrap();
        assert!(got.iter().all(|x| *x == GUARD), "{case}: nothing landed");
    }
}

#[test]
fn truncated_frames_and_disconnects_are_errors_not_hangs() {
    for inline in [false, true] {
        truncated_frame_then_disconnect(inline);
    }
}

fn truncated_frame_then_disconnect(inline: bool) {
    let (mut a, b) = pair("t", "t").unwrap();
    a.read_inline(inline);
    let target = SlotRegion::host(HostBuffer::new(4096).unwrap());
    let grant = a.grant(&target).unwrap();
    let mut raw = b.stream.try_clone().unwrap();
    raw.write_all(
        &WriteHeader {
            key: grant.key,
            offset: 0,
            len: 100,
            notify: Some(1),
        }
        .encode(),
    )
    .unwrap();
    raw.write_all(&[1; 10]).unwrap();
    drop(raw);
    drop(b);
    let mut ev = Vec::new();
    assert!(matches!(
        a.wait(&mut ev, Deadline::after(AMPLE)),
        Err(Error::Exchange { .. })
    ));
}

#[test]
fn silence_times_out() {
    let (mut a, _b) = pair("t", "t").unwrap();
    let start = std::time::Instant::now();
    assert!(matches!(
        a.wait(&mut Vec::new(), Deadline::after(Duration::from_millis(200))),
        Err(Error::Timeout { .. })
    ));
    assert!(start.elapsed() < Duration::from_secs(2));
}

/// A rank reached by a peer it does not expect yet (a peer link formed on first use): rank 2
/// dials rank 0 while rank 0 accepts rank 1 only; rank 0's next exchange, with rank 2, takes
/// the connection kept for it, and every payload arrives where it was sent.
#[test]
fn a_connection_that_comes_early_waits_for_the_accept_that_expects_it() {
    let timeout = Duration::from_secs(5);
    let token = JobToken::new("t");
    let e: Vec<TcpEndpoint> = (0..3)
        .map(|_| TcpEndpoint::bind("127.0.0.1:0", token.clone(), timeout).unwrap())
        .collect();
    let addr: Vec<String> = e
        .iter()
        .map(|x| x.local_addr().unwrap().to_string())
        .collect();
    let wait = Deadline::after(Duration::from_secs(10));
    let ex = |me: u32, peers: &[u32]| {
        e[me as usize].exchange(
            peers,
            me,
            3,
            &|r| addr[r as usize].clone(),
            &|p| format!("{me} to {p}").into_bytes(),
            &|| Ok(()),
            wait,
        )
    };
    std::thread::scope(|s| {
        let two = s.spawn(|| ex(2, &[0]));
        // Rank 2's dial is accepted (and kept) while rank 0 waits for rank 1.
        std::thread::sleep(Duration::from_millis(300));
        let one = s.spawn(|| ex(1, &[0]));
        let first = ex(0, &[1]).unwrap();
        assert_eq!(first[&1], b"1 to 0");
        let second = ex(0, &[2]).unwrap();
        assert_eq!(second[&2], b"2 to 0");
        assert_eq!(one.join().unwrap().unwrap()[&0], b"0 to 1");
        assert_eq!(two.join().unwrap().unwrap()[&0], b"0 to 2");
    });
}

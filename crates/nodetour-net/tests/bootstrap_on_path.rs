//! An on-path attacker between the ranks and rank 0's rendezvous (a loopback proxy that
//! forwards every byte and changes some): a rewritten table, a forged barrier release, a forged
//! "rank lost", and a replayed message are each refused by every rank that receives them (a
//! typed authentication error, or the connection dropped and named), never acted on.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use nodetour_core::{Deadline, Error, Result};
use nodetour_net::bootstrap::wire::{HEADER_LEN, Message};
use nodetour_net::bootstrap::{Bootstrap, HostIdentity, JobToken, PeerEntry};

/// Bytes of a session tag after each message past the proofs.
const TAG: usize = 16;

#[derive(Clone, Copy, Debug)]
enum Tamper {
    /// Flip the last byte of the table (the last rank's blob) on its way to each rank.
    RewriteTable,
    /// After the table, a barrier release nobody sent (with a made-up tag).
    ForgeRelease,
    /// After the table, "rank 2 lost" (with a made-up tag).
    ForgeRankLost,
    /// After the table, the table again, byte for byte (its tag was valid once).
    ReplayTable,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn entry(rank: u32) -> PeerEntry {
    PeerEntry {
        rank,
        host: HostIdentity::current(),
        address: format!("127.0.0.1:{}", 41000 + rank),
        blob: vec![rank as u8; 8],
    }
}

fn read_exact(s: &mut TcpStream, n: usize) -> Option<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b).ok().map(|()| b)
}

/// Rank 0 to a rank: frames parsed (the challenge and the server proof carry no tag, every
/// later message does), the table changed or followed by a forged one as `tamper` says.
fn downstream(mut from: TcpStream, mut to: TcpStream, tamper: Tamper) {
    loop {
        let Some(header) = read_exact(&mut from, HEADER_LEN) else {
            return;
        };
        let kind = header[5];
        let len = u32::from_be_bytes(header[8..12].try_into().unwrap()) as usize;
        let tagged = !matches!(kind, 1 | 3);
        let Some(mut rest) = read_exact(&mut from, len + if tagged { TAG } else { 0 }) else {
            return;
        };
        let table = kind == 5;
        if table && matches!(tamper, Tamper::RewriteTable) {
            rest[len - 1] ^= 0x5a;
        }
        let mut frame = header.clone();
        frame.extend_from_slice(&rest);
        if to.write_all(&frame).is_err() {
            return;
        }
        if table {
            let forged = |m: Message| {
                let mut f = m.encode().unwrap();
                f.extend_from_slice(&[0xab; TAG]);
                f
            };
            let extra = match tamper {
                Tamper::RewriteTable => None,
                Tamper::ForgeRelease => Some(forged(Message::BarrierRelease { generation: 1 })),
                Tamper::ForgeRankLost => Some(forged(Message::RankLost {
                    rank: 2,
                    reason: "forged by the proxy".into(),
                })),
                Tamper::ReplayTable => Some(frame.clone()),
            };
            if let Some(x) = extra {
                let _ = to.write_all(&x);
            }
        }
    }
}

/// A proxy in front of `upstream`; returns its address.
fn proxy(upstream: String, tamper: Tamper) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    thread::spawn(move || {
        for client in listener.incoming() {
            let Ok(client) = client else { return };
            let server = loop {
                match TcpStream::connect(&upstream) {
                    Ok(s) => break s,
                    Err(_) => thread::sleep(Duration::from_millis(20)),
                }
            };
            let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            thread::spawn(move || {
                let _ = std::io::copy(&mut c2, &mut s2);
                let _ = s2.shutdown(std::net::Shutdown::Both);
            });
            thread::spawn(move || downstream(server, client, tamper));
        }
    });
    addr
}

/// Rank 0 at its own address, ranks 1 and 2 through the proxy; each rank then runs `after`.
fn job_through_proxy<R: Send>(
    tamper: Tamper,
    after: impl Fn(u32, Result<Bootstrap>) -> R + Sync,
) -> Vec<R> {
    let real = format!("127.0.0.1:{}", free_port());
    let via = proxy(real.clone(), tamper);
    let token = JobToken::new("the job's secret");
    thread::scope(|s| {
        let hs: Vec<_> = (0..3u32)
            .map(|r| {
                let addr = if r == 0 { real.clone() } else { via.clone() };
                let (token, after) = (token.clone(), &after);
                s.spawn(move || {
                    let d = Deadline::after(Duration::from_secs(10));
                    after(r, Bootstrap::rendezvous(&addr, r, 3, entry(r), &token, d))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn is_tag_failure(e: &Error) -> bool {
    match e {
        Error::Authenticate { reason, .. } => reason.contains("session tag"),
        Error::RankLost { reason, .. } => reason.contains("session tag"),
        _ => false,
    }
}

#[test]
fn a_rewritten_table_is_refused_by_every_rank_that_receives_it() {
    let got = job_through_proxy(Tamper::RewriteTable, |r, formed| {
        (r, formed.map(|b| b.peers().to_vec()))
    });
    for (r, formed) in &got[1..] {
        match formed {
            Err(e) if is_tag_failure(e) => println!("ON_PATH rewrite: rank {r} refused: {e}"),
            other => panic!("rank {r} took a rewritten table: {other:?}"),
        }
    }
}

#[test]
fn forged_and_replayed_mesh_messages_are_refused_and_never_acted_on() {
    for tamper in [
        Tamper::ForgeRelease,
        Tamper::ForgeRankLost,
        Tamper::ReplayTable,
    ] {
        let got = job_through_proxy(tamper, |r, formed| {
            let job = formed.unwrap_or_else(|e| panic!("{tamper:?}: rank {r} formation: {e}"));
            let outcome = if r == 1 {
                // Ranks 0 and 2 never reach this barrier: only a forged release can end it
                // with Ok.
                job.barrier(Deadline::after(Duration::from_millis(1500)))
            } else {
                thread::sleep(Duration::from_millis(1500));
                Ok(())
            };
            let seen = job.check();
            // Hold the job until every rank looked.
            thread::sleep(Duration::from_millis(800));
            (r, outcome, seen)
        });
        for (r, outcome, seen) in &got {
            println!("ON_PATH {tamper:?}: rank {r}: barrier {outcome:?}, check {seen:?}");
            assert!(
                !(*r == 1 && outcome.is_ok()),
                "{tamper:?}: rank 1's barrier took a forged release"
            );
            if let Err(Error::RankLost { rank, reason }) = seen {
                assert!(
                    !reason.contains("forged by the proxy"),
                    "{tamper:?}: rank {r} believed the forged loss of rank {rank}"
                );
            }
            if *r != 0 {
                // The ranks behind the proxy dropped rank 0's connection at the bad message
                // and say why.
                match seen {
                    Err(e) if is_tag_failure(e) => {}
                    other => panic!("{tamper:?}: rank {r} did not refuse it: {other:?}"),
                }
            }
        }
    }
}

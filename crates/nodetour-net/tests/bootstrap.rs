//! The rendezvous on loopback: jobs that form, and every way one must not (wrong token, world
//! size mismatch, duplicate rank, a rank that never arrives, strangers), and the liveness mesh
//! noticing a rank killed with SIGKILL.

use std::io::Write;
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use nodetour_core::{Deadline, Error, Result};
use nodetour_net::bootstrap::{Bootstrap, HostIdentity, JobToken, PeerEntry};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn entry(rank: u32) -> PeerEntry {
    PeerEntry {
        rank,
        host: HostIdentity::current(),
        address: format!("127.0.0.1:{}", 40000 + rank),
        blob: vec![rank as u8; 8],
    }
}

fn join(addr: &str, rank: u32, world: u32, token: &str, secs: u64) -> Result<Bootstrap> {
    Bootstrap::rendezvous(
        addr,
        rank,
        world,
        entry(rank),
        &JobToken::new(token),
        Deadline::after(Duration::from_secs(secs)),
    )
}

/// Runs ranks 1..world in threads and rank 0 here.
fn job(
    world: u32,
    token_of: impl Fn(u32) -> &'static str + Sync,
    secs: u64,
) -> Vec<Result<Bootstrap>> {
    let addr = format!("127.0.0.1:{}", free_port());
    thread::scope(|s| {
        let others: Vec<_> = (1..world)
            .map(|r| {
                let (addr, token) = (addr.clone(), token_of(r));
                s.spawn(move || join(&addr, r, world, token, secs))
            })
            .collect();
        let mut all = vec![join(&addr, 0, world, token_of(0), secs)];
        all.extend(others.into_iter().map(|h| h.join().unwrap()));
        all
    })
}

#[test]
fn eight_ranks_form_a_job_and_agree_on_the_table() {
    let all = job(8, |_| "tok", 20);
    let jobs: Vec<Bootstrap> = all.into_iter().map(|r| r.unwrap()).collect();
    for (r, j) in jobs.iter().enumerate() {
        assert_eq!((j.rank(), j.world_size()), (r as u32, 8));
        assert_eq!(j.peers(), jobs[0].peers());
        assert_eq!(j.peers()[5].blob, vec![5u8; 8]);
        j.check().unwrap();
    }
    // Leaving on purpose is not a loss.
    drop(jobs);
}

#[test]
fn a_wrong_token_is_refused_and_its_rank_never_arrives() {
    let all = job(3, |r| if r == 2 { "guess" } else { "tok" }, 3);
    match &all[2] {
        Err(Error::Authenticate { reason, .. }) => assert!(reason.contains("token"), "{reason}"),
        other => panic!("{:?}", other.as_ref().err()),
    }
    match &all[0] {
        // Rank 0's own deadline passed: a timeout naming who never came.
        Err(Error::Timeout { what, .. }) => assert!(what.contains("rank(s) 2"), "{what}"),
        other => panic!("{:?}", other.as_ref().err()),
    }
    assert!(
        matches!(&all[1], Err(Error::Rendezvous { reason }) if reason.contains("never arrived")),
        "{:?}",
        all[1].as_ref().err()
    );
}

#[test]
fn a_rendezvous_without_the_token_is_not_trusted() {
    // Rank 0 has another token: the client refuses rank 0 too (mutual authentication).
    let all = job(2, |r| if r == 0 { "other" } else { "tok" }, 3);
    assert!(
        matches!(&all[1], Err(Error::Authenticate { .. })),
        "{:?}",
        all[1].as_ref().err()
    );
    assert!(all[0].is_err());
}

#[test]
fn world_size_mismatch_and_duplicate_ranks_are_refused() {
    let addr = format!("127.0.0.1:{}", free_port());
    let (r0, r1, bad_world, dup) = thread::scope(|s| {
        let a = addr.clone();
        let r0 = s.spawn(move || join(&a, 0, 2, "t", 4));
        thread::sleep(Duration::from_millis(100));
        let a = addr.clone();
        let bad_world = s.spawn(move || {
            Bootstrap::rendezvous(
                &a,
                1,
                3,
                entry(1),
                &JobToken::new("t"),
                Deadline::after(Duration::from_secs(4)),
            )
        });
        let bad_world = bad_world.join().unwrap();
        let a = addr.clone();
        let r1 = s.spawn(move || join(&a, 1, 2, "t", 4));
        let r1 = r1.join().unwrap();
        // The job is formed: a second rank 1 finds nobody listening any more, or is refused.
        let a = addr.clone();
        let dup = s.spawn(move || join(&a, 1, 2, "t", 1)).join().unwrap();
        (r0.join().unwrap(), r1, bad_world, dup)
    });
    match bad_world {
        Err(Error::Rendezvous { reason }) => assert!(
            reason.contains("world size mismatch: rank 0 has 2"),
            "{reason}"
        ),
        other => panic!("{:?}", other.err()),
    }
    r0.unwrap();
    r1.unwrap();
    assert!(dup.is_err());
}

#[test]
fn a_duplicate_rank_during_the_rendezvous_is_refused() {
    let addr = format!("127.0.0.1:{}", free_port());
    let results = thread::scope(|s| {
        let a = addr.clone();
        let r0 = s.spawn(move || join(&a, 0, 3, "t", 4));
        thread::sleep(Duration::from_millis(100));
        let a = addr.clone();
        let first = s.spawn(move || join(&a, 1, 3, "t", 4));
        thread::sleep(Duration::from_millis(300));
        let a = addr.clone();
        let second = s.spawn(move || join(&a, 1, 3, "t", 4));
        thread::sleep(Duration::from_millis(300));
        let a = addr.clone();
        let r2 = s.spawn(move || join(&a, 2, 3, "t", 4));
        [
            r0.join().unwrap(),
            first.join().unwrap(),
            second.join().unwrap(),
            r2.join().unwrap(),
        ]
    });
    match &results[2] {
        Err(Error::Rendezvous { reason }) => {
            assert!(reason.contains("rank 1 already joined"), "{reason}")
        }
        other => panic!("{:?}", other.as_ref().err()),
    }
    assert!(results[0].is_ok() && results[1].is_ok() && results[3].is_ok());
}

#[test]
fn strangers_are_dropped_and_the_job_still_forms() {
    let addr = format!("127.0.0.1:{}", free_port());
    let all = thread::scope(|s| {
        let a = addr.clone();
        let r0 = s.spawn(move || join(&a, 0, 2, "t", 10));
        thread::sleep(Duration::from_millis(100));
        // A port scanner and an HTTP client.
        drop(TcpStream::connect(&addr).unwrap());
        let mut http = TcpStream::connect(&addr).unwrap();
        let _ = http.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
        let a = addr.clone();
        let r1 = s.spawn(move || join(&a, 1, 2, "t", 10));
        [r0.join().unwrap(), r1.join().unwrap()]
    });
    assert!(all.iter().all(|r| r.is_ok()));
}

#[test]
fn a_flood_of_silent_connections_holds_a_bounded_number_of_handshakes_and_the_job_forms() {
    let addr = format!("127.0.0.1:{}", free_port());
    let threads = || std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    let all = thread::scope(|s| {
        let a = addr.clone();
        let r0 = s.spawn(move || join(&a, 0, 2, "t", 60));
        thread::sleep(Duration::from_millis(200));
        let before = threads();
        // 150 connections that never say a word, then the real rank.
        let silent: Vec<TcpStream> = (0..150)
            .filter_map(|_| TcpStream::connect(&addr).ok())
            .collect();
        thread::sleep(Duration::from_millis(500));
        let during = threads();
        assert!(
            during <= before + 64 + 4,
            "{during} threads with 150 silent connections ({before} before): handshakes are bounded"
        );
        let t = Instant::now();
        let a = addr.clone();
        let r1 = s.spawn(move || join(&a, 1, 2, "t", 60));
        let out = [r0.join().unwrap(), r1.join().unwrap()];
        // Silent connections are dropped after 2 s each, 64 at a time.
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "formed after {:?}",
            t.elapsed()
        );
        drop(silent);
        out
    });
    assert!(all.iter().all(|r| r.is_ok()));
}

#[test]
fn a_peer_that_announces_a_large_message_before_proving_the_token_is_cut_off() {
    use std::io::Read;
    let addr = format!("127.0.0.1:{}", free_port());
    thread::scope(|s| {
        let a = addr.clone();
        let r0 = s.spawn(move || join(&a, 0, 2, "t", 5));
        thread::sleep(Duration::from_millis(200));
        let mut c = TcpStream::connect(&addr).unwrap();
        let mut challenge = [0u8; 64];
        let _ = c.read(&mut challenge).unwrap();
        // A header that claims 4 MiB of Hello (magic, version, kind, length as the wire has
        // them): refused on the header, before a byte of it is read or allocated.
        let header = nodetour_net::bootstrap::wire::Message::Hello {
            rank: 1,
            world_size: 2,
            proof: [0; 32],
            nonce: [0; 32],
        }
        .encode()
        .unwrap();
        let mut big = header[..nodetour_net::bootstrap::wire::HEADER_LEN].to_vec();
        let n = big.len();
        big[n - 4..].copy_from_slice(&(4u32 << 20).to_be_bytes());
        let t = Instant::now();
        c.write_all(&big).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut rest = [0u8; 16];
        let closed = matches!(c.read(&mut rest), Ok(0) | Err(_));
        assert!(
            closed && t.elapsed() < Duration::from_secs(2),
            "cut off at once"
        );
        // Rank 0 goes on waiting for the real rank 1, and times out cleanly.
        assert!(r0.join().unwrap().is_err());
    });
}

#[test]
fn nobody_at_the_rendezvous_times_out() {
    let addr = format!("127.0.0.1:{}", free_port());
    let start = Instant::now();
    assert!(matches!(
        join(&addr, 1, 2, "t", 1),
        Err(Error::Timeout { .. })
    ));
    assert!(start.elapsed() < Duration::from_secs(5));
}

/// Child mode: `CHILD_RANK=r CHILD_ADDR=a CHILD_WORLD=n` joins and then sleeps until killed.
#[test]
fn child_rank() {
    let (Ok(rank), Ok(addr), Ok(world)) = (
        std::env::var("CHILD_RANK"),
        std::env::var("CHILD_ADDR"),
        std::env::var("CHILD_WORLD"),
    ) else {
        return; // not a child: nothing to do
    };
    let job = join(
        &addr,
        rank.parse().unwrap(),
        world.parse().unwrap(),
        "t",
        20,
    )
    .unwrap();
    println!("CHILD JOINED");
    thread::sleep(Duration::from_secs(60));
    drop(job);
}

#[test]
fn a_rank_killed_after_the_rendezvous_is_reported_to_every_rank() {
    if std::env::var("CHILD_RANK").is_ok() {
        return;
    }
    let addr = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_rank",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("CHILD_RANK", "2")
        .env("CHILD_ADDR", &addr)
        .env("CHILD_WORLD", "3")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let jobs = thread::scope(|s| {
        let a = addr.clone();
        let r1 = s.spawn(move || join(&a, 1, 3, "t", 20));
        let r0 = join(&addr, 0, 3, "t", 20);
        [r0.unwrap(), r1.join().unwrap().unwrap()]
    });
    let killed_at = Instant::now();
    // SIGKILL (std's kill on Unix): the child gets no chance to say goodbye.
    child.kill().expect("kill the child rank");
    let _ = child.wait();
    for j in &jobs {
        let lost = j.wait_for_loss(Deadline::after(Duration::from_secs(10)));
        let (rank, reason) = lost.expect("the loss is noticed");
        assert_eq!(rank, 2, "{reason}");
        assert!(matches!(j.check(), Err(Error::RankLost { rank: 2, .. })));
    }
    assert!(
        killed_at.elapsed() < Duration::from_secs(3),
        "noticed at once, not after a timeout: {:?}",
        killed_at.elapsed()
    );
}

#[test]
fn barriers_hold_every_rank_until_the_last_arrives() {
    let jobs: Vec<Bootstrap> = job(4, |_| "t", 20)
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let start = Instant::now();
    thread::scope(|s| {
        for (i, j) in jobs.iter().enumerate() {
            s.spawn(move || {
                for round in 0..3u64 {
                    if i == 3 {
                        thread::sleep(Duration::from_millis(100)); // the laggard
                    }
                    j.barrier(Deadline::after(Duration::from_secs(10))).unwrap();
                    assert!(
                        start.elapsed() >= Duration::from_millis(100 * (round + 1)),
                        "released before the laggard arrived"
                    );
                }
            });
        }
    });
    // A barrier some rank never reaches times out.
    assert!(matches!(
        jobs[1].barrier(Deadline::after(Duration::from_millis(200))),
        Err(Error::Timeout { .. })
    ));
}

#[test]
fn a_rank_that_dies_during_the_handshake_never_arrives_and_nobody_hangs() {
    use std::io::Read;
    let addr = format!("127.0.0.1:{}", free_port());
    let results = thread::scope(|s| {
        let a = addr.clone();
        let r0 = s.spawn(move || join(&a, 0, 3, "t", 3));
        let a = addr.clone();
        let r1 = s.spawn(move || join(&a, 1, 3, "t", 3));
        thread::sleep(Duration::from_millis(200));
        // "Rank 2" connects, reads the challenge, and dies before answering.
        let mut dying = TcpStream::connect(&addr).unwrap();
        let mut challenge = [0u8; 44];
        let _ = dying.read_exact(&mut challenge);
        drop(dying);
        [r0.join().unwrap(), r1.join().unwrap()]
    });
    for (i, r) in results.iter().enumerate() {
        match r {
            // Rank 0's deadline passed; rank 1 hears why.
            Err(Error::Timeout { what, .. }) if i == 0 => {
                assert!(what.contains("rank(s) 2"), "{what}")
            }
            Err(Error::Rendezvous { reason }) if i == 1 => {
                assert!(reason.contains("rank(s) 2 never arrived"), "{reason}")
            }
            other => panic!("{:?}", other.as_ref().err()),
        }
    }
}

/// Under a sharing policy each rank receives the addresses of the ranks named for it only (and
/// its own); every other entry comes without its address, host and blob intact.
#[test]
fn a_sharing_policy_gives_each_rank_only_its_neighbours_addresses() {
    let world = 5u32;
    let addr = format!("127.0.0.1:{}", free_port());
    // Rank r gets rank r + 1's address.
    let share = |t: &[PeerEntry]| -> Vec<Vec<u32>> {
        let n = t.len() as u32;
        (0..n).map(|r| vec![(r + 1) % n]).collect()
    };
    let jobs: Vec<Bootstrap> = thread::scope(|s| {
        let handles: Vec<_> = (0..world)
            .map(|r| {
                let addr = addr.clone();
                let share = &share;
                s.spawn(move || {
                    Bootstrap::rendezvous_sharing(
                        &addr,
                        r,
                        world,
                        entry(r),
                        &JobToken::new("sharing"),
                        Deadline::after(Duration::from_secs(20)),
                        Some(share),
                    )
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for job in &jobs {
        let r = job.rank();
        for e in job.peers() {
            let visible = e.rank == r || e.rank == (r + 1) % world;
            assert_eq!(
                !e.address.is_empty(),
                visible,
                "rank {r} sees rank {}'s address: {:?}",
                e.rank,
                e.address
            );
            if visible {
                assert_eq!(e.address, entry(e.rank).address);
            }
            assert_eq!(e.blob, entry(e.rank).blob);
            assert_eq!(e.host, entry(e.rank).host);
        }
    }
}

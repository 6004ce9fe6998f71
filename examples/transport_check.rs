//! Transport check: N processes form a job (torchrun-style environment, see
//! `scripts/launch-local.sh`), connect every pair over the chosen transport, write a distinct
//! pattern into every peer's granted slot region with a notification, verify everything they
//! received, and exit cleanly.
//!
//! ```text
//! scripts/launch-local.sh -n 4 -- target/release/examples/transport_check
//! scripts/launch-local.sh -n 2 -- target/release/examples/transport_check --bench 268435456
//! ```
//! `--bench BYTES` (2 ranks): rank 1 writes BYTES into rank 0 over the transport and, alternating,
//! over a plain TCP stream between the same two processes (the reference: `write_all` of a buffer
//! into one socket, `read_exact` on the other side), 5 times each; rank 1 prints the medians and
//! the ratio. `--kill-rank R` makes rank R exit abruptly after the rendezvous (SIGKILL-like) to
//! show that the others report it lost instead of hanging.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use nodetour_core::bootstrap::{Bootstrap, HostIdentity, JobToken, LaunchInfo, PeerEntry};
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::tcp::{self, TcpConnection, TcpEndpoint};
use nodetour_core::transport::{Event, HostConnection, SlotGrant, SlotRegion};
use nodetour_core::{Config, Deadline};

#[derive(Parser)]
#[command(about = "Connect every pair of ranks over a transport, write, verify")]
struct Args {
    /// Bytes each rank writes into each peer.
    #[arg(long, default_value_t = 4 << 20)]
    size: usize,
    /// Measure BYTES over the transport against a plain TCP stream (2 ranks).
    #[arg(long)]
    bench: Option<usize>,
    /// This rank exits abruptly right after the rendezvous.
    #[arg(long)]
    kill_rank: Option<u32>,
}

fn pattern(from: u32, to: u32, i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ (from * 31 + to * 7) as u8
}

fn main() -> ExitCode {
    nodetour::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transport_check: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Grants announced in the bootstrap blob: for every rank r, the key and length of the region
/// this rank lets r write; then a port for the plain-TCP reference (0 if none).
fn encode_blob(grants: &[SlotGrant], bench_port: u16) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(grants.len() as u32).to_be_bytes());
    for g in grants {
        b.extend_from_slice(&g.encode());
    }
    b.extend_from_slice(&bench_port.to_be_bytes());
    b
}

fn decode_blob(b: &[u8]) -> anyhow::Result<(Vec<SlotGrant>, u16)> {
    let n = u32::from_be_bytes(b.get(..4).context("short blob")?.try_into()?) as usize;
    let len = SlotGrant::ENCODED_LEN;
    let mut grants = Vec::with_capacity(n);
    for i in 0..n {
        grants.push(SlotGrant::decode(
            b.get(4 + i * len..4 + (i + 1) * len)
                .context("short blob")?,
        )?);
    }
    let at = 4 + n * len;
    let port = u16::from_be_bytes(b.get(at..at + 2).context("short blob")?.try_into()?);
    Ok((grants, port))
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::from_env()?;
    let info = LaunchInfo::from_env()?;
    let token = JobToken::from_env();
    let (me, world) = (info.rank, info.world_size);
    let size = args.bench.unwrap_or(args.size);
    if args.bench.is_some() && world != 2 {
        bail!("--bench runs with exactly 2 ranks");
    }
    // One receive region per peer, created and announced before the rendezvous.
    let recv: Vec<SlotRegion> = (0..world)
        .map(|_| HostBuffer::new(size).map(SlotRegion::host))
        .collect::<Result<_, _>>()?;
    let grants: Vec<SlotGrant> = recv
        .iter()
        .map(|r| SlotGrant {
            key: r.key(),
            len: r.len() as u64,
            remote: None,
        })
        .collect();
    let endpoint = TcpEndpoint::bind("0.0.0.0:0", token.clone(), config.timeout)?;
    let host_ip = nodetour_core::bootstrap::host::local_ip_towards(&info.master_addr, info.port);
    let address = format!("{host_ip}:{}", endpoint.local_addr()?.port());
    let reference = (args.bench.is_some() && me == 0)
        .then(|| TcpListener::bind("0.0.0.0:0"))
        .transpose()?;
    let bench_port = reference
        .as_ref()
        .map_or(Ok(0), |l| l.local_addr().map(|a| a.port()))?;
    let entry = PeerEntry {
        rank: me,
        host: HostIdentity::current(),
        address,
        blob: encode_blob(&grants, bench_port),
    };
    let deadline = Deadline::after(config.timeout);
    let job = Bootstrap::rendezvous(&info.rendezvous_addr(), me, world, entry, &token, deadline)?;
    if args.kill_rank == Some(me) {
        println!("rank {me}: exiting abruptly after the rendezvous");
        std::process::abort();
    }

    // Every pair connects once: the higher rank dials the lower.
    let lower: Vec<u32> = (0..me).collect();
    let higher: Vec<u32> = (me + 1..world).collect();
    let grants = |p: u32| vec![recv[p as usize].clone()];
    let alive = || job.check();
    let mut conns: HashMap<u32, TcpConnection> = std::thread::scope(|s| -> anyhow::Result<_> {
        let accepting = s.spawn(|| endpoint.accept(&higher, world, &grants, &alive, deadline));
        let mut out = HashMap::new();
        for &p in &lower {
            let addr = &job.peers()[p as usize].address;
            out.insert(
                p,
                tcp::connect(
                    addr,
                    me,
                    world,
                    &token,
                    &grants(p),
                    &alive,
                    config.timeout,
                    deadline,
                )?,
            );
        }
        out.extend(accepting.join().expect("accept thread")?);
        Ok(out)
    })?;
    let mut theirs: HashMap<u32, SlotGrant> = HashMap::new();
    for &p in conns.keys() {
        let (peer_grants, _) = decode_blob(&job.peers()[p as usize].blob)?;
        theirs.insert(
            p,
            *peer_grants
                .get(me as usize)
                .context("the peer announced no region for us")?,
        );
    }
    if let Some(bytes) = args.bench {
        let port = decode_blob(&job.peers()[0].blob)?.1;
        return bench(
            me,
            bytes,
            conns,
            theirs,
            &recv,
            reference,
            &job.peers()[0].address,
            port,
            &config,
            &job,
        );
    }

    let send = SlotRegion::host(HostBuffer::new(size)?);
    let start = Instant::now();
    let mut peers: Vec<u32> = conns.keys().copied().collect();
    peers.sort();
    for &p in &peers {
        let data: Vec<u8> = (0..size).map(|i| pattern(me, p, i)).collect();
        send.write_at(0, &data)?;
        conns
            .get_mut(&p)
            .expect("connected")
            .write(&send, 0..size, &theirs[&p], 0, Some(me))?;
    }
    for &p in &peers {
        let mut events = Vec::new();
        while !events.contains(&Event::Notified(p)) {
            job.check()?;
            conns
                .get_mut(&p)
                .expect("connected")
                .wait(&mut events, Deadline::after(config.timeout))?;
        }
        let mut got = vec![0u8; size];
        recv[p as usize].read_at(0, &mut got)?;
        if let Some(bad) = got
            .iter()
            .enumerate()
            .position(|(i, b)| *b != pattern(p, me, i))
        {
            bail!("data from rank {p} is corrupted at byte {bad}");
        }
    }
    job.check()?;
    println!(
        "TRANSPORT OK rank={me} world={world} transport=tcp peers={} bytes_per_peer={size} verified seconds={:.3}",
        peers.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bench(
    me: u32,
    bytes: usize,
    mut conns: HashMap<u32, TcpConnection>,
    theirs: HashMap<u32, SlotGrant>,
    recv: &[SlotRegion],
    reference: Option<TcpListener>,
    rank0: &str,
    port: u16,
    config: &Config,
    job: &Bootstrap,
) -> anyhow::Result<()> {
    let peer = 1 - me;
    let conn = conns.get_mut(&peer).context("connected")?;
    let runs = 5;
    let mut plain = match reference {
        Some(l) => l.accept()?.0,
        None => TcpStream::connect(format!(
            "{}:{port}",
            rank0.rsplit_once(':').map_or(rank0, |x| x.0)
        ))?,
    };
    plain.set_nodelay(true)?;
    let send = SlotRegion::host(HostBuffer::new(bytes)?);
    send.write_at(0, &vec![0x5a; bytes])?;
    let mut buf = vec![0x5a_u8; bytes];
    let (mut ours, mut refs) = (Vec::new(), Vec::new());
    let wait_for = |conn: &mut TcpConnection, v: u32| -> anyhow::Result<()> {
        let mut ev = Vec::new();
        while !ev.contains(&Event::Notified(v)) {
            conn.wait(&mut ev, Deadline::after(config.timeout))?;
        }
        Ok(())
    };
    for run in 0..runs {
        let v = 1000 + run as u32;
        if me == 1 {
            let t = Instant::now();
            conn.write(&send, 0..bytes, &theirs[&peer], 0, Some(v))?;
            wait_for(conn, v)?; // the receiver's acknowledgement
            ours.push(t.elapsed().as_secs_f64());
            let t = Instant::now();
            plain.write_all(&buf)?;
            let mut ack = [0u8; 1];
            plain.read_exact(&mut ack)?;
            refs.push(t.elapsed().as_secs_f64());
        } else {
            wait_for(conn, v)?;
            conn.write(&recv[peer as usize], 0..1, &theirs[&peer], 0, Some(v))?;
            plain.read_exact(&mut buf)?;
            plain.write_all(&[1])?;
        }
    }
    job.check()?;
    if me == 1 {
        let median = |mut v: Vec<f64>| {
            v.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
            v[v.len() / 2]
        };
        let (o, r) = (
            bytes as f64 / median(ours) / 1e9,
            bytes as f64 / median(refs) / 1e9,
        );
        println!(
            "TCP_BENCH bytes={bytes} runs={runs} nodetour_tcp_GBps={o:.2} plain_tcp_stream_GBps={r:.2} ratio={:.2}",
            o / r
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    Ok(())
}

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
use std::sync::Arc;

use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::transport::{
    self, Event, HostConnection, PairFacts, SlotGrant, SlotRegion, TransportKind,
};
use nodetour_core::verbs::{Access, EndpointDescription, MemoryRegion, Near, PathOptions};
use nodetour_core::{Config, Deadline};
use nodetour_net::bootstrap::{Bootstrap, HostIdentity, LaunchInfo, PeerEntry};
use nodetour_tools::link::LocalSide;

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
    /// tcp or verbs (default: NODETOUR_TRANSPORT, else tcp).
    #[arg(long)]
    transport: Option<String>,
    /// RDMA devices to spread the ranks over (rank r takes device r mod n), comma-separated.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
}

fn pattern(from: u32, to: u32, i: usize) -> u8 {
    ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ (from * 31 + to * 7) as u8
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("transport_check: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// What each rank announces in its bootstrap blob: for every rank r, the grant of the region
/// this rank lets r write and (verbs) the endpoint of the queue pair it made for r; then a port
/// for the plain-TCP reference (0 if none).
fn encode_blob(grants: &[SlotGrant], endpoints: &[Vec<u8>], bench_port: u16) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&(grants.len() as u32).to_be_bytes());
    for (g, e) in grants.iter().zip(endpoints) {
        b.extend_from_slice(&g.encode());
        b.extend_from_slice(&(e.len() as u16).to_be_bytes());
        b.extend_from_slice(e);
    }
    b.extend_from_slice(&bench_port.to_be_bytes());
    b
}

/// The grant and endpoint rank `owner` announced for rank `me`, and its bench port.
fn decode_blob(b: &[u8], me: u32) -> anyhow::Result<(SlotGrant, Vec<u8>, u16)> {
    let take = |at: &mut usize, n: usize| -> anyhow::Result<&[u8]> {
        let s = b.get(*at..*at + n).context("short blob")?;
        *at += n;
        Ok(s)
    };
    let mut at = 0;
    let n = u32::from_be_bytes(take(&mut at, 4)?.try_into()?);
    let mut mine = None;
    for r in 0..n {
        let g = SlotGrant::decode(take(&mut at, SlotGrant::ENCODED_LEN)?)?;
        let len = u16::from_be_bytes(take(&mut at, 2)?.try_into()?) as usize;
        let e = take(&mut at, len)?.to_vec();
        if r == me {
            mine = Some((g, e));
        }
    }
    let port = u16::from_be_bytes(take(&mut at, 2)?.try_into()?);
    let (g, e) = mine.context("the peer announced nothing for us")?;
    Ok((g, e, port))
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::from_env()?;
    let info = LaunchInfo::from_env()?;
    let token = nodetour_net::bootstrap::job_token(&info)?;
    let (me, world) = (info.rank, info.world_size);
    let size = args.bench.unwrap_or(args.size);
    if args.bench.is_some() && world != 2 {
        bail!("--bench runs with exactly 2 ranks");
    }
    let kind = match args
        .transport
        .clone()
        .or_else(|| std::env::var("NODETOUR_TRANSPORT").ok())
        .as_deref()
    {
        None | Some("tcp") | Some("auto") => TransportKind::Tcp,
        Some("verbs") => TransportKind::Verbs,
        Some(other) => bail!("transport_check speaks tcp and verbs, not {other}"),
    };
    // Verbs: this rank's device, port, GID and protection domain, and a queue pair per peer, all
    // made before the rendezvous so their endpoints go in the blob.
    let local = match kind {
        TransportKind::Verbs => {
            let mut cfg = config.clone();
            if !args.devices.is_empty() {
                cfg.ib_device = Some(args.devices[me as usize % args.devices.len()].clone());
            }
            Some(LocalSide::open(&cfg, Near::Host)?)
        }
        _ => None,
    };
    let mut prepared: Vec<Option<PreparedVerbs>> = (0..world).map(|_| None).collect();
    let mut endpoints: Vec<Vec<u8>> = vec![Vec::new(); world as usize];
    if let Some(l) = &local {
        for p in (0..world).filter(|p| *p != me) {
            let (q, e) = nodetour_core::transport::verbs::PreparedVerbs::for_peer(l)?;
            endpoints[p as usize] = e;
            prepared[p as usize] = Some(q);
        }
    }
    // One receive region per peer, created and announced before the rendezvous.
    let region = |len: usize| -> anyhow::Result<SlotRegion> {
        let buf = HostBuffer::new(len)?;
        Ok(match &local {
            Some(l) => SlotRegion::registered(Arc::new(MemoryRegion::register(
                &l.pd,
                buf,
                Access::REMOTE,
            )?)),
            None => SlotRegion::host(buf),
        })
    };
    let recv: Vec<SlotRegion> = (0..world)
        .map(|_| region(size))
        .collect::<anyhow::Result<_>>()?;
    let grants: Vec<SlotGrant> = recv
        .iter()
        .map(|r| SlotGrant {
            key: r.key(),
            len: r.len() as u64,
            remote: r.remote(),
        })
        .collect();
    let endpoint = TcpEndpoint::bind("0.0.0.0:0", token.clone(), config.timeout)?;
    let host_ip = nodetour_net::bootstrap::host::local_ip_towards(&info.master_addr, info.port);
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
        blob: encode_blob(&grants, &endpoints, bench_port),
    };
    let deadline = Deadline::after(config.timeout);
    let job = Bootstrap::rendezvous(&info.rendezvous_addr(), me, world, entry, &token, deadline)?;
    if args.kill_rank == Some(me) {
        println!("rank {me}: exiting abruptly after the rendezvous");
        std::process::abort();
    }

    // What the automatic choice would be for each pair, and why, beside what this example runs
    // (it moves host memory over tcp or verbs; the in-host GPU transports are exercised by
    // gpu_transport_check).
    let me_host = HostIdentity::current();
    for p in (0..world).filter(|p| *p != me) {
        let peer_host = &job.peers()[p as usize].host;
        let facts = PairFacts {
            same_host: me_host.same_host(peer_host),
            shares_memory: me_host.shares_memory(peer_host),
            gpu_peer_access: false,
            both_have_rdma: kind == TransportKind::Verbs,
        };
        let auto = transport::choose(
            &facts,
            transport::forced(&nodetour::core::knobs::Env::process())?,
        );
        tracing::info!(peer = p, chosen = %auto.kind, reason = %auto.reason, running = %kind, "transport for this pair");
    }
    let mut theirs: HashMap<u32, SlotGrant> = HashMap::new();
    let mut conns: HashMap<u32, Box<dyn HostConnection>> = HashMap::new();
    for p in (0..world).filter(|p| *p != me) {
        let (grant, endpoint, _) = decode_blob(&job.peers()[p as usize].blob, me)?;
        theirs.insert(p, grant);
        if let (Some(l), Some(q)) = (&local, prepared[p as usize].take()) {
            let remote = EndpointDescription::decode(&endpoint)?.endpoint;
            let path = PathOptions::new(l.port.port, &l.gid, &config);
            conns.insert(
                p,
                Box::new(q.connect(&remote, &path, format!("rank {p}"), config.timeout)?),
            );
        }
    }
    if kind == TransportKind::Verbs {
        // Every queue pair is connected before anyone writes.
        job.barrier(deadline)?;
    } else {
        // Every pair connects once: the higher rank dials the lower. Connections start with the
        // peer's region granted (it learned the grant from the bootstrap and may write at once).
        let grants = |p: u32| vec![recv[p as usize].clone()];
        let alive = || job.check();
        let peers: Vec<u32> = (0..world).filter(|p| *p != me).collect();
        let address = |p: u32| job.peers()[p as usize].address.clone();
        let tcp_conns =
            endpoint.connect_mesh(&peers, me, world, &address, &grants, &alive, deadline)?;
        conns.extend(
            tcp_conns
                .into_iter()
                .map(|(p, c)| (p, Box::new(c) as Box<dyn HostConnection>)),
        );
    }
    if let Some(bytes) = args.bench {
        let port = if me == 0 {
            0
        } else {
            decode_blob(&job.peers()[0].blob, me)?.2
        };
        let send = region(bytes)?;
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
            send,
        );
    }

    let send = region(size)?;
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
        "TRANSPORT OK rank={me} world={world} transport={kind} peers={} bytes_per_peer={size} verified seconds={:.3}",
        peers.len(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn bench(
    me: u32,
    bytes: usize,
    mut conns: HashMap<u32, Box<dyn HostConnection>>,
    theirs: HashMap<u32, SlotGrant>,
    recv: &[SlotRegion],
    reference: Option<TcpListener>,
    rank0: &str,
    port: u16,
    config: &Config,
    job: &Bootstrap,
    send: SlotRegion,
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
    send.write_at(0, &vec![0x5a; bytes])?;
    let mut buf = vec![0x5a_u8; bytes];
    let (mut ours, mut refs) = (Vec::new(), Vec::new());
    let wait_for = |conn: &mut Box<dyn HostConnection>, v: u32| -> anyhow::Result<()> {
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
            "{}_BENCH bytes={bytes} runs={runs} nodetour_GBps={o:.2} plain_tcp_stream_GBps={r:.2} ratio={:.2}",
            conn.kind().to_string().to_uppercase(),
            o / r
        );
    }
    std::thread::sleep(Duration::from_millis(100));
    Ok(())
}

//! Ring allreduce of host buffers between N processes over tcp or verbs, checked against a
//! float64 reference on every rank, for every data type and operation (or one of each).
//!
//! ```text
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check
//! # inside the soft-RoCE VM:
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --transport verbs --devices rxe0,rxe1
//! ```
//! Prints `ALLREDUCE OK rank=.. world=.. transport=.. cases=..` per rank, or fails naming the
//! first mismatch.

use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context as _, bail};
use clap::Parser;
use half::{bf16, f16};
use nodetour::link::LocalSide;
use nodetour_core::bootstrap::{Bootstrap, HostIdentity, JobToken, LaunchInfo, PeerEntry};
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::tcp::{self, TcpConnection, TcpEndpoint};
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::transport::{HostConnection, SlotGrant, SlotRegion};
use nodetour_core::verbs::{
    Access, EndpointDescription, MemoryRegion, Near, PathOptions, QueuePairOptions,
};
use nodetour_core::{Config, Deadline};
use nodetour_ring::host::{HostRing, HostRingOptions, Links};
use nodetour_ring::{DataType, ReduceOp};

#[derive(Parser)]
#[command(about = "Ring allreduce of host buffers across processes, checked against float64")]
struct Args {
    /// tcp or verbs.
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// RDMA devices to spread the ranks over (rank r takes device r mod n).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Elements per buffer.
    #[arg(long, default_value_t = 100_003)]
    count: usize,
    /// Bytes per slot.
    #[arg(long, default_value_t = 64 << 10)]
    slot_bytes: usize,
    /// Run every type and operation (else f32 sum and i64 max).
    #[arg(long)]
    all: bool,
}

const TYPES: [DataType; 7] = [
    DataType::F32,
    DataType::F64,
    DataType::F16,
    DataType::Bf16,
    DataType::I32,
    DataType::I64,
    DataType::U8,
];
const OPS: [ReduceOp; 5] = [
    ReduceOp::Sum,
    ReduceOp::Prod,
    ReduceOp::Min,
    ReduceOp::Max,
    ReduceOp::Avg,
];

fn value(dtype: DataType, rank: u32, i: usize) -> f64 {
    let v = ((i as u32).wrapping_add(rank * 7) % 3) as f64;
    if dtype == DataType::U8 { v } else { v - 1.0 }
}

fn encode(dtype: DataType, v: f64, out: &mut Vec<u8>) {
    match dtype {
        DataType::F32 => out.extend_from_slice(&(v as f32).to_ne_bytes()),
        DataType::F64 => out.extend_from_slice(&v.to_ne_bytes()),
        DataType::F16 => out.extend_from_slice(&f16::from_f64(v).to_ne_bytes()),
        DataType::Bf16 => out.extend_from_slice(&bf16::from_f64(v).to_ne_bytes()),
        DataType::I32 => out.extend_from_slice(&(v as i32).to_ne_bytes()),
        DataType::I64 => out.extend_from_slice(&(v as i64).to_ne_bytes()),
        DataType::U8 => out.push(v as u8),
    }
}

fn decode(dtype: DataType, b: &[u8]) -> f64 {
    match dtype {
        DataType::F32 => f64::from(f32::from_ne_bytes(b.try_into().expect("4 bytes"))),
        DataType::F64 => f64::from_ne_bytes(b.try_into().expect("8 bytes")),
        DataType::F16 => f16::from_ne_bytes(b.try_into().expect("2 bytes")).to_f64(),
        DataType::Bf16 => bf16::from_ne_bytes(b.try_into().expect("2 bytes")).to_f64(),
        DataType::I32 => f64::from(i32::from_ne_bytes(b.try_into().expect("4 bytes"))),
        DataType::I64 => i64::from_ne_bytes(b.try_into().expect("8 bytes")) as f64,
        DataType::U8 => f64::from(b[0]),
    }
}

fn reference(dtype: DataType, op: ReduceOp, world: u32, i: usize) -> f64 {
    let vals = (0..world).map(|r| value(dtype, r, i));
    let r = match op {
        ReduceOp::Sum | ReduceOp::Avg => vals.sum(),
        ReduceOp::Prod => vals.product(),
        ReduceOp::Min => vals.fold(f64::INFINITY, f64::min),
        ReduceOp::Max => vals.fold(f64::NEG_INFINITY, f64::max),
    };
    match (op, dtype) {
        (ReduceOp::Avg, DataType::I32 | DataType::I64 | DataType::U8) => {
            (r / f64::from(world)).trunc()
        }
        (ReduceOp::Avg, _) => r / f64::from(world),
        _ => r,
    }
}

fn tolerance(dtype: DataType) -> f64 {
    match dtype {
        DataType::F16 => 2e-3,
        DataType::Bf16 => 1e-2,
        DataType::F32 => 1e-6,
        _ => 0.0,
    }
}

fn main() -> ExitCode {
    nodetour::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce_check: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::from_env()?;
    let info = LaunchInfo::from_env()?;
    let token = JobToken::from_env();
    let (me, world) = (info.rank, info.world_size);
    let (next, prev) = ((me + 1) % world, (me + world - 1) % world);
    let verbs = match args.transport.as_str() {
        "tcp" => false,
        "verbs" => true,
        other => bail!("allreduce_check speaks tcp and verbs, not {other}"),
    };
    let options = HostRingOptions {
        slot_bytes: args.slot_bytes,
        slots: 4,
        timeout: config.timeout,
    };
    let local = if verbs {
        let mut cfg = config.clone();
        if !args.devices.is_empty() {
            cfg.ib_device = Some(args.devices[me as usize % args.devices.len()].clone());
        }
        Some(LocalSide::open(&cfg, Near::Host)?)
    } else {
        None
    };
    let region = |len: usize| -> anyhow::Result<SlotRegion> {
        let buf = HostBuffer::new(len.max(4096))?;
        Ok(match &local {
            Some(l) => SlotRegion::registered(Arc::new(MemoryRegion::register(
                &l.pd,
                buf,
                Access::REMOTE,
            )?)),
            None => SlotRegion::host(buf),
        })
    };
    let recv = region(options.slots as usize * options.slot_bytes)?; // written by prev
    let bell = region(4096)?; // zero-length grant writes from next land "here"
    let work = region(args.count * 8)?;
    let grant = |r: &SlotRegion| SlotGrant {
        key: r.key(),
        len: r.len() as u64,
        remote: r.memory_region().map(|m| m.remote()),
    };
    // Verbs: one queue pair per neighbour (one in all for two ranks), made before the rendezvous.
    let neighbours: Vec<u32> = if world == 1 {
        vec![]
    } else if next == prev {
        vec![next]
    } else {
        vec![next, prev]
    };
    let mut prepared: HashMap<u32, PreparedVerbs> = HashMap::new();
    let mut blob = Vec::new();
    blob.extend_from_slice(&grant(&recv).encode());
    blob.extend_from_slice(&grant(&bell).encode());
    if let Some(l) = &local {
        for &p in &neighbours {
            let q = PreparedVerbs::new(
                &l.pd,
                l.port.port,
                QueuePairOptions {
                    send_depth: 64,
                    recv_depth: 16,
                    max_inline: 0,
                },
            )?;
            let e = EndpointDescription {
                endpoint: q.endpoint(&l.gid),
                regions: vec![],
            }
            .encode()?;
            blob.extend_from_slice(&p.to_be_bytes());
            blob.extend_from_slice(&(e.len() as u16).to_be_bytes());
            blob.extend_from_slice(&e);
            prepared.insert(p, q);
        }
    }
    let endpoint = TcpEndpoint::bind("0.0.0.0:0", token.clone(), config.timeout)?;
    let ip = nodetour_core::bootstrap::host::local_ip_towards(&info.master_addr, info.port);
    let entry = PeerEntry {
        rank: me,
        host: HostIdentity::current(),
        address: format!("{ip}:{}", endpoint.local_addr()?.port()),
        blob,
    };
    let deadline = Deadline::after(config.timeout);
    let job = Bootstrap::rendezvous(&info.rendezvous_addr(), me, world, entry, &token, deadline)?;
    let blob_of = |r: u32| &job.peers()[r as usize].blob;
    let peer_grant = |r: u32, which: usize| {
        SlotGrant::decode(
            &blob_of(r)[which * SlotGrant::ENCODED_LEN..(which + 1) * SlotGrant::ENCODED_LEN],
        )
    };
    let next_slots = peer_grant(next, 0)?; // next's recv region
    let prev_slots = peer_grant(prev, 1)?; // prev's doorbell
    // Connections to the neighbours. Regions granted at the start: prev writes our slots, next
    // rings our doorbell; for two ranks one connection carries both.
    let mut conns: HashMap<u32, Box<dyn HostConnection>> = HashMap::new();
    if let Some(l) = &local {
        for p in neighbours.iter().copied() {
            let q = prepared.remove(&p).context("queue pair")?;
            let theirs = blob_of(p);
            let mut at = 2 * SlotGrant::ENCODED_LEN;
            let mut found = None;
            while at + 6 <= theirs.len() {
                let owner = u32::from_be_bytes(theirs[at..at + 4].try_into()?);
                let len = u16::from_be_bytes(theirs[at + 4..at + 6].try_into()?) as usize;
                if owner == me {
                    found =
                        Some(EndpointDescription::decode(&theirs[at + 6..at + 6 + len])?.endpoint);
                }
                at += 6 + len;
            }
            let remote = found.with_context(|| format!("rank {p} made no queue pair for us"))?;
            let path = PathOptions::new(l.port.port, &l.gid, &config);
            conns.insert(
                p,
                Box::new(q.connect(&remote, &path, format!("rank {p}"), config.timeout)?),
            );
        }
        job.barrier(deadline)?;
    } else if world > 1 {
        let grants_for = |p: u32| {
            let mut g = Vec::new();
            if p == prev {
                g.push(recv.clone());
            }
            if p == next {
                g.push(bell.clone());
            }
            g
        };
        let alive = || job.check();
        let lower: Vec<u32> = neighbours.iter().copied().filter(|p| *p < me).collect();
        let higher: Vec<u32> = neighbours.iter().copied().filter(|p| *p > me).collect();
        let tcp_conns: HashMap<u32, TcpConnection> =
            std::thread::scope(|s| -> anyhow::Result<_> {
                let accepting =
                    s.spawn(|| endpoint.accept(&higher, world, &grants_for, &alive, deadline));
                let mut out = HashMap::new();
                for &p in &lower {
                    out.insert(
                        p,
                        tcp::connect(
                            &job.peers()[p as usize].address,
                            me,
                            world,
                            &token,
                            &grants_for(p),
                            &alive,
                            config.timeout,
                            deadline,
                        )?,
                    );
                }
                out.extend(accepting.join().expect("accept thread")?);
                Ok(out)
            })?;
        conns.extend(
            tcp_conns
                .into_iter()
                .map(|(p, c)| (p, Box::new(c) as Box<dyn HostConnection>)),
        );
    }

    let cases: Vec<(DataType, ReduceOp)> = if args.all {
        TYPES
            .iter()
            .flat_map(|t| OPS.iter().map(move |o| (*t, *o)))
            .collect()
    } else {
        vec![
            (DataType::F32, ReduceOp::Sum),
            (DataType::I64, ReduceOp::Max),
        ]
    };
    let links = if world == 1 {
        None
    } else if next == prev {
        Some(Links::One(
            conns.get_mut(&next).context("connection")?.as_mut(),
        ))
    } else {
        let (mut n, mut p) = (None, None);
        for (r, c) in conns.iter_mut() {
            if *r == next {
                n = Some(c.as_mut());
            } else if *r == prev {
                p = Some(c.as_mut());
            }
        }
        Some(Links::Two {
            next: n.context("next")?,
            prev: p.context("prev")?,
        })
    };
    // One ring for every collective: notifications of the next one that arrive early are kept.
    let mut ring = links.map(|links| HostRing {
        rank: me,
        world,
        links,
        next_slots,
        prev_slots,
        recv: recv.clone(),
        work: work.clone(),
        options,
        backlog: Vec::new(),
    });
    let start = Instant::now();
    for (epoch, &(dtype, op)) in cases.iter().enumerate() {
        let mut data = Vec::with_capacity(args.count * dtype.size());
        for i in 0..args.count {
            encode(dtype, value(dtype, me, i), &mut data);
        }
        if let Some(ring) = &mut ring {
            ring.all_reduce(&mut data, dtype, op, epoch as u8, &|| job.check())?;
        }
        let es = dtype.size();
        for i in 0..args.count {
            let (got, want) = (
                decode(dtype, &data[i * es..(i + 1) * es]),
                reference(dtype, op, world, i),
            );
            if (got - want).abs() > tolerance(dtype) * want.abs().max(1.0) {
                bail!("{dtype:?} {op:?}: element {i} is {got}, want {want}");
            }
        }
    }
    drop(ring);
    job.check()?;
    println!(
        "ALLREDUCE OK rank={me} world={world} transport={} cases={} count={} seconds={:.2}",
        args.transport,
        cases.len(),
        args.count,
        start.elapsed().as_secs_f64()
    );
    job.barrier(Deadline::after(config.timeout))?;
    Ok(())
}

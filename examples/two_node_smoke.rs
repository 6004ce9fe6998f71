//! Two-node smoke test: two processes (on two nodes, or two RDMA devices of one machine) each
//! register a host buffer, write a known pattern into the other's buffer with RDMA WRITE, ring
//! the peer with a final RDMA WRITE_WITH_IMM, verify what they received end to end, and print
//! the device, GID, MTU and bandwidth.
//!
//! ```text
//! # node A (rank 0, listens)            # node B (rank 1, connects)
//! two_node_smoke --rank 0 --addr 0.0.0.0:18517     two_node_smoke --rank 1 --addr nodeA:18517
//! ```
//! Without `--rank`/`--addr` the launcher environment is read: `RANK` (or `SLURM_PROCID`,
//! `OMPI_COMM_WORLD_RANK`), `MASTER_ADDR`, and the port from `NODETOUR_PORT` (default 18517).
//! Choose the device with `NODETOUR_IB_DEVICE`, the GID with `NODETOUR_IB_GID_INDEX`.
//! Prints `SMOKE OK ...` and exits 0 on success; exits 2 (with the reason) where the machine has
//! no RDMA device, 1 on any other failure.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use nodetour::link::{PeerLink, Role};
use nodetour_core::oob::MessageKind;
use nodetour_core::verbs::{Completion, QueuePairOptions};
use nodetour_core::{Config, Deadline};

#[derive(Parser)]
#[command(about = "Two-node RDMA WRITE smoke test")]
struct Args {
    /// 0 listens, 1 connects (default: from RANK / SLURM_PROCID / OMPI_COMM_WORLD_RANK).
    #[arg(long)]
    rank: Option<u32>,
    /// Rank 0's out-of-band address, HOST:PORT (default: MASTER_ADDR:NODETOUR_PORT).
    #[arg(long)]
    addr: Option<String>,
    /// Bytes each rank writes into the other.
    #[arg(long, default_value_t = 8 << 20)]
    size: usize,
    /// Bytes per RDMA WRITE.
    #[arg(long, default_value_t = 1 << 20)]
    chunk: usize,
}

/// The immediate that closes the transfer: a tag and the sender's rank.
const DOORBELL: u32 = 0x5eed_0000;

fn pattern(rank: u32, i: usize) -> u8 {
    ((i as u32)
        .wrapping_mul(2_654_435_761)
        .rotate_left(rank * 7 + 3)
        >> 24) as u8
        ^ rank as u8
}

fn main() -> ExitCode {
    nodetour::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let unsupported = e
                .downcast_ref::<nodetour_core::Error>()
                .is_some_and(|e| e.is_unsupported());
            eprintln!(
                "two_node_smoke: {}{e:#}",
                if unsupported { "" } else { "error: " }
            );
            ExitCode::from(if unsupported { 2 } else { 1 })
        }
    }
}

fn env(names: &[&str]) -> Option<String> {
    names
        .iter()
        .find_map(|n| std::env::var(n).ok().filter(|v| !v.is_empty()))
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    let rank = match args.rank {
        Some(r) => r,
        None => env(&["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"])
            .context("no --rank and no RANK/SLURM_PROCID/OMPI_COMM_WORLD_RANK in the environment")?
            .parse()
            .context("the rank is not a number")?,
    };
    if rank > 1 {
        bail!("this smoke test runs with exactly two ranks (0 and 1), got rank {rank}");
    }
    if args.size == 0 || args.chunk == 0 {
        bail!("--size and --chunk must be positive");
    }
    let addr = match args.addr {
        Some(a) => a,
        None => {
            let host = env(&["MASTER_ADDR"]).context("no --addr and no MASTER_ADDR")?;
            let port = env(&["NODETOUR_PORT"]).unwrap_or_else(|| "18517".into());
            if rank == 0 {
                format!("0.0.0.0:{port}")
            } else {
                format!("{host}:{port}")
            }
        }
    };
    let config = Config::from_env()?;
    let role = if rank == 0 {
        Role::Listen(addr)
    } else {
        Role::Connect(addr)
    };
    // One region of 2×size: the first half is what this rank sends, the second half is where
    // the peer writes.
    let size = args.size;
    let options = QueuePairOptions {
        send_depth: 64,
        recv_depth: 4,
        max_inline: 0,
    };
    let mut link = PeerLink::establish(
        &config,
        &role,
        2 * size,
        options,
        Deadline::after(config.timeout),
    )?;
    println!("rank {rank}: {}", link.describe());
    println!(
        "rank {rank}: device chosen because: {}; GID: {}",
        link.device.reason, link.gid.reason
    );
    link.region.fill_with(0..size, |i| pattern(rank, i))?;

    let start = Instant::now();
    let mut offset = 0;
    while offset < size {
        let end = (offset + args.chunk).min(size);
        let last = end == size;
        let imm = last.then_some(DOORBELL | rank);
        loop {
            match link.qp.post_write(
                &link.region,
                offset..end,
                &link.remote,
                (size + offset) as u64,
                imm,
                last,
            ) {
                Ok(_) => break,
                Err(nodetour_core::Error::SendQueueFull { .. }) => {
                    link.qp
                        .wait(&mut Vec::new(), Deadline::after(config.timeout))?;
                }
                Err(e) => return Err(e.into()),
            }
        }
        offset = end;
    }
    // Our writes are done when the signalled doorbell completes; the peer's have landed when its
    // doorbell's immediate arrives (it covers every earlier write on the queue pair).
    let deadline = Deadline::after(config.timeout + Duration::from_micros(2 * size as u64));
    let (mut sent, mut received) = (None, None);
    let mut completions = Vec::new();
    while sent.is_none() || received.is_none() {
        completions.clear();
        link.qp.wait(&mut completions, deadline)?;
        for c in &completions {
            match *c {
                Completion::Send { .. } if link.qp.outstanding_sends() == 0 => {
                    sent = Some(start.elapsed())
                }
                Completion::Send { .. } => {}
                Completion::WriteWithImmediate { immediate, .. } => {
                    if immediate != DOORBELL | (1 - rank) {
                        bail!(
                            "unexpected immediate {immediate:#x} (expected {:#x})",
                            DOORBELL | (1 - rank)
                        );
                    }
                    received = Some(start.elapsed());
                }
            }
        }
    }
    let mut got = vec![0u8; size];
    link.region.read_at(size, &mut got)?;
    let peer = 1 - rank;
    if let Some(bad) = got
        .iter()
        .enumerate()
        .position(|(i, b)| *b != pattern(peer, i))
    {
        link.channel.send(
            MessageKind::Failed,
            format!("rank {rank} found corruption at byte {bad}").as_bytes(),
            Deadline::after(config.timeout),
        )?;
        bail!("data from rank {peer} is corrupted at byte {bad} of {size}");
    }
    let checksum: u64 = got.iter().map(|b| u64::from(*b)).sum();
    let deadline = Deadline::after(config.timeout);
    link.channel
        .send(MessageKind::Done, &checksum.to_be_bytes(), deadline)?;
    link.channel.expect(MessageKind::Done, deadline)?;
    let secs = sent.unwrap_or_default().as_secs_f64();
    println!(
        "SMOKE OK rank={rank} device={} gid_index={} mtu={} bytes={size} write_seconds={secs:.3} MB_per_s={:.2} verified_bytes={size} checksum={checksum}",
        link.context.name(),
        link.gid.index,
        link.mtu_bytes(),
        size as f64 / secs.max(1e-9) / 1_048_576.0
    );
    Ok(())
}

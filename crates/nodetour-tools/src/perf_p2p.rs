//! `nodetour perf --p2p`: point-to-point bandwidth between ranks 0 and 1 (host memory), beside
//! its ceiling measured in the same run between the same two processes: the same bytes over a
//! bare TCP connection (no framing, no slots, no copies but the kernel's).
//!
//! Per size, each timed iteration is one batch of `DEPTH` sends from rank 0 (received by rank
//! 1 into its own buffers, every byte checked once per size), ended by a one-byte reply so the
//! time covers delivery; the ceiling writes the same `DEPTH × size` bytes on the socket and
//! waits for a one-byte reply. The median iteration is reported. Other ranks only take part in
//! the final barrier.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use nodetour_ring::comm::Communicator;

use crate::perf::median;

/// Messages per timed batch (sends in flight together).
pub const DEPTH: usize = 8;

/// One measured size.
#[derive(Clone, Debug, PartialEq)]
pub struct P2pRow {
    /// Bytes per message.
    pub bytes: usize,
    /// Median time of a batch of [`DEPTH`] messages, seconds.
    pub seconds: f64,
    /// Messages' bytes / time, GB/s.
    pub gbps: f64,
    /// The bare socket's GB/s for the same bytes (rank 0's view).
    pub ceiling_gbps: f64,
    /// Whether every received byte matched on rank 1.
    pub correct: bool,
}

/// The value of byte `i` of message `m` of size `size`.
fn byte(size: usize, m: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ m.wrapping_mul(7) ^ size) as u8
}

/// Runs the sweep over `sizes` on ranks 0 and 1 of `comm`; rank 0 returns the rows.
pub fn sweep(
    comm: &Communicator,
    sizes: &[usize],
    warmup: usize,
    iters: usize,
) -> anyhow::Result<Vec<P2pRow>> {
    if comm.world() < 2 {
        anyhow::bail!("perf --p2p needs two ranks");
    }
    if comm.local_world() != comm.world() {
        anyhow::bail!("perf --p2p measures its ceiling on loopback: run every rank on one host");
    }
    let me = comm.rank();
    let socket = if me < 2 {
        Some(bare_socket(comm)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    for &size in sizes {
        let row = match (me, &socket) {
            (0 | 1, Some(s)) => Some(one_size(comm, s, size, warmup, iters)?),
            _ => None,
        };
        if let Some(r) = row.filter(|_| me == 0) {
            rows.push(r);
        }
    }
    comm.barrier()?;
    Ok(rows)
}

/// A bare TCP connection between ranks 0 and 1 (rank 1 listens on loopback and sends its port
/// over the communicator).
fn bare_socket(comm: &Communicator) -> anyhow::Result<TcpStream> {
    let s = if comm.rank() == 1 {
        let l = TcpListener::bind("127.0.0.1:0")?;
        comm.send(&[u32::from(l.local_addr()?.port())], 0)?;
        l.accept()?.0
    } else {
        let mut port = [0u32];
        comm.recv(&mut port, 1)?;
        TcpStream::connect(("127.0.0.1", port[0] as u16))?
    };
    s.set_nodelay(true)?;
    Ok(s)
}

fn one_size(
    comm: &Communicator,
    socket: &TcpStream,
    size: usize,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<P2pRow> {
    let me = comm.rank();
    let msgs: Vec<Vec<u8>> = (0..DEPTH)
        .map(|m| (0..size).map(|i| byte(size, m, i)).collect())
        .collect();
    let mut into: Vec<Vec<u8>> = vec![vec![0u8; size]; DEPTH];
    let mut times = Vec::new();
    let mut correct = true;
    for it in 0..warmup + iters {
        let t = Instant::now();
        if me == 0 {
            let mut b = comm.batch();
            for m in &msgs {
                b.send(m, 1);
            }
            b.run()?;
            comm.recv(&mut [0u8][..], 1)?;
        } else {
            let mut b = comm.batch();
            for m in into.iter_mut() {
                b.recv(m, 0);
            }
            b.run()?;
            comm.send(&[1u8], 0)?;
            if it == 0 {
                correct = into.iter().zip(&msgs).all(|(a, b)| a == b);
            }
        }
        if it >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let ceiling = ceiling(me, socket, size, warmup, iters)?;
    let seconds = median(times);
    let gbps = (DEPTH * size) as f64 / seconds / 1e9;
    // Rank 1's check of the bytes, to rank 0.
    let mut ok = [u8::from(correct)];
    if me == 1 {
        comm.send(&ok, 0)?;
    } else {
        comm.recv(&mut ok[..], 1)?;
    }
    Ok(P2pRow {
        bytes: size,
        seconds,
        gbps,
        ceiling_gbps: (DEPTH * size) as f64 / ceiling / 1e9,
        correct: ok[0] == 1,
    })
}

/// The median time for `DEPTH × size` bytes over the bare socket, and a one-byte reply.
fn ceiling(
    me: u32,
    socket: &TcpStream,
    size: usize,
    warmup: usize,
    iters: usize,
) -> anyhow::Result<f64> {
    let mut s = socket;
    let data = vec![0x5Au8; DEPTH * size];
    let mut sink = vec![0u8; DEPTH * size];
    let mut times = Vec::new();
    for it in 0..warmup + iters {
        let t = Instant::now();
        if me == 0 {
            s.write_all(&data)?;
            s.read_exact(&mut [0u8])?;
        } else {
            s.read_exact(&mut sink)?;
            s.write_all(&[1u8])?;
        }
        if it >= warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    Ok(median(times))
}

/// The rows as text, csv or json.
pub fn render(rows: &[P2pRow], format: &str, paths: &str) -> String {
    let mut out = String::new();
    match format {
        "json" => {
            let rows: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "bytes": r.bytes, "time_us": r.seconds * 1e6, "gbps": r.gbps,
                        "ceiling_gbps": r.ceiling_gbps, "ratio": r.gbps / r.ceiling_gbps,
                        "correct": r.correct,
                    })
                })
                .collect();
            let doc = serde_json::json!({"depth": DEPTH, "paths": paths, "rows": rows});
            out.push_str(&format!("{doc}\n"));
        }
        "csv" => {
            out.push_str("bytes,time_us,gbps,ceiling_gbps,ratio,correct\n");
            for r in rows {
                out.push_str(&format!(
                    "{},{:.2},{:.4},{:.4},{:.3},{}\n",
                    r.bytes,
                    r.seconds * 1e6,
                    r.gbps,
                    r.ceiling_gbps,
                    r.gbps / r.ceiling_gbps,
                    r.correct
                ));
            }
        }
        _ => {
            out.push_str(&format!(
                "# send/recv, rank 0 -> rank 1, {DEPTH} messages per batch; ceiling: the same bytes over a bare TCP socket between the same processes\n# {paths}\n"
            ));
            out.push_str(&format!(
                "{:>12} {:>12} {:>10} {:>12} {:>8} {:>6}\n",
                "bytes", "batch_us", "GB/s", "ceiling_GB/s", "ratio", "check"
            ));
            for r in rows {
                out.push_str(&format!(
                    "{:>12} {:>12.2} {:>10.4} {:>12.4} {:>8.3} {:>6}\n",
                    r.bytes,
                    r.seconds * 1e6,
                    r.gbps,
                    r.ceiling_gbps,
                    r.gbps / r.ceiling_gbps,
                    if r.correct { "ok" } else { "WRONG" }
                ));
            }
        }
    }
    out
}

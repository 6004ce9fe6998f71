//! `nodetour write-lat`: RDMA WRITE latency between two processes, measured like perftest's
//! `ib_write_lat`: a ping-pong of `size`-byte writes, each side answering the other's, for
//! `iters` round trips; the latency is half a round trip (typical = median, and the average).
//!
//! Where perftest polls the last byte of the buffer, each write here carries an immediate and
//! the receiver waits for its completion (nodetour's notification path: the one collectives
//! use), so the comparison includes that mechanism.

use std::time::{Duration, Instant};

use nodetour_core::auth::JobToken;
use nodetour_core::verbs::{Completion, QueuePairOptions};
use nodetour_core::{Config, Deadline, Error, Result};

use crate::link::{PeerLink, Role};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteLatOptions {
    /// Bytes per write.
    pub size: usize,
    /// Round trips.
    pub iters: u64,
}

/// What was measured (client side; the server reports its role only).
#[derive(Clone, Debug, PartialEq)]
pub struct WriteLatReport {
    /// Which side this is.
    pub role: &'static str,
    /// Bytes per write.
    pub size: usize,
    /// Round trips timed.
    pub iters: u64,
    /// Median half round trip, µs (perftest's t_typical).
    pub typical_us: f64,
    /// Mean half round trip, µs.
    pub average_us: f64,
    /// Link description.
    pub link: String,
}

impl WriteLatReport {
    /// perftest-like result line.
    pub fn line(&self) -> String {
        format!(
            "WRITE_LAT role={} bytes={} iters={} t_typical_us={:.2} t_avg_us={:.2} {}",
            self.role, self.size, self.iters, self.typical_us, self.average_us, self.link
        )
    }
}

const WARMUP: u64 = 16;
const DEPTH: u32 = 16;

/// Writes `size` bytes with immediate `seq` to the peer, then waits for the peer's write.
fn ping(link: &PeerLink, size: usize, seq: u32, timeout: Duration) -> Result<()> {
    link.qp
        .post_write(&link.region, 0..size, &link.remote, 0, Some(seq), true)?;
    wait_for_peer(link, timeout)
}

/// Waits for the peer's next WRITE_WITH_IMM (send completions along the way are retired) and
/// reposts the receive it consumed.
fn wait_for_peer(link: &PeerLink, timeout: Duration) -> Result<()> {
    let mut done: Vec<Completion> = Vec::with_capacity(4);
    loop {
        done.clear();
        link.qp.wait(&mut done, Deadline::after(timeout))?;
        if done
            .iter()
            .any(|c| matches!(c, Completion::WriteWithImmediate { .. }))
        {
            return link.qp.post_receives(1);
        }
    }
}

fn establish(config: &Config, role: Role, token: &JobToken, size: usize) -> Result<PeerLink> {
    if size == 0 {
        return Err(Error::InvalidArgument {
            reason: "the write size must be positive".into(),
        });
    }
    let options = QueuePairOptions {
        send_depth: DEPTH,
        recv_depth: DEPTH,
        max_inline: 0,
    };
    PeerLink::establish(
        config,
        &role,
        token,
        size,
        options,
        Deadline::after(config.timeout),
    )
}

/// Runs the measuring side against the server at `server`.
/// `token`: the pair's job token, which the out-of-band channel proves both ways.
pub fn run_client(
    config: &Config,
    server: &str,
    token: &JobToken,
    o: WriteLatOptions,
) -> Result<WriteLatReport> {
    if o.iters == 0 {
        return Err(Error::InvalidArgument {
            reason: "iterations must be positive".into(),
        });
    }
    let link = establish(config, Role::Connect(server.to_owned()), token, o.size)?;
    let mut rtts = Vec::with_capacity(o.iters as usize);
    for i in 0..WARMUP + o.iters {
        let t = Instant::now();
        ping(&link, o.size, i as u32, config.timeout)?;
        if i >= WARMUP {
            rtts.push(t.elapsed().as_secs_f64() * 1e6 / 2.0);
        }
    }
    let average = rtts.iter().sum::<f64>() / rtts.len() as f64;
    Ok(WriteLatReport {
        role: "client",
        size: o.size,
        iters: o.iters,
        typical_us: crate::perf::median(rtts),
        average_us: average,
        link: link.describe(),
    })
}

/// Runs the answering side: each write of the client is answered by one of the same size.
/// `token`: as for [`run_client`].
pub fn run_server(
    config: &Config,
    listen: &str,
    token: &JobToken,
    o: WriteLatOptions,
) -> Result<WriteLatReport> {
    let link = establish(config, Role::Listen(listen.to_owned()), token, o.size)?;
    for i in 0..WARMUP + o.iters {
        wait_for_peer(&link, config.timeout)?;
        link.qp.post_write(
            &link.region,
            0..o.size,
            &link.remote,
            0,
            Some(i as u32),
            true,
        )?;
    }
    // Let the last answer complete before the queue pair is torn down.
    link.qp.wait_idle(Deadline::after(config.timeout))?;
    Ok(WriteLatReport {
        role: "server",
        size: o.size,
        iters: o.iters,
        typical_us: 0.0,
        average_us: 0.0,
        link: link.describe(),
    })
}

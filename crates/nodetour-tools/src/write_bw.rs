//! `nodetour write-bw`: RDMA WRITE bandwidth between two processes, measured the way perftest's
//! `ib_write_bw` measures it (same message size, iteration count and send-queue depth; time from
//! the first post to the last completion; MB = 2^20 bytes), so the two can run side by side.

use std::time::{Duration, Instant};

use crate::oob::MessageKind;
use nodetour_core::auth::JobToken;
use nodetour_core::verbs::{Completion, QueuePairOptions};
use nodetour_core::{Config, Deadline, Error, Result};

use crate::link::{PeerLink, Role};

/// What to measure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteBwOptions {
    /// Bytes per RDMA WRITE.
    pub size: usize,
    /// Number of writes.
    pub iters: u64,
    /// Writes in flight at once (send queue depth; perftest's `--tx-depth`).
    pub tx_depth: u32,
    /// Check on the server that the last write's bytes arrived intact.
    pub verify: bool,
}

impl Default for WriteBwOptions {
    fn default() -> Self {
        WriteBwOptions {
            size: 65536,
            iters: 1000,
            tx_depth: 128,
            verify: true,
        }
    }
}

/// What was measured.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteBwReport {
    /// Which side this is.
    pub role: &'static str,
    /// Link description (device, GID, MTU).
    pub link: String,
    /// Bytes per write.
    pub size: usize,
    /// Writes.
    pub iters: u64,
    /// From the first post to the last completion (client side).
    pub elapsed: Duration,
    /// Average bandwidth in MiB/s (perftest's "MB/sec").
    pub mib_per_s: f64,
    /// Whether the server verified the data ("n/a" on the client).
    pub verified: Option<bool>,
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 11)) as u8
}

/// Runs the measuring side: connects to the server and writes.
/// `token`: the pair's job token, which the out-of-band channel proves both ways.
pub fn run_client(
    config: &Config,
    server: &str,
    token: &JobToken,
    opts: WriteBwOptions,
) -> Result<WriteBwReport> {
    check(&opts)?;
    let deadline = Deadline::after(config.timeout);
    let qp_options = QueuePairOptions {
        send_depth: opts.tx_depth,
        recv_depth: 1,
        max_inline: 0,
    };
    let mut link = PeerLink::establish(
        config,
        &Role::Connect(server.to_owned()),
        token,
        opts.size,
        qp_options,
        deadline,
    )?;
    link.region.fill_with(0..opts.size, pattern)?;
    let mut done = Vec::with_capacity(64);
    let start = Instant::now();
    let mut posted = 0u64;
    // Each wait gets the whole timeout budget: the deadline bounds a stall, not the run.
    while posted < opts.iters {
        match link.qp.post_write(
            &link.region,
            0..opts.size,
            &link.remote,
            0,
            None,
            posted + 1 == opts.iters,
        ) {
            Ok(_) => posted += 1,
            Err(Error::SendQueueFull { .. }) => {
                done.clear();
                link.qp.wait(&mut done, Deadline::after(config.timeout))?;
            }
            Err(e) => return Err(e),
        }
    }
    link.qp.wait_idle(Deadline::after(config.timeout))?;
    let elapsed = start.elapsed();
    let deadline = Deadline::after(config.timeout);
    link.channel
        .send(MessageKind::Done, &opts.size.to_be_bytes(), deadline)?;
    let verdict = link.channel.expect(MessageKind::Done, deadline)?;
    let verified = verdict.first().map(|v| *v == 1);
    if verified == Some(false) {
        return Err(Error::PeerMismatch {
            reason: "the server found corrupted data".into(),
        });
    }
    Ok(report("client", &link, opts, elapsed, verified))
}

/// Runs the passive side: accepts the client, lets it write, and verifies the data.
/// `token`: as for [`run_client`].
pub fn run_server(
    config: &Config,
    listen: &str,
    token: &JobToken,
    opts: WriteBwOptions,
) -> Result<WriteBwReport> {
    check(&opts)?;
    let qp_options = QueuePairOptions {
        send_depth: 1,
        recv_depth: 1,
        max_inline: 0,
    };
    let accept_deadline = Deadline::after(config.timeout);
    let mut link = PeerLink::establish(
        config,
        &Role::Listen(listen.to_owned()),
        token,
        opts.size,
        qp_options,
        accept_deadline,
    )?;
    // The client's writes may take long on slow links: wait for its "done" with a deadline
    // that scales with the volume (at a pessimistic 1 MB/s) on top of the timeout.
    let volume = opts.size as u64 * opts.iters;
    let deadline = Deadline::after(config.timeout + Duration::from_micros(volume));
    link.channel.expect(MessageKind::Done, deadline)?;
    let verified = if opts.verify {
        let mut got = vec![0u8; opts.size];
        link.region.read_at(0, &mut got)?;
        got.iter().enumerate().all(|(i, b)| *b == pattern(i))
    } else {
        true
    };
    link.channel.send(
        MessageKind::Done,
        &[u8::from(verified)],
        Deadline::after(config.timeout),
    )?;
    // The server saw no completions: the client's timing is the measurement.
    let mut done: Vec<Completion> = Vec::new();
    let _ = link.qp.poll(&mut done);
    Ok(report(
        "server",
        &link,
        opts,
        Duration::ZERO,
        Some(verified),
    ))
}

fn check(opts: &WriteBwOptions) -> Result<()> {
    if opts.size == 0 || opts.iters == 0 || opts.tx_depth == 0 {
        return Err(Error::InvalidArgument {
            reason: "size, iterations and tx depth must be positive".into(),
        });
    }
    Ok(())
}

fn report(
    role: &'static str,
    link: &PeerLink,
    o: WriteBwOptions,
    elapsed: Duration,
    verified: Option<bool>,
) -> WriteBwReport {
    let secs = elapsed.as_secs_f64();
    let mib_per_s = if secs > 0.0 {
        (o.size as f64 * o.iters as f64) / secs / 1_048_576.0
    } else {
        0.0
    };
    WriteBwReport {
        role,
        link: link.describe(),
        size: o.size,
        iters: o.iters,
        elapsed,
        mib_per_s,
        verified,
    }
}

impl WriteBwReport {
    /// perftest-style result line: `#bytes #iterations BW-average[MB/sec]`, then details.
    pub fn line(&self) -> String {
        format!(
            "WRITE_BW role={} bytes={} iters={} seconds={:.3} MB_per_s={:.2} verified={} {}",
            self.role,
            self.size,
            self.iters,
            self.elapsed.as_secs_f64(),
            self.mib_per_s,
            self.verified.map_or("n/a".into(), |v| v.to_string()),
            self.link
        )
    }
}

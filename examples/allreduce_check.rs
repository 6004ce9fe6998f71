//! Ring allreduce of host buffers between N processes over tcp or verbs, checked against a
//! float64 reference on every rank, for every data type and operation (or one of each).
//!
//! ```text
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --all
//! # inside the soft-RoCE VM:
//! scripts/launch-local.sh -n 4 -- target/release/examples/allreduce_check --transport verbs --devices rxe0,rxe1
//! ```
//! With `--gpu` the buffers are GPU memory (`Communicator::all_reduce_in_place` on `Elements`), on the
//! GPU ring: its links are network links over the chosen transport (a forced host transport
//! makes every link one):
//! `NCCL_NVLS_ENABLE=0 scripts/launch-local.sh -n 2 -- target/release/examples/allreduce_check --gpu --all`.
//!
//! Prints `ALLREDUCE OK rank=.. world=.. transport=.. cases=..` per rank, or fails naming the
//! first mismatch.

use std::process::ExitCode;
use std::time::Instant;

use anyhow::bail;
use clap::Parser;
use nodetour::core::memory::DeviceBuffer;
use nodetour::core::transport::TransportKind;
use nodetour::ring::seeded::{input, rank_op, verify};
use nodetour::{Communicator, DataType, Deadline, Elements, Host, HostBytes, Options, ReduceOp};
use nodetour_tools::perf::cases;

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
    /// GPU buffers (GPU `local rank mod GPUs`), on the GPU ring's network links: SKIP without
    /// CUDA.
    #[arg(long)]
    gpu: bool,
    /// Soak: run the cases round-robin this many collectives in all (each checked exactly),
    /// and report memory and descriptor counts before and after.
    #[arg(long)]
    repeat: Option<u64>,
    /// Load: run the cases round-robin for this many seconds (each checked exactly).
    #[arg(long)]
    seconds: Option<u64>,
    /// Failure drill (with --repeat): this rank kills itself (SIGKILL) after 50 collectives;
    /// every other rank must fail naming it within 2x NODETOUR_TIMEOUT_MS.
    #[arg(long)]
    kill_rank: Option<u32>,
    /// Abort drill (with --repeat): this rank aborts its ring from another thread after 50
    /// collectives; its call must return `Aborted`, the others fail within 2x the timeout.
    #[arg(long)]
    abort_rank: Option<u32>,
    /// Agreement drill: this rank uses twice the slot bytes of the others; formation must fail
    /// on every rank, naming `NODETOUR_SLOT_BYTES` and both values (prints
    /// `SETTINGS_DIFFER rank=..`).
    #[arg(long)]
    differ_rank: Option<u32>,
    /// Deterministic drills: every other rank holds this many milliseconds before collective
    /// 50, and the kill or abort rank fails 5 ms into collective 50, so the failure always
    /// lands while that rank waits on a held peer in the middle of the collective.
    #[arg(long)]
    hold_ms: Option<u64>,
}

/// Resident memory (KiB) and open file descriptors of this process.
fn footprint() -> (u64, usize) {
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0);
    let fds = std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count());
    (rss, fds)
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("allreduce_check: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.gpu
        && let Err(e) = nodetour_core::cuda::availability()
    {
        println!("SKIP allreduce_check --gpu: {e}");
        return Ok(());
    }
    let mut options = Options::from_env()?;
    options.transport = Some(match args.transport.as_str() {
        "tcp" => TransportKind::Tcp,
        "verbs" => TransportKind::Verbs,
        other => bail!("allreduce_check speaks tcp and verbs, not {other}"),
    });
    options.devices = args.devices.clone();
    options.slot_bytes = args.slot_bytes;
    // The staging region this check needs (its buffers are small): registering the default
    // 16 MiB per rank is slow in the soft-RoCE VM, whose drills form under a 3 s timeout.
    options.piece_bytes = (args.count * 8).max(4096);
    let timeout = options.timeout();
    // This rank's GPU (local rank mod GPUs), chosen before the communicator forms: its host
    // memory is pinned under it.
    let gpu = if args.gpu {
        let n = nodetour::core::cuda::gpus()?.len().max(1);
        let info = nodetour::net::bootstrap::LaunchInfo::from_env()?;
        let ordinal = info.local_rank.unwrap_or(info.rank) as usize % n;
        options.gpu = Some(ordinal);
        let ctx = cudarc::driver::CudaContext::new(ordinal)
            .map_err(|e| anyhow::anyhow!("GPU {ordinal}: {e:?}"))?;
        let stream = nodetour::core::cuda::GpuStream::new(&ctx)?;
        Some((ctx, stream))
    } else {
        None
    };
    if let Some(odd) = args.differ_rank {
        let me = nodetour::net::bootstrap::LaunchInfo::from_env()?.rank;
        if me == odd {
            options.slot_bytes *= 2;
        }
        return match Communicator::from_env(options) {
            Err(e @ nodetour::Error::SettingDiffers { .. }) => {
                println!("SETTINGS_DIFFER rank={me} error=\"{e}\"");
                Ok(())
            }
            Err(e) => bail!("rank {me}: formation failed, but not naming the setting: {e}"),
            Ok(_) => bail!("rank {me}: formed with a rank whose slot bytes differ"),
        };
    }
    let comm = Communicator::from_env(options)?;
    let cases = cases(
        args.all,
        gpu.is_some(),
        &[
            (DataType::F32, ReduceOp::Sum),
            (DataType::I64, ReduceOp::Max),
        ],
    );
    let start = Instant::now();
    let me = comm.rank();
    let run_case = |comm: &Communicator, k: usize| -> anyhow::Result<()> {
        let (dtype, op) = cases[k % cases.len()];
        // Collective k's own input (seeded by k and the rank): an Ok computed from another
        // collective's data fails the check.
        let mut data = input(dtype, op, comm.rank(), args.count, k as u64);
        // A PreMulSum: this rank's own scalar (the seeded reference knows every rank's).
        let op = rank_op(op, dtype, comm.rank());
        match &gpu {
            None => {
                comm.all_reduce_in_place(&mut HostBytes::new_mut(&mut data, dtype)?, op, Host)?
            }
            Some((ctx, stream)) => {
                let buffer = DeviceBuffer::new(ctx, data.len().max(1))?;
                buffer.copy_from_host(0, &data)?;
                comm.all_reduce_in_place(
                    &mut Elements::new(&buffer, args.count, dtype)?,
                    op,
                    stream,
                )?;
                // The collective is queued on `stream`; the copy out runs on a stream of its
                // own, so wait for this one (only) first.
                stream.synchronize()?;
                buffer.copy_to_host(0, &mut data)?;
            }
        }
        if let Err(mismatch) = verify(dtype, op, comm.world(), &data, k as u64) {
            bail!("collective {k}: {mismatch}");
        }
        Ok(())
    };
    for k in 0..cases.len() {
        run_case(&comm, k)?;
    }
    if args.repeat.is_some() || args.seconds.is_some() {
        // Counted after the first round: buffers, connections and kernels exist by then.
        let (rss0, fds0) = footprint();
        let t = Instant::now();
        let (mut k, mut slowest) = (0u64, 0f64);
        let until = args.seconds.map(std::time::Duration::from_secs);
        let mut stop = false;
        let failing = args.kill_rank == Some(me) || args.abort_rank == Some(me);
        let hold = args.hold_ms.map(std::time::Duration::from_millis);
        let five_ms = std::time::Duration::from_millis(5);
        while !stop && args.repeat.is_none_or(|n| k < n) {
            if let (Some(h), 50, false) = (hold, k, failing) {
                println!("HOST_RING_DRILL rank={me}: holding {h:?} before collective {k}");
                std::thread::sleep(h);
            }
            if args.kill_rank == Some(me) && k == 50 && hold.is_some() {
                println!(
                    "HOST_RING_DRILL rank={me}: killing myself (SIGKILL) 5 ms into collective {k}"
                );
                std::thread::spawn(move || {
                    std::thread::sleep(five_ms);
                    let _ = std::process::Command::new("kill")
                        .args(["-9", &std::process::id().to_string()])
                        .status();
                });
            } else if args.kill_rank == Some(me) && k == 50 {
                println!(
                    "HOST_RING_DRILL rank={me}: killing myself (SIGKILL) after {k} collectives"
                );
                let _ = std::process::Command::new("kill")
                    .args(["-9", &std::process::id().to_string()])
                    .status();
                std::thread::sleep(std::time::Duration::from_secs(60));
            }
            if args.abort_rank == Some(me) && k == 50 {
                let handle = comm.abort_handle();
                std::thread::spawn(move || {
                    if hold.is_some() {
                        std::thread::sleep(five_ms);
                    }
                    handle.abort("the abort drill's watchdog")
                });
            }
            let c = Instant::now();
            // Numbered after the first round's collectives: every collective has its own seed.
            if let Err(e) = run_case(&comm, cases.len() + k as usize) {
                if let Some(a) = args.abort_rank {
                    let text = format!("{e:#}");
                    println!(
                        "HOST_RING_DRILL rank={me} failed_at_collective={k} ok_verified={k} detected_after_ms={} bound_ms={} error=\"{text}\"",
                        c.elapsed().as_millis(),
                        2 * timeout.as_millis()
                    );
                    if c.elapsed() > 2 * timeout || (a == me && !text.contains("aborted")) {
                        bail!("rank {me}: the abort drill did not end as it must");
                    }
                    return Ok(());
                }
                let Some(victim) = args.kill_rank else {
                    return Err(e);
                };
                let waited = c.elapsed();
                println!(
                    "HOST_RING_DRILL rank={me} failed_at_collective={k} ok_verified={k} detected_after_ms={} bound_ms={} error=\"{e:#}\"",
                    waited.as_millis(),
                    2 * timeout.as_millis()
                );
                if waited > 2 * timeout || !format!("{e:#}").contains(&format!("rank {victim}")) {
                    bail!("rank {me}: the loss of rank {victim} was not reported in time");
                }
                return Ok(());
            }
            slowest = slowest.max(c.elapsed().as_secs_f64());
            k += 1;
            // With a time limit every rank must stop after the same collective: agree on it
            // every 64 collectives with one more (a max of everyone's "time is up").
            if let Some(u) = until.filter(|_| k % 64 == 0) {
                let mut up = vec![u8::from(t.elapsed() >= u)];
                comm.all_reduce_in_place(&mut up, ReduceOp::Max, Host)?;
                stop = up[0] == 1;
            }
        }
        let (rss1, fds1) = footprint();
        println!(
            "SOAK rank={} world={} transport={} collectives={k} errors=0 count={} seconds={:.1} per_collective_ms={:.3} slowest_ms={:.1} rss_kib_start={rss0} rss_kib_end={rss1} fds_start={fds0} fds_end={fds1}",
            comm.rank(),
            comm.world(),
            args.transport,
            args.count,
            t.elapsed().as_secs_f64(),
            t.elapsed().as_secs_f64() * 1e3 / k.max(1) as f64,
            slowest * 1e3
        );
    }
    comm.wait(Deadline::after(timeout))?;
    println!(
        "ALLREDUCE OK rank={} world={} transport={}{} cases={} count={} seconds={:.2} ring={:?}",
        comm.rank(),
        comm.world(),
        args.transport,
        match &gpu {
            Some((c, _)) => format!(
                " buffers=GPU{} ({})",
                c.ordinal(),
                match &comm.paths().device {
                    nodetour::ring::comm::DevicePath::GpuRing { transport, .. } => format!(
                        "GPU ring, {}",
                        transport.map_or("one rank".into(), |t| t.to_string())
                    ),
                    other => format!("{other:?}"),
                }
            ),
            None => String::new(),
        },
        cases.len(),
        args.count,
        start.elapsed().as_secs_f64(),
        comm.paths().order
    );
    comm.close(Deadline::after(timeout))?;
    Ok(())
}

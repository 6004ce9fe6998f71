//! The `nodetour` command: inspect RDMA devices and measure the verbs path.
//!
//! Exit status: 0 success, 1 failure, 2 the machine lacks what the command needs (no
//! libibverbs, no RDMA device), with the reason on stderr.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use nodetour_core::verbs::{self, Context, library};
use nodetour_core::{Config, Error};
use nodetour_tools::write_bw::{self, WriteBwOptions};
use nodetour_tools::write_lat;

#[derive(Parser)]
#[command(
    name = "nodetour",
    version,
    about = "GPUDirect RDMA transport: devices, bandwidth, readiness"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
#[allow(clippy::large_enum_variant)]
enum Command {
    /// For each GPU: whether the direct path (NIC writing GPU memory) works here, and if not,
    /// why and how to fix it. Exit 0: every GPU direct; 3: some GPU stages; 2: no usable GPU.
    Doctor {
        /// Print one JSON document instead of text.
        #[arg(long)]
        json: bool,
        /// Skip the live checks (copies, peer access, loopback writes into GPU memory).
        #[arg(long)]
        no_live: bool,
    },
    /// Allreduce sweeps like NCCL's all_reduce_perf (size, time, algbw, busbw, check), one
    /// process per rank under a launcher (scripts/launch-local.sh, torchrun, Slurm, Open MPI):
    /// host buffers over tcp or verbs; `--gpu`: GPU buffers, one GPU per process (direct
    /// cuda-ipc, staged shm, or both); `--gpus 0,1`: the GPUs of this one process (direct).
    Perf {
        #[command(flatten)]
        sweep: SweepArgs,
        /// tcp or verbs (host buffers).
        #[arg(long, default_value = "tcp")]
        transport: String,
        /// RDMA devices to spread the ranks over (verbs).
        #[arg(long, value_delimiter = ',')]
        devices: Vec<String>,
        /// Bytes per slot (host buffers).
        #[arg(long, default_value_t = 1 << 20)]
        slot_bytes: usize,
        /// Point-to-point instead: send/recv bandwidth from rank 0 to rank 1 (host buffers),
        /// beside the same bytes over a bare TCP socket between the same processes.
        #[arg(long, conflicts_with_all = ["gpu", "gpus", "handoff"])]
        p2p: bool,
        #[command(flatten)]
        gpu: GpuArgs,
    },
    /// List RDMA devices with their ports, link layer, MTU and the GID nodetour would use.
    Devices,
    /// List GPUs with their GPUDirect attributes, try a dma-buf export, and show which
    /// registration path (dma-buf, peermem, staged) GPU memory would take here, and why.
    Gpus,
    /// RDMA WRITE bandwidth between two processes, measured like perftest's ib_write_bw.
    WriteBw {
        /// Listen for the client on this address (server side).
        #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
        listen: Option<String>,
        /// Connect to the server at this address and measure (client side).
        #[arg(long)]
        connect: Option<String>,
        /// Bytes per write.
        #[arg(long, short = 's', default_value_t = 65536)]
        size: usize,
        /// Number of writes.
        #[arg(long, short = 'n', default_value_t = 1000)]
        iters: u64,
        /// Writes in flight (send queue depth).
        #[arg(long, short = 't', default_value_t = 128)]
        tx_depth: u32,
        /// Skip the server-side data check.
        #[arg(long)]
        no_verify: bool,
    },
    /// RDMA WRITE latency between two processes, measured like perftest's ib_write_lat (a
    /// ping-pong of writes with immediates; half a round trip, median and mean).
    WriteLat {
        /// Listen for the client on this address (server side).
        #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
        listen: Option<String>,
        /// Connect to the server at this address and measure (client side).
        #[arg(long)]
        connect: Option<String>,
        /// Bytes per write.
        #[arg(long, short = 's', default_value_t = 8)]
        size: usize,
        /// Round trips.
        #[arg(long, short = 'n', default_value_t = 1000)]
        iters: u64,
    },
}

/// What every sweep takes.
#[derive(clap::Args)]
struct SweepArgs {
    /// MIN:MAX bytes per rank (K, M, G suffixes).
    #[arg(long, default_value = "8:64M")]
    sizes: String,
    /// Size multiplier between rows.
    #[arg(long, default_value_t = 2)]
    factor: usize,
    /// f32, f64, f16, bf16, i32, i64, u8.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// sum, prod, min, max, avg.
    #[arg(long, default_value = "sum")]
    op: String,
    /// Untimed iterations per size.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// Timed iterations per batch (the median batch is reported).
    #[arg(long, default_value_t = 10)]
    iters: usize,
    /// text, csv, json (markdown too for GPU sweeps).
    #[arg(long, default_value = "text")]
    format: String,
    /// Also draw busbw against size (each path, and NCCL) into this SVG file (GPU sweeps).
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
}

/// The GPU sweeps' options.
#[derive(clap::Args)]
struct GpuArgs {
    /// GPU buffers, one GPU per process (rank r on GPU local_rank mod GPUs), under a launcher.
    #[arg(long, conflicts_with = "gpus")]
    gpu: bool,
    /// The direct GPU ring over these GPUs of this one process (one rank each, e.g. `0,1`;
    /// repeating a GPU puts several ranks on it).
    #[arg(long, value_delimiter = ',')]
    gpus: Vec<usize>,
    /// The network link's hand-off alone, on GPU 0 in this process: one chunk from a stream
    /// through the link's threads and tcp loopback to another stream, beside the same copies
    /// handed over by a stored word (`NODETOUR_NET_SPIN_US` sets the threads' spin).
    #[arg(long, conflicts_with_all = ["gpu", "gpus"])]
    handoff: bool,
    /// With --gpu: direct (cuda-ipc), staged (shm), both side by side, or auto.
    #[arg(long, default_value = "auto")]
    path: String,
    /// References measured in the same run: nccl (its own buffers, on the same streams, alternating) and
    /// ceiling (the copy ceilings: peer copies and concurrent D2H+H2D on all GPUs at once).
    #[arg(long, value_delimiter = ',')]
    compare: Vec<String>,
    /// With --gpu: every collective (ours and NCCL's) beside a compute load on another stream
    /// of each GPU (compute-bound kernels, 4 blocks per SM): how fast each runs beside compute,
    /// and how much of the compute it leaves (the `cmp` columns).
    #[arg(long)]
    beside_compute: bool,
    /// With --gpu: also each path's collectives captured into a CUDA graph and replayed (rows
    /// direct-graph, staged-graph; rings with a network link cannot be captured).
    #[arg(long)]
    graph: bool,
    /// With --gpus: the largest all-gather segment copied by a kernel instead of the copy
    /// engine (tuning; 0 = always the copy engine).
    #[arg(long)]
    kernel_copy_max: Option<usize>,
    /// With --gpus: the largest two-rank collective run in one step instead of the ring
    /// (tuning; 0 = always the ring).
    #[arg(long)]
    one_step_max: Option<usize>,
}

impl GpuArgs {
    /// The sweep these arguments ask for.
    fn spec(&self, sweep: &SweepArgs) -> anyhow::Result<nodetour_tools::perf_gpu::SweepSpec> {
        use nodetour_tools::perf::{parse_dtype, parse_op, parse_sizes};
        let (compare_nccl, ceiling) = self.compares()?;
        Ok(nodetour_tools::perf_gpu::SweepSpec {
            sizes: parse_sizes(&sweep.sizes, sweep.factor)?,
            dtype: parse_dtype(&sweep.dtype)?,
            op: parse_op(&sweep.op)?,
            warmup: sweep.warmup,
            iters: sweep.iters,
            compare_nccl,
            ceiling,
            beside_compute: self.beside_compute,
            graph: self.graph,
        })
    }

    fn compares(&self) -> anyhow::Result<(bool, bool)> {
        let (mut nccl, mut ceiling) = (false, false);
        for c in &self.compare {
            match c.as_str() {
                "nccl" => nccl = true,
                "ceiling" => ceiling = true,
                other => anyhow::bail!("--compare {other}: the references are nccl and ceiling"),
            }
        }
        Ok((nccl, ceiling))
    }
}

fn exit(result: anyhow::Result<bool>) -> ExitCode {
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("nodetour: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    let cli = Cli::parse();
    if let Command::Perf {
        sweep,
        transport,
        devices,
        slot_bytes,
        p2p,
        gpu,
    } = &cli.command
    {
        if *p2p {
            return exit(perf_p2p(sweep, transport, devices, *slot_bytes));
        }
        if !gpu.gpus.is_empty() {
            return exit(perf_gpus(sweep, gpu));
        }
        if gpu.handoff {
            return exit(perf_handoff(sweep));
        }
        if gpu.gpu {
            return exit(perf_ring(sweep, gpu));
        }
        if !gpu.compare.is_empty() || sweep.plot.is_some() {
            eprintln!(
                "nodetour: error: --compare and --plot need GPU buffers (--gpu or --gpus): the \
                 references run on GPUs"
            );
            return ExitCode::FAILURE;
        }
        return exit(perf(sweep, transport, devices, *slot_bytes));
    }
    if let Command::Doctor { json, no_live } = cli.command {
        return match Config::from_env().and_then(|c| nodetour_tools::doctor::examine(&c, !no_live))
        {
            Ok(report) => {
                if json {
                    println!(
                        "{}",
                        serde_json::to_string_pretty(&nodetour_tools::doctor::render_json(&report))
                            .unwrap_or_default()
                    );
                } else {
                    print!("{}", nodetour_tools::doctor::render_text(&report));
                }
                ExitCode::from(report.exit_code())
            }
            Err(e) => {
                eprintln!("nodetour: error: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let result = Config::from_env().and_then(|config| {
        tracing::debug!(settings = %config.describe(), "nodetour starting");
        match cli.command {
            Command::Doctor { .. } | Command::Perf { .. } => unreachable!("handled above"),
            Command::Devices => devices(&config),
            Command::Gpus => gpus(&config),
            Command::WriteBw {
                listen,
                connect,
                size,
                iters,
                tx_depth,
                no_verify,
            } => {
                let opts = WriteBwOptions {
                    size,
                    iters,
                    tx_depth,
                    verify: !no_verify,
                };
                let report = match (listen, connect) {
                    (Some(addr), _) => write_bw::run_server(&config, &addr, &token()?, opts)?,
                    (None, Some(addr)) => write_bw::run_client(&config, &addr, &token()?, opts)?,
                    (None, None) => unreachable!("clap requires one of them"),
                };
                println!("{}", report.line());
                Ok(())
            }
            Command::WriteLat {
                listen,
                connect,
                size,
                iters,
            } => {
                let opts = write_lat::WriteLatOptions { size, iters };
                let report = match (listen, connect) {
                    (Some(addr), _) => write_lat::run_server(&config, &addr, &token()?, opts)?,
                    (None, Some(addr)) => write_lat::run_client(&config, &addr, &token()?, opts)?,
                    (None, None) => unreachable!("clap requires one of them"),
                };
                println!("{}", report.line());
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unsupported() => {
            eprintln!("nodetour: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("nodetour: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn devices(config: &Config) -> Result<(), Error> {
    let list = verbs::devices()?;
    if list.is_empty() {
        return Err(Error::NoDevice {
            reason: "libibverbs lists no device (no RDMA NIC, no driver loaded, or /dev/infiniband not visible in this container)".into(),
        });
    }
    let entry = library::optional_entry_points()?;
    println!(
        "libibverbs: loaded; ibv_reg_mr_iova2 {}; ibv_reg_dmabuf_mr {}",
        if entry.reg_mr_iova2 {
            "present"
        } else {
            "missing"
        },
        if entry.reg_dmabuf_mr {
            "present"
        } else {
            "missing (rdma-core < 34)"
        }
    );
    for info in &list {
        println!(
            "{}: guid {:016x} pci {} numa {}",
            info.name,
            info.guid,
            info.pci_path
                .as_ref()
                .map_or("none (software device)".into(), |p| p.display().to_string()),
            info.numa_node.map_or("unknown".into(), |n| n.to_string())
        );
        let context = match Context::open(&info.name) {
            Ok(c) => c,
            Err(e) => {
                println!("  cannot open: {e}");
                continue;
            }
        };
        let a = context.attributes();
        println!(
            "  firmware {} vendor {:#x}:{:#x} ports {} max_qp_wr {} max_cqe {} max_mr_size {}",
            a.firmware,
            a.vendor_id,
            a.vendor_part_id,
            a.ports,
            a.max_qp_wr,
            a.max_cqe,
            a.max_mr_size
        );
        for port in 1..=a.ports {
            match context.port(port) {
                Ok(p) => {
                    let gid = context.choose_gid(&p, config.gid_index).map_or_else(
                        |e| format!("none ({e})"),
                        |g| format!("{} [{}]", g.index, g.reason),
                    );
                    println!(
                        "  port {}: {} {:?} mtu {} (max {}) lid {} rate {} gid {}",
                        port,
                        p.state.name(),
                        p.link_layer,
                        p.active_mtu.map_or(0, |m| m.bytes()),
                        p.max_mtu.map_or(0, |m| m.bytes()),
                        p.lid,
                        p.rate_gbps()
                            .map_or("unknown".into(), |r| format!("{r} Gb/s")),
                        gid
                    );
                }
                Err(e) => println!("  port {port}: {e}"),
            }
        }
        if let Ok(pd) = verbs::ProtectionDomain::new(&context) {
            println!("  dma-buf registration: {:?}", pd.probe_dmabuf());
        }
    }
    Ok(())
}

fn gpus(config: &Config) -> Result<(), Error> {
    use nodetour_core::registration::{self, Probe};
    let version = nodetour_core::cuda::availability()?;
    let mode = config.gdr;
    println!("CUDA driver: {}.{}", version / 1000, (version % 1000) / 10);
    let mut contexts = Vec::new();
    for gpu in nodetour_core::cuda::gpus()? {
        println!(
            "gpu {}: {} pci {} sm_{}{} memory {} GiB",
            gpu.ordinal,
            gpu.name,
            gpu.pci_bus_id,
            gpu.compute_capability.0,
            gpu.compute_capability.1,
            gpu.total_memory >> 30
        );
        println!("  GPUDirect attributes: {:?}", gpu.gdr);
        let context = cudarc::driver::CudaContext::new(gpu.ordinal).map_err(|e| Error::Cuda {
            op: "cuDevicePrimaryCtxRetain",
            code: format!("{e:?}"),
            hint: "",
        })?;
        contexts.push(context.clone());
        let buffer = nodetour_core::memory::DeviceBuffer::new(&context, 64 << 20)?;
        match buffer.export_dmabuf() {
            Ok(x) => println!(
                "  dma-buf export of a 64 MiB buffer: ok ({} bytes, fd {:?})",
                x.len, x.fd
            ),
            Err(e) => println!("  dma-buf export of a 64 MiB buffer: failed: {e}"),
        }
        let pci = gpu.pci_path();
        let nic = verbs::Context::open_chosen(
            config,
            verbs::Near::Gpu(pci.as_deref().unwrap_or(std::path::Path::new("/"))),
        );
        let probe = match &nic {
            Ok((ctx, choice)) => {
                println!("  NIC: {} ({})", ctx.name(), choice.reason);
                let pd = verbs::ProtectionDomain::new(ctx)?;
                let probe = Probe::gather(Ok(gpu.gdr.clone()), Ok(&pd));
                let outcome =
                    registration::register_gpu(&pd, buffer, &probe, mode, verbs::Access::REMOTE)?;
                println!("  registration: {}", outcome.describe());
                continue;
            }
            Err(e) => {
                let why = match e {
                    Error::NoDevice { reason } => reason.clone(),
                    other => other.to_string(),
                };
                Probe {
                    gpu: Ok(gpu.gdr.clone()),
                    nic: Err(why.clone()),
                    nic_dmabuf: verbs::DmabufSupport::Unknown(why),
                    peermem: registration::peermem_state(std::path::Path::new("/")),
                }
            }
        };
        let plan = registration::plan(&probe, mode);
        let reasons: Vec<String> = plan
            .refused
            .iter()
            .map(|r| format!("{}: {}", r.rung, r.reason))
            .collect();
        println!("  registration: staged; {}", reasons.join("; "));
    }
    if contexts.len() > 1 {
        println!(
            "GPU to GPU (the direct GPU ring in one process needs peer access between ring neighbours):"
        );
        for (i, a) in contexts.iter().enumerate() {
            for (j, b) in contexts.iter().enumerate().filter(|(j, _)| *j != i) {
                let can = nodetour_core::cuda::can_access_peer(a, b)?;
                println!(
                    "  gpu {i} -> gpu {j}: {}",
                    if can {
                        "peer access (direct)"
                    } else {
                        "no peer access: no NVLink or PCIe peer-to-peer between them"
                    }
                );
            }
        }
    }
    Ok(())
}

/// Prints the rows and draws the plot when asked.
fn report(
    sweep: &SweepArgs,
    spec: &nodetour_tools::perf_gpu::SweepSpec,
    rows: &[nodetour_tools::perf_gpu::GpuRow],
    what: &str,
    path: &str,
) -> anyhow::Result<()> {
    use nodetour_tools::perf_gpu::{render, series};
    let (dtype, op) = (spec.dtype, spec.op);
    print!("{}", render(rows, &sweep.format, what, path, dtype, op));
    if let Some(file) = &sweep.plot {
        let title = format!("all_reduce {dtype:?} {op:?}, {what}");
        std::fs::write(file, nodetour_tools::plot::svg(&title, &series(rows)))?;
        eprintln!("plot: {}", file.display());
    }
    Ok(())
}

fn perf_gpus(sweep: &SweepArgs, gpu: &GpuArgs) -> anyhow::Result<bool> {
    use nodetour_tools::perf_gpu::sweep as run;
    if gpu.path == "staged" || gpu.path == "both" {
        anyhow::bail!(
            "--gpus runs the direct ring of one process; the staged path runs one GPU per \
             process: use --gpu under a launcher"
        );
    }
    let spec = gpu.spec(sweep)?;
    let (path, rows) = run(&gpu.gpus, &spec, gpu.kernel_copy_max, gpu.one_step_max)?;
    let what = format!("GPUs {:?} (one process)", gpu.gpus);
    report(sweep, &spec, &rows, &what, &path)?;
    Ok(rows
        .iter()
        .all(|r| r.nodetour.2 && r.nccl.is_none_or(|x| x.2)))
}

fn perf_handoff(sweep: &SweepArgs) -> anyhow::Result<bool> {
    use nodetour_tools::perf::{human_size, parse_sizes};
    let sizes = parse_sizes(&sweep.sizes, sweep.factor)?;
    let spin = nodetour::Config::from_env()?.net_spin;
    let rows = nodetour_tools::perf_handoff::handoff(0, &sizes, sweep.iters.max(1))?;
    println!(
        "# nodetour perf --handoff: one chunk, stream -> link thread -> tcp loopback -> link \
         thread -> stream, on GPU 0 (link threads spin {} us, then nap); median of {} chunks",
        spin.as_micros(),
        sweep.iters.max(1)
    );
    println!(
        "{:>12} {:>14} {:>12} {:>12}",
        "size", "network(us)", "local(us)", "added(us)"
    );
    for r in &rows {
        println!(
            "{:>12} {:>14.1} {:>12.1} {:>12.1}",
            human_size(r.bytes),
            r.network_us,
            r.local_us,
            r.network_us - r.local_us
        );
    }
    Ok(true)
}

fn perf_ring(sweep: &SweepArgs, gpu: &GpuArgs) -> anyhow::Result<bool> {
    use nodetour::ring::comm::GpuRingOptions;
    use nodetour_tools::gpu_job::{GpuJob, ring_path, variants_of};
    use nodetour_tools::perf_gpu::ring_sweep;
    let config = Config::from_env()?;
    let spec = gpu.spec(sweep)?;
    let g = GpuJob::form(
        &variants_of(&gpu.path)?,
        GpuRingOptions::default(),
        spec.compare_nccl,
    )?;
    let rows = ring_sweep(&g, &spec, config.timeout)?;
    if g.rank == 0 {
        let what = format!("{} processes, one GPU each", g.world);
        let path = g
            .variants
            .iter()
            .map(|v| ring_path(&v.comm))
            .collect::<Vec<_>>()
            .join(" | ");
        report(sweep, &spec, &rows, &what, &path)?;
    }
    g.close(nodetour_core::Deadline::after(config.timeout))?;
    Ok(rows
        .iter()
        .all(|r| r.nodetour.2 && r.nccl.is_none_or(|x| x.2)))
}

fn perf_p2p(
    sweep: &SweepArgs,
    transport: &str,
    devices: &[String],
    slot_bytes: usize,
) -> anyhow::Result<bool> {
    use nodetour_tools::perf::parse_sizes;
    use nodetour_tools::perf_p2p::{render, sweep as run};
    let sizes = parse_sizes(&sweep.sizes, sweep.factor)?;
    let options = host_options(transport, devices, slot_bytes)?;
    let timeout = options.timeout();
    let comm = nodetour::Communicator::from_env(options)?;
    let rows = run(&comm, &sizes, sweep.warmup, sweep.iters)?;
    if comm.rank() == 0 {
        print!(
            "{}",
            render(&rows, &sweep.format, &comm.paths().to_string())
        );
    }
    comm.close(nodetour_core::Deadline::after(timeout))?;
    Ok(rows.iter().all(|r| r.correct))
}

/// The options of a host-buffer sweep: the environment's, with `transport`, `devices` and
/// `slot_bytes`.
fn host_options(
    transport: &str,
    devices: &[String],
    slot_bytes: usize,
) -> anyhow::Result<nodetour::Options> {
    let mut options = nodetour::Options::from_env()?;
    options.transport = Some(match transport {
        "tcp" => nodetour::core::transport::TransportKind::Tcp,
        "verbs" => nodetour::core::transport::TransportKind::Verbs,
        other => anyhow::bail!("perf runs host buffers over tcp or verbs, not {other}"),
    });
    options.devices = devices.to_vec();
    options.slot_bytes = slot_bytes;
    Ok(options)
}

fn perf(
    sweep: &SweepArgs,
    transport: &str,
    devices: &[String],
    slot_bytes: usize,
) -> anyhow::Result<bool> {
    use nodetour_tools::perf::{parse_dtype, parse_op, parse_sizes, render, sweep as run};
    let (sizes, dtype, op) = (
        parse_sizes(&sweep.sizes, sweep.factor)?,
        parse_dtype(&sweep.dtype)?,
        parse_op(&sweep.op)?,
    );
    let mut options = host_options(transport, devices, slot_bytes)?;
    // One piece per collective at every size measured (as the ring ran before pieces), and
    // at least the default staging region: a small allreduce gathers every rank's input
    // (world × its size), which a region of the largest size alone would split.
    options.piece_bytes = sizes
        .iter()
        .copied()
        .max()
        .unwrap_or(8)
        .max(nodetour::ring::comm::DEFAULT_PIECE_BYTES);
    let timeout = options.timeout();
    let comm = nodetour::Communicator::from_env(options)?;
    if comm.rank() == 0 && sweep.format != "json" && sweep.format != "csv" {
        println!("# paths: {}", comm.paths());
    }
    let rows = run(&comm, &sizes, dtype, op, sweep.warmup, sweep.iters)?;
    if comm.rank() == 0 {
        print!(
            "{}",
            render(&rows, &sweep.format, comm.world(), transport, dtype, op)
        );
    }
    comm.close(nodetour_core::Deadline::after(timeout))?;
    Ok(rows.iter().all(|r| r.correct))
}

/// The pair's job token for the two-node commands (`NODETOUR_JOB_TOKEN`, else an
/// unauthenticated `NODETOUR_JOB_ID`, else an error saying how to set one).
fn token() -> nodetour_core::Result<nodetour_core::auth::JobToken> {
    nodetour_net::bootstrap::explicit_job_token()
}

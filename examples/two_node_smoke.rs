//! Two-node smoke test: two processes (on two nodes, or two RDMA devices of one machine) each
//! register a buffer, write a known pattern into the other's buffer with RDMA WRITE, ring the
//! peer with a final RDMA WRITE_WITH_IMM, verify what they received end to end, and print the
//! device, GID, MTU and bandwidth.
//!
//! ```text
//! # node A (rank 0, listens)                         # node B (rank 1, connects)
//! two_node_smoke --rank 0 --addr 0.0.0.0:18517        two_node_smoke --rank 1 --addr nodeA:18517
//! ```
//! With `--gpu` the buffers are GPU memory (GPU `LOCAL_RANK`, else the rank): the example
//! prints the GPU, whether it exports dma-bufs, the registration rung it got (dma-buf, peermem
//! or staged) and the reason of each rung it did not get, picks the NIC nearest to the GPU, and
//! moves the data on that path: straight into GPU memory, or staged through host memory.
//!
//! Without `--rank`/`--addr` it reads its launcher as the communicator does (torchrun, Slurm,
//! Open MPI, MPICH; `nodetour::net::bootstrap::LaunchInfo`), so a launcher starts both ranks:
//!
//! ```text
//! srun -N 2 --ntasks-per-node 1 target/release/examples/two_node_smoke --gpu
//! torchrun --nnodes 2 --nproc-per-node 1 --node-rank $NODE_RANK --master-addr $HEAD --no-python \
//!     target/release/examples/two_node_smoke --gpu
//! ```
//! (rank 0's host from `MASTER_ADDR` or Slurm's node list; the port from `NODETOUR_PORT`,
//! `MASTER_PORT + 17`, or the launcher's job and step id).
//! Choose the device with `NODETOUR_IB_DEVICE`, the GID with `NODETOUR_IB_GID_INDEX`, the GPU
//! path with `NODETOUR_GDR=auto|force|off`. Prints `SMOKE OK ...` and exits 0 on success; exits 2
//! (with the reason) where the machine lacks an RDMA device, 1 on any other failure.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use cudarc::driver::CudaContext;
use nodetour_core::cuda::{self, GpuInfo};
use nodetour_core::memory::{DeviceBuffer, HostBuffer, RdmaBuffer};
use nodetour_core::registration::{self, GdrMode, Probe, Registration};
use nodetour_core::verbs::{
    Access, Completion, DmabufSupport, MemoryRegion, Near, QueuePairOptions,
};
use nodetour_core::{Config, Deadline, Error};
use nodetour_tools::link::{LocalSide, PeerLink, Role};
use nodetour_tools::oob::MessageKind;

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
    /// Use GPU buffers (direct path when a registration rung works, else staged).
    #[arg(long)]
    gpu: bool,
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
    nodetour_tools::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let unsupported = e
                .downcast_ref::<Error>()
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
    let launch = match (args.rank, &args.addr) {
        (Some(_), Some(_)) => None,
        _ => Some(
            nodetour_net::bootstrap::LaunchInfo::from_env()
                .context("no --rank/--addr, and no launcher in the environment")?,
        ),
    };
    if let Some(l) = launch.as_ref().filter(|l| l.world_size != 2) {
        bail!(
            "this smoke test runs with exactly two ranks, the launcher started {}",
            l.world_size
        );
    }
    let rank = match (args.rank, &launch) {
        (Some(r), _) => r,
        (None, Some(l)) => l.rank,
        (None, None) => unreachable!("a launcher was read without --rank"),
    };
    if rank > 1 {
        bail!("this smoke test runs with exactly two ranks (0 and 1), got rank {rank}");
    }
    if args.size == 0 || args.chunk == 0 {
        bail!("--size and --chunk must be positive");
    }
    let addr = match (&args.addr, &launch) {
        (Some(a), _) => a.clone(),
        (None, Some(l)) if rank == 0 => format!("0.0.0.0:{}", l.port),
        (None, Some(l)) => l.rendezvous_addr(),
        (None, None) => unreachable!("a launcher was read without --addr"),
    };
    let config = Config::from_env()?;
    let role = if rank == 0 {
        Role::Listen(addr)
    } else {
        Role::Connect(addr)
    };
    let smoke = Smoke {
        rank,
        size: args.size,
        chunk: args.chunk,
        config,
        role,
    };

    let gpu = if args.gpu { open_gpu(rank)? } else { None };
    let gpu_path = gpu.as_ref().and_then(|(_, info)| info.pci_path());
    let near = gpu_path.as_deref().map_or(Near::Host, Near::Gpu);
    let local = match LocalSide::open(&smoke.config, near) {
        Ok(local) => local,
        Err(e) => {
            if let Some((_, info)) = &gpu {
                report_without_nic(rank, info, &e);
            }
            return Err(e.into());
        }
    };
    println!(
        "rank {rank}: device {} chosen because: {}; GID: {}",
        local.context.name(),
        local.device.reason,
        local.gid.reason
    );
    let Some((context, info)) = gpu else {
        let region =
            MemoryRegion::register(&local.pd, HostBuffer::new(2 * smoke.size)?, Access::REMOTE)?;
        return smoke.exchange(local, region, &HostIo, "host");
    };
    let buffer = DeviceBuffer::new(&context, 2 * smoke.size)?;
    let probe = Probe::gather(Ok(info.gdr.clone()), Ok(&local.pd));
    let outcome =
        registration::register_gpu(&local.pd, buffer, &probe, smoke.config.gdr, Access::REMOTE)?;
    println!(
        "rank {rank}: GPU buffer registration: {}",
        outcome.describe()
    );
    match outcome {
        Registration::Direct { region, rung, .. } => {
            smoke.exchange(local, region, &GpuDirectIo, &format!("gpu-direct-{rung}"))
        }
        Registration::Staged { buffer, .. } => {
            let region = MemoryRegion::register(
                &local.pd,
                HostBuffer::new(2 * smoke.size)?,
                Access::REMOTE,
            )?;
            smoke.exchange(local, region, &StagedIo { device: buffer }, "gpu-staged")
        }
    }
}

/// Opens the GPU this rank uses and reports it, or says why there is none.
fn open_gpu(rank: u32) -> anyhow::Result<Option<(Arc<CudaContext>, GpuInfo)>> {
    let gpus = match cuda::gpus() {
        Ok(g) if !g.is_empty() => g,
        Ok(_) => {
            println!("rank {rank}: GPU: none (CUDA lists no GPU); using host memory");
            return Ok(None);
        }
        Err(e) => {
            println!("rank {rank}: GPU: none ({e}); using host memory");
            return Ok(None);
        }
    };
    let local_rank: usize = env(&["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"])
        .and_then(|v| v.parse().ok())
        .unwrap_or(rank as usize);
    let info = gpus[local_rank % gpus.len()].clone();
    let context = CudaContext::new(info.ordinal)
        .map_err(|e| anyhow::anyhow!("opening GPU {}: {e:?}", info.ordinal))?;
    let probe = DeviceBuffer::new(&context, 64 << 10)?;
    let export = match probe.export_dmabuf() {
        Ok(x) => format!("dma-buf export ok ({} bytes)", x.len),
        Err(e) => format!("dma-buf export failed: {e}"),
    };
    println!(
        "rank {rank}: GPU {} {} pci {} ({export}; GPUDirect RDMA supported: {})",
        info.ordinal, info.name, info.pci_bus_id, info.gdr.gpu_direct_rdma
    );
    Ok(Some((context, info)))
}

/// Without an RDMA device the ladder can still say what GPU memory would get, and why.
fn report_without_nic(rank: u32, info: &GpuInfo, e: &Error) {
    let why = match e {
        Error::NoDevice { reason } => reason.clone(),
        other => other.to_string(),
    };
    let probe = Probe {
        gpu: Ok(info.gdr.clone()),
        nic: Err(why.clone()),
        nic_dmabuf: DmabufSupport::Unknown(why),
        peermem: registration::peermem_state(std::path::Path::new("/")),
    };
    let mode = Config::from_env().map_or(GdrMode::Auto, |c| c.gdr);
    let plan = registration::plan(&probe, mode);
    let reasons: Vec<String> = plan
        .refused
        .iter()
        .map(|r| format!("{}: {}", r.rung, r.reason))
        .collect();
    println!(
        "rank {rank}: GPU buffer registration: staged; {}",
        reasons.join("; ")
    );
}

/// How the pattern gets into the send half and the received half gets out, per memory kind.
trait Payload<B: RdmaBuffer> {
    fn fill(&self, region: &MemoryRegion<B>, bytes: &[u8]) -> anyhow::Result<()>;
    fn received(
        &self,
        region: &MemoryRegion<B>,
        offset: usize,
        len: usize,
    ) -> anyhow::Result<Vec<u8>>;
}

/// Host memory: copies in and out of the region.
struct HostIo;

impl Payload<HostBuffer> for HostIo {
    fn fill(&self, region: &MemoryRegion<HostBuffer>, bytes: &[u8]) -> anyhow::Result<()> {
        Ok(region.write_at(0, bytes)?)
    }
    fn received(
        &self,
        region: &MemoryRegion<HostBuffer>,
        offset: usize,
        len: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let mut out = vec![0; len];
        region.read_at(offset, &mut out)?;
        Ok(out)
    }
}

/// GPU memory the NIC writes directly: the GPU copies the pattern in and the result out.
struct GpuDirectIo;

impl Payload<DeviceBuffer> for GpuDirectIo {
    fn fill(&self, region: &MemoryRegion<DeviceBuffer>, bytes: &[u8]) -> anyhow::Result<()> {
        Ok(region.device_buffer().copy_from_host(0, bytes)?)
    }
    fn received(
        &self,
        region: &MemoryRegion<DeviceBuffer>,
        offset: usize,
        len: usize,
    ) -> anyhow::Result<Vec<u8>> {
        // NIC writes are made visible to the GPU's own reads; then the GPU copies them out.
        cuda::flush_rdma_writes(region.device_buffer().context())?;
        let mut out = vec![0; len];
        region.device_buffer().copy_to_host(offset, &mut out)?;
        Ok(out)
    }
}

/// GPU memory staged through a registered host region: GPU → host before sending, host → GPU
/// after receiving, and the check reads the GPU copy.
struct StagedIo {
    device: DeviceBuffer,
}

impl Payload<HostBuffer> for StagedIo {
    fn fill(&self, region: &MemoryRegion<HostBuffer>, bytes: &[u8]) -> anyhow::Result<()> {
        self.device.copy_from_host(0, bytes)?;
        let mut staged = vec![0; bytes.len()];
        self.device.copy_to_host(0, &mut staged)?;
        Ok(region.write_at(0, &staged)?)
    }
    fn received(
        &self,
        region: &MemoryRegion<HostBuffer>,
        offset: usize,
        len: usize,
    ) -> anyhow::Result<Vec<u8>> {
        let mut staged = vec![0; len];
        region.read_at(offset, &mut staged)?;
        self.device.copy_from_host(offset, &staged)?;
        let mut out = vec![0; len];
        self.device.copy_to_host(offset, &mut out)?;
        Ok(out)
    }
}

struct Smoke {
    rank: u32,
    size: usize,
    chunk: usize,
    config: Config,
    role: Role,
}

impl Smoke {
    /// Connects, writes the first half of our region into the second half of the peer's,
    /// verifies what arrived in ours, and reports.
    fn exchange<B: RdmaBuffer>(
        &self,
        local: LocalSide,
        region: MemoryRegion<B>,
        io: &impl Payload<B>,
        path: &str,
    ) -> anyhow::Result<()> {
        let (rank, size, config) = (self.rank, self.size, &self.config);
        let options = QueuePairOptions {
            send_depth: 64,
            recv_depth: 4,
            max_inline: 0,
        };
        // The pair proves NODETOUR_JOB_TOKEN on its out-of-band channel.
        let token = nodetour_net::bootstrap::explicit_job_token()?;
        let mut link = PeerLink::connect(
            config,
            local,
            Arc::new(region),
            &self.role,
            &token,
            options,
            Deadline::after(config.timeout),
        )?;
        println!("rank {rank}: {}", link.describe());
        let send: Vec<u8> = (0..size).map(|i| pattern(rank, i)).collect();
        io.fill(&link.region, &send)?;

        let start = Instant::now();
        let mut offset = 0;
        while offset < size {
            let end = (offset + self.chunk).min(size);
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
                    Err(Error::SendQueueFull { .. }) => {
                        link.qp
                            .wait(&mut Vec::new(), Deadline::after(config.timeout))?;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            offset = end;
        }
        // Our writes are done when the signalled doorbell completes; the peer's have landed when
        // its doorbell's immediate arrives (it covers every earlier write on the queue pair).
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
        let got = io.received(&link.region, size, size)?;
        let peer = 1 - rank;
        if let Some(bad) = got
            .iter()
            .enumerate()
            .position(|(i, b)| *b != pattern(peer, i))
        {
            let msg = format!("rank {rank} found corruption at byte {bad}");
            link.channel.send(
                MessageKind::Failed,
                msg.as_bytes(),
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
            "SMOKE OK rank={rank} path={path} device={} gid_index={} mtu={} bytes={size} write_seconds={secs:.3} MB_per_s={:.2} verified_bytes={size} checksum={checksum}",
            link.local.context.name(),
            link.local.gid.index,
            link.mtu_bytes(),
            size as f64 / secs.max(1e-9) / 1_048_576.0
        );
        Ok(())
    }
}

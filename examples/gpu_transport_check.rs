//! In-host GPU transports between two processes, one GPU each (run on a two-GPU machine):
//!
//! ```text
//! NCCL_NVLS_ENABLE=0 scripts/launch-local.sh -n 2 -- target/release/examples/gpu_transport_check
//! ```
//! 1. cuda-ipc: each rank writes 256 MiB from its GPU straight into the other's GPU slot and
//!    sets its flag; each verifies what it received. Then rank 1 times its write into rank 0
//!    (CUDA events, median of 5) and, in the same process, a cuMemcpyPeer-style copy between
//!    the same two GPUs (the reference), and prints the ratio.
//! 2. shm: rank 1 sends 1 GiB from its GPU to rank 0's GPU through shared host memory in 8 MiB
//!    chunks, D2H and H2D pipelined by flags on both streams; rank 0 verifies and times it; the
//!    reference is this machine's pinned D2H bandwidth measured in the same run.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use cudarc::driver::CudaContext;
use nodetour_core::cuda::{GpuStream, enable_peer_access};
use nodetour_core::memory::{DeviceBuffer, HostBuffer, ShmName};
use nodetour_core::transport::gpu::{
    CudaIpcSender, Flags, GpuSlot, IpcGrant, ShmSender, ShmSlot, StagedReceive,
};
use nodetour_core::{Config, Deadline};
use nodetour_net::bootstrap::{HostIdentity, LaunchInfo};
use nodetour_tools::blob::{put, rendezvous, take};
use nodetour_tools::perf::median;

const IPC_BYTES: usize = 256 << 20;
const SHM_BYTES: usize = 1 << 30;
const CHUNK: usize = 8 << 20;
const RUNS: usize = 5;

fn main() -> ExitCode {
    nodetour_tools::logging::init();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu_transport_check: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn pattern(rank: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            ((i as u32).wrapping_mul(2_654_435_761) >> 24) as u8 ^ (rank as u8).wrapping_mul(37)
        })
        .collect()
}

fn run() -> anyhow::Result<()> {
    let config = Config::from_env()?;
    let info = LaunchInfo::from_env()?;
    let (me, world) = (info.rank, info.world_size);
    if world != 2 {
        bail!("run with exactly 2 ranks (one GPU each)");
    }
    let peer = 1 - me;
    let gpu = info.local_rank.unwrap_or(me) as usize;
    let ctx = CudaContext::new(gpu).map_err(|e| anyhow::anyhow!("GPU {gpu}: {e:?}"))?;
    let stream = GpuStream::new(&ctx)?;

    // What this rank receives into, announced before the rendezvous.
    let flags = Flags::create(&ctx, world)?;
    let slot = GpuSlot::new(&ctx, IPC_BYTES)?;
    let shm = ShmSlot::create(&ctx, SHM_BYTES)?;
    let (shm_path, shm_len) = shm.grant();
    let mut blob = Vec::new();
    put(&mut blob, &slot.ipc_grant()?.encode());
    put(&mut blob, &flags.name().encode());
    put(&mut blob, &shm_path.encode());
    blob.extend_from_slice(&(shm_len as u64).to_be_bytes());
    let deadline = Deadline::after(config.timeout);
    let job = rendezvous(&info, &config, String::new(), blob)?;
    let theirs = &job.peers()[peer as usize];
    if !theirs.host.same_host(&HostIdentity::current()) {
        bail!("the peer is on another host: the in-host transports do not apply");
    }
    let mut at = 0;
    let grant = IpcGrant::decode(take(&theirs.blob, &mut at)?)?;
    let flags_path = ShmName::decode(take(&theirs.blob, &mut at)?)?;
    let peer_shm = ShmName::decode(take(&theirs.blob, &mut at)?)?;
    let peer_shm_len = u64::from_be_bytes(
        theirs
            .blob
            .get(at..at + 8)
            .context("short blob")?
            .try_into()?,
    ) as usize;
    let ipc = CudaIpcSender::open(&ctx, &grant, Flags::open(&ctx, &flags_path, world)?, me)?;
    let staged = ShmSender::open(
        &ctx,
        &peer_shm,
        peer_shm_len,
        Flags::open(&ctx, &flags_path, world)?,
        me,
    )?;
    job.barrier(deadline)?;
    // Every peer has mapped our files: remove their names (nothing is left behind on a crash).
    flags.unlink()?;
    shm.unlink()?;
    println!("rank {me}: GPU {gpu}, shm slot on {:?}", shm.pages());

    // 1. cuda-ipc, both ways at once, verified.
    let src = DeviceBuffer::new(&ctx, IPC_BYTES)?;
    src.copy_from_host(0, &pattern(me, IPC_BYTES))?;
    ipc.enqueue_write(&stream, &src, 0, 0, IPC_BYTES, Some(1))?;
    flags.enqueue_wait(&stream, peer, 1)?;
    stream.synchronize()?;
    let mut got = vec![0u8; IPC_BYTES];
    slot.buffer().copy_to_host(0, &mut got)?;
    if got != pattern(peer, IPC_BYTES) {
        bail!("cuda-ipc: data from rank {peer} is corrupted");
    }
    println!(
        "rank {me}: cuda-ipc {IPC_BYTES} bytes from rank {peer} verified (flag {})",
        flags.read(peer)?
    );
    job.barrier(deadline)?;

    // cuda-ipc bandwidth, rank 1 → rank 0, against a peer copy between the same GPUs.
    if me == 1 {
        let mut ours = Vec::new();
        for run in 0..RUNS {
            let start = stream.record()?;
            ipc.enqueue_write(&stream, &src, 0, 0, IPC_BYTES, Some(10 + run as u32))?;
            let end = stream.record()?;
            ours.push(f64::from(start.elapsed_ms(&end)?) / 1e3);
        }
        let other =
            CudaContext::new(1 - gpu).map_err(|e| anyhow::anyhow!("GPU {}: {e:?}", 1 - gpu))?;
        enable_peer_access(&ctx, &other)?;
        let dst = DeviceBuffer::new(&other, IPC_BYTES)?;
        let mut refs = Vec::new();
        for _ in 0..RUNS {
            let start = stream.record()?;
            stream.copy(&dst, 0, &src, 0, IPC_BYTES)?;
            let end = stream.record()?;
            refs.push(f64::from(start.elapsed_ms(&end)?) / 1e3);
        }
        let (o, r) = (
            IPC_BYTES as f64 / median(ours) / 1e9,
            IPC_BYTES as f64 / median(refs) / 1e9,
        );
        println!(
            "CUDA_IPC_BENCH bytes={IPC_BYTES} runs={RUNS} cuda_ipc_GBps={o:.1} peer_copy_same_process_GBps={r:.1} ratio={:.2}",
            o / r
        );
    }
    job.barrier(deadline)?;

    // 2. shm: rank 1's GPU → shared host memory → rank 0's GPU, pipelined by flags.
    let chunks = SHM_BYTES / CHUNK;
    let base = 1000;
    if me == 1 {
        let big = DeviceBuffer::new(&ctx, SHM_BYTES)?;
        big.copy_from_host(0, &pattern(me, SHM_BYTES))?;
        // The reference: pinned D2H on this GPU, same run.
        let mut pinned = HostBuffer::new(SHM_BYTES)?;
        pinned.register_with_cuda(&ctx)?;
        let mut d2h = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            big.copy_to_host(0, pinned.as_mut_slice())?;
            d2h.push(t.elapsed().as_secs_f64());
        }
        let pinned_gbps = SHM_BYTES as f64 / median(d2h) / 1e9;
        job.barrier(deadline)?;
        for k in 0..chunks {
            staged.enqueue_write(
                &stream,
                &big,
                k * CHUNK,
                k * CHUNK,
                CHUNK,
                Some(base + k as u32 + 1),
            )?;
        }
        stream.synchronize()?;
        job.barrier(deadline)?;
        println!("SHM_REFERENCE pinned_d2h_GBps={pinned_gbps:.1}");
    } else {
        let dst = DeviceBuffer::new(&ctx, SHM_BYTES)?;
        job.barrier(deadline)?;
        let t = Instant::now();
        for k in 0..chunks {
            flags.enqueue_wait(&stream, peer, base + k as u32 + 1)?;
            shm.enqueue_copy_out(&stream, &dst, k * CHUNK, k * CHUNK, CHUNK)?;
        }
        stream.synchronize()?;
        let secs = t.elapsed().as_secs_f64();
        job.barrier(deadline)?;
        let mut got = vec![0u8; SHM_BYTES];
        dst.copy_to_host(0, &mut got)?;
        if got != pattern(peer, SHM_BYTES) {
            bail!("shm: data from rank {peer} is corrupted");
        }
        println!(
            "SHM_BENCH bytes={SHM_BYTES} chunk={CHUNK} gpu_to_gpu_through_shm_GBps={:.1} verified=true",
            SHM_BYTES as f64 / secs / 1e9
        );
    }
    job.barrier(deadline)?;
    std::thread::sleep(Duration::from_millis(50));
    drop(Arc::clone(&ctx));
    Ok(())
}

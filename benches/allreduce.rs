//! Allreduce throughput (busbw-style: bytes per rank per second) on every path this machine
//! has:
//! - host buffers, 4 ranks over the in-memory transport (CPU reduction), and 2 ranks over tcp on
//!   loopback is measured between processes by `nodetour perf` (scripts/test.sh prints it);
//! - GPU buffers where GPUs exist: the direct ring (`Communicator::from_devices` driven by a
//!   `Group`, each GPU reads its neighbour)
//!   beside the staged path (chunks through host slots, reduced on the GPU), side by side on
//!   the same GPUs and buffers; else `SKIP` with the reason.
//!
//! NCCL and the copy ceilings are compared by `nodetour perf --compare nccl,ceiling`, which
//! needs one process per GPU for the per-process paths; see docs/PERFORMANCE.md.

use std::sync::Arc;
use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use cudarc::driver::CudaContext;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::{Communicator, Group, Options};
use nodetour_ring::host::{GpuStaging, HostRingOptions};
use nodetour_ring::local::LocalRing;
use nodetour_ring::{DataType, ReduceOp};

const HOST_SIZES: [usize; 2] = [256 << 10, 4 << 20];
const GPU_SIZES: [usize; 3] = [1 << 20, 16 << 20, 256 << 20];

fn options() -> HostRingOptions {
    HostRingOptions {
        slot_bytes: 1 << 20,
        slots: 4,
        timeout: Duration::from_secs(30),
    }
}

fn host(c: &mut Criterion) {
    let mut g = c.benchmark_group("allreduce_host_mem_4_ranks");
    let mut ring = LocalRing::new(4, HOST_SIZES[1], options()).expect("ring");
    for bytes in HOST_SIZES {
        let mut data = vec![vec![0u8; bytes]; 4];
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("f32_sum_{}KiB", bytes >> 10), |b| {
            b.iter(|| {
                ring.all_reduce(&mut data, DataType::F32, ReduceOp::Sum)
                    .expect("allreduce")
            })
        });
    }
    g.finish();
}

fn gpu(c: &mut Criterion) {
    if let Err(e) = nodetour_core::cuda::availability() {
        return println!("SKIP allreduce_gpu_direct / allreduce_gpu_staged: {e}");
    }
    let n = match nodetour_core::cuda::gpus() {
        Ok(list) if !list.is_empty() => list.len(),
        Ok(_) => return println!("SKIP allreduce_gpu: no GPU"),
        Err(e) => return println!("SKIP allreduce_gpu: {e}"),
    };
    // Two ranks: on two GPUs where there are two, else both on GPU 0.
    let contexts: Vec<Arc<CudaContext>> = (0..2)
        .map(|r| CudaContext::new(r % n).expect("GPU"))
        .collect();
    let largest = *GPU_SIZES.last().expect("sizes");
    let buffers: Vec<DeviceBuffer> = contexts
        .iter()
        .map(|c| DeviceBuffer::new(c, largest).expect("buffer"))
        .collect();
    let streams: Vec<GpuStream> = contexts
        .iter()
        .map(|c| GpuStream::new(c).expect("stream"))
        .collect();
    let b: Vec<&DeviceBuffer> = buffers.iter().collect();
    let s: Vec<&GpuStream> = streams.iter().collect();
    let direct = match Communicator::from_devices(&contexts, Options::default()) {
        Ok(g) => Some(g),
        Err(e) => {
            println!("SKIP allreduce_gpu_direct: {e}");
            None
        }
    };
    let kernels: Vec<ReduceKernels> = contexts
        .iter()
        .map(|c| ReduceKernels::load(c).expect("kernels"))
        .collect();
    let scratch: Vec<DeviceBuffer> = contexts
        .iter()
        .map(|c| DeviceBuffer::new(c, options().slot_bytes).expect("scratch"))
        .collect();
    let staging: Vec<GpuStaging> = (0..2)
        .map(|r| GpuStaging {
            kernels: &kernels[r],
            stream: &streams[r],
            scratch: &scratch[r],
        })
        .collect();
    let mut staged = LocalRing::for_gpu(2, largest, options(), &contexts[0]).expect("ring");
    let mut g = c.benchmark_group(format!("allreduce_gpu_2_ranks_on_{}_gpus", n.min(2)));
    g.sample_size(10);
    for bytes in GPU_SIZES {
        let count = bytes / 4;
        g.throughput(Throughput::Bytes(bytes as u64));
        if let Some(comms) = direct.as_ref() {
            g.bench_function(format!("direct_f32_sum_{}MiB", bytes >> 20), |bn| {
                bn.iter(|| {
                    let mut group = Group::new();
                    for ((comm, buf), st) in comms.iter().zip(&b).zip(&s) {
                        group
                            .all_reduce_device_buffer(
                                comm,
                                buf,
                                count,
                                DataType::F32,
                                ReduceOp::Sum,
                                st,
                            )
                            .expect("direct");
                    }
                    group.end().expect("direct");
                    for st in &s {
                        st.synchronize().expect("sync");
                    }
                })
            });
        }
        g.bench_function(format!("staged_f32_sum_{}MiB", bytes >> 20), |bn| {
            bn.iter(|| {
                staged
                    .all_reduce_gpu(&b, count, DataType::F32, ReduceOp::Sum, &staging)
                    .expect("staged")
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(500));
    targets = host, gpu
}
criterion_main!(benches);

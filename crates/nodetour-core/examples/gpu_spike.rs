//! GPU design spike: measurements on a machine with two GPUs that decide the shape of the
//! in-host transports and the direct path (results in docs/gpu-design-spike.md).
//!
//! 1. Host memory for the staged path: hugepage memory registered with CUDA vs cuMemAllocHost.
//! 2. Copy ceilings: D2H+H2D on both GPUs at once (the staged path's bound); NVLink peer copies
//!    one way and both ways at once (the direct path's bound).
//! 3. A 2-rank allreduce step, three ways: copy engine into the peer's slot + reduce kernel
//!    (pipelined in chunks), a fused kernel that reads the peer's memory over NVLink and writes
//!    the sum to both GPUs, and the fused kernel as a reduce-scatter + copy-engine all-gather.
//! 4. Chunk hand-off between GPUs queued on streams (cuStreamWriteValue32 / cuStreamWaitValue32)
//!    against a host round trip per chunk.
//! 5. NVRTC: compile to CUBIN for the device's architecture, load it; against PTX + JIT load.
//!
//! Usage: gpu_spike [--bytes N] [--iters N]. Prints one `SPIKE key=value ...` line per figure.
//! This lives in nodetour-core (the one crate allowed `unsafe`) because it drives the CUDA
//! driver directly, below the safe layer it informs.

use std::ffi::{CString, c_void};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::result::{self, stream::StreamKind};
use cudarc::driver::sys::{self, CUdevice_attribute as A};
use cudarc::driver::{CudaContext, DriverError};
use nodetour_core::cuda::{self, nvrtc};
use nodetour_core::memory::{HostBuffer, Pages, RdmaBuffer};

const KERNELS: &str = r#"
extern "C" __global__ void fill_f32(float* __restrict__ x, float v, unsigned long long n) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) x[i] = v + (float)(i & 1023);
}
// dst[i] += src[i], float4 at a time (n4 = count of float4).
extern "C" __global__ void add_f32(float4* __restrict__ dst, const float4* __restrict__ src, unsigned long long n4) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float4 a = dst[i], b = src[i];
        a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
        dst[i] = a;
    }
}
// The 2-rank allreduce of one half in one pass: read the peer's half over NVLink, write the sum
// locally and into the peer.
extern "C" __global__ void fused_allreduce_f32(float4* __restrict__ mine, float4* __restrict__ peer, unsigned long long n4) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float4 a = mine[i], b = peer[i];
        a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
        mine[i] = a; peer[i] = a;
    }
}
// Reduce-scatter half of the fused scheme: mine[i] += peer[i] (peer read over NVLink).
extern "C" __global__ void reduce_from_peer_f32(float4* __restrict__ mine, const float4* __restrict__ peer, unsigned long long n4) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n4;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float4 a = mine[i], b = peer[i];
        a.x += b.x; a.y += b.y; a.z += b.z; a.w += b.w;
        mine[i] = a;
    }
}
"#;

type R<T> = Result<T, String>;

fn ck(r: Result<(), DriverError>, what: &str) -> R<()> {
    r.map_err(|e| format!("{what}: {e:?}"))
}

struct Gpu {
    ctx: Arc<CudaContext>,
    streams: Vec<sys::CUstream>,
    add: sys::CUfunction,
    fused: sys::CUfunction,
    reduce_from_peer: sys::CUfunction,
    fill: sys::CUfunction,
    blocks: u32,
}

impl Gpu {
    fn bind(&self) -> R<()> {
        ck(self.ctx.bind_to_thread(), "cuCtxSetCurrent")
    }

    fn sync(&self) -> R<()> {
        self.bind()?;
        for s in &self.streams {
            // SAFETY: s is a live stream of this context.
            ck(
                unsafe { result::stream::synchronize(*s) },
                "cuStreamSynchronize",
            )?;
        }
        Ok(())
    }

    fn alloc(&self, bytes: usize) -> R<sys::CUdeviceptr> {
        self.bind()?;
        // SAFETY: the context is current.
        unsafe { result::malloc_sync(bytes) }.map_err(|e| format!("cuMemAlloc({bytes}): {e:?}"))
    }

    /// Launches `f(a, b, n4)` on stream `s`.
    fn launch3(&self, f: sys::CUfunction, s: usize, a: u64, b: u64, n4: u64) -> R<()> {
        self.bind()?;
        let (mut a, mut b, mut n4) = (a, b, n4);
        let mut params = [
            (&mut a as *mut u64).cast::<c_void>(),
            (&mut b as *mut u64).cast::<c_void>(),
            (&mut n4 as *mut u64).cast::<c_void>(),
        ];
        // SAFETY: f takes (pointer, pointer, u64); the pointers name live allocations of at
        // least n4 float4 each, reachable from this GPU (peer access is enabled).
        ck(
            unsafe {
                result::launch_kernel(
                    f,
                    (self.blocks, 1, 1),
                    (512, 1, 1),
                    0,
                    self.streams[s],
                    &mut params,
                )
            },
            "cuLaunchKernel",
        )
    }

    fn fill(&self, x: u64, v: f32, n: u64) -> R<()> {
        self.bind()?;
        let (mut x, mut v, mut n) = (x, v, n);
        let mut params = [
            (&mut x as *mut u64).cast::<c_void>(),
            (&mut v as *mut f32).cast::<c_void>(),
            (&mut n as *mut u64).cast::<c_void>(),
        ];
        // SAFETY: fill_f32(float*, float, u64) over a live allocation of n floats.
        ck(
            unsafe {
                result::launch_kernel(
                    self.fill,
                    (self.blocks, 1, 1),
                    (512, 1, 1),
                    0,
                    self.streams[0],
                    &mut params,
                )
            },
            "cuLaunchKernel(fill)",
        )
    }

    fn copy(&self, s: usize, dst: u64, src: u64, bytes: usize) -> R<()> {
        self.bind()?;
        // SAFETY: both ranges are live allocations (or pinned host memory) of `bytes`, reachable
        // through unified addressing.
        ck(
            unsafe { result::memcpy_dtod_async(dst, src, bytes, self.streams[s]) },
            "cuMemcpyAsync",
        )
    }

    fn read_f32(&self, ptr: u64, index: usize) -> R<f32> {
        self.bind()?;
        let mut v = [0f32; 1];
        // SAFETY: ptr + index is inside a live allocation.
        ck(
            unsafe { result::memcpy_dtoh_sync(&mut v, ptr + 4 * index as u64) },
            "cuMemcpyDtoH",
        )?;
        Ok(v[0])
    }
}

fn setup(ordinal: usize, cubin: &[u8]) -> R<Gpu> {
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("context {ordinal}: {e:?}"))?;
    ck(ctx.bind_to_thread(), "bind")?;
    let sms = ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .unwrap_or(80) as u32;
    let streams = (0..4)
        .map(|_| {
            result::stream::create(StreamKind::NonBlocking).map_err(|e| format!("stream: {e:?}"))
        })
        .collect::<R<Vec<_>>>()?;
    // SAFETY: cubin is a complete CUBIN image for this GPU's architecture.
    let module = unsafe { result::module::load_data(cubin.as_ptr().cast()) }
        .map_err(|e| format!("cuModuleLoadData: {e:?}"))?;
    let get = |name: &str| {
        // SAFETY: module is loaded in the current context.
        unsafe { result::module::get_function(module, CString::new(name).unwrap()) }
            .map_err(|e| format!("{name}: {e:?}"))
    };
    Ok(Gpu {
        add: get("add_f32")?,
        fused: get("fused_allreduce_f32")?,
        reduce_from_peer: get("reduce_from_peer_f32")?,
        fill: get("fill_f32")?,
        blocks: sms * 4,
        streams,
        ctx,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// Runs `body` (which enqueues work) `iters` times after one warm-up, synchronising `gpus`
/// around each run; returns the median wall time in seconds.
fn time(gpus: &[&Gpu], iters: usize, mut body: impl FnMut() -> R<()>) -> R<f64> {
    let mut samples = Vec::new();
    for i in 0..=iters {
        for g in gpus {
            g.sync()?;
        }
        let t0 = Instant::now();
        body()?;
        for g in gpus {
            g.sync()?;
        }
        if i > 0 {
            samples.push(t0.elapsed().as_secs_f64());
        }
    }
    Ok(median(samples))
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

struct Pinned {
    ptr: *mut c_void,
}

impl Pinned {
    fn new(bytes: usize) -> R<Pinned> {
        // SAFETY: a context is current; flags: portable.
        let ptr = unsafe {
            result::malloc_host(
                bytes,
                sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP,
            )
        }
        .map_err(|e| format!("cuMemHostAlloc: {e:?}"))?;
        // SAFETY: ptr is a fresh host allocation of `bytes`; cuMemHostAlloc does not zero it.
        unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        Ok(Pinned { ptr })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // SAFETY: ptr came from malloc_host.
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

fn host_buffer(ctx: &Arc<CudaContext>, bytes: usize) -> R<HostBuffer> {
    let mut b = HostBuffer::new(bytes).map_err(|e| e.to_string())?;
    b.register_with_cuda(ctx).map_err(|e| e.to_string())?;
    Ok(b)
}

fn main() {
    let mut bytes: usize = 256 << 20;
    let mut iters = 5;
    let args: Vec<String> = std::env::args().collect();
    for w in args.windows(2) {
        match w[0].as_str() {
            "--bytes" => bytes = w[1].parse().expect("--bytes N"),
            "--iters" => iters = w[1].parse().expect("--iters N"),
            _ => {}
        }
    }
    if let Err(e) = run(bytes, iters) {
        println!("SPIKE error={e:?}");
        std::process::exit(1);
    }
}

fn run(bytes: usize, iters: usize) -> R<()> {
    let version = cuda::availability().map_err(|e| e.to_string())?;
    let gpus_info = cuda::gpus().map_err(|e| e.to_string())?;
    println!(
        "SPIKE driver_cuda_version={version} gpus={}",
        gpus_info.len()
    );
    for g in &gpus_info {
        println!(
            "SPIKE gpu={} name={:?} pci={} cc={}.{} gdr={:?}",
            g.ordinal, g.name, g.pci_bus_id, g.compute_capability.0, g.compute_capability.1, g.gdr
        );
    }
    let arch = gpus_info[0].compute_capability;

    // 5. NVRTC first: everything else needs the kernels.
    let t = Instant::now();
    let cubin = nvrtc::compile_cubin(KERNELS, "spike.cu", arch, &["--std=c++17"])
        .map_err(|e| e.to_string())?;
    let compile_cubin_ms = t.elapsed().as_secs_f64() * 1e3;
    let nv = nvrtc::version().map_err(|e| e.to_string())?;
    let gpu0 = setup(0, &cubin)?;
    let t = Instant::now();
    // SAFETY: as in setup.
    let m = unsafe { result::module::load_data(cubin.as_ptr().cast()) }
        .map_err(|e| format!("{e:?}"))?;
    let load_cubin_ms = t.elapsed().as_secs_f64() * 1e3;
    // SAFETY: m was loaded above and is not used again.
    let _ = unsafe { result::module::unload(m) };
    let t = Instant::now();
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(
        KERNELS,
        cudarc::nvrtc::CompileOptions {
            arch: Some(Box::leak(
                format!("compute_{}{}", arch.0, arch.1).into_boxed_str(),
            )),
            ..Default::default()
        },
    )
    .map_err(|e| format!("{e:?}"))?;
    let compile_ptx_ms = t.elapsed().as_secs_f64() * 1e3;
    let ptx_src = CString::new(ptx.to_src()).unwrap();
    let t = Instant::now();
    // SAFETY: a NUL-terminated PTX image; JIT-compiled by the driver.
    let m = unsafe { result::module::load_data(ptx_src.as_ptr().cast()) }
        .map_err(|e| format!("{e:?}"))?;
    let load_ptx_ms = t.elapsed().as_secs_f64() * 1e3;
    // SAFETY: unused afterwards.
    let _ = unsafe { result::module::unload(m) };
    println!(
        "SPIKE nvrtc={}.{} arch=sm_{}{} compile_cubin_ms={compile_cubin_ms:.1} load_cubin_ms={load_cubin_ms:.2} compile_ptx_ms={compile_ptx_ms:.1} load_ptx_jit_ms={load_ptx_ms:.1} cubin_bytes={}",
        nv.0,
        nv.1,
        arch.0,
        arch.1,
        cubin.len()
    );

    // 1. Host memory for the staged path, on GPU 0.
    {
        gpu0.bind()?;
        let d = gpu0.alloc(bytes)?;
        let pinned = Pinned::new(bytes)?;
        let huge = host_buffer(&gpu0.ctx, bytes)?;
        let pages = match huge.pages() {
            Pages::Huge2M => "2MiB".to_owned(),
            Pages::Base(why) => format!("base({why})"),
        };
        let row = |label: &str, host: u64| -> R<()> {
            let d2h = time(&[&gpu0], iters, || gpu0.copy(0, host, d, bytes))?;
            let h2d = time(&[&gpu0], iters, || gpu0.copy(0, d, host, bytes))?;
            println!(
                "SPIKE host_memory={label} bytes={bytes} d2h_GBps={:.1} h2d_GBps={:.1}",
                gbps(bytes, d2h),
                gbps(bytes, h2d)
            );
            Ok(())
        };
        row("cuMemAllocHost", pinned.ptr as u64)?;
        row(
            &format!("hugepage_registered pages={pages}"),
            huge.as_mut_ptr() as u64,
        )?;
        row("cuMemAllocHost_again", pinned.ptr as u64)?;
        gpu0.bind()?;
        // SAFETY: d came from malloc_sync and is no longer used.
        let _ = unsafe { result::free_sync(d) };
    }

    if gpus_info.len() < 2 {
        println!("SPIKE skip=two_gpu_measurements reason=\"one GPU\"");
        return Ok(());
    }
    let gpu1 = setup(1, &cubin)?;
    // Peer access both ways.
    let mut can = 0;
    // SAFETY: valid out-pointer and device handles.
    ck(
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, gpu0.ctx.cu_device(), gpu1.ctx.cu_device()) }
            .result(),
        "cuDeviceCanAccessPeer",
    )?;
    println!("SPIKE peer_access={can}");
    gpu0.bind()?;
    // SAFETY: gpu1's context is live.
    let _ = unsafe { sys::cuCtxEnablePeerAccess(gpu1.ctx.cu_ctx(), 0) };
    gpu1.bind()?;
    // SAFETY: gpu0's context is live.
    let _ = unsafe { sys::cuCtxEnablePeerAccess(gpu0.ctx.cu_ctx(), 0) };

    // 2. Copy ceilings.
    {
        let (d0, d1) = (gpu0.alloc(bytes)?, gpu1.alloc(bytes)?);
        let (e0, e1) = (gpu0.alloc(bytes)?, gpu1.alloc(bytes)?);
        let hosts = [
            host_buffer(&gpu0.ctx, bytes)?,
            host_buffer(&gpu0.ctx, bytes)?,
            host_buffer(&gpu0.ctx, bytes)?,
            host_buffer(&gpu0.ctx, bytes)?,
        ];
        let h: Vec<u64> = hosts.iter().map(|b| b.as_mut_ptr() as u64).collect();
        let alone = time(&[&gpu0], iters, || gpu0.copy(0, h[0], d0, bytes))?;
        let all = time(&[&gpu0, &gpu1], iters, || {
            gpu0.copy(0, h[0], d0, bytes)?;
            gpu0.copy(1, e0, h[1], bytes)?;
            gpu1.copy(0, h[2], d1, bytes)?;
            gpu1.copy(1, e1, h[3], bytes)
        })?;
        println!(
            "SPIKE ceiling=staged bytes={bytes} d2h_alone_GBps={:.1} both_gpus_d2h_and_h2d_per_copy_GBps={:.1}",
            gbps(bytes, alone),
            gbps(bytes, all)
        );
        let one_way = time(&[&gpu0], iters, || gpu0.copy(0, d1, d0, bytes))?;
        let both = time(&[&gpu0, &gpu1], iters, || {
            gpu0.copy(0, d1, d0, bytes)?;
            gpu1.copy(0, e0, e1, bytes)
        })?;
        let pull = time(&[&gpu1], iters, || gpu1.copy(0, d1, d0, bytes))?;
        let local = time(&[&gpu0], iters, || gpu0.copy(0, e0, d0, bytes))?;
        println!(
            "SPIKE ceiling=nvlink bytes={bytes} push_one_way_GBps={:.1} pull_one_way_GBps={:.1} both_ways_per_copy_GBps={:.1} local_d2d_GBps={:.1}",
            gbps(bytes, one_way),
            gbps(bytes, pull),
            gbps(bytes, both),
            gbps(bytes, local)
        );
        for p in [d0, e0] {
            gpu0.bind()?;
            // SAFETY: allocations of gpu0, unused from here.
            let _ = unsafe { result::free_sync(p) };
        }
        for p in [d1, e1] {
            gpu1.bind()?;
            // SAFETY: allocations of gpu1, unused from here.
            let _ = unsafe { result::free_sync(p) };
        }
    }

    // 3. 2-rank allreduce of `bytes` of f32, three ways. busbw = algbw × 2(n−1)/n = algbw.
    for total in [bytes, bytes * 4, 8 << 20, 1 << 20] {
        allreduce_variants(&gpu0, &gpu1, total, iters)?;
    }

    // 4. Chunk hand-off: queued on streams vs a host round trip per chunk.
    for (chunk, chunks) in [(1usize << 20, 64usize), (64 << 10, 256)] {
        handoff(&gpu0, &gpu1, chunk, chunks, iters)?;
    }
    Ok(())
}

fn allreduce_variants(gpu0: &Gpu, gpu1: &Gpu, total: usize, iters: usize) -> R<()> {
    let n = (total / 4) as u64;
    let half = total / 2;
    let (x0, x1) = (gpu0.alloc(total)?, gpu1.alloc(total)?);
    let (slot0, slot1) = (gpu0.alloc(half)?, gpu1.alloc(half)?);
    let init = || -> R<()> {
        gpu0.fill(x0, 1.0, n)?;
        gpu1.fill(x1, 2.0, n)?;
        gpu0.sync()?;
        gpu1.sync()
    };
    let check = |label: &str| -> R<()> {
        // every element should be 2·(i&1023)+3 after one allreduce of fresh data
        for (g, x) in [(gpu0, x0), (gpu1, x1)] {
            for i in [0usize, 1, (n as usize) / 2 + 5, n as usize - 1] {
                let want = 3.0 + 2.0 * (i & 1023) as f32;
                let got = g.read_f32(x, i)?;
                if got != want {
                    return Err(format!("{label}: element {i} is {got}, want {want}"));
                }
            }
        }
        Ok(())
    };
    let chunk = (4usize << 20).min(half);
    let chunks = half.div_ceil(chunk);
    // (a) copy engine + reduce kernel, pipelined: rank r owns half r; the peer pushes its copy
    // of that half into r's slot chunk by chunk; r reduces each chunk when its copy has landed;
    // then each rank pushes its reduced half to the peer.
    let ce = |gpu_a: &Gpu, gpu_b: &Gpu, xa: u64, xb: u64, slot_b: u64, off: u64| -> R<()> {
        // gpu_a sends its half `off` to gpu_b, gpu_b reduces it and sends the result back.
        let mut events = Vec::new();
        for c in 0..chunks {
            let o = (c * chunk) as u64;
            let len = chunk.min(half - c * chunk);
            gpu_a.copy(1, slot_b + o, xa + off + o, len)?;
            let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
                .map_err(|e| format!("{e:?}"))?;
            // SAFETY: live event and stream.
            ck(
                unsafe { result::event::record(ev, gpu_a.streams[1]) },
                "cuEventRecord",
            )?;
            gpu_b.bind()?;
            // SAFETY: live stream and event.
            ck(
                unsafe {
                    result::stream::wait_event(
                        gpu_b.streams[2],
                        ev,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                },
                "cuStreamWaitEvent",
            )?;
            gpu_b.launch3(gpu_b.add, 2, xb + off + o, slot_b + o, (len / 16) as u64)?;
            events.push(ev);
        }
        // all-gather: gpu_b pushes the reduced half back to gpu_a on the reduce stream.
        gpu_b.copy(2, xa + off, xb + off, half)?;
        for ev in events {
            // SAFETY: recorded above; destroyed after use is allowed (destruction is deferred).
            let _ = unsafe { result::event::destroy(ev) };
        }
        Ok(())
    };
    init()?;
    ce(gpu1, gpu0, x1, x0, slot0, 0)?;
    ce(gpu0, gpu1, x0, x1, slot1, half as u64)?;
    gpu0.sync()?;
    gpu1.sync()?;
    check("copy engine + reduce kernel")?;
    let t_ce = time(&[gpu0, gpu1], iters, || {
        ce(gpu1, gpu0, x1, x0, slot0, 0)?;
        ce(gpu0, gpu1, x0, x1, slot1, half as u64)
    })?;
    // (b) fused: each rank reads the peer's half over NVLink and writes the sum to both.
    let fused = || -> R<()> {
        gpu0.launch3(gpu0.fused, 0, x0, x1, (half / 16) as u64)?;
        gpu1.launch3(
            gpu1.fused,
            0,
            x1 + half as u64,
            x0 + half as u64,
            (half / 16) as u64,
        )
    };
    init()?;
    fused()?;
    gpu0.sync()?;
    gpu1.sync()?;
    check("fused kernel")?;
    let t_fused = time(&[gpu0, gpu1], iters, fused)?;
    // (c) fused reduce-scatter (kernel reads the peer) + copy-engine all-gather (push).
    let rs_ag = || -> R<()> {
        gpu0.launch3(gpu0.reduce_from_peer, 0, x0, x1, (half / 16) as u64)?;
        gpu1.launch3(
            gpu1.reduce_from_peer,
            0,
            x1 + half as u64,
            x0 + half as u64,
            (half / 16) as u64,
        )?;
        gpu0.copy(0, x1, x0, half)?;
        gpu1.copy(0, x0 + half as u64, x1 + half as u64, half)
    };
    init()?;
    rs_ag()?;
    gpu0.sync()?;
    gpu1.sync()?;
    check("fused reduce-scatter + copy-engine all-gather")?;
    let t_rsag = time(&[gpu0, gpu1], iters, rs_ag)?;
    println!(
        "SPIKE allreduce_2gpu bytes={total} ce_plus_kernel_us={:.0} busbw_GBps={:.1} fused_kernel_us={:.0} busbw_GBps={:.1} kernel_rs_plus_ce_ag_us={:.0} busbw_GBps={:.1} chunk={chunk} verified=true",
        t_ce * 1e6,
        gbps(total, t_ce),
        t_fused * 1e6,
        gbps(total, t_fused),
        t_rsag * 1e6,
        gbps(total, t_rsag)
    );
    for (g, ps) in [(gpu0, [x0, slot0]), (gpu1, [x1, slot1])] {
        g.bind()?;
        for p in ps {
            // SAFETY: allocations of g, unused from here.
            let _ = unsafe { result::free_sync(p) };
        }
    }
    Ok(())
}

fn handoff(gpu0: &Gpu, gpu1: &Gpu, chunk: usize, chunks: usize, iters: usize) -> R<()> {
    let total = chunk * chunks;
    let (src, dst) = (gpu0.alloc(total)?, gpu1.alloc(total)?);
    let acc = gpu1.alloc(total)?;
    gpu0.bind()?;
    let flags = Pinned::new(4 * chunks)?;
    let flag = |k: usize| flags.ptr as u64 + 4 * k as u64;
    let mut epoch = 0u32;
    // Stream-ordered: GPU0 copies chunk k into GPU1 and writes flag k = epoch; GPU1's stream waits
    // for flag k >= epoch, then reduces chunk k. Everything is queued up front.
    let mut queued = || -> R<()> {
        epoch += 1;
        for k in 0..chunks {
            let o = (k * chunk) as u64;
            gpu0.copy(0, dst + o, src + o, chunk)?;
            gpu0.bind()?;
            // SAFETY: flag(k) is pinned, device-mapped host memory (unified address).
            ck(
                unsafe { sys::cuStreamWriteValue32_v2(gpu0.streams[0], flag(k), epoch, 0) }
                    .result(),
                "cuStreamWriteValue32",
            )?;
            gpu1.bind()?;
            // SAFETY: as above; 0 = CU_STREAM_WAIT_VALUE_GEQ.
            ck(
                unsafe { sys::cuStreamWaitValue32_v2(gpu1.streams[0], flag(k), epoch, 0) }.result(),
                "cuStreamWaitValue32",
            )?;
            gpu1.launch3(gpu1.add, 0, acc + o, dst + o, (chunk / 16) as u64)?;
        }
        Ok(())
    };
    let t_stream = time(&[gpu0, gpu1], iters, &mut queued)?;
    // Host-driven: the host waits for each copy to finish before it enqueues the reduce.
    let host = || -> R<()> {
        for k in 0..chunks {
            let o = (k * chunk) as u64;
            gpu0.copy(0, dst + o, src + o, chunk)?;
            gpu0.bind()?;
            // SAFETY: live stream.
            ck(
                unsafe { result::stream::synchronize(gpu0.streams[0]) },
                "cuStreamSynchronize",
            )?;
            gpu1.launch3(gpu1.add, 0, acc + o, dst + o, (chunk / 16) as u64)?;
        }
        Ok(())
    };
    let t_host = time(&[gpu0, gpu1], iters, host)?;
    // Lower bound: the same copies and kernels with no dependency between GPUs at all.
    let free = || -> R<()> {
        for k in 0..chunks {
            let o = (k * chunk) as u64;
            gpu0.copy(0, dst + o, src + o, chunk)?;
            gpu1.launch3(gpu1.add, 0, acc + o, dst + o, (chunk / 16) as u64)?;
        }
        Ok(())
    };
    let t_free = time(&[gpu0, gpu1], iters, free)?;
    println!(
        "SPIKE handoff chunk={chunk} chunks={chunks} stream_ordered_us={:.0} per_chunk_us={:.1} host_round_trip_us={:.0} per_chunk_us={:.1} no_dependency_us={:.0}",
        t_stream * 1e6,
        t_stream * 1e6 / chunks as f64,
        t_host * 1e6,
        t_host * 1e6 / chunks as f64,
        t_free * 1e6
    );
    drop(flags);
    for (g, p) in [(gpu0, src), (gpu1, dst), (gpu1, acc)] {
        g.bind()?;
        // SAFETY: allocations of g, unused from here.
        let _ = unsafe { result::free_sync(p) };
    }
    Ok(())
}

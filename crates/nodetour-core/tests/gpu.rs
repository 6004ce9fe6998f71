//! GPU memory on a real GPU: the tier that runs on the GPU machine (`scripts/device-gpu-tier.sh`
//! carries this binary there). `#[ignore]`d, so machines without a GPU count these tests as
//! skipped; forced without one they print `SKIP <reason>`, and `NODETOUR_REQUIRE_GPU=1` makes a
//! missing GPU a failure.

use std::io::{Seek, SeekFrom};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::Error;
use nodetour_core::cuda;
use nodetour_core::memory::{DEVICE_ALIGNMENT, DeviceBuffer, HostBuffer, Pages};

fn gpu() -> Option<Arc<CudaContext>> {
    match cuda::gpus() {
        Ok(g) if !g.is_empty() => Some(CudaContext::new(0).expect("GPU 0 opens")),
        other => {
            let reason = match other {
                Err(e) => e.to_string(),
                Ok(_) => "CUDA lists no GPU".into(),
            };
            if std::env::var("NODETOUR_REQUIRE_GPU").as_deref() == Ok("1") {
                panic!("NODETOUR_REQUIRE_GPU=1 but {reason}");
            }
            println!("SKIP {reason}");
            None
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn gpus_report_their_gpudirect_attributes() {
    let Some(_) = gpu() else { return };
    for g in cuda::gpus().unwrap() {
        println!("{g:?}");
        assert!(!g.name.is_empty());
        assert_eq!(g.pci_bus_id.len(), 12, "{}", g.pci_bus_id);
        assert!(g.compute_capability.0 >= 7);
    }
    assert!(cuda::availability().unwrap() >= 11000);
}

#[test]
#[ignore = "needs a GPU"]
fn device_buffers_are_aligned_zeroed_and_copy_both_ways() {
    let Some(ctx) = gpu() else { return };
    let b = DeviceBuffer::new(&ctx, 100_000).unwrap();
    assert_eq!(b.device_ptr() % DEVICE_ALIGNMENT as u64, 0);
    assert_eq!(b.len(), 131_072, "rounded up to 64 KiB");
    let mut out = vec![1u8; b.len()];
    b.copy_to_host(0, &mut out).unwrap();
    assert!(out.iter().all(|x| *x == 0), "zeroed at allocation");
    let data: Vec<u8> = (0..4096).map(|i| (i * 7) as u8).collect();
    b.copy_from_host(1000, &data).unwrap();
    let mut back = vec![0u8; 4096];
    b.copy_to_host(1000, &mut back).unwrap();
    assert_eq!(back, data);
    assert!(matches!(
        b.copy_from_host(b.len() - 10, &data),
        Err(Error::OutOfBounds { .. })
    ));
    assert!(matches!(
        DeviceBuffer::new(&ctx, 0),
        Err(Error::InvalidRegistration { .. })
    ));
}

#[test]
#[ignore = "needs a GPU"]
fn device_buffers_export_as_dma_buf_of_their_size() {
    let Some(ctx) = gpu() else { return };
    let gdr = &cuda::gpus().unwrap()[0].gdr;
    let b = DeviceBuffer::new(&ctx, 64 << 20).unwrap();
    match b.export_dmabuf() {
        Ok(x) => {
            let mut file = std::fs::File::from(x.fd);
            let size = file.seek(SeekFrom::End(0)).unwrap();
            assert_eq!(size, 64 << 20, "the dma-buf covers exactly the buffer");
            assert_eq!(x.offset, 0);
            let link = std::fs::read_link(format!(
                "/proc/self/fd/{}",
                std::os::fd::AsRawFd::as_raw_fd(&file)
            ))
            .unwrap();
            println!("dma-buf: {} bytes, {}", size, link.display());
        }
        Err(e) => {
            assert!(
                !gdr.dma_buf,
                "the GPU says it supports dma-buf, yet export failed: {e}"
            );
            println!("SKIP dma-buf export unsupported here: {e}");
        }
    }
}

#[test]
#[ignore = "needs a GPU"]
fn hugepage_host_buffers_register_with_cuda_and_flush_is_available() {
    let Some(ctx) = gpu() else { return };
    let mut h = HostBuffer::new(8 << 20).unwrap();
    h.register_with_cuda(&ctx).unwrap();
    h.register_with_cuda(&ctx).unwrap(); // idempotent
    assert!(h.is_registered_with_cuda());
    println!("host buffer pages: {:?}", h.pages());
    if let Pages::Base(reason) = h.pages() {
        println!("no hugepages: {reason}");
    }
    h.as_mut_slice()[12345] = 42;
    let d = DeviceBuffer::new(&ctx, 8 << 20).unwrap();
    d.copy_from_host(0, h.as_slice()).unwrap();
    let mut back = vec![0u8; 8 << 20];
    d.copy_to_host(0, &mut back).unwrap();
    assert_eq!(back[12345], 42);
    drop(h); // unregisters before unmapping
    let gdr = &cuda::gpus().unwrap()[0].gdr;
    match cuda::flush_rdma_writes(&ctx) {
        Ok(()) => assert!(gdr.flush_writes_options & 1 == 1),
        Err(e) => println!(
            "flush unavailable: {e} (flush options {})",
            gdr.flush_writes_options
        ),
    }
}

#[test]
#[ignore = "needs a GPU"]
fn nvrtc_compiles_to_cubin_and_reports_errors() {
    let Some(_) = gpu() else { return };
    let cc = cuda::gpus().unwrap()[0].compute_capability;
    let cubin = cuda::nvrtc::compile_cubin(
        "extern \"C\" __global__ void k(float* x) { x[0] = 1.0f; }",
        "k.cu",
        cc,
        &[],
    )
    .unwrap();
    assert!(cubin.starts_with(b"\x7fELF"), "a CUBIN is an ELF image");
    match cuda::nvrtc::compile_cubin("this is not CUDA", "bad.cu", cc, &[]) {
        Err(Error::CompileKernels { log, .. }) => assert!(log.contains("bad.cu"), "{log}"),
        other => panic!("{other:?}"),
    }
}

/// Free GPU memory (bytes), as the driver reports it.
fn free_memory(ctx: &Arc<CudaContext>) -> usize {
    ctx.bind_to_thread().unwrap();
    cudarc::driver::result::mem_get_info().unwrap().0
}

/// Polls `cond` for up to `limit`; whether it held.
fn eventually(limit: std::time::Duration, mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + limit;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= end {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
#[ignore = "needs a GPU"]
fn teardown_waits_for_no_work_but_its_own() {
    use nodetour_core::cuda::GpuStream;
    use nodetour_core::cuda::reduce::ReduceKernels;
    use nodetour_core::transport::gpu::{
        FlagValue, Flags, Guarded, StopWord, StreamGuard, enqueue_wait,
    };
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    let Some(ctx) = gpu() else { return };
    let kernels = ReduceKernels::load(&ctx).unwrap();
    // A blocker on a stream of its own: a guarded wait for word 0 of a host page, which only
    // the watchdog below stores (after 20 s: the test is over long before, unless a drop
    // waited for the blocker, which the `released` flag then shows).
    let page = Arc::new(Flags::create(&ctx, 8).unwrap());
    let guard = StreamGuard::new(&ctx, StopWord::new(page.clone(), 7).unwrap()).unwrap();
    let blocker = GpuStream::new(&ctx).unwrap();
    enqueue_wait(
        Guarded {
            stream: &blocker,
            kernels: &kernels,
            guard: &guard,
        },
        Some(FlagValue::fixed(&*page, 0, 1)),
        false,
        None,
    )
    .unwrap();
    let released = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let (page, released) = (page.clone(), released.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(20));
            released.store(true, Ordering::SeqCst);
            page.store(0, 1).unwrap();
        })
    };
    let held = |what: &str| {
        assert!(
            !released.load(Ordering::SeqCst),
            "{what} waited for the unrelated blocker"
        );
    };

    // 1. A buffer whose work has run: dropping it returns at once and the memory comes back.
    let big = 4usize << 30;
    let before = free_memory(&ctx);
    let a = DeviceBuffer::new(&ctx, big).unwrap();
    let b = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
    let s = GpuStream::new(&ctx).unwrap();
    s.copy(&a, 0, &b, 0, 1 << 20).unwrap();
    s.synchronize().unwrap();
    assert!(free_memory(&ctx) + big <= before + (64 << 20));
    drop(a);
    drop(b);
    held("dropping GPU buffers");
    assert!(
        eventually(Duration::from_secs(5), || free_memory(&ctx) + (64 << 20)
            >= before),
        "the memory of a dropped buffer comes back while unrelated work runs"
    );
    // Streams and kernel handles: dropping them waits for nothing either (the kernels stay
    // loaded; a second load finds them).
    drop(s);
    let again = ReduceKernels::load(&ctx).unwrap();
    assert!(again.from_cache);
    drop(again);
    held("dropping a stream or a kernel handle");

    // 2. A buffer whose queued work waits (behind word 1, stored below): dropping it returns at
    // once, and the memory is freed only after that work has run.
    let guard2 = StreamGuard::new(&ctx, StopWord::new(page.clone(), 6).unwrap()).unwrap();
    let s2 = GpuStream::new(&ctx).unwrap();
    let c = DeviceBuffer::new(&ctx, big).unwrap();
    let d = DeviceBuffer::new(&ctx, 1 << 20).unwrap();
    let with_c = free_memory(&ctx);
    enqueue_wait(
        Guarded {
            stream: &s2,
            kernels: &kernels,
            guard: &guard2,
        },
        Some(FlagValue::fixed(&*page, 1, 1)),
        false,
        None,
    )
    .unwrap();
    s2.copy(&c, big - (1 << 20), &d, 0, 1 << 20).unwrap();
    drop(c);
    drop(d);
    drop(s2);
    held("dropping a buffer with queued work");
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        free_memory(&ctx) < with_c + big / 2,
        "a buffer's memory is not freed before the work queued on it has run"
    );
    page.store(1, 1).unwrap();
    assert!(
        eventually(Duration::from_secs(5), || {
            nodetour_core::cuda::reap_releases();
            free_memory(&ctx) >= with_c + big - (64 << 20)
        }),
        "the memory comes back once its work has run"
    );
    held("the whole test");
    // Release the blocker; the context reports no fault from anything above.
    page.store(0, 1).unwrap();
    blocker.synchronize().unwrap();
    ctx.synchronize().unwrap();
    drop(watchdog);
    println!("teardown: drops returned while unrelated work ran; memory freed in stream order");
}

#[test]
#[ignore = "needs a GPU"]
fn a_runtimes_raw_streams_and_memory_are_borrowed_and_never_freed_or_destroyed() {
    let Some(ctx) = gpu() else { return };
    // The runtime's own stream and memory, as raw handles (a runtime without cudarc).
    let theirs = ctx.new_stream().unwrap();
    let slice = theirs.clone_htod(&[7u8; 4096]).unwrap();
    let ptr = {
        let (p, _sync) = cudarc::driver::DevicePtr::device_ptr(&slice, &theirs);
        p
    };
    for raw in [
        theirs.cu_stream(),
        cuda::stream::CU_STREAM_LEGACY,
        cuda::stream::CU_STREAM_PER_THREAD,
    ] {
        // SAFETY: live handles (the runtime's stream outlives this block; the default streams
        // always are).
        let s = unsafe { cuda::GpuStream::borrowed(&ctx, raw) }.unwrap();
        assert!(s.is_borrowed());
        // SAFETY: the slice's memory outlives the view and the work queued on it (synchronised
        // below, before the slice is dropped).
        let view = unsafe { DeviceBuffer::borrowed(&ctx, ptr, 4096) };
        let mine = DeviceBuffer::new(&ctx, 4096).unwrap();
        s.copy(&mine, 0, &view, 0, 4096).unwrap();
        s.synchronize().unwrap();
        let mut back = vec![0u8; 4096];
        mine.copy_to_host(0, &mut back).unwrap();
        assert_eq!(back, vec![7u8; 4096]);
        drop(view);
        drop(s);
    }
    // Still the runtime's: usable after the borrowed values are gone.
    assert_eq!(theirs.clone_dtoh(&slice).unwrap(), vec![7u8; 4096]);
    theirs.synchronize().unwrap();
}

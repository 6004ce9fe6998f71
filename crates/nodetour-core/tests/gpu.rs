//! GPU memory on a real GPU: the tier that runs on the GPU machine (`scripts/device-gpu-tier.sh`
//! carries this binary there). `#[ignore]`d, so machines without a GPU count these tests as
//! skipped; forced without one they print `SKIP <reason>`, and `NODETOUR_REQUIRE_GPU=1` makes a
//! missing GPU a failure.

use std::io::{Seek, SeekFrom};
use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::Error;
use nodetour_core::cuda;
use nodetour_core::memory::{DEVICE_ALIGNMENT, DeviceBuffer, HostBuffer, Pages, RdmaBuffer};

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
    h.register_with_cuda().unwrap();
    h.register_with_cuda().unwrap(); // idempotent
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

//! Teardown probe: which CUDA calls that free or close things wait for unrelated work?
//!
//! The teardown rules say a drop waits only for its own work, never the whole context. Some
//! driver calls synchronise implicitly (the programming guide says `cudaFree` synchronises
//! across all streams). This probe keeps a *blocker* busy on a stream of its own (a one-thread
//! kernel spinning on a host-mapped word, or a `cuStreamWaitValue32` on it), releases it from a
//! watchdog thread after `--hold-ms`, and times each teardown call made meanwhile on memory,
//! modules, streams and events the blocker never touches. A call that takes about the hold
//! waited for the blocker.
//!
//! Usage: teardown_probe [--hold-ms N]. Prints one `TEARDOWN call=.. blocker=.. ms=.. waited=..
//! rc=..` line per call. `cuIpcCloseMemHandle` is probed in a child process (the same binary
//! with `--ipc-child HEX`) that maps memory this process exported.
//!
//! This lives in nodetour-core (the one crate allowed `unsafe`) because it drives the CUDA
//! driver directly, below the safe layer whose teardown it informs.

use std::ffi::CString;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result::{self, stream::StreamKind};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, DriverError};
use nodetour_core::cuda::nvrtc;

const KERNELS: &str = r#"
// Spins until *flag != 0 or about 20 s of GPU clock have passed (never forever).
extern "C" __global__ void spin_until(volatile unsigned int* flag, unsigned long long max_cycles) {
    unsigned long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { __nanosleep(1000); }
}
extern "C" __global__ void nop() {}
"#;

type R<T> = std::result::Result<T, String>;

fn ck<T>(r: Result<T, DriverError>, what: &str) -> R<T> {
    r.map_err(|e| format!("{what}: {e:?}"))
}

fn raw(r: sys::CUresult) -> String {
    format!("{r:?}")
}

/// Host-mapped memory the blocker spins on and the watchdog writes.
struct Flag {
    host: *mut u32,
    dev: sys::CUdeviceptr,
}

// SAFETY: the pointer is pinned host memory valid for the whole run; accessed with volatile ops.
unsafe impl Send for Flag {}
// SAFETY: as above.
unsafe impl Sync for Flag {}

impl Flag {
    fn new() -> R<Flag> {
        // SAFETY: a context is current; 4 KiB of pinned, device-mapped host memory.
        let host = unsafe {
            result::malloc_host(
                4096,
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        };
        let host = ck(host, "cuMemHostAlloc")? as *mut u32;
        let mut dev = 0;
        // SAFETY: host came from cuMemHostAlloc with DEVICEMAP.
        ck(
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host.cast(), 0) }.result(),
            "cuMemHostGetDevicePointer",
        )?;
        let f = Flag { host, dev };
        f.set(0);
        Ok(f)
    }
    fn set(&self, v: u32) {
        // SAFETY: host points at live pinned memory (see Flag).
        unsafe { std::ptr::write_volatile(self.host, v) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
}

struct Probe {
    ctx: Arc<CudaContext>,
    spin: sys::CUfunction,
    blocker: sys::CUstream,
    flag: Arc<Flag>,
    hold: Duration,
    max_cycles: u64,
}

#[derive(Clone, Copy, Debug)]
enum Blocker {
    Kernel,
    WaitValue,
}

impl Probe {
    /// Starts the blocker and a watchdog that releases it after the hold.
    fn block(&self, how: Blocker) -> R<std::thread::JoinHandle<()>> {
        self.flag.set(0);
        match how {
            Blocker::Kernel => {
                let mut a0 = self.flag.dev;
                let mut a1 = self.max_cycles;
                let mut params = [
                    (&mut a0 as *mut u64).cast::<std::ffi::c_void>(),
                    (&mut a1 as *mut u64).cast(),
                ];
                // SAFETY: spin_until(u32*, u64) with a live host-mapped address.
                ck(
                    unsafe {
                        result::launch_kernel(
                            self.spin,
                            (1, 1, 1),
                            (1, 1, 1),
                            0,
                            self.blocker,
                            &mut params,
                        )
                    },
                    "launch spin_until",
                )?;
            }
            Blocker::WaitValue => {
                // SAFETY: a live stream; the address is host-mapped memory that outlives it.
                ck(
                    unsafe { sys::cuStreamWaitValue32_v2(self.blocker, self.flag.dev, 1, 0) }
                        .result(),
                    "cuStreamWaitValue32",
                )?;
            }
        }
        // Let the blocker start.
        std::thread::sleep(Duration::from_millis(50));
        let flag = self.flag.clone();
        let hold = self.hold;
        Ok(std::thread::spawn(move || {
            std::thread::sleep(hold);
            flag.set(1);
        }))
    }

    /// Times `call` while the blocker runs; prints one line.
    fn time(&self, name: &str, how: Blocker, call: impl FnOnce() -> String) -> R<()> {
        let watchdog = self.block(how)?;
        let t = Instant::now();
        let rc = call();
        let ms = t.elapsed().as_secs_f64() * 1e3;
        watchdog.join().map_err(|_| "watchdog panicked")?;
        // SAFETY: a live stream.
        ck(
            unsafe { result::stream::synchronize(self.blocker) },
            "sync blocker",
        )?;
        let waited = ms > self.hold.as_secs_f64() * 1e3 * 0.5;
        println!(
            "TEARDOWN call={name} blocker={how:?} ms={ms:.2} waited={} rc={rc}",
            if waited { "yes" } else { "no" }
        );
        Ok(())
    }
}

fn alloc(bytes: usize) -> R<sys::CUdeviceptr> {
    // SAFETY: a context is current.
    ck(unsafe { result::malloc_sync(bytes) }, "cuMemAlloc")
}

fn main() {
    if let Err(e) = run() {
        println!("TEARDOWN error={e}");
        std::process::exit(1);
    }
}

fn run() -> R<()> {
    let args: Vec<String> = std::env::args().collect();
    let mut hold_ms = 1000u64;
    let mut child: Option<String> = None;
    let mut i = 1;
    while i < args.len() {
        match args[i].as_str() {
            "--hold-ms" => {
                hold_ms = args
                    .get(i + 1)
                    .and_then(|v| v.parse().ok())
                    .ok_or("--hold-ms N")?;
                i += 1;
            }
            "--launch-cost" => {}
            "--ipc-child" => {
                child = Some(args.get(i + 1).cloned().ok_or("--ipc-child HEX")?);
                i += 1;
            }
            a => return Err(format!("unknown argument {a}")),
        }
        i += 1;
    }
    if let Err(e) = nodetour_core::cuda::driver::availability() {
        println!("SKIP no usable CUDA driver: {e}");
        return Ok(());
    }
    let ctx = CudaContext::new(0).map_err(|e| format!("context: {e:?}"))?;
    ck(ctx.bind_to_thread(), "bind")?;
    let arch = ctx
        .compute_capability()
        .map_err(|e| format!("compute capability: {e:?}"))?;
    let cubin = nvrtc::compile_cubin(KERNELS, "probe.cu", arch, &[]).map_err(|e| e.to_string())?;
    let load = || -> R<sys::CUmodule> {
        // SAFETY: a complete CUBIN for this GPU.
        ck(
            unsafe { result::module::load_data(cubin.as_ptr().cast()) },
            "cuModuleLoadData",
        )
    };
    let module = load()?;
    // SAFETY: the module is loaded in the current context.
    let spin = ck(
        unsafe { result::module::get_function(module, CString::new("spin_until").unwrap()) },
        "get spin_until",
    )?;
    let clock_khz = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
        .unwrap_or(2_000_000) as u64;
    let probe = Probe {
        ctx: ctx.clone(),
        spin,
        blocker: ck(result::stream::create(StreamKind::NonBlocking), "stream")?,
        flag: Arc::new(Flag::new()?),
        hold: Duration::from_millis(hold_ms),
        max_cycles: clock_khz * 1000 * 20,
    };
    if let Some(hex) = child {
        return ipc_child(&probe, &hex);
    }
    let own = ck(result::stream::create(StreamKind::NonBlocking), "stream")?;
    if args.iter().any(|a| a == "--launch-cost") {
        return launch_cost(&probe, module);
    }
    memory_comes_back(&probe)?;
    for how in [Blocker::Kernel, Blocker::WaitValue] {
        let p = alloc(4 << 20)?;
        probe.time("cuMemFree", how, || {
            // SAFETY: p came from cuMemAlloc; nothing uses it.
            raw(unsafe { sys::cuMemFree_v2(p) })
        })?;
        let p = alloc(4 << 20)?;
        probe.time("cuMemFreeAsync(cuMemAlloc memory)", how, || {
            // SAFETY: as above; own is an idle stream.
            raw(unsafe { sys::cuMemFreeAsync(p, own) })
        })?;
        // SAFETY: a live stream.
        ck(unsafe { result::stream::synchronize(own) }, "sync own")?;
        let mut q = 0;
        // SAFETY: a live stream of the current context.
        ck(
            unsafe { sys::cuMemAllocAsync(&mut q, 4 << 20, own) }.result(),
            "cuMemAllocAsync",
        )?;
        // SAFETY: a live stream.
        ck(unsafe { result::stream::synchronize(own) }, "sync own")?;
        probe.time("cuMemFreeAsync(pool memory)", how, || {
            // SAFETY: q came from cuMemAllocAsync; nothing uses it.
            raw(unsafe { sys::cuMemFreeAsync(q, own) })
        })?;
        // SAFETY: a live stream.
        ck(unsafe { result::stream::synchronize(own) }, "sync own")?;
        probe.time("cuMemAlloc", how, || {
            let mut d = 0;
            // SAFETY: a context is current.
            let r = unsafe { sys::cuMemAlloc_v2(&mut d, 4 << 20) };
            // Freed after the blocker (below) so the free is not part of this figure.
            FREE_LATER.with(|f| f.borrow_mut().push(d));
            raw(r)
        })?;
        FREE_LATER.with(|f| {
            for d in f.borrow_mut().drain(..) {
                // SAFETY: d came from cuMemAlloc; nothing uses it.
                let _ = unsafe { sys::cuMemFree_v2(d) };
            }
        });
        let m = load()?;
        probe.time("cuModuleUnload", how, || {
            // SAFETY: m is loaded and never launched.
            raw(unsafe { sys::cuModuleUnload(m) })
        })?;
        let s = ck(result::stream::create(StreamKind::NonBlocking), "stream")?;
        probe.time("cuStreamDestroy", how, || {
            // SAFETY: s is an idle stream.
            raw(unsafe { sys::cuStreamDestroy_v2(s) })
        })?;
        let e = ck(
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
            "event",
        )?;
        probe.time("cuEventDestroy", how, || {
            // SAFETY: e is a live event.
            raw(unsafe { sys::cuEventDestroy_v2(e) })
        })?;
        let h = ck(
            // SAFETY: a context is current.
            unsafe { result::malloc_host(1 << 20, 0) },
            "cuMemHostAlloc",
        )?;
        probe.time("cuMemFreeHost", how, || {
            // SAFETY: h came from cuMemHostAlloc; nothing uses it.
            raw(unsafe { sys::cuMemFreeHost(h) })
        })?;
        let layout = std::alloc::Layout::from_size_align(2 << 20, 4096).unwrap();
        // SAFETY: a non-zero layout.
        let mem = unsafe { std::alloc::alloc_zeroed(layout) };
        // SAFETY: mem is 2 MiB of live, page-aligned memory.
        ck(
            unsafe { sys::cuMemHostRegister_v2(mem.cast(), 2 << 20, 0) }.result(),
            "cuMemHostRegister",
        )?;
        probe.time("cuMemHostUnregister", how, || {
            // SAFETY: mem was registered above; nothing uses it.
            raw(unsafe { sys::cuMemHostUnregister(mem.cast()) })
        })?;
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(mem, layout) };
        // The cuda-ipc close, in a child that maps memory exported here.
        let p = alloc(4 << 20)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: p is a live cuMemAlloc allocation.
        ck(
            unsafe { sys::cuIpcGetMemHandle(&mut handle, p) }.result(),
            "cuIpcGetMemHandle",
        )?;
        let hex: String = handle
            .reserved
            .iter()
            .map(|b| format!("{:02x}", *b as u8))
            .collect();
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let out = std::process::Command::new(exe)
            .args(["--hold-ms", &hold_ms.to_string(), "--ipc-child", &hex])
            .env("PROBE_BLOCKER", format!("{how:?}"))
            .output()
            .map_err(|e| e.to_string())?;
        print!("{}", String::from_utf8_lossy(&out.stdout));
        // SAFETY: the child has exited (its mapping is gone).
        let _ = unsafe { sys::cuMemFree_v2(p) };
    }
    for how in [Blocker::Kernel, Blocker::WaitValue] {
        vmm(
            &probe,
            how,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            "device",
        )?;
        vmm(
            &probe,
            how,
            sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST_NUMA,
            "host-numa",
        )?;
    }
    // While one thread sits in a synchronising call, do other threads' calls proceed? (If
    // they do, such calls can be handed to a background thread without stalling anyone.)
    let nop = ck(
        // SAFETY: the module is loaded in the current context.
        unsafe { result::module::get_function(module, CString::new("nop").unwrap()) },
        "get nop",
    )?;
    for how in [Blocker::Kernel, Blocker::WaitValue] {
        let p = alloc(4 << 20)?;
        let ctx = probe.ctx.clone();
        let watchdog = probe.block(how)?;
        let freer = std::thread::spawn(move || {
            let _ = ctx.bind_to_thread();
            // SAFETY: p came from cuMemAlloc; nothing uses it.
            unsafe { sys::cuMemFree_v2(p) }
        });
        std::thread::sleep(Duration::from_millis(100));
        let t = Instant::now();
        let mut params: [*mut std::ffi::c_void; 0] = [];
        // SAFETY: nop() takes no arguments; own is a live stream.
        let r1 = unsafe { result::launch_kernel(nop, (1, 1, 1), (1, 1, 1), 0, own, &mut params) };
        // SAFETY: a live stream.
        let r2 = unsafe { result::stream::synchronize(own) };
        let e = ck(
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
            "event",
        )?;
        // SAFETY: live event and stream.
        let r3 = unsafe { result::event::record(e, own) };
        let mut q = 0;
        // SAFETY: a live stream of the current context.
        let r4 = unsafe { sys::cuMemAllocAsync(&mut q, 1 << 20, own) };
        // SAFETY: q is live until this free, ordered on the same stream.
        let r5 = unsafe { sys::cuMemFreeAsync(q, own) };
        // SAFETY: a live stream.
        let r6 = unsafe { result::stream::synchronize(own) };
        let ms = t.elapsed().as_secs_f64() * 1e3;
        let free_rc = freer.join().map_err(|_| "freer panicked")?;
        watchdog.join().map_err(|_| "watchdog panicked")?;
        // SAFETY: a live event.
        let _ = unsafe { result::event::destroy(e) };
        println!(
            "TEARDOWN call=launch+sync+record+allocasync+freeasync-while-another-thread-is-in-cuMemFree \
             blocker={how:?} ms={ms:.2} waited={} rc={:?}/{:?}/{:?}/{}/{}/{:?} free_rc={}",
            if ms > probe.hold.as_secs_f64() * 1e3 * 0.5 {
                "yes"
            } else {
                "no"
            },
            r1.is_ok(),
            r2.is_ok(),
            r3.is_ok(),
            raw(r4),
            raw(r5),
            r6.is_ok(),
            raw(free_rc)
        );
        // SAFETY: a live stream.
        ck(
            unsafe { result::stream::synchronize(probe.blocker) },
            "sync blocker",
        )?;
    }
    let _ = probe.ctx.synchronize();
    Ok(())
}

/// Host time per (event record on one stream, event wait on another, launch on it), before and
/// after things a teardown might do: many idle streams alive, one stream-ordered free.
fn launch_cost(probe: &Probe, module: sys::CUmodule) -> R<()> {
    // SAFETY: the module is loaded in the current context.
    let nop = ck(
        unsafe { result::module::get_function(module, CString::new("nop").unwrap()) },
        "get nop",
    )?;
    let a = ck(result::stream::create(StreamKind::NonBlocking), "stream")?;
    let b = ck(result::stream::create(StreamKind::NonBlocking), "stream")?;
    let ev = ck(
        result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING),
        "event",
    )?;
    let measure = |what: &str| -> R<()> {
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..2000 {
                let mut params: [*mut std::ffi::c_void; 0] = [];
                // SAFETY: live streams, event and a kernel without arguments.
                unsafe {
                    ck(
                        result::launch_kernel(nop, (1, 1, 1), (1, 1, 1), 0, a, &mut params),
                        "launch",
                    )?;
                    ck(result::event::record(ev, a), "record")?;
                    ck(
                        result::stream::wait_event(
                            b,
                            ev,
                            sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                        ),
                        "wait",
                    )?;
                    ck(
                        result::launch_kernel(nop, (1, 1, 1), (1, 1, 1), 0, b, &mut params),
                        "launch",
                    )?;
                }
            }
            // SAFETY: live streams.
            unsafe {
                ck(result::stream::synchronize(a), "sync")?;
                ck(result::stream::synchronize(b), "sync")?;
            }
            best = best.min(t.elapsed().as_secs_f64() * 1e6 / 2000.0);
        }
        println!("TEARDOWN launch_cost {what} us_per_iteration={best:.2}");
        Ok(())
    };
    measure("fresh")?;
    let idle: Vec<_> = (0..64)
        .map(|_| result::stream::create(StreamKind::NonBlocking))
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{e:?}"))?;
    measure("with 64 idle streams alive")?;
    for s in idle {
        // SAFETY: idle streams.
        let _ = unsafe { result::stream::destroy(s) };
    }
    measure("after destroying them")?;
    let p = alloc(1 << 20)?;
    let t = ck(result::stream::create(StreamKind::NonBlocking), "stream")?;
    // SAFETY: p came from cuMemAlloc; nothing uses it; t is idle.
    cu(unsafe { sys::cuMemFreeAsync(p, t) }, "free async")?;
    // SAFETY: a live stream.
    ck(unsafe { result::stream::synchronize(t) }, "sync")?;
    measure("after one cuMemFreeAsync")?;
    let _ = probe;
    Ok(())
}

fn free_mib() -> u64 {
    result::mem_get_info().map_or(0, |(f, _)| f as u64 >> 20)
}

/// When does memory freed with cuMemFreeAsync come back (as `cuMemGetInfo` counts it): at
/// once, after a synchronisation of the freeing stream, or of the context? With and without a
/// blocker running on another stream.
fn memory_comes_back(probe: &Probe) -> R<()> {
    for blocked in [false, true] {
        let watchdog = if blocked {
            Some(probe.block(Blocker::Kernel)?)
        } else {
            None
        };
        let before = free_mib();
        let p = alloc(4 << 30)?;
        let allocated = free_mib();
        let s = ck(result::stream::create(StreamKind::NonBlocking), "stream")?;
        // SAFETY: p came from cuMemAlloc; nothing uses it.
        let rc = raw(unsafe { sys::cuMemFreeAsync(p, s) });
        std::thread::sleep(Duration::from_millis(100));
        let after_100ms = free_mib();
        // A non-blocking query of the freeing stream, repeated until it reports idle.
        let t0 = Instant::now();
        let mut q_rc = String::new();
        while t0.elapsed() < Duration::from_millis(3000) {
            // SAFETY: a live stream.
            let r = unsafe { sys::cuStreamQuery(s) };
            q_rc = raw(r);
            if r == sys::CUresult::CUDA_SUCCESS {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let after_query = free_mib();
        // SAFETY: a live stream.
        ck(unsafe { result::stream::synchronize(s) }, "sync")?;
        let after_stream_sync = free_mib();
        let t = Instant::now();
        if let Some(w) = watchdog {
            w.join().map_err(|_| "watchdog panicked")?;
        }
        // SAFETY: a live stream.
        ck(
            unsafe { result::stream::synchronize(probe.blocker) },
            "sync blocker",
        )?;
        let after_blocker = free_mib();
        ck(probe.ctx.synchronize(), "ctx sync")?;
        let after_ctx_sync = free_mib();
        let mut q = 0;
        // SAFETY: a context is current.
        let again = raw(unsafe { sys::cuMemAlloc_v2(&mut q, 4 << 30) });
        // SAFETY: q came from cuMemAlloc (if it succeeded), nothing uses it.
        let _ = unsafe { sys::cuMemFree_v2(q) };
        println!(
            "TEARDOWN memory blocked={blocked} rc={rc} free_mib before={before} allocated={allocated} \
             after_100ms={after_100ms} after_query={after_query} ({q_rc}) after_stream_sync={after_stream_sync} \
             after_blocker={after_blocker} (waited {:.0} ms) after_ctx_sync={after_ctx_sync} realloc={again}",
            t.elapsed().as_secs_f64() * 1e3
        );
        // SAFETY: a live idle stream.
        let _ = unsafe { result::stream::destroy(s) };
    }
    Ok(())
}

fn cu(r: sys::CUresult, what: &str) -> R<()> {
    ck(r.result(), what)
}

/// The virtual-memory-management calls: create, reserve, map (and an fd export imported again,
/// as a peer process would), then time unmapping and releasing.
fn vmm(probe: &Probe, how: Blocker, kind: sys::CUmemLocationType, name: &str) -> R<()> {
    let mut prop: sys::CUmemAllocationProp = unsafe {
        // SAFETY: a plain C struct for which all zeroes is a valid (empty) value.
        std::mem::zeroed()
    };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requestedHandleTypes =
        sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location = sys::CUmemLocation { type_: kind, id: 0 };
    let mut gran = 0usize;
    // SAFETY: valid out-pointer and properties.
    let r = unsafe {
        sys::cuMemGetAllocationGranularity(
            &mut gran,
            &prop,
            sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        println!("TEARDOWN call=vmm-{name} unsupported rc={}", raw(r));
        return Ok(());
    }
    let size = (4usize << 20).next_multiple_of(gran);
    let mut h = 0;
    // SAFETY: valid out-pointer and properties.
    let r = unsafe { sys::cuMemCreate(&mut h, size, &prop, 0) };
    if r != sys::CUresult::CUDA_SUCCESS {
        println!("TEARDOWN call=vmm-{name} unsupported rc={}", raw(r));
        return Ok(());
    }
    let map = |h: sys::CUmemGenericAllocationHandle| -> R<sys::CUdeviceptr> {
        let mut va = 0;
        // SAFETY: out-pointer; a fresh reservation of `size` bytes.
        cu(
            unsafe { sys::cuMemAddressReserve(&mut va, size, 0, 0, 0) },
            "reserve",
        )?;
        // SAFETY: va..va+size is reserved; h is a live allocation of `size` bytes.
        cu(unsafe { sys::cuMemMap(va, size, 0, h, 0) }, "map")?;
        let desc = sys::CUmemAccessDesc {
            location: sys::CUmemLocation {
                type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
                id: 0,
            },
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        // SAFETY: va..va+size is mapped.
        cu(
            unsafe { sys::cuMemSetAccess(va, size, &desc, 1) },
            "set access",
        )?;
        Ok(va)
    };
    let va = map(h)?;
    let mut fd: i32 = -1;
    // SAFETY: out-pointer for an fd; h was created with the POSIX fd handle type.
    cu(
        unsafe {
            sys::cuMemExportToShareableHandle(
                (&mut fd as *mut i32).cast(),
                h,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                0,
            )
        },
        "export",
    )?;
    let mut imported = 0;
    // SAFETY: fd is a live descriptor from the export (passed by value, as the API takes it).
    cu(
        unsafe {
            sys::cuMemImportFromShareableHandle(
                &mut imported,
                fd as isize as *mut std::ffi::c_void,
                sys::CUmemAllocationHandleType::CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
            )
        },
        "import",
    )?;
    // SAFETY: fd is ours to close (the import holds its own reference).
    unsafe { libc_close(fd) };
    let iva = map(imported)?;
    probe.time(&format!("cuMemUnmap({name}, imported)"), how, || {
        // SAFETY: iva..iva+size is mapped and unused.
        raw(unsafe { sys::cuMemUnmap(iva, size) })
    })?;
    probe.time(&format!("cuMemAddressFree({name})"), how, || {
        // SAFETY: an unmapped reservation.
        raw(unsafe { sys::cuMemAddressFree(iva, size) })
    })?;
    probe.time(&format!("cuMemRelease({name}, imported)"), how, || {
        // SAFETY: imported is unmapped.
        raw(unsafe { sys::cuMemRelease(imported) })
    })?;
    probe.time(&format!("cuMemUnmap({name}, own)"), how, || {
        // SAFETY: va..va+size is mapped and unused.
        raw(unsafe { sys::cuMemUnmap(va, size) })
    })?;
    // SAFETY: an unmapped reservation.
    let _ = unsafe { sys::cuMemAddressFree(va, size) };
    probe.time(&format!("cuMemRelease({name}, own)"), how, || {
        // SAFETY: h is unmapped everywhere.
        raw(unsafe { sys::cuMemRelease(h) })
    })
}

unsafe extern "C" {
    #[link_name = "close"]
    fn libc_close(fd: i32) -> i32;
}

thread_local! {
    static FREE_LATER: std::cell::RefCell<Vec<sys::CUdeviceptr>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn ipc_child(probe: &Probe, hex: &str) -> R<()> {
    let how = match std::env::var("PROBE_BLOCKER").as_deref() {
        Ok("WaitValue") => Blocker::WaitValue,
        _ => Blocker::Kernel,
    };
    let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
    if hex.len() != 128 {
        return Err("a handle is 64 bytes".into());
    }
    for (i, b) in handle.reserved.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|e| e.to_string())? as _;
    }
    let mut base = 0;
    // SAFETY: a handle exported by the parent, which keeps the allocation alive until we exit.
    ck(
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut base,
                handle,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result(),
        "cuIpcOpenMemHandle",
    )?;
    probe.time("cuIpcCloseMemHandle", how, || {
        // SAFETY: base came from cuIpcOpenMemHandle; nothing uses it.
        raw(unsafe { sys::cuIpcCloseMemHandle(base) })
    })
}

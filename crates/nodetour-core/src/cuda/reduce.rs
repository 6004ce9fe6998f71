//! Reduction kernels for every data type × operation, compiled once with NVRTC to a CUBIN for
//! the GPU's architecture (all instantiations in one module), cached on disk keyed by a SHA-256
//! of the NVRTC version, the driver version, the architecture and the source (see
//! [`super::kernel_cache`] for what the cache trusts), and loaded per context.
//!
//! The arithmetic matches the host reducer bit for bit: halves and bfloat16 are widened to f32,
//! combined, and rounded back to nearest-even; integers wrap.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, DeviceRepr, LaunchArgs, LaunchConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;

use super::GpuStream;
use super::device_buffer::DeviceBuffer;
use super::kernel_cache::{self, KernelCache};
use super::one_kernel::{ONE_SHOT_BLOCKS, ONE_SHOT_THREADS, OneShotArgs};
use super::result::cuda_error;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};

/// Where in a device buffer a kernel reads or writes: the buffer and a byte offset in it.
#[derive(Clone, Copy)]
pub struct At<'a> {
    /// The buffer.
    pub buffer: &'a DeviceBuffer,
    /// Bytes from its start.
    pub offset: usize,
}

impl<'a> At<'a> {
    /// `offset` bytes into `buffer`.
    pub fn new(buffer: &'a DeviceBuffer, offset: usize) -> At<'a> {
        At { buffer, offset }
    }

    /// Its device address once `count` elements of `dtype` from it are checked to lie inside
    /// the buffer (and the offset to be aligned), with `stream` noted as its user.
    fn checked(&self, stream: &GpuStream, count: usize, dtype: DataType) -> Result<u64> {
        check(self.buffer, self.offset, count, dtype)?;
        self.buffer.note_use(stream);
        Ok(self.buffer.device_ptr() + self.offset as u64)
    }
}

/// What a reduction computes: the element type and the operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reduction {
    /// The element type.
    pub dtype: DataType,
    /// The operation.
    pub op: ReduceOp,
}

/// A PreMulSum's multiplication as the kernels take it (`struct NtScale` in [`SOURCE`]): the
/// scalar, and for the integer types the whole scalar as a 64-bit two's-complement integer
/// (`reduce::check_op` refuses a fraction there).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct NtScale {
    /// The scalar.
    pub f: f64,
    /// `f as i64`, as its bits.
    pub whole: u64,
}

// SAFETY: `repr(C)` plain data of the layout of the kernels' `struct NtScale`, passed by value.
unsafe impl DeviceRepr for NtScale {}

impl NtScale {
    /// `op`'s multiplication, if it is a PreMulSum.
    pub fn of(op: ReduceOp) -> Option<NtScale> {
        op.scalar().map(|f| NtScale {
            f,
            whole: f as i64 as u64,
        })
    }
}

/// A chunk multiplied as it is sent: this rank's own values of a PreMulSum, first read by the
/// send (the ring's first step).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PreMul {
    /// The element type.
    pub dtype: DataType,
    /// The multiplication.
    pub scale: NtScale,
}

/// A received chunk a guarded kernel consumes: `count` elements (bytes for a copy) from `src`,
/// an address this GPU reads (GPU memory, or registered host memory mapped into it) that the
/// caller checked and keeps alive until the stream has passed the kernel, into `dst`.
#[derive(Clone, Copy)]
pub(crate) struct Consume<'a> {
    pub dst: At<'a>,
    pub src: u64,
    pub count: usize,
}

/// The kernels' CUDA C source. Self-contained (no headers), so NVRTC needs no include paths.
pub const SOURCE: &str = include_str!("reduce.cu");

/// The device addresses a guarded stream's kernels use (checked by whoever builds it): the
/// rank's stop word (host memory), the stream's latch and completion counter, and its two
/// counters (chunks, collectives: 64-bit words), all of this GPU's memory and used only by
/// this stream's kernels; and how long a guarded wait waits. See the guarded kernels in
/// [`SOURCE`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct GuardWords {
    pub(crate) stop: u64,
    pub(crate) latch: u64,
    pub(crate) done: u64,
    pub(crate) counters: u64,
    /// The claim of the collective running on the stream (nt_claim, released by nt_advance).
    pub(crate) claim: u64,
    pub(crate) timeout_ns: u64,
}

/// A flag operand of the guarded kernels, as the kernels' `NtFlag` (the same layout): a word and
/// a value, fixed (`base` 0) or relative to a stream's counters (see [`SOURCE`]). `addr` 0: none.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct NtFlag {
    pub(crate) addr: u64,
    pub(crate) base: u64,
    pub(crate) value: u32,
    pub(crate) align: u32,
    pub(crate) cells: u32,
    pub(crate) stride: u32,
}

// SAFETY: `repr(C)` plain data of the layout of the kernels' `struct NtFlag`, passed by value.
unsafe impl DeviceRepr for NtFlag {}

/// The kernels of one GPU: a cheap handle (clones share them).
///
/// A context loads them once per process and keeps them loaded while it lives: unloading a
/// module (`cuModuleUnload`) waits for every stream of the context (measured by
/// `examples/teardown_probe`), which a teardown must not do. Dropping a handle does nothing.
#[derive(Clone)]
pub struct ReduceKernels {
    k: Arc<Loaded>,
    // The most blocks one grid-stride kernel of this handle launches (at most the GPU's
    // `4 × SMs`): a cap leaves SMs to the caller's compute at large sizes.
    max_blocks: u32,
    /// Whether the kernels came from a cache (already loaded in this process, or a CUBIN on
    /// disk) rather than a compile.
    pub from_cache: bool,
    /// Where the CUBIN is cached.
    pub cache_path: Option<PathBuf>,
}

/// One context's loaded module and its functions. Never unloaded (see [`ReduceKernels`]).
struct Loaded {
    reduce: Vec<((DataType, ReduceOp), CudaFunction)>,
    both: Vec<((DataType, ReduceOp), CudaFunction)>,
    average: Vec<(DataType, CudaFunction)>,
    pattern: Vec<(DataType, CudaFunction)>,
    copy: CudaFunction,
    wait: CudaFunction,
    signal: CudaFunction,
    send: CudaFunction,
    advance: CudaFunction,
    claim: CudaFunction,
    reduce_then: Vec<((DataType, ReduceOp), CudaFunction)>,
    /// PreMulSum: `d = scalar · d + s` guarded (the ring's receive) and plain (its receive
    /// through a scratch chunk), `d = scalar · s` guarded (its first send) and plain.
    reduce_then_premul: Vec<(DataType, CudaFunction)>,
    reduce_premul: Vec<(DataType, CudaFunction)>,
    send_scaled: Vec<(DataType, CudaFunction)>,
    scale: Vec<(DataType, CudaFunction)>,
    one_shot: Vec<((DataType, ReduceOp), CudaFunction)>,
    two_shot: Vec<((DataType, ReduceOp), CudaFunction)>,
    busy: CudaFunction,
    sms: u32,
    blocks: u32,
    context: Arc<CudaContext>,
}

/// The kernels loaded in this process, by context (held weakly: an entry whose context is gone
/// is dropped with the context's modules).
type LoadedTable = Vec<(std::sync::Weak<CudaContext>, Arc<Loaded>, Option<PathBuf>)>;
static LOADED: std::sync::Mutex<LoadedTable> = std::sync::Mutex::new(Vec::new());

impl ReduceKernels {
    /// Loads the kernels for `context`'s GPU: from the disk cache, or compiled with NVRTC (and
    /// cached). Without NVRTC (and no cached CUBIN) this is [`Error::Unsupported`].
    pub fn load(context: &Arc<CudaContext>) -> Result<ReduceKernels> {
        let mut table = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        table.retain(|(c, _, _)| c.strong_count() > 0);
        if let Some((_, k, path)) = table.iter().find(|(c, _, _)| {
            c.upgrade()
                .is_some_and(|c| crate::cuda::same_context(&c, context))
        }) {
            return Ok(ReduceKernels {
                max_blocks: k.blocks,
                k: k.clone(),
                from_cache: true,
                cache_path: path.clone(),
            });
        }
        let (k, from_cache, cache_path) = Self::load_module(context)?;
        let k = Arc::new(k);
        table.push((Arc::downgrade(context), k.clone(), cache_path.clone()));
        Ok(ReduceKernels {
            max_blocks: k.blocks,
            k,
            from_cache,
            cache_path,
        })
    }

    /// Loads the module: from the disk cache, or compiled (and cached).
    fn load_module(context: &Arc<CudaContext>) -> Result<(Loaded, bool, Option<PathBuf>)> {
        let driver = super::availability()?;
        let major = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| cuda_error("cuDeviceGetAttribute", e))?;
        let minor = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(|e| cuda_error("cuDeviceGetAttribute", e))?;
        let sms = context
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(80)
            .max(1) as u32;
        let nvrtc = super::nvrtc::version().ok();
        let arch = format!("sm{major}{minor}");
        // One module: the ring's kernels, the one-kernel collectives (which use the element
        // types and operations defined above them) and the compute-bound kernel of the
        // measurements.
        let source = [SOURCE, super::one_kernel::SOURCE, super::busy::SOURCE].concat();
        let key = kernel_cache::entry_name(
            "reduce",
            &source,
            &nvrtc.map_or("none".into(), |(a, b)| format!("nvrtc {a}.{b}")),
            &driver.to_string(),
            &arch,
        );
        let cache = kernel_cache::default_dir().and_then(|d| match KernelCache::open(&d) {
            Ok(c) => Some(c),
            Err(why) => {
                tracing::warn!(%why, "the GPU kernel cache is not used (kernels are compiled each start)");
                None
            }
        });
        let cache_path = cache.as_ref().map(|c| c.path(&key));
        let cached = cache.as_ref().and_then(|c| match c.load(&key) {
            Ok(image) => image,
            Err(why) => {
                tracing::warn!(%why, "a bad GPU kernel cache entry: compiling again");
                None
            }
        });
        let from_cache = cached.is_some();
        let cubin = match cached {
            Some(c) => c,
            None => {
                let c = super::nvrtc::compile_cubin(
                    &source,
                    "nodetour_reduce.cu",
                    (major, minor),
                    &["--std=c++14"],
                )?;
                if let Some(cache) = &cache {
                    // Best effort: a read-only cache only costs the next start a compile.
                    if let Err(why) = cache.store(&key, &c) {
                        tracing::debug!(%why, "could not cache the GPU kernels");
                    }
                }
                c
            }
        };
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        let module = context
            .load_module(Ptx::from_binary(cubin))
            .map_err(|e| cuda_error("cuModuleLoadData", e))?;
        // Never unloaded: unloading waits for every stream of the context (see
        // [`ReduceKernels`]). This reference is never dropped.
        std::mem::forget(module.clone());
        let get = |name: String| -> Result<CudaFunction> {
            module
                .load_function(&name)
                .map_err(|e| Error::CompileKernels {
                    arch: format!("sm_{major}{minor}"),
                    log: format!("{name}: {e:?}"),
                })
        };
        let mut reduce = Vec::new();
        let mut reduce_then = Vec::new();
        let mut both = Vec::new();
        let mut average = Vec::new();
        let mut pattern = Vec::new();
        let mut one_shot = Vec::new();
        let mut two_shot = Vec::new();
        let (mut reduce_then_premul, mut send_scaled, mut scale) =
            (Vec::new(), Vec::new(), Vec::new());
        let mut reduce_premul = Vec::new();
        for dtype in DataType::ALL {
            let name = dtype.name();
            reduce_then_premul.push((dtype, get(format!("nt_reduce_then_{name}_premul"))?));
            reduce_premul.push((dtype, get(format!("nt_reduce_{name}_premul"))?));
            send_scaled.push((dtype, get(format!("nt_send_scaled_{name}"))?));
            scale.push((dtype, get(format!("nt_scale_{name}"))?));
            for op in [ReduceOp::Sum, ReduceOp::Prod, ReduceOp::Min, ReduceOp::Max] {
                reduce.push((
                    (dtype, op),
                    get(format!("nt_reduce_{}_{}", dtype.name(), op.name()))?,
                ));
                both.push((
                    (dtype, op),
                    get(format!("nt_both_{}_{}", dtype.name(), op.name()))?,
                ));
                reduce_then.push((
                    (dtype, op),
                    get(format!("nt_reduce_then_{}_{}", dtype.name(), op.name()))?,
                ));
                one_shot.push((
                    (dtype, op),
                    get(format!("nt_one_shot_{}_{}", dtype.name(), op.name()))?,
                ));
                two_shot.push((
                    (dtype, op),
                    get(format!("nt_two_shot_{}_{}", dtype.name(), op.name()))?,
                ));
            }
            average.push((dtype, get(format!("nt_average_{}", dtype.name()))?));
            pattern.push((dtype, get(format!("nt_pattern_{}", dtype.name()))?));
        }
        let copy = get("nt_copy".to_owned())?;
        let loaded = Loaded {
            reduce,
            both,
            average,
            pattern,
            copy,
            wait: get("nt_wait".to_owned())?,
            signal: get("nt_signal".to_owned())?,
            send: get("nt_send".to_owned())?,
            advance: get("nt_advance".to_owned())?,
            claim: get("nt_claim".to_owned())?,
            reduce_then,
            reduce_then_premul,
            reduce_premul,
            send_scaled,
            scale,
            one_shot,
            two_shot,
            busy: get("nt_busy".to_owned())?,
            sms,
            blocks: sms * 4,
            context: context.clone(),
        };
        Ok((loaded, from_cache, cache_path))
    }

    /// Queues on `stream`: `dst = op(dst, src)` over `count` elements of `r.dtype` (`Avg`
    /// sums; finish with [`Self::average`]; a `PreMulSum` takes `dst` as this rank's own values
    /// and multiplies them as it reads them: `dst = scalar · dst + src`). `src` may live on
    /// another GPU that this one has peer access to.
    pub fn reduce(
        &self,
        stream: &GpuStream,
        r: Reduction,
        dst: At<'_>,
        src: At<'_>,
        count: usize,
    ) -> Result<()> {
        let (d, s) = (
            dst.checked(stream, count, r.dtype)?,
            src.checked(stream, count, r.dtype)?,
        );
        let n = count as u64;
        // 16 bytes per thread (see SOURCE).
        let threads = count.div_ceil(16 / r.dtype.size());
        if let Some(k) = NtScale::of(r.op) {
            let f = by_type(&self.k.reduce_premul, r.dtype);
            let mut call = self.on(stream, f)?;
            call.arg(&d).arg(&s).arg(&n).arg(&k);
            return self.elementwise(call, threads);
        }
        let f = pick(&self.k.reduce, r.dtype, r.op)?;
        let mut call = self.on(stream, f)?;
        call.arg(&d).arg(&s).arg(&n);
        self.elementwise(call, threads)
    }

    /// Queues on `stream`: `dst = scalar · src` over `count` elements of `dtype` (`dst` may be
    /// `src`): a PreMulSum's multiplication of this rank's own values, where nothing else reads
    /// them first (one rank; staged paths that send from host memory).
    pub fn scale(
        &self,
        stream: &GpuStream,
        dtype: DataType,
        scalar: f64,
        dst: At<'_>,
        src: At<'_>,
        count: usize,
    ) -> Result<()> {
        let (d, s) = (
            dst.checked(stream, count, dtype)?,
            src.checked(stream, count, dtype)?,
        );
        let k = NtScale::of(ReduceOp::pre_mul_sum(scalar)).expect("a PreMulSum");
        let f = by_type(&self.k.scale, dtype);
        let n = count as u64;
        let mut call = self.on(stream, f)?;
        call.arg(&d).arg(&s).arg(&n).arg(&k);
        // 16 bytes per thread (see SOURCE).
        self.elementwise(call, count.div_ceil(16 / dtype.size()))
    }

    /// Queues on `stream`: `a = b = op(a, b)` over `count` elements
    /// (`Avg`: the result divided by `avg_ranks`). With `a` and `b` on two GPUs and each GPU
    /// doing one half, this is a whole two-rank allreduce in one step. `b` may live on another
    /// GPU that this one has peer access to.
    pub fn reduce_both(
        &self,
        stream: &GpuStream,
        r: Reduction,
        a: At<'_>,
        b: At<'_>,
        count: usize,
        avg_ranks: u32,
    ) -> Result<()> {
        let Reduction { dtype, op } = r;
        let (x, y) = (
            a.checked(stream, count, dtype)?,
            b.checked(stream, count, dtype)?,
        );
        let (op, avg) = if op == ReduceOp::Avg {
            (ReduceOp::Sum, avg_ranks.max(1))
        } else {
            (op, 0)
        };
        let f = pick(&self.k.both, dtype, op)?;
        let n = count as u64;
        let mut call = self.on(stream, f)?;
        call.arg(&x).arg(&y).arg(&n).arg(&avg);
        // 16 bytes per thread (see SOURCE).
        self.elementwise(call, count.div_ceil(16 / dtype.size()))
    }

    /// Queues on `stream`: fill `count` elements at `dst` with a test pattern (what a
    /// training step's gradient kernel would produce, for examples and benchmarks): element `i`
    /// holds [`pattern_value`]`(first + i, seed)`, a small integer exact in every type but E5M2
    /// (whose 9 and 11 round to 8 and 12).
    pub fn fill_pattern(
        &self,
        stream: &GpuStream,
        dtype: DataType,
        dst: At<'_>,
        count: usize,
        first: u64,
        seed: u32,
    ) -> Result<()> {
        let d = dst.checked(stream, count, dtype)?;
        let f = by_type(&self.k.pattern, dtype);
        let (n, a, sd) = (count as u64, first, seed);
        let mut call = self.on(stream, f)?;
        call.arg(&d).arg(&n).arg(&a).arg(&sd);
        self.elementwise(call, count)
    }

    /// Queues on `stream`: divide `count` elements at `offset` by `ranks` (the end of `Avg`).
    pub fn average(
        &self,
        stream: &GpuStream,
        dtype: DataType,
        dst: &DeviceBuffer,
        offset: usize,
        count: usize,
        ranks: u32,
    ) -> Result<()> {
        check(dst, offset, count, dtype)?;
        dst.note_use(stream);
        let f = by_type(&self.k.average, dtype);
        let (d, n, r) = (dst.device_ptr() + offset as u64, count as u64, ranks.max(1));
        let mut call = self.on(stream, f)?;
        call.arg(&d).arg(&n).arg(&r);
        // 16 bytes per thread (see SOURCE).
        self.elementwise(call, count.div_ceil(16 / dtype.size()))
    }

    /// Queues on `stream`: copy `len` bytes from `src` to `dst` with a kernel (16 bytes per thread where both are aligned). For small copies from a peer
    /// GPU this starts sooner than a copy-engine copy; for large ones the copy engine leaves the
    /// SMs free.
    pub fn copy(&self, stream: &GpuStream, dst: At<'_>, src: At<'_>, len: usize) -> Result<()> {
        let (d, s, n) = (
            dst.checked(stream, len, DataType::U8)?,
            src.checked(stream, len, DataType::U8)?,
            len as u64,
        );
        let mut call = self.on(stream, &self.k.copy)?;
        call.arg(&d).arg(&s).arg(&n);
        self.elementwise(call, len.div_ceil(16))
    }

    /// Queues on `stream` a one-thread kernel that waits until the word of `first` reaches its
    /// value (cyclic ≥, or `==` with `first_equal`), then the word of `second` reaches its
    /// value (cyclic ≥), or until the stop word is set or the guard's timeout passed (then it
    /// sets the stop word to 2); it then sets the latch: 1 if the words were reached (with
    /// neither word given: if the stop word is clear), else 0.
    pub(crate) fn wait_words(
        &self,
        stream: &GpuStream,
        first: NtFlag,
        first_equal: bool,
        second: NtFlag,
        g: GuardWords,
    ) -> Result<()> {
        let (f1, f2) = (first, second);
        let eq = u32::from(first_equal);
        let (st, l, t) = (g.stop, g.latch, g.timeout_ns);
        let mut call = self.on(stream, &self.k.wait)?;
        call.arg(&f1).arg(&eq).arg(&f2).arg(&st).arg(&l).arg(&t);
        Self::grid(call, 1, 1)
    }

    /// Queues on `stream` a one-thread kernel that, if the latch is 1, stores flag `first` and
    /// then `second`, each after a system-wide fence.
    pub(crate) fn signal(
        &self,
        stream: &GpuStream,
        g: GuardWords,
        first: NtFlag,
        second: NtFlag,
    ) -> Result<()> {
        let (l, a, b) = (g.latch, first, second);
        let mut call = self.on(stream, &self.k.signal)?;
        call.arg(&l).arg(&a).arg(&b);
        Self::grid(call, 1, 1)
    }

    /// Queues on `stream` a one-thread kernel that ends a collective on the stream: its chunk
    /// counter rounded up to `align`, plus `chunks`; its collective counter plus one.
    pub(crate) fn advance(
        &self,
        stream: &GpuStream,
        g: GuardWords,
        align: u32,
        chunks: u32,
    ) -> Result<()> {
        let (c, a, n, claim) = (g.counters, align.max(1), chunks, g.claim);
        let mut call = self.on(stream, &self.k.advance)?;
        call.arg(&c).arg(&a).arg(&n).arg(&claim);
        Self::grid(call, 1, 1)
    }

    /// Queues on `stream` the claim of its guard words for the collective that starts (see
    /// `nt_claim` in [`SOURCE`]): a claim still held sets the rank's stop word to 4.
    pub(crate) fn claim(&self, stream: &GpuStream, g: GuardWords) -> Result<()> {
        let (claim, stop) = (g.claim, g.stop);
        let mut call = self.on(stream, &self.k.claim)?;
        call.arg(&claim).arg(&stop);
        Self::grid(call, 1, 1)
    }

    /// Queues on `stream` one kernel that, if the latch is 1, copies `len` bytes of `src` to
    /// `dst` (a checked device address) and, once every byte has landed, stores `signals[0]`
    /// and then `signals[1]` (address, value).
    /// With `premul`, the bytes are elements of its type, each multiplied by its scalar on
    /// the way (`len` a whole number of them).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn send_guarded(
        &self,
        stream: &GpuStream,
        g: GuardWords,
        dst: u64,
        src: At<'_>,
        len: usize,
        signals: [NtFlag; 2],
        premul: Option<PreMul>,
    ) -> Result<()> {
        let Some(PreMul { dtype, scale }) = premul else {
            let from = src.checked(stream, len, DataType::U8)?;
            return self.send_at(stream, g, dst, from, len, signals);
        };
        let size = dtype.size();
        if !len.is_multiple_of(size) || !dst.is_multiple_of(size as u64) {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "a scaled send of {len} bytes to {dst:#x}: not whole {dtype:?} elements"
                ),
            });
        }
        let count = len / size;
        let s = src.checked(stream, count, dtype)?;
        let (l, d, n, k) = (g.latch, dst, count as u64, scale);
        let [a, b] = signals;
        let dn = g.done;
        let mut call = self.on(stream, by_type(&self.k.send_scaled, dtype))?;
        call.arg(&l)
            .arg(&d)
            .arg(&s)
            .arg(&n)
            .arg(&k)
            .arg(&a)
            .arg(&b)
            .arg(&dn);
        // 16 bytes per thread; at least one block, which stores the signals.
        let blocks = (len.div_ceil(16).div_ceil(512) as u32).clamp(1, self.max_blocks);
        Self::grid(call, blocks, 512)
    }

    /// Queues on `stream` one kernel that, if the latch is 1, copies the chunk's `count` bytes
    /// into its `dst` and, once every byte has landed, stores `signal` if the latch is 1: a
    /// received chunk copied out of its slot and the slot credited, in one launch.
    pub(crate) fn copy_then_signal(
        &self,
        stream: &GpuStream,
        g: GuardWords,
        chunk: Consume<'_>,
        signal: NtFlag,
    ) -> Result<()> {
        let to = chunk.dst.checked(stream, chunk.count, DataType::U8)?;
        let signals = [signal, NtFlag::default()];
        self.send_at(stream, g, to, chunk.src, chunk.count, signals)
    }

    /// The guarded copy kernel (`nt_send`) between two addresses the caller checked.
    fn send_at(
        &self,
        stream: &GpuStream,
        g: GuardWords,
        dst: u64,
        src: u64,
        len: usize,
        [first, second]: [NtFlag; 2],
    ) -> Result<()> {
        let l = g.latch;
        let (d, s, n) = (dst, src, len as u64);
        let (a, b) = (first, second);
        let dn = g.done;
        let mut call = self.on(stream, &self.k.send)?;
        call.arg(&l)
            .arg(&d)
            .arg(&s)
            .arg(&n)
            .arg(&a)
            .arg(&b)
            .arg(&dn);
        let blocks = (len.div_ceil(16).div_ceil(512) as u32).clamp(1, self.max_blocks);
        Self::grid(call, blocks, 512)
    }

    /// Like [`Self::reduce`] on a received chunk (`dst = op(dst, src)` over its `count`
    /// elements), but only if the latch is 1, and then (once every block has finished) stores
    /// `signal` (address, value) if the latch is 1.
    pub(crate) fn reduce_then_signal(
        &self,
        stream: &GpuStream,
        g: GuardWords,
        r: Reduction,
        chunk: Consume<'_>,
        signal: NtFlag,
    ) -> Result<()> {
        let Reduction { dtype, op } = r;
        let count = chunk.count;
        let d = chunk.dst.checked(stream, count, dtype)?;
        let (s, n) = (chunk.src, count as u64);
        let (l, a, dn) = (g.latch, signal, g.done);
        // 16 bytes per thread (see SOURCE); at least one block, which stores the signal.
        let per = 16 / dtype.size();
        let blocks = (count.div_ceil(per).div_ceil(512) as u32).clamp(1, self.max_blocks);
        if let Some(k) = NtScale::of(op) {
            // A PreMulSum: `dst` holds this rank's own values, multiplied as they are read.
            let f = by_type(&self.k.reduce_then_premul, dtype);
            let mut call = self.on(stream, f)?;
            call.arg(&d)
                .arg(&s)
                .arg(&n)
                .arg(&k)
                .arg(&l)
                .arg(&a)
                .arg(&dn);
            return Self::grid(call, blocks, 512);
        }
        let f = pick(&self.k.reduce_then, dtype, op)?;
        let mut call = self.on(stream, f)?;
        call.arg(&d).arg(&s).arg(&n).arg(&l).arg(&a).arg(&dn);
        Self::grid(call, blocks, 512)
    }

    /// Queues on `stream` one one-kernel allreduce (see [`super::one_kernel`]: one-shot, or
    /// two-shot) of [`ONE_SHOT_BLOCKS`] blocks. The caller (`transport::one_kernel`) built
    /// `args` from memory it owns or mapped and checked every range, and keeps it alive until
    /// the stream has passed the launch.
    pub(crate) fn one_kernel(
        &self,
        stream: &GpuStream,
        dtype: DataType,
        op: ReduceOp,
        two_shot: bool,
        args: &mut OneShotArgs,
    ) -> Result<()> {
        let table = if two_shot {
            &self.k.two_shot
        } else {
            &self.k.one_shot
        };
        // A PreMulSum sums what the copy in multiplied (`args.premul`).
        if op.scalar().is_some() && args.premul == 0 {
            return Err(Error::InvalidArgument {
                reason: "a one-kernel PreMulSum without its scalar in the arguments".into(),
            });
        }
        let op = if op.scalar().is_some() {
            ReduceOp::Sum
        } else {
            op
        };
        let f = pick(table, dtype, op)?;
        let mut call = self.on(stream, f)?;
        call.arg(&*args);
        Self::grid(call, ONE_SHOT_BLOCKS, ONE_SHOT_THREADS)
    }

    /// The GPU's streaming multiprocessors.
    pub fn sms(&self) -> u32 {
        self.k.sms
    }

    /// The most blocks (of 512 threads) one reduce, copy or guarded kernel launches: by
    /// default `4 × SMs` (a large chunk's kernel fills every SM of the GPU while it runs), or
    /// the cap of [`Self::with_max_blocks`].
    pub fn max_blocks(&self) -> u32 {
        self.max_blocks
    }

    /// This handle with its grid-stride kernels capped at `blocks` blocks (1 to `4 × SMs`;
    /// 0: no cap): the same results (every kernel strides over its range), fewer SMs taken
    /// from the caller's compute while a large chunk moves, at some bandwidth. The one-kernel
    /// path's fixed grid is not affected.
    pub fn with_max_blocks(mut self, blocks: u32) -> ReduceKernels {
        self.max_blocks = if blocks == 0 {
            self.k.blocks
        } else {
            blocks.min(self.k.blocks)
        };
        self
    }

    /// Queues on `stream` the compute-bound kernel of [`super::busy`]: `blocks` blocks of
    /// [`super::busy::BUSY_THREADS`] threads, `iters` rounds of four FMAs each per thread
    /// (`sink`, at least 1 KiB, is never written in practice).
    pub fn busy(
        &self,
        stream: &GpuStream,
        sink: &DeviceBuffer,
        iters: u32,
        blocks: u32,
    ) -> Result<()> {
        check(sink, 0, 1024, DataType::U8)?;
        sink.note_use(stream);
        let (p, n) = (sink.device_ptr(), iters);
        let mut call = self.on(stream, &self.k.busy)?;
        call.arg(&p).arg(&n);
        Self::grid(call, blocks.max(1), super::busy::BUSY_THREADS)
    }

    /// A launch of `f` on `stream` through cudarc's launch builder: the caller pushes the
    /// kernel's arguments in its order, then launches with [`Self::elementwise`] or
    /// [`Self::grid`].
    fn on<'a>(&self, stream: &'a GpuStream, f: &'a CudaFunction) -> Result<LaunchArgs<'a>> {
        if !crate::cuda::same_context(stream.context(), &self.k.context) {
            return Err(Error::InvalidArgument {
                reason: "the stream belongs to another GPU than the kernels".into(),
            });
        }
        Ok(stream.launch_on().launch_builder(f))
    }

    /// Launches `call` as `blocks` blocks of `threads` threads.
    fn grid(mut call: LaunchArgs<'_>, blocks: u32, threads: u32) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every caller above pushed exactly the kernel's parameters, in its order and
        // of its types (`NtFlag`, `NtScale` and `OneShotArgs` have the layouts of their C
        // structs): device addresses of live words and of in-bounds ranges it checked, and
        // plain integers. The memory outlives the queued work (buffers and peer mappings noted
        // this stream and are freed or closed after it; the guard words, flag pages and
        // one-kernel words belong to owners that drain their streams first); the module is
        // never unloaded ([`ReduceKernels`]).
        unsafe { call.launch(cfg) }
            .map(drop)
            .map_err(|e| cuda_error("cuLaunchKernel", e))
    }

    /// Launches `call` over `count` threads' work: blocks of 512, at most
    /// [`Self::max_blocks`] of them (the kernels stride over the rest); nothing for none.
    fn elementwise(&self, call: LaunchArgs<'_>, count: usize) -> Result<()> {
        if count == 0 {
            return Ok(());
        }
        let blocks = (count.div_ceil(512) as u32).clamp(1, self.max_blocks);
        Self::grid(call, blocks, 512)
    }
}

/// The kernel of `table` for `dtype` and `op` (`Avg` sums: the division is a kernel of its own;
/// a `PreMulSum` multiplies where its rank's values are first read, which a kernel that
/// combines two operands as they are cannot do: refused here).
fn pick(
    table: &[((DataType, ReduceOp), CudaFunction)],
    dtype: DataType,
    op: ReduceOp,
) -> Result<&CudaFunction> {
    let op = if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    };
    table
        .iter()
        .find(|(k, _)| *k == (dtype, op))
        .map(|(_, f)| f)
        .ok_or_else(|| Error::Unsupported {
            what: "this reduction on device memory",
            reason: format!(
                "no GPU kernel of this kind reduces {} with {} (a PreMulSum multiplies each \
                 rank's own values where they are first read)",
                dtype.name(),
                op.name()
            ),
        })
}

/// The kernel of `table` for `dtype` (every type is loaded).
fn by_type(table: &[(DataType, CudaFunction)], dtype: DataType) -> &CudaFunction {
    table
        .iter()
        .find(|(k, _)| *k == dtype)
        .map(|(_, f)| f)
        .expect("every type is loaded")
}

/// Element `i` of the test pattern of [`ReduceKernels::fill_pattern`] with `seed`.
pub fn pattern_value(i: u64, seed: u32) -> u32 {
    (i.wrapping_mul(7).wrapping_add(u64::from(seed)) % 13) as u32
}

/// `count` elements of `dtype` at byte `offset` are aligned and inside `b`.
fn check(b: &DeviceBuffer, offset: usize, count: usize, dtype: DataType) -> Result<()> {
    let bytes = count
        .checked_mul(dtype.size())
        .ok_or_else(|| Error::InvalidArgument {
            reason: format!("{count} elements of {dtype:?} overflow the address space"),
        })?;
    if !offset.is_multiple_of(dtype.size()) {
        return Err(Error::InvalidArgument {
            reason: format!("offset {offset} is not aligned to {dtype:?}"),
        });
    }
    b.check("GPU reduction", offset, bytes)
}

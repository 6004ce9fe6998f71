//! Ring allreduce over the GPUs of one process, direct: every rank's GPU reads its ring
//! neighbour's buffer over NVLink or PCIe peer-to-peer (peer access), so no byte passes through
//! host memory and no slot memory is needed at all.
//!
//! The design the GPU spike measured fastest (docs/gpu-design-spike.md): the reduce-scatter is a
//! reduce kernel that reads the previous rank's segment straight out of its memory and combines
//! it into the local one; the all-gather copies the previous rank's finished segment, with a
//! copy kernel up to [`KERNEL_COPY_MAX`] per segment (lower latency) and the copy engine above. A rank may also share a GPU with others (one buffer and stream each), which lets a
//! single GPU exercise rings of any size.
//!
//! Everything is stream-ordered, like NCCL: [`GpuGroup::all_reduce`] only queues work on the
//! callers' streams, returns at once, starts after the work already queued there, and work
//! queued afterwards sees the result. Ranks are ordered between each other by markers (CUDA
//! events): before step `k`, rank `r` waits for step `k − 1` of its previous rank (whose output
//! it reads) and of its next rank (which read what `r` is about to overwrite). The collective
//! ends on each stream only after the next rank finished reading it, so a buffer is free for
//! reuse as soon as its own stream says so.
//!
//! Two ranks with at most [`ONE_STEP_MAX`] bytes skip the ring: each GPU combines one half of
//! both buffers and writes the result into both, one kernel per rank (lower latency).
//!
//! Failure: every rank is in this process and waits only on CUDA events of the group's own
//! work, so nothing here waits on a peer that can vanish. [`GpuGroup::abort_handle`] still ends
//! the group from any thread (the next call, and [`GpuGroup::wait`], return the typed error;
//! work already queued finishes), a collective that failed half queued poisons the group (its
//! markers no longer describe a whole collective), and [`GpuGroup::wait`] polls only the group's
//! own end markers, with a deadline. Dropping the group waits for nothing: its kernels stay
//! loaded while their context lives (shared by every user of that GPU in the process), and the
//! buffers its work uses are freed in stream order after that work (see `DeviceBuffer`).
//!
//! The schedule, in pull form: at reduce-scatter step `s` rank `r` combines segment `r − 1 − s`
//! of rank `r − 1` into its own; after `N − 1` steps it owns the final segment `r + 1` (divided
//! by `N` there for `Avg`); at all-gather step `s` it copies segment `r − s` from rank `r − 1`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cudarc::driver::CudaContext;
use nodetour_core::cuda::reduce::{At, ReduceKernels, Reduction};
use nodetour_core::cuda::{GpuEvent, GpuStream, enable_peer_access};
use nodetour_core::memory::DeviceBuffer;

use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};

/// One rank of a [`GpuGroup`]: its GPU, its reduction kernels and its step markers.
struct Member {
    context: Arc<CudaContext>,
    kernels: Arc<ReduceKernels>,
    /// `markers[0]`: the start; `markers[k + 1]`: the end of step `k`.
    markers: Vec<GpuEvent>,
    /// The same for collectives captured into a CUDA graph: recorded only under capture (where
    /// a record makes a graph edge, not a point to wait for), so the eager markers keep the
    /// state eager collectives wait on (an event last recorded under capture cannot be waited
    /// for or queried outside it).
    captured: Vec<GpuEvent>,
    /// Recorded on this rank's stream after each collective: what `wait` and `Drop` poll.
    end: GpuEvent,
}

/// A ring of ranks on the GPUs of this process.
///
/// Private: the communicators of [`crate::comm::Communicator::from_devices`] share one.
pub(crate) struct GpuGroup {
    members: Vec<Member>,
    path: String,
    kernel_copy_max: usize,
    one_step_max: usize,
    abort: GroupAbort,
    /// Whether the collective being queued is captured into a CUDA graph (set by `queue`).
    capturing: bool,
}

/// Ends a [`GpuGroup`] from any thread. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct GroupAbort {
    failed: Arc<Mutex<Option<Error>>>,
}

impl GroupAbort {
    /// Ends the group: its next call and [`GpuGroup::wait`] return [`Error::Aborted`] with
    /// `reason` (work already queued on the streams still finishes: it waits on nothing outside
    /// this process).
    pub(crate) fn abort(&self, reason: &str) {
        self.fail(Error::Aborted {
            reason: reason.to_owned(),
        });
    }

    /// The error the group ended with, if it did.
    pub(crate) fn error(&self) -> Option<Error> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }

    pub(crate) fn fail(&self, e: Error) {
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert(e);
        }
    }
}

/// A broadcast moves in up to this many chunks, pipelined along the ring (chunks of at least
/// [`BROADCAST_CHUNK_MIN`] bytes).
pub(crate) const BROADCAST_CHUNKS: usize = 16;
/// The smallest broadcast chunk.
pub(crate) const BROADCAST_CHUNK_MIN: usize = 1 << 20;

/// Two-rank collectives up to this many bytes run in one step: each GPU combines one half of
/// both buffers and writes the result into both (one kernel and two cross-GPU waits per rank,
/// against two kernels and three waits for the ring). Measured on two H200s, f32 sum, against
/// NCCL in the same run: 8 B to 256 KiB 13.5-14.9 µs (NCCL 13.6-15.6), 2 MiB 14.3 µs (NCCL
/// 28.1); at 16 MiB one step took 58.6 µs and the ring 66.8.
pub const ONE_STEP_MAX: usize = 16 << 20;

/// All-gather segments up to this size are copied by a kernel (it starts sooner than the copy
/// engine); larger ones by the copy engine (which leaves the SMs free). Measured on two H200s
/// (NVLink), f32 sum, against NCCL in the same run: at 16 MiB a kernel all-gather gave 1.16x
/// NCCL's busbw and the copy engine 0.96x; at 256 MiB the copy engine 1.14x, the kernel 1.08x.
pub const KERNEL_COPY_MAX: usize = 32 << 20;

impl GpuGroup {
    /// A ring with one rank per entry of `contexts`, in that order (the same GPU may appear
    /// more than once). Enables peer access between every pair of distinct GPUs that are ring
    /// neighbours; a pair without peer access is [`Error::Unsupported`] with the reason (the
    /// staged path across processes serves such machines). Loads (or compiles, once, and
    /// caches on disk) the reduction kernels of each GPU.
    pub(crate) fn new(contexts: &[Arc<CudaContext>]) -> Result<GpuGroup> {
        let n = contexts.len();
        if n == 0 {
            return Err(Error::InvalidArgument {
                reason: "a GPU group needs at least one GPU".into(),
            });
        }
        let mut kernels: Vec<(Arc<CudaContext>, Arc<ReduceKernels>)> = Vec::new();
        let mut distinct_pairs = 0;
        for (r, ctx) in contexts.iter().enumerate() {
            let prev = &contexts[(r + n - 1) % n];
            // Two contexts of one GPU (two `CudaContext::new(0)`) need no peer access.
            if !Arc::ptr_eq(prev, ctx) && prev.ordinal() != ctx.ordinal() {
                distinct_pairs += 1;
                let ok = enable_peer_access(ctx, prev)
                    .map_err(|e| Error::gpu("enabling peer access", e))?;
                // What the callers' allocations and nodetour's captured scratch come from
                // (cuMemAllocAsync) ignores peer access: its pool grants it, both ways (the
                // two-rank step writes the neighbour's buffer too).
                if ok {
                    for (a, b) in [(ctx, prev), (prev, ctx)] {
                        nodetour_core::cuda::enable_pool_access(a, b)
                            .map_err(|e| Error::gpu("granting peer access to memory pools", e))?;
                    }
                }
                if !ok {
                    return Err(Error::Unsupported {
                        reason: format!(
                            "GPU {} cannot access GPU {} directly (no NVLink or PCIe peer-to-peer \
                             between them): the direct path needs peer access",
                            ctx.ordinal(),
                            prev.ordinal()
                        ),
                    });
                }
            }
            if !kernels.iter().any(|(c, _)| Arc::ptr_eq(c, ctx)) {
                let k =
                    ReduceKernels::load(ctx).map_err(|e| Error::gpu("loading the kernels", e))?;
                kernels.push((ctx.clone(), Arc::new(k)));
            }
        }
        // The most steps any collective takes: the allreduce ring, or a broadcast pipeline.
        let steps = (2 * (n - 1)).max(BROADCAST_CHUNKS + n - 2);
        let mut members = Vec::with_capacity(n);
        for ctx in contexts {
            let k = kernels
                .iter()
                .find(|(c, _)| Arc::ptr_eq(c, ctx))
                .map(|(_, k)| k.clone())
                .expect("loaded above");
            let markers = || {
                (0..=steps)
                    .map(|_| GpuEvent::marker(ctx))
                    .collect::<nodetour_core::Result<Vec<_>>>()
                    .map_err(|e| Error::gpu("creating markers", e))
            };
            members.push(Member {
                context: ctx.clone(),
                kernels: k,
                markers: markers()?,
                captured: markers()?,
                end: GpuEvent::marker(ctx).map_err(|e| Error::gpu("creating markers", e))?,
            });
        }
        let path = if n == 1 {
            "direct: one rank, nothing to exchange".to_owned()
        } else if distinct_pairs == 0 {
            format!("direct: {n} ranks on one GPU (device-local reads)")
        } else {
            format!(
                "direct: {n} ranks, each GPU reads its ring neighbour's memory through peer \
                 access: kernel reduce-scatter, all-gather by kernel up to 32 MiB segments and \
                 copy engine above{}; no host staging, no slot memory",
                if n == 2 {
                    " (up to 16 MiB in one step: each GPU combines one half into both buffers)"
                } else {
                    ""
                }
            )
        };
        Ok(GpuGroup {
            members,
            path,
            kernel_copy_max: KERNEL_COPY_MAX,
            one_step_max: ONE_STEP_MAX,
            abort: GroupAbort::default(),
            capturing: false,
        })
    }

    /// Sets the largest all-gather segment copied by a kernel rather than the copy engine
    /// (default [`KERNEL_COPY_MAX`]; 0: always the copy engine).
    pub(crate) fn set_kernel_copy_max(&mut self, bytes: usize) {
        self.kernel_copy_max = bytes;
    }

    /// Sets the largest two-rank collective run in one step (default [`ONE_STEP_MAX`]; 0:
    /// always the ring).
    pub(crate) fn set_one_step_max(&mut self, bytes: usize) {
        self.one_step_max = bytes;
    }

    /// Which path the group takes, and why.
    pub(crate) fn path(&self) -> &str {
        &self.path
    }

    /// Queues an in-place allreduce of `count` elements of `dtype` at the start of each rank's
    /// buffer, rank `r` on `streams[r]` (a stream of rank `r`'s GPU). Returns once queued; each
    /// stream sees the result in order. Everything is checked before anything is queued.
    pub(crate) fn all_reduce(
        &mut self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.members.len();
        self.check(buffers, streams, count, dtype)?;
        self.queue(streams, |g| {
            if count == 0 || n == 1 {
                return Ok(());
            }
            let size = dtype.size();
            if n == 2 && count * size <= g.one_step_max {
                g.record_start(streams)?;
                return g.one_step(buffers, streams, count, dtype, op);
            }
            let seg = |i: usize| (i * count / n, (i + 1) * count / n - i * count / n);
            g.ring(buffers, streams, dtype, Some((op, 1)), true, &seg)
        })
    }

    /// A handle that ends the group from another thread (see [`GroupAbort`]).
    pub(crate) fn abort_handle(&self) -> GroupAbort {
        self.abort.clone()
    }

    /// Waits until every collective queued so far has finished on every rank's stream, at most
    /// `timeout` (spins briefly, then sleeps in growing steps up to 1 ms); polls only this
    /// group's end markers, never the whole device. An aborted group returns its error once
    /// its work has finished; past the deadline the group is aborted and the error says so.
    pub(crate) fn wait(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let spin_until = Instant::now() + Duration::from_micros(50);
        let mut nap = Duration::from_micros(10);
        loop {
            if self.finished()? {
                return match self.abort.error() {
                    Some(e) => Err(e),
                    None => Ok(()),
                };
            }
            let now = Instant::now();
            if now >= deadline {
                let e = Error::Timeout {
                    waiting_for: "the GPU group's collectives".into(),
                    rank: None,
                    after: timeout,
                };
                self.abort.fail(e.clone());
                return Err(e);
            }
            if now >= spin_until {
                std::thread::sleep(nap.min(deadline - now));
                nap = (nap * 2).min(Duration::from_millis(1));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    fn finished(&self) -> Result<bool> {
        for m in &self.members {
            if !m
                .end
                .is_complete()
                .map_err(|e| Error::gpu("asking about the collective", e))?
            {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Runs `f` (which queues one collective on `streams`) unless the group has ended, then
    /// records each rank's end marker. A failure while queueing (the streams may hold part of
    /// the collective) ends the group with that error. Under graph capture (every stream in one
    /// capture, see [`capture_of`]) `f` orders the ranks with the capture's own markers and no
    /// end marker is recorded: the graph's work runs when the caller launches it, and the
    /// caller's stream says when it is done.
    fn queue(&mut self, streams: &[&GpuStream], f: impl FnOnce(&Self) -> Result<()>) -> Result<()> {
        if let Some(e) = self.abort.error() {
            return Err(e);
        }
        self.capturing = capture_of(streams)?;
        let queued = f(self).and_then(|()| {
            if self.capturing {
                return Ok(());
            }
            for (m, s) in self.members.iter().zip(streams) {
                s.record_marker(&m.end)
                    .map_err(|e| Error::gpu("queueing the end of the collective", e))?;
            }
            Ok(())
        });
        if let Err(e) = &queued {
            self.abort.fail(e.clone());
        }
        queued
    }

    /// Rank `r`'s step markers for the collective being queued: eager or captured.
    fn marks(&self, r: usize) -> &[GpuEvent] {
        let m = &self.members[r];
        if self.capturing {
            &m.captured
        } else {
            &m.markers
        }
    }

    /// Queues on each rank's stream the first `count` elements of its buffer multiplied by
    /// its PreMulSum scalar (`scalars[r]`): a set's PreMulSum, before its sum.
    pub(crate) fn pre_multiply(
        &self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        count: usize,
        dtype: DataType,
        scalars: &[f64],
    ) -> Result<()> {
        self.check(buffers, streams, count, dtype)?;
        if scalars.len() != self.members.len() {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} PreMulSum scalars for a group of {} ranks",
                    scalars.len(),
                    self.members.len()
                ),
            });
        }
        for (r, m) in self.members.iter().enumerate() {
            let whole = At::new(buffers[r], 0);
            m.kernels
                .scale(streams[r], dtype, scalars[r], whole, whole, count)
                .map_err(|e| Error::gpu("queueing a PreMulSum's multiplication", e))?;
        }
        Ok(())
    }

    /// Queues an in-place reduce-scatter in NCCL's in-place layout: each buffer holds
    /// `n × recv_count` elements (rank `i`'s contribution to block `i` at `i × recv_count`);
    /// afterwards block `r` of rank `r` holds the reduction of every rank's block `r` (the
    /// other blocks hold partial results).
    pub(crate) fn reduce_scatter(
        &mut self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        recv_count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.members.len();
        let total = recv_count
            .checked_mul(n)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("{recv_count} elements × {n} ranks overflow"),
            })?;
        self.check(buffers, streams, total, dtype)?;
        self.queue(streams, |g| {
            if recv_count == 0 || n == 1 {
                return Ok(());
            }
            let seg = |i: usize| (i * recv_count, recv_count);
            g.ring(buffers, streams, dtype, Some((op, 2)), false, &seg)
        })
    }

    /// Queues an in-place all-gather in NCCL's in-place layout: each buffer holds
    /// `n × count` elements, rank `r` contributing block `r`; afterwards every buffer holds
    /// every rank's block.
    pub(crate) fn all_gather(
        &mut self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        let n = self.members.len();
        let total = count.checked_mul(n).ok_or_else(|| Error::InvalidArgument {
            reason: format!("{count} elements × {n} ranks overflow"),
        })?;
        self.check(buffers, streams, total, dtype)?;
        self.queue(streams, |g| {
            if count == 0 || n == 1 {
                return Ok(());
            }
            let seg = |i: usize| (i * count, count);
            g.ring(buffers, streams, dtype, None, true, &seg)
        })
    }

    /// Queues a broadcast of the first `bytes` bytes of rank `root`'s buffer into every
    /// other rank's buffer: chunks flow along the ring from the root, each rank copying a chunk
    /// from its previous rank once that rank has it (a pipeline, so every link carries data at
    /// once).
    pub(crate) fn broadcast(
        &mut self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        bytes: usize,
        root: usize,
    ) -> Result<()> {
        let n = self.members.len();
        if root >= n {
            return Err(Error::InvalidArgument {
                reason: format!("root {root} of a group of {n} ranks"),
            });
        }
        self.check(buffers, streams, bytes, DataType::U8)?;
        self.queue(streams, |me| {
            me.broadcast_queue(buffers, streams, bytes, root)
        })
    }

    fn broadcast_queue(
        &self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        bytes: usize,
        root: usize,
    ) -> Result<()> {
        let n = self.members.len();
        if bytes == 0 || n == 1 {
            return Ok(());
        }
        let g = |e| Error::gpu("queueing the broadcast", e);
        let chunks = (bytes / BROADCAST_CHUNK_MIN).clamp(1, BROADCAST_CHUNKS);
        let chunk = |c: usize| {
            let (a, b) = (c * bytes / chunks, (c + 1) * bytes / chunks);
            (a, b - a)
        };
        self.record_start(streams)?;
        // At step k the rank d hops after the root copies chunk k − (d − 1).
        let steps = chunks + n - 2;
        for k in 0..steps {
            for (r, &s) in streams.iter().enumerate() {
                let prev = (r + n - 1) % n;
                let d = (r + n - root) % n;
                if d != 0 {
                    s.wait_marker(&self.marks(prev)[k]).map_err(g)?;
                    if let Some(c) = (k + 1).checked_sub(d).filter(|&c| c < chunks) {
                        let (off, len) = chunk(c);
                        self.pull(r, s, buffers, off, len)?;
                    }
                }
                s.record_marker(&self.marks(r)[k + 1]).map_err(g)?;
            }
        }
        self.finish(streams, steps)
    }

    fn record_start(&self, streams: &[&GpuStream]) -> Result<()> {
        for (r, s) in streams.iter().enumerate() {
            s.record_marker(&self.marks(r)[0])
                .map_err(|e| Error::gpu("queueing the collective", e))?;
        }
        Ok(())
    }

    /// Queues the ring: with `reduce = Some((op, a))`, `n − 1` reduce-scatter steps in which
    /// rank `r` combines segment `r − a − k` of its previous rank into its own, ending with the
    /// final segment `r + 2 − a`; with `gather`, `n − 1` all-gather steps in which it copies
    /// segment `r − b − t` from its previous rank, where every rank starts owning segment
    /// `r + 1 − b` (`b = a − 1` after a reduce-scatter, 1 for a bare all-gather). `seg(i)` is
    /// segment `i`'s (first element, element count).
    fn ring(
        &self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        dtype: DataType,
        reduce: Option<(ReduceOp, usize)>,
        gather: bool,
        seg: &dyn Fn(usize) -> (usize, usize),
    ) -> Result<()> {
        let n = self.members.len();
        let size = dtype.size();
        let bytes = |i: usize| {
            let (first, len) = seg(i % n);
            (first * size, len)
        };
        let g = |e| Error::gpu("queueing the collective", e);
        self.record_start(streams)?;
        let reduce_steps = if reduce.is_some() { n - 1 } else { 0 };
        let steps = reduce_steps + if gather { n - 1 } else { 0 };
        let b = reduce.map_or(1, |(_, a)| a - 1);
        for k in 0..steps {
            for r in 0..n {
                let (prev, next) = ((r + n - 1) % n, (r + 1) % n);
                let s = streams[r];
                s.wait_marker(&self.marks(prev)[k]).map_err(g)?;
                if next != prev {
                    s.wait_marker(&self.marks(next)[k]).map_err(g)?;
                }
                let kernels = &self.members[r].kernels;
                match reduce {
                    Some((op, a)) if k < reduce_steps => {
                        let (off, len) = bytes(r + 2 * n - a - k);
                        kernels
                            .reduce(
                                s,
                                Reduction { dtype, op },
                                At::new(buffers[r], off),
                                At::new(buffers[prev], off),
                                len,
                            )
                            .map_err(g)?;
                        if k + 1 == reduce_steps && op == ReduceOp::Avg {
                            let (off, len) = bytes(r + n + 2 - a);
                            kernels
                                .average(s, dtype, buffers[r], off, len, n as u32)
                                .map_err(g)?;
                        }
                    }
                    _ => {
                        let t = k - reduce_steps;
                        let (off, len) = bytes(r + 2 * n - b - t);
                        self.pull(r, s, buffers, off, len * size)?;
                    }
                }
                s.record_marker(&self.marks(r)[k + 1]).map_err(g)?;
            }
        }
        self.finish(streams, steps)
    }

    /// Queues on rank `r`'s stream `s` a copy of `len` bytes at `off` from its previous rank's
    /// buffer into its own: a kernel up to `kernel_copy_max`, the copy engine above.
    fn pull(
        &self,
        r: usize,
        s: &GpuStream,
        buffers: &[&DeviceBuffer],
        off: usize,
        len: usize,
    ) -> Result<()> {
        let prev = (r + buffers.len() - 1) % buffers.len();
        let queued = if len <= self.kernel_copy_max {
            self.members[r].kernels.copy(
                s,
                At::new(buffers[r], off),
                At::new(buffers[prev], off),
                len,
            )
        } else {
            s.copy(buffers[r], off, buffers[prev], off, len)
        };
        queued.map_err(|e| Error::gpu("queueing a copy from the previous rank", e))
    }

    /// The next rank read this rank's buffer up to the last step: the collective ends on each
    /// stream only once that read is done.
    fn finish(&self, streams: &[&GpuStream], steps: usize) -> Result<()> {
        let n = self.members.len();
        for (r, stream) in streams.iter().enumerate() {
            stream
                .wait_marker(&self.marks((r + 1) % n)[steps])
                .map_err(|e| Error::gpu("queueing the end of the collective", e))?;
        }
        Ok(())
    }

    /// Two ranks in one step: rank `r` combines half `r` of both buffers into both, after the
    /// peer's earlier work; each stream then waits for the peer's half to land in its buffer.
    fn one_step(
        &self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        count: usize,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let g = |e| Error::gpu("queueing the allreduce", e);
        let halves = [(0, count / 2), (count / 2, count - count / 2)];
        for (r, &(start, len)) in halves.iter().enumerate() {
            let peer = 1 - r;
            let s = streams[r];
            s.wait_marker(&self.marks(peer)[0]).map_err(g)?;
            let off = start * dtype.size();
            self.members[r]
                .kernels
                .reduce_both(
                    s,
                    Reduction { dtype, op },
                    At::new(buffers[r], off),
                    At::new(buffers[peer], off),
                    len,
                    2,
                )
                .map_err(g)?;
            s.record_marker(&self.marks(r)[1]).map_err(g)?;
        }
        for (r, stream) in streams.iter().enumerate() {
            stream.wait_marker(&self.marks(1 - r)[1]).map_err(g)?;
        }
        Ok(())
    }

    fn check(
        &self,
        buffers: &[&DeviceBuffer],
        streams: &[&GpuStream],
        count: usize,
        dtype: DataType,
    ) -> Result<()> {
        let n = self.members.len();
        if buffers.len() != n || streams.len() != n {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{} buffers and {} streams for a group of {n} ranks",
                    buffers.len(),
                    streams.len()
                ),
            });
        }
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("{count} elements of {dtype:?} overflow the address space"),
            })?;
        for (r, m) in self.members.iter().enumerate() {
            if buffers[r].len() < bytes {
                return Err(Error::InvalidArgument {
                    reason: format!(
                        "rank {r}'s buffer holds {} bytes, the collective needs {bytes}",
                        buffers[r].len()
                    ),
                });
            }
            if !nodetour_core::cuda::same_context(buffers[r].context(), &m.context) {
                return Err(Error::InvalidArgument {
                    reason: format!("rank {r}'s buffer is not on rank {r}'s GPU"),
                });
            }
            if !nodetour_core::cuda::same_context(streams[r].context(), &m.context) {
                return Err(Error::InvalidArgument {
                    reason: format!("rank {r}'s stream is not on rank {r}'s GPU"),
                });
            }
        }
        for (i, a) in buffers.iter().enumerate() {
            if buffers[..i]
                .iter()
                .any(|b| b.device_ptr() == a.device_ptr())
            {
                return Err(Error::InvalidArgument {
                    reason: format!("rank {i}'s buffer is also another rank's buffer"),
                });
            }
        }
        Ok(())
    }
}

/// Whether the collective on `streams` is being captured into a CUDA graph: every stream in
/// one capture (the caller forked them from one capturing stream, so the ranks' markers become
/// the graph's edges), or none. Some streams capturing and others not, or streams in separate
/// captures (one thread per GPU, each capturing its own stream), is `Unsupported`: a rank
/// cannot wait for a marker recorded in another graph.
fn capture_of(streams: &[&GpuStream]) -> Result<bool> {
    let mut ids = Vec::with_capacity(streams.len());
    for s in streams {
        ids.push(
            s.capture_id()
                .map_err(|e| Error::gpu("asking about stream capture", e))?,
        );
    }
    match ids.first().copied().flatten() {
        None if ids.iter().all(Option::is_none) => Ok(false),
        Some(id) if ids.iter().all(|i| *i == Some(id)) => Ok(true),
        _ => Err(Error::Unsupported {
            reason: format!(
                "the GPUs' streams are not all in one CUDA graph capture (capture ids by rank: \
                 {ids:?}): capture the one-process path from one thread, starting the capture \
                 on one stream and forking every GPU's stream from it (cuEventRecord on the \
                 capturing stream, cuStreamWaitEvent on the others) before the collectives, \
                 inside a nodetour Group"
            ),
        }),
    }
}

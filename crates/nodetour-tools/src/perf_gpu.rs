//! GPU allreduce sweeps measured like `all_reduce_perf`, with the references in the same run:
//! NCCL's allreduce ([`crate::nccl_ref`], cudarc's `nccl::Comm`) on buffers of its own of the
//! same size, queued on the same streams (the two alternate, batch by batch, and each reports
//! the median of its batches), and the machine's copy ceilings ([`crate::ceiling`]). Every row
//! checks each implementation's results against the float64 reference first.
//!
//! - `nodetour perf --gpus 0,1`: the direct GPU ring (`Communicator::from_devices`, driven by a
//!   `Group`) over the GPUs of this process;
//! - `nodetour perf --gpu` under a launcher: one GPU per process ([`crate::gpu_job`]), the
//!   direct path (cuda-ipc), the staged path (shm) or both side by side.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cudarc::driver::{CudaContext, CudaStream};
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_ring::comm::{Communicator, DevicePath, Elements, Group, Options};
use nodetour_ring::{DataType, ReduceOp};
use serde_json::json;

use crate::ceiling::{CEILING_BYTES, Ceilings, measure};
use crate::compute_load::ComputeLoad;
use crate::gpu_job::{GpuJob, is_direct};
use crate::nccl_ref::{self, NcclBuffer};
use crate::perf::{median, progress};
use crate::plot::Series;
use nodetour_ring::seeded::{input, verify};

/// Batches per size and implementation (the median is reported).
const BATCHES: usize = 5;
/// Length of one kernel of the compute load, alone (µs): about a large GEMM tile's worth.
const COMPUTE_KERNEL_US: f64 = 200.0;

/// One measured size of one path.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuRow {
    /// Bytes per rank.
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// `direct` or `staged`.
    pub path: &'static str,
    /// The copy ceiling this path is bounded by, GB/s (when measured).
    pub ceiling: Option<f64>,
    /// nodetour: seconds per collective, busbw GB/s, result correct.
    pub nodetour: (f64, f64, bool),
    /// NCCL, when compared: seconds per collective, busbw GB/s, result correct.
    pub nccl: Option<(f64, f64, bool)>,
    /// Beside a compute load ([`SweepSpec::beside_compute`]): what the collectives left of it.
    pub compute: Option<ComputeShare>,
}

/// The compute load's kernels finished per second, alone and while each implementation's
/// collectives ran beside it (a share of 1.0: the collective took nothing from the compute).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeShare {
    /// With nothing else on the GPU.
    pub alone_per_s: f64,
    /// While nodetour's collectives ran.
    pub beside_ours_per_s: f64,
    /// While NCCL's ran (when compared).
    pub beside_nccl_per_s: Option<f64>,
}

impl ComputeShare {
    fn ours(&self) -> f64 {
        self.beside_ours_per_s / self.alone_per_s.max(1e-9)
    }

    fn nccl(&self) -> Option<f64> {
        self.beside_nccl_per_s
            .map(|v| v / self.alone_per_s.max(1e-9))
    }
}

struct Ranks {
    buffers: Vec<DeviceBuffer>,
    /// The cudarc streams (NCCL queues there) and the same streams seen as nodetour's.
    cu_streams: Vec<Arc<CudaStream>>,
    streams: Vec<GpuStream>,
    /// NCCL's communicators and buffers, when compared.
    nccl: Option<(Vec<cudarc::nccl::Comm>, Vec<NcclBuffer>)>,
}

impl Ranks {
    fn load(&self, dtype: DataType, op: ReduceOp, count: usize, seed: u64) -> anyhow::Result<()> {
        for (r, b) in self.buffers.iter().enumerate() {
            b.copy_from_host(0, &input(dtype, op, r as u32, count, seed))?;
        }
        Ok(())
    }

    fn check(
        &self,
        dtype: DataType,
        op: ReduceOp,
        count: usize,
        seed: u64,
    ) -> anyhow::Result<bool> {
        let world = self.buffers.len() as u32;
        let mut ok = true;
        for (b, s) in self.buffers.iter().zip(&self.streams) {
            s.synchronize()?;
            let mut got = vec![0u8; count * dtype.size()];
            b.copy_to_host(0, &mut got)?;
            if let Err(e) = verify(dtype, op, world, &got, seed) {
                tracing::error!(%e, "wrong allreduce result");
                ok = false;
            }
        }
        Ok(ok)
    }

    fn sync(&self) -> anyhow::Result<()> {
        for s in &self.streams {
            s.synchronize()?;
        }
        Ok(())
    }

    /// NCCL's allreduce of the seeded inputs of `seed`, checked on every rank.
    fn nccl_checked(
        &mut self,
        dtype: DataType,
        op: ReduceOp,
        count: usize,
        seed: u64,
    ) -> anyhow::Result<Option<bool>> {
        let Some((comms, bufs)) = self.nccl.as_mut() else {
            return Ok(None);
        };
        for (r, (b, s)) in bufs.iter_mut().zip(&self.cu_streams).enumerate() {
            b.load(s, &input(dtype, op, r as u32, count, seed))?;
        }
        nccl_ref::all_reduce_group(comms, bufs, count, op)?;
        let world = bufs.len() as u32;
        let mut ok = true;
        for (b, s) in bufs.iter().zip(&self.cu_streams) {
            if let Err(e) = verify(dtype, op, world, &b.read(s, count)?, seed) {
                tracing::error!(%e, "wrong NCCL allreduce result");
                ok = false;
            }
        }
        Ok(Some(ok))
    }
}

/// What a GPU sweep measures.
#[derive(Clone, Debug)]
pub struct SweepSpec {
    /// Bytes per rank, one row each.
    pub sizes: Vec<usize>,
    /// Element type.
    pub dtype: DataType,
    /// Operation.
    pub op: ReduceOp,
    /// Untimed collectives per size.
    pub warmup: usize,
    /// Collectives per timed batch.
    pub iters: usize,
    /// NCCL alongside.
    pub compare_nccl: bool,
    /// The copy ceilings.
    pub ceiling: bool,
    /// Run every collective beside a compute load on another stream of the same GPU
    /// ([`crate::compute_load`]); per-process sweeps only.
    pub beside_compute: bool,
    /// Also time each path's collectives captured into a CUDA graph and replayed (rows
    /// `direct-graph`, `staged-graph`); per-process sweeps only.
    pub graph: bool,
}

/// Runs the sweep on the GPUs `ordinals` (one rank each, in that order).
pub fn sweep(
    ordinals: &[usize],
    spec: &SweepSpec,
    kernel_copy_max: Option<usize>,
    one_step_max: Option<usize>,
) -> anyhow::Result<(String, Vec<GpuRow>)> {
    let SweepSpec {
        ref sizes,
        dtype,
        op,
        warmup,
        iters,
        compare_nccl,
        ceiling,
        beside_compute,
        graph,
    } = *spec;
    anyhow::ensure!(
        !beside_compute && !graph,
        "--beside-compute and --graph measure one GPU per process (--gpu under a launcher)"
    );
    let contexts = ordinals
        .iter()
        .map(|&o| CudaContext::new(o).with_context(|| format!("opening GPU {o}")))
        .collect::<anyhow::Result<Vec<Arc<CudaContext>>>>()?;
    let peer_ceiling = if ceiling {
        let n = contexts.len();
        let pairs: Vec<_> = (0..n)
            .map(|i| {
                (
                    contexts[i].clone(),
                    (n > 1).then(|| contexts[(i + 1) % n].clone()),
                )
            })
            .collect();
        let c = Ceilings::min_of(&measure(&pairs, CEILING_BYTES, &|| Ok(()))?);
        eprintln!(
            "ceilings: peer copy {} GB/s per direction, D2H {:.1} / H2D {:.1} GB/s (all GPUs at once)",
            c.peer.map_or("-".into(), |p| format!("{p:.1}")),
            c.d2h,
            c.h2d
        );
        c.peer
    } else {
        None
    };
    let mut options = Options::from_env()?;
    if let Some(b) = kernel_copy_max {
        options.kernel_copy_max = b;
    }
    if let Some(b) = one_step_max {
        options.one_step_max = b;
    }
    let comms = Communicator::from_devices(&contexts, options)?;
    let path = match &comms[0].paths().device {
        DevicePath::InProcess { reason } => reason.clone(),
        other => format!("{other:?}"),
    };
    tracing::info!(ranks = contexts.len(), path = %path, "GPU group ready");
    let n = contexts.len() as f64;
    let es = dtype.size();
    let largest = sizes.iter().max().copied().unwrap_or(0).max(es);
    let cu_streams = contexts
        .iter()
        .map(|c| c.new_stream())
        .collect::<Result<Vec<_>, _>>()?;
    let nccl = if compare_nccl {
        let comms = nccl_ref::local(&cu_streams).context("starting NCCL (the reference)")?;
        let bufs = cu_streams
            .iter()
            .map(|s| NcclBuffer::zeroed(s, dtype, largest / es))
            .collect::<anyhow::Result<_>>()?;
        Some((comms, bufs))
    } else {
        None
    };
    let mut ranks = Ranks {
        buffers: contexts
            .iter()
            .map(|c| DeviceBuffer::new(c, largest))
            .collect::<nodetour_core::Result<_>>()?,
        streams: cu_streams.iter().map(GpuStream::of_cudarc).collect(),
        cu_streams,
        nccl,
    };
    let mut rows = Vec::new();
    for (k, &size) in sizes.iter().enumerate() {
        let count = size / es;
        let bytes = count * es;
        let busbw = |secs: f64| bytes as f64 / secs / 1e9 * 2.0 * (n - 1.0) / n;
        // Correctness first, on fresh data of its own, for each implementation.
        let seed = 2 * k as u64;
        ranks.load(dtype, op, count, seed)?;
        all_reduce(&comms, &ranks, count, dtype, op)?;
        let ours_ok = ranks.check(dtype, op, count, seed)?;
        let nccl_ok = ranks.nccl_checked(dtype, op, count, seed + 1)?;
        // Then timing, alternating batches; the data keeps being reduced (values do not
        // matter for the time).
        let batch = iters.max(1);
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for round in 0..BATCHES + 1 {
            let reps = if round == 0 { warmup } else { batch };
            let t = Instant::now();
            for _ in 0..reps {
                all_reduce(&comms, &ranks, count, dtype, op)?;
            }
            ranks.sync()?;
            if round > 0 {
                ours.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            if let Some((nc, bufs)) = ranks.nccl.as_mut() {
                let t = Instant::now();
                for _ in 0..reps {
                    nccl_ref::all_reduce_group(nc, bufs, count, op)?;
                }
                ranks.sync()?;
                if round > 0 {
                    theirs.push(t.elapsed().as_secs_f64() / reps as f64);
                }
            }
        }
        let t_ours = median(ours);
        rows.push(GpuRow {
            bytes,
            count,
            path: "direct",
            ceiling: peer_ceiling,
            nodetour: (t_ours, busbw(t_ours), ours_ok),
            nccl: nccl_ok.map(|ok| {
                let t = median(theirs);
                (t, busbw(t), ok)
            }),
            compute: None,
        });
    }
    Ok((path, rows))
}

/// The rows as text, CSV, JSON or a markdown table. `what` names the ranks (GPUs, or processes) in the header.
pub fn render(
    rows: &[GpuRow],
    format: &str,
    what: &str,
    path: &str,
    dtype: DataType,
    op: ReduceOp,
) -> String {
    let ratio = |r: &GpuRow| r.nccl.map(|(t, _, _)| t / r.nodetour.0);
    let frac = |r: &GpuRow| r.ceiling.map(|c| r.nodetour.1 / c);
    let opt = |v: Option<f64>, prec: usize| v.map_or(String::new(), |x| format!("{x:.prec$}"));
    match format {
        "json" => serde_json::to_string_pretty(&json!({
            "collective": "all_reduce", "ranks": what, "path": path,
            "dtype": dtype.name(), "op": format!("{op:?}").to_lowercase(),
            "rows": rows.iter().map(|r| json!({
                "bytes": r.bytes, "count": r.count, "path": r.path,
                "time_us": r.nodetour.0 * 1e6, "busbw_GBps": r.nodetour.1, "correct": r.nodetour.2,
                "ceiling_GBps": r.ceiling, "busbw_vs_ceiling": frac(r),
                "nccl_time_us": r.nccl.map(|x| x.0 * 1e6), "nccl_busbw_GBps": r.nccl.map(|x| x.1),
                "nccl_correct": r.nccl.map(|x| x.2), "busbw_vs_nccl": ratio(r),
                "compute_alone_per_s": r.compute.map(|c| c.alone_per_s),
                "compute_beside_per_s": r.compute.map(|c| c.beside_ours_per_s),
                "compute_beside_nccl_per_s": r.compute.and_then(|c| c.beside_nccl_per_s),
            })).collect::<Vec<_>>(),
        }))
        .unwrap_or_default(),
        "markdown" => {
            let mut s = format!(
                "all_reduce on {what}, {dtype:?} {op:?}; path: {path}\n\n| size | path | time (µs) | busbw (GB/s) | vs ceiling | NCCL time (µs) | NCCL busbw (GB/s) | vs NCCL | check |\n|---|---|---|---|---|---|---|---|---|\n"
            );
            for r in rows {
                let dash = |v: String| if v.is_empty() { "-".to_owned() } else { v };
                let ok = r.nodetour.2 && r.nccl.is_none_or(|x| x.2);
                s.push_str(&format!(
                    "| {} | {} | {:.1} | {:.1} | {} | {} | {} | {} | {} |\n",
                    crate::perf::human_size(r.bytes),
                    r.path,
                    r.nodetour.0 * 1e6,
                    r.nodetour.1,
                    dash(opt(frac(r), 2)),
                    dash(opt(r.nccl.map(|x| x.0 * 1e6), 1)),
                    dash(opt(r.nccl.map(|x| x.1), 1)),
                    dash(opt(ratio(r), 2)),
                    if ok { "ok" } else { "WRONG" }
                ));
            }
            s
        }
        "csv" => {
            let mut s = "bytes,count,path,time_us,busbw_GBps,correct,ceiling_GBps,busbw_vs_ceiling,nccl_time_us,nccl_busbw_GBps,nccl_correct,busbw_vs_nccl,compute_share,nccl_compute_share\n".to_owned();
            for r in rows {
                s.push_str(&format!(
                    "{},{},{},{:.1},{:.3},{},{},{},{},{},{},{},{},{}\n",
                    r.bytes,
                    r.count,
                    r.path,
                    r.nodetour.0 * 1e6,
                    r.nodetour.1,
                    r.nodetour.2,
                    opt(r.ceiling, 3),
                    opt(frac(r), 3),
                    opt(r.nccl.map(|x| x.0 * 1e6), 1),
                    opt(r.nccl.map(|x| x.1), 3),
                    r.nccl.map_or(String::new(), |x| x.2.to_string()),
                    opt(ratio(r), 3),
                    opt(r.compute.map(|c| c.ours()), 3),
                    opt(r.compute.and_then(|c| c.nccl()), 3)
                ));
            }
            s
        }
        _ => {
            let mut s = format!(
                "# nodetour perf: all_reduce on {what}, {dtype:?} {op:?}\n# path: {path}\n"
            );
            if rows.iter().any(|r| r.compute.is_some()) {
                s.push_str(
                    "# beside a compute load on another stream of each GPU: cmp = its kernels \
                     finished per second beside our collectives / alone, ncmp = beside NCCL's\n",
                );
            }
            s.push_str(&format!(
                "{:>12} {:>12} {:>7} {:>10} {:>9} {:>6} {:>8} {:>10} {:>9} {:>6} {:>8}\n",
                "size(B)",
                "count",
                "path",
                "time(us)",
                "busbw",
                "check",
                "vs ceil",
                "nccl(us)",
                "busbw",
                "check",
                "vs nccl"
            ));
            let beside = rows.iter().any(|r| r.compute.is_some());
            if beside {
                s.pop();
                s.push_str(&format!(" {:>6} {:>6}\n", "cmp", "ncmp"));
            }
            for r in rows {
                let ok = |c: bool| if c { "ok" } else { "WRONG" };
                let (nt, nb, nc) = r.nccl.map_or(("-".into(), "-".into(), "-"), |(t, b, c)| {
                    (format!("{:.1}", t * 1e6), format!("{b:.2}"), ok(c))
                });
                let dash = |v: String| if v.is_empty() { "-".to_owned() } else { v };
                s.push_str(&format!(
                    "{:>12} {:>12} {:>7} {:>10.1} {:>9.2} {:>6} {:>8} {:>10} {:>9} {:>6} {:>8}\n",
                    r.bytes,
                    r.count,
                    r.path,
                    r.nodetour.0 * 1e6,
                    r.nodetour.1,
                    ok(r.nodetour.2),
                    dash(opt(frac(r), 3)),
                    nt,
                    nb,
                    nc,
                    dash(opt(ratio(r), 3))
                ));
                if beside {
                    s.pop();
                    s.push_str(&format!(
                        " {:>6} {:>6}\n",
                        dash(opt(r.compute.map(|c| c.ours()), 2)),
                        dash(opt(r.compute.and_then(|c| c.nccl()), 2))
                    ));
                }
            }
            s
        }
    }
}

/// The plot's lines: busbw of each path, and NCCL's where measured.
pub fn series(rows: &[GpuRow]) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    let mut add = |name: String, point: (usize, f64)| match out.iter_mut().find(|s| s.name == name)
    {
        Some(s) => s.points.push(point),
        None => out.push(Series {
            name,
            points: vec![point],
        }),
    };
    for r in rows {
        add(format!("nodetour {}", r.path), (r.bytes, r.nodetour.1));
        if let Some((_, b, _)) = r.nccl {
            add("NCCL".into(), (r.bytes, b));
        }
    }
    for s in &mut out {
        s.points.sort_by_key(|p| p.0);
        s.points.dedup_by_key(|p| p.0);
    }
    out
}

/// Sweeps a GPU ring of processes (one GPU each): every variant of the job (e.g. the direct
/// ring and the staged one), NCCL's allreduce (one rank per process, `ncclCommInitRank` with
/// the job's NCCL id) when `compare_nccl`, and the copy ceilings when `ceiling`. Every rank
/// returns the same rows (its own timings). `iters` collectives per timed batch (0: as many as
/// make about 4 GiB, 2 to 50).
pub fn ring_sweep(g: &GpuJob, spec: &SweepSpec, timeout: Duration) -> anyhow::Result<Vec<GpuRow>> {
    let (sizes, dtype, op, warmup, iters) =
        (&spec.sizes, spec.dtype, spec.op, spec.warmup, spec.iters);
    let (compare_nccl, ceiling) = (spec.compare_nccl, spec.ceiling);
    let ceilings = if ceiling {
        let next = match g.next_gpu {
            Some(o) => Some(CudaContext::new(o).with_context(|| format!("opening GPU {o}"))?),
            None => None,
        };
        let c = measure(&[(g.context.clone(), next)], CEILING_BYTES, &|| {
            Ok(g.barrier()?)
        })?[0];
        eprintln!(
            "rank {}: ceilings: peer copy {} GB/s per direction, D2H {:.1} / H2D {:.1} GB/s (all GPUs at once)",
            g.rank,
            c.peer.map_or("-".into(), |p| format!("{p:.1}")),
            c.d2h,
            c.h2d
        );
        Some(c)
    } else {
        None
    };
    let es = dtype.size();
    let largest = sizes.iter().max().copied().unwrap_or(0).max(es);
    let buf = DeviceBuffer::new(&g.context, largest)?;
    // A cudarc stream (its graphs capture and launch there; NCCL queues there), seen as
    // nodetour's.
    let cu_stream = g.context.new_stream()?;
    let stream = GpuStream::of_cudarc(&cu_stream);
    let mut nccl = if compare_nccl {
        let id = g.nccl_id.context("the job was formed without an NCCL id")?;
        let comm = nccl_ref::join(&id, g.world, g.rank, &cu_stream)
            .context("starting NCCL (the reference)")?;
        Some((comm, NcclBuffer::zeroed(&cu_stream, dtype, largest / es)?))
    } else {
        None
    };
    let n = f64::from(g.world);
    // Every rank's load runs before any rank measures it alone (the GPUs may be shared).
    let load = if spec.beside_compute {
        let l = ComputeLoad::start(&g.context, COMPUTE_KERNEL_US, Duration::from_millis(300))?;
        g.barrier()?;
        eprintln!(
            "rank {}: compute load: {} blocks of {} threads per kernel, {:.0} µs alone, {:.0} kernels/s",
            g.rank,
            l.blocks,
            nodetour_core::cuda::busy::BUSY_THREADS,
            l.kernel_us,
            l.alone_per_s
        );
        Some(l)
    } else {
        None
    };
    // Kernels of the load finished, and seconds, while each implementation ran.
    let (mut beside_ours, mut beside_nccl) = ((0u64, 0f64), (0u64, 0f64));
    let deadline = || Deadline::after(timeout);
    let mut rows = Vec::new();
    for (k, &size) in sizes.iter().enumerate() {
        progress(k, sizes.len(), &format!("{size} bytes"));
        let count = size / es;
        let bytes = count * es;
        let busbw = |secs: f64| bytes as f64 / secs / 1e9 * 2.0 * (n - 1.0) / n;
        // Each checked collective of this size has an input of its own (seeds from `seed0`).
        let seed0 = 64 * k as u64;
        let check = |ok: &mut bool, seed: u64| -> anyhow::Result<()> {
            stream.synchronize()?;
            let mut got = vec![0u8; bytes];
            buf.copy_to_host(0, &mut got)?;
            *ok = verify(dtype, op, g.world, &got, seed).is_ok();
            Ok(())
        };
        let mut nccl_ok = None;
        if let Some((c, nb)) = nccl.as_mut() {
            nb.load(&cu_stream, &input(dtype, op, g.rank, count, seed0))?;
            nb.all_reduce(c, count, op)?;
            nccl_ok = Some(verify(dtype, op, g.world, &nb.read(&cu_stream, count)?, seed0).is_ok());
        }
        let mut theirs = Vec::new();
        let mut per_ring = Vec::new();
        let mut graph_rows = Vec::new();
        let mut shares = Vec::new();
        for (vi, v) in g.variants.iter().enumerate() {
            let comm = &v.comm;
            let seed = seed0 + 1 + 2 * vi as u64;
            buf.copy_from_host(0, &input(dtype, op, g.rank, count, seed))?;
            comm.all_reduce_in_place(&mut Elements::new(&buf, count, dtype)?, op, &stream)?;
            comm.wait(deadline())?;
            let mut ok = false;
            check(&mut ok, seed)?;
            let mut ours = Vec::new();
            for round in 0..=BATCHES {
                let reps = if round == 0 {
                    warmup.max(1)
                } else {
                    iters.max(1)
                };
                let mark = load.as_ref().map(ComputeLoad::mark);
                let start = stream.record()?;
                for _ in 0..reps {
                    comm.all_reduce_in_place(&mut Elements::new(&buf, count, dtype)?, op, &stream)?;
                }
                let end = stream.record()?;
                comm.wait(deadline())?;
                if round > 0 {
                    ours.push(f64::from(start.elapsed_ms(&end)?) / 1e3 / reps as f64);
                    if let (Some(l), Some(m)) = (&load, mark) {
                        stream.synchronize()?;
                        let (k, t) = l.since(m);
                        beside_ours = (beside_ours.0 + k, beside_ours.1 + t);
                    }
                }
                // NCCL alternates with the first path's batches.
                if let (Some((c, nb)), true) = (nccl.as_mut(), per_ring.is_empty()) {
                    let mark = load.as_ref().map(ComputeLoad::mark);
                    let start = stream.record()?;
                    for _ in 0..reps {
                        nb.all_reduce(c, count, op)?;
                    }
                    let end = stream.record()?;
                    if round > 0 {
                        theirs.push(f64::from(start.elapsed_ms(&end)?) / 1e3 / reps as f64);
                        if let (Some(l), Some(m)) = (&load, mark) {
                            stream.synchronize()?;
                            let (k, t) = l.since(m);
                            beside_nccl = (beside_nccl.0 + k, beside_nccl.1 + t);
                        }
                    }
                }
            }
            per_ring.push((is_direct(comm), median(ours), ok));
            if spec.graph {
                // The same collectives captured into a graph and replayed: its result checked
                // once (one collective), its time per collective over `iters` captured ones.
                let reps = iters.max(1);
                let check_graph = capture(&cu_stream, 1, || {
                    comm.all_reduce_in_place(&mut Elements::new(&buf, count, dtype)?, op, &stream)
                })?;
                let timed = capture(&cu_stream, reps, || {
                    comm.all_reduce_in_place(&mut Elements::new(&buf, count, dtype)?, op, &stream)
                })?;
                buf.copy_from_host(0, &input(dtype, op, g.rank, count, seed + 1))?;
                check_graph.launch()?;
                // The replay's outcome, once the stream ran it.
                comm.wait_stream(&stream, deadline())?;
                let mut graph_ok = false;
                check(&mut graph_ok, seed + 1)?;
                timed.launch()?; // warm-up
                let mut replayed = Vec::new();
                for _ in 0..BATCHES {
                    let start = stream.record()?;
                    timed.launch()?;
                    let end = stream.record()?;
                    comm.wait_stream(&stream, deadline())?;
                    replayed.push(f64::from(start.elapsed_ms(&end)?) / 1e3 / reps as f64);
                }
                graph_rows.push((is_direct(comm), median(replayed), graph_ok));
            }
            let rate = |(k, t): (u64, f64)| k as f64 / t.max(1e-9);
            shares.push(load.as_ref().map(|l| ComputeShare {
                alone_per_s: l.alone_per_s,
                beside_ours_per_s: rate(std::mem::take(&mut beside_ours)),
                beside_nccl_per_s: (beside_nccl.1 > 0.0).then(|| rate(beside_nccl)),
            }));
        }
        let nccl_row = nccl_ok.map(|ok| {
            let t = median(std::mem::take(&mut theirs));
            (t, busbw(t), ok)
        });
        beside_nccl = (0, 0.0);
        for ((direct, t, ok), compute) in per_ring.into_iter().zip(shares) {
            rows.push(GpuRow {
                bytes,
                count,
                path: if direct { "direct" } else { "staged" },
                ceiling: ceilings.and_then(|c| if direct { c.peer } else { Some(c.staged()) }),
                nodetour: (t, busbw(t), ok),
                nccl: nccl_row,
                compute,
            });
        }
        for (direct, t, ok) in graph_rows {
            rows.push(GpuRow {
                bytes,
                count,
                path: if direct {
                    "direct-graph"
                } else {
                    "staged-graph"
                },
                ceiling: ceilings.and_then(|c| if direct { c.peer } else { Some(c.staged()) }),
                nodetour: (t, busbw(t), ok),
                nccl: nccl_row,
                compute: None,
            });
        }
    }
    if let Some(l) = load {
        l.stop()?;
    }
    progress(sizes.len(), sizes.len(), "done");
    Ok(rows)
}

/// `reps` calls of `queue` (each queueing one collective on `stream`) captured into a CUDA graph.
fn capture(
    stream: &Arc<cudarc::driver::CudaStream>,
    reps: usize,
    queue: impl Fn() -> nodetour_ring::Result<()>,
) -> anyhow::Result<cudarc::driver::CudaGraph> {
    use cudarc::driver::sys;
    stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
    let queued = (0..reps).try_for_each(|_| queue());
    // End the capture whatever happened (a stream left capturing breaks everything after).
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    queued.context("queueing a collective under capture")?;
    graph?.context("the capture made no graph")
}

/// One allreduce over every GPU of the set, queued from this thread as a group.
fn all_reduce(
    comms: &[Communicator],
    ranks: &Ranks,
    count: usize,
    dtype: DataType,
    op: ReduceOp,
) -> nodetour_ring::Result<()> {
    let mut group = Group::new();
    for ((comm, buf), stream) in comms.iter().zip(&ranks.buffers).zip(&ranks.streams) {
        group.add(comm, move |c| {
            c.all_reduce_in_place(&mut Elements::new(buf, count, dtype)?, op, stream)
        })?;
    }
    group.end()
}

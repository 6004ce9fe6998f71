//! `nodetour perf --gpus 0,1 [--compare nccl]`: the direct GPU ring ([`GpuGroup`]) over the GPUs
//! of this process, measured like `all_reduce_perf`, with NCCL's allreduce on the same buffers
//! and streams in the same run as the reference: the two alternate, batch by batch, and each
//! reports the median of its batches. Every row checks both results against the float64
//! reference first.

use std::sync::Arc;
use std::time::Instant;

use anyhow::Context as _;
use cudarc::driver::CudaContext;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::nccl::LocalNccl;
use nodetour_ring::{DataType, GpuGroup, ReduceOp};
use serde_json::json;

use crate::perf::{pattern, verify};

/// Batches per size and implementation (the median is reported).
const BATCHES: usize = 5;

/// One measured size.
#[derive(Clone, Debug, PartialEq)]
pub struct GpuRow {
    /// Bytes per rank.
    pub bytes: usize,
    /// Elements.
    pub count: usize,
    /// nodetour: seconds per collective, busbw GB/s, result correct.
    pub nodetour: (f64, f64, bool),
    /// NCCL, when compared: seconds per collective, busbw GB/s, result correct.
    pub nccl: Option<(f64, f64, bool)>,
}

struct Ranks {
    buffers: Vec<DeviceBuffer>,
    streams: Vec<GpuStream>,
}

impl Ranks {
    fn load(&self, dtype: DataType, count: usize) -> anyhow::Result<()> {
        for (r, b) in self.buffers.iter().enumerate() {
            b.copy_from_host(0, &pattern(dtype, r as u32, count))?;
        }
        Ok(())
    }

    fn check(&self, dtype: DataType, op: ReduceOp, count: usize) -> anyhow::Result<bool> {
        let world = self.buffers.len() as u32;
        let mut ok = true;
        for (b, s) in self.buffers.iter().zip(&self.streams) {
            s.synchronize()?;
            let mut got = vec![0u8; count * dtype.size()];
            b.copy_to_host(0, &mut got)?;
            if let Err(e) = verify(dtype, op, world, &got) {
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
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Runs the sweep on the GPUs `ordinals` (one rank each, in that order).
#[allow(clippy::too_many_arguments)]
pub fn sweep(
    ordinals: &[usize],
    sizes: &[usize],
    dtype: DataType,
    op: ReduceOp,
    warmup: usize,
    iters: usize,
    compare_nccl: bool,
    kernel_copy_max: Option<usize>,
    one_step_max: Option<usize>,
) -> anyhow::Result<(String, Vec<GpuRow>)> {
    let contexts = ordinals
        .iter()
        .map(|&o| CudaContext::new(o).with_context(|| format!("opening GPU {o}")))
        .collect::<anyhow::Result<Vec<Arc<CudaContext>>>>()?;
    let mut group = GpuGroup::new(&contexts)?;
    if let Some(b) = kernel_copy_max {
        group.set_kernel_copy_max(b);
    }
    if let Some(b) = one_step_max {
        group.set_one_step_max(b);
    }
    let path = group.path().to_owned();
    tracing::info!(ranks = contexts.len(), path = %path, "GPU group ready");
    let mut nccl = if compare_nccl {
        let list: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        Some(LocalNccl::new(&list).context("starting NCCL (the reference)")?)
    } else {
        None
    };
    let n = contexts.len() as f64;
    let es = dtype.size();
    let largest = sizes.iter().max().copied().unwrap_or(0).max(es);
    let ranks = Ranks {
        buffers: contexts
            .iter()
            .map(|c| DeviceBuffer::new(c, largest))
            .collect::<nodetour_core::Result<_>>()?,
        streams: contexts
            .iter()
            .map(GpuStream::new)
            .collect::<nodetour_core::Result<_>>()?,
    };
    let b: Vec<&DeviceBuffer> = ranks.buffers.iter().collect();
    let s: Vec<&GpuStream> = ranks.streams.iter().collect();
    let mut rows = Vec::new();
    for &size in sizes {
        let count = size / es;
        let bytes = count * es;
        let busbw = |secs: f64| bytes as f64 / secs / 1e9 * 2.0 * (n - 1.0) / n;
        // Correctness first, on fresh data, for each implementation.
        ranks.load(dtype, count)?;
        group.all_reduce(&b, &s, count, dtype, op)?;
        let ours_ok = ranks.check(dtype, op, count)?;
        let nccl_ok = match nccl.as_mut() {
            Some(nc) => {
                ranks.load(dtype, count)?;
                nc.all_reduce(&b, &s, count, dtype, op)?;
                Some(ranks.check(dtype, op, count)?)
            }
            None => None,
        };
        // Then timing, alternating batches; the data keeps being reduced (values do not
        // matter for the time).
        let batch = iters.max(1);
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for round in 0..BATCHES + 1 {
            let reps = if round == 0 { warmup } else { batch };
            let t = Instant::now();
            for _ in 0..reps {
                group.all_reduce(&b, &s, count, dtype, op)?;
            }
            ranks.sync()?;
            if round > 0 {
                ours.push(t.elapsed().as_secs_f64() / reps as f64);
            }
            if let Some(nc) = nccl.as_mut() {
                let t = Instant::now();
                for _ in 0..reps {
                    nc.all_reduce(&b, &s, count, dtype, op)?;
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
            nodetour: (t_ours, busbw(t_ours), ours_ok),
            nccl: nccl_ok.map(|ok| {
                let t = median(theirs);
                (t, busbw(t), ok)
            }),
        });
    }
    Ok((path, rows))
}

/// The rows as text, CSV or JSON.
pub fn render(
    rows: &[GpuRow],
    format: &str,
    ordinals: &[usize],
    path: &str,
    dtype: DataType,
    op: ReduceOp,
) -> String {
    let ratio = |r: &GpuRow| r.nccl.map(|(t, _, _)| t / r.nodetour.0);
    match format {
        "json" => serde_json::to_string_pretty(&json!({
            "collective": "all_reduce", "gpus": ordinals, "path": path,
            "dtype": dtype.name(), "op": format!("{op:?}").to_lowercase(),
            "rows": rows.iter().map(|r| json!({
                "bytes": r.bytes, "count": r.count,
                "time_us": r.nodetour.0 * 1e6, "busbw_GBps": r.nodetour.1, "correct": r.nodetour.2,
                "nccl_time_us": r.nccl.map(|x| x.0 * 1e6), "nccl_busbw_GBps": r.nccl.map(|x| x.1),
                "nccl_correct": r.nccl.map(|x| x.2), "busbw_vs_nccl": ratio(r),
            })).collect::<Vec<_>>(),
        }))
        .unwrap_or_default(),
        "csv" => {
            let mut s = "bytes,count,time_us,busbw_GBps,correct,nccl_time_us,nccl_busbw_GBps,nccl_correct,busbw_vs_nccl\n".to_owned();
            for r in rows {
                let (nt, nb, nc) = r.nccl.map_or(
                    (String::new(), String::new(), String::new()),
                    |(t, b, c)| (format!("{:.1}", t * 1e6), format!("{b:.3}"), c.to_string()),
                );
                s.push_str(&format!(
                    "{},{},{:.1},{:.3},{},{nt},{nb},{nc},{}\n",
                    r.bytes,
                    r.count,
                    r.nodetour.0 * 1e6,
                    r.nodetour.1,
                    r.nodetour.2,
                    ratio(r).map_or(String::new(), |x| format!("{x:.3}"))
                ));
            }
            s
        }
        _ => {
            let mut s = format!(
                "# nodetour perf: all_reduce on GPUs {ordinals:?}, {dtype:?} {op:?}\n# path: {path}\n"
            );
            s.push_str(&format!(
                "{:>12} {:>12} {:>10} {:>9} {:>6} {:>10} {:>9} {:>6} {:>8}\n",
                "size(B)",
                "count",
                "time(us)",
                "busbw",
                "check",
                "nccl(us)",
                "busbw",
                "check",
                "vs nccl"
            ));
            for r in rows {
                let ok = |c: bool| if c { "ok" } else { "WRONG" };
                let (nt, nb, nc) = r.nccl.map_or(("-".into(), "-".into(), "-"), |(t, b, c)| {
                    (format!("{:.1}", t * 1e6), format!("{b:.2}"), ok(c))
                });
                s.push_str(&format!(
                    "{:>12} {:>12} {:>10.1} {:>9.2} {:>6} {:>10} {:>9} {:>6} {:>8}\n",
                    r.bytes,
                    r.count,
                    r.nodetour.0 * 1e6,
                    r.nodetour.1,
                    ok(r.nodetour.2),
                    nt,
                    nb,
                    nc,
                    ratio(r).map_or("-".into(), |x| format!("{x:.3}"))
                ));
            }
            s
        }
    }
}

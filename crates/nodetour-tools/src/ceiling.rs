//! The copy ceilings of a machine, measured in the same run as the collectives they bound:
//! every GPU at once copies to its ring neighbour's GPU (the direct path's ceiling, per
//! direction, NVLink or PCIe peer-to-peer) and to and from pinned host memory in both
//! directions at once (the staged path's ceiling: the slower of the concurrent D2H and H2D).
//! A ring moves its busbw over each link in each direction, so busbw / ceiling is the fraction
//! of the hardware the collective uses.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::cuda::{GpuEvent, GpuStream, enable_peer_access};
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::transport::gpu::{Flags, ShmSender, ShmSlot, StagedReceive};

use crate::perf::median;

/// Bytes per copy of the ceiling measurement.
pub const CEILING_BYTES: usize = 512 << 20;

/// Measured ceilings of one GPU, GB/s.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Ceilings {
    /// Copy to the next GPU while every GPU does the same (None: no next GPU or no peer access).
    pub peer: Option<f64>,
    /// GPU → pinned host while host → GPU runs too.
    pub d2h: f64,
    /// Host → GPU while GPU → host runs too.
    pub h2d: f64,
}

impl Ceilings {
    /// The staged path's ceiling: the slower direction.
    pub fn staged(&self) -> f64 {
        self.d2h.min(self.h2d)
    }

    /// The lowest of each field over several GPUs (the ring runs at its slowest link).
    pub fn min_of(all: &[Ceilings]) -> Ceilings {
        let mut out = all.first().copied().unwrap_or_default();
        for c in all.iter().skip(1) {
            out.peer = match (out.peer, c.peer) {
                (Some(a), Some(b)) => Some(a.min(b)),
                _ => None,
            };
            out.d2h = out.d2h.min(c.d2h);
            out.h2d = out.h2d.min(c.h2d);
        }
        out
    }
}

struct Gpu {
    src: DeviceBuffer,
    dst: DeviceBuffer,
    peer_dst: Option<DeviceBuffer>,
    host: ShmSlot,
    out: ShmSender,
    streams: [GpuStream; 3],
}

/// Measures the ceilings of `gpus` (each with the GPU it sends to, if any), all copying at
/// once, three times (median). `before_each` runs before each round (a barrier, when other
/// processes measure their GPUs at the same time).
pub fn measure(
    gpus: &[(Arc<CudaContext>, Option<Arc<CudaContext>>)],
    bytes: usize,
    before_each: &dyn Fn() -> anyhow::Result<()>,
) -> anyhow::Result<Vec<Ceilings>> {
    let mut set = Vec::new();
    for (ctx, next) in gpus {
        let host = ShmSlot::create(ctx, 2 * bytes)?;
        let (path, len) = host.grant();
        let out = ShmSender::open(ctx, &path, len, Flags::create(ctx, 1)?, 0)?;
        host.unlink()?;
        let peer_dst = match next {
            Some(n) if !Arc::ptr_eq(n, ctx) && enable_peer_access(ctx, n).unwrap_or(false) => {
                Some(DeviceBuffer::new(n, bytes)?)
            }
            _ => None,
        };
        set.push(Gpu {
            src: DeviceBuffer::new(ctx, bytes)?,
            dst: DeviceBuffer::new(ctx, bytes)?,
            peer_dst,
            host,
            out,
            streams: [
                GpuStream::new(ctx)?,
                GpuStream::new(ctx)?,
                GpuStream::new(ctx)?,
            ],
        });
    }
    let mut samples = vec![(Vec::new(), Vec::new(), Vec::new()); set.len()];
    for _ in 0..3 {
        before_each()?;
        // Queue every copy of every GPU, then time each from its own start event.
        let mut timing: Vec<(GpuEvent, GpuEvent, GpuEvent, Option<GpuEvent>)> = Vec::new();
        for g in &set {
            let [a, b, c] = &g.streams;
            let start = a.record()?;
            b.wait_marker(&start)?;
            c.wait_marker(&start)?;
            g.out.enqueue_write(a, &g.src, 0, 0, bytes, None)?;
            g.host.enqueue_copy_out(b, &g.dst, 0, bytes, bytes)?;
            let peer = match &g.peer_dst {
                Some(d) => {
                    c.copy(d, 0, &g.src, 0, bytes)?;
                    Some(c.record()?)
                }
                None => None,
            };
            timing.push((start, a.record()?, b.record()?, peer));
        }
        for (k, (start, d2h, h2d, peer)) in timing.iter().enumerate() {
            let gbps = |e: &GpuEvent| -> anyhow::Result<f64> {
                Ok(bytes as f64 / (f64::from(start.elapsed_ms(e)?) / 1e3) / 1e9)
            };
            samples[k].0.push(gbps(d2h)?);
            samples[k].1.push(gbps(h2d)?);
            if let Some(p) = peer {
                samples[k].2.push(gbps(p)?);
            }
        }
    }
    Ok(samples
        .into_iter()
        .map(|(d, h, p)| Ceilings {
            peer: (!p.is_empty()).then(|| median(p)),
            d2h: median(d),
            h2d: median(h),
        })
        .collect())
}

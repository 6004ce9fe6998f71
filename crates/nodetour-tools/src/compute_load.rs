//! A compute load beside a measurement (`nodetour perf --gpu --beside-compute`): a thread keeps
//! a stream of its own on the rank's GPU busy with compute-bound kernels
//! (`nodetour_core::cuda::busy`: 4 blocks per SM, FMAs in registers, each kernel about
//! `kernel_us` long, a few queued at a time), the way a training step's GEMMs occupy the SMs
//! while gradients are reduced. It counts the kernels that finish, so a sweep can say both how
//! fast a collective runs beside compute and how much compute it took away: kernels per second
//! alone (measured at the start, before anything else runs) against beside each collective.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cudarc::driver::CudaContext;
use nodetour_core::cuda::GpuStream;
use nodetour_core::cuda::reduce::ReduceKernels;
use nodetour_core::memory::DeviceBuffer;

/// Kernels queued at a time (enough that the GPU never waits for the thread).
const DEPTH: usize = 3;

/// A running compute load.
pub struct ComputeLoad {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    thread: Option<JoinHandle<anyhow::Result<()>>>,
    /// Kernels finished per second with nothing else on the GPU (this process's view).
    pub alone_per_s: f64,
    /// Blocks per kernel.
    pub blocks: u32,
    /// One kernel's length alone, µs (calibrated).
    pub kernel_us: f64,
}

/// Where a measurement started: kernels finished and the time.
#[derive(Clone, Copy, Debug)]
pub struct Mark(u64, Instant);

impl ComputeLoad {
    /// Calibrates the kernel to about `kernel_us`, starts the thread and measures the rate
    /// alone over `settle`.
    pub fn start(
        context: &Arc<CudaContext>,
        kernel_us: f64,
        settle: Duration,
    ) -> anyhow::Result<ComputeLoad> {
        let kernels = ReduceKernels::load(context).context("loading the GPU kernels")?;
        let stream = GpuStream::new(context)?;
        let sink = DeviceBuffer::new(context, 4096)?;
        let blocks = kernels.sms() * 4;
        let mut iters = 4096u32;
        let mut us = 0.0;
        for _ in 0..3 {
            let start = stream.record()?;
            kernels.busy(&stream, &sink, iters, blocks)?;
            let end = stream.record()?;
            stream.synchronize()?;
            us = f64::from(start.elapsed_ms(&end)?) * 1e3;
            iters = (f64::from(iters) * kernel_us / us.max(1.0)).clamp(64.0, 1e9) as u32;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let done = Arc::new(AtomicU64::new(0));
        let (s, d) = (stop.clone(), done.clone());
        let thread = std::thread::spawn(move || -> anyhow::Result<()> {
            let mut queued = VecDeque::with_capacity(DEPTH);
            while !s.load(Ordering::Acquire) {
                while queued.len() < DEPTH {
                    kernels.busy(&stream, &sink, iters, blocks)?;
                    queued.push_back(stream.record()?);
                }
                if queued.front().map_or(Ok(false), |e| e.is_complete())? {
                    queued.pop_front();
                    d.fetch_add(1, Ordering::AcqRel);
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            stream.synchronize()?;
            Ok(())
        });
        let mut load = ComputeLoad {
            stop,
            done,
            thread: Some(thread),
            alone_per_s: 0.0,
            blocks,
            kernel_us: us,
        };
        let m = load.mark();
        std::thread::sleep(settle);
        load.alone_per_s = load.rate_since(m);
        Ok(load)
    }

    /// Now, for [`Self::rate_since`].
    pub fn mark(&self) -> Mark {
        Mark(self.done.load(Ordering::Acquire), Instant::now())
    }

    /// Kernels finished, and seconds, since `m`.
    pub fn since(&self, m: Mark) -> (u64, f64) {
        (
            self.done.load(Ordering::Acquire) - m.0,
            m.1.elapsed().as_secs_f64(),
        )
    }

    /// Kernels finished per second since `m`.
    pub fn rate_since(&self, m: Mark) -> f64 {
        let (n, t) = self.since(m);
        n as f64 / t.max(1e-9)
    }

    /// Stops the thread (its stream drains: at most `DEPTH` kernels).
    pub fn stop(mut self) -> anyhow::Result<()> {
        self.stop.store(true, Ordering::Release);
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(r)) => r,
            Some(Err(_)) => anyhow::bail!("the compute load's thread panicked"),
            None => Ok(()),
        }
    }
}

impl Drop for ComputeLoad {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

//! The engine of one formed job: its rank and world, its host ring and GPU ring (the state
//! behind one lock), its call order, and the machinery every collective shares (the lock, the
//! failure that breaks it, the numbering of calls). A [`super::Communicator`] is a thin face
//! over one engine, and holds a second, the device side formed from a stream
//! (`device_from_stream.rs`), beside it: never a communicator inside another.

use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Duration;

use nodetour_core::cuda::GpuStream;

use super::host_job::{AbortFlag, HostJob};
use super::{AbortHandle, Paths, call_order, gpu_error, scratch, symmetric};
use crate::descriptor::{Algorithm, Collective, Descriptor};
use crate::error::{Error, Result};
use crate::reduce::{DataType, ReduceOp};

/// One formed job's collectives. See the [module docs](self).
pub(super) struct Engine {
    pub(super) rank: u32,
    pub(super) world: u32,
    /// This rank's local rank and its host's ranks.
    pub(super) local: (u32, u32),
    pub(super) paths: Paths,
    pub(super) aborted: AbortFlag,
    pub(super) gpu_abort: Option<crate::gpu_ring::AbortHandle>,
    pub(super) state: Mutex<State>,
    /// The whole input of a device reduce-scatter on the GPU ring (reduced in place there).
    pub(super) scratch: Mutex<scratch::Scratch>,
    /// The options' timeout (what a dropped `InFlight` waits at most).
    pub(super) timeout: Duration,
    /// Counts the collectives run so far, host and device alike (shared with the device
    /// side): each carries its number in its descriptor (`Descriptor::call`).
    pub(super) calls: Arc<AtomicU32>,
    /// The stream its device collectives run on in call order (see `call_order`), made on the
    /// GPU of its first device collective.
    pub(super) order: OnceLock<call_order::CallOrder>,
    /// Whether it is a member's of a GPU set (`from_devices`: no host ring, no host
    /// collectives).
    pub(super) in_set: bool,
    /// The abort handle of the device side formed from a stream, once formed: broken with
    /// this engine.
    pub(super) device_abort: Arc<OnceLock<AbortHandle>>,
    /// What `paths()` shows of the point-to-point links (a job's; none in a set).
    pub(super) peer_paths: Option<Arc<Mutex<Vec<super::PeerLinkPath>>>>,
}

pub(super) struct State {
    /// `None` once closed.
    pub(super) job: Option<HostJob>,
    /// The first failure after ranks started talking: the engine is broken.
    pub(super) failed: Option<Error>,
}

impl Engine {
    /// The engine of a formed `job`, with the options' `timeout`.
    pub(super) fn of_job(job: HostJob, timeout: Duration) -> Engine {
        Engine {
            peer_paths: Some(job.peer_paths()),
            rank: job.rank,
            world: job.world,
            local: job.local,
            paths: job.paths.clone(),
            gpu_abort: job.gpu_ring.as_ref().map(|r| r.abort_handle()),
            aborted: Arc::new(Mutex::new(None)),
            state: Mutex::new(State {
                job: Some(job),
                failed: None,
            }),
            scratch: Mutex::default(),
            timeout,
            calls: Arc::default(),
            order: OnceLock::default(),
            in_set: false,
            device_abort: Arc::default(),
        }
    }

    /// The engine of seat `seat` of a GPU set of `world` (its collectives run on the set).
    pub(super) fn of_set(seat: u32, world: u32, paths: Paths, timeout: Duration) -> Engine {
        Engine {
            rank: seat,
            world,
            local: (seat, world),
            paths,
            gpu_abort: None,
            aborted: Arc::new(Mutex::new(None)),
            state: Mutex::new(State {
                job: None,
                failed: None,
            }),
            scratch: Mutex::default(),
            timeout,
            calls: Arc::default(),
            order: OnceLock::default(),
            in_set: true,
            device_abort: Arc::default(),
            peer_paths: None,
        }
    }

    /// A handle that aborts this engine's collectives (and its device side's).
    pub(super) fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            flag: self.aborted.clone(),
            gpu: self.gpu_abort.clone(),
            set: None,
            device: self.device_abort.clone(),
        }
    }

    /// The failure that broke this engine, if one did: also one its GPU ring met after a
    /// device collective's call had returned.
    pub(super) fn error(&self) -> Option<Error> {
        let failed = self.lock().ok().and_then(|s| s.failed.clone());
        failed.or_else(|| self.gpu_abort.as_ref().and_then(|a| a.error()))
    }

    pub(super) fn lock(&self) -> Result<MutexGuard<'_, State>> {
        if symmetric::inside_closure() {
            return Err(Error::InvalidArgument {
                reason: "a communicator call inside SymmetricBuffer::with_device_buffer's \
                         closure (the communicator is held there: queue your work in the \
                         closure, return, then call)"
                    .into(),
            });
        }
        self.state.lock().map_err(|_| Error::Aborted {
            reason: "a thread panicked inside a collective of this communicator".into(),
        })
    }

    /// Records `e` as the communicator's failure (the first one is kept): it is broken. Its
    /// device side breaks with it (the GPU ring formed with it under `Options::with_gpu`, or
    /// the one formed from a stream: aborted, which its neighbours see), so device collectives
    /// queued there end now with the reason, on every rank, rather than waiting for peers that
    /// will never join them.
    pub(super) fn record_failure(&self, state: &mut State, e: &Error) {
        if state.failed.is_some() {
            return;
        }
        state.failed = Some(e.clone());
        let reason = format!("the communicator is broken: {e}");
        if let Some(ring) = &self.gpu_abort {
            ring.abort(&reason);
        }
        if let Some(device) = self.device_abort.get() {
            device.abort(&reason);
        }
    }

    /// The state, if the communicator can run a collective.
    pub(super) fn usable(&self) -> Result<MutexGuard<'_, State>> {
        if self.in_set {
            return Err(Error::Unsupported {
                reason: "host-memory collectives run on communicators of processes (from_env, \
                         from_unique_id); the communicators of from_devices run device \
                         collectives"
                    .into(),
            });
        }
        let state = self.lock()?;
        if let Some(first) = &state.failed {
            return Err(Error::Broken {
                first: Box::new(first.clone()),
            });
        }
        if state.job.is_none() {
            return Err(Error::InvalidArgument {
                reason: "the communicator is closed".into(),
            });
        }
        Ok(state)
    }

    pub(super) fn position(&self) -> u32 {
        self.position_of(self.rank)
    }

    /// An error of the GPU ring (ranks as ring positions) with job ranks.
    pub(super) fn job_ranks(&self, e: Error) -> Error {
        let order = &self.paths.order;
        e.map_ranks(&|p| order.get(p as usize).copied().unwrap_or(p))
    }

    /// The ring position of job rank `rank`.
    pub(super) fn position_of(&self, rank: u32) -> u32 {
        self.paths
            .order
            .iter()
            .position(|r| *r == rank)
            .unwrap_or(0) as u32
    }

    pub(super) fn descriptor(
        &self,
        collective: Collective,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        root: Option<u32>,
    ) -> Descriptor {
        Descriptor {
            collective,
            count: count as u64,
            dtype,
            op,
            root,
            algorithm: Algorithm::HostRing,
            seq: 0,
            call: 0,
        }
    }

    /// Runs device collective `f` on this communicator's stream in call order after the work
    /// queued on `caller`, then joins `caller` after it (see `call_order`). A stream being
    /// captured into a CUDA graph takes the collective itself (the graph's replays are
    /// ordered where the caller launches them).
    pub(super) fn in_call_order<R>(
        &self,
        caller: &GpuStream,
        f: impl FnOnce(&GpuStream) -> Result<R>,
    ) -> Result<R> {
        if caller.is_capturing().map_err(gpu_error)? {
            return f(caller);
        }
        let order = match self.order.get() {
            Some(o) => o,
            None => {
                let made = call_order::CallOrder::new(caller.context())?;
                let _ = self.order.set(made);
                self.order.get().expect("just set")
            }
        };
        order.run(caller, f)
    }

    /// A marker on this communicator's stream (see `call_order`), if a device collective ran:
    /// once it completes, every device collective called so far has run.
    pub(super) fn call_order_mark(&self) -> Result<Option<nodetour_core::cuda::GpuEvent>> {
        self.order
            .get()
            .map(call_order::CallOrder::mark)
            .transpose()
    }

    /// The next collective's number (`Descriptor::call`); taken under the state lock, once
    /// per collective, by the path that runs it.
    pub(super) fn next_call(&self) -> u32 {
        self.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }
}

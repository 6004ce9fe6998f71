//! The communicator: the one object a training runtime holds.
//!
//! In the order a runtime works:
//!
//! 1. **Form** it once per process: [`Communicator::from_env`] reads the launcher's variables
//!    (torchrun, Slurm, Open MPI, `NODETOUR_*`); [`Communicator::from_unique_id`] serves
//!    runtimes with their own store. Every rank calls the same constructor; it returns once
//!    every link is connected, or fails within the options' timeout naming what is missing.
//! 2. **Read its paths**: [`Communicator::paths`] says, per link, the transport, where the bytes
//!    land and why that path was chosen (also logged at formation).
//! 3. **Run collectives**: [`Communicator::all_reduce`], [`Communicator::reduce_scatter`],
//!    [`Communicator::all_gather`], [`Communicator::broadcast`], out of place or `*_in_place`,
//!    on any size of buffer (it goes through the communicator's bounded staging memory in
//!    pieces). On host memory the call is synchronous: it returns `Ok` only with the answer in
//!    the output, the same bits on every rank. On device memory ([`Options::gpu`]; cudarc
//!    slices on the caller's stream): [`Communicator::all_reduce_device`] (and `_in_place`),
//!    [`Communicator::reduce_scatter_device`], [`Communicator::all_gather_device`] and
//!    [`Communicator::broadcast_device_in_place`] queue on the stream and return where the
//!    ranks share one host (a GPU ring), and are staged through host memory, synchronous on
//!    the stream, across hosts. [`Communicator::paths`] says which ([`DevicePath`]).
//! 4. **Handle errors**: every failure is a typed [`Error`] naming the rank at fault where one
//!    is ([`Error::PeerLost`], [`Error::Disagreement`], [`Error::Timeout`], ...). After a
//!    failure that happened while ranks were talking, the communicator is broken: later calls
//!    return [`Error::Broken`] with the first failure, on every rank that saw it. What the
//!    output holds then: on host memory, the pieces that finished (the rest as it was); on a
//!    GPU ring, undefined (a collective ended by a failure writes partial results; every rank
//!    whose collective had not finished fails it, never `Ok`). A device collective's failure
//!    after its call returned comes from [`Communicator::wait`], [`Communicator::error`] or the
//!    next call.
//! 5. **Abort** from another thread with an [`AbortHandle`]; **close** with
//!    [`Communicator::close`], which waits (to a deadline) until every rank is done.
//!
//! ```no_run
//! use nodetour_ring::comm::{Communicator, Options};
//! use nodetour_ring::ReduceOp;
//! # fn main() -> nodetour_ring::Result<()> {
//! let comm = Communicator::from_env(Options::from_env()?)?;
//! println!("{}", comm.paths());
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg)?;
//! comm.close(nodetour_core::Deadline::after(std::time::Duration::from_secs(30)))?;
//! # Ok(()) }
//! ```
//!
//! **Thread safety**: `Communicator` is `Send + Sync`. Collectives take `&self` and run one at
//! a time, in the order their calls take the communicator's lock; every rank must issue the
//! same collectives in the same order (a rank that does not gets [`Error::Disagreement`]
//! rather than a wrong answer), so a runtime that calls from several threads orders them
//! itself. [`AbortHandle`] is `Send + Sync + Clone`.
//!
//! **Several GPUs of one process**: [`Communicator::from_devices`] makes one communicator per
//! GPU (as `ncclCommInitAll`); drive them with one thread per GPU, or from one thread through
//! a [`Group`] (as `ncclGroupStart`/`ncclGroupEnd`). Each GPU reads its neighbour's memory
//! directly; the calls queue on the callers' streams and return.
//!
//! **Not built yet**: sub-communicators (`split`), point-to-point (`send`/`recv`), all-to-all;
//! host and device collectives interleaved on one
//! communicator run on separate rings, so every rank must interleave them the same way (a rank
//! that does not times out rather than disagreeing).

mod device_buffers;
mod device_set;
mod gpu_links;
mod host_job;
mod in_flight;
pub(crate) mod links;
pub(crate) mod net_direct;
mod net_links;
pub(crate) mod one_kernel_links;
mod options;
mod paths;
mod scratch;
mod symmetric;
pub(crate) mod table;

pub use crate::gpu::{KERNEL_COPY_MAX, ONE_STEP_MAX};
pub use device_set::Group;
pub use gpu_links::{GpuPaths, GpuRingOptions, NetLanding, ONE_KERNEL_MAX, OneKernelMode};
pub use in_flight::{Failed, InFlight};
pub use nodetour_net::bootstrap::UniqueId;
pub use options::{
    DEFAULT_HOST_GATHER_MAX, DEFAULT_PIECE_BYTES, DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, MUST_AGREE,
    Options,
};
pub use paths::{DevicePath, Direction, Landing, LinkPath, Paths};
pub use symmetric::SymmetricBuffer;

use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::{DeviceBuffer, with_cudarc_slice, with_cudarc_slice_mut};
use nodetour_net::bootstrap::LaunchInfo;

use self::device_set::{DeviceSet, SetMember};
use self::host_job::{AbortFlag, HostJob, Launch};
use crate::descriptor::{Algorithm, Collective, Descriptor};
use crate::element::{Element, bytes, bytes_mut};
use crate::error::{Error, Result};
use crate::host::{HostRing, Staged};
use crate::plan::Shape;
use crate::reduce::{DataType, ReduceOp};

/// A group of ranks that run collectives together. See the [module docs](self).
///
/// ```
/// fn shared<T: Send + Sync>() {}
/// shared::<nodetour_ring::comm::Communicator>();
/// shared::<nodetour_ring::comm::AbortHandle>();
/// ```
pub struct Communicator {
    rank: u32,
    world: u32,
    paths: Paths,
    aborted: AbortFlag,
    gpu_abort: Option<crate::gpu_ring::AbortHandle>,
    state: Mutex<State>,
    /// A communicator of [`Communicator::from_devices`]: its GPU in the shared set.
    member: Option<SetMember>,
    /// The whole input of a device reduce-scatter on the GPU ring (reduced in place there).
    scratch: Mutex<scratch::Scratch>,
    /// The options' timeout (what a dropped [`InFlight`] waits at most).
    timeout: std::time::Duration,
}

struct State {
    /// `None` once closed.
    job: Option<HostJob>,
    /// The first failure after ranks started talking: the communicator is broken.
    failed: Option<Error>,
}

/// Aborts a communicator's collective in flight, and every later one, from any thread: they
/// return [`Error::Aborted`] with the reason, and the neighbours' collectives end with it too.
#[derive(Clone)]
pub struct AbortHandle {
    flag: AbortFlag,
    gpu: Option<crate::gpu_ring::AbortHandle>,
    set: Option<Arc<DeviceSet>>,
}

impl AbortHandle {
    /// Aborts with `reason` (the first reason given is kept): the host ring's collective in
    /// flight ends at its next poll, the GPU ring's streams stop waiting at once (its
    /// neighbours are told).
    pub fn abort(&self, reason: &str) {
        if let Ok(mut r) = self.flag.lock() {
            r.get_or_insert_with(|| reason.to_owned());
        }
        if let Some(g) = &self.gpu {
            g.abort(reason);
        }
        if let Some(s) = &self.set {
            s.abort(reason);
        }
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

/// One piece's layout: where each rank's share goes in the staging region.
#[derive(Clone, Copy)]
struct Layout {
    /// Element size.
    es: usize,
    /// Elements of each block in this piece.
    len: usize,
}

impl Layout {
    fn at(&self, position: u32) -> usize {
        position as usize * self.len * self.es
    }
}

fn gpu_error(e: nodetour_core::Error) -> Error {
    Error::Gpu {
        reason: e.to_string(),
    }
}

fn poisoned() -> Error {
    Error::Aborted {
        reason: "a thread panicked inside a collective of this communicator".into(),
    }
}

fn same_len(a: usize, b: usize, an: &str, bn: &str) -> Result<()> {
    if a != b {
        return Err(Error::InvalidArgument {
            reason: format!("{an} has {a} elements, {bn} {b}: they must match"),
        });
    }
    Ok(())
}

/// Waits (polling, to `deadline`) until `stream` has run everything queued on it so far.
fn stream_done(stream: &GpuStream, deadline: Deadline) -> Result<()> {
    let started = std::time::Instant::now();
    let done = nodetour_core::cuda::GpuEvent::marker(stream.context()).map_err(gpu_error)?;
    stream.record_marker(&done).map_err(gpu_error)?;
    while !done.is_complete().map_err(gpu_error)? {
        if deadline.expired() {
            return Err(Error::Timeout {
                waiting_for: "the caller's stream".into(),
                rank: None,
                after: started.elapsed(),
            });
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
    Ok(())
}

/// Ends a job's GPU ring with the teardown handshake: this rank's streams drained and its
/// mappings of its neighbours' memory closed, then a barrier (or the liveness mesh reporting a
/// rank gone, which counts as closed) says every rank has done the same, and only then is the
/// memory this rank exported freed; past `deadline` it is leaked, never freed under a
/// neighbour's mapping. Without a GPU ring, the barrier alone (every rank is done with every
/// collective before links close) when `orderly`.
fn teardown(job: &mut HostJob, deadline: Deadline, orderly: bool) -> Result<()> {
    let Some(ring) = job.gpu_ring.as_mut() else {
        if orderly && job.world > 1 {
            return job.job.barrier(deadline).map_err(Error::from);
        }
        return Ok(());
    };
    let result = gpu_links::teardown(&mut [ring], &job.job, deadline);
    job.gpu_ring = None;
    result
}

impl Drop for Communicator {
    /// Leaves at once: a collective still queued on a GPU stream is aborted (its neighbours are
    /// told), and the GPU ring's exported memory waits for the teardown handshake (to
    /// 10 s, then leaked). Ranks still in a collective with
    /// this one fail naming it. [`Communicator::close`] is the orderly way.
    fn drop(&mut self) {
        let job = self.state.get_mut().ok().and_then(|s| s.job.take());
        if let Some(mut job) = job {
            let deadline = Deadline::after(crate::gpu_ring::TEARDOWN_DEADLINE);
            if let Err(e) = teardown(&mut job, deadline, false) {
                tracing::warn!(error = %e, "dropping the communicator");
            }
        }
    }
}

/// Element ranges of at most `per` elements covering `0..count` (none for an empty buffer).
fn pieces(count: usize, per: usize) -> impl Iterator<Item = Range<usize>> {
    let per = per.max(1);
    (0..count.div_ceil(per)).map(move |i| i * per..((i + 1) * per).min(count))
}

/// The liveness check a ring collective polls (the bootstrap's, and the abort flag).
type Alive<'a> = dyn Fn() -> nodetour_core::Result<()> + 'a;

/// Runs an all-gather piece staged by the caller and scatters the result: block `q` of the
/// ring's buffer (position `q`) goes to rank `order[q]`'s block of `out`, elements `r`.
#[allow(clippy::too_many_arguments)]
fn gather_out<T: Element>(
    comm: &Communicator,
    ring: &mut HostRing<'_>,
    what: &Descriptor,
    l: Layout,
    out: &mut [T],
    n: usize,
    r: Range<usize>,
    alive: &Alive<'_>,
) -> Result<()> {
    let staged = Staged {
        shape: Shape::AllGather,
        count: (r.len() * comm.world as usize) as u64,
        dtype: T::DATA_TYPE,
        op: ReduceOp::Sum,
    };
    let mut outputs: Vec<(usize, &mut [u8])> = out
        .chunks_mut(n)
        .enumerate()
        .map(|(rank, block)| {
            (
                l.at(comm.position_of(rank as u32)),
                bytes_mut(&mut block[r.clone()]),
            )
        })
        .collect();
    ring.collective(staged, what, &mut outputs, alive)
}

impl Communicator {
    /// Forms the communicator of this process's job from the launcher's environment: rank,
    /// world size and rank 0's address from `NODETOUR_RANK`/`NODETOUR_WORLD_SIZE`/
    /// `NODETOUR_MASTER_ADDR`, torchrun, Open MPI or Slurm; the job token from
    /// `NODETOUR_JOB_TOKEN`. Without a token the job is unauthenticated, keyed by the
    /// launcher's job id (Slurm, Open MPI, torchrun's run id, `NODETOUR_JOB_ID`): a warning,
    /// and [`Self::paths`] says so; with neither, forming fails with an error that says how
    /// to set a token.
    pub fn from_env(options: Options) -> Result<Communicator> {
        let info = LaunchInfo::from_env()?;
        Self::form(
            Launch {
                rank: info.rank,
                world: info.world_size,
                rendezvous: info.rendezvous_addr(),
                token: nodetour_net::bootstrap::job_token(&info)?,
            },
            options,
        )
    }

    /// Forms the communicator of rank `rank` of `world` from an id that rank 0's process made
    /// with [`UniqueId::create`] (which binds rank 0's listener at once) and passed to every
    /// rank through the runtime's own store ([`UniqueId::encode`] / [`UniqueId::decode`]). The
    /// id carries the job token: publish it only where no one outside the job can read it.
    pub fn from_unique_id(
        id: &UniqueId,
        rank: u32,
        world: u32,
        options: Options,
    ) -> Result<Communicator> {
        Self::form(
            Launch {
                rank,
                world,
                rendezvous: id.address.clone(),
                token: id.job_token(),
            },
            options,
        )
    }

    fn form(launch: Launch, options: Options) -> Result<Communicator> {
        if launch.world == 0 || launch.rank >= launch.world {
            return Err(Error::InvalidArgument {
                reason: format!("rank {} of {}", launch.rank, launch.world),
            });
        }
        let pin = match options.gpu {
            Some(ordinal) => Some(
                {
                    // CUDA is loaded at run time: its absence is a typed error, not a crash.
                    nodetour_core::cuda::availability()?;
                    cudarc::driver::CudaContext::new(ordinal)
                }
                .map_err(|e| Error::Gpu {
                    reason: format!("GPU {ordinal}: {e:?}"),
                })?,
            ),
            None => None,
        };
        let job = HostJob::form(launch, &options, pin.as_ref())?;
        Ok(Communicator {
            rank: job.rank,
            world: job.world,
            paths: job.paths.clone(),
            gpu_abort: job.gpu_ring.as_ref().map(|r| r.abort_handle()),
            aborted: Arc::new(Mutex::new(None)),
            state: Mutex::new(State {
                job: Some(job),
                failed: None,
            }),
            member: None,
            scratch: Mutex::default(),
            timeout: options.config.timeout,
        })
    }

    /// Forms one communicator per entry of `contexts` (GPUs of this process, in ring order; a
    /// GPU may appear more than once), as NCCL's `ncclCommInitAll`: communicator `i` is rank
    /// `i` and runs device collectives on `contexts[i]`'s memory. Each GPU reads its ring
    /// neighbour's memory directly (peer access between neighbours on distinct GPUs is enabled
    /// here; a pair without it is [`Error::Unsupported`]); nothing is staged through the host
    /// and no slot memory is held.
    ///
    /// Drive them with one thread per GPU (each calls its communicator's `*_device`
    /// collective; every call returns once the collective is queued on every GPU's stream) or
    /// from one thread through a [`Group`] (as `ncclGroupStart`/`ncclGroupEnd`). Host-memory
    /// collectives are for communicators of processes; here they are
    /// [`Error::Unsupported`]. `options.config.timeout` bounds how long a call waits for the
    /// other GPUs' calls.
    pub fn from_devices(
        contexts: &[Arc<CudaContext>],
        options: Options,
    ) -> Result<Vec<Communicator>> {
        let set = DeviceSet::new(contexts, &options)?;
        let n = contexts.len() as u32;
        let reason = set.path();
        Ok((0..n)
            .map(|seat| Communicator {
                rank: seat,
                world: n,
                paths: Paths {
                    rank: seat,
                    world: n,
                    order: (0..n).collect(),
                    links: Vec::new(),
                    security: "one process: no network".into(),
                    device: DevicePath::InProcess {
                        reason: reason.clone(),
                    },
                },
                aborted: Arc::new(Mutex::new(None)),
                gpu_abort: None,
                state: Mutex::new(State {
                    job: None,
                    failed: None,
                }),
                member: Some(SetMember::new(
                    set.clone(),
                    seat as usize,
                    options.config.timeout,
                )),
                scratch: Mutex::default(),
                timeout: options.config.timeout,
            })
            .collect())
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// How data travels: per link, the transport, where the bytes land, and why.
    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    /// A handle that aborts this communicator's collectives from any thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            flag: self.aborted.clone(),
            gpu: self.gpu_abort.clone(),
            set: self.member.as_ref().map(|m| m.set.clone()),
        }
    }

    /// The failure that broke this communicator, if one did (as `ncclCommGetAsyncError`):
    /// also one that the GPU ring met after a device collective's call had returned.
    pub fn error(&self) -> Option<Error> {
        if let Some(m) = &self.member {
            return m.set.error();
        }
        let failed = self.lock().ok().and_then(|s| s.failed.clone());
        failed.or_else(|| self.gpu_abort.as_ref().and_then(|a| a.error()))
    }

    /// Waits until every collective issued so far has finished on this rank (device
    /// collectives run on their streams after the calls returned), to `deadline`, and returns
    /// the first failure if there was one; a failure breaks the communicator. Host collectives
    /// finish before they return. Replays of CUDA graphs are not calls: after launching one,
    /// use [`Self::wait_stream`].
    pub fn wait(&self, deadline: Deadline) -> Result<()> {
        self.wait_on(None, deadline)
    }

    /// [`Self::wait`], and first until `stream` has run everything queued on it so far: the
    /// replays of CUDA graphs that captured this communicator's collectives included, which
    /// the communicator does not see launched. Their outcome is what the GPU recorded (a wait
    /// inside the graph that timed out, a one-kernel collective that failed) and every
    /// neighbour's failure, which fails every replay not yet confirmed by a wait. Waiting on
    /// the stream in any other way (`cuStreamSynchronize`, an event) runs the replays but
    /// reports nothing: their results are trustworthy only after this returns `Ok`.
    pub fn wait_stream(&self, stream: &GpuStream, deadline: Deadline) -> Result<()> {
        self.wait_on(Some(stream), deadline)
    }

    /// [`Self::wait`], after `stream` where one is given ([`Self::wait_stream`]).
    fn wait_on(&self, stream: Option<&GpuStream>, deadline: Deadline) -> Result<()> {
        // Without a GPU ring of processes the stream is waited for here (a GPU ring waits for
        // it while it watches its neighbours).
        let ringless = |deadline: Deadline| stream.map_or(Ok(()), |s| stream_done(s, deadline));
        if let Some(m) = &self.member {
            ringless(deadline)?;
            return m.set.wait(deadline.remaining());
        }
        let mut state = self.lock()?;
        if let Some(first) = &state.failed {
            return Err(Error::Broken {
                first: Box::new(first.clone()),
            });
        }
        let State { job, failed } = &mut *state;
        let Some(job) = job.as_mut().filter(|j| j.gpu_ring.is_some()) else {
            drop(state);
            return ringless(deadline);
        };
        let bootstrap = &job.job;
        let ring = job.gpu_ring.as_mut().expect("checked above");
        // The GPU ring names ranks by ring position; its errors name job ranks.
        let alive = || {
            bootstrap.check_present().map_err(|e| match e {
                nodetour_core::Error::RankLost { rank, reason } => nodetour_core::Error::RankLost {
                    rank: self.position_of(rank),
                    reason,
                },
                e => e,
            })
        };
        let result = match stream {
            Some(s) => ring.wait_stream(s, deadline.remaining(), &alive),
            None => ring.wait_alive(deadline.remaining(), &alive),
        }
        .map_err(|e| self.job_ranks(e));
        if let Err(e) = &result {
            failed.get_or_insert_with(|| e.clone());
        }
        result
    }

    /// Closes the communicator: finishes the device collectives in flight (to `deadline`),
    /// waits until every rank has finished its collectives (a barrier over the bootstrap), then
    /// tears down links and memory; memory a neighbour maps (the GPU ring's slots) is freed only
    /// after every neighbour said it unmapped it, and leaked past the deadline rather than
    /// freed under a mapping. A broken communicator tears down at once and returns its failure.
    pub fn close(self, deadline: Deadline) -> Result<()> {
        let finished = self.wait(deadline);
        let mut state = self.lock()?;
        let job = state.job.take();
        let failed = state.failed.clone();
        drop(state);
        let Some(mut job) = job else {
            return finished;
        };
        let teardown = teardown(&mut job, deadline, failed.is_none());
        // Then the links, the regions, the device and the bootstrap (its drop stops the
        // liveness watcher, with a deadline), in the job's field order.
        drop(job);
        match failed {
            Some(first) => Err(Error::Broken {
                first: Box::new(first),
            }),
            None => finished.and(teardown),
        }
    }

    /// Sums (or another `op`) `send` over every rank into `recv` on every rank. `send` and
    /// `recv` have the same length on this rank and on every other.
    pub fn all_reduce<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        same_len(send.len(), recv.len(), "send", "recv")?;
        self.all_reduce_bytes(Some(bytes(send)), bytes_mut(recv), T::DATA_TYPE, op)
    }

    /// [`Self::all_reduce`] with `data` as both input and output.
    pub fn all_reduce_in_place<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_bytes(None, bytes_mut(data), T::DATA_TYPE, op)
    }

    /// [`Self::all_reduce_in_place`] for runtimes that carry the element type at run time:
    /// `data` holds whole elements of `dtype` (native byte order).
    pub fn all_reduce_in_place_bytes(
        &self,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        if data.len() % dtype.size() != 0 {
            return Err(Error::InvalidArgument {
                reason: format!("{} bytes are not whole {dtype:?} elements", data.len()),
            });
        }
        self.all_reduce_bytes(None, data, dtype, op)
    }

    /// The allreduce of `send` (or, without it, of `out` itself) into `out`.
    fn all_reduce_bytes(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let es = dtype.size();
        let n = out.len() / es;
        let gather_max = {
            let state = self.usable()?;
            state.job.as_ref().map_or(0, HostJob::host_gather_max)
        };
        if self.world > 1 && n > 0 && out.len() <= gather_max {
            return self.all_reduce_gathered(send, out, dtype, op);
        }
        let what = Descriptor {
            dtype,
            ..self.descriptor::<u8>(Collective::AllReduce, n, op, None)
        };
        self.run_pieces(&what, n, 1, |ring, r, d, alive| {
            let b = r.start * es..r.end * es;
            let staged = Staged {
                shape: Shape::AllReduce,
                count: r.len() as u64,
                dtype,
                op,
            };
            // Reductions read the input where it is; the output is written once it finished.
            ring.all_reduce_from(staged, d, &send.unwrap_or(&*out)[b.clone()], alive)?;
            ring.read_out(staged, &mut [(0, &mut out[b])])
        })
    }

    /// A small allreduce: every rank's whole input goes to every rank (an all-gather around the
    /// ring: `world − 1` hops of the buffer, where the ring takes `2 (world − 1)` hops of a
    /// block), and each rank reduces the `world` inputs itself, in ring order from position 0:
    /// the same operations in the same order on every rank, so every rank's result is bitwise
    /// the same. The algorithm is in the descriptor the ranks agree on.
    fn all_reduce_gathered(
        &self,
        send: Option<&[u8]>,
        out: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let es = dtype.size();
        let n = out.len() / es;
        let world = self.world as usize;
        let what = Descriptor {
            dtype,
            algorithm: Algorithm::HostGather,
            ..self.descriptor::<u8>(Collective::AllReduce, n, op, None)
        };
        self.run_pieces(&what, n, self.world, |ring, r, d, alive| {
            let b = r.start * es..r.end * es;
            let len = b.len();
            // Segment p of the gathered buffer is position p's input.
            ring.stage_in(ring.rank as usize * len, &send.unwrap_or(&*out)[b.clone()])?;
            let staged = Staged {
                shape: Shape::AllGather,
                count: (r.len() * world) as u64,
                dtype,
                op,
            };
            let mut all = vec![0u8; len * world];
            ring.collective(staged, d, &mut [(0, &mut all[..])], alive)?;
            let result = &mut out[b];
            result.copy_from_slice(&all[..len]);
            for input in all[len..].chunks_exact(len) {
                crate::reduce::reduce_into(dtype, op, result, input)?;
            }
            if op == ReduceOp::Avg {
                crate::reduce::finish_avg(dtype, result, self.world);
            }
            Ok(())
        })
    }

    /// Reduces `send` (`world` blocks of `recv.len()` elements) over every rank, leaving
    /// block `rank` of the result in `recv`.
    pub fn reduce_scatter<T: Element>(
        &self,
        send: &[T],
        recv: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.blocks(send.len(), recv.len(), "send", "recv")?;
        self.reduce_scatter_into(Some(send), recv, recv.len(), 0, op)
    }

    /// [`Self::reduce_scatter`] in one buffer of `world` blocks: block `rank` ends with this
    /// rank's result (the other blocks keep their input).
    pub fn reduce_scatter_in_place<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let n = self.block_of(data.len())?;
        let at = self.rank as usize * n;
        self.reduce_scatter_into(None, data, n, at, op)
    }

    /// The reduce-scatter of `send` (or, without it, of `out` itself: `world` blocks of `n`)
    /// into the `n` elements of `out` at `out_at`.
    fn reduce_scatter_into<T: Element>(
        &self,
        send: Option<&[T]>,
        out: &mut [T],
        n: usize,
        out_at: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let what = self.descriptor::<T>(Collective::ReduceScatter, n, op, None);
        let me = self.position();
        self.run_pieces(&what, n, self.world, |ring, r, d, alive| {
            let l = Layout {
                es: T::DATA_TYPE.size(),
                len: r.len(),
            };
            let input = send.unwrap_or(&*out);
            for rank in 0..self.world {
                let block = rank as usize * n;
                let src = &input[block + r.start..block + r.end];
                ring.stage_in(l.at(self.position_of(rank)), bytes(src))?;
            }
            let staged = Staged {
                shape: Shape::ReduceScatter,
                count: (r.len() * self.world as usize) as u64,
                dtype: T::DATA_TYPE,
                op,
            };
            let dst = &mut out[out_at + r.start..out_at + r.end];
            ring.collective(staged, d, &mut [(l.at(me), bytes_mut(dst))], alive)
        })
    }

    /// Gathers every rank's `send` into `recv` (`world` blocks of `send.len()` elements, block
    /// `r` from rank `r`) on every rank.
    pub fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        self.blocks(recv.len(), send.len(), "recv", "send")?;
        self.all_gather_into(Some(send), recv, send.len())
    }

    /// [`Self::all_gather`] in one buffer of `world` blocks, this rank's input in block `rank`.
    pub fn all_gather_in_place<T: Element>(&self, data: &mut [T]) -> Result<()> {
        let n = self.block_of(data.len())?;
        self.all_gather_into(None, data, n)
    }

    /// The all-gather of `send` (or, without it, of block `rank` of `out`; blocks of `n`) into
    /// `out`.
    fn all_gather_into<T: Element>(
        &self,
        send: Option<&[T]>,
        out: &mut [T],
        n: usize,
    ) -> Result<()> {
        let what = self.descriptor::<T>(Collective::AllGather, n, ReduceOp::Sum, None);
        let me = self.position();
        let mine = if send.is_some() {
            0
        } else {
            self.rank as usize * n
        };
        self.run_pieces(&what, n, self.world, |ring, r, d, alive| {
            let l = Layout {
                es: T::DATA_TYPE.size(),
                len: r.len(),
            };
            let input = send.unwrap_or(&*out);
            ring.stage_in(l.at(me), bytes(&input[mine + r.start..mine + r.end]))?;
            gather_out(self, ring, d, l, out, n, r, alive)
        })
    }

    /// Copies `send` of rank `root` into `recv` on every rank. `send` is read on the root only
    /// (it must have `recv`'s length there; elsewhere pass an empty slice).
    pub fn broadcast<T: Element>(&self, send: &[T], recv: &mut [T], root: u32) -> Result<()> {
        self.check_root(root)?;
        if self.rank == root {
            same_len(send.len(), recv.len(), "send", "recv")?;
        }
        self.broadcast_into(Some(send), recv, root)
    }

    /// [`Self::broadcast`] of rank `root`'s `data` into `data` on every rank.
    pub fn broadcast_in_place<T: Element>(&self, data: &mut [T], root: u32) -> Result<()> {
        self.check_root(root)?;
        self.broadcast_into(None, data, root)
    }

    /// The broadcast of the root's `send` (or, without it, of its `out`) into `out`.
    fn broadcast_into<T: Element>(
        &self,
        send: Option<&[T]>,
        out: &mut [T],
        root: u32,
    ) -> Result<()> {
        let n = out.len();
        let what = self.descriptor::<T>(Collective::Broadcast, n, ReduceOp::Sum, Some(root));
        let is_root = self.rank == root;
        self.run_pieces(&what, n, 1, |ring, r, d, alive| {
            if is_root {
                ring.stage_in(0, bytes(&send.unwrap_or(&*out)[r.clone()]))?;
            }
            let staged = Staged {
                shape: Shape::Broadcast {
                    root: self.position_of(root),
                },
                count: r.len() as u64,
                dtype: T::DATA_TYPE,
                op: ReduceOp::Sum,
            };
            // In place, the root's buffer already holds the answer.
            let mut outputs = if is_root && send.is_none() {
                vec![]
            } else {
                vec![(0, bytes_mut(&mut out[r]))]
            };
            ring.collective(staged, d, &mut outputs, alive)
        })
    }

    /// [`Self::all_reduce_device_in_place`] on the first `count` elements of nodetour's own
    /// device buffer and stream (lower level: what the tools and examples that allocate with
    /// nodetour use).
    pub fn all_reduce_device_buffer(
        &self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        if let Some(m) = &self.member {
            return m
                .all_reduce_buffer(buffer, count, dtype, op, stream)?
                .run_alone(m.timeout());
        }
        self.device_all_reduce(buffer, count, dtype, op, stream)
    }

    /// The owning non-blocking form of [`Self::all_reduce_device_buffer`]: queues the allreduce
    /// and returns a handle that owns `buffer` until [`InFlight::wait`] gives it back (the
    /// buffer cannot be read, reused or freed meanwhile). A collective that cannot be queued
    /// gives the buffer back with the error.
    #[allow(clippy::result_large_err)]
    pub fn start_all_reduce_device_buffer(
        &self,
        buffer: DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> std::result::Result<InFlight<'_>, Failed> {
        let queued = self
            .all_reduce_device_buffer(&buffer, count, dtype, op, stream)
            .and_then(|()| {
                let done =
                    nodetour_core::cuda::GpuEvent::marker(stream.context()).map_err(gpu_error)?;
                stream.record_marker(&done).map_err(gpu_error)?;
                Ok(done)
            });
        match queued {
            Ok(done) => Ok(InFlight {
                comm: self,
                buffer: Some(buffer),
                done,
            }),
            Err(error) => Err(Failed { error, buffer }),
        }
    }

    /// Allreduces `send` into `recv` on every rank: device memory of this rank's GPU
    /// ([`Options::gpu`]), as cudarc slices or views, queued on `stream` (the caller's stream of
    /// that GPU). On a GPU ring ([`DevicePath::GpuRing`]) the call queues the collective after
    /// the work already on `stream` and returns: no host wait, no device-wide synchronisation;
    /// work queued on `stream` afterwards sees the result, and a failure after the call returned
    /// is reported by [`Self::wait`], [`Self::error`] or the next call. Staged through host
    /// memory ([`DevicePath::Staged`]) it waits for `stream` before returning. cudarc's own
    /// ordering of the slices (its read and write events) is kept.
    pub fn all_reduce_device<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m
                .all_reduce_from(send, recv, op, stream)?
                .run_alone(m.timeout());
        }
        same_len(send.len(), recv.len(), "send", "recv")?;
        let (n, bytes) = (recv.len(), recv.num_bytes());
        let s = GpuStream::of_cudarc(stream);
        with_cudarc_slice_mut(recv, stream, |out| {
            with_cudarc_slice(send, stream, |inp| s.copy(out, 0, inp, 0, bytes))??;
            self.device_all_reduce(out, n, T::DATA_TYPE, op, &s)
        })?
    }

    /// [`Self::all_reduce_device`] with `data` as both input and output.
    pub fn all_reduce_device_in_place<T, R>(
        &self,
        data: &mut R,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m.all_reduce(data, op, stream)?.run_alone(m.timeout());
        }
        let n = data.len();
        let s = GpuStream::of_cudarc(stream);
        with_cudarc_slice_mut(data, stream, |buf| {
            self.device_all_reduce(buf, n, T::DATA_TYPE, op, &s)
        })?
    }

    /// [`Self::reduce_scatter`] on device memory (cudarc slices of [`Options::gpu`]'s GPU):
    /// `send` holds `world` blocks of `recv.len()` elements; `recv` gets block `rank` of the
    /// reduction; `send` is never written. On a GPU ring it is queued on `stream` like
    /// [`Self::all_reduce_device`] (`send` is copied into the communicator's scratch buffer,
    /// reduced there, and this rank's block copied out; under CUDA graph capture the scratch
    /// is the graph's own); staged, it is copied out on `stream`, reduced by the host ring and
    /// copied back: synchronous, waiting for `stream` only. On nodetour's buffers or a
    /// runtime's own memory with the type at run time:
    /// [`Self::reduce_scatter_device_buffer`].
    pub fn reduce_scatter_device<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m
                .reduce_scatter(send, recv, op, stream)?
                .run_alone(m.timeout());
        }
        self.blocks(send.len(), recv.len(), "send", "recv")?;
        let s = GpuStream::of_cudarc(stream);
        let count = recv.len();
        with_cudarc_slice_mut(recv, stream, |out| {
            with_cudarc_slice(send, stream, |inp| {
                self.reduce_scatter_device_buffer(inp, out, count, T::DATA_TYPE, op, &s)
            })?
        })?
    }

    /// [`Self::all_gather`] on device memory: `recv` holds `world` blocks of `send.len()`
    /// elements. Queued on a GPU ring, staged elsewhere (as [`Self::reduce_scatter_device`]).
    pub fn all_gather_device<T, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        if let Some(m) = &self.member {
            return m.all_gather(send, recv, stream)?.run_alone(m.timeout());
        }
        self.blocks(recv.len(), send.len(), "recv", "send")?;
        let s = GpuStream::of_cudarc(stream);
        let count = send.len();
        with_cudarc_slice_mut(recv, stream, |out| {
            with_cudarc_slice(send, stream, |inp| {
                self.all_gather_device_buffer(inp, out, count, T::DATA_TYPE, &s)
            })?
        })?
    }

    /// [`Self::broadcast`] on device memory: rank `root`'s `data` into `data` everywhere.
    /// Queued on a GPU ring, staged elsewhere (as [`Self::reduce_scatter_device`]).
    pub fn broadcast_device_in_place<T, R>(
        &self,
        data: &mut R,
        root: u32,
        stream: &Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element + DeviceRepr,
        R: DevicePtr<T> + DevicePtrMut<T>,
    {
        self.check_root(root)?;
        if let Some(m) = &self.member {
            return m
                .broadcast(data, root as usize, stream)?
                .run_alone(m.timeout());
        }
        let s = GpuStream::of_cudarc(stream);
        let count = data.len();
        with_cudarc_slice_mut(data, stream, |buf| {
            self.broadcast_device_buffer(buf, count, T::DATA_TYPE, root, &s)
        })?
    }

    /// The device allreduce of the first `count` elements of `buffer`, on `stream`: through the
    /// GPU ring where there is one, else staged through the host ring.
    fn device_all_reduce(
        &self,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        if !nodetour_core::cuda::same_context(stream.context(), buffer.context()) {
            return Err(Error::InvalidArgument {
                reason: "the stream is not on the buffer's GPU".into(),
            });
        }
        if count
            .checked_mul(dtype.size())
            .is_none_or(|b| b > buffer.len())
        {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{count} elements of {dtype:?} in a buffer of {} bytes",
                    buffer.len()
                ),
            });
        }
        if self.has_gpu_ring() {
            return self.gpu_ring_collective(buffer, Shape::AllReduce, count, dtype, op, stream);
        }
        device_buffers::refuse_capture(stream)?;
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let result = self.staged_all_reduce(job, buffer, count, dtype, op, stream);
        if let Err(e) = &result {
            state.failed.get_or_insert_with(|| e.clone());
        }
        result
    }

    /// Whether device collectives run on a GPU ring (queued on the stream, no host wait).
    fn has_gpu_ring(&self) -> bool {
        matches!(self.paths.device, DevicePath::GpuRing { .. })
    }

    /// Queues `shape` on the GPU ring, in place on `buffer` (laid out in ring positions). A
    /// failure once the neighbours count on the collective breaks the communicator; arguments
    /// refused before anything was queued do not.
    fn gpu_ring_collective(
        &self,
        buffer: &DeviceBuffer,
        shape: Shape,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let ring = job.gpu_ring.as_mut().ok_or_else(|| Error::Unsupported {
            reason: "this communicator has no GPU ring".into(),
        })?;
        let result = match ring.collective(buffer, shape, count, dtype, op, stream) {
            Err(e @ (Error::InvalidArgument { .. } | Error::Unsupported { .. })) => return Err(e),
            other => other.map_err(|e| self.job_ranks(e)),
        };
        if let Err(e) = &result {
            state.failed.get_or_insert_with(|| e.clone());
        }
        result
    }

    /// Queues `world` block copies of `block` bytes from `src` to `dst`; `at(r)` gives, for
    /// rank `r`, the block index in `dst` and in `src`. One copy when the ring order is the rank
    /// order.
    fn copy_blocks(
        &self,
        s: &GpuStream,
        dst: &DeviceBuffer,
        src: &DeviceBuffer,
        block: usize,
        at: impl Fn(u32) -> (u32, u32),
    ) -> Result<()> {
        let identity = (0..self.world).all(|r| at(r) == (r, r));
        if identity {
            return s
                .copy(dst, 0, src, 0, block * self.world as usize)
                .map_err(gpu_error);
        }
        for r in 0..self.world {
            let (d, from) = at(r);
            s.copy(dst, d as usize * block, src, from as usize * block, block)
                .map_err(gpu_error)?;
        }
        Ok(())
    }

    fn staged_all_reduce(
        &self,
        job: &mut HostJob,
        buffer: &DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
    ) -> Result<()> {
        let what = Descriptor {
            collective: Collective::AllReduce,
            count: count as u64,
            dtype,
            op,
            root: None,
            algorithm: Algorithm::HostRingGpuStaged,
            seq: 0,
        };
        let per = job.piece_bytes() / dtype.size();
        job.with_staging(buffer, stream, |job, staging| {
            for r in pieces(count, per) {
                job.run(&self.aborted, |ring, seq, alive| {
                    let d = Descriptor { seq, ..what };
                    ring.all_reduce_gpu_piece(buffer, r, &d, staging, alive)
                })?;
            }
            stream.synchronize().map_err(|e| Error::Gpu {
                reason: e.to_string(),
            })
        })
    }

    // --- the machinery every collective shares ---

    fn lock(&self) -> Result<MutexGuard<'_, State>> {
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

    /// The state, if the communicator can run a collective.
    fn usable(&self) -> Result<MutexGuard<'_, State>> {
        if self.member.is_some() {
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

    fn position(&self) -> u32 {
        self.position_of(self.rank)
    }

    /// An error of the GPU ring (ranks as ring positions) with job ranks.
    fn job_ranks(&self, e: Error) -> Error {
        let order = &self.paths.order;
        e.map_ranks(&|p| order.get(p as usize).copied().unwrap_or(p))
    }

    /// The ring position of job rank `rank`.
    fn position_of(&self, rank: u32) -> u32 {
        self.paths
            .order
            .iter()
            .position(|r| *r == rank)
            .unwrap_or(0) as u32
    }

    fn descriptor<T: Element>(
        &self,
        collective: Collective,
        count: usize,
        op: ReduceOp,
        root: Option<u32>,
    ) -> Descriptor {
        Descriptor {
            collective,
            count: count as u64,
            dtype: T::DATA_TYPE,
            op,
            root,
            algorithm: Algorithm::HostRing,
            seq: 0,
        }
    }

    fn check_root(&self, root: u32) -> Result<()> {
        if root >= self.world {
            return Err(Error::InvalidArgument {
                reason: format!("root {root} in a communicator of {} ranks", self.world),
            });
        }
        Ok(())
    }

    /// `whole` is `world` blocks of `block` elements.
    fn blocks(&self, whole: usize, block: usize, a: &str, b: &str) -> Result<()> {
        if (block as u128) * u128::from(self.world) != whole as u128 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{a} has {whole} elements, {b} {block}: {a} must be {} × {b}",
                    self.world
                ),
            });
        }
        Ok(())
    }

    /// The block length of a buffer of `world` blocks.
    fn block_of(&self, len: usize) -> Result<usize> {
        if len % self.world as usize != 0 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{len} elements do not split into {} equal blocks",
                    self.world
                ),
            });
        }
        Ok(len / self.world as usize)
    }

    /// Runs `what` (per-rank count `n`) in pieces: each piece covers elements `r` of every
    /// rank's block (`blocks` blocks share the staging region) and is one ring collective with
    /// its own sequence number; `body` stages its input, runs it and fills its output. Any
    /// failure breaks the communicator (ranks were talking); the output then holds the results
    /// of the pieces that finished and the rest as it was.
    fn run_pieces(
        &self,
        what: &Descriptor,
        n: usize,
        blocks: u32,
        mut body: impl FnMut(&mut HostRing<'_>, Range<usize>, &Descriptor, &Alive<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut state = self.usable()?;
        let job = state.job.as_mut().expect("usable");
        let es = what.dtype.size();
        let per = job.piece_bytes() / es / blocks as usize;
        if per == 0 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "a staging region of {} bytes holds no piece of {blocks} blocks of {:?}: raise NODETOUR_PIECE_BYTES",
                    job.piece_bytes(),
                    what.dtype
                ),
            });
        }
        let aborted = self.aborted.clone();
        let mut result = Ok(());
        for r in pieces(n, per) {
            result = job.run(&aborted, |ring, seq, alive| {
                body(ring, r, &Descriptor { seq, ..*what }, alive)
            });
            if result.is_err() {
                break;
            }
        }
        if let Err(e) = &result {
            state.failed.get_or_insert_with(|| e.clone());
        }
        result
    }
}

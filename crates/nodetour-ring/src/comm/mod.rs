//! The communicator: the one object a training runtime holds.
//!
//! In the order a runtime works:
//!
//! 1. **Form** it once per process: [`Communicator::from_env`] reads the launcher's variables
//!    (torchrun, Slurm, Open MPI, `NODETOUR_*`); [`Communicator::from_unique_id`] serves
//!    runtimes with their own store. Every rank calls the same constructor; it returns once
//!    every link is connected, or fails within the options' joining timeout
//!    ([`Options::join_timeout`], 10 minutes by default) naming what is missing.
//! 2. **Read its paths**: [`Communicator::paths`] says, per link, the transport, where the bytes
//!    land and why that path was chosen (also logged at formation).
//! 3. **Run collectives**: one verb each, [`Communicator::all_reduce`],
//!    [`Communicator::reduce_scatter`], [`Communicator::all_gather`],
//!    [`Communicator::broadcast`], and their `*_in_place` forms, on any memory the [`Input`]
//!    and [`Output`] traits accept, with the queue it is ordered on as the last argument:
//!    cudarc slices and views with the caller's `&Arc<CudaStream>`; [`Elements`] (nodetour's
//!    device buffers, views of a runtime's own memory, raw pointers; the type at run time)
//!    with a `&GpuStream`; host slices, arrays, vectors and [`HostBytes`] with [`Host`]. On
//!    device memory the call queues the collective on the stream and returns: a GPU ring on
//!    one host (cuda-ipc or shm) and across hosts (network links driven from the streams by a
//!    progress thread, landing in GPU memory where GPUDirect RDMA allows, else in host
//!    slots); only where no GPU ring can form (host links forced, a GPU missing on a rank) is
//!    it staged through the host ring, synchronous with a deadline. [`Communicator::paths`]
//!    says which ([`DevicePath`]). A communicator's device collectives run in the order of
//!    the calls, whatever stream each names (a stream of its own, joined from and back to the
//!    caller's on the calling thread, as NCCL's), and [`Communicator::wait`] covers every
//!    stream used. [`Communicator::start`] is the owning non-blocking form of any device collective. On
//!    host memory the call is synchronous: it returns `Ok` only with the answer in the output,
//!    the same bits on every rank. Any size of buffer goes through the communicator's bounded
//!    staging memory in pieces.
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
//! use nodetour_ring::comm::{Communicator, Host, Options};
//! use nodetour_ring::ReduceOp;
//! # fn main() -> nodetour_ring::Result<()> {
//! let comm = Communicator::from_env(Options::from_env()?)?;
//! println!("{}", comm.paths());
//! let mut grads = vec![1.0f32; 1 << 20];
//! comm.all_reduce_in_place(&mut grads, ReduceOp::Avg, Host)?;
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
//! a [`Group`] that collects each GPU's calls (as `ncclGroupStart`/`ncclGroupEnd`). Each GPU
//! reads its neighbour's memory directly; the calls queue on the callers' streams and return.
//!
//! **Host and device collectives** may be interleaved in any order the ranks agree on. Every
//! collective carries its place among all of the communicator's collectives, so ranks that
//! interleave them differently fail with [`Error::Disagreement`] on the ring where the two
//! orders meet. One case still ends in [`Error::Timeout`] instead: with a GPU ring, a rank
//! waiting for its queued device collectives ([`Communicator::wait`]) while the peer waits in
//! a host collective that rank has not reached (neither ring then sees the other's call); the
//! peer's timeout then breaks its communicator, whose abort ends the waiting rank's wait too.
//! A communicator broken by any failure aborts its device side formed from a stream, so device
//! collectives queued there end at once on every rank and `close` does not wait for them.
//!
//! **Not built yet**: sub-communicators (`split`), point-to-point (`send`/`recv`), all-to-all.

mod call_order;
mod device_buffers;
mod device_collectives;
mod device_from_stream;
mod device_set;
mod engine;
mod executor;
pub(crate) mod form;
mod gpu_options;
mod host_collectives;
mod host_job;
mod in_flight;
mod lifecycle;
pub(crate) mod links;
mod operand;
mod options;
mod p2p;
pub(crate) mod paths;
mod peers;
mod scratch;
mod symmetric;
mod verbs;

pub use crate::gpu::{KERNEL_COPY_MAX, ONE_STEP_MAX};
pub use device_set::Group;
pub use gpu_options::{GpuPaths, GpuRingOptions, NetLanding, ONE_KERNEL_MAX, OneKernelMode};
use host_collectives::pieces;
pub use in_flight::{Failed, InFlight};
pub use nodetour_net::bootstrap::UniqueId;
pub use operand::{Elements, Host, HostBytes, Input, Output, Queue};
pub use options::{
    DEFAULT_HOST_GATHER_MAX, DEFAULT_PIECE_BYTES, DEFAULT_SLOT_BYTES, DEFAULT_SLOTS, MUST_AGREE,
    Options,
};
pub use p2p::Batch;
pub use paths::{DevicePath, Direction, Landing, LinkPath, Paths, PeerLinkPath};
pub use symmetric::{SymmetricBuffer, SymmetricElements};

use std::ops::Range;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::memory::DeviceBuffer;
use nodetour_net::bootstrap::LaunchInfo;

use self::device_set::{DeviceSet, SetMember};
use self::engine::Engine;
use self::host_job::{AbortFlag, HostJob, Launch};
use crate::descriptor::{Algorithm, Collective, Descriptor};
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
    /// The device side formed from a stream, dropped (torn down) before `engine`.
    device: device_from_stream::DeviceSide,
    /// The formed job this communicator runs its collectives on.
    engine: Engine,
    /// A communicator of [`Communicator::from_devices`]: its GPU in the shared set.
    member: Option<SetMember>,
    /// A communicator of processes: what formed it (to form its device side later).
    formed_with: Option<device_from_stream::FormedWith>,
}

/// Aborts a communicator's collective in flight, and every later one, from any thread: they
/// return [`Error::Aborted`] with the reason, and the neighbours' collectives end with it too.
#[derive(Clone)]
pub struct AbortHandle {
    flag: AbortFlag,
    gpu: Option<crate::gpu_ring::AbortHandle>,
    set: Option<Arc<DeviceSet>>,
    /// The device side's, once formed from a stream.
    device: Arc<std::sync::OnceLock<AbortHandle>>,
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
        if let Some(d) = self.device.get() {
            d.abort(reason);
        }
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("world", &self.world())
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

/// A CUDA call of a device collective failed (its error kept as the source).
fn gpu_error(e: nodetour_core::Error) -> Error {
    Error::gpu("a device collective's CUDA call", e)
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

/// The liveness check a ring collective polls (the bootstrap's, and the abort flag).
type Alive<'a> = dyn Fn() -> nodetour_core::Result<()> + 'a;

impl Communicator {
    /// This rank.
    pub fn rank(&self) -> u32 {
        self.engine.rank
    }

    /// Ranks in the communicator.
    pub fn world(&self) -> u32 {
        self.engine.world
    }

    /// This rank's place among the ranks on its host (0 for the lowest rank there), as a
    /// runtime picks its GPU by (torchrun's `LOCAL_RANK`).
    pub fn local_rank(&self) -> u32 {
        self.engine.local.0
    }

    /// Ranks on this rank's host (torchrun's `LOCAL_WORLD_SIZE`).
    pub fn local_world(&self) -> u32 {
        self.engine.local.1
    }

    /// How data travels: per link, the transport, where the bytes land, and why; for device
    /// memory, the path of the GPU given ([`Options::gpu`]) or, formed without one, of the
    /// GPU of the first device collective's stream (none before it).
    pub fn paths(&self) -> Paths {
        let mut paths = self.engine.paths.clone();
        if let Some(peers) = &self.engine.peer_paths {
            paths.peers = peers.lock().unwrap_or_else(|p| p.into_inner()).clone();
        }
        if let Some(d) = self.device.engine() {
            paths.device = d.paths.device.clone();
        } else if let Some((_, staged)) = self.device.staged.get() {
            paths.device = staged.clone();
        }
        paths
    }

    /// A handle that aborts this communicator's collectives from any thread.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle {
            set: self.member.as_ref().map(|m| m.set.clone()),
            ..self.engine.abort_handle()
        }
    }

    /// The failure that broke this communicator, if one did (as `ncclCommGetAsyncError`):
    /// also one that the GPU ring met after a device collective's call had returned.
    pub fn error(&self) -> Option<Error> {
        if let Some(m) = &self.member {
            return m.set.error();
        }
        self.engine
            .error()
            .or_else(|| self.device.engine().and_then(Engine::error))
    }

    /// `whole` is `world` blocks of `block` elements.
    fn blocks(&self, whole: usize, block: usize, a: &str, b: &str) -> Result<()> {
        let world = self.world();
        if (block as u128) * u128::from(world) != whole as u128 {
            return Err(Error::InvalidArgument {
                reason: format!("{a} has {whole} elements, {b} {block}: {a} must be {world} × {b}"),
            });
        }
        Ok(())
    }

    /// The block length of a buffer of `world` blocks.
    fn block_of(&self, len: usize) -> Result<usize> {
        let world = self.world() as usize;
        if !len.is_multiple_of(world) {
            return Err(Error::InvalidArgument {
                reason: format!("{len} elements do not split into {world} equal blocks"),
            });
        }
        Ok(len / world)
    }
}

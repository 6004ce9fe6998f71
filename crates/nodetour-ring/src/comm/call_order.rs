//! A communicator's device collectives in call order, whatever stream each call names (as
//! NCCL's): every eager device collective runs on the communicator's own stream, the **lane**,
//! joined from the caller's stream (the lane waits for an event recorded there) and back (the
//! caller's stream waits for an event recorded on the lane after the collective). The lane is
//! one stream, so each collective starts after the previous one ended, on whatever stream that
//! one was called; every wait polls a marker recorded on the lane, which so covers every
//! stream used; and nothing but these two joins, on the calling thread, ever names the
//! caller's stream: buffers note the lane for their stream-ordered frees, a set's last arrival
//! queues on the members' lanes, so a per-thread default stream (`CU_STREAM_PER_THREAD`,
//! which names another stream on every thread) is resolved before the call returns.
//!
//! A [`super::Group`] runs its members' calls on threads of its own: there the per-thread
//! stream the caller named is the group caller's, which on a member thread would name that
//! thread's own. So [`Group::end`](super::Group::end) makes a **stand-in** for it on each GPU
//! on the calling thread before the members run (a stream forked from the caller's per-thread
//! stream: it starts after what is queued there), the member threads' calls use the stand-in
//! in its place everywhere (the joins here, cudarc's read and write events of the caller's
//! slices), and the caller's per-thread stream joins each stand-in back once every member has
//! queued ([`GroupStandIns`]): the member threads never name `CU_STREAM_PER_THREAD`.
//!
//! Captured into a CUDA graph, a collective runs on the capturing stream itself (the lane
//! stays out of every capture: an eager call meanwhile must not land in the graph); a replay
//! runs where the caller launches its graph, ordered by the caller. A replay that runs beside
//! another collective of the communicator fails typed on every rank (the one-kernel path's
//! claim and counted arrival words; the ring streams' claims of their guards), never `Ok`.
//!
//! Cost: two event records and two stream waits per collective on the host, and the hops
//! between the two streams on the GPU (to be measured: `docs/PERFORMANCE.md`, "Call order").

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaStream};
use nodetour_core::cuda::{GpuEvent, GpuStream};

use crate::error::{Error, Result};

/// The lane of one GPU and its join events.
pub(crate) struct CallOrder {
    context: Arc<CudaContext>,
    lane: Mutex<Lane>,
}

struct Lane {
    stream: GpuStream,
    /// Recorded on the caller's stream at entry; the lane waits for it.
    entry: GpuEvent,
    /// Recorded on the lane at each exit; the caller's stream waits for it.
    exit: GpuEvent,
}

/// What a [`super::Group`]'s member threads use in place of the group caller's per-thread
/// stream: one stand-in per GPU, forked from it on the caller's thread.
pub(crate) struct GroupStandIns {
    stand_ins: Vec<Arc<CudaStream>>,
}

thread_local! {
    /// Set on a group's member threads for the length of their calls.
    static GROUP: RefCell<Option<Vec<Arc<CudaStream>>>> = const { RefCell::new(None) };
}

fn gpu(what: &'static str) -> impl Fn(nodetour_core::Error) -> Error {
    move |e| Error::gpu(what, e)
}

impl CallOrder {
    /// The lane of `context`'s GPU.
    pub(crate) fn new(context: &Arc<CudaContext>) -> Result<CallOrder> {
        let g = gpu("creating the communicator's stream");
        Ok(CallOrder {
            context: context.clone(),
            lane: Mutex::new(Lane {
                stream: GpuStream::new(context).map_err(&g)?,
                entry: GpuEvent::marker(context).map_err(&g)?,
                exit: GpuEvent::marker(context).map_err(&g)?,
            }),
        })
    }

    /// Runs `f` with the lane, joined after the work already queued on `caller`; then joins
    /// `caller` after what `f` queued (whether `f` failed or not: the caller's stream waits
    /// for whatever was queued). Calls on the lane are serialised by its lock, held for the
    /// whole collective.
    pub(crate) fn run<R>(
        &self,
        caller: &GpuStream,
        f: impl FnOnce(&GpuStream) -> Result<R>,
    ) -> Result<R> {
        if !nodetour_core::cuda::same_context(caller.context(), &self.context) {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "the stream is on GPU {}, this communicator's device collectives on GPU {}",
                    caller.context().ordinal(),
                    self.context.ordinal()
                ),
            });
        }
        let lane = self.lane.lock().map_err(|_| poisoned())?;
        let g = gpu("joining the communicator's stream to the caller's");
        caller.record_marker(&lane.entry).map_err(&g)?;
        lane.stream.wait_marker(&lane.entry).map_err(&g)?;
        let result = f(&lane.stream);
        let back = lane
            .stream
            .record_marker(&lane.exit)
            .map_err(&g)
            .and_then(|()| caller.wait_marker(&lane.exit).map_err(&g));
        match (result, back) {
            (Ok(r), Ok(())) => Ok(r),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        }
    }

    /// A marker recorded on the lane now: once it completes, every collective called so far
    /// has run (what `wait` polls).
    pub(crate) fn mark(&self) -> Result<GpuEvent> {
        let lane = self.lane.lock().map_err(|_| poisoned())?;
        let g = gpu("marking the communicator's stream");
        let m = GpuEvent::marker(&self.context).map_err(&g)?;
        lane.stream.record_marker(&m).map_err(&g)?;
        Ok(m)
    }
}

/// On a group's member thread, where `stream` is the per-thread default stream (named on the
/// group caller's thread, meant as its own): the stand-in to queue on in its place.
fn stand_in_for(stream: &Arc<CudaStream>) -> Option<Arc<CudaStream>> {
    if stream.cu_stream() != nodetour_core::cuda::stream::CU_STREAM_PER_THREAD {
        return None;
    }
    GROUP.with(|g| {
        g.borrow()
            .as_ref()?
            .iter()
            .find(|s| nodetour_core::cuda::same_context(s.context(), stream.context()))
            .cloned()
    })
}

/// Runs `f` with the stream a lent operand queues on: `stream`, or its group stand-in
/// ([`stand_in_for`]).
pub(crate) fn with_resolved_cudarc<R>(
    stream: &Arc<CudaStream>,
    f: impl FnOnce(&Arc<CudaStream>) -> R,
) -> R {
    match stand_in_for(stream) {
        Some(s) => f(&s),
        None => f(stream),
    }
}

/// [`with_resolved_cudarc`] of a [`GpuStream`].
pub(crate) fn with_resolved<R>(stream: &GpuStream, f: impl FnOnce(&GpuStream) -> R) -> R {
    let stand_in = stream
        .is_per_thread()
        .then(|| stand_in_for(&stream.context().per_thread_stream()))
        .flatten();
    match stand_in {
        Some(s) => f(&GpuStream::of_cudarc(&s)),
        None => f(stream),
    }
}

impl GroupStandIns {
    /// On the group caller's thread: a stand-in for its per-thread stream on each of
    /// `contexts`, starting after what is queued there now.
    pub(crate) fn fork(contexts: &[Arc<CudaContext>]) -> Result<GroupStandIns> {
        let mut stand_ins: Vec<Arc<CudaStream>> = Vec::new();
        for c in contexts {
            if stand_ins
                .iter()
                .any(|s| nodetour_core::cuda::same_context(s.context(), c))
            {
                continue;
            }
            // cudarc's fork: a new non-blocking stream that waits for an event recorded on
            // the per-thread stream (this thread's, here); no synchronisation of the context.
            let s = c.per_thread_stream().fork().map_err(|e| {
                Error::gpu(
                    "forking the caller's per-thread stream",
                    nodetour_core::Error::from(e),
                )
            })?;
            stand_ins.push(s);
        }
        Ok(GroupStandIns { stand_ins })
    }

    /// Runs `f` on a member thread with these stand-ins in place of the per-thread stream.
    pub(crate) fn enter<R>(&self, f: impl FnOnce() -> R) -> R {
        GROUP.with(|g| *g.borrow_mut() = Some(self.stand_ins.clone()));
        let r = f();
        GROUP.with(|g| *g.borrow_mut() = None);
        r
    }

    /// On the group caller's thread, once every member has queued: its per-thread stream on
    /// each GPU waits for the stand-in there (whatever the members queued on it). The
    /// stand-ins are released after that work (a stream destroyed with work queued finishes
    /// it first).
    pub(crate) fn join_back(self) -> Result<()> {
        for s in &self.stand_ins {
            s.context().per_thread_stream().join(s).map_err(|e| {
                Error::gpu(
                    "joining the caller's per-thread stream back",
                    nodetour_core::Error::from(e),
                )
            })?;
        }
        Ok(())
    }
}

fn poisoned() -> Error {
    Error::Aborted {
        reason: "a thread panicked inside a collective of this communicator".into(),
    }
}

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
//! stream the caller named is the group caller's, so [`Group::end`](super::Group::end) records
//! its tail on the calling thread before the members run ([`GroupTails`]) and joins it back
//! after: the member threads never name it.
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

use cudarc::driver::CudaContext;
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
/// stream: its tail on each GPU (recorded on the caller's thread), and the lanes it must join
/// back (waited for on the caller's thread once every member has queued).
pub(crate) struct GroupTails {
    /// (GPU, the caller's per-thread stream's tail there).
    tails: Vec<(Arc<CudaContext>, Arc<GpuEvent>)>,
    /// The lanes that ran work on the caller's behalf.
    joined: Arc<Mutex<Vec<GpuStream>>>,
}

thread_local! {
    /// Set on a group's member threads for the length of their calls.
    static GROUP: RefCell<Option<GroupTails>> = const { RefCell::new(None) };
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
        match group_tail(caller) {
            Some(tail) => lane.stream.wait_marker(&tail).map_err(&g)?,
            None => {
                caller.record_marker(&lane.entry).map_err(&g)?;
                lane.stream.wait_marker(&lane.entry).map_err(&g)?;
            }
        }
        let result = f(&lane.stream);
        let back = lane
            .stream
            .record_marker(&lane.exit)
            .map_err(&g)
            .and_then(|()| {
                if note_group_join(caller, &lane.stream) {
                    return Ok(());
                }
                caller.wait_marker(&lane.exit).map_err(&g)
            });
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

/// The group caller's tail on `caller`'s GPU, where this is a group's member thread and
/// `caller` the per-thread stream (named on the caller's thread, meant as its own).
fn group_tail(caller: &GpuStream) -> Option<Arc<GpuEvent>> {
    if !caller.is_per_thread() {
        return None;
    }
    GROUP.with(|g| {
        let g = g.borrow();
        let tails = g.as_ref()?;
        tails
            .tails
            .iter()
            .find(|(c, _)| nodetour_core::cuda::same_context(c, caller.context()))
            .map(|(_, t)| t.clone())
    })
}

/// On a group's member thread with the per-thread stream: notes `lane` for the caller's
/// thread to join back, and says so.
fn note_group_join(caller: &GpuStream, lane: &GpuStream) -> bool {
    if !caller.is_per_thread() {
        return false;
    }
    GROUP.with(|g| {
        let g = g.borrow();
        let Some(tails) = g.as_ref() else {
            return false;
        };
        if let Ok(mut v) = tails.joined.lock() {
            v.push(lane.clone());
        }
        true
    })
}

impl GroupTails {
    /// On the group caller's thread: the tail of its per-thread stream on each of `contexts`.
    pub(crate) fn record(contexts: &[Arc<CudaContext>]) -> Result<GroupTails> {
        let g = gpu("marking the caller's per-thread stream");
        let mut tails: Vec<(Arc<CudaContext>, Arc<GpuEvent>)> = Vec::new();
        for c in contexts {
            if tails
                .iter()
                .any(|(t, _)| nodetour_core::cuda::same_context(t, c))
            {
                continue;
            }
            let per_thread = per_thread_stream(c);
            let m = GpuEvent::marker(c).map_err(&g)?;
            per_thread.record_marker(&m).map_err(&g)?;
            tails.push((c.clone(), Arc::new(m)));
        }
        Ok(GroupTails {
            tails,
            joined: Arc::default(),
        })
    }

    /// The tails for a member thread (sharing what it joins).
    pub(crate) fn for_member(&self) -> GroupTails {
        GroupTails {
            tails: self.tails.clone(),
            joined: self.joined.clone(),
        }
    }

    /// Runs `f` on a member thread with these tails in place of the per-thread stream.
    pub(crate) fn enter<R>(self, f: impl FnOnce() -> R) -> R {
        GROUP.with(|g| *g.borrow_mut() = Some(self));
        let r = f();
        GROUP.with(|g| *g.borrow_mut() = None);
        r
    }

    /// On the group caller's thread, once every member has queued: its per-thread stream on
    /// each GPU waits for the lanes that ran work on its behalf.
    pub(crate) fn join_back(&self) -> Result<()> {
        let g = gpu("joining the caller's per-thread stream back");
        let lanes = std::mem::take(&mut *self.joined.lock().map_err(|_| poisoned())?);
        for lane in lanes {
            let per_thread = per_thread_stream(lane.context());
            let m = GpuEvent::marker(lane.context()).map_err(&g)?;
            lane.record_marker(&m).map_err(&g)?;
            per_thread.wait_marker(&m).map_err(&g)?;
        }
        Ok(())
    }
}

/// The calling thread's per-thread default stream on `context`'s GPU (cudarc's handle, always
/// valid).
fn per_thread_stream(context: &Arc<CudaContext>) -> GpuStream {
    GpuStream::of_cudarc(&context.per_thread_stream())
}

fn poisoned() -> Error {
    Error::Aborted {
        reason: "a thread panicked inside a collective of this communicator".into(),
    }
}

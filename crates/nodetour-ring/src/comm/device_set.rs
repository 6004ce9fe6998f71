//! Several GPUs of one process, one communicator each ([`super::Communicator::from_devices`],
//! as NCCL's `ncclCommInitAll`): every member queues its collectives through one shared
//! [`GpuGroup`] (each GPU reads its ring neighbour's memory directly; no slots, no host
//! staging).
//!
//! Two ways to drive them, as with NCCL:
//! - **one thread per GPU**: each thread calls its member's device collective; the calls meet
//!   (a [`Meeting`]: each lends its view of the caller's buffer and stream, the last to arrive
//!   queues the collective on every stream), and every call returns once it is queued. A
//!   thread waits only for the other threads' calls, to the options' timeout.
//! - **one thread for all**: a [`Group`] collects each member's calls (closures) and runs them
//!   at [`Group::end`], each member's on a scoped thread of its own (as `ncclGroupStart` /
//!   `ncclGroupEnd` from the caller's view). Calling the members one after the other from one
//!   thread without a group would wait for calls that never come: that times out with an
//!   error saying to use a group.
//!
//! Every member must call the same collectives in the same order with the same arguments
//! (count, type, operation, root); members that disagree all fail with
//! [`Error::Disagreement`] and nothing is queued. A failure breaks every member.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::CudaContext;
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::meeting::{MeetError, Meeting};
use nodetour_core::memory::DeviceBuffer;

use super::Communicator;
use super::call_order::GroupStandIns;
use super::executor::DeviceOperands;
use super::scratch::{Scratch, with_scratch};
use crate::call::{CallSpec, element_bytes};
use crate::descriptor::Collective;
use crate::error::{Error, Result};
use crate::gpu::{GpuGroup, GroupAbort};
use crate::reduce::ReduceOp;

/// How a member's call that another member refused begins its reason.
const REFUSED_ON: &str = "the collective was refused on GPU";

/// The GPUs of one `from_devices` call, shared by its members.
pub(crate) struct DeviceSet {
    group: Mutex<GpuGroup>,
    abort: GroupAbort,
    pub(super) meeting: Meeting<DeviceBuffer, GpuStream, CallSpec, Result<()>>,
    contexts: Vec<Arc<CudaContext>>,
}

impl DeviceSet {
    pub(crate) fn new(
        contexts: &[Arc<CudaContext>],
        options: &super::Options,
    ) -> Result<Arc<DeviceSet>> {
        let mut group = GpuGroup::new(contexts)?;
        group.set_kernel_copy_max(options.kernel_copy_max);
        group.set_one_step_max(options.one_step_max);
        Ok(Arc::new(DeviceSet {
            abort: group.abort_handle(),
            group: Mutex::new(group),
            meeting: Meeting::new(contexts.len()),
            contexts: contexts.to_vec(),
        }))
    }

    pub(crate) fn path(&self) -> String {
        self.group
            .lock()
            .map(|g| g.path().to_owned())
            .unwrap_or_default()
    }

    /// Ends every member: waiting calls leave with the reason, later calls fail with it.
    pub(crate) fn abort(&self, reason: &str) {
        self.abort.abort(reason);
        self.meeting.break_with(&format!("aborted: {reason}"));
    }

    /// The failure that ended the set, if one did.
    pub(crate) fn error(&self) -> Option<Error> {
        self.abort.error()
    }

    fn fail(&self, e: &Error) {
        self.abort.fail(e.clone());
        self.meeting.break_with(&e.to_string());
    }

    /// Waits until every collective queued so far has finished on every member's stream.
    pub(crate) fn wait(&self, timeout: Duration) -> Result<()> {
        let group = self.group.lock().map_err(|_| poisoned())?;
        group.wait(timeout)
    }

    /// Queues one collective on every member's stream (the members' views and streams in
    /// seat order), once every member's key agrees.
    fn run(
        &self,
        views: &[&DeviceBuffer],
        streams: &[&GpuStream],
        keys: &[CallSpec],
    ) -> Result<()> {
        let first = keys[0];
        if let Some((seat, theirs)) = keys.iter().enumerate().find(|(_, k)| !k.agrees(&first)) {
            let e = Error::Disagreement {
                rank: 0,
                peer: seat as u32,
                ours: format!("{first:?}"),
                theirs: format!("{theirs:?}"),
            };
            self.fail(&e);
            return Err(e);
        }
        let mut group = self.group.lock().map_err(|_| poisoned())?;
        let CallSpec {
            kind: collective,
            count,
            dtype,
            op,
            root,
        } = first;
        // A PreMulSum: each member's values multiplied by its own scalar (a pass over its
        // buffer on its stream, before the collective), then summed.
        let op = match op.scalar() {
            Some(_) => {
                let scalars: Vec<f64> = keys.iter().filter_map(|k| k.op.scalar()).collect();
                let elements = match collective {
                    Collective::ReduceScatter => count.checked_mul(keys.len()),
                    _ => Some(count),
                }
                .ok_or_else(|| Error::InvalidArgument {
                    reason: format!("{count} elements × {} GPUs overflow", keys.len()),
                })?;
                group.pre_multiply(views, streams, elements, dtype, &scalars)?;
                ReduceOp::Sum
            }
            None => op,
        };
        match collective {
            Collective::AllReduce => group.all_reduce(views, streams, count, dtype, op),
            Collective::ReduceScatter => group.reduce_scatter(views, streams, count, dtype, op),
            Collective::AllGather => group.all_gather(views, streams, count, dtype),
            Collective::Broadcast => {
                group.broadcast(views, streams, count * dtype.size(), root as usize)
            }
        }
    }
}

fn poisoned() -> Error {
    Error::Aborted {
        reason: "a thread panicked inside a collective of this GPU set".into(),
    }
}

/// Queues the memory of one call on its stream (copies in), calls the continuation with the
/// buffer and stream the collective runs on, then queues what follows it (copies out). The
/// views it lends live only for the continuation.
pub(crate) type Lend<'a> =
    Box<dyn FnMut(&mut dyn FnMut(&DeviceBuffer, &GpuStream) -> Result<()>) -> Result<()> + 'a>;

/// One member's share of one collective, ready to run (meeting the other members' threads).
pub(crate) struct Call<'a> {
    set: Arc<DeviceSet>,
    seat: usize,
    key: CallSpec,
    lend: Lend<'a>,
}

/// One member of a [`DeviceSet`].
pub(crate) struct SetMember {
    pub(crate) set: Arc<DeviceSet>,
    pub(crate) seat: usize,
    timeout: Duration,
    scratch: Arc<Mutex<Scratch>>,
}

impl SetMember {
    pub(crate) fn new(set: Arc<DeviceSet>, seat: usize, timeout: Duration) -> SetMember {
        SetMember {
            set,
            seat,
            timeout,
            scratch: Arc::default(),
        }
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.set.contexts[self.seat]
    }

    fn usable(&self) -> Result<()> {
        match self.set.error() {
            Some(first) => Err(Error::Broken {
                first: Box::new(first),
            }),
            None => Ok(()),
        }
    }

    fn call<'a>(&self, key: CallSpec, lend: Lend<'a>) -> Result<Call<'a>> {
        self.usable()?;
        Ok(Call {
            set: self.set.clone(),
            seat: self.seat,
            key,
            lend,
        })
    }

    /// A set member's device memory (its `Executor`): runs `call` as this member's share,
    /// meeting the other members' calls.
    pub(super) fn verb(&self, call: CallSpec, on: DeviceOperands<'_>) -> Result<()> {
        // A call refused here cancels the meeting: the other members' calls fail with the
        // reason at once instead of waiting for this one, and the set stays usable.
        self.share(call, on.send, on.out, on.stream)
            .inspect_err(|e| self.set.meeting.cancel(self.seat, &e.to_string()))?
            .run_alone(self.timeout)
    }

    /// This member's share of `call`, ready to meet the others.
    fn share<'a>(
        &self,
        call: CallSpec,
        send: Option<&'a DeviceBuffer>,
        out: &'a DeviceBuffer,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let block = call.block_bytes()?;
        let copy_in = |src: &DeviceBuffer| {
            stream
                .copy(out, 0, src, 0, block)
                .map_err(|e| Error::gpu("copying the input in", e))
        };
        match call.kind {
            Collective::AllReduce => {
                if let Some(src) = send {
                    copy_in(src)?;
                }
                self.call(call, Box::new(move |k| k(out, stream)))
            }
            Collective::ReduceScatter => {
                let (src, at) = send.map_or((out, self.seat * block), |s| (s, 0));
                self.reduce_scatter_buffer(src, out, at, call, stream)
            }
            Collective::AllGather => self.all_gather_buffer(send, out, call, stream),
            Collective::Broadcast => {
                if let Some(src) = send.filter(|_| self.seat == call.root as usize) {
                    copy_in(src)?;
                }
                self.call(call, Box::new(move |k| k(out, stream)))
            }
        }
    }

    /// The reduce-scatter of device buffers: `send` holds `n` blocks of `call.count`
    /// elements, `recv` at byte `out_at` gets block `seat`'s reduction (`send` is copied into
    /// the member's scratch and reduced there, so it is never written).
    fn reduce_scatter_buffer<'a>(
        &self,
        send: &'a DeviceBuffer,
        recv: &'a DeviceBuffer,
        out_at: usize,
        call: CallSpec,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let n = self.set.contexts.len();
        let block = call.block_bytes()?;
        let whole = element_bytes(call.count, n, call.dtype)?;
        let through = self.scatter_through(whole, block, out_at);
        self.call(call, Box::new(move |k| through.run(send, recv, stream, k)))
    }

    fn scatter_through(&self, whole: usize, block: usize, out_at: usize) -> ScatterThrough {
        ScatterThrough {
            scratch: self.scratch.clone(),
            context: self.context().clone(),
            seat: self.seat,
            whole,
            block,
            out_at,
        }
    }

    /// The all-gather of device buffers: `send`'s first `call.count` elements go to block
    /// `seat` of `recv` (`n` blocks; without `send` they are there already), then gathered
    /// there in place.
    fn all_gather_buffer<'a>(
        &self,
        send: Option<&'a DeviceBuffer>,
        recv: &'a DeviceBuffer,
        call: CallSpec,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let block = call.block_bytes()?;
        let seat = self.seat;
        self.call(
            call,
            Box::new(move |k| {
                if let Some(send) = send {
                    stream
                        .copy(recv, seat * block, send, 0, block)
                        .map_err(|e| Error::gpu("copying the block in", e))?;
                }
                k(recv, stream)
            }),
        )
    }
}

/// A member's reduce-scatter: the whole input copied into scratch (the pool's, or under
/// capture the graph's own), reduced there in place, block `seat` copied out, so the input is
/// never written (in place, only block `seat` is).
struct ScatterThrough {
    scratch: Arc<Mutex<Scratch>>,
    context: Arc<CudaContext>,
    seat: usize,
    /// Bytes of the whole input, and of one block.
    whole: usize,
    block: usize,
    /// Where the block goes in the output.
    out_at: usize,
}

impl ScatterThrough {
    fn run(
        &self,
        inp: &DeviceBuffer,
        out: &DeviceBuffer,
        s: &GpuStream,
        k: &mut dyn FnMut(&DeviceBuffer, &GpuStream) -> Result<()>,
    ) -> Result<()> {
        let (whole, block, seat) = (self.whole, self.block, self.seat);
        with_scratch(&self.scratch, &self.context, whole, s, |buf| {
            s.copy(buf, 0, inp, 0, whole)
                .map_err(|e| Error::gpu("copying the input in", e))?;
            k(buf, s)?;
            s.copy(out, self.out_at, buf, seat * block, block)
                .map_err(|e| Error::gpu("copying the block out", e))
        })
    }
}

impl Call<'_> {
    /// Runs this member's share by meeting the other members' threads: returns once the
    /// collective is queued on every member's stream.
    pub(crate) fn run_alone(mut self, timeout: Duration) -> Result<()> {
        let (set, seat, key) = (self.set.clone(), self.seat, self.key);
        (self.lend)(&mut |view, stream| {
            let met = set.meeting.meet(
                seat,
                view,
                stream,
                key,
                Deadline::after(timeout),
                |views, streams, keys| set.run(views, streams, &keys),
            );
            match met {
                Ok(result) => result,
                Err(MeetError::Timeout) => {
                    let e = Error::Timeout {
                        waiting_for: "the other GPUs of the set to call the same collective \
                                      (one thread per GPU; a thread that drives several GPUs \
                                      calls them inside a nodetour Group)"
                            .into(),
                        rank: None,
                        after: timeout,
                    };
                    set.abort.fail(e.clone());
                    Err(e)
                }
                Err(MeetError::Broken(reason)) => Err(Error::Broken {
                    first: Box::new(set.error().unwrap_or(Error::Aborted { reason })),
                }),
                Err(MeetError::Seat(reason)) => Err(Error::InvalidArgument { reason }),
                Err(MeetError::Cancelled { seat, reason }) => Err(Error::InvalidArgument {
                    reason: format!("{REFUSED_ON} {seat}, so nothing was queued: {reason}"),
                }),
            }
        })
    }
}

/// The calls of one member in a [`Group`], run in the order they were added.
type Calls<'a> = Vec<Box<dyn FnOnce(&Communicator) -> Result<()> + Send + 'a>>;

/// Collectives of several members of one [`super::Communicator::from_devices`] set, driven
/// from one thread (as NCCL's `ncclGroupStart` / `ncclGroupEnd`): [`Group::add`] collects a
/// call of one member (a closure that calls the member's collective verbs, as a thread per GPU
/// would); [`Group::end`] runs every member's calls, each member's on a thread of its own (the
/// last member's on the caller's), and returns once every collective is queued. The `k`-th collective of every member makes the
/// `k`-th collective of the set, so every member's calls issue the same collectives.
///
/// A call refused before it was queued (a wrong length, a buffer of another GPU) fails that
/// collective on every member, nothing of it is queued, and the set stays usable; a failure
/// once the collective is queued breaks the set, as outside a group.
///
/// ```no_run
/// # fn demo(
/// #     comms: &[nodetour_ring::comm::Communicator],
/// #     grads: &mut [cudarc::driver::CudaSlice<f32>],
/// #     streams: &[std::sync::Arc<cudarc::driver::CudaStream>],
/// # ) -> nodetour_ring::Result<()> {
/// use nodetour_ring::comm::Group;
/// use nodetour_ring::ReduceOp;
/// let mut group = Group::new();
/// for ((comm, grad), stream) in comms.iter().zip(grads.iter_mut()).zip(streams) {
///     group.add(comm, move |c| c.all_reduce_in_place(grad, ReduceOp::Sum, stream))?;
/// }
/// group.end()?;
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct Group<'a> {
    /// Per member seat: its communicator and calls.
    calls: Vec<(&'a Communicator, Calls<'a>)>,
}

impl<'a> Group<'a> {
    /// An empty group.
    pub fn new() -> Self {
        Group { calls: Vec::new() }
    }

    /// Adds a call of `comm` (a member of a `from_devices` set): `call` runs at
    /// [`Self::end`] with `comm`, and issues that member's collectives.
    pub fn add(
        &mut self,
        comm: &'a Communicator,
        call: impl FnOnce(&Communicator) -> Result<()> + Send + 'a,
    ) -> Result<()> {
        let m = member(comm)?;
        if let Some((first, _)) = self.calls.first()
            && !Arc::ptr_eq(&member(first)?.set, &m.set)
        {
            return Err(Error::InvalidArgument {
                reason: "a group holds calls of the communicators of one from_devices set".into(),
            });
        }
        match self.calls.iter_mut().find(|(c, _)| std::ptr::eq(*c, comm)) {
            Some((_, calls)) => calls.push(Box::new(call)),
            None => self.calls.push((comm, vec![Box::new(call)])),
        }
        Ok(())
    }

    /// Runs every member's calls (each member's on a thread of its own) and returns once all
    /// are queued, or with the first failure. A member without a call fails the group before
    /// anything runs.
    pub fn end(self) -> Result<()> {
        let Some((first, _)) = self.calls.first() else {
            return Ok(());
        };
        let set = member(first)?.set.clone();
        let n = set.contexts.len();
        if self.calls.len() != n {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "a group with calls of {} of the set's {n} GPUs: every GPU of the set takes \
                     part in every collective",
                    self.calls.len()
                ),
            });
        }
        // Each member's calls in order; a failure cancels the other members' share of that
        // collective (they may be waiting for it; settled below).
        let run_member = |comm: &Communicator, calls: Calls<'a>| -> Result<()> {
            let seat = member(comm)?.seat;
            for call in calls {
                if let Err(e) = call(comm) {
                    set.meeting.cancel(seat, &e.to_string());
                    return Err(e);
                }
            }
            Ok(())
        };
        // The per-thread default stream named in a call means this thread's: a stand-in forked
        // from it here takes its place on the member threads, and joins it back below.
        let stand_ins = GroupStandIns::fork(&set.contexts)?;
        // Every member but the last on a thread of its own, the last on this one.
        let mut members = self.calls;
        let (last, last_calls) = members.pop().expect("n > 0 members");
        let results: Vec<Result<()>> = std::thread::scope(|scope| {
            // Named by GPU seat (what a debugger or /proc shows of a blocked group).
            let threads: Vec<_> = members
                .into_iter()
                .map(|(comm, calls)| {
                    let stand_ins = &stand_ins;
                    let seat = member(comm)?.seat;
                    std::thread::Builder::new()
                        .name(format!("nodetour-group-{seat}"))
                        .spawn_scoped(scope, move || stand_ins.enter(|| run_member(comm, calls)))
                        .map_err(|e| {
                            let e = Error::Aborted {
                                reason: format!("no thread for GPU seat {seat} of the group: {e}"),
                            };
                            set.meeting.cancel(seat, &e.to_string());
                            e
                        })
                })
                .collect();
            let mine = run_member(last, last_calls);
            let mut all: Vec<Result<()>> = threads
                .into_iter()
                .map(|t| t.and_then(|t| t.join().unwrap_or_else(|_| Err(poisoned()))))
                .collect();
            all.push(mine);
            all
        });
        let joined = stand_ins.join_back();
        // A cancellation only its member saw is taken back; one that some members' calls
        // met and others' never did means the members issued different collectives.
        if let Err(reason) = set.meeting.settle() {
            let e = Error::InvalidArgument {
                reason: format!("a group whose GPUs issued different collectives: {reason}"),
            };
            set.abort.fail(e.clone());
            return Err(e);
        }
        // The cause first: a member's own failure rather than the others' `Broken` or
        // cancelled calls.
        let failures: Vec<Error> = results.into_iter().filter_map(|r| r.err()).collect();
        let echo = |e: &Error| match e {
            Error::Broken { .. } => true,
            Error::InvalidArgument { reason } => reason.starts_with(REFUSED_ON),
            _ => false,
        };
        let cause = failures.iter().position(|e| !echo(e)).unwrap_or(0);
        failures.into_iter().nth(cause).map_or(joined, Err)
    }
}

fn member(comm: &Communicator) -> Result<&SetMember> {
    comm.member.as_ref().ok_or_else(|| Error::InvalidArgument {
        reason: "a group holds calls of communicators made by from_devices (a communicator of \
                 processes runs its device collectives directly)"
            .into(),
    })
}

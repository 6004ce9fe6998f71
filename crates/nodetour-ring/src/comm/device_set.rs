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
//! - **one thread for all**: a [`Group`] collects one call per member and queues them all at
//!   [`Group::end`] (as `ncclGroupStart` / `ncclGroupEnd`). Calling the members one after the
//!   other from one thread without a group would wait for calls that never come: that times
//!   out with an error saying to use a group.
//!
//! Every member must call the same collectives in the same order with the same arguments
//! (count, type, operation, root); members that disagree all fail with
//! [`Error::Disagreement`] and nothing is queued. A failure breaks every member.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cudarc::driver::{CudaContext, CudaStream, DevicePtr, DevicePtrMut};
use nodetour_core::Deadline;
use nodetour_core::cuda::GpuStream;
use nodetour_core::meeting::{MeetError, Meeting};
use nodetour_core::memory::{DeviceBuffer, with_cudarc_slice, with_cudarc_slice_mut};

use super::Communicator;
use super::scratch::{Scratch, with_scratch};
use crate::descriptor::Collective;
use crate::element::Element;
use crate::error::{Error, Result};
use crate::gpu::{GpuGroup, GroupAbort};
use crate::reduce::{DataType, ReduceOp};

/// What every member must agree on for one collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    collective: Collective,
    /// Elements: of the whole buffer (allreduce), of one block (reduce-scatter, all-gather),
    /// of the buffer (broadcast).
    count: usize,
    dtype: DataType,
    op: ReduceOp,
    root: usize,
}

/// The GPUs of one `from_devices` call, shared by its members.
pub(crate) struct DeviceSet {
    group: Mutex<GpuGroup>,
    abort: GroupAbort,
    meeting: Meeting<DeviceBuffer, GpuStream, Key, Result<()>>,
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
    fn run(&self, views: &[&DeviceBuffer], streams: &[&GpuStream], keys: &[Key]) -> Result<()> {
        let first = keys[0];
        if let Some((seat, theirs)) = keys.iter().enumerate().find(|(_, k)| **k != first) {
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
        let Key {
            collective,
            count,
            dtype,
            op,
            root,
        } = first;
        match collective {
            Collective::AllReduce => group.all_reduce(views, streams, count, dtype, op),
            Collective::ReduceScatter => group.reduce_scatter(views, streams, count, dtype, op),
            Collective::AllGather => group.all_gather(views, streams, count, dtype),
            Collective::Broadcast => group.broadcast(views, streams, count * dtype.size(), root),
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

/// One member's share of one collective, ready to run alone (meeting the other threads) or
/// in a [`Group`].
pub(crate) struct Call<'a> {
    set: Arc<DeviceSet>,
    seat: usize,
    key: Key,
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

    fn call<'a>(&self, key: Key, lend: Lend<'a>) -> Result<Call<'a>> {
        self.usable()?;
        Ok(Call {
            set: self.set.clone(),
            seat: self.seat,
            key,
            lend,
        })
    }

    /// The in-place allreduce of `data`.
    pub(crate) fn all_reduce<'a, T, R>(
        &self,
        data: &'a mut R,
        op: ReduceOp,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Call<'a>>
    where
        T: Element,
        R: DevicePtrMut<T>,
    {
        let key = key::<T>(Collective::AllReduce, data.len(), op, 0);
        let s = GpuStream::of_cudarc(stream);
        self.call(
            key,
            Box::new(move |k| with_cudarc_slice_mut(&mut *data, stream, |v| k(v, &s))?),
        )
    }

    /// The allreduce of `send` into `recv` (copied in on `stream` first).
    pub(crate) fn all_reduce_from<'a, T, S, R>(
        &self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Call<'a>>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        same_len(send.len(), recv.len())?;
        let key = key::<T>(Collective::AllReduce, recv.len(), op, 0);
        let s = GpuStream::of_cudarc(stream);
        let bytes = recv.num_bytes();
        self.call(
            key,
            Box::new(move |k| {
                with_cudarc_slice_mut(&mut *recv, stream, |out| {
                    with_cudarc_slice(send, stream, |inp| s.copy(out, 0, inp, 0, bytes))??;
                    k(out, &s)
                })?
            }),
        )
    }

    /// The allreduce of nodetour's own buffer (the first `count` elements).
    pub(crate) fn all_reduce_buffer<'a>(
        &self,
        buffer: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let key = Key {
            collective: Collective::AllReduce,
            count,
            dtype,
            op,
            root: 0,
        };
        self.call(key, Box::new(move |k| k(buffer, stream)))
    }

    /// The reduce-scatter of `send` (`world` blocks of `recv.len()`) into `recv`: `send` is
    /// copied into the member's scratch buffer, reduced there in place, and block `seat` copied
    /// out (the input is never written).
    pub(crate) fn reduce_scatter<'a, T, S, R>(
        &self,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Call<'a>>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let n = self.set.contexts.len();
        blocks(send.len(), recv.len(), n)?;
        let key = key::<T>(Collective::ReduceScatter, recv.len(), op, 0);
        let s = GpuStream::of_cudarc(stream);
        let through = self.scatter_through(send.num_bytes(), recv.num_bytes());
        self.call(
            key,
            Box::new(move |k| {
                with_cudarc_slice_mut(&mut *recv, stream, |out| {
                    with_cudarc_slice(send, stream, |inp| through.run(inp, out, &s, k))?
                })?
            }),
        )
    }

    /// [`Self::reduce_scatter`] on device buffers: `send` holds `n` blocks of `count` elements
    /// of `dtype`, `recv` gets block `seat`'s reduction.
    pub(crate) fn reduce_scatter_buffer<'a>(
        &self,
        send: &'a DeviceBuffer,
        recv: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let n = self.set.contexts.len();
        let block = element_bytes(count, 1, dtype)?;
        let whole = element_bytes(count, n, dtype)?;
        let key = Key {
            collective: Collective::ReduceScatter,
            count,
            dtype,
            op,
            root: 0,
        };
        let through = self.scatter_through(whole, block);
        self.call(key, Box::new(move |k| through.run(send, recv, stream, k)))
    }

    fn scatter_through(&self, whole: usize, block: usize) -> ScatterThrough {
        ScatterThrough {
            scratch: self.scratch.clone(),
            context: self.context().clone(),
            seat: self.seat,
            whole,
            block,
        }
    }

    /// The all-gather of `send` into `recv` (`world` blocks of `send.len()`): `send` is copied
    /// into block `seat` of `recv`, then gathered there in place.
    pub(crate) fn all_gather<'a, T, S, R>(
        &self,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Call<'a>>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let n = self.set.contexts.len();
        blocks(recv.len(), send.len(), n)?;
        let key = key::<T>(Collective::AllGather, send.len(), ReduceOp::Sum, 0);
        let s = GpuStream::of_cudarc(stream);
        let (block, seat) = (send.num_bytes(), self.seat);
        self.call(
            key,
            Box::new(move |k| {
                with_cudarc_slice_mut(&mut *recv, stream, |out| {
                    with_cudarc_slice(send, stream, |inp| {
                        s.copy(out, seat * block, inp, 0, block)
                    })??;
                    k(out, &s)
                })?
            }),
        )
    }

    /// The broadcast of member `root`'s `data` into every member's `data`.
    pub(crate) fn broadcast<'a, T, R>(
        &self,
        data: &'a mut R,
        root: usize,
        stream: &'a Arc<CudaStream>,
    ) -> Result<Call<'a>>
    where
        T: Element,
        R: DevicePtrMut<T>,
    {
        let n = self.set.contexts.len();
        if root >= n {
            return Err(Error::InvalidArgument {
                reason: format!("root {root} of a set of {n} GPUs"),
            });
        }
        let key = key::<T>(Collective::Broadcast, data.len(), ReduceOp::Sum, root);
        let s = GpuStream::of_cudarc(stream);
        self.call(
            key,
            Box::new(move |k| with_cudarc_slice_mut(&mut *data, stream, |v| k(v, &s))?),
        )
    }
}

impl SetMember {
    /// [`Self::all_gather`] on device buffers: `send`'s first `count` elements of `dtype` go
    /// to block `seat` of `recv` (`n` blocks), then gathered there in place.
    pub(crate) fn all_gather_buffer<'a>(
        &self,
        send: &'a DeviceBuffer,
        recv: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let block = element_bytes(count, 1, dtype)?;
        element_bytes(count, self.set.contexts.len(), dtype)?;
        let key = Key {
            collective: Collective::AllGather,
            count,
            dtype,
            op: ReduceOp::Sum,
            root: 0,
        };
        let seat = self.seat;
        self.call(
            key,
            Box::new(move |k| {
                stream
                    .copy(recv, seat * block, send, 0, block)
                    .map_err(|e| Error::gpu("copying the block in", e))?;
                k(recv, stream)
            }),
        )
    }

    /// [`Self::broadcast`] on a device buffer: the first `count` elements of `dtype`.
    pub(crate) fn broadcast_buffer<'a>(
        &self,
        data: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        root: usize,
        stream: &'a GpuStream,
    ) -> Result<Call<'a>> {
        let n = self.set.contexts.len();
        if root >= n {
            return Err(Error::InvalidArgument {
                reason: format!("root {root} of a set of {n} GPUs"),
            });
        }
        element_bytes(count, 1, dtype)?;
        let key = Key {
            collective: Collective::Broadcast,
            count,
            dtype,
            op: ReduceOp::Sum,
            root,
        };
        self.call(key, Box::new(move |k| k(data, stream)))
    }
}

/// A member's reduce-scatter out of place: the whole input copied into scratch (the pool's,
/// or under capture the graph's own), reduced there in place, block `seat` copied out, so the
/// input is never written.
struct ScatterThrough {
    scratch: Arc<Mutex<Scratch>>,
    context: Arc<CudaContext>,
    seat: usize,
    /// Bytes of the whole input, and of one block.
    whole: usize,
    block: usize,
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
            s.copy(out, 0, buf, seat * block, block)
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
            }
        })
    }
}

impl SetMember {
    /// The member's timeout (from its options).
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Collectives of several members queued together from one thread, as NCCL's
/// `ncclGroupStart` / `ncclGroupEnd`: each `add` names one member's call (its buffers stay
/// borrowed until [`Group::end`]); `end` queues every collective on every member's stream and
/// returns. Each member's `k`-th call of the group makes the `k`-th collective, so every
/// member must have the same number of calls.
///
/// Built from the communicators of one [`super::Communicator::from_devices`] call.
#[derive(Default)]
pub struct Group<'a> {
    calls: Vec<Call<'a>>,
}

impl<'a> Group<'a> {
    /// An empty group.
    pub fn new() -> Self {
        Group { calls: Vec::new() }
    }

    /// Adds `comm`'s [`Communicator::all_reduce_device_in_place`] to the group.
    pub fn all_reduce_device_in_place<T, R>(
        &mut self,
        comm: &Communicator,
        data: &'a mut R,
        op: ReduceOp,
        stream: &'a Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        R: DevicePtrMut<T>,
    {
        let call = member(comm)?.all_reduce(data, op, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::all_reduce_device`] to the group.
    pub fn all_reduce_device<T, S, R>(
        &mut self,
        comm: &Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let call = member(comm)?.all_reduce_from(send, recv, op, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::all_reduce_device_buffer`] to the group.
    pub fn all_reduce_device_buffer(
        &mut self,
        comm: &Communicator,
        buffer: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &'a GpuStream,
    ) -> Result<()> {
        let call = member(comm)?.all_reduce_buffer(buffer, count, dtype, op, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::reduce_scatter_device`] to the group.
    pub fn reduce_scatter_device<T, S, R>(
        &mut self,
        comm: &Communicator,
        send: &'a S,
        recv: &'a mut R,
        op: ReduceOp,
        stream: &'a Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let call = member(comm)?.reduce_scatter(send, recv, op, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::all_gather_device`] to the group.
    pub fn all_gather_device<T, S, R>(
        &mut self,
        comm: &Communicator,
        send: &'a S,
        recv: &'a mut R,
        stream: &'a Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        S: DevicePtr<T>,
        R: DevicePtrMut<T>,
    {
        let call = member(comm)?.all_gather(send, recv, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::broadcast_device_in_place`] to the group.
    pub fn broadcast_device_in_place<T, R>(
        &mut self,
        comm: &Communicator,
        data: &'a mut R,
        root: u32,
        stream: &'a Arc<CudaStream>,
    ) -> Result<()>
    where
        T: Element,
        R: DevicePtrMut<T>,
    {
        let call = member(comm)?.broadcast(data, root as usize, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::reduce_scatter_device_buffer`] to the group.
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_scatter_device_buffer(
        &mut self,
        comm: &Communicator,
        send: &'a DeviceBuffer,
        recv: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        op: ReduceOp,
        stream: &'a GpuStream,
    ) -> Result<()> {
        let call = member(comm)?.reduce_scatter_buffer(send, recv, count, dtype, op, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::all_gather_device_buffer`] to the group.
    pub fn all_gather_device_buffer(
        &mut self,
        comm: &Communicator,
        send: &'a DeviceBuffer,
        recv: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        stream: &'a GpuStream,
    ) -> Result<()> {
        let call = member(comm)?.all_gather_buffer(send, recv, count, dtype, stream)?;
        self.push(call)
    }

    /// Adds `comm`'s [`Communicator::broadcast_device_buffer`] to the group.
    pub fn broadcast_device_buffer(
        &mut self,
        comm: &Communicator,
        data: &'a DeviceBuffer,
        count: usize,
        dtype: DataType,
        root: u32,
        stream: &'a GpuStream,
    ) -> Result<()> {
        let call = member(comm)?.broadcast_buffer(data, count, dtype, root as usize, stream)?;
        self.push(call)
    }

    fn push(&mut self, call: Call<'a>) -> Result<()> {
        if let Some(first) = self.calls.first()
            && !Arc::ptr_eq(&first.set, &call.set)
        {
            return Err(Error::InvalidArgument {
                reason: "a group holds calls of the communicators of one from_devices set".into(),
            });
        }
        self.calls.push(call);
        Ok(())
    }

    /// Queues every collective of the group, in order, on every member's stream, and returns.
    /// A call missing for some member, or members that disagree, fail the whole group before
    /// anything of that collective is queued.
    pub fn end(self) -> Result<()> {
        let Some(set) = self.calls.first().map(|c| c.set.clone()) else {
            return Ok(());
        };
        let n = set.contexts.len();
        // The common case, one collective with the calls in seat order, as it comes.
        if self.calls.len() == n && self.calls.iter().enumerate().all(|(i, c)| c.seat == i) {
            return run_round(&set, self.calls);
        }
        let mut per_seat: Vec<Vec<Call<'a>>> = (0..n).map(|_| Vec::new()).collect();
        for c in self.calls {
            per_seat[c.seat].push(c);
        }
        let rounds = per_seat[0].len();
        if let Some((seat, calls)) = per_seat.iter().enumerate().find(|(_, c)| c.len() != rounds) {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "a group with {rounds} calls of GPU 0 and {} of GPU {seat}: every GPU of \
                     the set takes part in every collective",
                    calls.len()
                ),
            });
        }
        let mut iters: Vec<_> = per_seat.into_iter().map(|c| c.into_iter()).collect();
        for _ in 0..rounds {
            let round: Vec<Call<'a>> = iters
                .iter_mut()
                .map(|it| it.next().expect("counted"))
                .collect();
            run_round(&set, round)?;
        }
        Ok(())
    }
}

/// Queues one collective: every member's call, in seat order.
fn run_round(set: &DeviceSet, mut round: Vec<Call<'_>>) -> Result<()> {
    if let Some(e) = set.error() {
        return Err(Error::Broken { first: Box::new(e) });
    }
    let keys: Vec<Key> = round.iter().map(|c| c.key).collect();
    let mut lends: Vec<&mut Lend<'_>> = round.iter_mut().map(|c| &mut c.lend).collect();
    nest(&mut lends, Vec::with_capacity(keys.len()), &mut |views| {
        let (v, s): (Vec<&DeviceBuffer>, Vec<&GpuStream>) = views.iter().copied().unzip();
        set.run(&v, &s, &keys)
    })
}

/// Takes the views of every lend in turn, then runs `run` with all of them (each lend's copies
/// in are queued before, its copies out after).
#[allow(clippy::type_complexity)]
fn nest<'v>(
    lends: &mut [&mut Lend<'_>],
    views: Vec<(&'v DeviceBuffer, &'v GpuStream)>,
    run: &mut dyn FnMut(&[(&DeviceBuffer, &GpuStream)]) -> Result<()>,
) -> Result<()> {
    match lends.split_first_mut() {
        None => run(&views),
        Some((first, rest)) => first(&mut |v, s| {
            let mut more: Vec<(&DeviceBuffer, &GpuStream)> = Vec::with_capacity(views.len() + 1);
            more.extend_from_slice(&views);
            more.push((v, s));
            nest(rest, more, run)
        }),
    }
}

fn member(comm: &Communicator) -> Result<&SetMember> {
    comm.member.as_ref().ok_or_else(|| Error::InvalidArgument {
        reason: "a group holds calls of communicators made by from_devices (a communicator of \
                 processes runs its device collectives directly)"
            .into(),
    })
}

fn key<T: Element>(collective: Collective, count: usize, op: ReduceOp, root: usize) -> Key {
    Key {
        collective,
        count,
        dtype: T::DATA_TYPE,
        op,
        root,
    }
}

fn same_len(a: usize, b: usize) -> Result<()> {
    if a != b {
        return Err(Error::InvalidArgument {
            reason: format!("send has {a} elements, recv {b}: they must match"),
        });
    }
    Ok(())
}

fn blocks(whole: usize, block: usize, n: usize) -> Result<()> {
    if (block as u128) * (n as u128) != whole as u128 {
        return Err(Error::InvalidArgument {
            reason: format!("{whole} elements are not {n} blocks of {block}"),
        });
    }
    Ok(())
}

/// Bytes of `blocks` blocks of `count` elements of `dtype`, overflow-checked.
pub(crate) fn element_bytes(count: usize, blocks: usize, dtype: DataType) -> Result<usize> {
    count
        .checked_mul(blocks)
        .and_then(|c| c.checked_mul(dtype.size()))
        .ok_or_else(|| Error::InvalidArgument {
            reason: format!("{blocks} blocks of {count} elements of {dtype:?} overflow"),
        })
}

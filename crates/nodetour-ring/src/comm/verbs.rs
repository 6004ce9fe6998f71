//! The collective verbs: one per collective and its in-place form, on any memory the
//! [`operand`](super::operand) traits accept, and the one place they turn into host, device
//! or device-set work.

use std::cell::Cell;

use super::executor::{DeviceMemory, DeviceOperands, Executor, HostMemory, HostOperands};
use super::operand::{Input, Lent, LentMut, Output, Queue, sealed};
use super::*;
use crate::call::CallSpec;

impl Communicator {
    /// Reduces `send` over every rank into `recv` on every rank (`op`: sum, average, ...).
    /// `send` and `recv` have the same length, here and on every rank.
    ///
    /// On host memory (`Host`) the call returns with the answer in `recv`, the same bits on
    /// every rank. On device memory it is queued on `stream` after the work already there and
    /// returns (a failure after that comes from [`Self::wait`], [`Self::error`] or the next
    /// call); work queued on `stream` afterwards sees the result. [`Self::paths`] says how
    /// device memory travels ([`DevicePath`]).
    ///
    /// ```no_run
    /// # fn demo(comm: &nodetour_ring::comm::Communicator) -> nodetour_ring::Result<()> {
    /// use nodetour_ring::comm::Host;
    /// use nodetour_ring::ReduceOp;
    /// let send = vec![1.0f32; 1024];
    /// let mut recv = vec![0.0f32; 1024];
    /// comm.all_reduce(&send, &mut recv, ReduceOp::Sum, Host)?;
    /// # Ok(()) }
    /// ```
    pub fn all_reduce<Q, S, R>(&self, send: &S, recv: &mut R, op: ReduceOp, queue: Q) -> Result<()>
    where
        Q: Queue,
        S: Input<Q> + ?Sized,
        R: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let dtype = same_type(send, recv)?;
            let n = sealed::Input::count(recv);
            same_len(sealed::Input::count(send), n, "send", "recv")?;
            let call = CallSpec::all_reduce(n, dtype, op).checked(self.world())?;
            lend_both(send, recv, queue, |inp, out| {
                self.verb(reached, call, Some(inp), out)
            })
        })
    }

    /// [`Self::all_reduce`] with `data` as both input and output.
    ///
    /// ```no_run
    /// # fn demo(
    /// #     comm: &nodetour_ring::comm::Communicator,
    /// #     grads: &mut cudarc::driver::CudaSlice<f32>,
    /// #     stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    /// # ) -> nodetour_ring::Result<()> {
    /// use nodetour_ring::ReduceOp;
    /// comm.all_reduce_in_place(grads, ReduceOp::Avg, stream)?;
    /// # Ok(()) }
    /// ```
    pub fn all_reduce_in_place<Q, D>(&self, data: &mut D, op: ReduceOp, queue: Q) -> Result<()>
    where
        Q: Queue,
        D: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let (n, dtype) = (sealed::Input::count(data), sealed::Input::dtype(data));
            let call = CallSpec::all_reduce(n, dtype, op).checked(self.world())?;
            data.lend_mut(queue, |out| self.verb(reached, call, None, out))
        })
    }

    /// Reduces `send` (`world` blocks of `recv`'s length, block `r` for rank `r`) over every
    /// rank, leaving block `rank` of the result in `recv`; `send` is never written.
    pub fn reduce_scatter<Q, S, R>(
        &self,
        send: &S,
        recv: &mut R,
        op: ReduceOp,
        queue: Q,
    ) -> Result<()>
    where
        Q: Queue,
        S: Input<Q> + ?Sized,
        R: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let dtype = same_type(send, recv)?;
            let n = sealed::Input::count(recv);
            self.blocks(sealed::Input::count(send), n, "send", "recv")?;
            let call = CallSpec::reduce_scatter(n, dtype, op).checked(self.world())?;
            lend_both(send, recv, queue, |inp, out| {
                self.verb(reached, call, Some(inp), out)
            })
        })
    }

    /// [`Self::reduce_scatter`] in one buffer of `world` blocks: block `rank` ends with this
    /// rank's result (what the other blocks hold after it is undefined).
    pub fn reduce_scatter_in_place<Q, D>(&self, data: &mut D, op: ReduceOp, queue: Q) -> Result<()>
    where
        Q: Queue,
        D: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let n = self.block_of(sealed::Input::count(data))?;
            let dtype = sealed::Input::dtype(data);
            let call = CallSpec::reduce_scatter(n, dtype, op).checked(self.world())?;
            data.lend_mut(queue, |out| self.verb(reached, call, None, out))
        })
    }

    /// Gathers every rank's `send` into `recv` (`world` blocks of `send`'s length, block `r`
    /// from rank `r`) on every rank.
    pub fn all_gather<Q, S, R>(&self, send: &S, recv: &mut R, queue: Q) -> Result<()>
    where
        Q: Queue,
        S: Input<Q> + ?Sized,
        R: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let dtype = same_type(send, recv)?;
            let n = sealed::Input::count(send);
            self.blocks(sealed::Input::count(recv), n, "recv", "send")?;
            let call = CallSpec::all_gather(n, dtype).checked(self.world())?;
            lend_both(send, recv, queue, |inp, out| {
                self.verb(reached, call, Some(inp), out)
            })
        })
    }

    /// [`Self::all_gather`] in one buffer of `world` blocks, this rank's input in block `rank`.
    pub fn all_gather_in_place<Q, D>(&self, data: &mut D, queue: Q) -> Result<()>
    where
        Q: Queue,
        D: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let n = self.block_of(sealed::Input::count(data))?;
            let dtype = sealed::Input::dtype(data);
            let call = CallSpec::all_gather(n, dtype).checked(self.world())?;
            data.lend_mut(queue, |out| self.verb(reached, call, None, out))
        })
    }

    /// Copies rank `root`'s `send` into `recv` on every rank. `send` is read on the root only
    /// (it must have `recv`'s length there; elsewhere an empty one will do).
    pub fn broadcast<Q, S, R>(&self, send: &S, recv: &mut R, root: u32, queue: Q) -> Result<()>
    where
        Q: Queue,
        S: Input<Q> + ?Sized,
        R: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let n = sealed::Input::count(recv);
            let dtype = sealed::Input::dtype(recv);
            let call = CallSpec::broadcast(n, dtype, root).checked(self.world())?;
            if self.rank() == root {
                same_type(send, recv)?;
                same_len(sealed::Input::count(send), n, "send", "recv")?;
            }
            lend_both(send, recv, queue, |inp, out| {
                self.verb(reached, call, Some(inp), out)
            })
        })
    }

    /// [`Self::broadcast`] of rank `root`'s `data` into `data` on every rank.
    pub fn broadcast_in_place<Q, D>(&self, data: &mut D, root: u32, queue: Q) -> Result<()>
    where
        Q: Queue,
        D: Output<Q> + ?Sized,
    {
        self.guarded(queue, |reached| {
            let (n, dtype) = (sealed::Input::count(data), sealed::Input::dtype(data));
            let call = CallSpec::broadcast(n, dtype, root).checked(self.world())?;
            data.lend_mut(queue, |out| self.verb(reached, call, None, out))
        })
    }

    /// Runs `call` (checked) on what the operands lent, through the executor of that memory
    /// (`executor`): host memory, device memory of a process's communicator, or a member of
    /// a GPU set.
    fn verb(
        &self,
        reached: &Cell<bool>,
        call: CallSpec,
        send: Option<Lent<'_>>,
        out: LentMut<'_>,
    ) -> Result<()> {
        match out {
            LentMut::Host(out) => {
                let send = match send {
                    None => None,
                    Some(Lent::Host(b)) => Some(b),
                    Some(Lent::Device(..)) => return Err(mixed()),
                };
                HostMemory(&self.engine).run(call, HostOperands { send, out })
            }
            LentMut::Symmetric(buffer, stream) => {
                // Never a set's meeting turn (on a member the buffer is another communicator's,
                // refused below): nothing to cancel.
                reached.set(true);
                match (call.kind, send) {
                    (Collective::AllReduce, None) => {
                        let mine = [Some(&self.engine), self.device.engine()];
                        let Some(engine) = mine.into_iter().flatten().find(|e| buffer.of(e)) else {
                            return Err(Error::InvalidArgument {
                                reason: "a symmetric buffer of another communicator".into(),
                            });
                        };
                        engine.all_reduce_symmetric(buffer, &call, stream)
                    }
                    _ => Err(Error::Unsupported {
                        reason: "a symmetric buffer takes the in-place allreduce only".into(),
                    }),
                }
            }
            LentMut::Device(out, stream) => {
                let send = match send {
                    None => None,
                    Some(Lent::Device(b, _)) => Some(b),
                    Some(Lent::Host(_)) => return Err(mixed()),
                };
                match &self.member {
                    Some(m) => {
                        // From here the member itself cancels what it refuses.
                        reached.set(true);
                        let called = Cell::new(false);
                        self.engine
                            .in_call_order(stream, |lane| {
                                called.set(true);
                                m.run(
                                    call,
                                    DeviceOperands {
                                        send,
                                        out,
                                        stream: lane,
                                    },
                                )
                            })
                            .inspect_err(|e| {
                                // Refused before the member's share: nobody else waits for it.
                                if !called.get() {
                                    m.set.meeting.cancel(m.seat, &e.to_string());
                                }
                            })
                    }
                    None => {
                        let comm = self.on_device(stream)?;
                        comm.in_call_order(stream, |lane| {
                            DeviceMemory(comm).run(
                                call,
                                DeviceOperands {
                                    send,
                                    out,
                                    stream: lane,
                                },
                            )
                        })
                    }
                }
            }
        }
    }
}

impl Engine {
    /// Host memory (`executor::HostMemory`): runs `call` synchronously (the answer is in `out`
    /// on return).
    pub(super) fn host_verb(
        &self,
        call: CallSpec,
        send: Option<&[u8]>,
        out: &mut [u8],
    ) -> Result<()> {
        let (n, dtype, op) = (call.count, call.dtype, call.op);
        match call.kind {
            Collective::AllReduce => self.all_reduce_bytes(send, out, dtype, op),
            Collective::ReduceScatter => {
                let out_at = if send.is_some() {
                    0
                } else {
                    self.rank as usize * n
                };
                self.reduce_scatter_into(send, out, n, out_at, dtype, op)
            }
            Collective::AllGather => self.all_gather_into(send, out, n, dtype),
            Collective::Broadcast => self.broadcast_into(send, out, call.root, dtype),
        }
    }
}

impl Communicator {
    /// Runs a verb's body; for a member of a GPU set, a failure of a device call before it
    /// reached the member's meeting (`reached` still false: an argument refused, a lend that
    /// failed) cancels that collective for the other members, who would otherwise wait for it.
    /// Host memory and symmetric buffers are refused on a member without a meeting's turn: the
    /// other members call nothing to pair with them, so their refusal cancels nothing.
    fn guarded<Q: Queue>(
        &self,
        queue: Q,
        body: impl FnOnce(&Cell<bool>) -> Result<()>,
    ) -> Result<()> {
        let reached = Cell::new(sealed::Queue::is_host(&queue));
        let result = body(&reached);
        if let (Err(e), Some(m), false) = (&result, &self.member, reached.get()) {
            m.set.meeting.cancel(m.seat, &e.to_string());
        }
        result
    }
}

/// Lends `send` and then `recv` on `queue`, and runs `f` with both.
fn lend_both<Q, S, R, T>(
    send: &S,
    recv: &mut R,
    queue: Q,
    f: impl FnOnce(Lent<'_>, LentMut<'_>) -> Result<T>,
) -> Result<T>
where
    Q: Queue,
    S: Input<Q> + ?Sized,
    R: Output<Q> + ?Sized,
{
    recv.lend_mut(queue, |out| send.lend(queue, |inp| f(inp, out)))
}

fn same_type<Q, S, R>(send: &S, recv: &R) -> Result<DataType>
where
    S: sealed::Input<Q> + ?Sized,
    R: sealed::Input<Q> + ?Sized,
{
    let (s, r) = (send.dtype(), recv.dtype());
    if s != r {
        return Err(Error::InvalidArgument {
            reason: format!("send holds {s:?}, recv {r:?}: they must match"),
        });
    }
    Ok(r)
}

fn mixed() -> Error {
    Error::InvalidArgument {
        reason: "send and recv on different kinds of memory".into(),
    }
}

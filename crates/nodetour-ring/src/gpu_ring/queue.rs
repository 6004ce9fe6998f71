//! Queueing one ring collective on the send and receive streams: the descriptor cells, the
//! guarded hand-offs of each chunk, and the events that order the streams.

use super::*;

impl GpuRing {
    /// Whether a collective may be queued: the ring is open, not aborted, no neighbour ended it
    /// since the last call, and no one-kernel collective (a graph replay's, which no wait saw)
    /// failed.
    pub(super) fn ready_to_queue(&mut self) -> Result<()> {
        if let Some(e) = self.abort.error() {
            return Err(e);
        }
        if self.held.is_none() {
            return Err(Error::Aborted {
                reason: "the ring was closed".into(),
            });
        }
        if let Some((e, _)) = self.abort.read_notice(self.queued, self.captured()) {
            self.abort.abort_with(e.clone());
            return Err(e);
        }
        if let Some(e) = self.one_kernel_failure().or_else(|| self.guard_timeout()) {
            self.abort.abort_with(e.clone());
            return Err(e);
        }
        Ok(())
    }

    /// Queues `prog` on the send and receive streams between the caller's `stream` and back.
    /// Every flag value is relative to the streams' guard counters (see
    /// `nodetour_core::transport::gpu::Counted`), which each stream advances at its end of the
    /// collective: so `capturing` (into a CUDA graph) changes only which events order the
    /// streams; each replay is then the next collective.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue(
        &mut self,
        buffer: &DeviceBuffer,
        call: &RingCall,
        stream: &GpuStream,
        steps: u32,
        prog: &StreamProgram,
        desc: ((u32, u32), u32),
        capturing: bool,
        replayable: Replayable,
    ) -> Result<()> {
        let (sends, recvs) = (&prog.sends, &prog.recvs);
        let context = self.context.clone();
        let marks = if capturing {
            &mut self.capture_marks
        } else {
            &mut self.marks
        };
        marks
            .grow(&context, sends.len(), recvs.len())
            .map_err(queueing)?;
        let marks = if capturing {
            &self.capture_marks
        } else {
            &self.marks
        };
        let h = self.held.as_ref().expect("checked by the caller");
        let links = h.links.as_ref().expect("checked by the caller");
        let slots = links.slots;
        let q = Queueing {
            h,
            links,
            marks,
            guards: h.guards.as_ref().expect("a ring with links has guards"),
            buffer,
            call,
            world: self.world,
            // Values relative to where the collective's counters start (the guards add theirs).
            start: (prog.start.sent as u32, prog.start.received as u32),
            align: (
                if replayable.send { slots } else { 1 },
                if replayable.recv { slots } else { 1 },
            ),
            tell: FlagValue::cell(&*links.ends.next, desc.0.0, desc.0.1, desc.1),
            desc,
            // A PreMulSum multiplies this rank's own values where they are first read: by the
            // sends that carry nothing received (the ring's first step, every send of an
            // exchange), and by the receives that reduce into the buffer; the stream program
            // reads each element so exactly once (its tests).
            premul: NtScale::of(call.op).map(|scale| PreMul {
                dtype: call.dtype,
                scale,
            }),
        };
        q.begin(stream, sends.is_empty())?;
        // Step by step, so that every marker wait is queued after the record it refers to.
        let (mut si, mut ri) = (0, 0);
        for step in 0..steps {
            while let Some(s) = sends.get(si).filter(|s| s.step == step) {
                q.send(si, s)?;
                si += 1;
            }
            while let Some(r) = recvs.get(ri).filter(|r| r.step == step) {
                q.recv(ri, r)?;
                ri += 1;
            }
        }
        q.end(stream, sends.len(), recvs.len())
    }
}

/// A CUDA call queueing a ring collective failed.
fn queueing(e: nodetour_core::Error) -> Error {
    Error::gpu("queueing the collective", e)
}

/// One ring collective being queued: what the hand-off of each of its chunks reads.
struct Queueing<'a> {
    h: &'a Held,
    links: &'a StreamLinks,
    marks: &'a Marks,
    /// The send and receive streams' guards.
    guards: &'a [StreamGuard; 2],
    buffer: &'a DeviceBuffer,
    call: &'a RingCall,
    world: u32,
    /// The send and receive chunk counters where the collective starts, and what each
    /// rounds up to on the GPU.
    start: (u32, u32),
    align: (u32, u32),
    /// What the send stream tells the next rank: this collective's descriptor word.
    tell: FlagValue<'a>,
    /// The descriptor's cells and word.
    desc: ((u32, u32), u32),
    premul: Option<PreMul>,
}

impl<'a> Queueing<'a> {
    fn on_send(&self) -> Guarded<'a> {
        Guarded {
            stream: &self.h.send,
            kernels: &self.h.kernels,
            guard: &self.guards[0],
        }
    }

    fn on_recv(&self) -> Guarded<'a> {
        Guarded {
            stream: &self.h.recv,
            kernels: &self.h.kernels,
            guard: &self.guards[1],
        }
    }

    /// Both streams after the work queued on the caller's `stream`, each claiming its guard
    /// for this collective (released by its advance in [`Self::end`]): a graph replay that
    /// runs beside another collective of this rank stops the rank rather than share the
    /// guards' counters.
    ///
    /// Agreement before anything is used: the send stream tells the next rank what this
    /// collective is just before its first chunk's ready flag (so the next rank's wait for it
    /// costs no extra hand-off), and the receive stream reads no chunk of the previous rank's
    /// before it said the same (see [`Self::recv`]). A rank that sends nothing (`silent`)
    /// says it here. Every hand-off is guarded by the stop word (see the module's doc).
    fn begin(&self, stream: &GpuStream, silent: bool) -> Result<()> {
        let h = self.h;
        stream.record_marker(&self.marks.start).map_err(queueing)?;
        h.send.wait_marker(&self.marks.start).map_err(queueing)?;
        h.recv.wait_marker(&self.marks.start).map_err(queueing)?;
        self.guards[0]
            .enqueue_claim(&h.send, &h.kernels)
            .map_err(queueing)?;
        self.guards[1]
            .enqueue_claim(&h.recv, &h.kernels)
            .map_err(queueing)?;
        if silent {
            enqueue_wait(self.on_send(), None, false, None).map_err(queueing)?;
            enqueue_signal(self.on_send(), self.tell, None).map_err(queueing)?;
        }
        Ok(())
    }

    /// Queues send `si`: wait for the slot's credit (or, for a slot never used, only read the
    /// stop word), then one kernel copies and stores the ready flag (the first chunk's
    /// carries the descriptor word just before it).
    fn send(&self, si: usize, s: &SendOp) -> Result<()> {
        let (h, links) = (self.h, self.links);
        if let Some(j) = s.after_recv {
            h.send.wait_marker(&self.marks.recvs[j]).map_err(queueing)?;
        }
        let size = self.call.dtype.size();
        let off = s.elements.start as usize * size;
        let len = (s.elements.end - s.elements.start) as usize * size;
        let at = s.slot as usize * links.slot_bytes;
        let (s0, align) = (self.start.0, self.align.0);
        let ready = FlagValue::chunks(
            &*links.next_flags,
            flag::READY,
            s.ready.wrapping_sub(s0),
            align,
        );
        let credit = s.wait_released.map(|v| {
            FlagValue::chunks(
                &*links.flags as &dyn FlagPage,
                flag::RELEASED,
                v.wrapping_sub(s0),
                align,
            )
        });
        let on = self.on_send();
        enqueue_wait(on, credit, false, None).map_err(queueing)?;
        let (first, second) = if si == 0 {
            (self.tell, Some(ready))
        } else {
            (ready, None)
        };
        let src = At::new(self.buffer, off);
        let premul = self.premul.filter(|_| s.after_recv.is_none());
        match &links.outgoing {
            Outgoing::CudaIpc(o) => {
                o.enqueue_send(on, src, at as u64, len, (first, second), premul)
            }
            staged => {
                let o: &dyn StagedSend = match staged {
                    Outgoing::Shm(o) => o,
                    Outgoing::Net(o) => o,
                    Outgoing::CudaIpc(_) => unreachable!("matched above"),
                };
                o.enqueue_send(on, src, at, len, (first, second), premul)
            }
        }
        .map_err(queueing)?;
        h.send
            .record_marker(&self.marks.sends[si])
            .map_err(queueing)
    }

    /// Queues receive `ri`. Nothing of the previous rank's lands in this rank's buffer before
    /// it has said it calls the same collective: the first receive waits for its descriptor
    /// word too.
    fn recv(&self, ri: usize, r: &RecvOp) -> Result<()> {
        let (h, links) = (self.h, self.links);
        if let Some(i) = r.after_send {
            h.recv.wait_marker(&self.marks.sends[i]).map_err(queueing)?;
        }
        let (r0, align) = (self.start.1, self.align.1);
        let ready = FlagValue::chunks(
            &*links.flags,
            flag::READY,
            r.wait_ready.wrapping_sub(r0),
            align,
        );
        let ((c0, c1), word) = self.desc;
        let on = self.on_recv();
        match (ri == 0).then(|| FlagValue::cell(&*links.ends.mine, c0, c1, word)) {
            Some(d) => enqueue_wait(on, Some(d), true, Some(ready)),
            None => enqueue_wait(on, Some(ready), false, None),
        }
        .map_err(queueing)?;
        // Credit back to the previous rank (skipped when the wait ended on the stop word: what
        // an aborted rank's streams write is only its own memory).
        let credit = FlagValue::chunks(
            &*links.prev_flags,
            flag::RELEASED,
            r.released.wrapping_sub(r0),
            align,
        );
        let gpu_slots: Option<&DeviceBuffer> = match &links.incoming {
            Incoming::CudaIpc(slot) => Some(slot.buffer()),
            Incoming::NetGpu(slot) => Some(slot.buffer()),
            Incoming::NetDirect(slots) => slots.region().device_buffer(),
            _ => None,
        };
        match gpu_slots {
            Some(slots) => self.recv_from_gpu(r, slots, credit)?,
            None => self.recv_staged(r, credit)?,
        }
        h.recv
            .record_marker(&self.marks.recvs[ri])
            .map_err(queueing)
    }

    /// Receive `r` out of slots in this GPU's memory (cuda-ipc, or a network link landing
    /// there), crediting the slot with `credit`.
    fn recv_from_gpu(&self, r: &RecvOp, slots: &DeviceBuffer, credit: FlagValue<'_>) -> Result<()> {
        let (on, s) = (self.on_recv(), &self.h.recv);
        let (off, n, at) = self.chunk(r);
        let bytes = n * self.call.dtype.size();
        let src = ChunkSource::Gpu(slots, at);
        match r.kind {
            RecvKind::Reduce { average } => {
                let dst = At::new(self.buffer, off);
                enqueue_reduce_then_signal(on, self.reduction(), dst, src, n, credit)
                    .map_err(queueing)?;
                self.divide(average, off, n)
            }
            RecvKind::Copy if bytes <= self.links.copy_kernel_max => {
                enqueue_copy_then_signal(on, At::new(self.buffer, off), src, bytes, credit)
                    .map_err(queueing)
            }
            RecvKind::Copy => {
                s.copy(self.buffer, off, slots, at, bytes)
                    .map_err(queueing)?;
                enqueue_signal(on, credit, None).map_err(queueing)
            }
        }
    }

    /// Receive `r` out of host slots (shm, or a network link landing in host memory),
    /// crediting the slot with `credit`: small reductions read the slot over PCIe in one
    /// kernel, the rest copy it in first.
    fn recv_staged(&self, r: &RecvOp, credit: FlagValue<'_>) -> Result<()> {
        let (on, s) = (self.on_recv(), &self.h.recv);
        let (slots, scratch): (&dyn StagedReceive, &DeviceBuffer) = match &self.links.incoming {
            Incoming::Shm { slots, scratch } => (slots, scratch),
            Incoming::Net { slots, scratch } => (slots, scratch),
            Incoming::CudaIpc(_) | Incoming::NetGpu(_) | Incoming::NetDirect(_) => {
                unreachable!("taken by recv_from_gpu (direct slots are checked GPU memory)")
            }
        };
        let (off, n, at) = self.chunk(r);
        let bytes = n * self.call.dtype.size();
        let dst = At::new(self.buffer, off);
        match r.kind {
            RecvKind::Reduce { average } if bytes <= self.links.host_read_max => {
                // One kernel reads the slot over PCIe, reduces, and credits the slot.
                let src = ChunkSource::Slots(slots, at);
                enqueue_reduce_then_signal(on, self.reduction(), dst, src, n, credit)
                    .map_err(queueing)?;
                self.divide(average, off, n)
            }
            RecvKind::Reduce { average } => {
                slots
                    .enqueue_copy_out(s, scratch, 0, at, bytes)
                    .map_err(queueing)?;
                enqueue_signal(on, credit, None).map_err(queueing)?;
                self.h
                    .kernels
                    .reduce(s, self.reduction(), dst, At::new(scratch, 0), n)
                    .map_err(queueing)?;
                self.divide(average, off, n)
            }
            RecvKind::Copy => {
                slots
                    .enqueue_copy_out(s, self.buffer, off, at, bytes)
                    .map_err(queueing)?;
                enqueue_signal(on, credit, None).map_err(queueing)
            }
        }
    }

    /// Receive `r`'s byte offset in the buffer, its elements, and its slot's byte offset.
    fn chunk(&self, r: &RecvOp) -> (usize, usize, usize) {
        let off = r.elements.start as usize * self.call.dtype.size();
        let n = (r.elements.end - r.elements.start) as usize;
        (off, n, r.slot as usize * self.links.slot_bytes)
    }

    fn reduction(&self) -> Reduction {
        Reduction {
            dtype: self.call.dtype,
            op: self.call.op,
        }
    }

    /// The last reduce-scatter step of an average divides the `n` elements at byte `off` it
    /// reduced.
    fn divide(&self, average: bool, off: usize, n: usize) -> Result<()> {
        if !average {
            return Ok(());
        }
        self.h
            .kernels
            .average(
                &self.h.recv,
                self.call.dtype,
                self.buffer,
                off,
                n,
                self.world,
            )
            .map_err(queueing)
    }

    /// Each stream's end of the collective: its counters move past it (for the next
    /// collective, or the next replay); the caller's `stream` waits for both.
    fn end(&self, stream: &GpuStream, sends: usize, recvs: usize) -> Result<()> {
        let h = self.h;
        let chunks = |n: usize| {
            u32::try_from(n).map_err(|_| Error::InvalidArgument {
                reason: format!("{n} chunks in one collective"),
            })
        };
        self.guards[0]
            .enqueue_advance(&h.send, &h.kernels, self.align.0, chunks(sends)?)
            .map_err(queueing)?;
        self.guards[1]
            .enqueue_advance(&h.recv, &h.kernels, self.align.1, chunks(recvs)?)
            .map_err(queueing)?;
        h.send.record_marker(&self.marks.end[0]).map_err(queueing)?;
        h.recv.record_marker(&self.marks.end[1]).map_err(queueing)?;
        stream.wait_marker(&self.marks.end[0]).map_err(queueing)?;
        stream.wait_marker(&self.marks.end[1]).map_err(queueing)
    }
}

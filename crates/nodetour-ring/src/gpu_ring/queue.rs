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
        dtype: DataType,
        op: ReduceOp,
        stream: &GpuStream,
        steps: u32,
        prog: &StreamProgram,
        (cells, desc_value): ((u32, u32), u32),
        capturing: bool,
        replayable: Replayable,
    ) -> Result<()> {
        let (sends, recvs) = (&prog.sends, &prog.recvs);
        let g = |e| Error::gpu("queueing the collective", e);
        let context = self.context.clone();
        let marks = if capturing {
            &mut self.capture_marks
        } else {
            &mut self.marks
        };
        marks.grow(&context, sends.len(), recvs.len()).map_err(g)?;
        let marks = if capturing {
            &self.capture_marks
        } else {
            &self.marks
        };
        let h = self.held.as_ref().expect("checked by the caller");
        let links = h.links.as_ref().expect("checked by the caller");
        let kernels = &h.kernels;
        let [send_guard, recv_guard] = h.guards.as_ref().expect("a ring with links has guards");
        let slots = links.slots;
        let (send_align, recv_align) = (
            if replayable.send { slots } else { 1 },
            if replayable.recv { slots } else { 1 },
        );
        // Values relative to where the collective's counters start (the guards add theirs).
        let (s0, r0) = (prog.start.sent as u32, prog.start.received as u32);
        stream.record_marker(&marks.start).map_err(g)?;
        h.send.wait_marker(&marks.start).map_err(g)?;
        h.recv.wait_marker(&marks.start).map_err(g)?;
        // Each stream claims its guard for this collective (released by its advance below): a
        // graph replay that runs beside another collective of this rank stops the rank rather
        // than share the guards' counters.
        send_guard.enqueue_claim(&h.send, kernels).map_err(g)?;
        recv_guard.enqueue_claim(&h.recv, kernels).map_err(g)?;
        // Agreement before anything is used: the send stream tells the next rank what this
        // collective is just before its first chunk's ready flag (so the next rank's wait for
        // it costs no extra hand-off), and the receive stream reads no chunk of the previous
        // rank's before it said the same (see queue_recv). A rank that sends nothing says it
        // at the start. Every hand-off is guarded by the stop word (see the module's doc).
        let tell = FlagValue::cell(&*links.ends.next, cells.0, cells.1, desc_value);
        if sends.is_empty() {
            let on = Guarded {
                stream: &h.send,
                kernels,
                guard: send_guard,
            };
            enqueue_wait(on, None, false, None).map_err(g)?;
            enqueue_signal(on, tell, None).map_err(g)?;
        }
        let size = dtype.size();
        // A PreMulSum multiplies this rank's own values where they are first read: by the
        // sends that carry nothing received (the ring's first step, every send of an
        // exchange), and by the receives that reduce into the buffer (`queue_recv`); the
        // stream program reads each element so exactly once (its tests).
        let premul = NtScale::of(op).map(|scale| PreMul { dtype, scale });
        let slot_at = |slot: u32| slot as usize * links.slot_bytes;
        // Step by step, so that every marker wait is queued after the record it refers to.
        let (mut si, mut ri) = (0, 0);
        for step in 0..steps {
            while let Some(s) = sends.get(si).filter(|s| s.step == step) {
                if let Some(j) = s.after_recv {
                    h.send.wait_marker(&marks.recvs[j]).map_err(g)?;
                }
                let send = &h.send;
                let off = s.elements.start as usize * size;
                let len = (s.elements.end - s.elements.start) as usize * size;
                let at = slot_at(s.slot);
                let ready = FlagValue::chunks(
                    &*links.next_flags,
                    flag::READY,
                    s.ready.wrapping_sub(s0),
                    send_align,
                );
                // Wait for the slot's credit (or, for a slot never used, only read the stop
                // word), then one kernel copies and stores the ready flag (the first chunk's
                // carries the descriptor word just before it).
                let credit = s.wait_released.map(|v| {
                    FlagValue::chunks(
                        &*links.flags as &dyn FlagPage,
                        flag::RELEASED,
                        v.wrapping_sub(s0),
                        send_align,
                    )
                });
                let on = Guarded {
                    stream: send,
                    kernels,
                    guard: send_guard,
                };
                enqueue_wait(on, credit, false, None).map_err(g)?;
                let (first, second) = if si == 0 {
                    (tell, Some(ready))
                } else {
                    (ready, None)
                };
                let src = At::new(buffer, off);
                let premul = premul.filter(|_| s.after_recv.is_none());
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
                .map_err(g)?;
                send.record_marker(&marks.sends[si]).map_err(g)?;
                si += 1;
            }
            while let Some(r) = recvs.get(ri).filter(|r| r.step == step) {
                // Nothing of the previous rank's lands in this rank's buffer before it has said
                // it calls the same collective: the first receive waits for its descriptor word
                // too.
                let desc = (ri == 0)
                    .then(|| FlagValue::cell(&*links.ends.mine, cells.0, cells.1, desc_value));
                self.queue_recv(links, r, buffer, dtype, op, desc, marks, (r0, recv_align))?;
                h.recv.record_marker(&marks.recvs[ri]).map_err(g)?;
                ri += 1;
            }
        }
        // Each stream's end of the collective: its counters move past it (for the next
        // collective, or the next replay).
        let chunks = |n: usize| {
            u32::try_from(n).map_err(|_| Error::InvalidArgument {
                reason: format!("{n} chunks in one collective"),
            })
        };
        send_guard
            .enqueue_advance(&h.send, kernels, send_align, chunks(sends.len())?)
            .map_err(g)?;
        recv_guard
            .enqueue_advance(&h.recv, kernels, recv_align, chunks(recvs.len())?)
            .map_err(g)?;
        h.send.record_marker(&marks.end[0]).map_err(g)?;
        h.recv.record_marker(&marks.end[1]).map_err(g)?;
        stream.wait_marker(&marks.end[0]).map_err(g)?;
        stream.wait_marker(&marks.end[1]).map_err(g)
    }

    /// Queues receive `r` (values relative to `r0`, the guard's chunk counter rounded up to
    /// `align` added on the GPU).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue_recv(
        &self,
        links: &StreamLinks,
        r: &RecvOp,
        buffer: &DeviceBuffer,
        dtype: DataType,
        op: ReduceOp,
        desc: Option<FlagValue>,
        marks: &Marks,
        (r0, align): (u32, u32),
    ) -> Result<()> {
        let g = |e| Error::gpu("queueing the collective", e);
        let s = &self.h().recv;
        let kernels = &self.h().kernels;
        let [_, guard] = self
            .h()
            .guards
            .as_ref()
            .expect("a ring with links has guards");
        let size = dtype.size();
        if let Some(i) = r.after_send {
            s.wait_marker(&marks.sends[i]).map_err(g)?;
        }
        let ready = FlagValue::chunks(
            &*links.flags,
            flag::READY,
            r.wait_ready.wrapping_sub(r0),
            align,
        );
        let on = Guarded {
            stream: s,
            kernels,
            guard,
        };
        match desc {
            Some(d) => enqueue_wait(on, Some(d), true, Some(ready)),
            None => enqueue_wait(on, Some(ready), false, None),
        }
        .map_err(g)?;
        let off = r.elements.start as usize * size;
        let n = (r.elements.end - r.elements.start) as usize;
        let at = r.slot as usize * links.slot_bytes;
        // Credit back to the previous rank (skipped when the wait ended on the stop word: what
        // an aborted rank's streams write is only its own memory).
        let credit = FlagValue::chunks(
            &*links.prev_flags,
            flag::RELEASED,
            r.released.wrapping_sub(r0),
            align,
        );
        let release = |s: &GpuStream| {
            let on = Guarded {
                stream: s,
                kernels,
                guard,
            };
            enqueue_signal(on, credit, None).map_err(g)
        };
        // The last reduce-scatter step of an average divides what it reduced.
        let divide = |average: bool| {
            if !average {
                return Ok(());
            }
            kernels
                .average(s, dtype, buffer, off, n, self.world)
                .map_err(g)
        };
        let gpu_slots: Option<&DeviceBuffer> = match &links.incoming {
            Incoming::CudaIpc(slot) => Some(slot.buffer()),
            Incoming::NetGpu(slot) => Some(slot.buffer()),
            Incoming::NetDirect(slots) => slots.region().device_buffer(),
            _ => None,
        };
        match (gpu_slots, &links.incoming, r.kind) {
            (Some(src), _, RecvKind::Reduce { average }) => {
                let src = ChunkSource::Gpu(src, at);
                enqueue_reduce_then_signal(
                    on,
                    Reduction { dtype, op },
                    At::new(buffer, off),
                    src,
                    n,
                    credit,
                )
                .map_err(g)?;
                divide(average)?;
            }
            (Some(src), _, RecvKind::Copy) if n * size <= links.copy_kernel_max => {
                let src = ChunkSource::Gpu(src, at);
                enqueue_copy_then_signal(on, At::new(buffer, off), src, n * size, credit)
                    .map_err(g)?;
            }
            (Some(src), _, RecvKind::Copy) => {
                s.copy(buffer, off, src, at, n * size).map_err(g)?;
                release(s)?;
            }
            (None, staged, kind) => {
                let (slots, scratch): (&dyn StagedReceive, &DeviceBuffer) = match staged {
                    Incoming::Shm { slots, scratch } => (slots, scratch),
                    Incoming::Net { slots, scratch } => (slots, scratch),
                    Incoming::CudaIpc(_) | Incoming::NetGpu(_) | Incoming::NetDirect(_) => {
                        unreachable!("matched above (direct slots are checked GPU memory)")
                    }
                };
                match kind {
                    RecvKind::Reduce { average } if n * size <= links.host_read_max => {
                        // One kernel reads the slot over PCIe, reduces, and credits the slot.
                        let src = ChunkSource::Slots(slots, at);
                        let r = Reduction { dtype, op };
                        enqueue_reduce_then_signal(on, r, At::new(buffer, off), src, n, credit)
                            .map_err(g)?;
                        divide(average)?;
                    }
                    RecvKind::Reduce { average } => {
                        slots
                            .enqueue_copy_out(s, scratch, 0, at, n * size)
                            .map_err(g)?;
                        release(s)?;
                        kernels
                            .reduce(
                                s,
                                Reduction { dtype, op },
                                At::new(buffer, off),
                                At::new(scratch, 0),
                                n,
                            )
                            .map_err(g)?;
                        divide(average)?;
                    }
                    RecvKind::Copy => {
                        slots
                            .enqueue_copy_out(s, buffer, off, at, n * size)
                            .map_err(g)?;
                        release(s)?;
                    }
                }
            }
        }
        Ok(())
    }
}

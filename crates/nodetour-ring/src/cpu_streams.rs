//! A CPU executor of the stream program (tests only): one rank of a ring whose two "streams"
//! are host threads performing the program's waits, copies, reductions and stores on host
//! memory, exactly as the GPU ring queues them on CUDA streams, with its links to the
//! neighbours through [`crate::net_link`]. With it the whole network ring, progress threads
//! included, runs without a GPU (CI) over the real transports (tcp, the in-process one; verbs in
//! the soft-RoCE VM).
//!
//! The guarded semantics of the GPU ring hold: a wait ends when its word is reached or when the
//! rank's stop word is set; after a stop, nothing is written into memory the peers read (the
//! outboxes' counters, the send slots' contents are not published), so an aborted rank only
//! drains.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nodetour_core::transport::SlotRegion;

use crate::error::{Error, Result};
use crate::flag;
use crate::net_link::{CELL, NetLink, WordPage};
use crate::plan::{Plan, Shape};
use crate::reduce::{DataType, ReduceOp, finish_avg, reduce_into};
use crate::stream_plan::{LinkCounters, RecvKind, StreamProgram, program, program_exchange};

/// A flag page in plain host memory.
pub(crate) struct HostPage {
    cells: Mutex<Vec<u8>>,
}

impl HostPage {
    pub(crate) fn new() -> Arc<HostPage> {
        Arc::new(HostPage {
            cells: Mutex::new(vec![0; flag::WORDS as usize * CELL]),
        })
    }

    fn at(index: u32, at: usize, len: usize) -> nodetour_core::Result<usize> {
        if index >= flag::WORDS || at.checked_add(len).is_none_or(|e| e > CELL) {
            return Err(nodetour_core::Error::OutOfBounds {
                what: "host page",
                offset: at as u64,
                len: len as u64,
                region_len: CELL as u64,
            });
        }
        Ok(index as usize * CELL + at)
    }
}

impl WordPage for HostPage {
    fn read(&self, index: u32) -> nodetour_core::Result<u32> {
        let o = Self::at(index, 0, 4)?;
        let c = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        Ok(u32::from_ne_bytes([c[o], c[o + 1], c[o + 2], c[o + 3]]))
    }
    fn store(&self, index: u32, value: u32) -> nodetour_core::Result<()> {
        let o = Self::at(index, 0, 4)?;
        let mut c = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        c[o..o + 4].copy_from_slice(&value.to_ne_bytes());
        Ok(())
    }
    fn read_bytes(&self, index: u32, at: usize, dst: &mut [u8]) -> nodetour_core::Result<()> {
        let o = Self::at(index, at, dst.len())?;
        let c = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        dst.copy_from_slice(&c[o..o + dst.len()]);
        Ok(())
    }
    fn store_bytes(&self, index: u32, at: usize, src: &[u8]) -> nodetour_core::Result<()> {
        let o = Self::at(index, at, src.len())?;
        let mut c = self.cells.lock().unwrap_or_else(|p| p.into_inner());
        c[o..o + src.len()].copy_from_slice(src);
        Ok(())
    }
}

/// Moves each landed chunk into a second region before it says `ready` (the GPU-slot landing's
/// control flow on host memory: the copy a GPU lander queues on its stream, done here at once).
pub(crate) struct CpuLander {
    pub from: SlotRegion,
    pub to: SlotRegion,
    pub mine: Arc<HostPage>,
}

impl crate::net_link::Lander for CpuLander {
    fn land(&mut self, offset: usize, len: usize, ready: u32) -> nodetour_core::Result<()> {
        let mut chunk = vec![0u8; len];
        self.from.read_at(offset, &mut chunk)?;
        self.to.write_at(offset, &chunk)?;
        self.mine.store(flag::READY, ready)
    }
}

/// Cyclic "at least" on 32-bit counters, as the GPU's waits compare.
fn reached(word: u32, value: u32) -> bool {
    (word.wrapping_sub(value) as i32) >= 0
}

/// The descriptor word of collective `seq` (as the GPU ring's, with a test tag).
pub(crate) fn desc_word(seq: u64, tag: u16) -> u32 {
    ((seq as u32 & 0xffff) << 16) | 0x8000 | u32::from(tag & 0x7fff)
}

/// One rank of a ring driven by host threads.
pub(crate) struct CpuRank {
    pub position: u32,
    pub world: u32,
    pub slots: u32,
    pub slot_bytes: usize,
    pub mine: Arc<HostPage>,
    pub out_next: Arc<HostPage>,
    pub out_prev: Arc<HostPage>,
    pub send_slots: SlotRegion,
    pub recv_slots: SlotRegion,
    /// Where a lander moves landed chunks (the GPU-slot variant's stand-in), if one does: the
    /// receive stream reads there.
    pub landed: Option<SlotRegion>,
    pub link: Option<NetLink>,
    pub desc_cells: (u32, u32),
    pub counters: LinkCounters,
    pub queued: u64,
    pub exchange: bool,
    /// The tag this rank puts in its descriptors (ranks that disagree use different ones).
    pub tag: u16,
    pub broken: Option<Error>,
}

impl CpuRank {
    fn stopped(&self) -> bool {
        self.mine.read(flag::STOPPED).unwrap_or(1) != 0
    }

    /// Whether a neighbour's end notice came.
    fn ended(&self) -> bool {
        self.mine.read(flag::ENDED_BY_PREV).unwrap_or(0) != 0
            || self.mine.read(flag::ENDED_BY_NEXT).unwrap_or(0) != 0
    }

    /// Ends the ring here: notices to both neighbours (through the outboxes), then the stop
    /// word.
    pub(crate) fn abort(&mut self, error: Error) {
        let v = (self.queued as u32).max(1);
        let _ = self.out_next.store(flag::ENDED_BY_PREV, v);
        let _ = self.out_prev.store(flag::ENDED_BY_NEXT, v);
        let _ = self.mine.store(flag::STOPPED, 1);
        self.broken.get_or_insert(error);
    }

    /// Waits (guarded) until `cond` holds or the stop word is set; whether `cond` held.
    fn guarded(&self, cond: impl Fn() -> bool) -> bool {
        let mut nap = Duration::from_micros(2);
        loop {
            if cond() {
                return true;
            }
            if self.stopped() {
                return false;
            }
            std::thread::sleep(nap);
            nap = (nap * 2).min(Duration::from_micros(200));
        }
    }

    /// `shape` over `data` (f32) with `op`, every rank calling it alike; `Ok` only with the
    /// whole collective done on this rank and nothing failed.
    pub(crate) fn collective(
        &mut self,
        data: &mut [f32],
        shape: Shape,
        rop: ReduceOp,
        timeout: Duration,
    ) -> Result<()> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let plan = Plan::new(
            self.world,
            data.len() as u64,
            4,
            self.slot_bytes as u64,
            self.slots,
        )?
        .with_shape(shape)?;
        let average = rop == ReduceOp::Avg;
        let exchange = self.exchange && self.world == 2 && shape == Shape::AllReduce;
        let prog = if exchange {
            program_exchange(&plan, average, &mut self.counters)
        } else {
            program(&plan, self.position, average, &mut self.counters)
        };
        let seq = self.queued;
        self.queued += 1;
        let cell = self.desc_cells.0 + (seq % u64::from(self.desc_cells.1)) as u32;
        let word = desc_word(seq, self.tag);
        let _ = self.out_next.store_bytes(cell, 32, &seq.to_le_bytes());
        if let Some(link) = &self.link {
            let bytes = |e: &std::ops::Range<u64>| (e.end - e.start) as usize * 4;
            link.plan(
                prog.sends.iter().map(|s| bytes(&s.elements)),
                prog.recvs.iter().map(|r| bytes(&r.elements)),
            );
        }
        let run = Run {
            rank: &*self,
            prog: &prog,
            buffer: Mutex::new(bytemuck::cast_slice::<f32, u8>(data).to_vec()),
            sends_done: AtomicUsize::new(0),
            recvs_done: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            cell,
            word,
            rop,
        };
        let deadline = Instant::now() + timeout;
        let mut failure = None;
        std::thread::scope(|s| {
            s.spawn(|| run.send_stream());
            s.spawn(|| run.recv_stream());
            failure = run.watch(seq, deadline, timeout);
        });
        let failure = failure.or_else(|| run.after(seq));
        if let Some(e) = failure {
            self.broken = Some(e.clone());
            return Err(e);
        }
        let bytes = run.buffer.into_inner().unwrap_or_else(|p| p.into_inner());
        for (d, b) in data.iter_mut().zip(bytes.chunks_exact(4)) {
            *d = f32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
        }
        Ok(())
    }
}

/// One collective of a [`CpuRank`] while its two streams (threads) run it.
struct Run<'a> {
    rank: &'a CpuRank,
    prog: &'a StreamProgram,
    /// The buffer (bytes of f32), shared by both streams.
    buffer: Mutex<Vec<u8>>,
    sends_done: AtomicUsize,
    recvs_done: AtomicUsize,
    /// Streams that reached their end.
    finished: AtomicUsize,
    /// This collective's descriptor cell and word.
    cell: u32,
    word: u32,
    rop: ReduceOp,
}

impl Run<'_> {
    /// The send stream: each chunk into the next rank's slot once its credit came, then its
    /// ready flag (the first chunk's after the descriptor word).
    fn send_stream(&self) {
        let this = self.rank;
        if self.prog.sends.is_empty() {
            // A rank that sends nothing still says what it calls.
            if !this.stopped() {
                let _ = this.out_next.store(self.cell, self.word);
            }
        }
        for (i, op) in self.prog.sends.iter().enumerate() {
            if let Some(j) = op.after_recv {
                while self.recvs_done.load(Ordering::Acquire) <= j && !this.stopped() {
                    std::thread::sleep(Duration::from_micros(5));
                }
            }
            let credit = this.guarded(|| {
                op.wait_released
                    .is_none_or(|v| reached(this.mine.read(flag::RELEASED).unwrap_or(0), v))
            });
            if credit {
                let (a, b) = (op.elements.start as usize * 4, op.elements.end as usize * 4);
                let chunk = self.buffer.lock().unwrap()[a..b].to_vec();
                let at = op.slot as usize * this.slot_bytes;
                let _ = this.send_slots.write_at(at, &chunk);
                if i == 0 {
                    let _ = this.out_next.store(self.cell, self.word);
                }
                let _ = this.out_next.store(flag::READY, op.ready);
            }
            self.sends_done.store(i + 1, Ordering::Release);
        }
        self.finished.fetch_add(1, Ordering::AcqRel);
    }

    /// The receive stream: each chunk once ready (the first once the previous rank's
    /// descriptor word matched), reduced or copied in, then credited back.
    fn recv_stream(&self) {
        let this = self.rank;
        for (i, op) in self.prog.recvs.iter().enumerate() {
            if let Some(j) = op.after_send {
                while self.sends_done.load(Ordering::Acquire) <= j && !this.stopped() {
                    std::thread::sleep(Duration::from_micros(5));
                }
            }
            let got = this.guarded(|| {
                (i != 0 || this.mine.read(self.cell).unwrap_or(0) == self.word)
                    && reached(this.mine.read(flag::READY).unwrap_or(0), op.wait_ready)
            });
            let (a, b) = (op.elements.start as usize * 4, op.elements.end as usize * 4);
            let mut chunk = vec![0u8; b - a];
            let at = op.slot as usize * this.slot_bytes;
            let _ = this
                .landed
                .as_ref()
                .unwrap_or(&this.recv_slots)
                .read_at(at, &mut chunk);
            {
                let mut buf = self.buffer.lock().unwrap();
                match op.kind {
                    RecvKind::Reduce { average } => {
                        let _ = reduce_into(DataType::F32, self.rop, &mut buf[a..b], &chunk);
                        if average {
                            finish_avg(DataType::F32, &mut buf[a..b], this.world)
                                .expect("f32 is reduced");
                        }
                    }
                    RecvKind::Copy => buf[a..b].copy_from_slice(&chunk),
                }
            }
            if got {
                let _ = this.out_prev.store(flag::RELEASED, op.released);
            }
            self.recvs_done.store(i + 1, Ordering::Release);
        }
        self.finished.fetch_add(1, Ordering::AcqRel);
    }

    /// The host's wait for collective `seq`: the streams, the links, the neighbours' notices,
    /// the deadline; on the first failure it ends the ring here. Done when both streams are,
    /// and the link has carried their last chunks (or stopped).
    fn watch(&self, seq: u64, deadline: Instant, timeout: Duration) -> Option<Error> {
        let this = self.rank;
        let mut failure = None;
        let carried = |aborted: bool| {
            aborted
                || this
                    .link
                    .as_ref()
                    .is_none_or(|l| l.all_sent() || l.failure().is_some())
        };
        while self.finished.load(Ordering::Acquire) < 2 || !carried(failure.is_some()) {
            if failure.is_none() {
                let why = if let Some(e) = this.link.as_ref().and_then(|l| l.failure()) {
                    Some(e)
                } else if this.ended() {
                    Some(peer_failed(seq))
                } else if Instant::now() >= deadline {
                    Some(Error::Timeout {
                        waiting_for: "the CPU streams".into(),
                        rank: None,
                        after: timeout,
                    })
                } else {
                    None
                };
                if let Some(e) = why {
                    let v = (seq as u32).wrapping_add(1).max(1);
                    let _ = this.out_next.store(flag::ENDED_BY_PREV, v);
                    let _ = this.out_prev.store(flag::ENDED_BY_NEXT, v);
                    let _ = this.mine.store(flag::STOPPED, 1);
                    failure = Some(e);
                }
            }
            std::thread::sleep(Duration::from_micros(20));
        }
        failure
    }

    /// Read once more after the streams finished: a neighbour that ended told us first.
    fn after(&self, seq: u64) -> Option<Error> {
        let this = self.rank;
        if this.stopped() {
            Some(Error::Aborted {
                reason: "the ring was aborted".into(),
            })
        } else if this.ended() {
            Some(peer_failed(seq))
        } else if this.link.as_ref().is_some_and(|l| l.broke_protocol()) {
            this.link.as_ref().and_then(|l| l.failure())
        } else {
            None
        }
    }
}

/// A neighbour ended collective `seq`.
fn peer_failed(seq: u64) -> Error {
    Error::PeerFailed {
        peer: 0,
        seq,
        cause: crate::RootCause::new(0, crate::CauseKind::Failed),
    }
}

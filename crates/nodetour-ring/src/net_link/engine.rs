//! The progress thread's engine: moves chunks from the send slots to the wire, lands what
//! arrives, passes notes on, and waits (spin, then naps or the connection) without busy-polling
//! for ever.

use super::*;

/// The progress thread's state.
pub(super) struct Engine {
    pub(super) setup: NetLinkSetup,
    pub(super) shared: Arc<Shared>,
    pub(super) send: SendEnd,
    pub(super) recv: RecvEnd,
    /// The stream's counters as last read (unwrapped).
    pub(super) stream_sent: u64,
    pub(super) stream_released: u64,
    /// Cells watched in each outbox, with the word last forwarded.
    pub(super) next_cells: Vec<(u32, u32)>,
    pub(super) prev_cells: Vec<(u32, u32)>,
    /// Chunks planned so far (copied from the shared plan).
    pub(super) planned_sends: u64,
    pub(super) planned_recvs: u64,
    pub(super) lengths: VecDeque<usize>,
    pub(super) recv_lengths: VecDeque<usize>,
    /// `ready` published so far (with a lander: chunks handed to it), and the landed, visible
    /// chunks to publish (a neighbour may run into a collective before this rank has planned
    /// it: its chunks wait for their lengths).
    pub(super) published: u64,
    pub(super) ready_target: u64,
    pub(super) stopped: bool,
    pub(super) events: Vec<Event>,
    /// Events a nap's wait took off a connection, handled at the next step.
    pub(super) parked: Vec<(Role, Event)>,
    /// Neighbours known gone (their connection failed): nothing more is written to them (a
    /// write to a dead queue pair waits out its retries).
    pub(super) lost_next: bool,
    pub(super) lost_prev: bool,
}

impl Engine {
    pub(super) fn new(setup: NetLinkSetup, shared: Arc<Shared>) -> Engine {
        let (first, count) = setup.desc_cells;
        let mut next_cells: Vec<(u32, u32)> = (first..first + count).map(|c| (c, 0)).collect();
        next_cells.push((flag::ENDED_BY_PREV, 0));
        let prev_cells = vec![(flag::ENDED_BY_NEXT, 0)];
        Engine {
            send: SendEnd::new(setup.slots),
            // Host slots: the CPU's stores are visible to the GPU's reads once the flag is.
            recv: RecvEnd::new(setup.slots, false),
            setup,
            shared,
            stream_sent: 0,
            stream_released: 0,
            next_cells,
            prev_cells,
            planned_sends: 0,
            planned_recvs: 0,
            lengths: VecDeque::new(),
            recv_lengths: VecDeque::new(),
            published: 0,
            ready_target: 0,
            stopped: false,
            events: Vec::new(),
            parked: Vec::new(),
            lost_next: false,
            lost_prev: false,
        }
    }

    fn has_next(&self) -> bool {
        self.setup.to_next.is_some()
    }

    fn has_prev(&self) -> bool {
        self.setup.to_prev.is_some() || (self.setup.same_peer && self.has_next())
    }

    fn fail(&self, peer: u32, stop: Stop) {
        if stop == Stop::Aborted {
            return; // the ring knows: it set the stop word
        }
        let mut f = self
            .shared
            .failure
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if f.is_none() {
            // Debug only: at teardown a neighbour that closed first looks the same; the ring's
            // error names a failure that mattered.
            tracing::debug!(peer, ?stop, "a network link failed");
            *f = Some(LinkFailure { peer, stop });
        }
    }

    pub(super) fn run(&mut self) {
        let spin = self.setup.options.spin;
        let mut last = Instant::now();
        let mut nap = Duration::from_micros(5);
        loop {
            if self.shared.shutdown.load(Ordering::SeqCst) {
                return;
            }
            if self.step() {
                last = Instant::now();
                nap = Duration::from_micros(5);
                continue;
            }
            // Spin first, busy or idle: a training loop's next collective (or the next chunk)
            // usually comes within the spin, and a blocked thread's wake-up costs more.
            if last.elapsed() < spin {
                std::hint::spin_loop();
                continue;
            }
            if self.idle() {
                let p = self
                    .shared
                    .planned
                    .lock()
                    .unwrap_or_else(|p| p.into_inner());
                if p.sends == self.planned_sends
                    && p.recvs == self.planned_recvs
                    && !self.shared.shutdown.load(Ordering::SeqCst)
                {
                    let _ = self.shared.wake.wait_timeout(p, IDLE_WAKE);
                }
                continue;
            }
            self.nap(nap);
            nap = (nap * 2).min(NAP_MAX);
        }
    }

    /// Waits at most `d` without holding a core: on the connection a chunk is expected from
    /// (its arrival wakes the thread at once), else on the one credit is expected from, else
    /// asleep (what the streams store is seen at the next step).
    fn nap(&mut self, d: Duration) {
        let data_due =
            self.has_prev() && !self.lost_prev && self.recv.landed_count() < self.planned_recvs;
        let credit_due =
            self.has_next() && !self.lost_next && self.send.completed() > self.send.credited();
        let (conn, role) = if data_due {
            if self.setup.same_peer {
                (self.setup.to_next.as_mut(), Role::Both)
            } else {
                (self.setup.to_prev.as_mut(), Role::Prev)
            }
        } else if credit_due {
            let role = if self.setup.same_peer {
                Role::Both
            } else {
                Role::Next
            };
            (self.setup.to_next.as_mut(), role)
        } else {
            (None, Role::Next)
        };
        let Some(conn) = conn else {
            std::thread::sleep(d);
            return;
        };
        let mut events = Vec::new();
        // A failure shows again at the next step's poll, and is handled there.
        let _ = conn.wait(&mut events, nodetour_core::Deadline::after(d));
        self.parked.extend(events.into_iter().map(|e| (role, e)));
    }

    /// Nothing is in flight: every planned chunk written, landed and credited, both ways (a
    /// credit still due back keeps the thread waiting on its connection, not asleep: the send
    /// stream may be waiting for it to refill a slot).
    fn idle(&self) -> bool {
        self.send.completed() >= self.planned_sends
            && (self.send.credited() >= self.send.completed()
                || self.lost_next
                || self.send.is_stopped())
            && self.recv.landed_count() >= self.planned_recvs
            && self.recv.credited() >= self.planned_recvs
    }

    /// One round: events in, cells and counters from the outboxes, actions out. Whether
    /// anything happened.
    fn step(&mut self) -> bool {
        let mut busy = false;
        // The streams' counters before the plan: a collective is planned before its streams
        // can run, so every chunk seen ready here has its length in the plan read next.
        self.read_streams();
        {
            let mut p = self
                .shared
                .planned
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if p.sends != self.planned_sends || p.recvs != self.planned_recvs {
                self.lengths.extend(p.lengths.drain(..));
                self.recv_lengths.extend(p.recv_lengths.drain(..));
                self.planned_sends = p.sends;
                self.planned_recvs = p.recvs;
                busy = true;
            }
        }
        if self.published < self.ready_target && !self.recv.is_stopped() {
            self.publish();
        }
        busy |= self.take_events();
        busy |= self.forward_cells();
        if !self.stopped && self.setup.mine.read(self.setup.stop_word).unwrap_or(1) != 0 {
            self.stopped = true;
            self.send.abort();
            self.recv.abort();
            busy = true;
        }
        busy |= self.drive_send();
        busy |= self.drive_recv();
        busy
    }

    fn take_events(&mut self) -> bool {
        let mut busy = !self.parked.is_empty();
        for (role, Event::Notified(v)) in std::mem::take(&mut self.parked) {
            self.handle(role, v);
        }
        let roles: [(bool, Role); 2] = [
            (
                self.setup.to_next.is_some(),
                if self.setup.same_peer {
                    Role::Both
                } else {
                    Role::Next
                },
            ),
            (self.setup.to_prev.is_some(), Role::Prev),
        ];
        for (present, role) in roles {
            if !present {
                continue;
            }
            let conn = match role {
                Role::Prev => self.setup.to_prev.as_mut(),
                _ => self.setup.to_next.as_mut(),
            }
            .expect("present");
            let mut events = std::mem::take(&mut self.events);
            let polled = conn.poll(&mut events);
            for e in events.drain(..) {
                busy = true;
                let Event::Notified(v) = e;
                self.handle(role, v);
            }
            self.events = events;
            if let Err(e) = polled {
                let peer = if role == Role::Prev {
                    self.setup.prev
                } else {
                    self.setup.next
                };
                if !self.send.is_stopped() || !self.recv.is_stopped() {
                    busy = true;
                }
                self.fail(peer, Stop::PeerLost);
                self.lose(role);
                tracing::debug!(peer, error = %e, "a network link's connection ended");
            }
        }
        busy
    }

    fn handle(&mut self, role: Role, v: u32) {
        let desc = self.setup.desc_cells;
        match classify(v, role.is_prev(), role.is_next(), desc) {
            Note::Data(low) => {
                let seq = unwrap29(self.recv.landed_count(), low);
                self.recv.landed(seq);
            }
            Note::Credit(low) => {
                let n = unwrap29(self.send.credited(), low);
                self.send.credit(n);
                if !self.send.is_stopped() {
                    let _ = self
                        .setup
                        .mine
                        .store(flag::RELEASED, self.send.credited() as u32);
                }
            }
            Note::Cell { index, from_prev } => {
                let mailbox = if from_prev {
                    self.setup.mailbox_from_prev.as_ref()
                } else {
                    self.setup.mailbox_from_next.as_ref()
                };
                let Some(mailbox) = mailbox else {
                    self.protocol(
                        role,
                        format!("a cell on a link that has no mailbox ({index})"),
                    );
                    return;
                };
                let mut cell = [0u8; CELL];
                let at = index as usize * CELL;
                if mailbox.read_at(at, &mut cell).is_err() {
                    self.protocol(role, format!("cell {index} outside the mailbox"));
                    return;
                }
                let word = u32::from_ne_bytes([cell[0], cell[1], cell[2], cell[3]]);
                let mine = &self.setup.mine;
                let _ = mine.store_bytes(index, 4, &cell[4..]);
                let _ = mine.store(index, word);
            }
            Note::Refused(reason) => self.protocol(role, reason),
        }
    }

    /// The neighbour(s) behind `role` are gone: both ends stop, and nothing more is written
    /// to them.
    fn lose(&mut self, role: Role) {
        let both = self.setup.same_peer;
        self.lost_next |= role.is_next() || both;
        self.lost_prev |= role.is_prev() || both;
        self.send.peer_lost();
        self.recv.peer_lost();
    }

    fn protocol(&mut self, role: Role, reason: String) {
        let stop = Stop::Protocol { reason };
        let peer = if role.is_prev() {
            self.setup.prev
        } else {
            self.setup.next
        };
        self.fail(peer, stop);
        self.send.abort();
        self.recv.abort();
    }

    /// Forwards every outbox cell whose word changed.
    fn forward_cells(&mut self) -> bool {
        let mut busy = false;
        for next in [true, false] {
            let (has, page) = if next {
                (
                    self.has_next() && !self.lost_next,
                    self.setup.out_next.clone(),
                )
            } else {
                (
                    self.has_prev() && !self.lost_prev,
                    self.setup.out_prev.clone(),
                )
            };
            if !has {
                continue;
            }
            let n = if next {
                self.next_cells.len()
            } else {
                self.prev_cells.len()
            };
            for i in 0..n {
                let (index, seen) = if next {
                    self.next_cells[i]
                } else {
                    self.prev_cells[i]
                };
                let word = page.read(index).unwrap_or(seen);
                if word == seen {
                    continue;
                }
                busy = true;
                let mut cell = [0u8; CELL];
                cell[..4].copy_from_slice(&word.to_ne_bytes());
                let _ = page.read_bytes(index, 4, &mut cell[4..]);
                let at = index as usize * CELL;
                let sent = self.setup.cells.write_at(at, &cell).and_then(|()| {
                    let (conn, grant) = if next {
                        (
                            self.setup.to_next.as_mut(),
                            self.setup.next_mailbox.as_ref(),
                        )
                    } else if self.setup.same_peer {
                        (
                            self.setup.to_next.as_mut(),
                            self.setup.prev_mailbox.as_ref(),
                        )
                    } else {
                        (
                            self.setup.to_prev.as_mut(),
                            self.setup.prev_mailbox.as_ref(),
                        )
                    };
                    let (conn, grant) = (conn.expect("present"), grant.expect("checked"));
                    conn.write(
                        &self.setup.cells,
                        at..at + CELL,
                        grant,
                        at as u64,
                        Some(note_value(CELL_KIND, u64::from(index))),
                    )
                });
                if let Err(e) = sent {
                    let peer = if next {
                        self.setup.next
                    } else {
                        self.setup.prev
                    };
                    tracing::debug!(peer, error = %e, "forwarding a cell failed");
                    self.fail(peer, Stop::PeerLost);
                    self.lose(if next { Role::Next } else { Role::Prev });
                }
                if next {
                    self.next_cells[i].1 = word;
                } else {
                    self.prev_cells[i].1 = word;
                }
            }
        }
        busy
    }

    /// Reads what the streams stored: chunks ready to send, slots released.
    fn read_streams(&mut self) {
        if self.has_next()
            && let Ok(v) = self.setup.out_next.read(flag::READY)
        {
            let n = unwrap32(self.stream_sent, v);
            if n != self.stream_sent && n - self.stream_sent < 1 << 31 {
                self.stream_sent = n;
                self.send.stream_sent(n);
            }
        }
        if self.has_prev()
            && let Ok(v) = self.setup.out_prev.read(flag::RELEASED)
        {
            let n = unwrap32(self.stream_released, v);
            if n != self.stream_released && n - self.stream_released < 1 << 31 {
                self.stream_released = n;
                self.recv.stream_released(n);
            }
        }
    }

    fn drive_send(&mut self) -> bool {
        let mut busy = false;
        while let Some(action) = self.send.poll() {
            busy = true;
            match action {
                SendAction::Write { seq, slot } => {
                    let Some(len) = self.lengths.pop_front() else {
                        self.fail(
                            self.setup.next,
                            Stop::Protocol {
                                reason: format!(
                                    "the stream made chunk {seq} ready, none was planned"
                                ),
                            },
                        );
                        self.send.abort();
                        continue;
                    };
                    let at = slot as usize * self.setup.slot_bytes;
                    let len = len.min(self.setup.slot_bytes);
                    let conn = self.setup.to_next.as_mut().expect("a send end has a link");
                    // Posted, not waited for: the slot is refilled only after the next
                    // rank's credit for it, which it sends once the chunk has landed there.
                    let ok = !self.lost_next
                        && conn
                            .post(
                                self.setup.send_slots.as_ref().expect("checked"),
                                at..at + len,
                                self.setup.next_recv.as_ref().expect("checked"),
                                at as u64,
                                Some(note_value(DATA, seq)),
                            )
                            .inspect_err(
                                |e| tracing::debug!(error = %e, seq, "a chunk's write failed"),
                            )
                            .is_ok();
                    if !ok {
                        self.lost_next = true;
                    }
                    self.send.write_completed(seq, ok);
                    self.shared
                        .sent
                        .store(self.send.completed(), Ordering::Release);
                }
                SendAction::Stop(stop) => self.fail(self.setup.next, stop),
            }
        }
        busy
    }

    /// Chunks below `ready_target` are landed and visible: tell the receive stream (through
    /// the lander, chunk by chunk, where there is one, as far as they are planned here).
    fn publish(&mut self) {
        let n = self.ready_target;
        let Some(lander) = self.setup.lander.as_mut() else {
            let _ = self.setup.mine.store(flag::READY, n as u32);
            self.published = n;
            return;
        };
        while self.published < n {
            let k = self.published;
            let Some(len) = self.recv_lengths.pop_front() else {
                return; // planned by the next collective's call: published then
            };
            let offset = (k % u64::from(self.setup.slots)) as usize * self.setup.slot_bytes;
            let len = len.min(self.setup.slot_bytes);
            if let Err(e) = lander.land(offset, len, (k + 1) as u32) {
                self.recv.wire_failed(format!("landing chunk {k}: {e}"));
                return;
            }
            self.published = k + 1;
        }
    }

    fn drive_recv(&mut self) -> bool {
        let mut busy = false;
        while let Some(action) = self.recv.poll() {
            busy = true;
            match action {
                RecvAction::Flush { .. } => self.recv.flushed(true),
                RecvAction::Ready(n) => {
                    self.ready_target = n;
                    self.publish();
                }
                RecvAction::Credit(_) if self.lost_prev => {}
                RecvAction::Credit(n) => {
                    let conn = if self.setup.same_peer {
                        self.setup.to_next.as_mut()
                    } else {
                        self.setup.to_prev.as_mut()
                    }
                    .expect("a receive end has a link");
                    let sent = conn.write(
                        &self.setup.cells,
                        0..0,
                        self.setup.prev_mailbox.as_ref().expect("checked"),
                        0,
                        Some(note_value(CREDIT, n)),
                    );
                    if let Err(e) = sent {
                        tracing::debug!(error = %e, "a credit's write failed");
                        self.lost_prev = true;
                        self.recv.wire_failed(e.to_string());
                    }
                }
                RecvAction::Stop(stop) => self.fail(self.setup.prev, stop),
            }
        }
        busy
    }
}

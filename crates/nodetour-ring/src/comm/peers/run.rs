//! Runs a batch of sends and receives on host memory over the peer links, forming the links it
//! lacks first: every part posted at once, then every link it touches progressed together (a
//! batch to and from many peers never waits on one peer while another waits on it, whatever
//! order each rank lists its parts in), until every part ends or the deadline passes.
//!
//! A part that fails ends the batch: the links it touched are ended (the peers' parts on them
//! fail too, told why), and the batch returns the first failure, typed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nodetour_core::Deadline;
use nodetour_core::transport::{Event, HostConnection, wait_any};

use super::form::{self, Formed, Forming};
use crate::comm::paths::PeerLinkPath;
use crate::error::{Error, Result};
use crate::p2p::link::{Ended, PartMemory, PeerLink};
use crate::p2p::protocol::{Failure, PartId, Shape};

/// The cause word of an end this side sends: an abort, a timeout, another part's failure.
const END_ABORTED: u32 = 2;
const END_TIMED_OUT: u32 = 3;
const END_FAILED: u32 = 4;

/// One part of a batch: a send of `memory`'s bytes to `peer`, or a receive from it.
pub(crate) struct Part<'a> {
    pub peer: u32,
    pub shape: Shape,
    pub memory: PartMemory<'a>,
}

/// How a batch waits for its peers: looks without blocking for `spin` after each event
/// (`NODETOUR_RING_SPIN_US`, as the host ring), giving its CPU away between looks where the
/// host runs more ranks than CPUs, then blocks in the kernel.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Waiting {
    pub spin: Duration,
    pub yields: bool,
}

/// A communicator's peer links: formed on first use, reused, at most `max` at once.
pub(crate) struct PeerLinks {
    links: HashMap<u32, PeerLink>,
    paths: Vec<PeerLinkPath>,
    /// What `paths()` shows (read without the communicator's lock).
    shown: Arc<Mutex<Vec<PeerLinkPath>>>,
    next_id: PartId,
    max: usize,
    waiting: Waiting,
}

impl PeerLinks {
    /// No links yet; at most `max` at once.
    pub(crate) fn new(max: usize, waiting: Waiting) -> PeerLinks {
        PeerLinks {
            links: HashMap::new(),
            paths: Vec::new(),
            shown: Arc::default(),
            next_id: 0,
            max,
            waiting,
        }
    }

    /// What `paths()` shows of the links, kept up to date as they form.
    pub(crate) fn shown(&self) -> Arc<Mutex<Vec<PeerLinkPath>>> {
        self.shown.clone()
    }

    /// Whether a link to `peer` is formed.
    pub(crate) fn has(&self, peer: u32) -> bool {
        self.links.contains_key(&peer)
    }

    /// Forms the links `peers` lack (within `at`'s deadline).
    pub(crate) fn ensure(&mut self, at: &Forming<'_>, peers: &[u32]) -> Result<()> {
        let mut missing: Vec<u32> = peers
            .iter()
            .copied()
            .filter(|p| !self.links.contains_key(p))
            .collect();
        missing.sort_unstable();
        missing.dedup();
        if missing.is_empty() {
            return Ok(());
        }
        if self.links.len() + missing.len() > self.max {
            return Err(Error::Unsupported {
                reason: format!(
                    "{} peer links would be held at once, past NODETOUR_P2P_MAX_LINKS={}",
                    self.links.len() + missing.len(),
                    self.max
                ),
            });
        }
        for (p, f) in form::form(at, &missing)? {
            let Formed {
                link,
                kind,
                landing,
                why,
            } = f;
            tracing::info!(peer = p, %kind, reason = %why, "peer link formed");
            self.paths.push(PeerLinkPath {
                peer: p,
                transport: kind,
                landing,
                reason: why.to_string(),
                memory_bytes: link.memory_bytes(),
            });
            self.links.insert(p, link);
        }
        self.paths.sort_by_key(|p| p.peer);
        *self.shown.lock().unwrap_or_else(|p| p.into_inner()) = self.paths.clone();
        Ok(())
    }

    /// Runs `parts` (their links formed: [`Self::ensure`]) until each ends, `aborted` says
    /// why to stop, or `deadline` passes.
    pub(crate) fn run(
        &mut self,
        me: u32,
        parts: Vec<Part<'_>>,
        deadline: Deadline,
        timeout: Duration,
        aborted: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let mut memory: HashMap<PartId, PartMemory<'_>> = HashMap::new();
        let mut peer_of: HashMap<PartId, u32> = HashMap::new();
        let mut touched: Vec<u32> = Vec::new();
        for part in parts {
            let id = self.next_id;
            self.next_id += 1;
            let link = self
                .links
                .get_mut(&part.peer)
                .ok_or_else(|| Error::InvalidArgument {
                    reason: format!("no link to rank {} was formed", part.peer),
                })?;
            match &part.memory {
                PartMemory::Send(_) => link.link.post_send(id, part.shape),
                PartMemory::Recv(_) => link.link.post_recv(id, part.shape),
            }
            memory.insert(id, part.memory);
            peer_of.insert(id, part.peer);
            if !touched.contains(&part.peer) {
                touched.push(part.peer);
            }
        }
        let mut ended = Ended::new();
        let outcome = self.progress(
            &touched,
            &mut memory,
            &mut ended,
            (deadline, timeout),
            aborted,
        );
        let failed = match outcome {
            Ok(()) => first_failure(me, &peer_of, &ended),
            Err(e) => Some(e),
        };
        if let Some(e) = failed {
            // Every link the batch touched ends (the peers' parts on them fail, told why).
            for p in &touched {
                if let Some(l) = self.links.get_mut(p) {
                    l.link.fail(e.to_string(), END_FAILED);
                    let _ = l.act(&mut memory, &mut ended);
                }
            }
            return Err(e);
        }
        Ok(())
    }

    /// Carries out actions and collects events until every part ended.
    fn progress(
        &mut self,
        touched: &[u32],
        memory: &mut HashMap<PartId, PartMemory<'_>>,
        ended: &mut Ended,
        (deadline, timeout): (Deadline, Duration),
        aborted: &dyn Fn() -> Option<String>,
    ) -> Result<()> {
        let total = memory.len();
        let mut events = Vec::new();
        loop {
            for p in touched {
                self.links.get_mut(p).expect("formed").act(memory, ended)?;
            }
            if ended.len() == total || ended.values().any(|r| r.is_err()) {
                return Ok(());
            }
            if let Some(why) = aborted() {
                self.end_all(touched, &why, END_ABORTED, memory, ended);
                return Err(Error::Aborted { reason: why });
            }
            if deadline.expired() {
                let waiting = self.waiting_on(touched);
                self.end_all(touched, "timed out", END_TIMED_OUT, memory, ended);
                return Err(Error::Timeout {
                    waiting_for: format!("point-to-point parts with rank(s) {waiting:?}"),
                    rank: (waiting.len() == 1).then(|| waiting[0]),
                    after: timeout,
                });
            }
            events.clear();
            self.wait(touched, &mut events, deadline)?;
            for (p, e) in &events {
                self.links.get_mut(p).expect("formed").handle(e)?;
            }
        }
    }

    /// Waits for events on the links of `touched` with parts open: looks without blocking for
    /// the spin, then blocks (50 ms at most, so that an abort is seen soon).
    fn wait(
        &mut self,
        touched: &[u32],
        events: &mut Vec<(u32, Event)>,
        deadline: Deadline,
    ) -> Result<()> {
        // Only links with parts open: a peer done with this batch may close its side (its
        // next use here reports it).
        let open = |p: &u32, l: &PeerLink| touched.contains(p) && !l.link.is_idle();
        let mut order = Vec::new();
        let mut conns: Vec<&mut dyn HostConnection> = Vec::new();
        for (p, l) in self.links.iter_mut().filter(|(p, l)| open(p, l)) {
            order.push(*p);
            conns.push(l.conn());
        }
        let (mut got, mut indexed) = (Vec::new(), Vec::new());
        let spin_until = std::time::Instant::now() + self.waiting.spin;
        loop {
            for (i, c) in conns.iter_mut().enumerate() {
                c.poll(&mut got)?;
                indexed.extend(got.drain(..).map(|e| (i, e)));
            }
            if !indexed.is_empty() || std::time::Instant::now() >= spin_until {
                break;
            }
            if self.waiting.yields {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        if indexed.is_empty() {
            let step = Deadline::after(Duration::from_millis(50)).min(deadline);
            wait_any(&mut conns, &mut indexed, step)?;
        }
        events.extend(indexed.into_iter().map(|(i, e)| (order[i], e)));
        Ok(())
    }

    /// The peers whose links still have parts open.
    fn waiting_on(&self, touched: &[u32]) -> Vec<u32> {
        touched
            .iter()
            .copied()
            .filter(|p| self.links.get(p).is_some_and(|l| !l.link.is_idle()))
            .collect()
    }

    fn end_all(
        &mut self,
        touched: &[u32],
        why: &str,
        cause: u32,
        memory: &mut HashMap<PartId, PartMemory<'_>>,
        ended: &mut Ended,
    ) {
        for p in touched {
            if let Some(l) = self.links.get_mut(p) {
                l.link.fail(why.to_owned(), cause);
                let _ = l.act(memory, ended);
            }
        }
    }
}

/// The first part that failed, as the error the caller sees.
fn first_failure(me: u32, peer_of: &HashMap<PartId, u32>, ended: &Ended) -> Option<Error> {
    let mut failed: Vec<(&PartId, &Failure)> = ended
        .iter()
        .filter_map(|(id, r)| r.as_ref().err().map(|f| (id, f)))
        .collect();
    failed.sort_by_key(|(id, _)| **id);
    let (id, f) = failed.first()?;
    let peer = peer_of[id];
    Some(match f {
        Failure::Disagreement { ours, theirs } => Error::Disagreement {
            rank: me,
            peer,
            ours: show(*ours),
            theirs: show(*theirs),
        },
        Failure::Protocol(reason) => Error::Protocol {
            rank: peer,
            reason: reason.clone(),
        },
        Failure::Ended(cause) => Error::Aborted {
            reason: format!("rank {peer} ended the peer link ({})", cause_text(*cause)),
        },
        Failure::Local(reason) => Error::Aborted {
            reason: reason.clone(),
        },
    })
}

fn show(s: Shape) -> String {
    format!("a message of {} {}", s.count, s.dtype.name())
}

fn cause_text(cause: u32) -> &'static str {
    match cause {
        crate::p2p::protocol::END_PROTOCOL => "this rank broke the protocol",
        END_ABORTED => "it was aborted",
        END_TIMED_OUT => "it timed out",
        END_FAILED => "a part of its batch failed",
        _ => "an unknown cause",
    }
}

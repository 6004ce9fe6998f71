//! Forming peer links on first use, the way the ring's links form: the transport table chooses
//! each pair's host link kind with its reason ([`crate::comm::form::table::host_link`]); the
//! kind's own steps allocate and connect ([`crate::comm::form::links`]); what only that peer
//! may use (its slots' grant, a queue pair) travels to it alone, over this rank's
//! authenticated endpoint ([`crate::comm::form::setups::Received::exchange`]); and a pairwise
//! handshake after connecting makes sure neither side writes a queue pair that is not ready.
//!
//! Several peers form at once (a batch to many): one exchange with all of them, each pair
//! meeting in it. A peer that never takes part ends the wait at the deadline, naming it.

use std::collections::HashMap;
use std::sync::Arc;

use nodetour_core::Deadline;
use nodetour_core::memory::HostBuffer;
use nodetour_core::transport::setup::NeighbourSetup;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{SlotGrant, SlotRegion, TransportKind};
use nodetour_core::verbs::{Access, LocalSide, MemoryRegion};
use nodetour_net::bootstrap::Bootstrap;

use crate::comm::form::links::{self, Allocating, Connecting};
use crate::comm::form::setups::{self, Received};
use crate::comm::form::table::{self, Pair, Why};
use crate::comm::links::Announcement;
use crate::comm::paths::Landing;
use crate::error::{Error, Result};
use crate::p2p::link::{BELL, PeerLink};

/// What forming a peer link uses: the job, this rank's endpoint and RDMA device, the links'
/// shape and the timeouts.
pub(crate) struct Forming<'a> {
    pub job: &'a Bootstrap,
    pub endpoint: &'a TcpEndpoint,
    /// This rank's RDMA device, or why it has none.
    pub verbs: std::result::Result<&'a LocalSide, &'a str>,
    pub config: &'a nodetour_core::Config,
    /// Slots per link and their bytes (every rank the same: a must-agree setting).
    pub shape: (u32, usize),
    /// What bounds each later wait on a connection.
    pub timeout: std::time::Duration,
    pub deadline: Deadline,
}

/// A link formed, and what `paths()` says of it.
pub(crate) struct Formed {
    pub link: PeerLink,
    pub kind: TransportKind,
    pub landing: Landing,
    pub why: Why,
}

/// Forms a link to each of `peers` (none formed yet; all distinct, none this rank).
pub(crate) fn form(at: &Forming<'_>, peers: &[u32]) -> Result<HashMap<u32, Formed>> {
    let mut kinds = choose(at, peers)?;
    let peers_over = |k: TransportKind| -> Vec<u32> {
        let mut v: Vec<u32> = peers.iter().copied().filter(|p| kinds[p].0 == k).collect();
        v.sort_unstable();
        v
    };
    let local = at
        .verbs
        .ok()
        .filter(|_| links::uses_rdma_device(&peers_over));
    let (slots, slot_bytes) = at.shape;
    let inbox_bytes = (slots as usize)
        .checked_mul(slot_bytes)
        .and_then(|b| b.checked_add(BELL))
        .ok_or_else(|| Error::InvalidArgument {
            reason: "peer link slots × slot bytes overflows".into(),
        })?;
    let mut inboxes = HashMap::new();
    let mut stagings = HashMap::new();
    for &p in peers {
        inboxes.insert(p, region(local, inbox_bytes, Access::REMOTE)?);
        stagings.insert(p, region(local, slot_bytes, Access::LOCAL)?);
    }
    let allocating = Allocating {
        verbs: local,
        depth: None,
    };
    let mut prepared = links::allocate(&peers_over, &allocating)?;
    let setup_for = |p: u32| {
        NeighbourSetup {
            recv: inboxes.get(&p).map(SlotGrant::of),
            bell: None,
            endpoint: prepared.get(&p).map(|m| m.endpoint()),
        }
        .encode()
    };
    let received = Received::exchange(at.job, at.endpoint, peers, &setup_for, at.deadline)?;
    let mut theirs = HashMap::new();
    for &p in peers {
        let grant = received
            .host(p)?
            .recv
            .ok_or_else(|| setups::missing(p, "peer link slot grant"))?;
        let shape = format!("peer link slots ({slots} × {slot_bytes}) and bell");
        theirs.insert(p, setups::exactly(grant, p, &shape, inbox_bytes)?);
    }
    let grants_for = |p: u32| inboxes.get(&p).cloned().into_iter().collect();
    let connecting = Connecting {
        job: at.job,
        endpoint: at.endpoint,
        received: &received,
        verbs: local,
        config: at.config,
        timeout: at.timeout,
        deadline: at.deadline,
        grants_for: &grants_for,
    };
    let mut conns = links::connect(&peers_over, &mut prepared, &connecting)?;
    // Every peer connected its side before either writes (a verbs write must not reach a
    // queue pair that is not ready): a second exchange, of nothing, with the same peers.
    Received::exchange(at.job, at.endpoint, peers, &|_| Vec::new(), at.deadline)?;
    let mut formed = HashMap::new();
    for &p in peers {
        let conn = conns
            .remove(&p)
            .ok_or_else(|| setups::missing(p, "peer link connection"))?;
        let (kind, landing, why) = kinds.remove(&p).expect("chosen above");
        let link = PeerLink::new(
            p,
            conn,
            inboxes.remove(&p).expect("allocated above"),
            theirs.remove(&p).expect("granted above"),
            stagings.remove(&p).expect("allocated above"),
            at.shape,
        );
        formed.insert(
            p,
            Formed {
                link,
                kind,
                landing,
                why,
            },
        );
    }
    Ok(formed)
}

/// Plan: each peer's host link kind, where its bytes land and why, from the table (as the
/// ring's links choose theirs).
type Chosen = HashMap<u32, (TransportKind, Landing, Why)>;

fn choose(at: &Forming<'_>, peers: &[u32]) -> Result<Chosen> {
    let me = at.job.rank();
    let entries = at.job.peers();
    let announced = |r: u32| Announcement::decode(r, &entries[r as usize].blob);
    let ours = announced(me)?;
    let mut kinds = HashMap::new();
    for &p in peers {
        let theirs = announced(p)?;
        let pair = Pair {
            ours: (&ours, me),
            theirs: (&theirs, p),
            same_host: entries[me as usize]
                .host
                .same_host(&entries[p as usize].host),
            why_no_verbs: at.verbs.err().unwrap_or(""),
        };
        kinds.insert(p, table::host_link(&pair)?);
    }
    Ok(kinds)
}

/// Host memory of `len` bytes, registered with `local` where a link uses the RDMA device.
fn region(local: Option<&LocalSide>, len: usize, access: Access) -> Result<SlotRegion> {
    let buf = HostBuffer::new(len.max(1))?;
    Ok(match local {
        Some(l) => SlotRegion::registered(Arc::new(MemoryRegion::register(&l.pd, buf, access)?)),
        None => SlotRegion::host(buf),
    })
}

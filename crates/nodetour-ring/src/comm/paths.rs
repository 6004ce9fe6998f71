//! What a communicator tells its user about the way data travels: for each link to a peer, the
//! link kind, where the bytes land (the registration rung), whether the call waits on the host,
//! and why that path was chosen. A typed report that also displays as the log line.

use std::fmt;

use nodetour_core::transport::TransportKind;

/// Which way a link points in the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// To the next rank: this rank writes its slots.
    Next,
    /// From the previous rank: it writes this rank's slots.
    Prev,
    /// Two ranks: one link carries both directions.
    Both,
}

/// Where the bytes a peer sends land, and what was registered for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Landing {
    /// Host memory registered with the RDMA device (the NIC writes it).
    RegisteredHost,
    /// Host memory written by this process's transport thread (tcp: software one-sided writes).
    SoftwareHost,
}

/// One link of this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LinkPath {
    /// The peer's job rank.
    pub peer: u32,
    /// Its place relative to this rank in the ring.
    pub direction: Direction,
    /// The link kind.
    pub transport: TransportKind,
    /// Where its bytes land.
    pub landing: Landing,
    /// Why this kind was chosen (the override, or the facts of the pair).
    pub reason: String,
}

/// How collectives on GPU memory run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DevicePath {
    /// No GPU was given ([`crate::comm::Options::gpu`]) and no device collective has run yet:
    /// the first one forms the device path on its stream's GPU.
    None,
    /// A GPU ring (one GPU each): queued on the caller's stream, no host wait. `transport` is
    /// the link to the next rank: cuda-ipc (direct) or shm (through shared host memory) on one
    /// host, verbs or tcp across hosts (network links landing in GPU or host memory, as
    /// `reason` says).
    GpuRing {
        /// The link to the next rank.
        transport: Option<TransportKind>,
        /// Why.
        reason: String,
    },
    /// Several GPUs of one process ([`crate::comm::Communicator::from_devices`]): each GPU reads
    /// its ring neighbour's memory directly; queued on the caller's stream, no host wait.
    InProcess {
        /// The path and why.
        reason: String,
    },
    /// Staged through this rank's host ring (no GPU ring could form: `reason` says why):
    /// synchronous, waiting for the caller's stream only, with the communicator's timeout.
    Staged {
        /// Why not a GPU ring.
        reason: String,
    },
}

/// Every link of this rank, and how collectives on each kind of memory run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Paths {
    /// This rank.
    pub rank: u32,
    /// Ranks in the communicator.
    pub world: u32,
    /// The ring order (ranks of one host next to each other).
    pub order: Vec<u32>,
    /// The links (none for a communicator of one rank).
    pub links: Vec<LinkPath>,
    /// Whether the job is authenticated ("authenticated (job token)", or why not).
    pub security: String,
    /// How collectives on GPU memory run.
    pub device: DevicePath,
    /// The point-to-point links formed so far (on first use), by peer.
    pub peers: Vec<PeerLinkPath>,
}

/// A point-to-point link to one peer, formed the first time the pair met
/// ([`super::Communicator::send`], [`super::Communicator::batch`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerLinkPath {
    /// The peer.
    pub peer: u32,
    /// The link's transport.
    pub transport: TransportKind,
    /// Where the peer's bytes land.
    pub landing: Landing,
    /// Why this transport.
    pub reason: String,
    /// Host memory the link holds on this rank: the slots the peer writes, their bell and
    /// the staging slot this rank writes from.
    pub memory_bytes: u64,
}

impl Paths {
    /// Whether every link is `kind`.
    pub fn all(&self, kind: TransportKind) -> bool {
        !self.links.is_empty() && self.links.iter().all(|l| l.transport == kind)
    }
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::Next => "next",
            Direction::Prev => "prev",
            Direction::Both => "next+prev",
        })
    }
}

impl fmt::Display for Landing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Landing::RegisteredHost => "host memory registered with the NIC",
            Landing::SoftwareHost => "host memory, written by the tcp receiver",
        })
    }
}

impl fmt::Display for Paths {
    /// `rank 1/4: host buffers: synchronous ring; next rank 2 verbs (host memory registered
    /// with the NIC): both ranks have an RDMA device; prev rank 0 ...`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let DevicePath::InProcess { reason } = &self.device {
            return write!(
                f,
                "rank {}/{}: GPU buffers: GPUs of one process on the caller's streams, {reason}",
                self.rank, self.world
            );
        }
        write!(
            f,
            "rank {}/{}: host buffers: synchronous ring",
            self.rank, self.world
        )?;
        if self.links.is_empty() {
            write!(f, "; no links (one rank)")?;
        }
        for l in &self.links {
            write!(
                f,
                "; {} rank {} {} ({}): {}",
                l.direction, l.peer, l.transport, l.landing, l.reason
            )?;
        }
        for p in &self.peers {
            write!(
                f,
                "; peer link to rank {} {} ({}, {} bytes held): {}",
                p.peer, p.transport, p.landing, p.memory_bytes, p.reason
            )?;
        }
        write!(f, "; {}", self.security)?;
        match &self.device {
            DevicePath::None => write!(
                f,
                "; GPU buffers: formed on the first device collective's stream (none yet)"
            ),
            DevicePath::InProcess { .. } => Ok(()),
            DevicePath::GpuRing { transport, reason } => {
                let kind = transport.map_or("one rank".to_owned(), |t| t.to_string());
                write!(
                    f,
                    "; GPU buffers: GPU ring on the caller's stream, {kind}: {reason}"
                )
            }
            DevicePath::Staged { reason } => write!(
                f,
                "; GPU buffers: staged through host memory, synchronous: {reason}"
            ),
        }
    }
}

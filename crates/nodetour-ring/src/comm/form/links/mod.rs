//! Each host link kind's own formation steps, as NCCL's `ncclTransport` carries its setup and
//! connect: what the kind allocates for a peer before the exchange (sent in that peer's setup)
//! and how it connects once every neighbour's setup came. The transport table's rows
//! ([`super::table`]) carry them; formation loops over the rows, for the host ring's links
//! (`host.rs`) and the GPU ring's network links (`net.rs`) alike, so adding a link kind is its
//! file here and its row there. The in-host GPU link kinds (cuda-ipc, shm) carry steps of
//! their own shape ([`gpu_steps`]): the GPU ring's link to the next rank is connected by the
//! first of them that can (`gpu.rs`).
//!
//! | kind | allocate (per peer) | bytes land in | connect |
//! |---|---|---|---|
//! | verbs ([`verbs`]) | a queue pair, its endpoint sent in the setup; the regions are registered with the RDMA device | host memory registered with the NIC | the queue pair to the endpoint the peer sent |
//! | tcp ([`tcp`]) | nothing | host memory, written by the tcp receiver | an authenticated connection to each peer, starting with what it may write granted |

pub(crate) mod cuda_ipc;
pub(crate) mod gpu_steps;
pub(crate) mod shm;
pub(crate) mod tcp;
pub(crate) mod verbs;

use std::collections::HashMap;
use std::time::Duration;

use nodetour_core::Deadline;
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{HostConnection, SlotRegion};
use nodetour_core::verbs::{LocalSide, QueuePairOptions};
use nodetour_net::bootstrap::Bootstrap;

use super::setups::{Conns, Received};
use crate::comm::paths::Landing;
use crate::error::Result;

/// What allocating for a peer may use.
pub(crate) struct Allocating<'a> {
    /// The RDMA device, where this rank opened one and a link of the plan uses it.
    pub verbs: Option<&'a LocalSide>,
    /// The depth of each queue pair (`None`: the transport's default).
    pub depth: Option<QueuePairOptions>,
}

/// What connecting uses.
pub(crate) struct Connecting<'a> {
    pub job: &'a Bootstrap,
    pub endpoint: &'a TcpEndpoint,
    /// Every neighbour's setup.
    pub received: &'a Received,
    pub verbs: Option<&'a LocalSide>,
    pub config: &'a nodetour_core::Config,
    /// What bounds every later wait on a connection: the collective's timeout, not the
    /// joining deadline's remainder.
    pub timeout: Duration,
    /// The joining deadline.
    pub deadline: Deadline,
    /// What each peer may write into this rank, for kinds that grant it as the connection
    /// starts.
    pub grants_for: &'a (dyn Fn(u32) -> Vec<SlotRegion> + Sync),
}

/// What a link kind made for one peer before the exchange.
pub(crate) trait PreparedLink {
    /// What goes to the peer in its setup (a queue pair's endpoint).
    fn endpoint(&self) -> Vec<u8>;

    /// Connected to `peer` from what it sent in its setup.
    fn connect(self: Box<Self>, peer: u32, at: &Connecting<'_>) -> Result<Box<dyn HostConnection>>;
}

/// What a link kind made for each of its peers, by rank.
pub(crate) type Prepared = HashMap<u32, Box<dyn PreparedLink>>;

/// One host link kind's formation steps.
pub(crate) trait LinkSteps: Sync {
    /// Whether the kind needs the RDMA device (the regions are then registered with it).
    fn uses_rdma_device(&self) -> bool;

    /// Where a neighbour's bytes land (what `paths()` says).
    fn landing(&self) -> Landing;

    /// Allocate: what this rank makes for `peer` before the exchange (`None`: nothing).
    fn allocate(&self, peer: u32, at: &Allocating<'_>) -> Result<Option<Box<dyn PreparedLink>>>;

    /// Connect: a connection to each of `peers`, from what allocate made for each (taken out
    /// of `prepared`).
    fn connect(&self, peers: &[u32], prepared: &mut Prepared, at: &Connecting<'_>)
    -> Result<Conns>;
}

/// Allocate, for every host link kind of the table: what each makes for its peers
/// (`peers_over(kind)`).
pub(crate) fn allocate(
    peers_over: &dyn Fn(nodetour_core::transport::TransportKind) -> Vec<u32>,
    at: &Allocating<'_>,
) -> Result<Prepared> {
    let mut prepared = Prepared::new();
    for (kind, steps) in super::table::host_steps() {
        for p in peers_over(kind) {
            if let Some(made) = steps.allocate(p, at)? {
                prepared.insert(p, made);
            }
        }
    }
    Ok(prepared)
}

/// Connect, for every host link kind of the table: a connection to each of its peers
/// (`peers_over(kind)`).
pub(crate) fn connect(
    peers_over: &dyn Fn(nodetour_core::transport::TransportKind) -> Vec<u32>,
    prepared: &mut Prepared,
    at: &Connecting<'_>,
) -> Result<Conns> {
    let mut conns = Conns::new();
    for (kind, steps) in super::table::host_steps() {
        let peers = peers_over(kind);
        if !peers.is_empty() {
            conns.extend(steps.connect(&peers, prepared, at)?);
        }
    }
    Ok(conns)
}

/// Whether a link of the plan (`peers_over`) uses the RDMA device.
pub(crate) fn uses_rdma_device(
    peers_over: &dyn Fn(nodetour_core::transport::TransportKind) -> Vec<u32>,
) -> bool {
    super::table::host_steps()
        .any(|(kind, steps)| steps.uses_rdma_device() && !peers_over(kind).is_empty())
}

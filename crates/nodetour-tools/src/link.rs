//! A connected pair of RC queue pairs between two processes, each with one registered region
//! the other may write: the common start of the `nodetour write-bw` tool and the two-node
//! example.
//!
//! The steps are the ones a user of the core crate takes, in order: open the device the memory
//! calls for and pick the port and GID ([`LocalSide::open`]); register memory (host memory, or
//! GPU memory through the registration ladder); then [`PeerLink::connect`] creates the queue
//! pair, posts receives, exchanges endpoint descriptions out of band, connects, and waits until
//! both sides are ready (a write must not reach a queue pair that is not yet ready to receive).

use std::sync::Arc;

use crate::oob::{MessageKind, OobChannel, OobListener};
use nodetour_core::auth::JobToken;
use nodetour_core::memory::{HostBuffer, RdmaBuffer};
use nodetour_core::verbs::{
    Access, Endpoint, EndpointDescription, MemoryRegion, Near, PathOptions, QueuePair,
    QueuePairOptions, RemoteRegion,
};
use nodetour_core::{Config, Deadline, Result};

/// Which side of the out-of-band connection this process is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// Listen on this address ("0.0.0.0:18517") and accept the peer.
    Listen(String),
    /// Connect to the peer listening at this address.
    Connect(String),
}

pub use nodetour_core::verbs::LocalSide;

/// One end of an established link.
pub struct PeerLink<B: RdmaBuffer = HostBuffer> {
    /// The queue pair, connected and ready to send. Declared first: dropped (torn down) before
    /// the region it may still be writing into.
    pub qp: QueuePair,
    /// This side's registered region (the peer may write all of it).
    pub region: Arc<MemoryRegion<B>>,
    /// The peer's region, as this side may write it.
    pub remote: RemoteRegion,
    /// The peer's queue pair.
    pub remote_endpoint: Endpoint,
    /// The out-of-band channel, kept open for control messages.
    pub channel: OobChannel,
    /// Device, port, GID.
    pub local: LocalSide,
}

impl PeerLink<HostBuffer> {
    /// Establishes a link with `region_len` bytes of writable host memory on each side.
    pub fn establish(
        config: &Config,
        role: &Role,
        token: &JobToken,
        region_len: usize,
        options: QueuePairOptions,
        deadline: Deadline,
    ) -> Result<PeerLink<HostBuffer>> {
        let local = LocalSide::open(config, Near::Host)?;
        let region = Arc::new(MemoryRegion::register(
            &local.pd,
            HostBuffer::new(region_len)?,
            Access::REMOTE,
        )?);
        PeerLink::connect(config, local, region, role, token, options, deadline)
    }
}

impl<B: RdmaBuffer> PeerLink<B> {
    /// Connects `region` (registered in `local.pd`) with the peer's.
    pub fn connect(
        config: &Config,
        local: LocalSide,
        region: Arc<MemoryRegion<B>>,
        role: &Role,
        token: &JobToken,
        options: QueuePairOptions,
        deadline: Deadline,
    ) -> Result<PeerLink<B>> {
        let qp = QueuePair::new(&local.pd, local.port.port, options)?;
        qp.post_receives(options.recv_depth)?;
        // The channel proves the job's token both ways before anything is exchanged.
        let mut channel = match role {
            Role::Listen(addr) => OobListener::bind(addr.as_str())?.accept(token, deadline)?,
            Role::Connect(addr) => OobChannel::connect(addr, token, deadline)?,
        };
        let ours = EndpointDescription {
            endpoint: qp.endpoint(&local.gid),
            regions: vec![region.remote()],
        };
        let theirs = channel.exchange_endpoints(&ours, deadline)?;
        let remote = *theirs
            .regions
            .first()
            .ok_or_else(|| nodetour_core::Error::PeerMismatch {
                reason: "the peer advertised no writable region".into(),
            })?;
        qp.connect(
            &theirs.endpoint,
            &PathOptions::new(local.port.port, &local.gid, config),
        )?;
        channel.send(MessageKind::Ready, &[], deadline)?;
        channel.expect(MessageKind::Ready, deadline)?;
        Ok(PeerLink {
            qp,
            region,
            remote,
            remote_endpoint: theirs.endpoint,
            channel,
            local,
        })
    }

    /// The path MTU in bytes (the smaller of both ends).
    pub fn mtu_bytes(&self) -> u32 {
        let local = self.local.port.active_mtu.map_or(1024, |m| m.bytes());
        local.min(self.remote_endpoint.mtu.bytes())
    }

    /// A one-line description: device, port, GID, MTU.
    pub fn describe(&self) -> String {
        format!(
            "device={} port={} gid_index={} gid={} mtu={} link={:?} qpn={} peer_qpn={}",
            self.local.context.name(),
            self.local.port.port,
            self.local.gid.index,
            std::net::Ipv6Addr::from(self.local.gid.gid),
            self.mtu_bytes(),
            self.local.port.link_layer,
            self.qp.qpn(),
            self.remote_endpoint.qpn
        )
    }
}

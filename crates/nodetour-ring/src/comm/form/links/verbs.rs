//! Verbs links: a reliable-connected queue pair per peer, made before the exchange (its
//! endpoint goes in the peer's setup), connected to the endpoint the peer sent.

use nodetour_core::transport::HostConnection;
use nodetour_core::transport::verbs::PreparedVerbs;
use nodetour_core::verbs::{EndpointDescription, PathOptions};

use super::{Allocating, Connecting, LinkSteps, Prepared, PreparedLink};
use crate::comm::form::setups::{Conns, missing};
use crate::comm::paths::Landing;
use crate::error::{Error, Result};

/// The verbs row's steps.
pub(crate) struct Verbs;

/// A queue pair made for one peer, and its endpoint as sent.
struct QueuePair {
    made: PreparedVerbs,
    endpoint: Vec<u8>,
}

impl LinkSteps for Verbs {
    fn uses_rdma_device(&self) -> bool {
        true
    }

    fn landing(&self) -> Landing {
        Landing::RegisteredHost
    }

    fn allocate(&self, _peer: u32, at: &Allocating<'_>) -> Result<Option<Box<dyn PreparedLink>>> {
        let Some(local) = at.verbs else {
            return Ok(None);
        };
        let (made, endpoint) = match at.depth {
            Some(depth) => PreparedVerbs::for_peer_with(local, depth)?,
            None => PreparedVerbs::for_peer(local)?,
        };
        Ok(Some(Box::new(QueuePair { made, endpoint })))
    }

    fn connect(
        &self,
        peers: &[u32],
        prepared: &mut Prepared,
        at: &Connecting<'_>,
    ) -> Result<Conns> {
        let mut conns = Conns::new();
        if at.verbs.is_none() {
            return Ok(conns);
        }
        for &p in peers {
            if let Some(q) = prepared.remove(&p) {
                conns.insert(p, q.connect(p, at)?);
            }
        }
        Ok(conns)
    }
}

impl PreparedLink for QueuePair {
    fn endpoint(&self) -> Vec<u8> {
        self.endpoint.clone()
    }

    fn connect(self: Box<Self>, peer: u32, at: &Connecting<'_>) -> Result<Box<dyn HostConnection>> {
        let local = at.verbs.expect("a queue pair was made on the RDMA device");
        let sent = at
            .received
            .host(peer)?
            .endpoint
            .ok_or_else(|| missing(peer, "queue pair"))?;
        let remote = EndpointDescription::decode(&sent)
            .map_err(|e| Error::Protocol {
                rank: peer,
                reason: format!("its queue pair: {e}"),
            })?
            .endpoint;
        let path = PathOptions::new(local.port.port, &local.gid, at.config);
        let c = self
            .made
            .connect(&remote, &path, format!("rank {peer}"), at.timeout)?;
        Ok(Box::new(c))
    }
}

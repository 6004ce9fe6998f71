//! Formation's exchange step, in one place for every ring: what a neighbour sent (decoded
//! once, each missing or malformed part a protocol error naming the rank), and the grants
//! checked against the sizes this rank agreed. Each link kind connects from them in its own
//! steps ([`super::links`]).

use std::collections::HashMap;

use nodetour_core::Deadline;
use nodetour_core::transport::setup::{GpuNeighbourSetup, NeighbourSetup};
use nodetour_core::transport::tcp::TcpEndpoint;
use nodetour_core::transport::{HostConnection, SlotGrant};
use nodetour_net::bootstrap::Bootstrap;

use crate::error::{Error, Result};

/// Connections to neighbours, by rank.
pub(crate) type Conns = HashMap<u32, Box<dyn HostConnection>>;

/// What the neighbours sent in the exchange, as bytes until a step reads them.
pub(crate) struct Received(HashMap<u32, Vec<u8>>);

/// A neighbour that left out `what`.
pub(crate) fn missing(rank: u32, what: &str) -> Error {
    Error::Protocol {
        rank,
        reason: format!("sent no {what}"),
    }
}

impl Received {
    /// Sends `setup_for(p)` to each of `peers` and receives theirs (over this rank's
    /// authenticated endpoint, to those neighbours alone).
    pub(crate) fn exchange(
        job: &Bootstrap,
        endpoint: &TcpEndpoint,
        peers: &[u32],
        setup_for: &dyn Fn(u32) -> Vec<u8>,
        deadline: Deadline,
    ) -> Result<Received> {
        let (me, world) = (job.rank(), job.world_size());
        let alive = || job.check_present();
        let address = |p: u32| job.peers()[p as usize].address.clone();
        let got = endpoint.exchange(peers, me, world, &address, setup_for, &alive, deadline)?;
        Ok(Received(got))
    }

    fn bytes(&self, rank: u32, what: &str) -> Result<&[u8]> {
        self.0
            .get(&rank)
            .map(Vec::as_slice)
            .ok_or_else(|| missing(rank, what))
    }

    /// A host-memory link's setup (slots, doorbell or mailbox, queue pair).
    pub(crate) fn host(&self, rank: u32) -> Result<NeighbourSetup> {
        NeighbourSetup::decode(self.bytes(rank, "setup")?).map_err(|e| Error::Protocol {
            rank,
            reason: format!("its setup: {e}"),
        })
    }

    /// An in-host GPU link's setup (flag pages, slots, the ring's shape).
    pub(crate) fn gpu(&self, rank: u32) -> Result<GpuNeighbourSetup> {
        GpuNeighbourSetup::decode(self.bytes(rank, "GPU setup")?).map_err(|e| Error::Protocol {
            rank,
            reason: format!("its GPU setup: {e}"),
        })
    }
}

/// `grant` (from `rank`, of `what`) holds exactly `len` bytes: the agreed shape.
pub(crate) fn exactly(grant: SlotGrant, rank: u32, what: &str, len: usize) -> Result<SlotGrant> {
    if grant.len != len as u64 {
        return Err(Error::Protocol {
            rank,
            reason: format!(
                "granted {} bytes of {what}, the agreed shape is {len}",
                grant.len
            ),
        });
    }
    Ok(grant)
}

/// `grant` (from `rank`, of `what`) holds at least `len` bytes.
pub(crate) fn at_least(grant: SlotGrant, rank: u32, what: &str, len: usize) -> Result<SlotGrant> {
    if grant.len < len as u64 {
        return Err(Error::Protocol {
            rank,
            reason: format!("granted {} bytes of {what}, it must hold {len}", grant.len),
        });
    }
    Ok(grant)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_of_another_size_and_missing_setups_are_protocol_errors() {
        let g = SlotGrant {
            key: 7,
            len: 4096,
            remote: None,
        };
        assert!(exactly(g, 1, "receive slots", 4096).is_ok());
        let e = exactly(g, 1, "receive slots", 8192).unwrap_err();
        assert!(
            matches!(&e, Error::Protocol { rank: 1, reason } if reason.contains("4096 bytes of receive slots")),
            "{e}"
        );
        assert!(at_least(g, 2, "doorbell", 64).is_ok());
        assert!(matches!(
            at_least(g, 2, "doorbell", 8192),
            Err(Error::Protocol { rank: 2, .. })
        ));
        let got = Received(HashMap::from([(3, vec![0xff])]));
        assert!(matches!(got.host(4), Err(Error::Protocol { rank: 4, .. })));
        assert!(matches!(got.host(3), Err(Error::Protocol { rank: 3, .. })));
        assert!(matches!(got.gpu(3), Err(Error::Protocol { rank: 3, .. })));
    }
}

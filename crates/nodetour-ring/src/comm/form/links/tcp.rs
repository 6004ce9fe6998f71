//! Tcp links: nothing made before the exchange; an authenticated connection to each peer
//! (both ways), starting with what that peer may write granted.

use nodetour_core::transport::HostConnection;

use super::{Allocating, Connecting, LinkSteps, Prepared, PreparedLink};
use crate::comm::form::setups::Conns;
use crate::comm::paths::Landing;
use crate::error::Result;

/// The tcp row's steps.
pub(crate) struct Tcp;

impl LinkSteps for Tcp {
    fn uses_rdma_device(&self) -> bool {
        false
    }

    fn landing(&self) -> Landing {
        Landing::SoftwareHost
    }

    fn allocate(&self, _peer: u32, _at: &Allocating<'_>) -> Result<Option<Box<dyn PreparedLink>>> {
        Ok(None)
    }

    fn connect(
        &self,
        peers: &[u32],
        _prepared: &mut Prepared,
        at: &Connecting<'_>,
    ) -> Result<Conns> {
        let job = at.job;
        let (me, world) = (job.rank(), job.world_size());
        let alive = || job.check_present();
        let address = |p: u32| job.peers()[p as usize].address.clone();
        let made = at.endpoint.connect_mesh(
            peers,
            me,
            world,
            &address,
            at.grants_for,
            &alive,
            at.deadline,
        )?;
        Ok(made
            .into_iter()
            .map(|(p, c)| (p, Box::new(c) as Box<dyn HostConnection>))
            .collect())
    }
}

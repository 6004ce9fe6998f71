//! This process's end of the verbs fabric: the device chosen for the memory in play, its first
//! active port, the GID for that port, and a protection domain. What every user of verbs opens
//! first (the ring's links, the write tools, the two-node example).

use std::sync::Arc;

use super::{Context, DeviceChoice, GidChoice, Near, PortAttributes, ProtectionDomain};
use crate::config::Config;
use crate::error::Result;

/// This process's device, port, GID and protection domain.
pub struct LocalSide {
    /// The protection domain regions and queue pairs are created in. Declared first: dropped
    /// before the device it lives on.
    pub pd: Arc<ProtectionDomain>,
    /// The device, and why it was chosen.
    pub device: DeviceChoice,
    /// The port in use.
    pub port: PortAttributes,
    /// The GID in use, and why.
    pub gid: GidChoice,
    /// The open device.
    pub context: Arc<Context>,
}

impl LocalSide {
    /// Opens the device for memory at `near` (`NODETOUR_IB_DEVICE` overrides) and chooses the
    /// port and GID.
    pub fn open(config: &Config, near: Near<'_>) -> Result<LocalSide> {
        let (context, device) = Context::open_chosen(config, near)?;
        let port = context.first_active_port()?;
        let gid = context.choose_gid(&port, config.gid_index)?;
        tracing::info!(device = %context.name(), port = port.port, gid_index = gid.index, reason = %gid.reason, "GID chosen");
        let pd = ProtectionDomain::new(&context)?;
        Ok(LocalSide {
            pd,
            device,
            port,
            gid,
            context,
        })
    }
}

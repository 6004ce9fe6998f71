//! Forming a communicator, as a pipeline of small typed steps (every rank runs the same steps
//! in the same order; each fails within the options' joining timeout,
//! `NODETOUR_JOIN_TIMEOUT_MS`, naming what is missing):
//!
//! 1. **announce** ([`host::announce`]): the bootstrap; every rank hears every rank's host and
//!    announcement (link abilities, GPU, process, the must-agree settings).
//! 2. **plan** ([`plan::RingPlan`], pure): the settings' agreement, the ring order, one host
//!    link per neighbour from the transport table ([`table`]) with its reason, and how
//!    GPU buffers travel ([`plan::DevicePlan`]); tested on fixtures.
//! 3. **allocate** ([`host::allocate`]): the regions the plan asks for, and what each link kind
//!    makes for its peers ([`links`]: a queue pair per verbs neighbour), with
//!    least privilege.
//! 4. **exchange** ([`host::exchange`], [`setups`]): each neighbour's setup, decoded and checked
//!    in one place against what this rank agreed.
//! 5. **connect** ([`host::connect`]): each link kind's connections (the transport table's
//!    rows carry their steps: [`links`]), then a barrier.
//! 6. **device** ([`device`]): the GPU ring the plan chose (in-host links: [`gpu`]; network
//!    links: [`net`], [`net_direct`]; the one-kernel path: [`one_kernel`]), whose own steps choose each link's kind and landing, a fallback
//!    (cuda-ipc to shm, GPU slots to host slots) recorded with its reason.
//!
//! [`super::Paths`] is rendered from the plan's links and the device step's choice.

mod gpu;
pub(crate) mod host;
pub(crate) mod links;
mod net;
pub(crate) mod net_direct;
mod one_kernel;
pub(crate) mod plan;
pub(crate) mod setups;
pub(crate) mod table;

use std::sync::Arc;

use cudarc::driver::CudaContext;
use nodetour_core::transport::TransportKind;
use nodetour_core::verbs::LocalSide;

use self::gpu::Seat;
use self::host::Joined;
use self::net::Locality;
use self::plan::{DevicePlan, RingPlan};
use super::options::Options;
use super::paths::DevicePath;
use crate::error::Result;
use crate::gpu_ring::GpuRing;

/// Device: forms the GPU ring `plan` chose on `pin`'s context (every rank takes the same
/// branch: the plan is computed alike everywhere), or says why GPU buffers are staged.
pub(crate) fn device(
    joined: &Joined,
    plan: &RingPlan,
    verbs: Option<&LocalSide>,
    options: &Options,
    pin: Option<&Arc<CudaContext>>,
) -> Result<(Option<GpuRing>, DevicePath)> {
    let context = match (pin, &plan.device) {
        (Some(c), DevicePlan::InHost | DevicePlan::Network { .. }) => c,
        (_, DevicePlan::Staged(why)) => {
            let reason = why.to_string();
            return Ok((None, DevicePath::Staged { reason }));
        }
        _ => return Ok((None, DevicePath::None)),
    };
    let seat = Seat {
        job: &joined.job,
        endpoint: &joined.endpoint,
        context,
        me: plan.me,
        world: plan.world,
        position: plan.position(),
        prev: plan.prev,
        next: plan.next,
        forced: options.transport,
        deadline: joined.deadline,
        timeout: options.timeout(),
    };
    let formed = match plan.device {
        DevicePlan::Network {
            next_local,
            prev_local,
        } => {
            // A network link goes over the kind the host links chose for that neighbour.
            let over = |p: u32| plan.kind(p).unwrap_or(TransportKind::Tcp);
            let here = Locality {
                next_local,
                prev_local,
                verbs,
                next_over: over(plan.next),
                prev_over: over(plan.prev),
            };
            net::form(seat, here, options.gpu_ring, &options.config)?
        }
        _ => gpu::form(seat, options.gpu_ring)?,
    };
    let (mut ring, reason) = (formed.ring, formed.choice);
    ring.set_two_rank_exchange(options.two_rank_exchange);
    let transport = ring.kind();
    Ok((Some(ring), DevicePath::GpuRing { transport, reason }))
}

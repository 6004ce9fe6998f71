//! Point-to-point: one peer link's protocol as a pure state machine ([`protocol`], tested by
//! simulation with faults in `protocol_tests.rs`) and one formed link on host memory carrying
//! out its actions ([`link`]). The communicator forms the links on first use and runs batches
//! over them (`comm/peers/`); its face is `comm/p2p.rs`.

pub(crate) mod link;
pub(crate) mod protocol;
#[cfg(test)]
mod protocol_tests;

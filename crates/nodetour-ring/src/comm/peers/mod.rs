//! The communicator's point-to-point links ([`crate::p2p`] holds one link's protocol and the
//! link itself): formed on first use through the transport table's rows ([`form`]), and a
//! batch of sends and receives run over them together ([`run`]).

pub(crate) mod form;
pub(crate) mod run;

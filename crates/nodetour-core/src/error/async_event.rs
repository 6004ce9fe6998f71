//! Asynchronous events of an RDMA device (`ibv_get_async_event`): a port going down or up, a
//! queue pair or the whole device failing. They arrive on the context's event file, not as
//! completions; a queue pair waiting for completions also watches that file, so a port that
//! goes down or a queue pair the device killed fails its waits at once with a typed error and
//! a hint, instead of at the deadline.

use std::fmt;

/// One asynchronous event, as nodetour records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AsyncEvent {
    /// `IBV_EVENT_PORT_ACTIVE`: the port came (back) up.
    PortActive {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_PORT_ERR`: the port went down.
    PortError {
        /// Port number.
        port: u8,
    },
    /// `IBV_EVENT_DEVICE_FATAL`: the device is unusable until reset.
    DeviceFatal,
    /// `IBV_EVENT_QP_FATAL`: the device could not process this queue pair's work.
    QpFatal {
        /// Queue pair number.
        qpn: u32,
    },
    /// `IBV_EVENT_QP_REQ_ERR`: the peer sent a request this queue pair could not accept.
    QpRequestError {
        /// Queue pair number.
        qpn: u32,
    },
    /// `IBV_EVENT_QP_ACCESS_ERR`: a peer's request violated this queue pair's access rights.
    QpAccessError {
        /// Queue pair number.
        qpn: u32,
    },
    /// `IBV_EVENT_CQ_ERR`: a completion queue overran.
    CqError,
    /// `IBV_EVENT_GID_CHANGE`: the GID table of a port changed (an address came or went).
    GidChange {
        /// Port number.
        port: u8,
    },
    /// Any other event (path migration, LID/P_Key/SM changes, SRQ limits), by number.
    Other {
        /// The `ibv_event_type` value.
        event_type: u32,
    },
}

impl AsyncEvent {
    /// Classifies a raw event: its type and, depending on the type, the port number or the
    /// queue pair number it names.
    pub(crate) fn classify(event_type: u32, port: u8, qpn: u32) -> AsyncEvent {
        match event_type {
            0 => AsyncEvent::CqError,
            1 => AsyncEvent::QpFatal { qpn },
            2 => AsyncEvent::QpRequestError { qpn },
            3 => AsyncEvent::QpAccessError { qpn },
            8 => AsyncEvent::DeviceFatal,
            9 => AsyncEvent::PortActive { port },
            10 => AsyncEvent::PortError { port },
            18 => AsyncEvent::GidChange { port },
            other => AsyncEvent::Other { event_type: other },
        }
    }

    /// Whether the raw type names a queue pair (its element is a `struct ibv_qp *`).
    pub(crate) fn names_qp(event_type: u32) -> bool {
        matches!(event_type, 1..=7 | 16)
    }

    /// Whether the raw type names a port (its element is a port number).
    pub(crate) fn names_port(event_type: u32) -> bool {
        matches!(event_type, 9..=13 | 17 | 18)
    }

    /// What the event usually means and what to do.
    pub fn hint(&self) -> &'static str {
        match self {
            AsyncEvent::PortActive { .. } => "the port is up again",
            AsyncEvent::PortError { .. } => {
                "the link went down: check the cable and the switch port (RoCE: the network \
                 interface under the device is down or lost its carrier)"
            }
            AsyncEvent::DeviceFatal => {
                "the adapter reported a fatal error: check dmesg; the device must be reset \
                 (driver reload or reboot) before it moves data again"
            }
            AsyncEvent::QpFatal { .. } => {
                "the adapter could not process this queue pair's work (often a DMA or IOMMU \
                 failure on the local memory: check ACS/IOMMU settings and dmesg)"
            }
            AsyncEvent::QpRequestError { .. } => {
                "the peer sent a request this queue pair could not accept (mismatched queue \
                 pair settings or a peer that is not a nodetour rank of this job)"
            }
            AsyncEvent::QpAccessError { .. } => {
                "a peer's request violated this queue pair's access rights (a wrong or stale \
                 remote key: a peer of another job or collective)"
            }
            AsyncEvent::CqError => {
                "a completion queue overran (a bug: queues are sized for all outstanding work)"
            }
            AsyncEvent::GidChange { .. } => {
                "an address of the port changed: connections made with the old GID may stop working"
            }
            AsyncEvent::Other { .. } => "informational",
        }
    }

    /// Whether this event ends the work of a queue pair `qpn` on `port`, given the events that
    /// came after it (a later `PortActive` heals a `PortError`).
    pub(crate) fn is_fatal_for(&self, port: u8, qpn: u32, later: &[AsyncEvent]) -> bool {
        match *self {
            AsyncEvent::DeviceFatal | AsyncEvent::CqError => true,
            AsyncEvent::PortError { port: p } => {
                p == port && !later.contains(&AsyncEvent::PortActive { port })
            }
            AsyncEvent::QpFatal { qpn: q }
            | AsyncEvent::QpRequestError { qpn: q }
            | AsyncEvent::QpAccessError { qpn: q } => q == qpn,
            _ => false,
        }
    }
}

impl fmt::Display for AsyncEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AsyncEvent::PortActive { port } => write!(f, "IBV_EVENT_PORT_ACTIVE on port {port}"),
            AsyncEvent::PortError { port } => write!(f, "IBV_EVENT_PORT_ERR on port {port}"),
            AsyncEvent::DeviceFatal => f.write_str("IBV_EVENT_DEVICE_FATAL"),
            AsyncEvent::QpFatal { qpn } => write!(f, "IBV_EVENT_QP_FATAL on queue pair {qpn}"),
            AsyncEvent::QpRequestError { qpn } => {
                write!(f, "IBV_EVENT_QP_REQ_ERR on queue pair {qpn}")
            }
            AsyncEvent::QpAccessError { qpn } => {
                write!(f, "IBV_EVENT_QP_ACCESS_ERR on queue pair {qpn}")
            }
            AsyncEvent::CqError => f.write_str("IBV_EVENT_CQ_ERR"),
            AsyncEvent::GidChange { port } => write!(f, "IBV_EVENT_GID_CHANGE on port {port}"),
            AsyncEvent::Other { event_type } => write!(f, "asynchronous event {event_type}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_classified_and_judged_per_queue_pair_and_port() {
        assert_eq!(
            AsyncEvent::classify(10, 1, 0),
            AsyncEvent::PortError { port: 1 }
        );
        assert_eq!(
            AsyncEvent::classify(1, 0, 77),
            AsyncEvent::QpFatal { qpn: 77 }
        );
        assert_eq!(
            AsyncEvent::classify(42, 0, 0),
            AsyncEvent::Other { event_type: 42 }
        );
        assert!(AsyncEvent::names_port(10) && AsyncEvent::names_qp(3) && !AsyncEvent::names_qp(8));
        let down = AsyncEvent::PortError { port: 1 };
        assert!(down.is_fatal_for(1, 5, &[]));
        assert!(!down.is_fatal_for(2, 5, &[]));
        assert!(!down.is_fatal_for(1, 5, &[AsyncEvent::PortActive { port: 1 }]));
        assert!(AsyncEvent::QpFatal { qpn: 5 }.is_fatal_for(1, 5, &[]));
        assert!(!AsyncEvent::QpAccessError { qpn: 6 }.is_fatal_for(1, 5, &[]));
        assert!(AsyncEvent::DeviceFatal.is_fatal_for(1, 5, &[]));
        assert!(!AsyncEvent::GidChange { port: 1 }.is_fatal_for(1, 5, &[]));
        assert!(down.to_string().contains("PORT_ERR") && down.hint().contains("link went down"));
    }
}

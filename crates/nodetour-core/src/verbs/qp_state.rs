//! The RC queue pair state machine: which transitions exist and which attributes each one
//! must set. Pure data, unit-tested; `qp.rs` applies it.

/// Queue pair states (`ibv_qp_state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created or reset.
    Reset,
    /// Initialised: receives may be posted.
    Init,
    /// Ready to receive.
    ReadyToReceive,
    /// Ready to send.
    ReadyToSend,
    /// Send queue drained.
    SendQueueDrained,
    /// Send queue error.
    SendQueueError,
    /// Error: every outstanding work request completes with a flush error.
    Error,
}

impl QpState {
    /// The `ibv_qp_state` code.
    pub fn code(self) -> u32 {
        match self {
            QpState::Reset => 0,
            QpState::Init => 1,
            QpState::ReadyToReceive => 2,
            QpState::ReadyToSend => 3,
            QpState::SendQueueDrained => 4,
            QpState::SendQueueError => 5,
            QpState::Error => 6,
        }
    }

    /// The verbs name.
    pub fn name(self) -> &'static str {
        match self {
            QpState::Reset => "RESET",
            QpState::Init => "INIT",
            QpState::ReadyToReceive => "RTR",
            QpState::ReadyToSend => "RTS",
            QpState::SendQueueDrained => "SQD",
            QpState::SendQueueError => "SQE",
            QpState::Error => "ERR",
        }
    }
}

/// `ibv_qp_attr_mask` bits.
pub mod mask {
    #![allow(missing_docs)]
    pub const STATE: u32 = 1;
    pub const ACCESS_FLAGS: u32 = 1 << 3;
    pub const PKEY_INDEX: u32 = 1 << 4;
    pub const PORT: u32 = 1 << 5;
    pub const AV: u32 = 1 << 7;
    pub const PATH_MTU: u32 = 1 << 8;
    pub const TIMEOUT: u32 = 1 << 9;
    pub const RETRY_CNT: u32 = 1 << 10;
    pub const RNR_RETRY: u32 = 1 << 11;
    pub const RQ_PSN: u32 = 1 << 12;
    pub const MAX_QP_RD_ATOMIC: u32 = 1 << 13;
    pub const MIN_RNR_TIMER: u32 = 1 << 15;
    pub const SQ_PSN: u32 = 1 << 16;
    pub const MAX_DEST_RD_ATOMIC: u32 = 1 << 17;
    pub const DEST_QPN: u32 = 1 << 20;
}

/// The attribute mask an RC queue pair needs for `from → to`, or `None` if the transition
/// does not exist.
pub fn transition_mask(from: QpState, to: QpState) -> Option<u32> {
    use QpState::*;
    use mask::*;
    Some(match (from, to) {
        (_, Reset) | (_, Error) => STATE,
        (Reset, Init) | (Init, Init) => STATE | PKEY_INDEX | PORT | ACCESS_FLAGS,
        (Init, ReadyToReceive) => {
            STATE | AV | PATH_MTU | DEST_QPN | RQ_PSN | MAX_DEST_RD_ATOMIC | MIN_RNR_TIMER
        }
        (ReadyToReceive, ReadyToSend) => {
            STATE | TIMEOUT | RETRY_CNT | RNR_RETRY | SQ_PSN | MAX_QP_RD_ATOMIC
        }
        (ReadyToSend, ReadyToSend)
        | (SendQueueError, ReadyToSend)
        | (SendQueueDrained, ReadyToSend) => STATE,
        (ReadyToSend, SendQueueDrained) | (SendQueueDrained, SendQueueDrained) => STATE,
        _ => return None,
    })
}

/// Whether work may be posted to the send queue in `state`.
pub fn can_send(state: QpState) -> bool {
    state == QpState::ReadyToSend
}

/// Whether receives may be posted in `state` (they are accepted from INIT on).
pub fn can_receive(state: QpState) -> bool {
    matches!(
        state,
        QpState::Init | QpState::ReadyToReceive | QpState::ReadyToSend
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use QpState::*;

    const ALL: [QpState; 7] = [
        Reset,
        Init,
        ReadyToReceive,
        ReadyToSend,
        SendQueueDrained,
        SendQueueError,
        Error,
    ];

    #[test]
    fn connection_path_has_the_required_attributes() {
        let init = transition_mask(Reset, Init).unwrap();
        assert_eq!(init & mask::PORT, mask::PORT);
        let rtr = transition_mask(Init, ReadyToReceive).unwrap();
        for m in [
            mask::AV,
            mask::PATH_MTU,
            mask::DEST_QPN,
            mask::RQ_PSN,
            mask::MIN_RNR_TIMER,
        ] {
            assert_eq!(rtr & m, m);
        }
        let rts = transition_mask(ReadyToReceive, ReadyToSend).unwrap();
        for m in [
            mask::TIMEOUT,
            mask::RETRY_CNT,
            mask::RNR_RETRY,
            mask::SQ_PSN,
        ] {
            assert_eq!(rts & m, m);
        }
    }

    #[test]
    fn every_state_can_reset_or_fail() {
        for s in ALL {
            assert_eq!(transition_mask(s, Reset), Some(mask::STATE));
            assert_eq!(transition_mask(s, Error), Some(mask::STATE));
        }
    }

    #[test]
    fn no_shortcuts() {
        assert_eq!(transition_mask(Reset, ReadyToSend), None);
        assert_eq!(transition_mask(Reset, ReadyToReceive), None);
        assert_eq!(transition_mask(Init, ReadyToSend), None);
        assert_eq!(transition_mask(Error, ReadyToSend), None);
        assert_eq!(transition_mask(ReadyToReceive, Init), None);
    }

    #[test]
    fn posting_rules() {
        assert!(can_send(ReadyToSend));
        assert!(ALL.iter().filter(|s| can_send(**s)).count() == 1);
        assert!(can_receive(Init) && !can_receive(Reset) && !can_receive(Error));
    }

    #[test]
    fn codes_are_the_verbs_codes() {
        for (i, s) in ALL.iter().enumerate() {
            assert_eq!(s.code(), i as u32);
        }
    }
}

//! Why a collective ended, as every rank of the ring reports it: the rank at fault and what
//! happened there. A rank that ends a collective puts its cause in the end notices it sends
//! its neighbours, and a rank that ends because of such a notice passes the same cause on, so
//! that ranks far from the fault name it too (instead of the neighbour that told them).

/// The rank at fault and what happened there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RootCause {
    /// The rank at fault (a job rank in the communicator's errors; a ring position inside the
    /// ring executors, translated by the communicator).
    pub rank: u32,
    /// What happened there.
    pub kind: CauseKind,
}

/// What happened at the rank at fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CauseKind {
    /// It did not respond within the timeout: stopped, frozen, too slow, or late to call the
    /// collective (a rank that waited on it for the whole timeout said so).
    Timeout,
    /// Its process or its connections ended.
    Lost,
    /// Its caller aborted (an abort handle, a communicator closing).
    Aborted,
    /// It found that its neighbour calls another collective (operation, count, type,
    /// reduction, root or sequence number differ).
    Disagreement,
    /// A local error there (transport, GPU, a peer's protocol violation): its own error says
    /// which.
    Failed,
}

impl CauseKind {
    /// The kind's code on the wire (1..=5; 0 is "no cause").
    pub(crate) fn code(self) -> u32 {
        match self {
            CauseKind::Timeout => 1,
            CauseKind::Lost => 2,
            CauseKind::Aborted => 3,
            CauseKind::Disagreement => 4,
            CauseKind::Failed => 5,
        }
    }

    pub(crate) fn from_code(code: u32) -> Option<CauseKind> {
        Some(match code {
            1 => CauseKind::Timeout,
            2 => CauseKind::Lost,
            3 => CauseKind::Aborted,
            4 => CauseKind::Disagreement,
            5 => CauseKind::Failed,
            _ => return None,
        })
    }
}

/// Ranks a 32-bit cause word can name (24 bits).
pub(crate) const WORD_RANKS: u32 = 1 << 24;

impl RootCause {
    /// `kind` at `rank`.
    pub fn new(rank: u32, kind: CauseKind) -> Self {
        RootCause { rank, kind }
    }

    /// The same cause with its rank mapped (ring positions to job ranks).
    pub(crate) fn map_rank(self, f: impl Fn(u32) -> u32) -> Self {
        RootCause {
            rank: f(self.rank),
            kind: self.kind,
        }
    }

    /// As one nonzero 32-bit word (`kind:8 | rank:24`; a rank beyond 24 bits is saturated,
    /// which [`Self::from_word`] reads as unknown), for flag cells.
    pub(crate) fn to_word(self) -> u32 {
        self.kind.code() << 24 | self.rank.min(WORD_RANKS - 1)
    }

    /// Reads [`Self::to_word`]'s word (`None`: no cause, an unknown kind, or a saturated rank).
    pub(crate) fn from_word(w: u32) -> Option<Self> {
        let kind = CauseKind::from_code(w >> 24)?;
        let rank = w & (WORD_RANKS - 1);
        (rank < WORD_RANKS - 1).then_some(RootCause { rank, kind })
    }
}

impl std::fmt::Display for RootCause {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = self.rank;
        match self.kind {
            CauseKind::Timeout => write!(f, "rank {r} did not respond within the timeout"),
            CauseKind::Lost => write!(f, "rank {r} was lost (its process or connections ended)"),
            CauseKind::Aborted => write!(f, "rank {r} aborted it"),
            CauseKind::Disagreement => write!(
                f,
                "rank {r} and its neighbour disagree on what the collective is"
            ),
            CauseKind::Failed => write!(f, "rank {r} failed (its own error says why)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cause_round_trips_through_its_word_and_unknown_words_read_as_none() {
        for kind in [
            CauseKind::Timeout,
            CauseKind::Lost,
            CauseKind::Aborted,
            CauseKind::Disagreement,
            CauseKind::Failed,
        ] {
            for rank in [0, 1, 4095, WORD_RANKS - 2] {
                let c = RootCause::new(rank, kind);
                assert_ne!(c.to_word(), 0);
                assert_eq!(RootCause::from_word(c.to_word()), Some(c));
            }
        }
        assert_eq!(RootCause::from_word(0), None);
        assert_eq!(RootCause::from_word(6 << 24), None);
        assert_eq!(
            RootCause::from_word(RootCause::new(u32::MAX, CauseKind::Lost).to_word()),
            None
        );
    }
}

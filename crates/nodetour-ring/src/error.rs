//! The one error type of `nodetour-ring`.

use std::time::Duration;

use crate::cause::{CauseKind, RootCause};

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the ring.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The layout cannot be made (zero slots, a slot smaller than one element, ...).
    #[error("cannot plan the collective: {reason}")]
    Plan {
        /// Why.
        reason: String,
    },
    /// A peer broke the slot protocol (a slot it was not granted, out-of-order data, a grant
    /// of a slot that does not exist).
    #[error("protocol violation by rank {rank}: {reason}")]
    Protocol {
        /// The offending rank.
        rank: u32,
        /// What it did.
        reason: String,
    },
    /// A rank of the ring is gone.
    #[error("rank {rank} lost during the collective")]
    PeerLost {
        /// The lost rank.
        rank: u32,
    },
    /// Nothing moved for longer than the timeout.
    #[error("{}", timeout_text(waiting_for, *rank, *after))]
    Timeout {
        /// What the schedule was waiting for.
        waiting_for: String,
        /// The rank it waited on, where one rank was (that rank did not respond).
        rank: Option<u32>,
        /// The timeout.
        after: Duration,
    },
    /// The transport under the ring failed (its error kept as the source).
    #[error("transport failed: {source}")]
    Transport {
        /// The transport's error.
        #[source]
        source: CoreError,
    },
    /// The arguments cannot make a collective (buffer counts, sizes, devices); nothing was
    /// queued or sent.
    #[error("invalid collective arguments: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },
    /// A setting is missing or invalid (the environment, the job policy); nothing was formed
    /// or sent.
    #[error("{reason}")]
    Config {
        /// The setting, its value and what is wrong.
        reason: String,
    },
    /// This machine or configuration cannot run the requested path.
    #[error("unsupported: {reason}")]
    Unsupported {
        /// Why.
        reason: String,
    },
    /// A CUDA call nodetour made for a GPU collective failed: what it was doing, and the
    /// call's typed error (the CUDA call and error code: [`nodetour_core::Error::Cuda`]) as
    /// the source.
    #[error("GPU operation failed: {what}: {source}")]
    GpuCall {
        /// What nodetour was doing.
        what: String,
        /// The failed call's error.
        #[source]
        source: CoreError,
    },
    /// The collective was aborted.
    #[error("the collective was aborted: {reason}")]
    Aborted {
        /// Why.
        reason: String,
    },
    /// Two ranks disagree on what the collective is (operation, count, type, reduction, root,
    /// algorithm, sequence number or protocol version). Found before any data of it moves
    /// (the first grant, the GPU ring's descriptor word), but as every failure the output is
    /// undefined afterwards.
    #[error(
        "rank {rank} and rank {peer} disagree on the collective: {ours} here, {theirs} there; its output is undefined"
    )]
    Disagreement {
        /// This rank.
        rank: u32,
        /// The rank that disagrees.
        peer: u32,
        /// The collective as this rank called it.
        ours: String,
        /// The collective as the peer called it.
        theirs: String,
    },
    /// A setting that every rank must share ([`crate::comm::MUST_AGREE`]) differs
    /// between this rank and another: found at formation, on every rank.
    #[error(
        "{setting} is {ours} here and {theirs} on rank {peer}: every rank must use the same value"
    )]
    SettingDiffers {
        /// The setting (its environment variable, or the option's field).
        setting: &'static str,
        /// This rank's value (switches and modes as numbers).
        ours: u64,
        /// The rank that differs.
        peer: u32,
        /// Its value.
        theirs: u64,
    },
    /// A rank speaks another version of the ring protocol (built from another release).
    #[error(
        "rank {rank} speaks ring protocol version {theirs}, this build speaks {ours}: build every rank from the same release"
    )]
    Version {
        /// The rank.
        rank: u32,
        /// Its version.
        theirs: u8,
        /// This build's.
        ours: u8,
    },
    /// An earlier collective of this communicator failed after it had started to communicate;
    /// the communicator runs no more (close it and form a new one).
    #[error("the communicator failed earlier and runs no more collectives: {first}")]
    Broken {
        /// The first failure.
        #[source]
        first: Box<Error>,
    },
    /// A neighbour ended this collective and said why: `cause` names the rank at fault and
    /// what happened there (the neighbour's own failure, or one it was told of and passed on).
    /// The collective failed here: its output is undefined (it may hold partial results, as
    /// after any failed collective).
    #[error(
        "collective #{seq} ended: {cause} (rank {peer} told this rank); its output is undefined"
    )]
    PeerFailed {
        /// The neighbour that told us.
        peer: u32,
        /// The collective's sequence number (mod 128 on the host ring's wire).
        seq: u64,
        /// The rank at fault and what happened there.
        cause: RootCause,
    },
}

fn timeout_text(waiting_for: &str, rank: Option<u32>, after: Duration) -> String {
    match rank {
        Some(r) => format!(
            "rank {r} did not respond within the timeout: no progress for {after:?} waiting for {waiting_for} from it"
        ),
        None => format!("no progress for {after:?}: waiting for {waiting_for}"),
    }
}

impl Error {
    /// A CUDA call made while doing `what` failed with `e` (kept as the source).
    pub(crate) fn gpu(what: impl Into<String>, e: nodetour_core::Error) -> Error {
        Error::GpuCall {
            what: what.into(),
            source: CoreError::from(e),
        }
    }

    /// The rank at fault and what happened there, where the error names one: the same on every
    /// rank that a failure of one rank ended ([`Error::PeerFailed`] carries it from rank to
    /// rank). `None` for errors of this rank alone (an abort here, a refused argument, a local
    /// CUDA error): the ring tells the other ranks of them as this rank's.
    pub fn root_cause(&self) -> Option<RootCause> {
        match self {
            Error::PeerFailed { cause, .. } => Some(*cause),
            Error::PeerLost { rank } => Some(RootCause::new(*rank, CauseKind::Lost)),
            Error::Timeout {
                rank: Some(rank), ..
            } => Some(RootCause::new(*rank, CauseKind::Timeout)),
            Error::Disagreement { rank, .. } => {
                Some(RootCause::new(*rank, CauseKind::Disagreement))
            }
            Error::Protocol { rank, .. } => Some(RootCause::new(*rank, CauseKind::Failed)),
            Error::Broken { first } => first.root_cause(),
            _ => None,
        }
    }

    /// What this rank tells its neighbours when it ends a collective with this error (`me`:
    /// this rank's number in the same numbering as the error's ranks).
    pub(crate) fn cause_to_tell(&self, me: u32) -> RootCause {
        self.root_cause().unwrap_or(match self {
            Error::Aborted { .. } => RootCause::new(me, CauseKind::Aborted),
            _ => RootCause::new(me, CauseKind::Failed),
        })
    }

    /// The same error with every rank it names mapped (ring positions to job ranks).
    pub(crate) fn map_ranks(self, f: &dyn Fn(u32) -> u32) -> Error {
        match self {
            Error::Disagreement {
                rank,
                peer,
                ours,
                theirs,
            } => Error::Disagreement {
                rank: f(rank),
                peer: f(peer),
                ours,
                theirs,
            },
            Error::PeerFailed { peer, seq, cause } => Error::PeerFailed {
                peer: f(peer),
                seq,
                cause: cause.map_rank(f),
            },
            Error::Protocol { rank, reason } => Error::Protocol {
                rank: f(rank),
                reason,
            },
            Error::Timeout {
                waiting_for,
                rank,
                after,
            } => Error::Timeout {
                waiting_for,
                rank: rank.map(f),
                after,
            },
            Error::PeerLost { rank } => Error::PeerLost { rank: f(rank) },
            other => other,
        }
    }
}

/// A failed cudarc call (`?` on a runtime's own CUDA call): [`Error::GpuCall`], the CUDA
/// error code kept in the source.
impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        Error::gpu("a CUDA call", nodetour_core::Error::from(e))
    }
}

impl From<nodetour_core::Error> for Error {
    fn from(e: nodetour_core::Error) -> Self {
        match e {
            nodetour_core::Error::RankLost { rank, .. } => Error::PeerLost { rank },
            nodetour_core::Error::Aborted { reason } => Error::Aborted { reason },
            nodetour_core::Error::Unsupported { what, reason } => Error::Unsupported {
                reason: format!("{what}: {reason}"),
            },
            // A setting (the environment, the job policy): nothing was sent.
            e @ nodetour_core::Error::InvalidConfig { .. } => Error::Config {
                reason: e.to_string(),
            },
            other => Error::Transport {
                source: CoreError(std::sync::Arc::new(other)),
            },
        }
    }
}

/// A `nodetour_core` error kept as the source of a ring error: shared (the ring's errors are
/// `Clone`, a core error is not) and compared by what it says.
#[derive(Clone, Debug)]
pub struct CoreError(pub std::sync::Arc<nodetour_core::Error>);

impl CoreError {
    /// The core error.
    pub fn get(&self) -> &nodetour_core::Error {
        &self.0
    }
}

impl std::fmt::Display for CoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for CoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        std::error::Error::source(&*self.0)
    }
}

impl PartialEq for CoreError {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0) || self.0.to_string() == other.0.to_string()
    }
}

impl Eq for CoreError {}

impl From<nodetour_core::Error> for CoreError {
    fn from(e: nodetour_core::Error) -> Self {
        CoreError(std::sync::Arc::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cudarc_error_becomes_a_gpu_call_error_with_its_code() {
        use cudarc::driver::{DriverError, sys::CUresult};
        let e = Error::from(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(matches!(e, Error::GpuCall { .. }), "{e:?}");
        assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"), "{e}");
    }

    #[test]
    fn a_failed_cuda_call_keeps_its_typed_error_as_the_source() {
        let call = nodetour_core::Error::Cuda {
            op: "cuLaunchKernel",
            code: "CUDA_ERROR_LAUNCH_FAILED".into(),
            hint: "",
        };
        let e = Error::gpu("queueing the collective", call);
        let source = std::error::Error::source(&e).expect("a source");
        let core = source.downcast_ref::<CoreError>().expect("the core error");
        assert!(matches!(
            core.get(),
            nodetour_core::Error::Cuda {
                op: "cuLaunchKernel",
                ..
            }
        ));
        let shown = e.to_string();
        assert!(shown.contains("queueing the collective") && shown.contains("cuLaunchKernel"));
    }

    #[test]
    fn a_transport_error_keeps_the_core_error_as_its_source() {
        let core = nodetour_core::Error::Timeout {
            what: "a completion".into(),
            after: std::time::Duration::from_millis(5),
        };
        let shown = core.to_string();
        let e = Error::from(core);
        let Error::Transport { source } = &e else {
            panic!("{e:?}")
        };
        assert!(matches!(source.get(), nodetour_core::Error::Timeout { .. }));
        let as_source = std::error::Error::source(&e).expect("a source");
        assert_eq!(as_source.to_string(), shown);
        assert_eq!(e.clone(), e);
        assert!(matches!(
            Error::from(nodetour_core::Error::Aborted { reason: "x".into() }),
            Error::Aborted { .. }
        ));
    }
}

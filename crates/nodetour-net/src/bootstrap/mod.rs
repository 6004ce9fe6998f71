//! Forming a job: who each process is (from torchrun, Slurm, Open MPI, or explicit values), a
//! rendezvous at rank 0 guarded by a job token, the table of every rank (with the addresses of
//! the ranks it connects to, under a sharing policy), and a liveness mesh that tells every
//! rank when another is lost.
//!
//! ```no_run
//! use nodetour_net::bootstrap::{Bootstrap, HostIdentity, JobToken, LaunchInfo, PeerEntry};
//! use nodetour_core::Deadline;
//! # fn main() -> nodetour_core::Result<()> {
//! let info = LaunchInfo::from_env()?;               // RANK, WORLD_SIZE, MASTER_ADDR, ...
//! let me = PeerEntry { rank: info.rank, host: HostIdentity::current(),
//!                      address: "10.0.0.5:41000".into(), blob: vec![] };
//! let job = Bootstrap::rendezvous(&info.rendezvous_addr(), info.rank, info.world_size, me,
//!                                 &JobToken::from_env(), Deadline::after(std::time::Duration::from_secs(60)))?;
//! for peer in job.peers() { /* connect transports */ }
//! job.check()?;                                     // Err(RankLost) once any rank is gone
//! # Ok(()) }
//! ```

pub mod host;
pub mod launcher;
pub mod nodelist;
mod rendezvous;
pub mod wire;

pub use host::HostIdentity;
pub use launcher::{LaunchInfo, Launcher};
pub use nodetour_core::auth::{self, JobToken};
pub use rendezvous::{Bootstrap, Share};
pub use wire::PeerEntry;

use nodetour_core::{Error, Result};

/// An NCCL-style unique id: the rendezvous address and a fresh job token in one string, created
/// by rank 0 and passed to the others through the runtime's own store (for runtimes that do not
/// use launcher environment variables).
#[derive(Clone, PartialEq, Eq)]
pub struct UniqueId {
    /// `host:port` of rank 0's rendezvous.
    pub address: String,
    /// The job token (random).
    pub token: [u8; 16],
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UniqueId")
            .field("address", &self.address)
            .finish_non_exhaustive()
    }
}

impl UniqueId {
    /// A new id for a rendezvous at `address`, with a random token.
    pub fn new(address: impl Into<String>) -> UniqueId {
        let mut token = [0u8; 16];
        token.copy_from_slice(&nodetour_core::auth::nonce()[..16]);
        UniqueId {
            address: address.into(),
            token,
        }
    }

    /// A new id for this process to be rank 0 of a job: binds the rendezvous listener now (on
    /// every interface, a port the system picks), so the port cannot be taken before the job
    /// forms, and keeps it for this process's rank-0 rendezvous on that port (as
    /// `ncclGetUniqueId`; see [`bind_rendezvous`]). The id carries the job token: pass it only
    /// through a store no one outside the job reads.
    pub fn create() -> Result<UniqueId> {
        Ok(UniqueId::new(bind_rendezvous()?))
    }

    /// The id as text: `ndt1:<32 hex digits>@<host:port>`.
    pub fn encode(&self) -> String {
        let hex: String = self.token.iter().map(|b| format!("{b:02x}")).collect();
        format!("ndt1:{hex}@{}", self.address)
    }

    /// Parses [`Self::encode`]'s form.
    pub fn decode(s: &str) -> Result<UniqueId> {
        let bad = |reason: &str| Error::Decode {
            what: "unique id",
            reason: reason.to_owned(),
        };
        let rest = s
            .strip_prefix("ndt1:")
            .ok_or_else(|| bad("missing the ndt1: prefix"))?;
        let (hex, address) = rest
            .split_once('@')
            .ok_or_else(|| bad("missing @address"))?;
        if hex.len() != 32 || address.is_empty() || address.len() > wire::MAX_STRING {
            return Err(bad(
                "the token must be 32 hex digits and the address non-empty",
            ));
        }
        let mut token = [0u8; 16];
        for (i, b) in token.iter_mut().enumerate() {
            *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2).ok_or_else(|| bad("bad hex"))?, 16)
                .map_err(|_| bad("bad hex"))?;
        }
        Ok(UniqueId {
            address: address.to_owned(),
            token,
        })
    }

    /// The job token this id carries.
    pub fn job_token(&self) -> JobToken {
        JobToken::new(self.token.to_vec())
    }
}

/// Binds rank 0's rendezvous listener now (on every interface, a port the system picks) and
/// keeps it for this process's rank-0 rendezvous on that port, so the port cannot be taken
/// before the job forms; returns the `host:port` the other ranks dial: `NODETOUR_MASTER_ADDR`
/// where set, else the address of the interface that holds the default route, else 127.0.0.1.
/// For runtimes whose store carries the address but no secret (the token then comes from the
/// job policy, [`job_token`]).
pub fn bind_rendezvous() -> Result<String> {
    let listener = std::net::TcpListener::bind("0.0.0.0:0").map_err(|source| Error::Exchange {
        op: "listen",
        peer: "0.0.0.0:0".into(),
        source,
    })?;
    let port = listener
        .local_addr()
        .map_err(|source| Error::Exchange {
            op: "listen",
            peer: "0.0.0.0:0".into(),
            source,
        })?
        .port();
    let host = match nodetour_core::knobs::Env::process().get("NODETOUR_MASTER_ADDR") {
        Some(h) => h,
        // A UDP "connect" to a public address picks the default route's interface; no packet
        // is sent.
        _ => host::local_ip_towards("192.0.2.1", 9).to_string(),
    };
    rendezvous::park_listener(port, listener);
    Ok(format!("{host}:{port}"))
}

/// The job's token under the job policy (`shared` security policy, README "Security"):
/// `NODETOUR_JOB_TOKEN` where set (authenticated); else, where the launcher names the job
/// ([`LaunchInfo::job_id`]), a token keyed by that name, unauthenticated (two jobs never
/// cross; anyone who knows the name can join; a warning here, and `paths()` says so); else an
/// error that says how to set a token.
pub fn job_token(info: &LaunchInfo) -> Result<JobToken> {
    let env = nodetour_core::knobs::Env::process();
    job_token_from(info.job_id.as_deref(), &|k| env.any(k))
}

/// [`job_token`] for tools that take their rank from arguments, not a launcher (the two-node
/// examples): the job is named only by `NODETOUR_JOB_ID`.
pub fn explicit_job_token() -> Result<JobToken> {
    let env = nodetour_core::knobs::Env::process();
    let job = env.get("NODETOUR_JOB_ID").map(|v| format!("nodetour:{v}"));
    job_token_from(job.as_deref(), &|k| env.any(k))
}

/// [`job_token`] for a job named `job_id` (if at all), reading through `lookup`.
pub fn job_token_from(
    job_id: Option<&str>,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<JobToken> {
    if let Some(t) = lookup("NODETOUR_JOB_TOKEN").filter(|t| !t.is_empty()) {
        return Ok(JobToken::new(t.into_bytes()));
    }
    match job_id {
        Some(job) => {
            nodetour_core::notice::warn(format_args!(
                "NODETOUR_JOB_TOKEN is not set: job {job} is unauthenticated (keyed by the launcher's job id: jobs stay apart, but anyone who knows the id and reaches the ports can join)"
            ));
            Ok(JobToken::unauthenticated(job))
        }
        None => Err(Error::InvalidConfig {
            name: "NODETOUR_JOB_TOKEN",
            value: String::new(),
            reason: "not set, and the launcher names no job (no SLURM_JOB_ID, \
                     OMPI_MCA_ess_base_jobid, TORCHELASTIC_RUN_ID or NODETOUR_JOB_ID): set \
                     NODETOUR_JOB_TOKEN to one secret shared by every rank, e.g. \
                     `export NODETOUR_JOB_TOKEN=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n')` \
                     before launching (or NODETOUR_JOB_ID for an unauthenticated job on a \
                     trusted network)"
                .into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_policy_takes_the_token_else_the_launchers_job_id_else_refuses() {
        let with = |k: &str| (k == "NODETOUR_JOB_TOKEN").then(|| "s3cret".to_owned());
        let t = job_token_from(Some("slurm:7.0"), &with).unwrap();
        assert!(t.is_authenticated());
        let none = |_: &str| None;
        let t = job_token_from(Some("slurm:7.0"), &none).unwrap();
        assert!(!t.is_authenticated() && t.describe().contains("slurm:7.0"));
        // Two jobs' unauthenticated keys differ: their proofs do not cross.
        let u = job_token_from(Some("slurm:8.0"), &none).unwrap();
        let n = auth::nonce();
        assert!(!u.verify_client(&n, 1, 2, &t.client_proof(&n, 1, 2)));
        let e = job_token_from(None, &none).unwrap_err();
        assert!(e.to_string().contains("NODETOUR_JOB_TOKEN"), "{e}");
    }

    #[test]
    fn unique_ids_round_trip_and_reject_garbage() {
        let id = UniqueId::new("node0:29600");
        let text = id.encode();
        assert!(text.starts_with("ndt1:") && text.ends_with("@node0:29600"));
        assert_eq!(UniqueId::decode(&text).unwrap(), id);
        assert_ne!(UniqueId::new("x").token, UniqueId::new("x").token);
        for bad in [
            "",
            "ndt2:00@x",
            "ndt1:zz@x",
            "ndt1:0011@x",
            "ndt1:00112233445566778899aabbccddeeff@",
            "ndt1:00112233445566778899aabbccddeeffx",
        ] {
            assert!(UniqueId::decode(bad).is_err(), "{bad}");
        }
        assert!(
            !format!("{id:?}").contains(&text[5..37]),
            "Debug does not print the token"
        );
    }
}

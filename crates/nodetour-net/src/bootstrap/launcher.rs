//! Who am I in the job: rank, world size, local rank and the rendezvous address, from the
//! launchers people use (torchrun, Slurm, Open MPI) or explicit values.
//!
//! Pure: [`LaunchInfo::from_lookup`] reads through a closure, so every launcher is unit-tested
//! without touching the process environment.

use nodetour_core::{Error, Result};

/// Default rendezvous port when neither `NODETOUR_PORT` nor `MASTER_PORT` is set (a job the
/// launcher names takes one of the [`JOB_PORTS`] ports from here, by its name).
pub const DEFAULT_PORT: u16 = 29600;
/// Ports the launcher's job identity chooses among.
pub const JOB_PORTS: u32 = 1000;

/// The launcher's name for the job (`NODETOUR_JOB_ID` first, for any launcher).
fn job_identity(launcher: Launcher, get: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    if let Some(id) = get("NODETOUR_JOB_ID") {
        return Some(format!("nodetour:{id}"));
    }
    match launcher {
        Launcher::Explicit => None,
        // torchrun's default run id is "none" (not a name); --standalone makes a random one.
        Launcher::Torchrun => get("TORCHELASTIC_RUN_ID")
            .filter(|id| id != "none")
            .map(|id| format!("torchrun:{id}")),
        Launcher::Slurm => {
            let job = get("SLURM_JOB_ID")?;
            Some(format!(
                "slurm:{job}.{}",
                get("SLURM_STEP_ID").unwrap_or_else(|| "-".into())
            ))
        }
        Launcher::OpenMpi => get("OMPI_MCA_ess_base_jobid")
            .map(|id| format!("ompi:{id}"))
            .or_else(|| get("PMIX_NAMESPACE").map(|ns| format!("pmix:{ns}"))),
    }
}

fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    })
}
/// `NODETOUR_PORT` defaults to `MASTER_PORT + PORT_OFFSET`: torchrun's agent already listens on
/// `MASTER_PORT`, so nodetour must not.
pub const PORT_OFFSET: u16 = 17;

/// Where the process's identity came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Explicit values (arguments, or `NODETOUR_RANK`/`NODETOUR_WORLD_SIZE`).
    Explicit,
    /// torchrun / torch.distributed.launch (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    Torchrun,
    /// Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// Open MPI (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`).
    OpenMpi,
}

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchInfo {
    /// Rank, `0..world_size`.
    pub rank: u32,
    /// Number of ranks.
    pub world_size: u32,
    /// Rank among the processes of this host, if the launcher says.
    pub local_rank: Option<u32>,
    /// Host of rank 0's rendezvous listener.
    pub master_addr: String,
    /// Its port.
    pub port: u16,
    /// Which launcher provided the values.
    pub launcher: Launcher,
    /// The launcher's name for this job, where it gives one: `slurm:<job>.<step>`,
    /// `ompi:<job id>`, `torchrun:<run id>`, or `nodetour:<NODETOUR_JOB_ID>`. A job without a
    /// token is keyed by it (see [`crate::bootstrap::job_token`]).
    pub job_id: Option<String>,
}

impl LaunchInfo {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        let env = nodetour_core::knobs::Env::process();
        Self::from_lookup(|k| env.any(k))
    }

    /// Reads through `lookup`. Precedence: `NODETOUR_RANK`/`NODETOUR_WORLD_SIZE`, torchrun,
    /// Open MPI, Slurm. The address: `NODETOUR_MASTER_ADDR`, `MASTER_ADDR`, then Slurm's
    /// `SLURM_LAUNCH_NODE_IPADDR`. The port: `NODETOUR_PORT`, else `MASTER_PORT + 17`, else 29600.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let get = |k: &str| {
            lookup(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let sets: [(Launcher, &str, &str, Option<&str>); 4] = [
            (
                Launcher::Explicit,
                "NODETOUR_RANK",
                "NODETOUR_WORLD_SIZE",
                Some("NODETOUR_LOCAL_RANK"),
            ),
            (Launcher::Torchrun, "RANK", "WORLD_SIZE", Some("LOCAL_RANK")),
            (
                Launcher::OpenMpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                Some("OMPI_COMM_WORLD_LOCAL_RANK"),
            ),
            (
                Launcher::Slurm,
                "SLURM_PROCID",
                "SLURM_NTASKS",
                Some("SLURM_LOCALID"),
            ),
        ];
        let (launcher, rank_var, size_var, local_var) = sets
            .iter()
            .find(|(_, r, _, _)| get(r).is_some())
            .copied()
            .ok_or_else(|| Error::InvalidConfig {
                name: "RANK",
                value: String::new(),
                reason: "no rank in the environment: set RANK/WORLD_SIZE (torchrun), or run under Slurm or Open MPI, or pass them explicitly".into(),
            })?;
        let rank = parse_u32(rank_var, &get(rank_var).unwrap_or_default())?;
        let world_size = parse_u32(
            size_var,
            &get(size_var).ok_or_else(|| Error::InvalidConfig {
                name: "WORLD_SIZE",
                value: String::new(),
                reason: format!("{rank_var} is set but {size_var} is not"),
            })?,
        )?;
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidConfig {
                name: "RANK",
                value: rank.to_string(),
                reason: format!("rank must be below the world size {world_size}"),
            });
        }
        let local_rank = match local_var.and_then(get) {
            Some(v) => Some(parse_u32("LOCAL_RANK", &v)?),
            None => None,
        };
        let job_id = job_identity(launcher, &get);
        let master_addr = get("NODETOUR_MASTER_ADDR")
            .or_else(|| get("MASTER_ADDR"))
            .or_else(|| get("SLURM_LAUNCH_NODE_IPADDR"))
            .ok_or_else(|| Error::InvalidConfig {
                name: "MASTER_ADDR",
                value: String::new(),
                reason:
                    "no rendezvous host: set MASTER_ADDR (or NODETOUR_MASTER_ADDR) to rank 0's host"
                        .into(),
            })?;
        let port = match (get("NODETOUR_PORT"), get("MASTER_PORT")) {
            (Some(p), _) => parse_port("NODETOUR_PORT", &p)?,
            (None, Some(m)) => parse_port("MASTER_PORT", &m)?
                .checked_add(PORT_OFFSET)
                .ok_or_else(|| Error::InvalidConfig {
                    name: "MASTER_PORT",
                    value: m.clone(),
                    reason: format!("MASTER_PORT + {PORT_OFFSET} exceeds 65535: set NODETOUR_PORT"),
                })?,
            // Two jobs whose rank 0 share a host get different ports.
            (None, None) => match &job_id {
                Some(id) => DEFAULT_PORT + (fnv1a(id.as_bytes()) % JOB_PORTS) as u16,
                None => DEFAULT_PORT,
            },
        };
        Ok(LaunchInfo {
            rank,
            world_size,
            local_rank,
            master_addr,
            port,
            launcher,
            job_id,
        })
    }

    /// `host:port` of the rendezvous.
    pub fn rendezvous_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.port)
        } else {
            format!("{}:{}", self.master_addr, self.port)
        }
    }
}

fn parse_u32(name: &'static str, v: &str) -> Result<u32> {
    v.parse().map_err(|_| Error::InvalidConfig {
        name,
        value: v.to_owned(),
        reason: "expected a whole number".into(),
    })
}

fn parse_port(name: &'static str, v: &str) -> Result<u16> {
    v.parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| Error::InvalidConfig {
            name,
            value: v.to_owned(),
            reason: "expected a port number from 1 to 65535".into(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn info(vars: &[(&str, &str)]) -> Result<LaunchInfo> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchInfo::from_lookup(|k| m.get(k).cloned())
    }

    #[test]
    fn torchrun_and_the_derived_port() {
        let i = info(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29500"),
        ])
        .unwrap();
        assert_eq!(
            (i.rank, i.world_size, i.local_rank, i.launcher),
            (3, 8, Some(1), Launcher::Torchrun)
        );
        assert_eq!(i.port, 29517, "never torchrun's own MASTER_PORT");
        assert_eq!(i.rendezvous_addr(), "node0:29517");
    }

    #[test]
    fn slurm_and_open_mpi() {
        let s = info(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "16"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.9"),
        ])
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.launcher),
            (5, 16, Some(1), Launcher::Slurm)
        );
        assert_eq!((s.master_addr.as_str(), s.port), ("10.0.0.9", DEFAULT_PORT));
        let o = info(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "::1"),
            ("NODETOUR_PORT", "4000"),
        ])
        .unwrap();
        assert_eq!((o.launcher, o.port), (Launcher::OpenMpi, 4000));
        assert_eq!(o.rendezvous_addr(), "[::1]:4000");
    }

    #[test]
    fn each_launcher_names_its_job_and_two_jobs_take_different_ports() {
        let slurm = |job: &str| {
            info(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_LAUNCH_NODE_IPADDR", "10.0.0.9"),
                ("SLURM_JOB_ID", job),
                ("SLURM_STEP_ID", "3"),
            ])
            .unwrap()
        };
        let (a, b) = (slurm("1234"), slurm("1235"));
        assert_eq!(a.job_id.as_deref(), Some("slurm:1234.3"));
        assert_ne!(a.port, b.port, "two jobs' rank 0 on one host");
        assert!((DEFAULT_PORT..DEFAULT_PORT + JOB_PORTS as u16).contains(&a.port));
        let torch = |run: &str| {
            info(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "x"),
                ("MASTER_PORT", "29500"),
                ("TORCHELASTIC_RUN_ID", run),
            ])
            .unwrap()
            .job_id
        };
        assert_eq!(torch("f00d").as_deref(), Some("torchrun:f00d"));
        assert_eq!(
            torch("none"),
            None,
            "torchrun's default run id names no job"
        );
        let o = info(&[
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "x"),
            ("OMPI_MCA_ess_base_jobid", "77"),
        ])
        .unwrap();
        assert_eq!(o.job_id.as_deref(), Some("ompi:77"));
        let e = info(&[
            ("NODETOUR_RANK", "0"),
            ("NODETOUR_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "x"),
        ])
        .unwrap();
        assert_eq!(e.job_id, None);
    }

    #[test]
    fn explicit_values_win() {
        let i = info(&[
            ("NODETOUR_RANK", "1"),
            ("NODETOUR_WORLD_SIZE", "2"),
            ("RANK", "7"),
            ("WORLD_SIZE", "9"),
            ("NODETOUR_MASTER_ADDR", "a"),
            ("MASTER_ADDR", "b"),
        ])
        .unwrap();
        assert_eq!(
            (i.rank, i.world_size, i.launcher, i.master_addr.as_str()),
            (1, 2, Launcher::Explicit, "a")
        );
    }

    #[test]
    fn bad_environments_are_typed_errors() {
        for vars in [
            vec![],
            vec![("RANK", "0")],
            vec![("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "x")],
            vec![("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "x")],
            vec![("RANK", "0"), ("WORLD_SIZE", "0"), ("MASTER_ADDR", "x")],
            vec![("RANK", "0"), ("WORLD_SIZE", "2")],
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "x"),
                ("NODETOUR_PORT", "0"),
            ],
            vec![
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "x"),
                ("MASTER_PORT", "65530"),
            ],
        ] {
            assert!(
                matches!(info(&vars), Err(Error::InvalidConfig { .. })),
                "{vars:?}"
            );
        }
    }
}

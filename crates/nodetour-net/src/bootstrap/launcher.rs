//! Who am I in the job: rank, world size, local rank and the rendezvous address, from the
//! launchers people use (torchrun, Slurm, Open MPI, MPICH's Hydra and other PMI launchers) or
//! explicit values.
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
fn job_identity(
    launcher: Launcher,
    get: &dyn Fn(&str) -> Option<String>,
    one_host: bool,
    parent: Option<u32>,
) -> Option<String> {
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
        // Hydra names no job in the environment; its PMI server's address (PMI_PORT, where it
        // uses one) is the job's own, and on one host every rank is a child of the same
        // proxy process.
        Launcher::Pmi => get("PMIX_NAMESPACE")
            .map(|ns| format!("pmix:{ns}"))
            .or_else(|| get("PMI_PORT").map(|p| format!("pmi:{p}")))
            .or_else(|| {
                parent
                    .filter(|_| one_host)
                    .map(|pid| format!("pmi:proxy{pid}"))
            }),
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
#[non_exhaustive]
pub enum Launcher {
    /// Explicit values (arguments, or `NODETOUR_RANK`/`NODETOUR_WORLD_SIZE`).
    Explicit,
    /// torchrun / torch.distributed.launch (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`).
    Torchrun,
    /// Slurm (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`).
    Slurm,
    /// Open MPI (`OMPI_COMM_WORLD_RANK`, `_SIZE`, `_LOCAL_RANK`).
    OpenMpi,
    /// MPICH's Hydra and other PMI launchers (`PMI_RANK`, `PMI_SIZE`, `MPI_LOCALRANKID`).
    Pmi,
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
    /// Reads the process environment (and this process's parent, which names a one-host PMI
    /// job).
    pub fn from_env() -> Result<Self> {
        let env = nodetour_core::knobs::Env::process();
        Self::from_parts(|k| env.any(k), Some(std::os::unix::process::parent_id()))
    }

    /// Reads through `lookup`. Precedence: `NODETOUR_RANK`/`NODETOUR_WORLD_SIZE`, torchrun,
    /// Open MPI, MPICH/PMI, Slurm.
    ///
    /// The address of rank 0: `NODETOUR_MASTER_ADDR`, `MASTER_ADDR`; else the launcher's: a job
    /// on one host (every rank local: `LOCAL_WORLD_SIZE`, `OMPI_COMM_WORLD_LOCAL_SIZE`,
    /// `MPI_LOCALNRANKS`, `SLURM_STEP_NUM_NODES`) needs none (127.0.0.1); under Slurm the
    /// step's first node (`SLURM_STEP_NODELIST`, task 0's node under block and cyclic
    /// distribution); otherwise an error naming `MASTER_ADDR`.
    ///
    /// The port: `NODETOUR_PORT`, else `MASTER_PORT + 17`, else one of 1000 ports from 29600
    /// chosen by the launcher's job (and step) identity, so two jobs or two steps whose rank 0
    /// share a host do not collide.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::from_parts(lookup, None)
    }

    fn from_parts(lookup: impl Fn(&str) -> Option<String>, parent: Option<u32>) -> Result<Self> {
        let get = |k: &str| {
            lookup(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let sets: [(Launcher, &str, &str, Option<&str>); 5] = [
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
                Launcher::Pmi,
                "PMI_RANK",
                "PMI_SIZE",
                Some("MPI_LOCALRANKID"),
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
        let one_host = one_host(launcher, &get, world_size);
        let job_id = job_identity(launcher, &get, one_host, parent);
        let master_addr = match get("NODETOUR_MASTER_ADDR").or_else(|| get("MASTER_ADDR")) {
            Some(a) => a,
            None => launcher_address(launcher, &get, one_host)?,
        };
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

/// Whether the launcher says every rank runs on this host.
fn one_host(launcher: Launcher, get: &dyn Fn(&str) -> Option<String>, world: u32) -> bool {
    let local = |var: &str| get(var).and_then(|v| v.parse::<u32>().ok());
    match launcher {
        Launcher::Explicit => false,
        Launcher::Torchrun => local("LOCAL_WORLD_SIZE") == Some(world),
        Launcher::OpenMpi => local("OMPI_COMM_WORLD_LOCAL_SIZE") == Some(world),
        Launcher::Pmi => local("MPI_LOCALNRANKS") == Some(world),
        Launcher::Slurm => {
            local("SLURM_STEP_NUM_NODES").or_else(|| local("SLURM_NNODES")) == Some(1)
        }
    }
}

/// Rank 0's host as the launcher gives it, when `MASTER_ADDR` is not set.
fn launcher_address(
    launcher: Launcher,
    get: &dyn Fn(&str) -> Option<String>,
    one_host: bool,
) -> Result<String> {
    if one_host {
        return Ok("127.0.0.1".into());
    }
    let missing = |why: String| Error::InvalidConfig {
        name: "MASTER_ADDR",
        value: String::new(),
        reason: format!(
            "no rendezvous host: {why}; set MASTER_ADDR (or NODETOUR_MASTER_ADDR) to rank 0's host"
        ),
    };
    if launcher != Launcher::Slurm {
        return Err(missing(format!(
            "{launcher:?} gives no address of rank 0's host for a job on several hosts"
        )));
    }
    if get("SLURM_DISTRIBUTION").is_some_and(|d| d.starts_with("arbitrary")) {
        return Err(missing(
            "under Slurm's arbitrary distribution task 0's node is not the first".into(),
        ));
    }
    let list = get("SLURM_STEP_NODELIST")
        .or_else(|| get("SLURM_JOB_NODELIST"))
        .or_else(|| get("SLURM_NODELIST"))
        .ok_or_else(|| missing("Slurm gave no node list".into()))?;
    super::nodelist::first(&list).map_err(|e| Error::InvalidConfig {
        name: "SLURM_STEP_NODELIST",
        value: list.clone(),
        reason: e,
    })
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
        info_of(vars, None)
    }

    fn info_of(vars: &[(&str, &str)], parent: Option<u32>) -> Result<LaunchInfo> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        LaunchInfo::from_parts(|k| m.get(k).cloned(), parent)
    }

    #[test]
    fn slurm_finds_rank_0_on_the_steps_first_node() {
        let slurm = |extra: &[(&'static str, &'static str)]| {
            let mut v = vec![
                ("SLURM_PROCID", "9"),
                ("SLURM_NTASKS", "16"),
                ("SLURM_LOCALID", "1"),
                ("SLURM_STEP_NUM_NODES", "4"),
                ("SLURM_JOB_ID", "88"),
                ("SLURM_STEP_ID", "0"),
            ];
            v.extend_from_slice(extra);
            info(&v)
        };
        // Block and cyclic alike: task 0 is on the step's first node.
        for dist in ["block", "cyclic", "cyclic:cyclic", "plane=2"] {
            let i = slurm(&[
                ("SLURM_STEP_NODELIST", "n[01-03,07]"),
                ("SLURM_DISTRIBUTION", dist),
            ])
            .unwrap();
            assert_eq!(i.master_addr, "n01", "{dist}");
        }
        let i = slurm(&[("SLURM_JOB_NODELIST", "gpu[12-13],cpu[1-2]")]).unwrap();
        assert_eq!(i.master_addr, "gpu12", "the job's list without a step list");
        // The step's list wins over the job's (a step on part of the allocation).
        let i = slurm(&[
            ("SLURM_JOB_NODELIST", "n[01-08]"),
            ("SLURM_STEP_NODELIST", "n[05-08]"),
        ])
        .unwrap();
        assert_eq!(i.master_addr, "n05");
        assert!(slurm(&[("SLURM_STEP_NODELIST", "n[01-")]).is_err());
        assert!(
            slurm(&[
                ("SLURM_STEP_NODELIST", "n[01-04]"),
                ("SLURM_DISTRIBUTION", "arbitrary")
            ])
            .is_err(),
            "arbitrary distribution: task 0 may be anywhere"
        );
        assert!(slurm(&[]).is_err(), "no node list");
        // One node: no address needed.
        let one = info(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_STEP_NUM_NODES", "1"),
            ("SLURM_STEP_NODELIST", "somewhere"),
        ])
        .unwrap();
        assert_eq!(one.master_addr, "127.0.0.1");
    }

    #[test]
    fn one_host_jobs_of_mpirun_and_mpich_need_no_address_and_name_their_job() {
        let ompi = info(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "3"),
            ("OMPI_MCA_ess_base_jobid", "4242"),
        ])
        .unwrap();
        assert_eq!(
            (
                ompi.master_addr.as_str(),
                ompi.local_rank,
                ompi.job_id.as_deref()
            ),
            ("127.0.0.1", Some(3), Some("ompi:4242"))
        );
        let mpich = |parent, local: &'static str| {
            info_of(
                &[
                    ("PMI_RANK", "1"),
                    ("PMI_SIZE", "4"),
                    ("MPI_LOCALRANKID", "1"),
                    ("MPI_LOCALNRANKS", local),
                ],
                parent,
            )
        };
        let a = mpich(Some(700), "4").unwrap();
        assert_eq!(
            (
                a.launcher,
                a.rank,
                a.master_addr.as_str(),
                a.job_id.as_deref()
            ),
            (Launcher::Pmi, 1, "127.0.0.1", Some("pmi:proxy700"))
        );
        let b = mpich(Some(701), "4").unwrap();
        assert_ne!(a.port, b.port, "two one-host MPICH jobs");
        // On several hosts neither the address nor a job name can be had.
        let e = mpich(Some(700), "2").unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let named = info(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("MASTER_ADDR", "h0"),
            ("PMI_PORT", "h0:4567"),
        ])
        .unwrap();
        assert_eq!(named.job_id.as_deref(), Some("pmi:h0:4567"));
        // torchrun on one node (it sets MASTER_ADDR anyway; without it, none is needed).
        let t = info(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_WORLD_SIZE", "2"),
        ])
        .unwrap();
        assert_eq!(t.master_addr, "127.0.0.1");
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
            ("SLURM_STEP_NODELIST", "n[1-4]"),
        ])
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.launcher),
            (5, 16, Some(1), Launcher::Slurm)
        );
        assert_eq!((s.master_addr.as_str(), s.port), ("n1", DEFAULT_PORT));
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
                ("SLURM_STEP_NODELIST", "n[1-2]"),
                ("SLURM_JOB_ID", job),
                ("SLURM_STEP_ID", "3"),
            ])
            .unwrap()
        };
        let (a, b) = (slurm("1234"), slurm("1235"));
        assert_eq!(a.job_id.as_deref(), Some("slurm:1234.3"));
        let step = |s: &str| {
            info(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "2"),
                ("SLURM_STEP_NODELIST", "n[1-2]"),
                ("SLURM_JOB_ID", "1234"),
                ("SLURM_STEP_ID", s),
            ])
            .unwrap()
            .port
        };
        assert_ne!(step("3"), step("4"), "two steps of one job");
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

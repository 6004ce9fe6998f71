//! The transport table (as NCCL's): every link kind in one list, in order of preference, each
//! saying whether it can join two ranks from what both announced, and why; one chooser per kind
//! of memory picks the first that can, honouring `NODETOUR_TRANSPORT`, with the reason. Pure:
//! both ends of a link, and every rank of the job, choose alike from the same announcements.
//!
//! | kind | memory | can connect when |
//! |---|---|---|
//! | cuda-ipc | GPU | same host, both pass GPU memory, different processes (the mapping is tried when the ring forms; a GPU that cannot map its neighbour's memory falls to the next row) |
//! | shm | GPU | same host, both pass GPU memory, different processes |
//! | tcp (network link) | GPU | both pass GPU memory on different hosts, or a host kind forced (the GPU ring's network link: a progress thread carries the stream program's chunks; verbs where the host links chose verbs) |
//! | verbs | host | both ranks opened an RDMA device |
//! | tcp | host | always |
//!
//! The GPU ring forms when every link of the ring has a GPU row (in-host links between
//! processes of one host, network links between hosts) and no two ranks share a process. Ranks
//! of one process share its CUDA context: one rank's implicitly synchronising call (a free, a
//! module load) would wait for another rank's stream, which waits for the first rank's
//! progress, so their GPU buffers are staged through the host ring (synchronous), as are those
//! of a job where a rank passes host memory. RDMA writes into GPU slots (verbs, GPUDirect) are
//! the row to come above the network link.

use std::fmt;

use nodetour_core::transport::TransportKind;

use super::links::LinkSteps;
use super::links::cuda_ipc::CudaIpc;
use super::links::gpu_steps::GpuLinkSteps;
use super::links::shm::Shm;
use super::links::tcp::Tcp;
use super::links::verbs::Verbs;
use crate::comm::links::Announcement;
use crate::comm::paths::Landing;
use crate::error::{Error, Result};

/// Which memory a link kind carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Memory {
    /// Host memory: the host ring's links.
    Host,
    /// GPU memory: the GPU ring's links (stream-ordered).
    Device,
}

/// Two ranks that may be linked, as both announced themselves.
pub(crate) struct Pair<'a> {
    /// This rank's announcement, and its rank.
    pub ours: (&'a Announcement, u32),
    /// The peer's announcement, and its rank.
    pub theirs: (&'a Announcement, u32),
    /// Whether both share one host (the bootstrap's host identities).
    pub same_host: bool,
    /// Why this rank has no RDMA device (when it has none).
    pub why_no_verbs: &'a str,
}

/// The table's reasons, typed: why a row can or cannot join two ranks, why a host link took
/// its kind, why the GPU ring forms or not, why a network link's side keeps its slots in host
/// memory (`net_direct.rs`). Displayed as the words `paths()` and the log show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Why {
    /// Both ranks pass GPU memory on one host, in different processes.
    GpusOfOneHost,
    /// Both ranks pass GPU memory, on different hosts.
    GpusOnOtherHosts,
    /// Both ranks opened an RDMA device.
    BothHaveVerbs,
    /// tcp joins any two ranks.
    TcpReachesAll,
    /// The two ranks are on different hosts.
    OtherHosts { me: u32, peer: u32 },
    /// A rank passes host memory only.
    HostMemoryOnly { rank: u32 },
    /// The two ranks are threads of one process.
    OneProcess { me: u32, peer: u32 },
    /// The two ranks share a host.
    OneHost { me: u32, peer: u32 },
    /// The peer has no RDMA device.
    PeerHasNoVerbs { peer: u32 },
    /// This rank has no RDMA device, and why.
    NoVerbsHere(String),
    /// `NODETOUR_TRANSPORT` chose the kind.
    Forced(TransportKind),
    /// The preferred kinds were refused (each with its reason); this one was taken.
    FellBack {
        refused: Vec<Why>,
        taken: TransportKind,
    },
    /// Ranks share a process somewhere in the job: no GPU ring.
    ProcessShared,
    /// A host kind forced: every link of the GPU ring a network link.
    ForcedNetwork(TransportKind),
    /// Every link joins GPUs: in-host kinds within a host, a network link between hosts.
    GpusWithNetwork {
        direct: TransportKind,
        staged: TransportKind,
        network: TransportKind,
    },
    /// Every link joins GPUs of one host.
    GpusInHost {
        direct: TransportKind,
        staged: TransportKind,
    },
    /// A network link over this kind, not verbs: the CPU carries its chunks (no direct path).
    CpuCarries(TransportKind),
    /// `NODETOUR_NET_LANDING=host`: no direct path.
    LandingHost,
    /// `NODETOUR_GDR=off`: no direct path.
    GdrOff,
    /// This rank has no RDMA device: no direct path.
    NoRdmaDevice,
    /// What would make a chunk the NIC wrote visible to the GPU could not be decided (core's
    /// words).
    NoVisibility(String),
    /// The registration ladder ended on staging (its account of each rung).
    LadderStaged(String),
}

impl fmt::Display for Why {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Why::GpusOfOneHost => {
                f.write_str("both pass GPU memory on one host, in different processes")
            }
            Why::GpusOnOtherHosts => f.write_str("GPUs on different hosts: a network link"),
            Why::BothHaveVerbs => f.write_str("both ranks have an RDMA device"),
            Why::TcpReachesAll => f.write_str("tcp reaches every rank"),
            Why::OtherHosts { me, peer } => {
                write!(f, "ranks {me} and {peer} are on different hosts")
            }
            Why::HostMemoryOnly { rank } => write!(f, "rank {rank} passes host memory only"),
            Why::OneProcess { me, peer } => write!(
                f,
                "ranks {me} and {peer} share a process (cuda-ipc cannot map memory within one \
                 process; several GPUs of one process: Communicator::from_devices)"
            ),
            Why::OneHost { me, peer } => write!(f, "ranks {me} and {peer} share a host"),
            Why::PeerHasNoVerbs { peer } => write!(f, "rank {peer} has no RDMA device"),
            Why::NoVerbsHere(why) => write!(f, "this rank has no RDMA device ({why})"),
            Why::Forced(k) => write!(f, "NODETOUR_TRANSPORT={k}"),
            Why::FellBack { refused, taken } => {
                for (i, r) in refused.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{r}")?;
                }
                write!(f, ": {taken}")
            }
            Why::ProcessShared => f.write_str(
                "ranks share a process (one CUDA context: staged through the host ring)",
            ),
            Why::ForcedNetwork(k) => write!(f, "NODETOUR_TRANSPORT={k}: every link a network link"),
            Why::GpusWithNetwork {
                direct,
                staged,
                network,
            } => write!(
                f,
                "every link joins GPUs: {direct} or {staged} within a host, a network link \
                 ({network}) between hosts"
            ),
            Why::GpusInHost { direct, staged } => write!(
                f,
                "every link joins GPUs of one host ({direct} where the next GPU's memory maps, \
                 else {staged})"
            ),
            Why::CpuCarries(kind) => write!(
                f,
                "the link is {kind}: the CPU carries the chunks (RDMA needs a verbs link)"
            ),
            Why::LandingHost => f.write_str("NODETOUR_NET_LANDING=host"),
            Why::GdrOff => f.write_str("NODETOUR_GDR=off"),
            Why::NoRdmaDevice => f.write_str("no RDMA device"),
            Why::NoVisibility(why) | Why::LadderStaged(why) => f.write_str(why),
        }
    }
}

/// One row: a link kind, the memory it carries, its test, and its own formation steps.
struct Row {
    kind: TransportKind,
    memory: Memory,
    /// `Ok(why it can)` or `Err(why it cannot)`.
    can_connect: fn(&Pair<'_>) -> std::result::Result<Why, Why>,
    steps: Steps,
}

/// A row's formation steps.
enum Steps {
    /// A host link kind's allocate and connect ([`super::links`]).
    Host(&'static dyn LinkSteps),
    /// An in-host GPU link kind's connect and stream links ([`super::links::gpu_steps`]).
    Gpu(&'static dyn GpuLinkSteps),
    /// A network link between GPUs: formed by the host kind the host links chose, through
    /// that kind's [`Steps::Host`] (`net.rs`).
    OverHostKind,
}

/// The table, in order of preference within each kind of memory.
static TABLE: [Row; 5] = [
    Row {
        kind: TransportKind::CudaIpc,
        memory: Memory::Device,
        can_connect: gpus_of_one_host,
        steps: Steps::Gpu(&CudaIpc),
    },
    Row {
        kind: TransportKind::Shm,
        memory: Memory::Device,
        can_connect: gpus_of_one_host,
        steps: Steps::Gpu(&Shm),
    },
    Row {
        kind: TransportKind::Tcp,
        memory: Memory::Device,
        can_connect: gpus_on_other_hosts,
        steps: Steps::OverHostKind,
    },
    Row {
        kind: TransportKind::Verbs,
        memory: Memory::Host,
        can_connect: both_have_verbs,
        steps: Steps::Host(&Verbs),
    },
    Row {
        kind: TransportKind::Tcp,
        memory: Memory::Host,
        can_connect: |_| Ok(Why::TcpReachesAll),
        steps: Steps::Host(&Tcp),
    },
];

/// The host link kinds and their formation steps, in the table's order (formation allocates
/// and connects each kind's links in turn).
pub(crate) fn host_steps() -> impl Iterator<Item = (TransportKind, &'static dyn LinkSteps)> {
    TABLE.iter().filter_map(|r| match r.steps {
        Steps::Host(s) => Some((r.kind, s)),
        _ => None,
    })
}

/// The in-host GPU link kinds and their formation steps, in the table's order (formation
/// connects the GPU ring's link to the next rank by the first that can).
pub(crate) fn gpu_steps() -> impl Iterator<Item = (TransportKind, &'static dyn GpuLinkSteps)> {
    TABLE.iter().filter_map(|r| match r.steps {
        Steps::Gpu(s) => Some((r.kind, s)),
        _ => None,
    })
}

/// The first of the pair that passes host memory only.
fn host_memory_only(p: &Pair<'_>) -> Option<Why> {
    [p.ours, p.theirs]
        .iter()
        .find(|(a, _)| a.gpu.is_none())
        .map(|(_, rank)| Why::HostMemoryOnly { rank: *rank })
}

fn gpus_of_one_host(p: &Pair<'_>) -> std::result::Result<Why, Why> {
    let ((ours, me), (theirs, peer)) = (p.ours, p.theirs);
    if !p.same_host {
        return Err(Why::OtherHosts { me, peer });
    }
    if let Some(why) = host_memory_only(p) {
        return Err(why);
    }
    if ours.pid == theirs.pid {
        return Err(Why::OneProcess { me, peer });
    }
    Ok(Why::GpusOfOneHost)
}

fn gpus_on_other_hosts(p: &Pair<'_>) -> std::result::Result<Why, Why> {
    let ((_, me), (_, peer)) = (p.ours, p.theirs);
    if let Some(why) = host_memory_only(p) {
        return Err(why);
    }
    if p.same_host {
        return Err(Why::OneHost { me, peer });
    }
    Ok(Why::GpusOnOtherHosts)
}

/// Whether the GPU ring joins `pair` by a network link (rather than cuda-ipc or shm): ranks on
/// different hosts, or every link when `NODETOUR_TRANSPORT` forces a host kind (tcp, verbs).
/// Pure: both ends, and every rank, decide alike.
pub(crate) fn network_link(pair: &Pair<'_>, forced: Option<TransportKind>) -> bool {
    forced.is_some_and(is_host) || gpus_on_other_hosts(pair).is_ok()
}

fn both_have_verbs(p: &Pair<'_>) -> std::result::Result<Why, Why> {
    let ((ours, _), (theirs, peer)) = (p.ours, p.theirs);
    match (ours.has_verbs, theirs.has_verbs) {
        (true, true) => Ok(Why::BothHaveVerbs),
        (true, false) => Err(Why::PeerHasNoVerbs { peer }),
        _ => Err(Why::NoVerbsHere(p.why_no_verbs.to_owned())),
    }
}

/// Both ranks must be told the same `NODETOUR_TRANSPORT`.
fn same_override(p: &Pair<'_>) -> Result<()> {
    let ((ours, me), (theirs, peer)) = (p.ours, p.theirs);
    if ours.forced == theirs.forced {
        return Ok(());
    }
    let show = |k: Option<TransportKind>| match k {
        Some(k) => format!("NODETOUR_TRANSPORT={k}"),
        None => "no NODETOUR_TRANSPORT".to_owned(),
    };
    Err(Error::InvalidArgument {
        reason: format!(
            "rank {me} has {}, rank {peer} has {}: every rank must be told the same",
            show(ours.forced),
            show(theirs.forced)
        ),
    })
}

/// The host-memory link of `pair`, where its bytes land, and why.
pub(crate) fn host_link(pair: &Pair<'_>) -> Result<(TransportKind, Landing, Why)> {
    same_override(pair)?;
    let landing = |row: &Row| match row.steps {
        Steps::Host(s) => s.landing(),
        _ => Landing::SoftwareHost,
    };
    let forced = pair.ours.0.forced;
    if forced == Some(TransportKind::Mem) {
        return Err(Error::InvalidArgument {
            reason: "NODETOUR_TRANSPORT=mem joins threads of one process (tests), not ranks".into(),
        });
    }
    let mut refused = Vec::new();
    for row in TABLE.iter().filter(|r| r.memory == Memory::Host) {
        // A host kind that is forced is the only one tried; cuda-ipc and shm name GPU links,
        // so the host links choose as if unset.
        if forced.is_some_and(|f| is_host(f) && f != row.kind) {
            continue;
        }
        match (row.can_connect)(pair) {
            Ok(_) if forced == Some(row.kind) => {
                return Ok((row.kind, landing(row), Why::Forced(row.kind)));
            }
            Ok(why) if refused.is_empty() => return Ok((row.kind, landing(row), why)),
            Ok(_) => {
                let taken = row.kind;
                return Ok((taken, landing(row), Why::FellBack { refused, taken }));
            }
            Err(why) if forced == Some(row.kind) => {
                return Err(Error::Unsupported {
                    reason: format!("NODETOUR_TRANSPORT={}, but {why}", row.kind),
                });
            }
            Err(why) => refused.push(why),
        }
    }
    let refused: Vec<String> = refused.iter().map(Why::to_string).collect();
    Err(Error::Unsupported {
        reason: format!("no host link: {}", refused.join("; ")),
    })
}

fn is_host(k: TransportKind) -> bool {
    TABLE
        .iter()
        .any(|r| r.kind == k && r.memory == Memory::Host)
}

/// Whether the GPU ring can join every link of `ring` (each `(pair)` of ring neighbours), and
/// why not: every rank computes this from the same announcements, so all form a GPU ring or
/// none does. A host kind forced by `NODETOUR_TRANSPORT` makes every link a network link.
/// Ranks that share a process anywhere in the job (`pids_distinct`: no two ranks with one
/// host and one pid) never form one (a process's GPU memory cannot be mapped into itself, and
/// its threads' rings would share its CUDA context, where one rank's synchronising call waits
/// for another rank's streams).
pub(crate) fn device_ring(
    links: &[Pair<'_>],
    forced: Option<TransportKind>,
    pids_distinct: bool,
) -> std::result::Result<Why, Why> {
    let rows: Vec<&Row> = TABLE
        .iter()
        .filter(|r| r.memory == Memory::Device)
        .collect();
    for pair in links {
        rows.iter()
            .map(|r| (r.can_connect)(pair))
            .find(|c| c.is_ok())
            .unwrap_or_else(|| (rows[0].can_connect)(pair))?;
    }
    if !pids_distinct {
        return Err(Why::ProcessShared);
    }
    if let Some(f) = forced.filter(|f| is_host(*f)) {
        return Ok(Why::ForcedNetwork(f));
    }
    let (direct, staged) = (rows[0].kind, rows[1].kind);
    Ok(if links.iter().any(|p| network_link(p, forced)) {
        Why::GpusWithNetwork {
            direct,
            staged,
            network: rows[2].kind,
        }
    } else {
        Why::GpusInHost { direct, staged }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(forced: Option<TransportKind>, verbs: bool, gpu: Option<u32>, pid: u32) -> Announcement {
        Announcement {
            pid,
            ..Announcement::ours(
                forced,
                verbs,
                gpu,
                crate::comm::Options::default().must_agree(),
            )
        }
    }

    fn pick(x: &Announcement, y: &Announcement) -> Result<TransportKind> {
        let pair = |o, t, me, peer| Pair {
            ours: (o, me),
            theirs: (t, peer),
            same_host: true,
            why_no_verbs: "no device",
        };
        let here = host_link(&pair(x, y, 0, 1)).map(|c| c.0);
        let there = host_link(&pair(y, x, 1, 0)).map(|c| c.0);
        assert_eq!(here.is_ok(), there.is_ok());
        if let (Ok(h), Ok(t)) = (&here, &there) {
            assert_eq!(h, t);
        }
        here
    }

    #[test]
    fn host_links_choose_alike_on_both_ends_and_say_why() {
        let h = |forced, v| a(forced, v, None, 1);
        assert_eq!(
            pick(&h(None, true), &h(None, true)),
            Ok(TransportKind::Verbs)
        );
        assert_eq!(
            pick(&h(None, true), &h(None, false)),
            Ok(TransportKind::Tcp)
        );
        let tcp = Some(TransportKind::Tcp);
        assert_eq!(pick(&h(tcp, true), &h(tcp, true)), Ok(TransportKind::Tcp));
        let verbs = Some(TransportKind::Verbs);
        assert!(matches!(
            pick(&h(verbs, true), &h(verbs, false)),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            pick(&h(tcp, true), &h(None, true)),
            Err(Error::InvalidArgument { .. })
        ));
        // cuda-ipc and shm are GPU links: the host links choose as if unset.
        let shm = Some(TransportKind::Shm);
        assert_eq!(pick(&h(shm, true), &h(shm, true)), Ok(TransportKind::Verbs));
        assert_eq!(pick(&h(shm, false), &h(shm, true)), Ok(TransportKind::Tcp));
        let mem = Some(TransportKind::Mem);
        assert!(pick(&h(mem, true), &h(mem, true)).is_err());
        let (o, t) = (h(None, false), h(None, true));
        let (_, _, why) = host_link(&Pair {
            ours: (&o, 0),
            theirs: (&t, 1),
            same_host: true,
            why_no_verbs: "libibverbs is missing",
        })
        .unwrap();
        assert!(why.to_string().contains("libibverbs is missing"), "{why}");
    }

    #[test]
    fn the_gpu_ring_joins_gpus_in_host_and_over_the_network() {
        let g = |pid| a(None, false, Some(0), pid);
        let pair = |o, t, same_host| Pair {
            ours: (o, 0),
            theirs: (t, 1),
            same_host,
            why_no_verbs: "",
        };
        let (x, y) = (g(1), g(2));
        let near = pair(&x, &y, true);
        assert!(device_ring(&[pair(&x, &y, true)], None, true).is_ok());
        assert!(!network_link(&near, None));
        // GPUs on different hosts join through a network link.
        let far = device_ring(&[pair(&x, &y, false)], None, true).unwrap();
        assert!(far.to_string().contains("network link"), "{far}");
        assert!(network_link(&pair(&x, &y, false), None));
        let host_only = a(None, false, None, 3);
        let why = device_ring(&[pair(&x, &host_only, true)], None, true).unwrap_err();
        assert!(why.to_string().contains("host memory only"), "{why}");
        // Ranks of one process share its CUDA context: staged.
        let same = g(1);
        assert!(device_ring(&[pair(&x, &same, true)], None, true).is_err());
        assert!(device_ring(&[pair(&x, &y, false)], None, false).is_err());
        // A forced host kind makes every link a network link.
        let tcp = Some(TransportKind::Tcp);
        let forced = device_ring(&[pair(&x, &y, true)], tcp, true).unwrap();
        assert!(
            forced.to_string().contains("NODETOUR_TRANSPORT=tcp"),
            "{forced}"
        );
        assert!(network_link(&near, tcp));
        // shm forced is a GPU link: the ring forms (and runs staged).
        assert!(device_ring(&[pair(&x, &y, true)], Some(TransportKind::Shm), true).is_ok());
        assert!(!network_link(&near, Some(TransportKind::Shm)));
    }
}

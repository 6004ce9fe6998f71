//! Every `NODETOUR_*` variable, declared once (as NCCL's `NCCL_PARAM`): its name, kind and
//! range, default, meaning, whether every rank must share it, and who it is for. The table
//! ([`KNOBS`]) is the one place a setting is defined; [`Env`] is the one place the process
//! environment is read. `nodetour_ring::Options` and [`crate::Config`] turn an [`Env`] into
//! typed settings (their `Default`s are the table's defaults, with no environment read); the
//! docs/knobs.md's table (and the README's, for a user's settings) is checked against this one by a test.
//!
//! A value is trimmed; an empty value counts as unset. A malformed or out-of-range value is
//! [`Error::InvalidConfig`] naming the variable and what it accepts.

use std::collections::HashMap;

use crate::error::{Error, Result};

/// Whether every rank must use the same value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Agreement {
    /// Shapes what ranks exchange or which algorithm a size takes: formation compares every
    /// rank's value and fails on every rank, naming the setting and both values.
    MustAgree,
    /// A rank's own choice.
    Local,
}

/// Who sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Audience {
    /// A user's setting (the README's table, and docs/knobs.md's).
    User,
    /// A tuning knob: the defaults are measured; change one to compare (docs/).
    Tuning,
    /// Read only by the `nodetour` command and the examples (the doctor, logging).
    Tools,
}

/// What a variable holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A whole number in `min..=max`.
    Count {
        /// Smallest accepted.
        min: u64,
        /// Largest accepted.
        max: u64,
    },
    /// One of these words (the first is the default where the default is a word).
    Choice(&'static [&'static str]),
    /// Free text (a name, an address, a path, a secret).
    Text,
    /// A comma-separated list of names.
    List,
}

/// One declared variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Knob {
    /// The variable's name.
    pub name: &'static str,
    /// What it holds.
    pub kind: Kind,
    /// The value used where it is unset, as it would be written (`""`: none, chosen at run
    /// time as `meaning` says).
    pub default: &'static str,
    /// One line: what it does.
    pub meaning: &'static str,
    /// Whether every rank must share it.
    pub agreement: Agreement,
    /// Who sets it.
    pub audience: Audience,
    /// An earlier name still read (with a warning) where the new one is unset.
    pub old_name: Option<&'static str>,
}

const fn knob(
    name: &'static str,
    kind: Kind,
    default: &'static str,
    agreement: Agreement,
    audience: Audience,
    meaning: &'static str,
) -> Knob {
    Knob {
        name,
        kind,
        default,
        meaning,
        agreement,
        audience,
        old_name: None,
    }
}

const fn count(min: u64, max: u64) -> Kind {
    Kind::Count { min, max }
}

use Agreement::{Local, MustAgree};
use Audience::{Tools, Tuning, User};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Every variable nodetour reads, in the order docs/knobs.md lists them.
pub const KNOBS: &[Knob] = &[
    // Launching and joining.
    knob(
        "NODETOUR_RANK",
        count(0, u32::MAX as u64 - 1),
        "",
        Local,
        User,
        "this process's rank, where no launcher sets one (with NODETOUR_WORLD_SIZE)",
    ),
    knob(
        "NODETOUR_WORLD_SIZE",
        count(1, u32::MAX as u64),
        "",
        Local,
        User,
        "the number of ranks, where no launcher sets it",
    ),
    knob(
        "NODETOUR_LOCAL_RANK",
        count(0, u32::MAX as u64 - 1),
        "",
        Local,
        User,
        "this process's rank on its host, where no launcher sets one",
    ),
    knob(
        "NODETOUR_MASTER_ADDR",
        Kind::Text,
        "",
        Local,
        User,
        "the address rank 0 listens on (else MASTER_ADDR; a unique id: this host's address towards the default route)",
    ),
    knob(
        "NODETOUR_PORT",
        count(0, 65535),
        "",
        Local,
        User,
        "rank 0's rendezvous port (else MASTER_PORT + 17; else 29600 plus an offset from the launcher's job id)",
    ),
    knob(
        "NODETOUR_JOB_TOKEN",
        Kind::Text,
        "",
        Local,
        User,
        "the job's shared secret: both directions of every handshake are authenticated with it",
    ),
    knob(
        "NODETOUR_JOB_ID",
        Kind::Text,
        "",
        Local,
        User,
        "names the job for tools started by hand (no launcher): unauthenticated, warned",
    ),
    knob(
        "NODETOUR_TIMEOUT_MS",
        count(1, 24 * 3600 * 1000),
        "30000",
        Local,
        User,
        "no progress in a collective for this long fails it",
    ),
    knob(
        "NODETOUR_JOIN_TIMEOUT_MS",
        count(1, 24 * 3600 * 1000),
        "600000",
        Local,
        User,
        "forming a communicator (every rank joining, every link connecting) must finish within this long",
    ),
    // Paths.
    knob(
        "NODETOUR_TRANSPORT",
        Kind::Choice(&["auto", "verbs", "tcp", "cuda-ipc", "shm"]),
        "auto",
        Local,
        User,
        "the link kind for every link (auto: chosen per pair, with the reason in paths())",
    ),
    knob(
        "NODETOUR_GDR",
        Kind::Choice(&["auto", "force", "off"]),
        "auto",
        Local,
        User,
        "GPU memory registered for the NIC: where it works (auto), or fail with every rung's reason (force), or never (off)",
    ),
    knob(
        "NODETOUR_GDR_FLUSH",
        Kind::Choice(&["auto", "read", "host", "off", "none", "0"]),
        "auto",
        Local,
        User,
        "how a landed chunk is made visible to the GPU (auto: as the platform needs)",
    ),
    knob(
        "NODETOUR_NET_LANDING",
        Kind::Choice(&["auto", "host", "gpu"]),
        "auto",
        Local,
        User,
        "where a network link's receive slots live for GPU collectives",
    ),
    knob(
        "NODETOUR_IB_DEVICE",
        Kind::Text,
        "",
        Local,
        User,
        "use this RDMA device (and only it); unset: the nearest to the GPU",
    ),
    knob(
        "NODETOUR_IB_DEVICES",
        Kind::List,
        "",
        Local,
        User,
        "RDMA devices to spread a host's ranks over (rank r uses devices[r mod len])",
    ),
    knob(
        "NODETOUR_IB_GID_INDEX",
        count(0, 255),
        "",
        Local,
        User,
        "the GID table index (unset: RoCE v2 over IPv4 where there is one)",
    ),
    knob(
        "NODETOUR_IB_TC",
        count(0, 255),
        "0",
        Local,
        User,
        "traffic class of RoCE packets (DSCP << 2 | ECN)",
    ),
    knob(
        "NODETOUR_IB_SL",
        count(0, 15),
        "0",
        Local,
        User,
        "InfiniBand service level",
    ),
    knob(
        "NODETOUR_HOST_ID",
        Kind::Text,
        "",
        Local,
        User,
        "count this process as a host of this name (one machine split into several hosts, to run the paths between hosts)",
    ),
    knob(
        "NODETOUR_CACHE_DIR",
        Kind::Text,
        "",
        Local,
        User,
        "where compiled kernels are kept (empty: not kept; unset: $XDG_CACHE_HOME or ~/.cache, then nodetour/kernels)",
    ),
    knob(
        "NODETOUR_IBVERBS_LIBRARY",
        Kind::Text,
        "libibverbs.so.1",
        Local,
        User,
        "the verbs library to load (a path or a SONAME)",
    ),
    // Tuning: shapes on the wire (must agree).
    knob(
        "NODETOUR_SLOT_BYTES",
        count(64, GIB),
        "1048576",
        MustAgree,
        Tuning,
        "bytes of one host-ring slot (one chunk on the wire)",
    ),
    knob(
        "NODETOUR_SLOTS",
        count(1, 256),
        "4",
        MustAgree,
        Tuning,
        "host-ring slots each rank grants its previous rank",
    ),
    knob(
        "NODETOUR_PIECE_BYTES",
        count(4 * KIB, 1 << 40),
        "16777216",
        MustAgree,
        Tuning,
        "bytes of the staging region a host collective runs through at a time",
    ),
    knob(
        "NODETOUR_HOST_GATHER_MAX",
        count(0, GIB),
        "32768",
        MustAgree,
        Tuning,
        "host allreduces up to this size gather every input to every rank (0: always the ring)",
    ),
    knob(
        "NODETOUR_P2P_MAX_LINKS",
        count(1, 65535),
        "16",
        Local,
        Tuning,
        "point-to-point links a rank holds at once (each holds the host ring's slots, a bell and a staging slot)",
    ),
    knob(
        "NODETOUR_ONE_KERNEL",
        Kind::Choice(&["auto", "off", "force"]),
        "auto",
        MustAgree,
        Tuning,
        "small GPU allreduces on one host in one kernel",
    ),
    knob(
        "NODETOUR_ONE_KERNEL_MAX",
        count(1, 32 * MIB),
        "1048576",
        MustAgree,
        Tuning,
        "the largest allreduce the one-kernel path takes",
    ),
    knob(
        "NODETOUR_IPC_PIPELINE",
        count(1, 64),
        "1",
        MustAgree,
        Tuning,
        "chunks each direct-path (cuda-ipc) segment is cut into",
    ),
    knob(
        "NODETOUR_SHM_PIPELINE",
        count(1, 64),
        "1",
        MustAgree,
        Tuning,
        "chunks each staged-path (shm) segment is cut into",
    ),
    // Tuning: a rank's own.
    knob(
        "NODETOUR_SPIN_US",
        count(0, 1_000_000),
        "50",
        Local,
        Tuning,
        "how long a verbs waiter polls before it blocks (0: blocks at once)",
    ),
    knob(
        "NODETOUR_NET_SPIN_US",
        count(0, 1_000_000),
        "20",
        Local,
        Tuning,
        "how long a GPU network link's progress thread polls before it blocks",
    ),
    knob(
        "NODETOUR_RING_SPIN_US",
        count(0, 1_000_000),
        "1000",
        Local,
        Tuning,
        "how long a host collective looks for its neighbours' next notice before it blocks",
    ),
    knob(
        "NODETOUR_RING_BLOCKS",
        count(0, 1 << 16),
        "0",
        Local,
        Tuning,
        "the most blocks a GPU ring kernel launches (0: as the GPU suits)",
    ),
    knob(
        "NODETOUR_SHM_READ_MAX",
        count(0, GIB),
        "1048576",
        Local,
        Tuning,
        "staged chunks up to this size are reduced straight out of the host slots",
    ),
    Knob {
        old_name: Some("NODETOUR_COPY_KERNEL_MAX"),
        ..knob(
            "NODETOUR_SLOT_COPY_KERNEL_MAX",
            count(0, GIB),
            "1048576",
            Local,
            Tuning,
            "direct-path chunks up to this size are copied out of the slots by a kernel, not the copy engine",
        )
    },
    Knob {
        old_name: Some("NODETOUR_KERNEL_COPY_MAX"),
        ..knob(
            "NODETOUR_GATHER_KERNEL_MAX",
            count(0, 1 << 48),
            "33554432",
            Local,
            Tuning,
            "GPUs of one process: all-gather segments up to this size are copied by a kernel",
        )
    },
    knob(
        "NODETOUR_ONE_STEP_MAX",
        count(0, 1 << 48),
        "16777216",
        Local,
        Tuning,
        "GPUs of one process: two-GPU allreduces up to this size run in one step",
    ),
    // The tools.
    knob(
        "NODETOUR_LOG",
        Kind::Text,
        "info",
        Local,
        Tools,
        "the nodetour command's and examples' log filter (tracing's EnvFilter syntax)",
    ),
    knob(
        "NODETOUR_GDR_LEVEL",
        Kind::Choice(&["PIX", "PXB", "PHB", "NODE", "SYS"]),
        "PXB",
        Local,
        Tools,
        "the doctor: the farthest PCIe distance between GPU and NIC it accepts",
    ),
    knob(
        "NODETOUR_TOPOLOGY_FILE",
        Kind::Text,
        "",
        Local,
        Tools,
        "the doctor: the physical topology where sysfs cannot show it (`<gpu bus id> <nic> <level>` lines)",
    ),
];

/// The declaration of `name`. Panics where it is not declared: a setting read anywhere must be
/// in [`KNOBS`] (a test reads every declaration).
pub fn knob_named(name: &str) -> &'static Knob {
    KNOBS
        .iter()
        .find(|k| k.name == name)
        .unwrap_or_else(|| panic!("{name} is not declared in nodetour_core::knobs::KNOBS"))
}

/// Where settings come from: the process environment ([`Env::process`], the one reader of it),
/// nothing ([`Env::empty`]: every default), or a map (tests, and runtimes that keep settings
/// elsewhere).
pub struct Env<'a> {
    lookup: Box<Lookup<'a>>,
}

/// A variable name to its value, if set.
type Lookup<'a> = dyn Fn(&str) -> Option<String> + 'a;

impl std::fmt::Debug for Env<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Env")
    }
}

impl Env<'static> {
    /// The process environment, read at each lookup.
    pub fn process() -> Env<'static> {
        Env {
            lookup: Box::new(|k| std::env::var(k).ok()),
        }
    }

    /// No variable set: every setting at its default.
    pub fn empty() -> Env<'static> {
        Env {
            lookup: Box::new(|_| None),
        }
    }

    /// Variables from name-value pairs.
    pub fn from_pairs<K: Into<String>, V: Into<String>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Env<'static> {
        let map: HashMap<String, String> = pairs
            .into_iter()
            .map(|(k, v)| (k.into(), v.into()))
            .collect();
        Env::from_lookup(move |k| map.get(k).cloned())
    }
}

impl<'a> Env<'a> {
    /// Variables from `lookup` (a name to its value, if set).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String> + 'a) -> Env<'a> {
        Env {
            lookup: Box::new(lookup),
        }
    }

    /// Any variable, trimmed, `None` where unset or empty: for the variables of other programs
    /// that nodetour reads (a launcher's `RANK`, `SLURM_*`, `MASTER_ADDR`; `HOME`). A
    /// `NODETOUR_*` name must be declared (use [`Env::get`]).
    pub fn foreign(&self, name: &str) -> Option<String> {
        assert!(
            !name.starts_with("NODETOUR_"),
            "{name}: read nodetour's own variables through Env::get"
        );
        self.trimmed(name)
    }

    fn trimmed(&self, name: &str) -> Option<String> {
        (self.lookup)(name)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    /// The declared variable `name`, trimmed, `None` where unset or empty (then the earlier
    /// name, where it had one, with a warning).
    pub fn get(&self, name: &str) -> Option<String> {
        let k = knob_named(name);
        if let Some(v) = self.trimmed(k.name) {
            return Some(v);
        }
        let old = k.old_name?;
        let v = self.trimmed(old)?;
        tracing::warn!("{old} is now {}: read under its old name", k.name);
        Some(v)
    }

    /// A variable of either kind: a declared `NODETOUR_*` one through [`Env::get`], any
    /// other through [`Env::foreign`] (for readers that take both, such as a launcher's).
    pub fn any(&self, name: &str) -> Option<String> {
        if name.starts_with("NODETOUR_") {
            self.get(name)
        } else {
            self.foreign(name)
        }
    }

    /// Whether `name` is set (to anything, empty included): an empty `NODETOUR_CACHE_DIR`
    /// means "no cache", unlike an unset one.
    pub fn is_set(&self, name: &str) -> bool {
        (self.lookup)(knob_named(name).name).is_some()
    }

    /// The whole number `name` holds, its declared default where unset; out of the declared
    /// range is an error naming it. Panics where the knob is not a count with a default.
    pub fn count(&self, name: &str) -> Result<u64> {
        match self.count_if_set(name)? {
            Some(n) => Ok(n),
            None => {
                let k = knob_named(name);
                Ok(k.default
                    .parse()
                    .unwrap_or_else(|_| panic!("{name}: declared without a numeric default")))
            }
        }
    }

    /// The whole number `name` holds, `None` where unset.
    pub fn count_if_set(&self, name: &str) -> Result<Option<u64>> {
        let k = knob_named(name);
        let Kind::Count { min, max } = k.kind else {
            panic!("{name} is not declared as a count");
        };
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        match v.parse::<u64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(Some(n)),
            _ => Err(Error::InvalidConfig {
                name: k.name,
                value: v,
                reason: format!("expected a whole number from {min} to {max}"),
            }),
        }
    }

    /// The word `name` holds (lower-cased unless the declared words are upper case), its
    /// declared default where unset; a word not declared is an error listing them.
    pub fn choice(&self, name: &str) -> Result<&'static str> {
        let k = knob_named(name);
        let Kind::Choice(words) = k.kind else {
            panic!("{name} is not declared as a choice");
        };
        let Some(v) = self.get(name) else {
            return Ok(k.default);
        };
        words
            .iter()
            .find(|w| w.eq_ignore_ascii_case(&v))
            .copied()
            .ok_or_else(|| Error::InvalidConfig {
                name: k.name,
                value: v,
                reason: format!("expected {}", words.join(", ")),
            })
    }

    /// The names `name` lists (comma-separated, trimmed, empty entries dropped).
    pub fn list(&self, name: &str) -> Vec<String> {
        assert_eq!(knob_named(name).kind, Kind::List, "{name} is not a list");
        self.get(name)
            .map(|v| {
                v.split(',')
                    .map(|d| d.trim().to_owned())
                    .filter(|d| !d.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_declaration_is_well_formed() {
        let mut names = std::collections::HashSet::new();
        for k in KNOBS {
            assert!(k.name.starts_with("NODETOUR_"), "{}", k.name);
            assert!(names.insert(k.name), "{} declared twice", k.name);
            if let Some(old) = k.old_name {
                assert!(names.insert(old), "{old} is also a current name");
            }
            assert!(!k.meaning.is_empty(), "{} has no meaning", k.name);
            match k.kind {
                Kind::Count { min, max } => {
                    assert!(min <= max, "{}", k.name);
                    if !k.default.is_empty() {
                        let d: u64 = k.default.parse().expect(k.name);
                        assert!((min..=max).contains(&d), "{}: default out of range", k.name);
                    }
                }
                Kind::Choice(words) => assert!(words.contains(&k.default), "{}", k.name),
                Kind::Text | Kind::List => {}
            }
        }
    }

    #[test]
    fn values_parse_within_their_declared_ranges_and_errors_name_the_variable() {
        let env = Env::from_pairs([
            ("NODETOUR_SLOTS", " 8 "),
            ("NODETOUR_GDR", "FORCE"),
            ("NODETOUR_IB_DEVICES", "mlx5_0, ,mlx5_1"),
            ("NODETOUR_IB_SL", "16"),
            ("NODETOUR_TRANSPORT", "carrier-pigeon"),
            ("NODETOUR_IB_TC", ""),
        ]);
        assert_eq!(env.count("NODETOUR_SLOTS").unwrap(), 8);
        assert_eq!(env.count("NODETOUR_SLOT_BYTES").unwrap(), 1 << 20);
        assert_eq!(env.count("NODETOUR_IB_TC").unwrap(), 0, "empty is unset");
        assert_eq!(env.count_if_set("NODETOUR_IB_GID_INDEX").unwrap(), None);
        assert_eq!(env.choice("NODETOUR_GDR").unwrap(), "force");
        assert_eq!(env.choice("NODETOUR_NET_LANDING").unwrap(), "auto");
        assert_eq!(env.list("NODETOUR_IB_DEVICES"), ["mlx5_0", "mlx5_1"]);
        let e = env.count("NODETOUR_IB_SL").unwrap_err().to_string();
        assert!(e.contains("NODETOUR_IB_SL") && e.contains("0 to 15"), "{e}");
        let e = env.choice("NODETOUR_TRANSPORT").unwrap_err().to_string();
        assert!(
            e.contains("NODETOUR_TRANSPORT") && e.contains("cuda-ipc"),
            "{e}"
        );
    }

    #[test]
    fn an_earlier_name_is_read_where_the_new_one_is_unset() {
        let old = Env::from_pairs([("NODETOUR_COPY_KERNEL_MAX", "0")]);
        assert_eq!(old.count("NODETOUR_SLOT_COPY_KERNEL_MAX").unwrap(), 0);
        let both = Env::from_pairs([
            ("NODETOUR_KERNEL_COPY_MAX", "1"),
            ("NODETOUR_GATHER_KERNEL_MAX", "2"),
        ]);
        assert_eq!(both.count("NODETOUR_GATHER_KERNEL_MAX").unwrap(), 2);
    }

    #[test]
    #[should_panic(expected = "not declared")]
    fn an_undeclared_name_is_a_programming_error() {
        let _ = Env::empty().get("NODETOUR_NOT_A_SETTING");
    }
}

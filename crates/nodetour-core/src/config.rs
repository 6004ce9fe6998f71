//! The settings the core uses, parsed once from an [`Env`] into a typed [`Config`] (each
//! variable is declared in [`crate::knobs`]: its range, default and meaning).
//!
//! Parsing is a pure function of the [`Env`] ([`Config::from_knobs`]), so every setting and
//! every malformed value is unit-tested without touching the process environment; `Default` is
//! the declared defaults and reads nothing. [`Config::describe`] renders the effective values
//! for the startup log line.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::knobs::Env;

/// Default for `NODETOUR_TIMEOUT_MS`: how long any single wait may block.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// Default for [`Config::join_timeout`] (`NODETOUR_JOIN_TIMEOUT_MS`): 10 minutes, as
/// torch's default process-group timeout.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(600);

/// Effective settings of the core: the RDMA device and its packets, the waits, and whether
/// and how GPU memory is registered for the NIC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// `NODETOUR_IB_DEVICE`: use this RDMA device (and only it).
    pub ib_device: Option<String>,
    /// `NODETOUR_IB_GID_INDEX`: use this GID table index instead of choosing one.
    pub gid_index: Option<u32>,
    /// `NODETOUR_IB_TC`: traffic class of RoCE packets (DSCP << 2 | ECN).
    pub traffic_class: u8,
    /// `NODETOUR_IB_SL`: InfiniBand service level (0-15).
    pub service_level: u8,
    /// `NODETOUR_TIMEOUT_MS`: the budget of every blocking wait of a collective, and the base
    /// of the queue pairs' retransmission timeout.
    pub timeout: Duration,
    /// `NODETOUR_JOIN_TIMEOUT_MS`: forming a communicator (every rank joining the rendezvous,
    /// every link connecting) must finish within this long (default 10 minutes: the ranks of a
    /// multi-node job start tens of seconds apart).
    pub join_timeout: Duration,
    /// `NODETOUR_SPIN_US`: how long a verbs waiter polls before it blocks (default 50 µs).
    /// Longer trades a CPU core for latency; 0 blocks at once.
    pub spin: Duration,
    /// `NODETOUR_NET_SPIN_US`: how long a GPU network link's progress thread polls before it
    /// blocks (default 20 µs).
    pub net_spin: Duration,
    /// `NODETOUR_RING_SPIN_US`: how long a host collective keeps looking for its neighbours'
    /// next notification without blocking, after each one (default 1 ms). Only while a
    /// collective runs; where a host has more ranks than CPUs the ring yields its CPU between
    /// looks.
    pub ring_spin: Duration,
    /// `NODETOUR_GDR`: whether GPU memory is registered for the NIC (the direct path).
    pub gdr: GdrMode,
    /// `NODETOUR_GDR_FLUSH`: how landed chunks are made visible to the GPU.
    pub gdr_flush: FlushOverride,
}

/// `NODETOUR_GDR`: whether the direct path may, must or must not be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GdrMode {
    /// Use the direct path when a rung works, else stage (the default).
    Auto,
    /// Use the direct path or fail with every rung's reason (never stage silently).
    Force,
    /// Always stage.
    Off,
}

impl GdrMode {
    /// `NODETOUR_GDR`'s word (`auto`, `force`, `off`: the knob table checked it).
    pub(crate) fn parse(word: &str) -> Self {
        match word {
            "force" => GdrMode::Force,
            "off" => GdrMode::Off,
            _ => GdrMode::Auto,
        }
    }
}

/// `NODETOUR_GDR_FLUSH`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FlushOverride {
    /// Decide from the GPU (the default).
    #[default]
    Auto,
    /// Always an RDMA READ of the landed bytes on a loopback queue pair.
    Read,
    /// Always `cuFlushGPUDirectRDMAWrites` from the progress thread.
    Host,
    /// Never flush (unsafe on GPUs without owner ordering: chunks may be read stale).
    Off,
}

impl FlushOverride {
    /// Parses `NODETOUR_GDR_FLUSH`'s value (`auto`, `read`, `host`, `off`).
    pub fn parse(value: &str) -> Result<FlushOverride> {
        match value.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(FlushOverride::Auto),
            "read" => Ok(FlushOverride::Read),
            "host" => Ok(FlushOverride::Host),
            "off" | "0" | "none" => Ok(FlushOverride::Off),
            other => Err(Error::InvalidArgument {
                reason: format!("NODETOUR_GDR_FLUSH={other}: expected auto, read, host or off"),
            }),
        }
    }
}

/// Default for `NODETOUR_RING_SPIN_US`.
pub const DEFAULT_RING_SPIN: Duration = Duration::from_millis(1);

impl Default for Config {
    /// The declared defaults ([`crate::knobs::KNOBS`]); no environment read.
    fn default() -> Self {
        Self::from_knobs(&Env::empty()).expect("the declared defaults parse")
    }
}

impl Config {
    /// Reads the settings from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_knobs(&Env::process())
    }

    /// Reads the settings through `lookup` (a variable name to its value, if set).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        Self::from_knobs(&Env::from_lookup(lookup))
    }

    /// Reads the settings from `env`.
    pub fn from_knobs(env: &Env<'_>) -> Result<Self> {
        let micros = |name| env.count(name).map(Duration::from_micros);
        Ok(Config {
            ib_device: env.get("NODETOUR_IB_DEVICE"),
            gid_index: env.count_if_set("NODETOUR_IB_GID_INDEX")?.map(|i| i as u32),
            traffic_class: env.count("NODETOUR_IB_TC")? as u8,
            service_level: env.count("NODETOUR_IB_SL")? as u8,
            timeout: Duration::from_millis(env.count("NODETOUR_TIMEOUT_MS")?),
            join_timeout: Duration::from_millis(env.count("NODETOUR_JOIN_TIMEOUT_MS")?),
            spin: micros("NODETOUR_SPIN_US")?,
            net_spin: micros("NODETOUR_NET_SPIN_US")?,
            ring_spin: micros("NODETOUR_RING_SPIN_US")?,
            gdr: GdrMode::parse(env.choice("NODETOUR_GDR")?),
            gdr_flush: FlushOverride::parse(env.choice("NODETOUR_GDR_FLUSH")?)?,
        })
    }

    /// One line with every effective value, for the startup log.
    pub fn describe(&self) -> String {
        format!(
            "NODETOUR_IB_DEVICE={} NODETOUR_IB_GID_INDEX={} NODETOUR_IB_TC={} NODETOUR_IB_SL={} NODETOUR_TIMEOUT_MS={} NODETOUR_JOIN_TIMEOUT_MS={} NODETOUR_SPIN_US={} NODETOUR_RING_SPIN_US={}",
            self.ib_device.as_deref().unwrap_or("auto"),
            self.gid_index.map_or("auto".to_owned(), |i| i.to_string()),
            self.traffic_class,
            self.service_level,
            self.timeout.as_millis(),
            self.join_timeout.as_millis(),
            self.spin.as_micros(),
            self.ring_spin.as_micros()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn config(vars: &[(&str, &str)]) -> Result<Config> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(|k| map.get(k).cloned())
    }

    #[test]
    fn defaults_when_nothing_is_set() {
        assert_eq!(config(&[]).unwrap(), Config::default());
        assert!(
            config(&[])
                .unwrap()
                .describe()
                .contains("NODETOUR_IB_DEVICE=auto")
        );
    }

    #[test]
    fn every_knob_parses() {
        let c = config(&[
            ("NODETOUR_IB_DEVICE", " mlx5_0 "),
            ("NODETOUR_IB_GID_INDEX", "3"),
            ("NODETOUR_IB_TC", "106"),
            ("NODETOUR_IB_SL", "5"),
            ("NODETOUR_TIMEOUT_MS", "1500"),
            ("NODETOUR_JOIN_TIMEOUT_MS", "90000"),
            ("NODETOUR_SPIN_US", "7"),
            ("NODETOUR_RING_SPIN_US", "0"),
        ])
        .unwrap();
        assert_eq!(c.spin, Duration::from_micros(7));
        assert_eq!(c.ring_spin, Duration::ZERO);
        assert_eq!(c.ib_device.as_deref(), Some("mlx5_0"));
        assert_eq!(c.gid_index, Some(3));
        assert_eq!(c.traffic_class, 106);
        assert_eq!(c.service_level, 5);
        assert_eq!(c.timeout, Duration::from_millis(1500));
        assert_eq!(c.join_timeout, Duration::from_secs(90));
    }

    #[test]
    fn malformed_values_are_typed_errors() {
        for (name, value) in [
            ("NODETOUR_IB_GID_INDEX", "-1"),
            ("NODETOUR_IB_GID_INDEX", "256"),
            ("NODETOUR_IB_SL", "16"),
            ("NODETOUR_IB_TC", "x"),
            ("NODETOUR_TIMEOUT_MS", "0"),
            ("NODETOUR_JOIN_TIMEOUT_MS", "soon"),
            ("NODETOUR_RING_SPIN_US", "1000001"),
        ] {
            match config(&[(name, value)]) {
                Err(Error::InvalidConfig { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}={value}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn the_constants_are_the_declared_defaults() {
        let c = Config::default();
        assert_eq!(c.timeout, DEFAULT_TIMEOUT);
        assert_eq!(c.join_timeout, DEFAULT_JOIN_TIMEOUT);
        assert_eq!(c.ring_spin, DEFAULT_RING_SPIN);
        assert_eq!((c.gdr, c.gdr_flush), (GdrMode::Auto, FlushOverride::Auto));
    }

    #[test]
    fn empty_values_mean_unset() {
        assert_eq!(
            config(&[("NODETOUR_IB_DEVICE", "")]).unwrap().ib_device,
            None
        );
    }
}

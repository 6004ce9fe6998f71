//! The `NODETOUR_*` knobs that the core reads, parsed once into a typed [`Config`].
//!
//! Parsing is a pure function of a lookup closure ([`Config::from_lookup`]), so every knob and
//! every malformed value is unit-tested without touching the process environment. Every knob
//! is optional; [`Config::describe`] renders the effective values for the startup log line.

use std::time::Duration;

use crate::error::{Error, Result};

/// Default for `NODETOUR_TIMEOUT_MS`: how long any single wait may block.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Effective settings of the verbs layer.
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
    /// `NODETOUR_TIMEOUT_MS`: the budget of every blocking wait, and the base of the queue
    /// pairs' retransmission timeout.
    pub timeout: Duration,
    /// `NODETOUR_SPIN_US`: how long a waiter polls before it blocks (default 50 µs). Longer
    /// trades a CPU core for latency; 0 blocks at once.
    pub spin: Duration,
    /// `NODETOUR_RING_SPIN_US`: how long a host collective keeps looking for its neighbours'
    /// next notification without blocking, after each one (default 1 ms). Only while a
    /// collective runs; where a host has more ranks than CPUs the ring yields its CPU between
    /// looks.
    pub ring_spin: Duration,
}

/// Default for `NODETOUR_RING_SPIN_US`.
pub const DEFAULT_RING_SPIN: Duration = Duration::from_millis(1);

impl Default for Config {
    fn default() -> Self {
        Config {
            ib_device: None,
            gid_index: None,
            traffic_class: 0,
            service_level: 0,
            timeout: DEFAULT_TIMEOUT,
            spin: crate::verbs::DEFAULT_SPIN,
            ring_spin: DEFAULT_RING_SPIN,
        }
    }
}

impl Config {
    /// Reads the knobs from the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads the knobs through `lookup` (a variable name to its value, if set).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut config = Config::default();
        let get = |name: &'static str| lookup(name).filter(|v| !v.trim().is_empty());
        if let Some(device) = get("NODETOUR_IB_DEVICE") {
            config.ib_device = Some(device.trim().to_owned());
        }
        if let Some(v) = get("NODETOUR_IB_GID_INDEX") {
            config.gid_index = Some(parse_int("NODETOUR_IB_GID_INDEX", &v, 0, 255)? as u32);
        }
        if let Some(v) = get("NODETOUR_IB_TC") {
            config.traffic_class = parse_int("NODETOUR_IB_TC", &v, 0, 255)? as u8;
        }
        if let Some(v) = get("NODETOUR_IB_SL") {
            config.service_level = parse_int("NODETOUR_IB_SL", &v, 0, 15)? as u8;
        }
        if let Some(v) = get("NODETOUR_TIMEOUT_MS") {
            let ms = parse_int("NODETOUR_TIMEOUT_MS", &v, 1, 24 * 3600 * 1000)?;
            config.timeout = Duration::from_millis(ms);
        }
        if let Some(v) = get("NODETOUR_SPIN_US") {
            config.spin = Duration::from_micros(parse_int("NODETOUR_SPIN_US", &v, 0, 1_000_000)?);
        }
        if let Some(v) = get("NODETOUR_RING_SPIN_US") {
            config.ring_spin =
                Duration::from_micros(parse_int("NODETOUR_RING_SPIN_US", &v, 0, 1_000_000)?);
        }
        Ok(config)
    }

    /// One line with every effective value, for the startup log.
    pub fn describe(&self) -> String {
        format!(
            "NODETOUR_IB_DEVICE={} NODETOUR_IB_GID_INDEX={} NODETOUR_IB_TC={} NODETOUR_IB_SL={} NODETOUR_TIMEOUT_MS={} NODETOUR_SPIN_US={} NODETOUR_RING_SPIN_US={}",
            self.ib_device.as_deref().unwrap_or("auto"),
            self.gid_index.map_or("auto".to_owned(), |i| i.to_string()),
            self.traffic_class,
            self.service_level,
            self.timeout.as_millis(),
            self.spin.as_micros(),
            self.ring_spin.as_micros()
        )
    }
}

fn parse_int(name: &'static str, value: &str, min: u64, max: u64) -> Result<u64> {
    let invalid = |reason: String| Error::InvalidConfig {
        name,
        value: value.to_owned(),
        reason,
    };
    let n: u64 = value
        .trim()
        .parse()
        .map_err(|_| invalid(format!("expected a whole number from {min} to {max}")))?;
    if n < min || n > max {
        return Err(invalid(format!(
            "expected a whole number from {min} to {max}"
        )));
    }
    Ok(n)
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
    }

    #[test]
    fn malformed_values_are_typed_errors() {
        for (name, value) in [
            ("NODETOUR_IB_GID_INDEX", "-1"),
            ("NODETOUR_IB_GID_INDEX", "256"),
            ("NODETOUR_IB_SL", "16"),
            ("NODETOUR_IB_TC", "x"),
            ("NODETOUR_TIMEOUT_MS", "0"),
            ("NODETOUR_RING_SPIN_US", "1000001"),
        ] {
            match config(&[(name, value)]) {
                Err(Error::InvalidConfig { name: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}={value}: expected InvalidConfig, got {other:?}"),
            }
        }
    }

    #[test]
    fn empty_values_mean_unset() {
        assert_eq!(
            config(&[("NODETOUR_IB_DEVICE", "")]).unwrap().ib_device,
            None
        );
    }
}

//! Deadlines for every blocking wait.
//!
//! Waits in nodetour take a [`Deadline`] (a point in time), not a timeout, so that a wait made of
//! several steps (connect, then read a header, then a payload) cannot exceed its budget by
//! restarting the clock at each step.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A point in time after which a wait gives up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Deadline {
    at: Instant,
    budget: Duration,
}

impl Deadline {
    /// A deadline `budget` from now.
    pub fn after(budget: Duration) -> Self {
        Deadline {
            at: Instant::now() + budget,
            budget,
        }
    }

    /// Time left, zero once passed.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(Instant::now())
    }

    /// Whether the deadline has passed.
    pub fn expired(&self) -> bool {
        Instant::now() >= self.at
    }

    /// The whole budget this deadline was made with.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// `Err(Timeout)` naming `what` if the deadline has passed.
    pub fn check(&self, what: impl FnOnce() -> String) -> Result<()> {
        if self.expired() {
            Err(self.timeout(what()))
        } else {
            Ok(())
        }
    }

    /// The error to return when this deadline passes while waiting for `what`.
    pub fn timeout(&self, what: String) -> Error {
        Error::Timeout {
            what,
            after: self.budget,
        }
    }

    /// Remaining time as milliseconds for `poll(2)`, rounded up so a wait never returns early
    /// and spins, and capped at `cap` so long waits wake up to re-check their conditions.
    pub fn poll_timeout_ms(&self, cap: Duration) -> i32 {
        let left = self.remaining().min(cap);
        let ms = left.as_micros().div_ceil(1000);
        i32::try_from(ms).unwrap_or(i32::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expired_deadline_reports_timeout_with_budget() {
        let d = Deadline::after(Duration::ZERO);
        assert!(d.expired());
        assert_eq!(d.remaining(), Duration::ZERO);
        match d.check(|| "a completion".into()) {
            Err(Error::Timeout { what, after }) => {
                assert_eq!(what, "a completion");
                assert_eq!(after, Duration::ZERO);
            }
            other => panic!("expected a timeout, got {other:?}"),
        }
    }

    #[test]
    fn poll_timeout_rounds_up_and_caps() {
        let d = Deadline::after(Duration::from_secs(3600));
        assert_eq!(d.poll_timeout_ms(Duration::from_millis(100)), 100);
        let soon = Deadline::after(Duration::from_micros(10));
        assert!(soon.poll_timeout_ms(Duration::from_secs(1)) <= 1);
    }
}

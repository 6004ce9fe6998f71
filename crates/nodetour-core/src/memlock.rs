//! The memlock facts of this process (`RLIMIT_MEMLOCK`, `CAP_IPC_LOCK`) and the warning a
//! registration logs once where a small limit only holds because this process is exempt. One
//! floor below both the verbs registrations that warn and the doctor's probe that reports.

/// Smallest memlock limit that lets a communicator register its slots (64 MiB host + flags).
pub const MIN_MEMLOCK: u64 = 64 << 20;

/// The soft `RLIMIT_MEMLOCK` of this process in bytes (`None`: unlimited).
pub fn memlock_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: r is a valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0
        || r.rlim_cur == libc::RLIM_INFINITY
    {
        None
    } else {
        Some(r.rlim_cur)
    }
}

/// Whether the effective capabilities in a `/proc/<pid>/status` text include `CAP_IPC_LOCK`
/// (bit 14), which exempts a process from `RLIMIT_MEMLOCK`.
pub fn status_has_ipc_lock(status: &str) -> bool {
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << 14) != 0)
}

/// Whether this process has `CAP_IPC_LOCK` (root usually does; a container often does not).
pub fn has_ipc_lock() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| status_has_ipc_lock(&s))
}

/// The memlock problem of a process that is exempt from its limit, or `None`. Root (or any
/// holder of `CAP_IPC_LOCK`) registers memory whatever `RLIMIT_MEMLOCK` says, so a job that
/// works here can still fail where the same limit applies (a container without the
/// capability).
pub fn exempt_memlock_warning(
    memlock: Option<u64>,
    ipc_lock: bool,
    minimum: u64,
) -> Option<String> {
    let limit = memlock.filter(|l| *l < minimum)?;
    ipc_lock.then(|| {
        format!(
            "RLIMIT_MEMLOCK is {} KiB; this process has CAP_IPC_LOCK (root) and is exempt here, \
             but the same job in a container without CAP_IPC_LOCK will fail to register memory",
            limit / 1024
        )
    })
}

/// Logs [`exempt_memlock_warning`] for this process once (at its first registration).
pub fn warn_exempt_memlock_once(minimum: u64) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Some(w) = exempt_memlock_warning(memlock_limit(), has_ipc_lock(), minimum) {
            tracing::warn!("{w}: raise it anyway (ulimit -l unlimited, --ulimit memlock=-1)");
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipc_lock_is_read_from_cap_eff() {
        assert!(status_has_ipc_lock("Name:\tx\nCapEff:\t000001ffffffffff\n"));
        assert!(status_has_ipc_lock("CapEff:\t0000000000004000\n"));
        assert!(!status_has_ipc_lock("CapEff:\t0000000000000000\n"));
        assert!(!status_has_ipc_lock("CapPrm:\t0000000000004000\n"));
        assert!(!status_has_ipc_lock("CapEff:\tzz\n"));
    }

    #[test]
    fn root_with_a_small_limit_is_warned_not_blocked() {
        let min = 64 << 20;
        assert!(
            exempt_memlock_warning(Some(8 << 20), true, min)
                .is_some_and(|w| w.contains("container"))
        );
        assert!(
            exempt_memlock_warning(Some(8 << 20), false, min).is_none(),
            "blocked instead"
        );
        assert!(exempt_memlock_warning(None, true, min).is_none());
        assert!(exempt_memlock_warning(Some(min), true, min).is_none());
    }
}

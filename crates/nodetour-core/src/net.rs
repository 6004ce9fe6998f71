//! Socket plumbing shared by the out-of-band channel, the bootstrap (`nodetour-net`) and the tcp
//! transport: safe wrappers over the few system calls they need (poll, getrlimit/setrlimit).

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::RawFd;
use std::time::Duration;

use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// Resolves `addr` ("host:port") to its first address.
pub fn resolve(addr: &str) -> Result<SocketAddr> {
    let err = |source| Error::Exchange {
        op: "resolve",
        peer: addr.to_owned(),
        source,
    };
    addr.to_socket_addrs().map_err(err)?.next().ok_or_else(|| {
        err(io::Error::new(
            io::ErrorKind::NotFound,
            "the name has no address",
        ))
    })
}

/// Connects to `addr`, retrying while nobody listens there yet (the peer may start later),
/// until `deadline`; `alive` is asked between tries and its error ends the wait.
pub fn connect_retrying(
    addr: &str,
    deadline: Deadline,
    alive: &dyn Fn() -> Result<()>,
) -> Result<TcpStream> {
    let target = resolve(addr)?;
    loop {
        match TcpStream::connect_timeout(
            &target,
            deadline.remaining().max(Duration::from_millis(1)),
        ) {
            Ok(s) => return Ok(s),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::ConnectionRefused
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                alive()?;
                deadline.check(|| format!("{addr} to accept a connection ({e})"))?;
                std::thread::sleep(Duration::from_millis(50).min(deadline.remaining()));
            }
            Err(source) => {
                return Err(Error::Exchange {
                    op: "connect",
                    peer: addr.to_owned(),
                    source,
                });
            }
        }
    }
}

/// Sleeps until `fd` is readable, `deadline` passes, or `cap` elapses (callers loop).
pub fn wait_readable(fd: RawFd, deadline: Deadline, cap: Duration) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call.
    unsafe { libc::poll(&mut pfd, 1, deadline.poll_timeout_ms(cap)) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolution_and_refusal_are_typed() {
        assert!(matches!(
            resolve("no-such-host.invalid:1"),
            Err(Error::Exchange { op: "resolve", .. })
        ));
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let r = connect_retrying(
            &format!("127.0.0.1:{port}"),
            Deadline::after(Duration::from_millis(200)),
            &|| Ok(()),
        );
        assert!(matches!(r, Err(Error::Timeout { .. })));
        let dead = || {
            Err(Error::RankLost {
                rank: 3,
                reason: "test".into(),
            })
        };
        let r = connect_retrying(
            &format!("127.0.0.1:{port}"),
            Deadline::after(Duration::from_secs(5)),
            &dead,
        );
        assert!(matches!(r, Err(Error::RankLost { rank: 3, .. })));
    }
}

/// Raises this process's soft limit of open file descriptors (`RLIMIT_NOFILE`) to its hard
/// limit if it is below `needed`; a hard limit below `needed` is a typed error that names the
/// limit and how to raise it (rank 0 of a large job holds a socket per rank).
pub fn raise_open_files(needed: u64) -> Result<()> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(Error::Exchange {
            op: "getrlimit(RLIMIT_NOFILE)",
            peer: "this process".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    if lim.rlim_cur >= needed {
        return Ok(());
    }
    if lim.rlim_max < needed {
        return Err(Error::Unsupported {
            what: "a job of this size",
            reason: format!(
                "RLIMIT_NOFILE: this job needs {needed} open files on rank 0, the hard limit is \
                 {}: raise it (ulimit -Hn, or LimitNOFILE= in the service, or --ulimit nofile= \
                 for a container)",
                lim.rlim_max
            ),
        });
    }
    let raised = libc::rlimit {
        rlim_cur: lim.rlim_max,
        rlim_max: lim.rlim_max,
    };
    // SAFETY: a valid rlimit, raising the soft limit to the hard one (always permitted).
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
        return Err(Error::Exchange {
            op: "setrlimit(RLIMIT_NOFILE)",
            peer: "this process".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    tracing::info!(
        from = lim.rlim_cur,
        to = lim.rlim_max,
        "raised RLIMIT_NOFILE"
    );
    Ok(())
}

#[cfg(test)]
mod open_files_tests {
    use super::*;

    #[test]
    fn a_small_need_is_met_and_an_impossible_one_names_the_limit() {
        raise_open_files(16).unwrap();
        let e = raise_open_files(u64::MAX).unwrap_err();
        assert!(e.to_string().contains("RLIMIT_NOFILE"), "{e}");
    }
}

/// Waits up to `timeout` until any of `fds` is readable (or closed, or in error); returns, per
/// descriptor, whether it is (`None` entries are skipped and never ready). All false on a
/// timeout or an interrupted wait.
pub fn poll_readable(fds: &[Option<RawFd>], timeout: Duration) -> Vec<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|fd| libc::pollfd {
            fd: fd.unwrap_or(-1),
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: pfds is a valid array of pollfds for the duration of the call.
    let n = unsafe {
        libc::poll(
            pfds.as_mut_ptr(),
            pfds.len() as libc::nfds_t,
            timeout.as_millis().min(i32::MAX as u128) as i32,
        )
    };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    pfds.iter().map(|p| p.revents != 0).collect()
}

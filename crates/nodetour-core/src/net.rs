//! Socket plumbing shared by the out-of-band channel, the bootstrap and the tcp transport.

use std::io;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::RawFd;
use std::time::Duration;

use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// Resolves `addr` ("host:port") to its first address.
pub(crate) fn resolve(addr: &str) -> Result<SocketAddr> {
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
pub(crate) fn connect_retrying(
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
pub(crate) fn wait_readable(fd: RawFd, deadline: Deadline, cap: Duration) {
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

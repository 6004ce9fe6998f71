//! Waiting on several connections at once (a rank waits for its previous rank's data and its
//! next rank's grants together).

use std::os::fd::AsRawFd;
use std::time::Duration;

use super::{Event, HostConnection};
use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// Waits until one of `conns` has events (collected into `events`, tagged with the
/// connection's index) or `deadline` passes. Where every connection reads inline
/// ([`HostConnection::read_inline`]), one `poll(2)` covers them all; otherwise each is waited on
/// in turn for a short slice.
pub fn wait_any(
    conns: &mut [&mut dyn HostConnection],
    events: &mut Vec<(usize, Event)>,
    deadline: Deadline,
) -> Result<()> {
    let mut got = Vec::new();
    let before = events.len();
    loop {
        for (i, c) in conns.iter_mut().enumerate() {
            got.clear();
            c.poll(&mut got)?;
            events.extend(got.iter().map(|e| (i, *e)));
        }
        if events.len() > before || deadline.expired() {
            return Ok(());
        }
        let fds: Option<Vec<libc::pollfd>> = conns
            .iter()
            .map(|c| {
                c.readiness().map(|fd| libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
            })
            .collect();
        match fds {
            Some(mut fds) => {
                // SAFETY: `fds` is a valid array of pollfds for the duration of the call; the
                // descriptors stay open (borrowed from the connections, which outlive it).
                unsafe {
                    libc::poll(
                        fds.as_mut_ptr(),
                        fds.len() as libc::nfds_t,
                        deadline.poll_timeout_ms(Duration::from_millis(100)),
                    )
                };
            }
            None => {
                // (A transport without a descriptor spins first, then blocks in its own way:
                // a slice long enough to block in, as the ring always waited.)
                let slice = Duration::from_micros(200);
                for (i, c) in conns.iter_mut().enumerate() {
                    got.clear();
                    let d = Deadline::after(slice.min(deadline.remaining()));
                    match c.wait(&mut got, d) {
                        Ok(()) | Err(Error::Timeout { .. }) => {}
                        Err(e) => return Err(e),
                    }
                    events.extend(got.iter().map(|e| (i, *e)));
                    if events.len() > before {
                        return Ok(());
                    }
                }
            }
        }
    }
}

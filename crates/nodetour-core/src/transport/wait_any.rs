//! Waiting on several connections at once (a rank waits for its previous rank's data and its
//! next rank's grants together).

use std::time::Duration;

use super::{Armed, Event, HostConnection};
use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// Waits until one of `conns` has events (collected into `events`, tagged with the
/// connection's index) or `deadline` passes. Where every connection has descriptors to block on
/// ([`HostConnection::arm`]: tcp reading inline, verbs completion channels), one `poll(2)`
/// covers them all; otherwise each is waited on in turn for a short slice.
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
        let mut fds: Vec<libc::pollfd> = Vec::with_capacity(2 * conns.len());
        let mut pending = false;
        let mut unsupported = false;
        for c in conns.iter_mut() {
            match c.arm()? {
                Armed::Pending => pending = true,
                Armed::Fds(f) => {
                    fds.extend(f.iter().filter(|fd| **fd >= 0).map(|&fd| libc::pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    }))
                }
                Armed::Unsupported => unsupported = true,
            }
        }
        if pending {
            // Events came while arming: the next round's polls take them.
            continue;
        }
        if !unsupported {
            // SAFETY: `fds` is a valid array of pollfds for the duration of the call; the
            // descriptors stay open (the connections, which own them, outlive it).
            unsafe {
                libc::poll(
                    fds.as_mut_ptr(),
                    fds.len() as libc::nfds_t,
                    deadline.poll_timeout_ms(Duration::from_millis(100)),
                )
            };
            continue;
        }
        // (A transport without a descriptor spins first, then blocks in its own way: a slice
        // long enough to block in, as the ring always waited.)
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

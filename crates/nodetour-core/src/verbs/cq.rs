//! A completion queue with its completion channel: polled while work is expected, and
//! blocked on (through the channel's file descriptor) once a short spin finds nothing.

use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdma_sys::{ibv_comp_channel, ibv_cq, ibv_wc};

use super::context::Context;
use super::result;
use crate::deadline::Deadline;
use crate::error::{Error, Result};

/// How long a waiter polls before it arms the channel and sleeps, by default. Long enough to
/// catch a completion that is microseconds away without a system call, short enough not to
/// starve the soft-RoCE kernel threads or other ranks on a 2-core machine.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

static SPIN_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(50);

/// Sets how long waiters poll before they block, for the whole process (`NODETOUR_SPIN_US`,
/// applied when a device is opened through the configuration).
pub fn set_spin(spin: Duration) {
    SPIN_US.store(
        spin.as_micros().min(1_000_000) as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

fn spin() -> Duration {
    Duration::from_micros(SPIN_US.load(std::sync::atomic::Ordering::Relaxed))
}

/// The longest a waiter sleeps before re-checking its deadline and conditions.
const SLEEP_CAP: Duration = Duration::from_millis(100);

pub(crate) struct CompletionQueue {
    // Destroyed in Drop::drop: the CQ first, then the channel it reports to.
    raw: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    context: Arc<Context>,
}

// SAFETY: CQ and channel handles are usable from any thread; the owner serialises polling.
unsafe impl Send for CompletionQueue {}
// SAFETY: as above.
unsafe impl Sync for CompletionQueue {}

impl CompletionQueue {
    pub(crate) fn new(context: &Arc<Context>, entries: u32) -> Result<Self> {
        let lib = context.lib();
        let max = context.attributes().max_cqe;
        if entries == 0 || (max > 0 && entries > max) {
            return Err(Error::InvalidArgument {
                reason: format!("a completion queue of {entries} entries (device maximum {max})"),
            });
        }
        // SAFETY: the context is live.
        let channel =
            unsafe { result::create_comp_channel(lib, context.raw()) }.map_err(|source| {
                Error::CreateCompletionChannel {
                    device: context.name().to_owned(),
                    source,
                }
            })?;
        // Non-blocking, so that a spurious wake-up of poll(2) cannot block in ibv_get_cq_event.
        // SAFETY: channel is live; fd belongs to it.
        unsafe {
            let fd = (*channel).fd;
            let flags = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
        // SAFETY: context and channel are live.
        let raw = match unsafe { result::create_cq(lib, context.raw(), entries, channel) } {
            Ok(raw) => raw,
            Err(source) => {
                // SAFETY: channel is live and unused.
                let _ = unsafe { result::destroy_comp_channel(lib, channel) };
                return Err(Error::CreateCompletionQueue {
                    device: context.name().to_owned(),
                    entries,
                    source,
                });
            }
        };
        Ok(CompletionQueue {
            raw,
            channel,
            context: context.clone(),
        })
    }

    pub(crate) fn raw(&self) -> *mut ibv_cq {
        self.raw
    }

    /// The channel's file descriptor (readable when a completion event is queued), for
    /// progress engines that wait on many queues with epoll.
    pub(crate) fn fd(&self) -> RawFd {
        // SAFETY: channel is live for &self.
        unsafe { (*self.channel).fd }
    }

    /// Polls up to `wc.len()` completions without blocking.
    pub(crate) fn poll(&self, wc: &mut [ibv_wc]) -> Result<usize> {
        // SAFETY: the CQ is live.
        unsafe { result::poll_cq(self.raw, wc) }
            .map_err(|source| Error::PollCompletionQueue { source })
    }

    /// Polls until something completes or `deadline` passes: spins (see [`set_spin`]), then arms the
    /// channel and sleeps on it and on the device's asynchronous event file. `what` names the
    /// awaited event in the timeout error; `interrupt` runs before each sleep and after each
    /// wake-up, and its error (a port that went down, a queue pair the device killed) ends the
    /// wait at once.
    pub(crate) fn wait(
        &self,
        wc: &mut [ibv_wc],
        deadline: Deadline,
        what: &dyn Fn() -> String,
        interrupt: &dyn Fn() -> Result<()>,
    ) -> Result<usize> {
        let spin_until = Instant::now() + spin();
        loop {
            let n = self.poll(wc)?;
            if n > 0 {
                return Ok(n);
            }
            if Instant::now() >= spin_until {
                break;
            }
            std::hint::spin_loop();
        }
        loop {
            // Arm, then poll again: a completion that arrived before arming raises no event.
            // SAFETY: the CQ is live.
            unsafe { result::req_notify_cq(self.raw) }
                .map_err(|source| Error::WaitCompletionChannel { source })?;
            let n = self.poll(wc)?;
            if n > 0 {
                return Ok(n);
            }
            deadline.check(what)?;
            interrupt()?;
            let mut pfd = [
                libc::pollfd {
                    fd: self.fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.context.async_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: pfd is a valid array of two pollfds.
            let rc =
                unsafe { libc::poll(pfd.as_mut_ptr(), 2, deadline.poll_timeout_ms(SLEEP_CAP)) };
            if rc < 0 {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(Error::WaitCompletionChannel { source: e });
                }
            } else if pfd[0].revents != 0 {
                self.consume_event()?;
            }
            // An asynchronous event is read by `interrupt` at the top of the loop.
        }
    }

    /// Asks for an event on the channel at the next completion (a completion already queued
    /// raises none: poll after arming, before blocking on [`Self::fd`]).
    pub(crate) fn arm(&self) -> Result<()> {
        // SAFETY: the CQ is live.
        unsafe { result::req_notify_cq(self.raw) }
            .map_err(|source| Error::WaitCompletionChannel { source })
    }

    /// Takes (and acknowledges) the channel's event, if one is queued, without blocking.
    pub(crate) fn consume_event(&self) -> Result<()> {
        let lib = self.context.lib();
        // SAFETY: channel is live; the fd is non-blocking, so EAGAIN means no event.
        match unsafe { result::get_cq_event(lib, self.channel) } {
            // SAFETY: one event was received for cq, which is ours and live.
            Ok(cq) => unsafe { result::ack_cq_events(lib, cq, 1) },
            Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => {}
            Err(source) => return Err(Error::WaitCompletionChannel { source }),
        }
        Ok(())
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        let lib = self.context.lib();
        // Failure policy: log; a CQ that cannot be destroyed still has a queue pair (a bug),
        // and its channel must then stay too.
        // SAFETY: the owning queue pair was destroyed before this runs; every event was acked.
        match unsafe { result::destroy_cq(lib, self.raw) } {
            Ok(()) => {
                // SAFETY: the channel has no CQ any more.
                let destroyed = unsafe { result::destroy_comp_channel(lib, self.channel) };
                if let Err(e) = destroyed {
                    tracing::warn!(error = %e, "ibv_destroy_comp_channel failed");
                }
            }
            Err(e) => tracing::warn!(error = %e, "ibv_destroy_cq failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_default_spin_is_the_declared_default() {
        assert_eq!(crate::Config::default().spin, super::DEFAULT_SPIN);
    }
}

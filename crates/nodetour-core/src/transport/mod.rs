//! Transports: one-sided writes into a peer's slot regions, with notifications the receiver
//! waits on, behind one interface.
//!
//! A receiver owns [`SlotRegion`]s (memory peers may write, each with a key) and grants them to
//! one peer at a time ([`SlotGrant`]: key, length, and the transport's addressing). A sender
//! writes part of one of its own regions into a granted region at an offset, optionally with a
//! 32-bit notification that the receiver sees after the bytes have landed (and after every
//! earlier write on the same connection).
//!
//! Two kinds of completion, because the hardware differs (see docs/gpu-design-spike.md):
//! host-driven transports ([`HostConnection`]: verbs, tcp, mem) complete on the host; in-host
//! GPU transports (cuda-ipc, shm) queue their copies and flags on CUDA streams.
//!
//! What each transport guarantees about bounds: **tcp** and **mem** check every write's key,
//! offset and length against the regions granted to that peer in software (a bad frame closes the
//! connection before a byte is written); **verbs** relies on the NIC's key check (the remote key
//! names exactly the granted region), and isolation on the fabric is the network's job (VLANs,
//! partition keys).

pub mod gpu;
mod mem;
pub mod one_kernel;
/// The flush by read ([`crate::gdr::read_flush`], where it was before GPUDirect got its room).
pub use crate::gdr::read_flush;
pub mod setup;
mod slots;
pub mod tcp;
mod tcp_rx;
pub mod verbs;
mod wait_any;
pub mod wire;

pub use mem::MemConnection;
pub(crate) use slots::SlotRegistration;
pub use slots::{SlotGrant, SlotRegion, SlotTable};
pub use wait_any::wait_any;

use std::ops::Range;
use std::os::fd::RawFd;

use crate::deadline::Deadline;
use crate::error::Result;

/// Which transport a connection uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransportKind {
    /// RDMA verbs (RC queue pairs).
    Verbs,
    /// TCP sockets, one-sided semantics in software.
    Tcp,
    /// CUDA IPC between GPUs of one host (direct path).
    CudaIpc,
    /// Shared host memory between processes of one host (staged path).
    Shm,
    /// In-process, for tests.
    Mem,
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TransportKind::Verbs => "verbs",
            TransportKind::Tcp => "tcp",
            TransportKind::CudaIpc => "cuda-ipc",
            TransportKind::Shm => "shm",
            TransportKind::Mem => "mem",
        })
    }
}

/// Something that happened on a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// The peer's write carrying this notification has landed in one of our regions, and so
    /// have all its earlier writes on this connection.
    Notified(u32),
}

/// A connection to one peer over a host-driven transport.
pub trait HostConnection: Send {
    /// The transport.
    fn kind(&self) -> TransportKind;

    /// Grants `region` to this peer: from now on the peer may write it, within its bounds.
    fn grant(&mut self, region: &SlotRegion) -> Result<SlotGrant>;

    /// Writes `src[range]` into the peer's granted region `dst` at `dst_offset`, then (if given)
    /// delivers `notify` to the peer. When this returns, `src[range]` may be reused.
    fn write(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()>;

    /// Like [`Self::write`], but may return before the transport has read `src[range]`, so
    /// that several writes are in flight at once: the caller leaves those bytes untouched until
    /// the peer has acknowledged them (the peer acknowledges only what its notification told it
    /// landed, so only bytes that have left this host). A failure of the write surfaces on a
    /// later call. Transports that copy the bytes at once (tcp, in-process) just write.
    fn post(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()> {
        self.write(src, range, dst, dst_offset, notify)
    }

    /// Like [`Self::write`] (`src[range]` may be reused when it returns), but the transport may
    /// hold the write back, with others, until the next [`Self::flush`], [`Self::poll`],
    /// [`Self::wait`] or [`Self::write`] on this connection: several small writes then leave
    /// in one system call. The caller flushes before it stops driving the connection.
    /// Transports that write at once just write.
    fn write_deferred(
        &mut self,
        src: &SlotRegion,
        range: Range<usize>,
        dst: &SlotGrant,
        dst_offset: u64,
        notify: Option<u32>,
    ) -> Result<()> {
        self.write(src, range, dst, dst_offset, notify)
    }

    /// Sends what [`Self::write_deferred`] held back.
    fn flush(&mut self) -> Result<()> {
        Ok(())
    }

    /// Collects events without blocking.
    fn poll(&mut self, events: &mut Vec<Event>) -> Result<()>;

    /// Waits until at least one event arrives or `deadline` passes.
    fn wait(&mut self, events: &mut Vec<Event>, deadline: Deadline) -> Result<()>;

    /// Asks that the thread calling [`Self::poll`] and [`Self::wait`] receive the peer's writes
    /// itself (`true`), instead of a transport thread handing them over (`false`, the default
    /// mode): one wake-up per message instead of two. The caller promises to poll or wait
    /// whenever the peer may be writing to it, and a write of this process that would block
    /// ends the mode for every connection (the transport's threads read again), so a ring of
    /// blocked writers cannot wait for itself. Transports without receive threads ignore it.
    fn read_inline(&mut self, _on: bool) {}

    /// Prepares to block on this connection together with others (one `poll(2)`, see
    /// [`wait_any()`]), after a [`Self::poll`] that found nothing: the descriptors that become
    /// readable when the next [`Self::poll`] may find events, or that events came meanwhile.
    /// The descriptors stay valid while the connection lives; the caller polls the connection
    /// after it woke (or gave up), which takes what woke it.
    fn arm(&mut self) -> Result<Armed> {
        Ok(Armed::Unsupported)
    }
}

/// What [`HostConnection::arm`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Armed {
    /// Events came while arming: the next [`HostConnection::poll`] returns them, so do not
    /// block.
    Pending,
    /// Block until one of these descriptors is readable (negative ones are ignored, as by
    /// `poll(2)`).
    Fds([RawFd; 2]),
    /// No descriptor to block on now: wait on the connection itself, in slices.
    Unsupported,
}

/// Why a transport was chosen for a pair of ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportChoice {
    /// The transport.
    pub kind: TransportKind,
    /// The reason, for the log and the doctor.
    pub reason: String,
}

/// What is known about a pair of ranks when choosing their transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairFacts {
    /// Same kernel (boot id).
    pub same_host: bool,
    /// Same host and shared `/dev/shm` (mount and IPC namespaces).
    pub shares_memory: bool,
    /// Both GPUs can access each other (peer access).
    pub gpu_peer_access: bool,
    /// Both ranks have an RDMA device.
    pub both_have_rdma: bool,
}

/// Chooses the transport for a pair (`NODETOUR_TRANSPORT` forces one). Pure.
///
/// Same host with GPU peer access → cuda-ipc (direct); same host sharing memory → shm (staged);
/// an RDMA device on both → verbs; else tcp.
pub fn choose(facts: &PairFacts, forced: Option<TransportKind>) -> TransportChoice {
    if let Some(kind) = forced {
        return TransportChoice {
            kind,
            reason: format!("NODETOUR_TRANSPORT={kind}"),
        };
    }
    let (kind, reason) = if facts.same_host && facts.gpu_peer_access {
        (
            TransportKind::CudaIpc,
            "same host, GPU peer access: GPUs write each other's memory directly".to_owned(),
        )
    } else if facts.shares_memory {
        (
            TransportKind::Shm,
            "same host without GPU peer access: staged through shared host memory".to_owned(),
        )
    } else if facts.both_have_rdma {
        (
            TransportKind::Verbs,
            "different hosts, both with an RDMA device".to_owned(),
        )
    } else {
        let why = if facts.same_host {
            "same host but no shared memory namespace"
        } else {
            "no RDMA device on both ends"
        };
        (TransportKind::Tcp, format!("{why}: TCP"))
    };
    TransportChoice { kind, reason }
}

/// `NODETOUR_TRANSPORT` of `env` (`auto` or unset: choose per pair).
pub fn forced(env: &crate::knobs::Env<'_>) -> Result<Option<TransportKind>> {
    forced_from_value(env.choice("NODETOUR_TRANSPORT")?)
}

/// Parses a value of `NODETOUR_TRANSPORT` (`auto` or empty: none forced).
pub fn forced_from_value(v: &str) -> Result<Option<TransportKind>> {
    match v.trim() {
        "" | "auto" => Ok(None),
        "verbs" => Ok(Some(TransportKind::Verbs)),
        "tcp" => Ok(Some(TransportKind::Tcp)),
        "cuda-ipc" => Ok(Some(TransportKind::CudaIpc)),
        "shm" => Ok(Some(TransportKind::Shm)),
        other => Err(crate::Error::InvalidConfig {
            name: "NODETOUR_TRANSPORT",
            value: other.to_owned(),
            reason: "expected auto, verbs, tcp, cuda-ipc or shm".into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(
        same_host: bool,
        shares_memory: bool,
        gpu_peer_access: bool,
        both_have_rdma: bool,
    ) -> PairFacts {
        PairFacts {
            same_host,
            shares_memory,
            gpu_peer_access,
            both_have_rdma,
        }
    }

    #[test]
    fn the_choice_follows_the_pair() {
        assert_eq!(
            choose(&facts(true, true, true, true), None).kind,
            TransportKind::CudaIpc
        );
        assert_eq!(
            choose(&facts(true, true, false, true), None).kind,
            TransportKind::Shm
        );
        assert_eq!(
            choose(&facts(false, false, false, true), None).kind,
            TransportKind::Verbs
        );
        let tcp = choose(&facts(false, false, false, false), None);
        assert_eq!(tcp.kind, TransportKind::Tcp);
        assert!(tcp.reason.contains("no RDMA device"));
        let containers = choose(&facts(true, false, false, false), None);
        assert!(containers.reason.contains("no shared memory namespace"));
        let forced = choose(&facts(true, true, true, true), Some(TransportKind::Tcp));
        assert_eq!(
            (forced.kind, forced.reason.as_str()),
            (TransportKind::Tcp, "NODETOUR_TRANSPORT=tcp")
        );
    }
}

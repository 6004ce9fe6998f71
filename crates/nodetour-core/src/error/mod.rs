//! The one error type of `nodetour-core`.
//!
//! Variants are named for the operation that failed. Those that wrap a C call carry the errno
//! (as [`std::io::Error`]) and, where a user can act on it, a hint that says what to change.
//! Callers branch on the variant (and on [`Error::errno`]), never on the message text.

pub mod async_event;

use std::io;
use std::time::Duration;

pub use async_event::AsyncEvent;

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in `nodetour-core`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A capability this machine lacks: a library that cannot be loaded, an rdma-core too old
    /// for a call, a provider that refuses an operation. `reason` says which and how to fix it.
    #[error("{what} is not supported here: {reason}")]
    Unsupported {
        /// What was asked for ("RDMA verbs", "dma-buf registration", ...).
        what: &'static str,
        /// Why it cannot be had, with the remedy where there is one.
        reason: String,
    },

    /// No RDMA device exists on this machine (or none is visible to this process).
    #[error("no RDMA device: {reason}")]
    NoDevice {
        /// What the device list said, and where to look.
        reason: String,
    },

    /// `NODETOUR_IB_DEVICE` (or an explicit name) names a device that does not exist.
    #[error("RDMA device {name:?} not found; devices here: {available}")]
    DeviceNotFound {
        /// The name asked for.
        name: String,
        /// The devices that do exist, comma-separated (or "none").
        available: String,
    },

    /// `ibv_open_device` failed.
    #[error("opening RDMA device {device} failed: {source}{}", hint_suffix(hint))]
    OpenDevice {
        /// Device name.
        device: String,
        /// errno of the call.
        source: io::Error,
        /// What to check.
        hint: &'static str,
    },

    /// `ibv_query_device` failed.
    #[error("querying RDMA device {device} failed: {source}")]
    QueryDevice {
        /// Device name.
        device: String,
        /// errno of the call.
        source: io::Error,
    },

    /// `ibv_query_port` failed.
    #[error("querying port {port} of {device} failed: {source}")]
    QueryPort {
        /// Device name.
        device: String,
        /// Port number (1-based).
        port: u8,
        /// errno of the call.
        source: io::Error,
    },

    /// A port exists but cannot carry traffic.
    #[error("port {port} of {device} is {state}, not ACTIVE (check the link and `ibv_devinfo`)")]
    PortNotActive {
        /// Device name.
        device: String,
        /// Port number (1-based).
        port: u8,
        /// The port state the device reported.
        state: String,
    },

    /// A port number outside `1..=phys_port_cnt`.
    #[error("{device} has {ports} port(s); port {port} does not exist")]
    PortOutOfRange {
        /// Device name.
        device: String,
        /// The port asked for.
        port: u8,
        /// How many ports the device has.
        ports: u8,
    },

    /// `ibv_query_gid` failed.
    #[error("reading GID {index} of {device} port {port} failed: {source}")]
    QueryGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// GID table index.
        index: u32,
        /// errno of the call.
        source: io::Error,
    },

    /// `NODETOUR_IB_GID_INDEX` (or an explicit index) is past the end of the GID table, or
    /// names an empty entry.
    #[error(
        "GID index {index} is not usable on {device} port {port}: {reason} (the table has {table_len} entries; see `show_gids` or /sys/class/infiniband/{device}/ports/{port}/gids)"
    )]
    GidIndexOutOfRange {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// The index asked for.
        index: u32,
        /// Size of the port's GID table.
        table_len: u32,
        /// Why the entry cannot be used.
        reason: String,
    },

    /// No GID on the port can address a peer (no IP address on the RoCE netdev, say).
    #[error("no usable GID on {device} port {port}: {reason}")]
    NoUsableGid {
        /// Device name.
        device: String,
        /// Port number.
        port: u8,
        /// What was found instead, and what to do.
        reason: String,
    },

    /// `ibv_alloc_pd` failed.
    #[error("allocating a protection domain on {device} failed: {source}")]
    AllocateProtectionDomain {
        /// Device name.
        device: String,
        /// errno of the call.
        source: io::Error,
    },

    /// A registration was refused before any call: zero length, a misaligned address, a range
    /// outside the buffer.
    #[error("invalid memory registration: {reason}")]
    InvalidRegistration {
        /// What is wrong with the request.
        reason: String,
    },

    /// `ibv_reg_mr` / `ibv_reg_mr_iova2` / `ibv_reg_dmabuf_mr` failed.
    #[error(
        "registering {len} bytes of {kind} memory failed: {source}{}",
        hint_suffix(hint)
    )]
    RegisterMemory {
        /// "host", "dma-buf" or "peermem".
        kind: &'static str,
        /// Bytes asked for.
        len: usize,
        /// errno of the call.
        source: io::Error,
        /// What the errno usually means here.
        hint: &'static str,
    },

    /// Mapping host memory failed.
    #[error("allocating {len} bytes of host memory failed: {source}")]
    AllocateHostMemory {
        /// Bytes asked for.
        len: usize,
        /// errno of `mmap`.
        source: io::Error,
    },

    /// `ibv_create_comp_channel` failed.
    #[error("creating a completion channel on {device} failed: {source}")]
    CreateCompletionChannel {
        /// Device name.
        device: String,
        /// errno of the call.
        source: io::Error,
    },

    /// `ibv_create_cq` failed.
    #[error("creating a completion queue of {entries} entries on {device} failed: {source}")]
    CreateCompletionQueue {
        /// Device name.
        device: String,
        /// Entries asked for.
        entries: u32,
        /// errno of the call.
        source: io::Error,
    },

    /// `ibv_create_qp` failed.
    #[error(
        "creating an RC queue pair on {device} failed: {source}{}",
        hint_suffix(hint)
    )]
    CreateQueuePair {
        /// Device name.
        device: String,
        /// errno of the call.
        source: io::Error,
        /// What the errno usually means here.
        hint: &'static str,
    },

    /// `ibv_modify_qp` failed.
    #[error(
        "moving queue pair {qpn} from {from} to {to} failed: {source}{}",
        hint_suffix(hint)
    )]
    ModifyQueuePair {
        /// Queue pair number.
        qpn: u32,
        /// State before.
        from: &'static str,
        /// State asked for.
        to: &'static str,
        /// errno of the call.
        source: io::Error,
        /// What the errno usually means here.
        hint: &'static str,
    },

    /// A state change the RC transition table does not allow.
    #[error("queue pair {qpn}: no transition from {from} to {to}")]
    InvalidTransition {
        /// Queue pair number.
        qpn: u32,
        /// State before.
        from: &'static str,
        /// State asked for.
        to: &'static str,
    },

    /// `ibv_post_send` failed.
    #[error("posting a send work request on queue pair {qpn} failed: {source}")]
    PostSend {
        /// Queue pair number.
        qpn: u32,
        /// errno of the call.
        source: io::Error,
    },

    /// `ibv_post_recv` failed.
    #[error("posting a receive on queue pair {qpn} failed: {source}")]
    PostReceive {
        /// Queue pair number.
        qpn: u32,
        /// errno of the call.
        source: io::Error,
    },

    /// The send queue has no free entry until completions are polled.
    #[error("send queue of queue pair {qpn} is full ({depth} work requests outstanding)")]
    SendQueueFull {
        /// Queue pair number.
        qpn: u32,
        /// Send queue depth.
        depth: u32,
    },

    /// The queue pair is not connected (or has failed) and cannot take work.
    #[error("queue pair {qpn} is in state {state} and cannot {op}")]
    QueuePairNotReady {
        /// Queue pair number.
        qpn: u32,
        /// Current state.
        state: &'static str,
        /// What was attempted.
        op: &'static str,
    },

    /// `ibv_poll_cq` returned an error.
    #[error("polling the completion queue failed: {source}")]
    PollCompletionQueue {
        /// errno of the call.
        source: io::Error,
    },

    /// `ibv_req_notify_cq`, `poll` on the completion channel or `ibv_get_cq_event` failed.
    #[error("waiting on the completion channel failed: {source}")]
    WaitCompletionChannel {
        /// errno of the call.
        source: io::Error,
    },

    /// A work request completed with an error status.
    #[error(
        "work request {wr_id} on queue pair {qpn} completed with {status} (vendor error {vendor_err:#x}){}",
        hint_suffix(hint)
    )]
    WorkCompletion {
        /// Queue pair number.
        qpn: u32,
        /// The work request's id.
        wr_id: u64,
        /// The status, by its verbs name (`IBV_WC_RETRY_EXC_ERR`, ...).
        status: &'static str,
        /// The numeric status.
        status_code: u32,
        /// Provider-specific detail.
        vendor_err: u32,
        /// What the status usually means.
        hint: &'static str,
    },

    /// The device reported an asynchronous event that ends a queue pair's work (port down,
    /// queue pair or device fatal).
    #[error("RDMA device {device}: {event}{}", hint_suffix(hint))]
    AsyncEvent {
        /// The device.
        device: String,
        /// The event.
        event: AsyncEvent,
        /// What it usually means and what to do.
        hint: &'static str,
    },

    /// A deadline passed.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long was waited.
        after: Duration,
    },

    /// An offset/length outside a region.
    #[error("{what}: range {offset}..{offset}+{len} is outside the region of {region_len} bytes")]
    OutOfBounds {
        /// What was attempted.
        what: &'static str,
        /// Start of the range.
        offset: u64,
        /// Length of the range.
        len: u64,
        /// Size of the region.
        region_len: u64,
    },

    /// An argument that no call could accept (zero depth, an immediate on a plain write, ...).
    #[error("invalid argument: {reason}")]
    InvalidArgument {
        /// What is wrong.
        reason: String,
    },

    /// A `NODETOUR_*` environment variable could not be parsed.
    #[error("{name}={value:?} is not valid: {reason}")]
    InvalidConfig {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        reason: String,
    },

    /// A connection to a peer failed (connect, accept, read, write, EOF): the out-of-band
    /// channel, the bootstrap, or a socket transport.
    #[error("{op} with {peer} failed: {source}")]
    Exchange {
        /// What was being done.
        op: &'static str,
        /// The peer's address.
        peer: String,
        /// The socket error.
        source: io::Error,
    },

    /// Bytes from a peer did not decode.
    #[error("malformed {what} from peer: {reason}")]
    Decode {
        /// What was being decoded.
        what: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// A CUDA driver call failed.
    #[error("CUDA {op} failed: {code}{}", hint_suffix(hint))]
    Cuda {
        /// The call (`cuMemAlloc`, `cuMemHostRegister`, ...).
        op: &'static str,
        /// The CUDA error name (`CUDA_ERROR_OUT_OF_MEMORY`, ...).
        code: String,
        /// What it usually means here.
        hint: &'static str,
    },

    /// NVRTC could not compile nodetour's kernels.
    #[error("compiling CUDA kernels for {arch} failed: {log}")]
    CompileKernels {
        /// Target architecture (`sm_90`).
        arch: String,
        /// The compiler's log, or the NVRTC error.
        log: String,
    },

    /// Forming the job failed: world size mismatch, duplicate rank, a rank that never arrived,
    /// a peer refused.
    #[error("rendezvous failed: {reason}")]
    Rendezvous {
        /// What went wrong, naming the ranks involved.
        reason: String,
    },

    /// A peer failed the job-token challenge (or we did, in its eyes).
    #[error("authenticating {peer} failed: {reason}")]
    Authenticate {
        /// The peer's address (and rank, if known).
        peer: String,
        /// Why.
        reason: String,
    },

    /// A rank of the job is gone (its process died or its connection broke).
    #[error("rank {rank} lost: {reason}")]
    RankLost {
        /// The lost rank.
        rank: u32,
        /// How it was noticed.
        reason: String,
    },

    /// A peer's description does not fit ours (other link layer, other protocol version).
    #[error("peer is incompatible: {reason}")]
    PeerMismatch {
        /// What differs.
        reason: String,
    },

    /// The caller aborted the work (an abort handle, from any thread).
    #[error("aborted: {reason}")]
    Aborted {
        /// The reason the caller gave.
        reason: String,
    },
}

impl Error {
    /// The errno behind this error, where a C call or socket failed.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::OpenDevice { source, .. }
            | Error::QueryDevice { source, .. }
            | Error::QueryPort { source, .. }
            | Error::QueryGid { source, .. }
            | Error::AllocateProtectionDomain { source, .. }
            | Error::RegisterMemory { source, .. }
            | Error::AllocateHostMemory { source, .. }
            | Error::CreateCompletionChannel { source, .. }
            | Error::CreateCompletionQueue { source, .. }
            | Error::CreateQueuePair { source, .. }
            | Error::ModifyQueuePair { source, .. }
            | Error::PostSend { source, .. }
            | Error::PostReceive { source, .. }
            | Error::PollCompletionQueue { source }
            | Error::WaitCompletionChannel { source }
            | Error::Exchange { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }

    /// Whether this error means "this machine cannot do that" rather than "something broke":
    /// callers fall back (to staging, to tcp) on these and fail on the rest.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. } | Error::NoDevice { .. })
            || matches!(self, Error::Cuda { code, .. } if code == "CUDA_ERROR_NOT_SUPPORTED")
            || matches!(
                self.errno(),
                Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT) | Some(libc::ENOSYS)
            )
    }
}

fn hint_suffix(hint: &str) -> String {
    if hint.is_empty() {
        String::new()
    } else {
        format!(" (hint: {hint})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_carry_errno_and_hint() {
        let e = Error::RegisterMemory {
            kind: "host",
            len: 4096,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
            hint: "raise the memlock limit",
        };
        let text = e.to_string();
        assert!(text.contains("4096 bytes of host memory"), "{text}");
        assert!(text.contains("hint: raise the memlock limit"), "{text}");
        assert_eq!(e.errno(), Some(libc::ENOMEM));
        assert!(!e.is_unsupported());
    }

    #[test]
    fn eopnotsupp_counts_as_unsupported() {
        let e = Error::RegisterMemory {
            kind: "dma-buf",
            len: 1,
            source: io::Error::from_raw_os_error(libc::EOPNOTSUPP),
            hint: "",
        };
        assert!(e.is_unsupported());
        assert!(!e.to_string().contains("hint"));
    }
}

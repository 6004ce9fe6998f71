//! When the NIC's writes into GPU memory are visible to the GPU's own work: the decision, as a
//! pure function of the GPU's attributes and `NODETOUR_GDR_FLUSH`, tested on fixtures.
//!
//! A network link that lands chunks in GPU slots releases the receiving stream once the chunk's
//! completion arrived; whether the GPU's next read of the slot can see stale bytes depends on the
//! GPU:
//! - `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING` ≥ 100 (owner): the GPU orders remote
//!   writes to its own memory as its own work observes them, so work released after the
//!   completion reads the data (Hopper and later report it; the H200 reports 100);
//! - else the writes can still be in flight inside the GPU when the completion arrives, and a
//!   flush is needed first: an RDMA READ of the landed bytes on a loopback queue pair (what NCCL
//!   does: the read returns only once the earlier writes are visible), or
//!   `cuFlushGPUDirectRDMAWrites` from the host where `_FLUSH_WRITES_OPTIONS` has bit 1.
//!
//! NCCL skips the flush on compute capability ≥ 9.0 unless forced; `auto` here does the same
//! where the GPU also reports owner ordering. Host slots (the staged path) never need a flush.
//! A read flush needs remote read on the landing region: its registration must be the flush's
//! own (its own protection domain), so that no peer's queue pair holds a readable key for slots
//! ([`Flush::needs_read_access`]).

use std::fmt;

use crate::cuda::GdrAttributes;
use crate::error::{Error, Result};

/// `CU_GPU_DIRECT_RDMA_WRITES_ORDERING_OWNER`.
pub const ORDERING_OWNER: i32 = 100;
/// Bit of `_FLUSH_WRITES_OPTIONS`: `cuFlushGPUDirectRDMAWrites` is available.
pub const FLUSH_OPTION_HOST: i32 = 1;

pub use crate::config::FlushOverride;

/// How the receiver makes a landed chunk visible before its stream reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushMethod {
    /// Nothing: the GPU orders the writes (or the slot is host memory).
    None,
    /// An RDMA READ of the landed bytes on a loopback queue pair, completed before release.
    RdmaRead,
    /// `cuFlushGPUDirectRDMAWrites` (to the owner) from the progress thread before release.
    HostCall,
}

/// The decision and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Flush {
    /// What the receiver does.
    pub method: FlushMethod,
    /// Why (for `paths()` and the log).
    pub reason: String,
}

impl Flush {
    /// Whether the landing region must grant remote read (to the flush's own loopback queue
    /// pair only).
    pub fn needs_read_access(&self) -> bool {
        self.method == FlushMethod::RdmaRead
    }
}

impl fmt::Display for FlushMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FlushMethod::None => "no flush",
            FlushMethod::RdmaRead => "flush by RDMA read",
            FlushMethod::HostCall => "flush by cuFlushGPUDirectRDMAWrites",
        })
    }
}

impl fmt::Display for Flush {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.method, self.reason)
    }
}

/// The flush for chunks a NIC writes into GPU memory of a GPU with `attrs` and compute
/// capability `cc`, under `over`. A forced method the GPU cannot do is a typed error.
pub fn decide(attrs: &GdrAttributes, cc: (i32, i32), over: FlushOverride) -> Result<Flush> {
    let owner = attrs.writes_ordering >= ORDERING_OWNER;
    let host_call = attrs.flush_writes_options & FLUSH_OPTION_HOST != 0;
    let flush = |method, reason: String| Ok(Flush { method, reason });
    match over {
        FlushOverride::Off => flush(
            FlushMethod::None,
            if owner {
                "NODETOUR_GDR_FLUSH=off (the GPU orders remote writes anyway)".into()
            } else {
                format!(
                    "NODETOUR_GDR_FLUSH=off: the GPU does not order remote writes (writes \
                     ordering {}): chunks may be read before they are visible",
                    attrs.writes_ordering
                )
            },
        ),
        FlushOverride::Read => flush(FlushMethod::RdmaRead, "NODETOUR_GDR_FLUSH=read".into()),
        FlushOverride::Host if host_call => {
            flush(FlushMethod::HostCall, "NODETOUR_GDR_FLUSH=host".into())
        }
        FlushOverride::Host => Err(Error::Unsupported {
            what: "NODETOUR_GDR_FLUSH=host",
            reason: format!(
                "this GPU does not offer cuFlushGPUDirectRDMAWrites (flush options {:#x})",
                attrs.flush_writes_options
            ),
        }),
        FlushOverride::Auto if owner && cc.0 >= 9 => flush(
            FlushMethod::None,
            format!(
                "the GPU orders remote writes to its own memory (writes ordering {}, compute \
                 capability {}.{})",
                attrs.writes_ordering, cc.0, cc.1
            ),
        ),
        FlushOverride::Auto => flush(
            FlushMethod::RdmaRead,
            format!(
                "the GPU {} (writes ordering {}, compute capability {}.{}): an RDMA read on a \
                 loopback queue pair makes each chunk visible before release",
                if owner {
                    "orders remote writes, but before compute capability 9.0 NCCL flushes too"
                } else {
                    "does not order remote writes"
                },
                attrs.writes_ordering,
                cc.0,
                cc.1
            ),
        ),
    }
}

/// Chunks land in host memory (the staged path): coherent, never flushed.
pub fn host_slots() -> Flush {
    Flush {
        method: FlushMethod::None,
        reason: "the slots are host memory".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordering: i32, options: i32) -> GdrAttributes {
        GdrAttributes {
            gpu_direct_rdma: true,
            flush_writes_options: options,
            writes_ordering: ordering,
            dma_buf: true,
            host_register: true,
            gdr_with_vmm: true,
            stream_wait_value: true,
        }
    }

    /// What the H200 of the GPU tier reports (`nodetour gpus`, docs/measurements).
    fn h200() -> (GdrAttributes, (i32, i32)) {
        (gpu(100, 1), (9, 0))
    }

    /// An Ampere GPU without owner ordering.
    fn a100() -> (GdrAttributes, (i32, i32)) {
        (gpu(0, 1), (8, 0))
    }

    #[test]
    fn hopper_with_owner_ordering_needs_no_flush_and_older_gpus_read() {
        let (a, cc) = h200();
        let f = decide(&a, cc, FlushOverride::Auto).unwrap();
        assert_eq!(f.method, FlushMethod::None);
        assert!(f.reason.contains("orders remote writes"), "{f}");
        assert!(!f.needs_read_access());
        let (a, cc) = a100();
        let f = decide(&a, cc, FlushOverride::Auto).unwrap();
        assert_eq!(f.method, FlushMethod::RdmaRead);
        assert!(f.needs_read_access());
        // Owner ordering before 9.0: NCCL still flushes, and so do we.
        assert_eq!(
            decide(&gpu(100, 1), (8, 6), FlushOverride::Auto)
                .unwrap()
                .method,
            FlushMethod::RdmaRead
        );
        // 9.0 without owner ordering (a driver that does not report it): read.
        assert_eq!(
            decide(&gpu(0, 0), (9, 0), FlushOverride::Auto)
                .unwrap()
                .method,
            FlushMethod::RdmaRead
        );
    }

    #[test]
    fn overrides_are_honoured_and_impossible_ones_are_typed_errors() {
        let (a, cc) = h200();
        assert_eq!(
            decide(&a, cc, FlushOverride::Read).unwrap().method,
            FlushMethod::RdmaRead
        );
        assert_eq!(
            decide(&a, cc, FlushOverride::Host).unwrap().method,
            FlushMethod::HostCall
        );
        let off = decide(&gpu(0, 0), (8, 0), FlushOverride::Off).unwrap();
        assert_eq!(off.method, FlushMethod::None);
        assert!(off.reason.contains("may be read before"), "{off}");
        assert!(matches!(
            decide(&gpu(0, 0), (8, 0), FlushOverride::Host),
            Err(Error::Unsupported { .. })
        ));
        assert_eq!(host_slots().method, FlushMethod::None);
    }

    #[test]
    fn the_variable_parses_and_a_bad_value_names_itself() {
        for (v, want) in [
            ("auto", FlushOverride::Auto),
            ("", FlushOverride::Auto),
            ("READ", FlushOverride::Read),
            ("host", FlushOverride::Host),
            ("off", FlushOverride::Off),
        ] {
            assert_eq!(FlushOverride::parse(v).unwrap(), want);
        }
        let e = FlushOverride::parse("sometimes").unwrap_err();
        assert!(e.to_string().contains("NODETOUR_GDR_FLUSH"), "{e}");
    }
}

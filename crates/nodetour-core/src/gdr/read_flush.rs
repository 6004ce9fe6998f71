//! The flush by RDMA read: on GPUs that do not order a NIC's writes into their memory as their
//! own work sees them ([`crate::gdr::visibility`]), a chunk that landed in GPU slots is read back by
//! an RDMA READ of a few of its bytes on a loopback queue pair before the receive stream is
//! released. The read's completion means the writes before it are visible (PCIe ordering: a
//! read does not pass earlier posted writes to the same device), which is what NCCL does.
//!
//! Least privilege: the read needs remote read on the slots, which no peer may have. The flush
//! has a protection domain of its own, its own registration of the slots (readable, not
//! writable), a small host target, and a queue pair connected to itself: no peer's queue pair is
//! in that domain, so no peer ever holds a key that reads the slots, and the queue pairs that
//! reach peers never serve reads ([`QueuePair::new_reader`] is for this one only).

use std::sync::Arc;
use std::time::Duration;

use crate::config::Config;
use crate::deadline::Deadline;
use crate::error::{Error, Result};
use crate::gdr::registration::{LadderBuffer, Rung};
use crate::memory::{HostBuffer, RdmaBuffer};
use crate::verbs::{
    Access, Completion, Context, GidChoice, MemoryRegion, PathOptions, PortAttributes,
    ProtectionDomain, QueuePair, QueuePairOptions, RemoteRegion,
};

/// The memory of an existing registration, to be registered a second time (in another
/// protection domain). It holds the first registration, so the memory outlives the second.
pub struct Alias<B: RdmaBuffer>(Arc<MemoryRegion<B>>);

impl<B: RdmaBuffer> Alias<B> {
    /// The first registration.
    pub fn first(&self) -> &Arc<MemoryRegion<B>> {
        &self.0
    }
}

// SAFETY: the range is the first registration's buffer, alive (and not moved) while that
// registration is, which this value holds.
unsafe impl<B: RdmaBuffer> RdmaBuffer for Alias<B> {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.0.buffer().as_mut_ptr()
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn kind(&self) -> &'static str {
        self.0.buffer().kind()
    }
}

/// Access of the flush's registration of the slots: read by its own queue pair only.
const READABLE: Access = Access {
    remote_write: false,
    remote_read: true,
    relaxed_ordering: false,
};

/// A flush by RDMA read for one set of GPU slots.
pub struct ReadFlush {
    // Drop order: the queue pair first (destroyed with its reads retired or flushed), then the
    // target and the second registration of the slots (which holds the first), then, through
    // the last `Arc`, the protection domain.
    qp: QueuePair,
    target: Arc<MemoryRegion<HostBuffer>>,
    _source: Box<dyn Send + Sync>,
    source: RemoteRegion,
    timeout: Duration,
    completions: Vec<Completion>,
}

impl ReadFlush {
    /// The flush for `slots` (registered through `rung`) on `device`, port `port` with `gid`
    /// (the slots' device: a [`crate::verbs::LocalSide`]'s): a protection domain of its own,
    /// the slots registered there again (readable), and a queue pair connected to itself.
    /// `timeout` bounds each flush.
    pub fn new<B: LadderBuffer>(
        device: &Arc<Context>,
        port: &PortAttributes,
        gid: &GidChoice,
        config: &Config,
        slots: &Arc<MemoryRegion<B>>,
        rung: Rung,
        timeout: Duration,
    ) -> Result<ReadFlush> {
        match rung {
            Rung::DmaBuf => {
                let pd = ProtectionDomain::new(device)?;
                let second = B::register_dmabuf_again(&pd, Alias(slots.clone()), READABLE)
                    .map_err(|(e, _)| e)?;
                Self::with(pd, second, port, gid, config, timeout)
            }
            Rung::PeerMem => Self::by_address(device, port, gid, config, slots, timeout),
            Rung::Staged => Err(Error::InvalidArgument {
                reason: "host slots are never flushed".into(),
            }),
        }
    }

    /// The flush for `slots` registered by address (`ibv_reg_mr`: the peermem rung for GPU
    /// memory; host memory in tests, where the flush's control flow runs over soft-RoCE).
    pub fn by_address<B: RdmaBuffer>(
        device: &Arc<Context>,
        port: &PortAttributes,
        gid: &GidChoice,
        config: &Config,
        slots: &Arc<MemoryRegion<B>>,
        timeout: Duration,
    ) -> Result<ReadFlush> {
        let pd = ProtectionDomain::new(device)?;
        let second = MemoryRegion::register(&pd, Alias(slots.clone()), READABLE)?;
        Self::with(pd, second, port, gid, config, timeout)
    }

    fn with<B: RdmaBuffer>(
        pd: Arc<ProtectionDomain>,
        second: MemoryRegion<Alias<B>>,
        port: &PortAttributes,
        gid: &GidChoice,
        config: &Config,
        timeout: Duration,
    ) -> Result<ReadFlush> {
        let source = second.remote();
        let target = Arc::new(MemoryRegion::register(
            &pd,
            HostBuffer::new(4096)?,
            Access::LOCAL,
        )?);
        let qp = QueuePair::new_reader(
            &pd,
            port.port,
            QueuePairOptions {
                send_depth: 4,
                recv_depth: 1,
                max_inline: 0,
            },
        )?;
        qp.connect(&qp.endpoint(gid), &PathOptions::new(port.port, gid, config))?;
        Ok(ReadFlush {
            qp,
            target,
            _source: Box::new(second),
            source,
            timeout,
            completions: Vec::new(),
        })
    }

    /// The bytes the last flush read back (for checks: they are the landed bytes).
    pub fn read_back(&self) -> Result<[u8; 4]> {
        let mut b = [0u8; 4];
        self.target.read_at(0, &mut b)?;
        Ok(b)
    }

    /// Makes the writes that landed `len` bytes at `offset` of the slots visible: reads up to
    /// four of those bytes back and waits for the read (spinning briefly, then blocking on the
    /// completion channel, until the flush's timeout). Nothing to do for an empty chunk.
    pub fn flush(&mut self, offset: usize, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let n = len.min(4);
        let wr = self
            .qp
            .post_read(&self.target, 0..n, &self.source, offset as u64)?;
        let deadline = Deadline::after(self.timeout);
        loop {
            for c in self.completions.drain(..) {
                if let Completion::Send { wr_id, .. } = c
                    && wr_id == wr
                {
                    return Ok(());
                }
            }
            self.qp.wait(&mut self.completions, deadline)?;
        }
    }
}

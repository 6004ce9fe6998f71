//! The memory of the one-kernel allreduce on one host ([`crate::cuda::one_kernel`]): this
//! rank's scratch and signal page, exported over cuda-ipc to every rank of the host (not only
//! the ring's neighbours: every rank reads every peer), the peers' mapped, and the words only
//! this rank uses (its sequence words in GPU memory, its status page in host memory).
//!
//! Least privilege: every rank of the host (not only the ring's neighbours) maps this rank's
//! signal page, which it can write (its own words there are the protocol; it could write the
//! others', which only ends a wait early or late — the counted arrival words, the deadline and
//! the stop word bound what that costs), and its scratch, which it reads and which holds
//! nothing but copies of this rank's inputs to one-kernel collectives. Nothing of the caller's
//! memory is exported, except a symmetric buffer the caller asked for
//! ([`OneKernel::symmetric_create`]): that is the caller's data, mapped (read and written in
//! place) by every rank of the host while it lives.
//!
//! Teardown: [`OneKernel::close_imports`] closes this rank's mappings of its peers' memory
//! (each after the work queued on it, with a deadline); the memory this rank exported is freed
//! when the [`OneKernel`] is dropped, which its owner does only after every peer has closed its
//! mappings (the GPU ring's teardown handshake).

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaContext, sys};

use crate::cuda::GpuStream;
use crate::cuda::one_kernel::{
    ONE_SHOT_BLOCKS, ONE_SHOT_MAX_RANKS, OneShotArgs, SEQUENCE_BYTES, TWO_SHOT_ABOVE, status,
};
use crate::cuda::reduce::ReduceKernels;
use crate::cuda::result::cuda_error;
use crate::dtype::{DataType, ReduceOp};
use crate::error::{Error, Result};
use crate::memory::DeviceBuffer;
use crate::transport::gpu::{Flags, GpuSlot, IpcGrant, IpcMapping, StopWord};

/// Bytes of a signal page: one 8-byte word per (rank, block).
const SIGNAL_BYTES: usize = ONE_SHOT_MAX_RANKS * ONE_SHOT_BLOCKS as usize * 8;

/// Where a GPU sits on its host: PCI domain, bus and device. Ranks whose GPUs have the same
/// identity share a GPU.
pub type GpuIdentity = [u32; 3];

/// The PCI identity of `context`'s GPU.
pub fn gpu_identity(context: &Arc<CudaContext>) -> Result<GpuIdentity> {
    use sys::CUdevice_attribute::*;
    let mut id = [0u32; 3];
    for (slot, a) in id.iter_mut().zip([
        CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID,
        CU_DEVICE_ATTRIBUTE_PCI_BUS_ID,
        CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID,
    ]) {
        *slot = context
            .attribute(a)
            .map_err(|e| cuda_error("cuDeviceGetAttribute", e))? as u32;
    }
    Ok(id)
}

/// What a peer needs to take part: this rank's scratch and signal page, and its GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OneKernelGrant {
    /// The scratch (both halves).
    pub scratch: IpcGrant,
    /// The signal page.
    pub signals: IpcGrant,
    /// The GPU it is on.
    pub gpu: GpuIdentity,
}

impl OneKernelGrant {
    /// Encoded size.
    pub const ENCODED_LEN: usize = 2 * IpcGrant::ENCODED_LEN + 12;

    /// Encodes for the formation exchange.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(Self::ENCODED_LEN);
        b.extend_from_slice(&self.scratch.encode());
        b.extend_from_slice(&self.signals.encode());
        for v in self.gpu {
            b.extend_from_slice(&v.to_be_bytes());
        }
        b
    }

    /// Decodes what a peer sent (lengths are checked against the mapping when it is opened).
    pub fn decode(b: &[u8]) -> Result<OneKernelGrant> {
        if b.len() != Self::ENCODED_LEN {
            return Err(Error::Decode {
                what: "one-kernel grant",
                reason: format!("{} bytes", b.len()),
            });
        }
        let g = IpcGrant::ENCODED_LEN;
        let word = |i: usize| {
            u32::from_be_bytes(b[2 * g + 4 * i..2 * g + 4 * i + 4].try_into().expect("4"))
        };
        Ok(OneKernelGrant {
            scratch: IpcGrant::decode(&b[..g])?,
            signals: IpcGrant::decode(&b[g..2 * g])?,
            gpu: [word(0), word(1), word(2)],
        })
    }
}

/// This rank's own one-kernel memory, before it is connected to its peers.
pub struct OneKernelArena {
    scratch: GpuSlot,
    signals: GpuSlot,
    // Each block's sequence words (this GPU's memory, zeroed).
    counters: DeviceBuffer,
    // One status word per block (host memory mapped into the GPU; private: unlinked at once).
    status: Flags,
    rank: u32,
    world: u32,
    half: usize,
    gpu: GpuIdentity,
}

impl OneKernelArena {
    /// Allocates rank `rank` of `world`'s memory on `context`'s GPU for collectives of up to
    /// `half` bytes.
    pub fn create(
        context: &Arc<CudaContext>,
        rank: u32,
        world: u32,
        half: usize,
    ) -> Result<OneKernelArena> {
        if world < 2 || world as usize > ONE_SHOT_MAX_RANKS || rank >= world || half == 0 {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "one-kernel collectives for rank {rank} of {world} (2 to \
                     {ONE_SHOT_MAX_RANKS} ranks) of {half} bytes"
                ),
            });
        }
        let half = half.next_multiple_of(256);
        let status = Flags::create(context, ONE_SHOT_BLOCKS)?;
        status.unlink()?;
        Ok(OneKernelArena {
            scratch: GpuSlot::new(context, 2 * half)?,
            signals: GpuSlot::new(context, SIGNAL_BYTES)?,
            counters: DeviceBuffer::new(context, SEQUENCE_BYTES)?,
            status,
            rank,
            world,
            half,
            gpu: gpu_identity(context)?,
        })
    }

    /// What every peer needs (the same grant goes to each).
    pub fn grant(&self) -> Result<OneKernelGrant> {
        Ok(OneKernelGrant {
            scratch: self.scratch.ipc_grant()?,
            signals: self.signals.ipc_grant()?,
            gpu: self.gpu,
        })
    }

    /// This rank's GPU.
    pub fn gpu(&self) -> GpuIdentity {
        self.gpu
    }

    /// This rank's side, polling `stop` and waiting at most `timeout` for a peer; connect it
    /// with [`OneKernel::map_peers`].
    pub fn into_kernel(self, stop: StopWord, timeout: Duration) -> OneKernel {
        OneKernel {
            peers: Vec::new(),
            symmetric: Vec::new(),
            own: self,
            stop,
            timeout,
        }
    }
}

/// One symmetric buffer: this rank's part (exported to every peer) and the peers' parts,
/// mapped here once every rank has allocated its own.
struct Symmetric {
    peers: Vec<Option<IpcMapping>>,
    own: GpuSlot,
}

/// A peer's scratch and signal page, mapped here.
struct PeerMemory {
    scratch: IpcMapping,
    signals: IpcMapping,
}

/// One rank's one-kernel allreduce, connected to every peer of its host.
pub struct OneKernel {
    // Drop order: the mappings of the peers' memory first (each waits for its work), then this
    // rank's own memory (see the module's doc for when its owner may drop it).
    peers: Vec<Option<PeerMemory>>,
    // Symmetric buffers, by id (their mappings of the peers' parts first, then this rank's).
    // (`None`: an id whose part could not be made here, or was released before any peer
    // mapped it: the ids stay in step with the peers'.)
    symmetric: Vec<Option<Symmetric>>,
    own: OneKernelArena,
    stop: StopWord,
    timeout: Duration,
}

/// Why a one-kernel collective did not finish: what a block latched, and which collective
/// (its number on this rank's GPU: the launches that ran to their end before it, plus one,
/// modulo 2^16; graph replays count like eager launches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OneKernelFailed {
    /// What happened.
    pub failure: OneKernelFailure,
    /// The failed collective's number on this GPU, modulo 2^16.
    pub collective: u16,
}

/// What a block latched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OneKernelFailure {
    /// The rank's stop word ended the wait (it aborted) while it waited for `peer`.
    Aborted {
        /// The rank waited for.
        peer: u32,
    },
    /// `peer` did not arrive within the deadline.
    Timeout {
        /// The rank waited for.
        peer: u32,
    },
    /// `peer` arrived with another descriptor.
    Disagreement {
        /// The rank that differs.
        peer: u32,
    },
    /// Another launch of this rank's one-kernel collectives ran at the same time: a graph
    /// replay not ordered against the communicator's other collectives.
    Concurrent,
    /// `peer` took its arrival back: it failed at this barrier after arriving.
    PeerGaveUp {
        /// The rank that gave up.
        peer: u32,
    },
}

impl OneKernel {
    /// Maps every peer's scratch and signal page (`grants[r]` for every rank `r` but this one),
    /// checking that each grant covers what the kernel touches. Fails where a peer's memory
    /// cannot be mapped (another host, no peer access); what was mapped stays mapped until
    /// [`Self::close_imports`] (or the drop), and collectives are refused.
    pub fn map_peers(&mut self, grants: &[Option<OneKernelGrant>]) -> Result<()> {
        let own = &self.own;
        if grants.len() != own.world as usize {
            return Err(Error::InvalidArgument {
                reason: format!("{} grants for {} ranks", grants.len(), own.world),
            });
        }
        let context = own.scratch.buffer().context().clone();
        self.peers.clear();
        for (r, g) in grants.iter().enumerate() {
            if r == own.rank as usize {
                self.peers.push(None);
                continue;
            }
            let g = g.as_ref().ok_or_else(|| Error::InvalidArgument {
                reason: format!("no one-kernel grant from rank {r}"),
            })?;
            for (what, grant, need) in [
                ("scratch", &g.scratch, 2 * own.half as u64),
                ("signal page", &g.signals, SIGNAL_BYTES as u64),
            ] {
                if grant.len < need {
                    return Err(Error::Decode {
                        what: "one-kernel grant",
                        reason: format!(
                            "rank {r}'s {what} has {} bytes, the kernel uses {need}",
                            grant.len
                        ),
                    });
                }
            }
            self.peers.push(Some(PeerMemory {
                scratch: IpcMapping::open(&context, &g.scratch)?,
                signals: IpcMapping::open(&context, &g.signals)?,
            }));
        }
        Ok(())
    }

    /// How long a block waits for a peer.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// The largest collective it takes, in bytes.
    pub fn max_bytes(&self) -> usize {
        self.own.half
    }

    /// Whether an allreduce of `bytes` takes the two-shot kernel (else one-shot): the same on
    /// every rank (a constant and the job's size). Part of the collective's descriptor.
    pub fn two_shot(&self, bytes: usize) -> bool {
        self.own.world > 2 && bytes > TWO_SHOT_ABOVE
    }

    /// Queues on `stream` the allreduce of `count` elements of `dtype` from `input` into
    /// `output` (the same buffer for in place), as one kernel (two-shot where
    /// [`Self::two_shot`] says so). Every rank of the host must queue the same collectives in
    /// the same order with the same `digest` (of the descriptor, checked by the kernel). Keep
    /// the buffers alive until `stream` has passed it.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_all_reduce(
        &self,
        kernels: &ReduceKernels,
        stream: &GpuStream,
        dtype: DataType,
        op: ReduceOp,
        input: &DeviceBuffer,
        output: &DeviceBuffer,
        count: usize,
        digest: u32,
    ) -> Result<()> {
        if self.peers.len() != self.own.world as usize {
            return Err(Error::InvalidArgument {
                reason: "the one-kernel path is not connected to every peer".into(),
            });
        }
        let bytes = count
            .checked_mul(dtype.size())
            .filter(|b| *b <= self.own.half)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!(
                    "{count} elements of {dtype:?} for a one-kernel collective of at most {} \
                     bytes",
                    self.own.half
                ),
            })?;
        input.check("one-kernel input", 0, bytes)?;
        output.check("one-kernel output", 0, bytes)?;
        for b in [input, output] {
            if !crate::cuda::same_context(b.context(), self.own.scratch.buffer().context()) {
                return Err(Error::InvalidArgument {
                    reason: "a one-kernel collective's buffer on another GPU".into(),
                });
            }
        }
        let mut args = self.args(input, output, count, digest, op)?;
        for (r, p) in self.peers.iter().enumerate() {
            args.scratch[r] = match p {
                Some(p) => {
                    p.scratch.uses.note(stream);
                    p.scratch.dst
                }
                None => self.own.scratch.buffer().device_ptr(),
            };
        }
        self.note_signals(stream, &mut args);
        for b in [input, output, self.own.scratch.buffer()] {
            b.note_use(stream);
        }
        kernels.one_kernel(stream, dtype, op, self.two_shot(bytes), &mut args)
    }

    /// What a failed collective's blocks latched, read once the stream has passed the
    /// collectives (the words are written by the kernels and never cleared: a failure ends the
    /// ring). The first failure, by collective, then the cause over its echoes: a block that
    /// timed out or saw a disagreement stopped the rank, and its sibling blocks then report
    /// the stop (an abort) for the same collective.
    pub fn failure(&self) -> Option<OneKernelFailed> {
        let latched = (0..ONE_SHOT_BLOCKS).filter_map(|b| {
            let w = self.own.status.read(b).ok()?;
            let peer = (w >> 8) & 0xff;
            let failure = match w & 0xff {
                0 => return None,
                status::ABORTED => OneKernelFailure::Aborted { peer },
                status::TIMEOUT => OneKernelFailure::Timeout { peer },
                status::CONCURRENT => OneKernelFailure::Concurrent,
                status::PEER_GAVE_UP => OneKernelFailure::PeerGaveUp { peer },
                _ => OneKernelFailure::Disagreement { peer },
            };
            Some(OneKernelFailed {
                failure,
                collective: (w >> 16) as u16,
            })
        });
        // Collectives before the wrap of the 16-bit number are compared cyclically from any
        // one of them: the failures are at most a few collectives apart.
        let mut first: Option<OneKernelFailed> = None;
        for f in latched {
            let replace = match first {
                None => true,
                Some(g) => {
                    let ahead = f.collective.wrapping_sub(g.collective) as i16;
                    ahead < 0
                        || ahead == 0
                            && matches!(g.failure, OneKernelFailure::Aborted { .. })
                            && !matches!(f.failure, OneKernelFailure::Aborted { .. })
                }
            };
            if replace {
                first = Some(f);
            }
        }
        first
    }

    /// Closes this rank's mappings of its peers' memory (each once the work queued on it has
    /// run, at most [`crate::transport::gpu::IPC_CLOSE_DEADLINE`]; leaked past it), the
    /// symmetric buffers' too.
    pub fn close_imports(&mut self) {
        self.peers.clear();
        for s in self.symmetric.iter_mut().flatten() {
            s.peers.clear();
        }
    }

    /// Allocates this rank's part of a new symmetric buffer of `bytes` (every rank of the host
    /// calls it in the same order, so the ids agree) and what every peer needs to map it. The
    /// buffer takes collectives once [`Self::symmetric_map`] mapped every peer's part; its
    /// memory is freed with this object (after the teardown's handshake), never before.
    /// A failure still takes the next id (as `None`), so that this rank's ids stay those of
    /// its peers, which go on counting.
    pub fn symmetric_create(&mut self, bytes: usize) -> Result<(usize, IpcGrant)> {
        let made = (|| {
            if bytes == 0 {
                return Err(Error::InvalidArgument {
                    reason: "a symmetric buffer of 0 bytes".into(),
                });
            }
            let context = self.own.scratch.buffer().context().clone();
            let own = GpuSlot::new(&context, bytes.next_multiple_of(256))?;
            let grant = own.ipc_grant()?;
            Ok((own, grant))
        })();
        let id = self.symmetric.len();
        match made {
            Ok((own, grant)) => {
                self.symmetric.push(Some(Symmetric {
                    peers: Vec::new(),
                    own,
                }));
                Ok((id, grant))
            }
            Err(e) => {
                self.symmetric.push(None);
                Err(e)
            }
        }
    }

    /// Frees this rank's part of symmetric buffer `id` when no mapping of any rank can exist
    /// yet (the ranks agreed not to map it: another rank could not make its part, or asked for
    /// another size); the id stays taken. A buffer this rank mapped stays until teardown.
    pub fn symmetric_release_unmapped(&mut self, id: usize) {
        if let Some(slot) = self.symmetric.get_mut(id)
            && slot.as_ref().is_some_and(|s| s.peers.is_empty())
        {
            *slot = None;
        }
    }

    /// Maps every peer's part of symmetric buffer `id` (`grants[r]` for every rank `r` but this
    /// one), each at least as large as this rank's.
    pub fn symmetric_map(&mut self, id: usize, grants: &[Option<IpcGrant>]) -> Result<()> {
        let (rank, world) = (self.own.rank as usize, self.own.world as usize);
        let s = self
            .symmetric
            .get_mut(id)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("no symmetric buffer {id}"),
            })?;
        if grants.len() != world {
            return Err(Error::InvalidArgument {
                reason: format!("{} grants for {world} ranks", grants.len()),
            });
        }
        let context = s.own.buffer().context().clone();
        let need = s.own.buffer().len() as u64;
        s.peers.clear();
        for (r, g) in grants.iter().enumerate() {
            if r == rank {
                s.peers.push(None);
                continue;
            }
            let g = g.as_ref().ok_or_else(|| Error::InvalidArgument {
                reason: format!("no grant from rank {r} for symmetric buffer {id}"),
            })?;
            if g.len < need {
                return Err(Error::Decode {
                    what: "symmetric buffer grant",
                    reason: format!("rank {r}'s part has {} bytes, this rank's {need}", g.len),
                });
            }
            s.peers.push(Some(IpcMapping::open(&context, g)?));
        }
        Ok(())
    }

    /// This rank's part of symmetric buffer `id` (write its inputs here, read its results).
    pub fn symmetric_buffer(&self, id: usize) -> Option<&DeviceBuffer> {
        self.symmetric
            .get(id)
            .and_then(Option::as_ref)
            .map(|s| s.own.buffer())
    }

    /// Queues on `stream` the allreduce in place of the first `count` elements of symmetric
    /// buffer `id`, as one two-shot kernel that reads the peers' parts directly (no copy into
    /// scratch) and meets them once more at its end (the caller may write the buffer as soon
    /// as the stream passed it). Same rules as [`Self::enqueue_all_reduce`].
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_all_reduce_symmetric(
        &self,
        kernels: &ReduceKernels,
        stream: &GpuStream,
        dtype: DataType,
        op: ReduceOp,
        id: usize,
        count: usize,
        digest: u32,
    ) -> Result<()> {
        let s = self
            .symmetric
            .get(id)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("no symmetric buffer {id}"),
            })?;
        if s.peers.len() != self.own.world as usize || self.peers.len() != s.peers.len() {
            return Err(Error::InvalidArgument {
                reason: format!("symmetric buffer {id} is not mapped by every peer"),
            });
        }
        let own = s.own.buffer();
        let bytes = count
            .checked_mul(dtype.size())
            .ok_or_else(|| Error::InvalidArgument {
                reason: format!("{count} elements of {dtype:?} overflow the address space"),
            })?;
        own.check("symmetric buffer", 0, bytes)?;
        let mut args = self.args(own, own, count, digest, op)?;
        args.symmetric = 1;
        args.half = 0;
        for (r, p) in s.peers.iter().enumerate() {
            args.scratch[r] = match p {
                Some(m) => {
                    m.uses.note(stream);
                    m.dst
                }
                None => own.device_ptr(),
            };
        }
        self.note_signals(stream, &mut args);
        own.note_use(stream);
        kernels.one_kernel(stream, dtype, op, true, &mut args)
    }

    /// The launch's arguments but the scratch table.
    fn args(
        &self,
        input: &DeviceBuffer,
        output: &DeviceBuffer,
        count: usize,
        digest: u32,
        op: ReduceOp,
    ) -> Result<OneShotArgs> {
        Ok(OneShotArgs {
            input: input.device_ptr(),
            output: output.device_ptr(),
            count: count as u64,
            half: self.own.half as u64,
            counters: self.own.counters.device_ptr(),
            stop: self.stop.device_address()?,
            status: crate::transport::gpu::FlagPage::address(&self.own.status, 0)?,
            timeout_ns: u64::try_from(self.timeout.as_nanos()).unwrap_or(u64::MAX),
            world: self.own.world,
            rank: self.own.rank,
            digest,
            average: u32::from(op == ReduceOp::Avg),
            premul: u32::from(op.scalar().is_some()),
            scale: crate::cuda::reduce::NtScale::of(op).unwrap_or_default(),
            ..OneShotArgs::default()
        })
    }

    /// Fills the signal pages into `args` (noting `stream` on the peers' mappings) and notes
    /// this rank's own words.
    fn note_signals(&self, stream: &GpuStream, args: &mut OneShotArgs) {
        for (r, p) in self.peers.iter().enumerate() {
            args.signals[r] = match p {
                Some(p) => {
                    p.signals.uses.note(stream);
                    p.signals.dst
                }
                None => self.own.signals.buffer().device_ptr(),
            };
        }
        self.own.signals.buffer().note_use(stream);
        self.own.counters.note_use(stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_round_trip_and_reject_bad_lengths() {
        let g = OneKernelGrant {
            scratch: IpcGrant {
                handle: [7; 64],
                offset: 0,
                len: 1 << 21,
            },
            signals: IpcGrant {
                handle: [9; 64],
                offset: 512,
                len: SIGNAL_BYTES as u64,
            },
            gpu: [0, 0x19, 0],
        };
        let b = g.encode();
        assert_eq!(b.len(), OneKernelGrant::ENCODED_LEN);
        assert_eq!(OneKernelGrant::decode(&b).unwrap(), g);
        assert!(OneKernelGrant::decode(&b[1..]).is_err());
    }
}

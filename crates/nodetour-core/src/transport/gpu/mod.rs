//! In-host GPU transports, stream-ordered: everything is queued on CUDA streams (copies, then a
//! flag write; the receiver's stream waits for the flag), so a whole collective can be queued up
//! front without a host round trip per chunk (docs/gpu-design-spike.md: 8.5 µs per chunk
//! against 13.1 with a host round trip).
//!
//! - **cuda-ipc** (direct): the receiver exports a dedicated GPU slot allocation with
//!   `cuIpcGetMemHandle`; the sender maps it (`cuIpcOpenMemHandle`, which is also the proof
//!   that both are on one host with peer access) and its copy engine writes straight into the
//!   receiver's GPU memory.
//! - **shm** (staged): the receiver's slot is shared host memory (hugepages where available)
//!   registered with CUDA on both sides; the sender's D2H copy lands where the receiver's H2D
//!   copy reads.
//!
//! Notifications are 32-bit flags in a page of shared host memory owned by the receiver, one
//! per sender rank, written by the sender's stream after its copy (with a memory barrier) and
//! waited on by the receiver's stream. Values only grow.
//!
//! Bounds: a cuda-ipc or shm peer can write anywhere in the exported slot allocation or file
//! (the hardware checks nothing finer), which is why nothing but dedicated slot memory is ever
//! exported; every enqueued write is checked against the grant on the sending side.

use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::CudaContext;

use crate::cuda::GpuStream;
use crate::cuda::reduce::{At, Consume, GuardWords, NtFlag, PreMul, ReduceKernels, Reduction};
use crate::cuda::result::cuda_error;
use crate::cuda::stream::Uses;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, SharedHostMemory, ShmDir, ShmName};
use crate::transport::SlotRegion;

mod enqueue;
mod ipc;
mod staged;
pub use enqueue::*;
pub use ipc::*;
pub use staged::*;

/// Bytes between two flags (one cache line each).
const FLAG_STRIDE: usize = 64;
/// The bytes of a flag's cell in a host flag page ([`Flags::store_bytes`]).
pub const FLAG_CELL: usize = FLAG_STRIDE;

/// A receiver's notification flags: one word per sender rank, in shared host memory.
pub struct Flags {
    mem: SharedHostMemory,
    world: u32,
}

impl Flags {
    /// Creates this rank's flags for a job of `world` ranks, registered with CUDA under
    /// `context` (this rank's GPU).
    pub fn create(context: &Arc<CudaContext>, world: u32) -> Result<Flags> {
        let mut mem = SharedHostMemory::create(FLAG_STRIDE * world.max(1) as usize)?;
        mem.register_with_cuda(context)?;
        Ok(Flags { mem, world })
    }

    /// Opens a peer's flags (to write them), registered with CUDA under `context`.
    pub fn open(context: &Arc<CudaContext>, name: &ShmName, world: u32) -> Result<Flags> {
        let len =
            (FLAG_STRIDE * world.max(1) as usize).next_multiple_of(crate::memory::page_size());
        let len = match name.dir() {
            ShmDir::HugePages => len.next_multiple_of(crate::memory::HUGE_PAGE),
            ShmDir::Tmpfs => len,
        };
        let mut mem = SharedHostMemory::open(name, len)?;
        mem.register_with_cuda(context)?;
        Ok(Flags { mem, world })
    }

    /// The file peers open.
    pub fn name(&self) -> &ShmName {
        self.mem.name()
    }

    /// Removes the file name once every peer has opened it.
    pub fn unlink(&self) -> Result<()> {
        self.mem.unlink()
    }

    fn offset(&self, rank: u32) -> Result<usize> {
        if rank >= self.world {
            return Err(Error::InvalidArgument {
                reason: format!("rank {rank} of a job of {}", self.world),
            });
        }
        Ok(FLAG_STRIDE * rank as usize)
    }

    /// The current value of sender `rank`'s flag.
    pub fn read(&self, rank: u32) -> Result<u32> {
        self.mem.read_u32(self.offset(rank)?)
    }

    /// Queues on `stream`: wait until sender `rank`'s flag is at least `value`.
    pub fn enqueue_wait(&self, stream: &GpuStream, rank: u32, value: u32) -> Result<()> {
        stream.wait_value(self.mem.device_address(self.offset(rank)?, 4)?, value)
    }

    /// Queues on `stream`: set word `rank` to `value`, after the stream's earlier work and with
    /// a memory barrier (whoever sees the value sees what the stream wrote before).
    pub fn enqueue_set(&self, stream: &GpuStream, rank: u32, value: u32) -> Result<()> {
        stream.write_value(self.mem.device_address(self.offset(rank)?, 4)?, value)
    }

    /// Queues on `stream`: wait until word `index` equals `value` exactly.
    pub fn enqueue_wait_eq(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        stream.wait_value_eq(self.mem.device_address(self.offset(index)?, 4)?, value)
    }

    /// Stores `bytes` from the host into word `index`'s cell at byte `at` (the cell is
    /// [`FLAG_CELL`] bytes; the word itself is its first 4).
    pub fn store_bytes(&self, index: u32, at: usize, bytes: &[u8]) -> Result<()> {
        self.mem.write_at(self.cell(index, at, bytes.len())?, bytes)
    }

    /// Reads `dst.len()` bytes of word `index`'s cell at byte `at`.
    pub fn read_bytes(&self, index: u32, at: usize, dst: &mut [u8]) -> Result<()> {
        self.mem.read_at(self.cell(index, at, dst.len())?, dst)
    }

    fn cell(&self, index: u32, at: usize, len: usize) -> Result<usize> {
        match at.checked_add(len) {
            Some(end) if end <= FLAG_STRIDE => Ok(self.offset(index)? + at),
            _ => Err(Error::OutOfBounds {
                what: "flag cell",
                offset: at as u64,
                len: len as u64,
                region_len: FLAG_STRIDE as u64,
            }),
        }
    }

    /// Sets word `rank` to `value` from the host, now (announcements at setup, and releasing
    /// the waits of a collective being aborted).
    pub fn store(&self, rank: u32, value: u32) -> Result<()> {
        self.mem.write_at(self.offset(rank)?, &value.to_ne_bytes())
    }

    /// Sets word `index` to `value` only if it is 0, atomically against a GPU's store into it;
    /// returns what it held (0: the store happened).
    pub fn store_if_zero(&self, index: u32, value: u32) -> Result<u32> {
        self.mem.compare_exchange_u32(self.offset(index)?, 0, value)
    }
}

/// A page of 32-bit flags that streams wait on and set: in shared host memory ([`Flags`], any
/// two processes of a host) or in GPU memory ([`DeviceFlags`] / [`PeerDeviceFlags`], for GPUs
/// that reach each other: the waiting GPU polls its own memory instead of host memory across
/// PCIe, which shortens every hand-off).
pub trait FlagPage: Send + Sync {
    /// Queues on `stream`: wait until word `index` is at least `value` (cyclic comparison).
    fn enqueue_wait(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()>;
    /// Queues on `stream`: set word `index` to `value`, after the stream's earlier work and
    /// with a memory barrier.
    fn enqueue_set(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()>;
    /// Sets word `index` from the host, now.
    fn store(&self, index: u32, value: u32) -> Result<()>;
    /// The device address of word `index` (checked against the page), for kernels.
    fn address(&self, index: u32) -> Result<u64>;
}

/// A word of this rank's host flag page that its host sets, once, when it aborts, and that
/// nothing clears. Every guarded wait ([`enqueue_wait`]) ends once it is set, whatever a peer
/// stores into the words it waits for later; and the guarded work after such a wait on its
/// stream ([`enqueue_signal`], [`enqueue_reduce_then_signal`], [`CudaIpcSender::enqueue_send`],
/// [`ShmSender::enqueue_send`]) writes a peer's memory only if the wait ended because its words
/// were reached (the peer's credit, the peer's data), not because of the stop. So an aborted
/// rank's streams drain, and write nothing into a peer's memory that the peer has not granted.
#[derive(Clone)]
pub struct StopWord {
    page: Arc<Flags>,
    index: u32,
}

impl StopWord {
    /// Word `index` of `page` (this rank's own page).
    pub fn new(page: Arc<Flags>, index: u32) -> Result<StopWord> {
        page.offset(index)?;
        Ok(StopWord { page, index })
    }

    /// Sets the word from the host (no CUDA call), unless the GPU set it first: a value a
    /// guarded wait or a one-kernel block latched ([`STOP_TIMED_OUT`],
    /// [`crate::cuda::one_kernel::STOP_ONE_KERNEL`]) is never erased, so the cause stays
    /// readable after the host's abort.
    pub fn set(&self) -> Result<()> {
        self.page.store_if_zero(self.index, 1).map(drop)
    }

    /// Whether the word is set.
    pub fn is_set(&self) -> bool {
        self.page.read(self.index).is_ok_and(|v| v != 0)
    }

    /// Whether a guarded wait set the word itself, having waited its whole timeout (it stores
    /// [`STOP_TIMED_OUT`]; the host's abort stores 1).
    pub fn timed_out(&self) -> bool {
        self.page
            .read(self.index)
            .is_ok_and(|v| v == STOP_TIMED_OUT)
    }

    /// Whether a stream's claim found its guard held by another collective of this rank and set
    /// the word ([`STOP_CONCURRENT`]).
    pub fn concurrent(&self) -> bool {
        self.page
            .read(self.index)
            .is_ok_and(|v| v == STOP_CONCURRENT)
    }

    /// The word's address in the GPU (host memory mapped into it), for kernels that poll it.
    pub(crate) fn device_address(&self) -> Result<u64> {
        FlagPage::address(&*self.page, self.index)
    }
}

/// What a guarded wait stores into the stop word when it gives up at its timeout.
pub const STOP_TIMED_OUT: u32 = 2;

/// What a stream's claim stores into the rank's stop word when another collective of the rank
/// holds the same guard (a graph replay beside another collective: see
/// [`StreamGuard::enqueue_claim`]).
pub const STOP_CONCURRENT: u32 = 4;

/// One stream's guard: the rank's [`StopWord`], and the stream's latch (what its last guarded
/// wait found), completion counter and counters (chunks and collectives moved on the stream,
/// which [`FlagValue`]s may be relative to), in this GPU's memory; and how long its guarded
/// waits wait. One per stream: the stream's kernels run one at a time, so they share these
/// words without a race.
pub struct StreamGuard {
    stop: StopWord,
    words: DeviceBuffer,
    timeout: Option<Duration>,
}

/// Offsets in a [`StreamGuard`]'s words (a cache line apart; the counters are two u64).
const LATCH: usize = 0;
const DONE: usize = 64;
const COUNTERS: usize = 128;
const CLAIM: usize = 192;

impl StreamGuard {
    /// A guard on `context`'s GPU for one stream of the rank whose stop word is `stop`; its
    /// waits wait for their words or the stop, however long.
    pub fn new(context: &Arc<CudaContext>, stop: StopWord) -> Result<StreamGuard> {
        Ok(StreamGuard {
            stop,
            words: DeviceBuffer::new(context, CLAIM + 4)?, // zeroed
            timeout: None,
        })
    }

    /// Waits queued from now on give up after `timeout` (each then sets the stop word to
    /// [`STOP_TIMED_OUT`]; `None`: they wait until stopped): deadlines that hold inside CUDA
    /// graphs, where no host waits.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Queues on `stream` (this guard's stream) the start of a collective: a claim of the
    /// guard's words, released by [`Self::enqueue_advance`]. The stream's kernels run one at a
    /// time, so an eager collective always finds the claim free; a CUDA graph replay that runs
    /// beside another collective of the rank finds it held and stops the rank
    /// ([`STOP_CONCURRENT`]): every wait ends, nothing more reaches a peer, and the collectives
    /// fail typed rather than share the counters.
    pub fn enqueue_claim(&self, stream: &GpuStream, kernels: &ReduceKernels) -> Result<()> {
        kernels.claim(stream, self.words(stream)?)
    }

    /// Queues on `stream` (this guard's stream) the end of a collective: the chunk counter
    /// rounded up to `align`, plus `chunks`; the collective counter plus one; the claim
    /// ([`Self::enqueue_claim`]) released. Not guarded: the counters of both ends of a link
    /// move together even through an abort.
    pub fn enqueue_advance(
        &self,
        stream: &GpuStream,
        kernels: &ReduceKernels,
        align: u32,
        chunks: u32,
    ) -> Result<()> {
        kernels.advance(stream, self.words(stream)?, align, chunks)
    }

    /// The rank's stop word.
    pub fn stop(&self) -> &StopWord {
        &self.stop
    }

    /// The words, for a kernel queued on `stream` (noted: the words outlive its work).
    fn words(&self, stream: &GpuStream) -> Result<GuardWords> {
        self.words.note_use(stream);
        let timeout_ns = self.timeout.map_or(u64::MAX, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
        });
        Ok(GuardWords {
            stop: FlagPage::address(&*self.stop.page, self.stop.index)?,
            latch: self.words.device_ptr() + LATCH as u64,
            done: self.words.device_ptr() + DONE as u64,
            counters: self.words.device_ptr() + COUNTERS as u64,
            claim: self.words.device_ptr() + CLAIM as u64,
            timeout_ns,
        })
    }
}

/// What a [`FlagValue`]'s word and value are relative to: nothing, or the counters of the
/// stream that the guarded kernel runs on (read by the kernel, so that work captured into a
/// CUDA graph finds the values of the collective each replay is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counted {
    /// The word and the value as given.
    Fixed,
    /// The value plus the stream's chunk counter rounded up to `align` (a link's slots: every
    /// collective starts at slot 0).
    Chunks {
        /// The rounding (1: none).
        align: u32,
    },
    /// Word `index + (collectives mod cells)` of the page, the value with the stream's
    /// collective counter's low 16 bits in its high half (a descriptor cell).
    Cell {
        /// The cells, from `index` on.
        cells: u32,
    },
}

/// A word of a flag page and a value: what a guarded kernel waits for or stores.
#[derive(Clone, Copy)]
pub struct FlagValue<'a> {
    /// The page.
    pub page: &'a dyn FlagPage,
    /// The word (the first cell for [`Counted::Cell`]).
    pub index: u32,
    /// The value (relative, unless [`Counted::Fixed`]).
    pub value: u32,
    /// What word and value are relative to.
    pub counted: Counted,
}

impl<'a> FlagValue<'a> {
    /// Word `index` of `page`, value `value`, both fixed.
    pub fn fixed(page: &'a dyn FlagPage, index: u32, value: u32) -> Self {
        FlagValue {
            page,
            index,
            value,
            counted: Counted::Fixed,
        }
    }

    /// Word `index` of `page`, value `value` plus the stream's chunk counter rounded up to
    /// `align`.
    pub fn chunks(page: &'a dyn FlagPage, index: u32, value: u32, align: u32) -> Self {
        FlagValue {
            page,
            index,
            value,
            counted: Counted::Chunks { align },
        }
    }

    /// The descriptor cell of the stream's current collective among `cells` cells of `page`
    /// from `first`, value `value` (at most 16 bits) under the collective counter's low 16.
    pub fn cell(page: &'a dyn FlagPage, first: u32, cells: u32, value: u32) -> Self {
        FlagValue {
            page,
            index: first,
            value,
            counted: Counted::Cell { cells },
        }
    }
}

impl FlagPage for Flags {
    fn enqueue_wait(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        Flags::enqueue_wait(self, stream, index, value)
    }
    fn enqueue_set(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        Flags::enqueue_set(self, stream, index, value)
    }
    fn store(&self, index: u32, value: u32) -> Result<()> {
        Flags::store(self, index, value)
    }
    fn address(&self, index: u32) -> Result<u64> {
        self.mem.device_address(self.offset(index)?, 4)
    }
}

/// A flag page in this rank's GPU memory, exported to peers through cuda-ipc.
pub struct DeviceFlags {
    slot: GpuSlot,
    words: u32,
}

impl DeviceFlags {
    /// Allocates (zeroed) a page of `words` flags on `context`'s GPU.
    pub fn create(context: &Arc<CudaContext>, words: u32) -> Result<DeviceFlags> {
        Ok(DeviceFlags {
            slot: GpuSlot::new(context, FLAG_STRIDE * words.max(1) as usize)?,
            words,
        })
    }

    /// What a peer needs to map the page.
    pub fn ipc_grant(&self) -> Result<IpcGrant> {
        self.slot.ipc_grant()
    }

    fn address(&self, index: u32) -> Result<u64> {
        flag_address(self.slot.buffer.device_ptr(), index, self.words)
    }
}

fn flag_address(base: u64, index: u32, words: u32) -> Result<u64> {
    if index >= words {
        return Err(Error::InvalidArgument {
            reason: format!("flag {index} of a page of {words}"),
        });
    }
    Ok(base + (FLAG_STRIDE * index as usize) as u64)
}

/// Stores `value` at the device address `address` from the host and waits until it landed
/// (a stream-memory write on a fresh stream: it waits for nothing else, neither the streams
/// that may be waiting on the flag nor the legacy default stream).
fn store_device_word(context: &Arc<CudaContext>, address: u64, value: u32) -> Result<()> {
    // On a stream of its own, waited for alone: a synchronous copy would go through the legacy
    // default stream (and wait for every blocking stream of the context).
    let stream = GpuStream::new(context)?;
    stream.write_value(address, value)?;
    stream.synchronize()
}

impl FlagPage for DeviceFlags {
    fn enqueue_wait(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        stream.wait_value(self.address(index)?, value)
    }
    fn enqueue_set(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        stream.write_value(self.address(index)?, value)
    }
    fn store(&self, index: u32, value: u32) -> Result<()> {
        store_device_word(self.slot.buffer.context(), self.address(index)?, value)
    }
    fn address(&self, index: u32) -> Result<u64> {
        DeviceFlags::address(self, index)
    }
}

/// A peer's [`DeviceFlags`], mapped into this rank's GPU (to set its words).
pub struct PeerDeviceFlags {
    mapping: IpcMapping,
    words: u32,
}

impl PeerDeviceFlags {
    /// Maps the peer's page; fails where the GPUs cannot reach each other.
    pub fn open(
        context: &Arc<CudaContext>,
        grant: &IpcGrant,
        words: u32,
    ) -> Result<PeerDeviceFlags> {
        if grant.len < (FLAG_STRIDE * words as usize) as u64 {
            return Err(Error::InvalidArgument {
                reason: format!("a flag page of {} bytes for {words} flags", grant.len),
            });
        }
        Ok(PeerDeviceFlags {
            mapping: IpcMapping::open(context, grant)?,
            words,
        })
    }

    fn address(&self, index: u32) -> Result<u64> {
        flag_address(self.mapping.dst, index, self.words)
    }
}

impl FlagPage for PeerDeviceFlags {
    fn enqueue_wait(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        let a = self.address(index)?;
        self.mapping.uses.note(stream);
        stream.wait_value(a, value)
    }
    fn enqueue_set(&self, stream: &GpuStream, index: u32, value: u32) -> Result<()> {
        let a = self.address(index)?;
        self.mapping.uses.note(stream);
        stream.write_value(a, value)
    }
    fn store(&self, index: u32, value: u32) -> Result<()> {
        store_device_word(&self.mapping.context, self.address(index)?, value)
    }
    fn address(&self, index: u32) -> Result<u64> {
        PeerDeviceFlags::address(self, index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stop_values_are_distinct() {
        // The one-kernel path's stop value and the guarded waits' share the stop word.
        assert_ne!(crate::cuda::one_kernel::STOP_ONE_KERNEL, STOP_TIMED_OUT);
    }

    #[test]
    fn ipc_grants_round_trip_and_reject_garbage() {
        let g = IpcGrant {
            handle: [3; 64],
            offset: 65536,
            len: 1 << 20,
        };
        assert_eq!(IpcGrant::decode(&g.encode()).unwrap(), g);
        assert!(IpcGrant::decode(&[0; 10]).is_err());
        assert!(IpcGrant::decode(&IpcGrant { len: 0, ..g }.encode()).is_err());
    }

    #[test]
    fn grants_outside_the_mapped_allocation_are_refused() {
        let g = |offset, len| IpcGrant {
            handle: [0; 64],
            offset,
            len,
        };
        let mapped = 2 << 20;
        assert!(check_grant(&g(65536, 1 << 20), mapped).is_ok());
        assert!(check_grant(&g(0, mapped), mapped).is_ok());
        for bad in [
            g(0, mapped + 1),
            g(mapped, 1),
            g(1 << 20, (1 << 20) + 1),
            g(u64::MAX - 255, 512),
            g(256, u64::MAX),
            g(0, 0),
        ] {
            assert!(
                matches!(check_grant(&bad, mapped), Err(Error::OutOfBounds { .. })),
                "{bad:?}"
            );
        }
        // Inside the allocation but off the alignment every slot and flag page relies on.
        for bad in [g(1, 4096), g(65536 + 16, 4096), g(u64::MAX, 2)] {
            assert!(
                matches!(
                    check_grant(&bad, mapped),
                    Err(Error::InvalidArgument { .. })
                ),
                "{bad:?}"
            );
        }
    }
}

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
use crate::cuda::reduce::{GuardWords, NtFlag, ReduceKernels};
use crate::cuda::result::cuda_error;
use crate::cuda::stream::Uses;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, SharedHostMemory, ShmDir, ShmName};
use crate::transport::SlotRegion;

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

    /// The word's address in the GPU (host memory mapped into it), for kernels that poll it.
    pub(crate) fn device_address(&self) -> Result<u64> {
        FlagPage::address(&*self.page, self.index)
    }
}

/// What a guarded wait stores into the stop word when it gives up at its timeout.
pub const STOP_TIMED_OUT: u32 = 2;

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

impl StreamGuard {
    /// A guard on `context`'s GPU for one stream of the rank whose stop word is `stop`; its
    /// waits wait for their words or the stop, however long.
    pub fn new(context: &Arc<CudaContext>, stop: StopWord) -> Result<StreamGuard> {
        Ok(StreamGuard {
            stop,
            words: DeviceBuffer::new(context, COUNTERS + 16)?, // zeroed
            timeout: None,
        })
    }

    /// Waits queued from now on give up after `timeout` (each then sets the stop word to
    /// [`STOP_TIMED_OUT`]; `None`: they wait until stopped): deadlines that hold inside CUDA
    /// graphs, where no host waits.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    /// Queues on `stream` (this guard's stream) the end of a collective: the chunk counter
    /// rounded up to `align`, plus `chunks`; the collective counter plus one. Not guarded:
    /// the counters of both ends of a link move together even through an abort.
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

/// The kernels' operand for `f`, relative to the counters in `g`; every word it can name is
/// checked against its page.
fn at(f: FlagValue<'_>, g: &GuardWords) -> Result<NtFlag> {
    let addr = f.page.address(f.index)?;
    let fixed = NtFlag {
        addr,
        value: f.value,
        ..NtFlag::default()
    };
    Ok(match f.counted {
        Counted::Fixed => fixed,
        Counted::Chunks { align } => NtFlag {
            base: g.counters,
            align: align.max(1),
            ..fixed
        },
        Counted::Cell { cells } => {
            if cells == 0 || f.value > 0xffff {
                return Err(Error::InvalidArgument {
                    reason: format!("descriptor cells: {cells} cells, value {:#x}", f.value),
                });
            }
            let last = f
                .index
                .checked_add(cells - 1)
                .ok_or_else(|| Error::InvalidArgument {
                    reason: format!("{cells} cells from word {}", f.index),
                })?;
            // The cells are evenly spaced (the page's stride), the last inside the page.
            let end = f.page.address(last)?;
            let stride = if cells > 1 {
                (end - addr) / u64::from(cells - 1)
            } else {
                0
            };
            if cells > 1 && f.page.address(f.index + 1)? - addr != stride {
                return Err(Error::InvalidArgument {
                    reason: "descriptor cells that are not evenly spaced".into(),
                });
            }
            NtFlag {
                base: g.counters,
                cells,
                stride: u32::try_from(stride).map_err(|_| Error::InvalidArgument {
                    reason: format!("a flag stride of {stride} bytes"),
                })?,
                ..fixed
            }
        }
    })
}

fn at_opt(f: Option<FlagValue<'_>>, g: &GuardWords) -> Result<NtFlag> {
    f.map_or(Ok(NtFlag::default()), |f| at(f, g))
}

/// The guarded send into `dst`, a device address of `len` bytes the caller checked.
#[allow(clippy::too_many_arguments)]
fn send_to(
    stream: &GpuStream,
    kernels: &ReduceKernels,
    guard: &StreamGuard,
    dst: u64,
    src: &DeviceBuffer,
    src_offset: usize,
    len: usize,
    first: FlagValue<'_>,
    second: Option<FlagValue<'_>>,
) -> Result<()> {
    let g = guard.words(stream)?;
    let (first, second) = (at(first, &g)?, at_opt(second, &g)?);
    kernels.send_guarded(stream, g, dst, src, src_offset, len, first, second)
}

/// Queues on `stream` a guarded wait (a one-thread kernel of `kernels`): until word `first`
/// equals its value (or, without `first_equal`, reaches it in the cyclic comparison), then
/// `second` reaches its value, or until the stop word is set. With neither word it only
/// records whether the stop word is set. The guarded work queued after it on `stream` writes
/// a peer's memory only if the words were reached.
pub fn enqueue_wait(
    stream: &GpuStream,
    kernels: &ReduceKernels,
    guard: &StreamGuard,
    first: Option<FlagValue<'_>>,
    first_equal: bool,
    second: Option<FlagValue<'_>>,
) -> Result<()> {
    let g = guard.words(stream)?;
    let (first, second) = (at_opt(first, &g)?, at_opt(second, &g)?);
    kernels.wait_words(stream, first, first_equal, second, g)
}

/// Queues on `stream` (a one-thread kernel of `kernels`): if the stream's last guarded wait
/// found its words, `first` := its value, then `second`, each after a system-wide memory fence
/// (whoever sees a value sees what the stream wrote before).
pub fn enqueue_signal(
    stream: &GpuStream,
    kernels: &ReduceKernels,
    guard: &StreamGuard,
    first: FlagValue<'_>,
    second: Option<FlagValue<'_>>,
) -> Result<()> {
    let g = guard.words(stream)?;
    kernels.signal(stream, g, at(first, &g)?, at_opt(second, &g)?)
}

/// Where a guarded kernel reads a received chunk.
pub enum ChunkSource<'a> {
    /// GPU memory (this GPU's, or a peer's mapped into it): a buffer and a byte offset in it.
    Gpu(&'a DeviceBuffer, usize),
    /// Host slots mapped into this GPU, at a byte offset: the kernel's loads cross PCIe, with
    /// no copy into GPU memory first (one operation per chunk instead of three for a reduce:
    /// copy, credit, reduce; one instead of two for a copy). The slots' owner keeps them
    /// registered until the stream has passed (it drains its streams before it unregisters).
    Slots(&'a dyn StagedReceive, usize),
}

impl ChunkSource<'_> {
    /// The address `len` bytes of the chunk start at, checked against the source's bounds.
    fn address(&self, len: usize) -> Result<u64> {
        match *self {
            ChunkSource::Gpu(b, offset) => {
                b.check("a received chunk", offset, len)?;
                Ok(b.device_ptr() + offset as u64)
            }
            ChunkSource::Slots(slots, offset) => slots.mapped_address(offset, len),
        }
    }
}

/// Queues on `stream` one kernel of `kernels`: if the stream's last guarded wait found its
/// words, `dst[dst_offset..] = op(dst, src)` over `count` elements of `dtype` (see
/// [`ReduceKernels::reduce`]), then, once every element is done, `signal` := its value.
#[allow(clippy::too_many_arguments)]
pub fn enqueue_reduce_then_signal(
    stream: &GpuStream,
    kernels: &ReduceKernels,
    guard: &StreamGuard,
    dtype: crate::dtype::DataType,
    op: crate::dtype::ReduceOp,
    dst: &DeviceBuffer,
    dst_offset: usize,
    src: ChunkSource<'_>,
    count: usize,
    signal: FlagValue<'_>,
) -> Result<()> {
    let g = guard.words(stream)?;
    let signal = at(signal, &g)?;
    match src {
        ChunkSource::Gpu(b, offset) => kernels.reduce_then_signal(
            stream, g, dtype, op, dst, dst_offset, b, offset, count, signal,
        ),
        ChunkSource::Slots(..) => {
            let len = count
                .checked_mul(dtype.size())
                .ok_or_else(|| Error::InvalidArgument {
                    reason: format!("{count} elements of {dtype:?} overflow"),
                })?;
            let from = src.address(len)?;
            kernels
                .reduce_then_signal_at(stream, g, dtype, op, dst, dst_offset, from, count, signal)
        }
    }
}

/// Queues on `stream` one kernel of `kernels`: if the stream's last guarded wait found its
/// words, `len` bytes of `src` are copied to `dst` at `dst_offset`, then, once every byte has
/// landed, `signal` := its value (a received chunk copied out of its slot and the slot
/// credited in one launch, where the copy engine takes a copy and a credit kernel).
#[allow(clippy::too_many_arguments)]
pub fn enqueue_copy_then_signal(
    stream: &GpuStream,
    kernels: &ReduceKernels,
    guard: &StreamGuard,
    dst: &DeviceBuffer,
    dst_offset: usize,
    src: ChunkSource<'_>,
    len: usize,
    signal: FlagValue<'_>,
) -> Result<()> {
    let g = guard.words(stream)?;
    let signal = at(signal, &g)?;
    let from = src.address(len)?;
    if let ChunkSource::Gpu(b, _) = src {
        b.note_use(stream);
    }
    kernels.copy_then_signal_at(stream, g, dst, dst_offset, from, len, signal)
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

/// A peer's GPU allocation mapped into this process (`cuIpcOpenMemHandle`), closed on drop
/// once the work queued on it has run (at most [`IPC_CLOSE_DEADLINE`]; leaked past it).
pub(crate) struct IpcMapping {
    base: u64,
    /// Where the grant starts, as mapped here.
    pub(crate) dst: u64,
    /// The grant's length (checked against the mapped allocation).
    pub(crate) len: u64,
    context: Arc<CudaContext>,
    // The streams that queued work on the mapping.
    pub(crate) uses: Uses,
}

/// How long dropping a cuda-ipc mapping waits for the work queued on it before it leaks the
/// mapping rather than close it under that work.
pub const IPC_CLOSE_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

// SAFETY: the mapping is usable from any thread that binds the context (every user does).
unsafe impl Send for IpcMapping {}
// SAFETY: as above; nothing in it changes after creation.
unsafe impl Sync for IpcMapping {}

impl IpcMapping {
    pub(crate) fn open(context: &Arc<CudaContext>, grant: &IpcGrant) -> Result<IpcMapping> {
        context
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: a context is bound; the handle came from the peer's cuIpcGetMemHandle (the
        // driver validates it).
        let base = unsafe { crate::cuda::result::ipc_open_mem_handle(grant.handle) }
            .map_err(|e| Error::Unsupported {
                what: "cuda-ipc",
                reason: format!("mapping the peer's GPU memory failed ({}): not the same host, or no peer access between the GPUs", crate::cuda::result::error_name(e)),
            })?;
        let mut mapping = IpcMapping {
            base,
            dst: base,
            len: 0,
            context: context.clone(),
            uses: Uses::default(),
        };
        // What the peer granted must lie inside what was actually mapped: the allocation's own
        // size, asked of the driver, not the peer's word. (Dropping `mapping` closes it.)
        // SAFETY: the context is current and base is a live mapping.
        let (_, mapped) = unsafe { crate::cuda::result::address_range(base)? };
        check_grant(grant, mapped as u64)?;
        mapping.dst = base + grant.offset;
        mapping.len = grant.len;
        Ok(mapping)
    }
}

/// What a grant's offset must be a multiple of: the alignment `cuMemAlloc` guarantees an
/// allocation, which every slot, flag page and scratch of ours starts on (their 16-byte loads
/// and 4-byte flags rely on it), and whose multiples a peer's mapping keeps.
const IPC_GRANT_ALIGNMENT: u64 = 256;

/// A grant's slot `[offset, offset + len)` inside an allocation of `mapped` bytes, computed
/// without overflow, starting on [`IPC_GRANT_ALIGNMENT`].
fn check_grant(grant: &IpcGrant, mapped: u64) -> Result<()> {
    if grant.offset % IPC_GRANT_ALIGNMENT != 0 {
        return Err(Error::InvalidArgument {
            reason: format!(
                "a cuda-ipc grant at offset {} (not a multiple of {IPC_GRANT_ALIGNMENT})",
                grant.offset
            ),
        });
    }
    match grant.offset.checked_add(grant.len) {
        Some(end) if end <= mapped && grant.len > 0 => Ok(()),
        _ => Err(Error::OutOfBounds {
            what: "cuda-ipc grant",
            offset: grant.offset,
            len: grant.len,
            region_len: mapped,
        }),
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        // Wait for the mapping's own work only (never the whole context), with a deadline.
        let deadline = std::time::Instant::now() + IPC_CLOSE_DEADLINE;
        if !self.uses.wait_until(&self.context, deadline) {
            tracing::error!(
                "work queued on a peer's mapped GPU memory did not finish within \
                 {IPC_CLOSE_DEADLINE:?}: leaking the mapping"
            );
            return;
        }
        if self.context.bind_to_thread().is_ok() {
            // SAFETY: base came from cuIpcOpenMemHandle; the work queued on it has run (waited
            // for above). The driver's close itself waits for the whole context (measured by
            // examples/teardown_probe): the one implicit wait left in this teardown.
            let _ = unsafe { crate::cuda::result::ipc_close_mem_handle(self.base) };
        }
    }
}

/// What a sender needs to map a receiver's GPU slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcGrant {
    /// `cuIpcGetMemHandle` of the slot allocation.
    pub handle: [u8; 64],
    /// Where the slot starts in the allocation.
    pub offset: u64,
    /// Slot length.
    pub len: u64,
}

impl IpcGrant {
    /// Encoded size.
    pub const ENCODED_LEN: usize = 64 + 8 + 8;

    /// Encodes for the bootstrap exchange.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..64].copy_from_slice(&self.handle);
        b[64..72].copy_from_slice(&self.offset.to_be_bytes());
        b[72..].copy_from_slice(&self.len.to_be_bytes());
        b
    }

    /// Decodes.
    pub fn decode(b: &[u8]) -> Result<IpcGrant> {
        if b.len() != Self::ENCODED_LEN {
            return Err(Error::Decode {
                what: "cuda-ipc grant",
                reason: format!("{} bytes", b.len()),
            });
        }
        let len = u64::from_be_bytes(b[72..].try_into().expect("8 bytes"));
        if len == 0 {
            return Err(Error::Decode {
                what: "cuda-ipc grant",
                reason: "an empty slot".into(),
            });
        }
        Ok(IpcGrant {
            handle: b[..64].try_into().expect("64 bytes"),
            offset: u64::from_be_bytes(b[64..72].try_into().expect("8 bytes")),
            len,
        })
    }
}

/// A receiver's GPU slot: dedicated GPU memory that one peer writes through cuda-ipc.
pub struct GpuSlot {
    buffer: DeviceBuffer,
}

impl GpuSlot {
    /// Allocates a slot of at least `len` bytes on `context`'s GPU.
    pub fn new(context: &Arc<CudaContext>, len: usize) -> Result<GpuSlot> {
        Ok(GpuSlot {
            buffer: DeviceBuffer::new(context, len)?,
        })
    }

    /// The memory (read it with GPU copies or kernels after the flag says it landed).
    pub fn buffer(&self) -> &DeviceBuffer {
        &self.buffer
    }

    /// Exports the slot for one peer.
    pub fn ipc_grant(&self) -> Result<IpcGrant> {
        let (base, offset) = self.buffer.allocation();
        self.buffer
            .context()
            .bind_to_thread()
            .map_err(|e| cuda_error("cuCtxSetCurrent", e))?;
        // SAFETY: a context is bound; base is the start of a live cuMemAlloc allocation.
        let bytes = unsafe { crate::cuda::result::ipc_get_mem_handle(base) }?;
        Ok(IpcGrant {
            handle: bytes,
            offset,
            len: self.buffer.len() as u64,
        })
    }
}

/// A sender's mapping of one peer's GPU slot, and the peer's flags.
pub struct CudaIpcSender {
    mapping: IpcMapping,
    flags: Flags,
    rank: u32,
}

impl CudaIpcSender {
    /// Maps the peer's slot into `context` (this rank's GPU). Failing here means the two are not
    /// on one host, or their GPUs cannot reach each other: the caller falls back to shm.
    pub fn open(
        context: &Arc<CudaContext>,
        grant: &IpcGrant,
        peer_flags: Flags,
        my_rank: u32,
    ) -> Result<CudaIpcSender> {
        Ok(CudaIpcSender {
            mapping: IpcMapping::open(context, grant)?,
            flags: peer_flags,
            rank: my_rank,
        })
    }

    fn check(
        &self,
        src: &DeviceBuffer,
        src_offset: usize,
        dst_offset: u64,
        len: usize,
    ) -> Result<()> {
        src.check("GPU write source", src_offset, len)?;
        if dst_offset
            .checked_add(len as u64)
            .is_none_or(|e| e > self.mapping.len)
        {
            return Err(Error::OutOfBounds {
                what: "cuda-ipc write",
                offset: dst_offset,
                len: len as u64,
                region_len: self.mapping.len,
            });
        }
        Ok(())
    }

    /// Queues on `stream`: copy `len` bytes of `src` at `src_offset` into the peer's slot at
    /// `dst_offset` with the copy engine, then (if given) set this rank's flag at the peer to
    /// `notify`.
    pub fn enqueue_write(
        &self,
        stream: &GpuStream,
        src: &DeviceBuffer,
        src_offset: usize,
        dst_offset: u64,
        len: usize,
        notify: Option<u32>,
    ) -> Result<()> {
        self.check(src, src_offset, dst_offset, len)?;
        let s = stream.bind()?;
        self.mapping.uses.note(stream);
        src.note_use(stream);
        // SAFETY: the destination lies in the mapped slot (checked), the source in a live buffer
        // (checked); both noted this stream: the buffer is freed and the mapping closed only
        // after its queued work.
        unsafe {
            crate::cuda::result::memcpy_dtod_async(
                self.mapping.dst + dst_offset,
                src.device_ptr() + src_offset as u64,
                len,
                s,
            )
        }?;
        if let Some(v) = notify {
            self.flags.enqueue_set(stream, self.rank, v)?;
        }
        Ok(())
    }

    /// Queues on `stream` one kernel of `kernels` (this GPU's): if the stream's last guarded
    /// wait ([`enqueue_wait`], for the receiver's credit) found its words, it copies `len` bytes
    /// of `src` at `src_offset` into the peer's slot at `dst_offset` and, once every byte has
    /// landed, stores `first` and then `second` (e.g. the descriptor word and the ready flag).
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_send(
        &self,
        stream: &GpuStream,
        kernels: &ReduceKernels,
        guard: &StreamGuard,
        src: &DeviceBuffer,
        src_offset: usize,
        dst_offset: u64,
        len: usize,
        first: FlagValue<'_>,
        second: Option<FlagValue<'_>>,
    ) -> Result<()> {
        self.check(src, src_offset, dst_offset, len)?;
        self.mapping.uses.note(stream);
        let dst = self.mapping.dst + dst_offset;
        send_to(
            stream, kernels, guard, dst, src, src_offset, len, first, second,
        )
    }
}

/// A receiver's staging slot in shared host memory (the shm transport).
pub struct ShmSlot {
    mem: SharedHostMemory,
}

impl ShmSlot {
    /// Creates a slot of at least `len` bytes, registered with CUDA under `context`.
    pub fn create(context: &Arc<CudaContext>, len: usize) -> Result<ShmSlot> {
        let mut mem = SharedHostMemory::create(len)?;
        mem.register_with_cuda(context)?;
        Ok(ShmSlot { mem })
    }

    /// The file the peer opens, and its length.
    pub fn grant(&self) -> (ShmName, usize) {
        (self.mem.name().clone(), self.mem.len())
    }

    /// Removes the file name once the peer has opened it.
    pub fn unlink(&self) -> Result<()> {
        self.mem.unlink()
    }

    /// What backs the slot.
    pub fn pages(&self) -> &crate::memory::Pages {
        self.mem.pages()
    }
}

impl StagedReceive for ShmSlot {
    fn mapped_address(&self, slot_offset: usize, len: usize) -> Result<u64> {
        self.mem.device_address(slot_offset, len)
    }

    fn enqueue_copy_out(
        &self,
        stream: &GpuStream,
        dst: &DeviceBuffer,
        dst_offset: usize,
        slot_offset: usize,
        len: usize,
    ) -> Result<()> {
        let from = self.mem.device_address(slot_offset, len)?;
        copy_in(stream, dst, dst_offset, from, len)
    }
}

/// Queues on `stream` a copy of `len` bytes of registered host memory at `from` (its checked,
/// live, mapped address) into `dst` at `dst_offset`.
fn copy_in(
    stream: &GpuStream,
    dst: &DeviceBuffer,
    dst_offset: usize,
    from: u64,
    len: usize,
) -> Result<()> {
    dst.check("GPU copy destination", dst_offset, len)?;
    let s = stream.bind()?;
    dst.note_use(stream);
    // SAFETY: both ranges are in bounds of live memory (the caller checked `from`, `dst` is
    // checked here); the buffer noted this stream (freed after its work); the host memory stays
    // registered until its owner has drained the stream (unregistering waits for the whole
    // context anyway).
    unsafe {
        crate::cuda::result::memcpy_htod_async(
            dst.device_ptr() + dst_offset as u64,
            from as *const std::ffi::c_void,
            len,
            s,
        )
    }
}

/// Slots of this rank that a network link carries (the network links of a GPU ring): the send
/// stream fills them (a guarded kernel writing through the mapping) and the link's progress
/// thread writes them to the peer; or the peer's writes land in them and the receive stream
/// copies them in. Host memory registered with CUDA before it became a region (the staged
/// path), or GPU memory registered with the RDMA device ([`SlotRegion::device`], the direct
/// path: the send stream fills it at GPU speed and the NIC reads it; a receive stream reads
/// such slots directly rather than copying them out).
pub struct LinkSlots {
    region: SlotRegion,
}

impl LinkSlots {
    /// The slots of `region` (checked: registered with CUDA).
    pub fn new(region: SlotRegion) -> Result<LinkSlots> {
        region.device_address(0, region.len())?;
        Ok(LinkSlots { region })
    }

    /// The region (for the link's transport).
    pub fn region(&self) -> &SlotRegion {
        &self.region
    }

    /// Queues on `stream`: copy `len` bytes of `src` at `src_offset` into the slots at
    /// `slot_offset` (the copy engine; the kernel of [`StagedSend::enqueue_send`] is the
    /// guarded form the GPU ring uses).
    pub fn enqueue_copy_in(
        &self,
        stream: &GpuStream,
        src: &DeviceBuffer,
        src_offset: usize,
        slot_offset: usize,
        len: usize,
    ) -> Result<()> {
        src.check("GPU copy source", src_offset, len)?;
        let to = self.region.device_address(slot_offset, len)?;
        if self.region.is_device() {
            return copy_device(stream, src, src_offset, to, len, true);
        }
        copy_out(stream, src, src_offset, to, len)
    }
}

/// Queues on `stream` a copy of `len` bytes between `buffer` at `offset` (checked by the caller)
/// and GPU slot memory at `slot` (its checked, live address): into the slot when `to_slot`,
/// else out of it.
fn copy_device(
    stream: &GpuStream,
    buffer: &DeviceBuffer,
    offset: usize,
    slot: u64,
    len: usize,
    to_slot: bool,
) -> Result<()> {
    let s = stream.bind()?;
    buffer.note_use(stream);
    let at = buffer.device_ptr() + offset as u64;
    let (dst, src) = if to_slot { (slot, at) } else { (at, slot) };
    // SAFETY: both ranges are in bounds of live GPU memory (checked by the callers); the buffer
    // noted this stream; the slots' registration outlives the streams' work (its owner drains
    // them first).
    unsafe { crate::cuda::result::memcpy_dtod_async(dst, src, len, s) }
}

/// Queues on `stream` a copy of `len` bytes of `src` at `src_offset` (checked by the caller)
/// into registered host memory at `to` (its checked, live, mapped address).
fn copy_out(
    stream: &GpuStream,
    src: &DeviceBuffer,
    src_offset: usize,
    to: u64,
    len: usize,
) -> Result<()> {
    let s = stream.bind()?;
    src.note_use(stream);
    // SAFETY: both ranges are in bounds of live memory (checked by the callers); the buffer
    // noted this stream (freed after its work); the host memory stays registered until its
    // owner has drained the stream.
    unsafe {
        crate::cuda::result::memcpy_dtoh_async(
            to as *mut std::ffi::c_void,
            src.device_ptr() + src_offset as u64,
            len,
            s,
        )
    }
}

impl StagedSend for LinkSlots {
    fn host_address(&self, slot_offset: usize, len: usize) -> Result<u64> {
        self.region.device_address(slot_offset, len)
    }
}

impl StagedReceive for LinkSlots {
    fn mapped_address(&self, slot_offset: usize, len: usize) -> Result<u64> {
        self.region.device_address(slot_offset, len)
    }

    fn enqueue_copy_out(
        &self,
        stream: &GpuStream,
        dst: &DeviceBuffer,
        dst_offset: usize,
        slot_offset: usize,
        len: usize,
    ) -> Result<()> {
        let from = self.region.device_address(slot_offset, len)?;
        if self.region.is_device() {
            dst.check("GPU copy destination", dst_offset, len)?;
            return copy_device(stream, dst, dst_offset, from, len, false);
        }
        copy_in(stream, dst, dst_offset, from, len)
    }
}

/// Host slots a send stream writes chunks into (a peer's shared slots, or this rank's own
/// slots of a network link): the SMs write host memory through the mapping.
pub trait StagedSend {
    /// The mapped address of `len` bytes at `slot_offset` (checked against the slots).
    fn host_address(&self, slot_offset: usize, len: usize) -> Result<u64>;

    /// Like [`CudaIpcSender::enqueue_send`], into the slots at `slot_offset`.
    #[allow(clippy::too_many_arguments)]
    fn enqueue_send(
        &self,
        stream: &GpuStream,
        kernels: &ReduceKernels,
        guard: &StreamGuard,
        src: &DeviceBuffer,
        src_offset: usize,
        slot_offset: usize,
        len: usize,
        first: FlagValue<'_>,
        second: Option<FlagValue<'_>>,
    ) -> Result<()> {
        src.check("GPU write source", src_offset, len)?;
        let dst = self.host_address(slot_offset, len)?;
        send_to(
            stream, kernels, guard, dst, src, src_offset, len, first, second,
        )
    }
}

/// Host slots a receive stream copies chunks out of (slots shared with the previous rank, or
/// this rank's own slots of a network link).
pub trait StagedReceive {
    /// The address through which this GPU reads `len` bytes of the slots at `slot_offset`
    /// (checked against the slots).
    fn mapped_address(&self, slot_offset: usize, len: usize) -> Result<u64>;

    /// Queues on `stream`: copy `len` bytes of the slots at `slot_offset` into `dst` at
    /// `dst_offset` (after the wait for the flag that says they landed).
    fn enqueue_copy_out(
        &self,
        stream: &GpuStream,
        dst: &DeviceBuffer,
        dst_offset: usize,
        slot_offset: usize,
        len: usize,
    ) -> Result<()>;
}

/// A sender's mapping of one peer's staging slot, and the peer's flags.
pub struct ShmSender {
    mem: SharedHostMemory,
    flags: Flags,
    rank: u32,
}

impl ShmSender {
    /// Opens the peer's slot (`name`, `len` from its grant, validated when decoded).
    pub fn open(
        context: &Arc<CudaContext>,
        name: &ShmName,
        len: usize,
        peer_flags: Flags,
        my_rank: u32,
    ) -> Result<ShmSender> {
        let mut mem = SharedHostMemory::open(name, len)?;
        mem.register_with_cuda(context)?;
        Ok(ShmSender {
            mem,
            flags: peer_flags,
            rank: my_rank,
        })
    }

    /// Queues on `stream`: copy `len` bytes of `src` at `src_offset` into the peer's slot at
    /// `slot_offset`, then (if given) set this rank's flag at the peer to `notify`.
    pub fn enqueue_write(
        &self,
        stream: &GpuStream,
        src: &DeviceBuffer,
        src_offset: usize,
        slot_offset: usize,
        len: usize,
        notify: Option<u32>,
    ) -> Result<()> {
        src.check("GPU write source", src_offset, len)?;
        let to = self.mem.device_address(slot_offset, len)?;
        copy_out(stream, src, src_offset, to, len)?;
        if let Some(v) = notify {
            self.flags.enqueue_set(stream, self.rank, v)?;
        }
        Ok(())
    }
}

impl StagedSend for ShmSender {
    fn host_address(&self, slot_offset: usize, len: usize) -> Result<u64> {
        self.mem.device_address(slot_offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! The guarded hand-offs queued on a stream: waits on a flag, signals, and the reduce and copy
//! of a landed chunk followed by its signal (kernels from `crate::cuda::reduce`).

use super::*;

/// Where guarded work is queued: the stream, the kernels loaded on its GPU, and the stream's
/// guard (its latch, stop and counter words). Every `enqueue_*` call takes one.
#[derive(Clone, Copy)]
pub struct Guarded<'a> {
    /// The stream the work is queued on.
    pub stream: &'a GpuStream,
    /// The kernels of the stream's GPU.
    pub kernels: &'a ReduceKernels,
    /// The stream's guard.
    pub guard: &'a StreamGuard,
}

impl Guarded<'_> {
    fn words(&self) -> Result<GuardWords> {
        self.guard.words(self.stream)
    }
}

/// The kernels' operand for `f`, relative to the counters in `g`; every word it can name is
/// checked against its page.
pub(super) fn at(f: FlagValue<'_>, g: &GuardWords) -> Result<NtFlag> {
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

pub(super) fn at_opt(f: Option<FlagValue<'_>>, g: &GuardWords) -> Result<NtFlag> {
    f.map_or(Ok(NtFlag::default()), |f| at(f, g))
}

/// The guarded send of `len` bytes of `src` into `dst`, a device address the caller checked;
/// with `premul`, each element multiplied on the way.
pub(super) fn send_to(
    on: Guarded<'_>,
    dst: u64,
    src: At<'_>,
    len: usize,
    (first, second): (FlagValue<'_>, Option<FlagValue<'_>>),
    premul: Option<PreMul>,
) -> Result<()> {
    let g = on.words()?;
    let signals = [at(first, &g)?, at_opt(second, &g)?];
    on.kernels
        .send_guarded(on.stream, g, dst, src, len, signals, premul)
}

/// Queues on `stream` a guarded wait (a one-thread kernel of `kernels`): until word `first`
/// equals its value (or, without `first_equal`, reaches it in the cyclic comparison), then
/// `second` reaches its value, or until the stop word is set. With neither word it only
/// records whether the stop word is set. The guarded work queued after it on `stream` writes
/// a peer's memory only if the words were reached.
pub fn enqueue_wait(
    on: Guarded<'_>,
    first: Option<FlagValue<'_>>,
    first_equal: bool,
    second: Option<FlagValue<'_>>,
) -> Result<()> {
    let g = on.words()?;
    let (first, second) = (at_opt(first, &g)?, at_opt(second, &g)?);
    on.kernels
        .wait_words(on.stream, first, first_equal, second, g)
}

/// Queues on `stream` (a one-thread kernel of `kernels`): if the stream's last guarded wait
/// found its words, `first` := its value, then `second`, each after a system-wide memory fence
/// (whoever sees a value sees what the stream wrote before).
pub fn enqueue_signal(
    on: Guarded<'_>,
    first: FlagValue<'_>,
    second: Option<FlagValue<'_>>,
) -> Result<()> {
    let g = on.words()?;
    on.kernels
        .signal(on.stream, g, at(first, &g)?, at_opt(second, &g)?)
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

/// Queues one kernel: if the stream's last guarded wait found its words, `dst = op(dst, src)`
/// over `count` elements of `r.dtype` (see [`ReduceKernels::reduce`]), then, once every
/// element is done, `signal` := its value.
pub fn enqueue_reduce_then_signal(
    on: Guarded<'_>,
    r: Reduction,
    dst: At<'_>,
    src: ChunkSource<'_>,
    count: usize,
    signal: FlagValue<'_>,
) -> Result<()> {
    let (stream, dtype) = (on.stream, r.dtype);
    let g = on.words()?;
    let signal = at(signal, &g)?;
    let len = count
        .checked_mul(dtype.size())
        .ok_or_else(|| Error::InvalidArgument {
            reason: format!("{count} elements of {dtype:?} overflow"),
        })?;
    if let ChunkSource::Gpu(_, offset) = src
        && offset % dtype.size() != 0
    {
        return Err(Error::InvalidArgument {
            reason: format!("offset {offset} is not aligned to {dtype:?}"),
        });
    }
    let chunk = Consume {
        dst,
        src: src.address(len)?,
        count,
    };
    if let ChunkSource::Gpu(b, _) = src {
        b.note_use(stream);
    }
    on.kernels.reduce_then_signal(stream, g, r, chunk, signal)
}

/// Queues one kernel: if the stream's last guarded wait found its words, `len` bytes of `src`
/// are copied to `dst`, then, once every byte has landed, `signal` := its value (a received
/// chunk copied out of its slot and the slot credited in one launch, where the copy engine
/// takes a copy and a credit kernel).
pub fn enqueue_copy_then_signal(
    on: Guarded<'_>,
    dst: At<'_>,
    src: ChunkSource<'_>,
    len: usize,
    signal: FlagValue<'_>,
) -> Result<()> {
    let g = on.words()?;
    let signal = at(signal, &g)?;
    let chunk = Consume {
        dst,
        src: src.address(len)?,
        count: len,
    };
    if let ChunkSource::Gpu(b, _) = src {
        b.note_use(on.stream);
    }
    on.kernels.copy_then_signal(on.stream, g, chunk, signal)
}

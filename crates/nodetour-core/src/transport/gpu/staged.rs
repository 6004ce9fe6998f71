//! The staged path: host slots (shared memory, or a network link's registered slots) copied
//! into and out of GPU memory on the streams.

use super::*;

/// A receiver's staging slot in shared host memory (the shm transport).
pub struct ShmSlot {
    pub(super) mem: SharedHostMemory,
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
pub(super) fn copy_in(
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
    pub(super) region: SlotRegion,
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
pub(super) fn copy_device(
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
pub(super) fn copy_out(
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
    fn enqueue_send(
        &self,
        on: Guarded<'_>,
        src: At<'_>,
        slot_offset: usize,
        len: usize,
        signals: (FlagValue<'_>, Option<FlagValue<'_>>),
        premul: Option<PreMul>,
    ) -> Result<()> {
        src.buffer.check("GPU write source", src.offset, len)?;
        let dst = self.host_address(slot_offset, len)?;
        send_to(on, dst, src, len, signals, premul)
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
    pub(super) mem: SharedHostMemory,
    pub(super) flags: Flags,
    pub(super) rank: u32,
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

//! The direct path: GPU slots exported through CUDA IPC, the sender's mapping of them, and
//! the grant every write is checked against.

use super::*;

/// A peer's GPU allocation mapped into this process (`cuIpcOpenMemHandle`), closed on drop
/// once the work queued on it has run (at most [`IPC_CLOSE_DEADLINE`]; leaked past it).
pub(crate) struct IpcMapping {
    pub(super) base: u64,
    /// Where the grant starts, as mapped here.
    pub(crate) dst: u64,
    /// The grant's length (checked against the mapped allocation).
    pub(crate) len: u64,
    pub(super) context: Arc<CudaContext>,
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
pub(super) const IPC_GRANT_ALIGNMENT: u64 = 256;

/// A grant's slot `[offset, offset + len)` inside an allocation of `mapped` bytes, computed
/// without overflow, starting on [`IPC_GRANT_ALIGNMENT`].
pub(super) fn check_grant(grant: &IpcGrant, mapped: u64) -> Result<()> {
    if !grant.offset.is_multiple_of(IPC_GRANT_ALIGNMENT) {
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
    pub(super) buffer: DeviceBuffer,
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
    pub(super) mapping: IpcMapping,
    pub(super) flags: Flags,
    pub(super) rank: u32,
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

    /// Queues one kernel on `on`'s stream (this GPU's kernels): if the stream's last guarded
    /// wait ([`enqueue_wait`], for the receiver's credit) found its words, it copies `len` bytes
    /// of `src` into the peer's slot at `dst_offset` and, once every byte has landed, stores
    /// `first` and then `second` (e.g. the descriptor word and the ready flag). With
    /// `premul`, each element is multiplied by its scalar on the way (a PreMulSum's first
    /// read of this rank's own values).
    pub fn enqueue_send(
        &self,
        on: Guarded<'_>,
        src: At<'_>,
        dst_offset: u64,
        len: usize,
        signals: (FlagValue<'_>, Option<FlagValue<'_>>),
        premul: Option<PreMul>,
    ) -> Result<()> {
        self.check(src.buffer, src.offset, dst_offset, len)?;
        self.mapping.uses.note(on.stream);
        let dst = self.mapping.dst + dst_offset;
        send_to(on, dst, src, len, signals, premul)
    }
}

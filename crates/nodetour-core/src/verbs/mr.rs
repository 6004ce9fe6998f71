//! Memory regions (`ibv_mr`): buffers the device may read and write.
//!
//! A [`MemoryRegion`] owns the buffer it registered. While registered the buffer is reachable
//! only through copies ([`MemoryRegion::read_at`], [`MemoryRegion::write_at`]), because the NIC
//! or a peer may write it at any time; [`MemoryRegion::into_buffer`] deregisters and gives the
//! buffer back. Work requests in flight hold an `Arc` of the region, so it cannot be
//! deregistered under the NIC.

use std::ffi::c_void;
use std::ops::Range;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use rdma_sys::ibv_mr;

use super::pd::ProtectionDomain;
use super::result;
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, HostAccessible, RdmaBuffer, page_size};

const ACCESS_LOCAL_WRITE: u32 = 1;
const ACCESS_REMOTE_WRITE: u32 = 2;
const ACCESS_REMOTE_READ: u32 = 4;
const ACCESS_RELAXED_ORDERING: u32 = 1 << 20;

/// What a region allows the device and peers to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Access {
    /// Peers may RDMA WRITE into it.
    pub remote_write: bool,
    /// Peers may RDMA READ from it.
    pub remote_read: bool,
    /// Ask for PCIe relaxed ordering (faster writes on some platforms). Never for memory that
    /// is polled for flags: relaxed ordering lets a flag land before the data it guards.
    pub relaxed_ordering: bool,
}

impl Access {
    /// Local use only: a source of writes.
    pub const LOCAL: Access = Access {
        remote_write: false,
        remote_read: false,
        relaxed_ordering: true,
    };
    /// A target of remote writes (bulk data, relaxed ordering asked for). Not readable by
    /// peers: no nodetour path uses RDMA READ, so no region allows it (least privilege).
    pub const REMOTE: Access = Access {
        remote_write: true,
        remote_read: false,
        relaxed_ordering: true,
    };
    /// A target of remote writes that is polled (flags, clear-to-send entries): strict ordering.
    pub const REMOTE_STRICT: Access = Access {
        remote_write: true,
        remote_read: false,
        relaxed_ordering: false,
    };

    fn bits(self) -> u32 {
        let mut bits = ACCESS_LOCAL_WRITE;
        if self.remote_write {
            bits |= ACCESS_REMOTE_WRITE;
        }
        if self.remote_read {
            bits |= ACCESS_REMOTE_READ;
        }
        bits
    }
}

/// Whether a region got relaxed ordering, as far as user space can tell.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RelaxedOrdering {
    /// Not asked for.
    NotRequested,
    /// Passed as an optional flag: kernels and devices that support it honour it, others drop
    /// it silently (user space cannot tell which; soft-RoCE ignores it).
    Requested,
    /// Could not even be asked for, and why.
    Unavailable(&'static str),
}

/// A window of a peer's registered memory that this side may write: address, length, key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Start address (the region's iova) in the peer's key space.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// The peer's remote key.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Checks that `offset..offset+len` lies inside the region and returns its address.
    pub fn address_of(&self, offset: u64, len: u64) -> Result<u64> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(self.addr + offset),
            _ => Err(Error::OutOfBounds {
                what: "remote write",
                offset,
                len,
                region_len: self.len,
            }),
        }
    }
}

/// Something posted work can keep alive until its completion.
pub(crate) trait Registered: Send + Sync {
    /// The registered start address (the local iova).
    fn addr(&self) -> u64;
}

/// A registered buffer.
pub struct MemoryRegion<B: RdmaBuffer> {
    // Deregistered in Drop::drop before any field is dropped: the NIC stops using the memory
    // before `buffer` frees it, and the protection domain is released last.
    raw: *mut ibv_mr,
    buffer: Option<B>,
    pd: Arc<ProtectionDomain>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    relaxed: RelaxedOrdering,
    // Held by every CPU copy through `&self` (read_at, write_at): two threads of this process
    // never race on the region's bytes; the NIC and peers write it outside Rust's view.
    cpu: std::sync::Mutex<()>,
}

// SAFETY: ibv_mr is usable from any thread; the buffer is Send + Sync.
unsafe impl<B: RdmaBuffer> Send for MemoryRegion<B> {}
// SAFETY: shared access only copies through raw pointers.
unsafe impl<B: RdmaBuffer> Sync for MemoryRegion<B> {}

impl<B: RdmaBuffer> MemoryRegion<B> {
    /// Registers `buffer` in `pd` with `ibv_reg_mr` (`ibv_reg_mr_iova2` where rdma-core has it).
    /// The buffer must be page-aligned and non-empty (a region sharing a page with unrelated
    /// data would pin and expose that data too). GPU memory registered this way is the
    /// nvidia-peermem path; [`MemoryRegion::try_register_dmabuf`] is the dma-buf path.
    pub fn register(pd: &Arc<ProtectionDomain>, buffer: B, access: Access) -> Result<Self> {
        Self::try_register(pd, buffer, access).map_err(|(e, _)| e)
    }

    /// [`Self::register`], giving the buffer back on failure (so a caller can try another way).
    pub fn try_register(
        pd: &Arc<ProtectionDomain>,
        buffer: B,
        access: Access,
    ) -> Result<Self, (Error, B)> {
        crate::memlock::warn_exempt_memlock_once(crate::memlock::MIN_MEMLOCK);
        let addr = buffer.as_mut_ptr();
        let len = buffer.len();
        if let Err(e) = check_registration(addr as usize, len, page_size()) {
            return Err((e, buffer));
        }
        let lib = pd.context().lib();
        let optional = if access.relaxed_ordering {
            ACCESS_RELAXED_ORDERING
        } else {
            0
        };
        // SAFETY: pd is live; [addr, addr+len) is memory the buffer keeps allocated for as long
        // as this region (which owns the buffer) exists.
        let registered = unsafe {
            result::reg_mr(
                lib,
                pd.raw(),
                addr.cast::<c_void>(),
                len,
                addr as u64,
                access.bits(),
                optional,
            )
        };
        let (raw, iova2) = match registered {
            Ok(v) => v,
            Err(source) => {
                let e = Error::RegisterMemory {
                    kind: if buffer.kind() == "gpu" {
                        "peermem (GPU)"
                    } else {
                        "host"
                    },
                    len,
                    hint: register_hint(source.raw_os_error()),
                    source,
                };
                return Err((e, buffer));
            }
        };
        let relaxed = match (access.relaxed_ordering, iova2) {
            (false, _) => RelaxedOrdering::NotRequested,
            (true, true) => RelaxedOrdering::Requested,
            (true, false) => RelaxedOrdering::Unavailable(
                "rdma-core has no ibv_reg_mr_iova2 (needs rdma-core 29 or newer)",
            ),
        };
        Ok(Self::from_raw(raw, buffer, pd, addr as u64, len, relaxed))
    }

    fn from_raw(
        raw: *mut ibv_mr,
        buffer: B,
        pd: &Arc<ProtectionDomain>,
        addr: u64,
        len: usize,
        relaxed: RelaxedOrdering,
    ) -> Self {
        // SAFETY: raw is a live MR returned just now.
        let (lkey, rkey) = unsafe { ((*raw).lkey, (*raw).rkey) };
        tracing::debug!(
            len,
            lkey,
            rkey,
            kind = buffer.kind(),
            ?relaxed,
            "memory registered"
        );
        MemoryRegion {
            raw,
            buffer: Some(buffer),
            pd: pd.clone(),
            addr,
            len,
            lkey,
            rkey,
            relaxed,
            cpu: std::sync::Mutex::new(()),
        }
    }

    /// The registered buffer, for its metadata (never its bytes as a slice: the device may
    /// write them).
    pub(crate) fn buffer(&self) -> &B {
        self.buffer
            .as_ref()
            .expect("present until the region is dropped or turned back into its buffer")
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the region is empty (never: empty registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The key peers name this region by.
    pub fn rkey(&self) -> u32 {
        self.rkey
    }

    /// The key local work requests name this region by.
    pub fn lkey(&self) -> u32 {
        self.lkey
    }

    /// What happened to the relaxed ordering request.
    pub fn relaxed_ordering(&self) -> &RelaxedOrdering {
        &self.relaxed
    }

    /// The protection domain.
    pub fn protection_domain(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// The whole region as a peer addresses it.
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.addr,
            len: self.len as u64,
            rkey: self.rkey,
        }
    }

    /// `range` of the region as a peer addresses it.
    pub fn remote_range(&self, range: Range<usize>) -> Result<RemoteRegion> {
        self.check_range(
            "advertise",
            range.start,
            range.end.saturating_sub(range.start),
        )?;
        Ok(RemoteRegion {
            addr: self.addr + range.start as u64,
            len: (range.end - range.start) as u64,
            rkey: self.rkey,
        })
    }

    /// Deregisters the region and gives the buffer back.
    pub fn into_buffer(mut self) -> Result<B> {
        let lib = self.pd.context().lib();
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        // SAFETY: raw is live; no work request holds this region (we own it by value, and work
        // in flight holds an Arc, which would prevent calling this).
        unsafe { result::dereg_mr(lib, raw) }.map_err(|source| Error::RegisterMemory {
            kind: "deregistration of",
            len: self.len,
            hint: "",
            source,
        })?;
        Ok(self
            .buffer
            .take()
            .expect("buffer is present until into_buffer or drop"))
    }

    fn check_range(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what,
                offset: offset as u64,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }
}

impl<B: RdmaBuffer> MemoryRegion<B> {
    /// Registers `buffer` through the dma-buf `fd` (`ibv_reg_dmabuf_mr`) at iova = the buffer's
    /// address, `offset` being where the buffer starts in the dma-buf. The caller keeps
    /// ownership of `fd` and may close it once this returns (the kernel holds its own
    /// reference). Gives the buffer back on failure.
    pub fn try_register_dmabuf_fd(
        pd: &Arc<ProtectionDomain>,
        buffer: B,
        fd: BorrowedFd<'_>,
        offset: u64,
        access: Access,
    ) -> Result<Self, (Error, B)> {
        let len = buffer.len();
        let iova = buffer.as_mut_ptr() as u64;
        if let Err(e) = check_registration(iova as usize, len, page_size()) {
            return Err((e, buffer));
        }
        // SAFETY: pd is live; the dma-buf covers the buffer, which the region owns (and so keeps
        // allocated) for as long as the registration exists.
        let registered = unsafe {
            result::reg_dmabuf_mr(
                pd.context().lib(),
                pd.raw(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access.bits() as i32,
            )
        };
        match registered {
            // For dma-buf registrations the MR's `addr` field holds the offset: the region is
            // addressed, and advertised, by its iova.
            Ok(raw) => Ok(Self::from_raw(
                raw,
                buffer,
                pd,
                iova,
                len,
                RelaxedOrdering::NotRequested,
            )),
            Err(source) => Err((
                Error::RegisterMemory {
                    kind: "dma-buf",
                    len,
                    hint: register_hint(source.raw_os_error()),
                    source,
                },
                buffer,
            )),
        }
    }
}

impl MemoryRegion<DeviceBuffer> {
    /// The GPU buffer, for GPU-side copies (its methods go through the driver; the CPU never
    /// dereferences it). Host buffers have no such accessor: their bytes are reached only
    /// through `read_at`/`write_at` copies.
    pub fn device_buffer(&self) -> &DeviceBuffer {
        self.buffer
            .as_ref()
            .expect("buffer is present while registered")
    }

    /// Registers GPU memory through dma-buf: the buffer is exported
    /// (`cuMemGetHandleForAddressRange`), registered with [`Self::try_register_dmabuf_fd`], and
    /// the descriptor closed. Gives the buffer back on failure.
    pub fn try_register_dmabuf(
        pd: &Arc<ProtectionDomain>,
        buffer: DeviceBuffer,
        access: Access,
    ) -> Result<Self, (Error, DeviceBuffer)> {
        let export = match buffer.export_dmabuf() {
            Ok(x) => x,
            Err(e) => return Err((e, buffer)),
        };
        Self::try_register_dmabuf_fd(pd, buffer, export.fd.as_fd(), export.offset, access)
    }
}

impl<B: RdmaBuffer + HostAccessible> MemoryRegion<B> {
    /// Copies `dst.len()` bytes at `offset` out of the region.
    ///
    /// The device or a peer may be writing the region: call this only after the completion
    /// (or the peer's notification) that says the bytes landed, or expect torn data.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check_range("read", offset, dst.len())?;
        let _cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        fence(Ordering::Acquire);
        // SAFETY: offset..offset+len is inside the registered buffer (checked); dst is a
        // distinct Rust allocation, so the ranges cannot overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(self.ptr().add(offset), dst.as_mut_ptr(), dst.len());
        }
        Ok(())
    }

    /// Copies `src` into the region at `offset`. Do not write bytes a posted work request is
    /// still sending.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check_range("write", offset, src.len())?;
        let _cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: as in read_at.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr().add(offset), src.len());
        }
        fence(Ordering::Release);
        Ok(())
    }

    /// Fills `offset..offset+len` by calling `f(i)` for each byte index `i` of the region.
    pub fn fill_with(&self, range: Range<usize>, mut f: impl FnMut(usize) -> u8) -> Result<()> {
        const CHUNK: usize = 64 * 1024;
        let mut chunk = vec![0u8; CHUNK.min(range.len())];
        let mut at = range.start;
        while at < range.end {
            let n = CHUNK.min(range.end - at);
            for (i, b) in chunk[..n].iter_mut().enumerate() {
                *b = f(at + i);
            }
            self.write_at(at, &chunk[..n])?;
            at += n;
        }
        Ok(())
    }

    fn ptr(&self) -> *mut u8 {
        self.buffer
            .as_ref()
            .expect("buffer is present while registered")
            .as_mut_ptr()
    }
}

impl<B: RdmaBuffer> Registered for MemoryRegion<B> {
    fn addr(&self) -> u64 {
        self.addr
    }
}

impl<B: RdmaBuffer> Drop for MemoryRegion<B> {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return; // into_buffer already deregistered
        }
        // Failure policy: a failed deregistration leaves the pages pinned and the key valid; we
        // must then not free the memory the NIC may still write, so the buffer is leaked.
        // SAFETY: raw is live; no posted work holds this region (it would hold an Arc).
        if let Err(e) = unsafe { result::dereg_mr(self.pd.context().lib(), self.raw) } {
            tracing::error!(error = %e, len = self.len, "ibv_dereg_mr failed: leaking the buffer so the NIC cannot write freed memory");
            std::mem::forget(self.buffer.take());
        }
    }
}

impl<B: RdmaBuffer> std::fmt::Debug for MemoryRegion<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &self.lkey)
            .field("rkey", &self.rkey)
            .finish()
    }
}

/// Refuses registrations no device should be asked for.
fn check_registration(addr: usize, len: usize, page: usize) -> Result<()> {
    if len == 0 {
        return Err(Error::InvalidRegistration {
            reason: "zero-length region".into(),
        });
    }
    if !addr.is_multiple_of(page) {
        return Err(Error::InvalidRegistration {
            reason: format!("address {addr:#x} is not aligned to the {page}-byte page size"),
        });
    }
    if addr.checked_add(len).is_none() {
        return Err(Error::InvalidRegistration {
            reason: "range wraps the address space".into(),
        });
    }
    Ok(())
}

/// What a registration errno usually means.
pub(crate) fn register_hint(errno: Option<i32>) -> &'static str {
    match errno {
        Some(libc::ENOMEM) => {
            "pinning hit RLIMIT_MEMLOCK (or vm.max_map_count, or the GPU's BAR1 for GPU memory): `ulimit -l unlimited`; Docker: --ulimit memlock=-1 (its default is 8 MiB)"
        }
        Some(libc::EPERM) | Some(libc::EACCES) => {
            "not allowed to pin memory: raise RLIMIT_MEMLOCK (`ulimit -l unlimited`) or grant CAP_IPC_LOCK"
        }
        Some(libc::EFAULT) => {
            "the range is not mapped host memory (GPU memory needs dma-buf support or the nvidia-peermem module)"
        }
        Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT) => {
            "the provider or kernel cannot register this kind of memory"
        }
        Some(libc::EINVAL) => "the device refused the access flags or the range",
        _ => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_checks() {
        assert!(check_registration(0x10000, 4096, 4096).is_ok());
        for (addr, len) in [(0x10000, 0), (0x10001, 4096), (usize::MAX - 4095, 8192)] {
            assert!(
                matches!(
                    check_registration(addr, len, 4096),
                    Err(Error::InvalidRegistration { .. })
                ),
                "{addr:#x}+{len}"
            );
        }
    }

    #[test]
    fn every_registration_errno_has_a_hint() {
        for errno in [
            libc::ENOMEM,
            libc::EPERM,
            libc::EACCES,
            libc::EFAULT,
            libc::EOPNOTSUPP,
            libc::EINVAL,
        ] {
            assert!(!register_hint(Some(errno)).is_empty(), "errno {errno}");
        }
        assert!(register_hint(Some(libc::ENOMEM)).contains("ulimit -l"));
        assert!(register_hint(None).is_empty());
    }

    #[test]
    fn remote_bounds() {
        let r = RemoteRegion {
            addr: 0x1000,
            len: 100,
            rkey: 7,
        };
        assert_eq!(r.address_of(10, 90).unwrap(), 0x100a);
        assert!(r.address_of(10, 91).is_err());
        assert!(r.address_of(u64::MAX, 2).is_err());
    }

    #[test]
    fn access_bits() {
        assert_eq!(Access::LOCAL.bits(), ACCESS_LOCAL_WRITE);
        // Least privilege: remote write, never remote read.
        assert_eq!(
            Access::REMOTE.bits(),
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
        );
        assert_eq!(
            Access::REMOTE_STRICT.bits(),
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE
        );
    }
}

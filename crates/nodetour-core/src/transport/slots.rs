//! Slot regions: memory peers may write, named by a key, and the per-connection table of what
//! each peer was granted.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, HostBuffer, RdmaBuffer};
use crate::verbs::{MemoryRegion, RemoteRegion};

static NEXT_KEY: AtomicU32 = AtomicU32::new(1);

enum Memory {
    // Held only to own (and in the end unmap) the memory behind `ptr`.
    Host(#[allow(dead_code)] HostBuffer),
    Registered(Arc<MemoryRegion<HostBuffer>>),
    // GPU memory registered with an RDMA device (the direct path): NICs and GPU streams reach
    // it, the CPU never does.
    Device(Arc<MemoryRegion<DeviceBuffer>>),
}

/// The RDMA registration of a slot region, whichever memory it is.
#[derive(Clone, Copy)]
pub(crate) enum SlotRegistration<'a> {
    /// Host memory.
    Host(&'a Arc<MemoryRegion<HostBuffer>>),
    /// GPU memory (registered through the ladder: dma-buf or peermem).
    Device(&'a Arc<MemoryRegion<DeviceBuffer>>),
}

impl SlotRegistration<'_> {
    /// The window a peer writes through.
    pub(crate) fn remote(&self) -> RemoteRegion {
        match self {
            SlotRegistration::Host(r) => r.remote(),
            SlotRegistration::Device(r) => r.remote(),
        }
    }
}

struct Inner {
    key: u32,
    ptr: *mut u8,
    len: usize,
    // Held by every CPU copy in or out (`&self` methods): two threads of this process never
    // race on the region's bytes. Peers, NICs and GPUs write it outside Rust's view; that is
    // why it is only ever reached through raw pointers.
    cpu: Mutex<()>,
    // Owns the memory behind `ptr`.
    memory: Memory,
}

// SAFETY: the memory is owned by Inner; access goes through bounds-checked raw copies.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

/// Host memory that peers may write, with the key they name it by. Cheap to clone (shared).
///
/// Like a registered region, it is never visible as a slice: peers may write it at any time,
/// so it is read and written through copies, after the notification that says the bytes landed.
///
/// Who writes a slot when: a peer, into what this process granted it ([`SlotTable`]), between
/// the grant and the notification that says the bytes landed — by its NIC (verbs), or by this
/// process's receive thread for it (tcp, mem), which lands the bytes only through this type's
/// methods, under the region's one CPU lock; this process, after that notification, through
/// the same methods and lock (or its GPU, through [`Self::device_address`]). The slot table's
/// lock guards the table of grants, never the bytes.
#[derive(Clone)]
pub struct SlotRegion(Arc<Inner>);

impl SlotRegion {
    /// Slot memory for software transports (tcp, mem).
    pub fn host(buffer: HostBuffer) -> SlotRegion {
        let (ptr, len) = (buffer.as_mut_ptr(), RdmaBuffer::len(&buffer));
        Self::with(ptr, len, Memory::Host(buffer))
    }

    fn with(ptr: *mut u8, len: usize, memory: Memory) -> SlotRegion {
        SlotRegion(Arc::new(Inner {
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
            ptr,
            len,
            cpu: Mutex::new(()),
            memory,
        }))
    }

    /// Slot memory registered with an RDMA device (verbs).
    pub fn registered(region: Arc<MemoryRegion<HostBuffer>>) -> SlotRegion {
        let (ptr, len) = (region.remote().addr as *mut u8, region.len());
        Self::with(ptr, len, Memory::Registered(region))
    }

    /// GPU memory registered with an RDMA device (the direct path: the NIC writes the slots,
    /// or reads the send slots, and GPU streams read or fill them). The CPU never touches it:
    /// [`Self::read_at`], [`Self::write_at`] and the GPU copies refuse, and a software transport
    /// cannot land in it.
    pub fn device(region: Arc<MemoryRegion<DeviceBuffer>>) -> SlotRegion {
        let (ptr, len) = (region.remote().addr as *mut u8, region.len());
        Self::with(ptr, len, Memory::Device(region))
    }

    /// Whether it is GPU memory (the direct path).
    pub fn is_device(&self) -> bool {
        matches!(self.0.memory, Memory::Device(_))
    }

    /// The key peers name it by.
    pub fn key(&self) -> u32 {
        self.0.key
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// The window a peer writes through (its address and remote key), where the region is
    /// registered with verbs: what a grant carries, never the bytes.
    pub fn remote(&self) -> Option<RemoteRegion> {
        self.registration().map(|r| r.remote())
    }

    /// A read flush over this region's verbs registration (host memory registered with
    /// verbs): the flush reads the region through a second registration of its own, and the
    /// region's bytes stay reachable only through this type's methods, under its one lock
    /// (no second handle to them is ever handed out).
    pub fn read_flush(
        &self,
        device: &Arc<crate::verbs::Context>,
        port: &crate::verbs::PortAttributes,
        gid: &crate::verbs::GidChoice,
        config: &crate::Config,
        timeout: std::time::Duration,
    ) -> Result<crate::gdr::read_flush::ReadFlush> {
        match &self.0.memory {
            Memory::Registered(r) => {
                crate::gdr::read_flush::ReadFlush::by_address(device, port, gid, config, r, timeout)
            }
            Memory::Host(_) | Memory::Device(_) => Err(Error::InvalidArgument {
                reason: "a read flush needs slot memory registered with verbs".into(),
            }),
        }
    }

    /// The verbs registration, host or GPU memory, if any (for posting: never handed out of
    /// this crate, so that the bytes have one writer's lock).
    pub(crate) fn registration(&self) -> Option<SlotRegistration<'_>> {
        match &self.0.memory {
            Memory::Registered(r) => Some(SlotRegistration::Host(r)),
            Memory::Device(r) => Some(SlotRegistration::Device(r)),
            Memory::Host(_) => None,
        }
    }

    /// The GPU memory of a [`Self::device`] region (what the streams read or fill).
    pub fn device_buffer(&self) -> Option<&DeviceBuffer> {
        match &self.0.memory {
            Memory::Device(r) => Some(r.buffer()),
            Memory::Host(_) | Memory::Registered(_) => None,
        }
    }

    /// The address GPUs use for `len` bytes at `offset` (unified addressing: the host address),
    /// for a region whose buffer was registered with CUDA before it became a region
    /// ([`HostBuffer::register_with_cuda`]).
    pub fn device_address(&self, offset: usize, len: usize) -> Result<u64> {
        let registered = match &self.0.memory {
            Memory::Host(b) => b.is_registered_with_cuda(),
            Memory::Registered(r) => r.buffer().is_registered_with_cuda(),
            Memory::Device(_) => {
                self.bounds("GPU access to a slot region", offset, len)?;
                return Ok(self.0.ptr as u64 + offset as u64);
            }
        };
        if !registered {
            return Err(Error::InvalidArgument {
                reason: "the slot region's memory is not registered with CUDA".into(),
            });
        }
        Ok(self.ptr_at("GPU access to a slot region", offset, len)? as u64)
    }

    /// Copies `dst.len()` bytes at `offset` out (after the notification that they landed).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check("read", offset, dst.len())?;
        let _cpu = self.cpu_lock();
        fence(Ordering::Acquire);
        // SAFETY: in bounds (checked); dst is a distinct allocation.
        unsafe {
            std::ptr::copy_nonoverlapping(self.0.ptr.add(offset), dst.as_mut_ptr(), dst.len())
        };
        Ok(())
    }

    /// Copies `src` in at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check("write", offset, src.len())?;
        let _cpu = self.cpu_lock();
        // SAFETY: in bounds (checked); src is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.0.ptr.add(offset), src.len()) };
        fence(Ordering::Release);
        Ok(())
    }

    /// Copies `len` bytes at `offset` into `dst` at `dst_offset` (another region, or this one:
    /// the ranges may overlap), CPU to CPU without an intermediate buffer (after the
    /// notification that the bytes landed).
    pub fn copy_to(
        &self,
        offset: usize,
        dst: &SlotRegion,
        dst_offset: usize,
        len: usize,
    ) -> Result<()> {
        self.check("copy source", offset, len)?;
        dst.check("copy destination", dst_offset, len)?;
        // Both regions' CPU locks, in key order (one lock for a copy within a region).
        let same = Arc::ptr_eq(&self.0, &dst.0);
        let (first, second) = if self.0.key <= dst.0.key {
            (self, dst)
        } else {
            (dst, self)
        };
        let _a = first.cpu_lock();
        let _b = (!same).then(|| second.cpu_lock());
        fence(Ordering::Acquire);
        // SAFETY: both ranges are in bounds of live memory (checked), reached only through raw
        // pointers; `ptr::copy` allows the overlap of a copy within one region.
        unsafe { std::ptr::copy(self.0.ptr.add(offset), dst.0.ptr.add(dst_offset), len) };
        fence(Ordering::Release);
        Ok(())
    }

    /// Copies `len` bytes at `offset` into GPU memory `dst` at `dst_offset` on `stream`, after
    /// the work queued there, and waits for `stream` (only) until they have landed. Fast when
    /// the region's buffer was registered with CUDA before it became a region.
    pub fn copy_to_gpu(
        &self,
        offset: usize,
        dst: &crate::memory::DeviceBuffer,
        dst_offset: usize,
        len: usize,
        stream: &crate::cuda::GpuStream,
    ) -> Result<()> {
        let src = self.ptr_at("copy to GPU", offset, len)?;
        dst.check("copy to GPU", dst_offset, len)?;
        let _cpu = self.cpu_lock();
        fence(Ordering::Acquire);
        crate::cuda::copy::htod(dst, dst_offset, src, len, stream)
    }

    /// Copies `len` bytes of GPU memory `src` at `src_offset` into the region at `offset` on
    /// `stream`, after the work queued there, and waits for `stream` (only) until they landed.
    pub fn copy_from_gpu(
        &self,
        offset: usize,
        src: &crate::memory::DeviceBuffer,
        src_offset: usize,
        len: usize,
        stream: &crate::cuda::GpuStream,
    ) -> Result<()> {
        let dst = self.ptr_at("copy from GPU", offset, len)?;
        src.check("copy from GPU", src_offset, len)?;
        let _cpu = self.cpu_lock();
        crate::cuda::copy::dtoh(dst, src, src_offset, len, stream)?;
        fence(Ordering::Release);
        Ok(())
    }

    fn cpu_lock(&self) -> std::sync::MutexGuard<'_, ()> {
        self.0.cpu.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bounds, and CPU access (refused for GPU memory).
    pub(crate) fn check(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        if self.is_device() {
            return Err(Error::InvalidArgument {
                reason: format!(
                    "{what}: the slot region is GPU memory, which the CPU never touches"
                ),
            });
        }
        self.bounds(what, offset, len)
    }

    fn bounds(&self, what: &'static str, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.0.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what,
                offset: offset as u64,
                len: len as u64,
                region_len: self.0.len as u64,
            }),
        }
    }

    /// `len` bytes at `offset` as a raw pointer, bounds-checked.
    /// Runs `f` on the address of `len` bytes at `offset`, under the region's CPU lock: how a
    /// receive thread lands a peer's bytes (a `recv(2)` straight into the slot, a copy out of
    /// its buffer) without forming a slice over memory others write.
    pub(crate) fn with_locked<R>(
        &self,
        what: &'static str,
        offset: usize,
        len: usize,
        f: impl FnOnce(*mut u8) -> R,
    ) -> Result<R> {
        self.check(what, offset, len)?;
        let _cpu = self.cpu_lock();
        // SAFETY: offset..offset + len is within the allocation (checked).
        let r = f(unsafe { self.0.ptr.add(offset) });
        fence(Ordering::Release);
        Ok(r)
    }

    pub(crate) fn ptr_at(&self, what: &'static str, offset: usize, len: usize) -> Result<*mut u8> {
        self.check(what, offset, len)?;
        // SAFETY: offset is within the allocation (checked).
        Ok(unsafe { self.0.ptr.add(offset) })
    }
}

impl std::fmt::Debug for SlotRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotRegion")
            .field("key", &self.0.key)
            .field("len", &self.0.len)
            .finish()
    }
}

/// What a peer needs to write into a granted region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotGrant {
    /// The region's key.
    pub key: u32,
    /// Its length.
    pub len: u64,
    /// Its RDMA address and remote key (verbs only).
    pub remote: Option<RemoteRegion>,
}

impl SlotGrant {
    /// What a peer needs to write `region` (its RDMA window where it is registered).
    pub fn of(region: &SlotRegion) -> SlotGrant {
        SlotGrant {
            key: region.key(),
            len: region.len() as u64,
            remote: region.registration().map(|m| m.remote()),
        }
    }

    /// Encoded size.
    pub const ENCODED_LEN: usize = 4 + 8 + 1 + 8 + 8 + 4;

    /// Encodes (big-endian) for the out-of-band exchange.
    pub fn encode(&self) -> [u8; Self::ENCODED_LEN] {
        let mut b = [0u8; Self::ENCODED_LEN];
        b[..4].copy_from_slice(&self.key.to_be_bytes());
        b[4..12].copy_from_slice(&self.len.to_be_bytes());
        if let Some(r) = self.remote {
            b[12] = 1;
            b[13..21].copy_from_slice(&r.addr.to_be_bytes());
            b[21..29].copy_from_slice(&r.len.to_be_bytes());
            b[29..33].copy_from_slice(&r.rkey.to_be_bytes());
        }
        b
    }

    /// Decodes, validating every field.
    pub fn decode(b: &[u8]) -> Result<SlotGrant> {
        let bad = |reason: String| Error::Decode {
            what: "slot grant",
            reason,
        };
        if b.len() != Self::ENCODED_LEN {
            return Err(bad(format!(
                "{} bytes, expected {}",
                b.len(),
                Self::ENCODED_LEN
            )));
        }
        let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let key = u32::from_be_bytes(b[..4].try_into().expect("4 bytes"));
        let len = u64_at(4);
        if len == 0 {
            return Err(bad("an empty region".into()));
        }
        let remote = match b[12] {
            0 if b[13..].iter().all(|x| *x == 0) => None,
            1 => {
                let r = RemoteRegion {
                    addr: u64_at(13),
                    len: u64_at(21),
                    rkey: u32::from_be_bytes(b[29..33].try_into().expect("4 bytes")),
                };
                if r.len != len || r.addr.checked_add(r.len).is_none() {
                    return Err(bad("the RDMA window does not match the region".into()));
                }
                Some(r)
            }
            f => return Err(bad(format!("flag byte {f}"))),
        };
        Ok(SlotGrant { key, len, remote })
    }
}

/// The regions one peer may write on one connection: the receiver's side of every bounds check.
#[derive(Default, Clone)]
pub struct SlotTable(Arc<Mutex<HashMap<u32, SlotRegion>>>);

impl SlotTable {
    /// Allows writes into `region`. A software transport lands writes with the CPU: GPU memory
    /// ([`SlotRegion::device`]) is refused.
    pub fn insert(&self, region: &SlotRegion) -> Result<()> {
        if region.is_device() {
            return Err(Error::InvalidArgument {
                reason: "a software transport cannot land in GPU memory: grant host slots".into(),
            });
        }
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(region.key(), region.clone());
        Ok(())
    }

    /// Revokes `key`.
    pub fn remove(&self, key: u32) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key);
    }

    /// The region and offset of a peer's write of `len` bytes at `offset` into `key` (checked
    /// against the region), or the reason it is refused (unknown key, out of bounds).
    pub fn target(&self, key: u32, offset: u64, len: u64) -> Result<(SlotRegion, usize)> {
        let table = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let region = table.get(&key).cloned().ok_or(Error::OutOfBounds {
            what: "peer write to a region it was not granted",
            offset,
            len,
            region_len: 0,
        })?;
        let (off, n) = (usize::try_from(offset), usize::try_from(len));
        let at = match (off, n) {
            (Ok(o), Ok(n)) => {
                region.check("peer write", o, n)?;
                o
            }
            _ => {
                return Err(Error::OutOfBounds {
                    what: "peer write",
                    offset,
                    len,
                    region_len: region.len() as u64,
                });
            }
        };
        Ok((region, at))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_copy_to_each_other_and_within_themselves() {
        let a = SlotRegion::host(HostBuffer::new(4096).unwrap());
        let b = SlotRegion::host(HostBuffer::new(4096).unwrap());
        a.write_at(0, b"abcdef").unwrap();
        a.copy_to(1, &b, 100, 4).unwrap();
        b.copy_to(100, &a, 2, 4).unwrap(); // the other lock order
        let mut out = [0u8; 6];
        a.read_at(0, &mut out).unwrap();
        assert_eq!(&out, b"abbcde");
        a.copy_to(0, &a, 1, 5).unwrap(); // overlapping, within one region
        a.read_at(0, &mut out).unwrap();
        assert_eq!(&out, b"aabbcd");
        assert!(matches!(
            a.copy_to(4090, &b, 0, 8),
            Err(Error::OutOfBounds { .. })
        ));
        assert!(matches!(
            a.copy_to(0, &b, 4090, 8),
            Err(Error::OutOfBounds { .. })
        ));
    }

    #[test]
    fn regions_copy_in_and_out_within_bounds() {
        let r = SlotRegion::host(HostBuffer::new(4096).unwrap());
        r.write_at(100, b"abc").unwrap();
        let mut out = [0u8; 3];
        r.read_at(100, &mut out).unwrap();
        assert_eq!(&out, b"abc");
        assert!(r.write_at(4095, b"ab").is_err());
        assert!(r.read_at(usize::MAX, &mut out).is_err());
        assert_ne!(
            r.key(),
            SlotRegion::host(HostBuffer::new(4096).unwrap()).key()
        );
    }

    #[test]
    fn the_table_refuses_unknown_keys_and_out_of_bounds_writes() {
        let r = SlotRegion::host(HostBuffer::new(4096).unwrap());
        let t = SlotTable::default();
        assert!(t.target(r.key(), 0, 1).is_err(), "not granted yet");
        t.insert(&r).unwrap();
        assert!(t.target(r.key(), 0, 4096).is_ok());
        for (off, len) in [(0, 4097), (4096, 1), (u64::MAX, 2), (1 << 40, 1)] {
            assert!(t.target(r.key(), off, len).is_err(), "{off}+{len}");
        }
        assert!(t.target(r.key() + 1000, 0, 1).is_err());
        t.remove(r.key());
        assert!(t.target(r.key(), 0, 1).is_err(), "revoked");
    }

    #[test]
    fn grants_round_trip_and_reject_garbage() {
        let g = SlotGrant {
            key: 7,
            len: 4096,
            remote: Some(RemoteRegion {
                addr: 0x1000,
                len: 4096,
                rkey: 9,
            }),
        };
        assert_eq!(SlotGrant::decode(&g.encode()).unwrap(), g);
        let plain = SlotGrant {
            key: 7,
            len: 10,
            remote: None,
        };
        assert_eq!(SlotGrant::decode(&plain.encode()).unwrap(), plain);
        let mut bad = g.encode();
        bad[12] = 2;
        assert!(SlotGrant::decode(&bad).is_err());
        let mut bad = g.encode();
        bad[21..29].copy_from_slice(&1u64.to_be_bytes());
        assert!(SlotGrant::decode(&bad).is_err(), "window must match");
        assert!(SlotGrant::decode(&[0; 3]).is_err());
        assert!(
            SlotGrant::decode(
                &SlotGrant {
                    key: 1,
                    len: 0,
                    remote: None
                }
                .encode()
            )
            .is_err()
        );
    }
}

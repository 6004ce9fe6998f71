//! Page-aligned host memory for registration.

use std::io;

use memmap2::{MmapMut, MmapOptions};

use super::{RdmaBuffer, page_size};
use crate::error::{Error, Result};

/// Anonymous, page-aligned, zero-filled host memory.
///
/// While it is not registered it is ordinary memory (`as_slice`, `as_mut_slice`); registration
/// takes it by value and gives it back when the region is deregistered.
pub struct HostBuffer {
    // `ptr` is taken once from the mapping with write provenance and stays valid as long as
    // `map` lives; moving a HostBuffer does not move the mapping.
    ptr: *mut u8,
    len: usize,
    map: MmapMut,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through &self/&mut self
// or through a registered region that copies with raw pointers.
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Maps `len` bytes (rounded up to whole pages) of zeroed memory.
    pub fn new(len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidRegistration {
                reason: "a buffer of zero bytes".into(),
            });
        }
        let page = page_size();
        let mapped =
            len.checked_next_multiple_of(page)
                .ok_or_else(|| Error::AllocateHostMemory {
                    len,
                    source: io::Error::from_raw_os_error(libc::ENOMEM),
                })?;
        let mut map = MmapOptions::new()
            .len(mapped)
            .map_anon()
            .map_err(|source| Error::AllocateHostMemory { len, source })?;
        Ok(HostBuffer {
            ptr: map.as_mut_ptr(),
            len,
            map,
        })
    }

    /// Length in bytes (as asked; the mapping may be longer).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the length is zero (never: zero-length buffers are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// The contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

// SAFETY: ptr comes from the mapping, which lives (unmoved) as long as self, and len is within
// it.
unsafe impl RdmaBuffer for HostBuffer {
    fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn kind(&self) -> &'static str {
        "host"
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_length_is_refused() {
        assert!(matches!(
            HostBuffer::new(0),
            Err(Error::InvalidRegistration { .. })
        ));
    }

    #[test]
    fn page_aligned_zeroed_and_stable_across_moves() {
        let mut b = HostBuffer::new(10_000).unwrap();
        assert_eq!(b.as_mut_ptr() as usize % page_size(), 0);
        assert!(b.as_slice().iter().all(|x| *x == 0));
        b.as_mut_slice()[9_999] = 7;
        let addr = b.as_mut_ptr();
        let moved = Box::new(b);
        assert_eq!(moved.as_mut_ptr(), addr);
        assert_eq!(moved.as_slice()[9_999], 7);
        assert_eq!(RdmaBuffer::len(&*moved), 10_000);
    }
}

//! Page-aligned host memory for registration, on 2 MiB hugepages where the machine has them.

use std::io;

use memmap2::{MmapMut, MmapOptions};

use super::{HostAccessible, RdmaBuffer, page_size};
use crate::error::{Error, Result};

/// Size of the hugepages nodetour asks for.
pub const HUGE_PAGE: usize = 2 << 20;

/// What backs a [`HostBuffer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Pages {
    /// 2 MiB hugepages: fewer TLB misses for the NIC and the copy engines, fewer pinned pages.
    Huge2M,
    /// Base pages, and why not hugepages.
    Base(String),
}

/// Logs at info level, once per process, why host memory fell back from 2 MiB hugepages to
/// base pages (later fallbacks stay at debug level).
pub(crate) fn log_base_pages_once(reason: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        tracing::info!(
            reason,
            "host memory is on 4 KiB pages, not 2 MiB hugepages (logged once per process)"
        );
    });
}

/// Whether to try hugepages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HugePages {
    /// Use 2 MiB hugepages when the buffer is at least one hugepage and some are free.
    Try,
    /// Base pages only.
    Never,
}

/// Anonymous, page-aligned, zero-filled host memory, optionally registered with CUDA for
/// pinned-speed copies.
///
/// While it is not registered for RDMA it is ordinary memory (`as_slice`, `as_mut_slice`);
/// registration takes it by value and gives it back when the region is deregistered.
pub struct HostBuffer {
    // `ptr` is taken once from the mapping with write provenance and stays valid as long as
    // `map` lives; moving a HostBuffer does not move the mapping.
    ptr: *mut u8,
    len: usize,
    pages: Pages,
    cuda_registered: bool,
    // The context the range was registered under (bound again to unregister it).
    cuda_context: Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    // Dropped last, after Drop::drop has unregistered the range from CUDA.
    map: MmapMut,
}

// SAFETY: the buffer is plain memory owned by this value; access goes through &self/&mut self
// or through a registered region that copies with raw pointers.
unsafe impl Send for HostBuffer {}
// SAFETY: as above.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Maps `len` bytes of zeroed memory, on hugepages when possible (see [`Self::pages`]).
    pub fn new(len: usize) -> Result<Self> {
        Self::with_pages(len, HugePages::Try)
    }

    /// Maps `len` bytes (rounded up to whole pages) of zeroed memory.
    pub fn with_pages(len: usize, huge: HugePages) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidRegistration {
                reason: "a buffer of zero bytes".into(),
            });
        }
        let too_big = || Error::AllocateHostMemory {
            len,
            source: io::Error::from_raw_os_error(libc::ENOMEM),
        };
        let base_reason = match huge {
            HugePages::Never => Some("base pages asked for".to_owned()),
            HugePages::Try if len < HUGE_PAGE => {
                Some(format!("{len} bytes is less than one 2 MiB hugepage"))
            }
            HugePages::Try => None,
        };
        let reason = match base_reason {
            Some(r) => r,
            None => {
                let mapped = len
                    .checked_next_multiple_of(HUGE_PAGE)
                    .ok_or_else(too_big)?;
                match MmapOptions::new().len(mapped).huge(Some(21)).map_anon() {
                    Ok(mut map) => {
                        return Ok(HostBuffer {
                            ptr: map.as_mut_ptr(),
                            len,
                            pages: Pages::Huge2M,
                            cuda_registered: false,
                            cuda_context: None,
                            map,
                        });
                    }
                    Err(e) => format!(
                        "no free 2 MiB hugepages for {mapped} bytes ({e}): see HugePages_Free in /proc/meminfo; as root `echo N > /proc/sys/vm/nr_hugepages`"
                    ),
                }
            }
        };
        let mapped = len
            .checked_next_multiple_of(page_size())
            .ok_or_else(too_big)?;
        let mut map = MmapOptions::new()
            .len(mapped)
            .map_anon()
            .map_err(|source| Error::AllocateHostMemory { len, source })?;
        tracing::debug!(len, reason = %reason, "host buffer on base pages");
        if matches!(huge, HugePages::Try) && len >= HUGE_PAGE {
            log_base_pages_once(&reason);
        }
        Ok(HostBuffer {
            ptr: map.as_mut_ptr(),
            len,
            pages: Pages::Base(reason),
            cuda_registered: false,
            cuda_context: None,
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

    /// What backs the buffer, and why not hugepages if not.
    pub fn pages(&self) -> &Pages {
        &self.pages
    }

    /// The contents.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// The contents, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }

    /// Registers the buffer with CUDA (`cuMemHostRegister`, portable and device-mapped: every
    /// GPU's copies then run at pinned-memory speed, and kernels and stream memory operations
    /// reach it at its host address) under `context` (the caller's GPU: no context is made on
    /// another). Unregistered when the buffer is dropped. Registering twice is a no-op.
    pub fn register_with_cuda(
        &mut self,
        context: &std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<()> {
        if self.cuda_registered {
            return Ok(());
        }
        crate::cuda::availability()?;
        context
            .bind_to_thread()
            .map_err(|e| crate::cuda::result::cuda_error("cuCtxSetCurrent", e))?;
        let context = context.clone();
        // SAFETY: CUDA is initialised and a context is current; the range is this buffer's live
        // mapping, which outlives the registration (unregistered in Drop before the unmap).
        unsafe { crate::cuda::result::host_register_mapped(self.ptr, self.map.len())? };
        self.cuda_registered = true;
        self.cuda_context = Some(context);
        Ok(())
    }

    /// Whether [`Self::register_with_cuda`] succeeded.
    pub fn is_registered_with_cuda(&self) -> bool {
        self.cuda_registered
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.cuda_registered {
            if let Some(c) = &self.cuda_context {
                let _ = c.bind_to_thread();
            }
            // Failure policy: log; the unmap that follows releases the pages either way.
            // SAFETY: the range was registered by register_with_cuda and is still mapped.
            if let Err(e) = unsafe { crate::cuda::result::host_unregister(self.ptr) } {
                tracing::warn!(error = %e, "cuMemHostUnregister failed");
            }
        }
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

// SAFETY: the memory is ordinary host memory, dereferenceable by the CPU.
unsafe impl HostAccessible for HostBuffer {}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("pages", &self.pages)
            .field("cuda_registered", &self.cuda_registered)
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

    #[test]
    fn small_buffers_say_why_they_are_not_on_hugepages() {
        let b = HostBuffer::new(4096).unwrap();
        assert!(matches!(b.pages(), Pages::Base(r) if r.contains("less than one 2 MiB hugepage")));
        let b = HostBuffer::with_pages(4 << 20, HugePages::Never).unwrap();
        assert_eq!(b.pages(), &Pages::Base("base pages asked for".into()));
    }

    #[test]
    fn large_buffers_get_hugepages_or_a_reason() {
        let mut b = HostBuffer::new(4 << 20).unwrap();
        match b.pages() {
            Pages::Huge2M => assert_eq!(b.as_mut_ptr() as usize % HUGE_PAGE, 0),
            Pages::Base(reason) => assert!(reason.contains("nr_hugepages"), "{reason}"),
        }
        b.as_mut_slice()[(4 << 20) - 1] = 1;
    }
}

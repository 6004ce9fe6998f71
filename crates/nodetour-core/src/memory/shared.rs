//! Host memory shared between processes of one host: a file on hugetlbfs (`/dev/hugepages`)
//! where the machine has one with free pages, else on tmpfs (`/dev/shm`), mapped by both and
//! registered with CUDA on each side. The staged path inside a host (the sender's GPU copies
//! into it, the receiver's GPU copies out) and the home of the in-host transports' flags.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use memmap2::{MmapMut, MmapOptions};

use super::{HUGE_PAGE, Pages, page_size};
use crate::error::{Error, Result};

/// A shared mapping of a file under `/dev/hugepages` or `/dev/shm`.
pub struct SharedHostMemory {
    ptr: *mut u8,
    len: usize,
    path: PathBuf,
    pages: Pages,
    owner: bool,
    cuda_registered: bool,
    // The context the range was registered under (bound again to unregister it).
    cuda_context: Option<std::sync::Arc<cudarc::driver::CudaContext>>,
    // Owns the mapping behind `ptr`; unmapped last, after Drop::drop has unregistered the range
    // from CUDA.
    #[allow(dead_code)]
    map: MmapMut,
}

// SAFETY: the mapping is owned by this value; access goes through bounds-checked raw copies.
unsafe impl Send for SharedHostMemory {}
// SAFETY: as above.
unsafe impl Sync for SharedHostMemory {}

fn io_err(path: &Path, len: usize) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::AllocateHostMemory {
        len,
        source: std::io::Error::new(source.kind(), format!("{}: {source}", path.display())),
    }
}

impl SharedHostMemory {
    /// Creates a new shared file of at least `len` bytes (named with the process id and a
    /// random suffix), on 2 MiB hugepages where possible.
    pub fn create(len: usize) -> Result<SharedHostMemory> {
        if len == 0 {
            return Err(Error::InvalidRegistration {
                reason: "shared memory of zero bytes".into(),
            });
        }
        let name = format!(
            "nodetour-{}-{:016x}",
            std::process::id(),
            u64::from_be_bytes(
                crate::bootstrap::auth::nonce()[..8]
                    .try_into()
                    .expect("8 bytes")
            )
        );
        let huge_len = len.next_multiple_of(HUGE_PAGE);
        let huge = PathBuf::from("/dev/hugepages").join(&name);
        let why_not = match Self::make(&huge, huge_len, Pages::Huge2M) {
            Ok(m) => return Ok(m),
            Err(e) => format!("no hugetlbfs file ({e})"),
        };
        let path = PathBuf::from("/dev/shm").join(&name);
        Self::make(
            &path,
            len.next_multiple_of(page_size()),
            Pages::Base(why_not),
        )
    }

    fn make(path: &Path, len: usize, pages: Pages) -> Result<SharedHostMemory> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(io_err(path, len))?;
        let mapped = file
            .set_len(len as u64)
            .map_err(io_err(path, len))
            .and_then(|()| Self::map(&file, path, len));
        match mapped {
            Ok(mut map) => {
                // Touch every page now: a hugetlbfs file without enough free pages fails here
                // (SIGBUS on first touch would be worse), and the peer finds the pages ready.
                // SAFETY: the mapping is len bytes of shared, writable memory.
                unsafe { std::ptr::write_bytes(map.as_mut_ptr(), 0, len) };
                Ok(SharedHostMemory {
                    ptr: map.as_mut_ptr(),
                    len,
                    path: path.to_owned(),
                    pages,
                    owner: true,
                    cuda_registered: false,
                    cuda_context: None,
                    map,
                })
            }
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(e)
            }
        }
    }

    fn map(file: &File, path: &Path, len: usize) -> Result<MmapMut> {
        // MAP_POPULATE on hugetlbfs reserves the pages up front (ENOMEM instead of a later SIGBUS).
        // SAFETY: the file is ours (created or opened for this job); concurrent access by the
        // peer process is the point, and happens only through raw copies and the GPU.
        unsafe { MmapOptions::new().len(len).populate().map_mut(file) }.map_err(io_err(path, len))
    }

    /// Opens a peer's shared file at `path` (it must be `len` bytes long).
    pub fn open(path: &Path, len: usize) -> Result<SharedHostMemory> {
        if !(path.starts_with("/dev/hugepages") || path.starts_with("/dev/shm")) {
            return Err(Error::InvalidArgument {
                reason: format!("{} is not a nodetour shared-memory path", path.display()),
            });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(io_err(path, len))?;
        let actual = file.metadata().map_err(io_err(path, len))?.len();
        if actual != len as u64 {
            return Err(Error::InvalidArgument {
                reason: format!("{} is {actual} bytes, the peer said {len}", path.display()),
            });
        }
        let mut map = Self::map(&file, path, len)?;
        let pages = if path.starts_with("/dev/hugepages") {
            Pages::Huge2M
        } else {
            Pages::Base("the peer's file is on tmpfs".into())
        };
        Ok(SharedHostMemory {
            ptr: map.as_mut_ptr(),
            len,
            path: path.to_owned(),
            pages,
            owner: false,
            cuda_registered: false,
            cuda_context: None,
            map,
        })
    }

    /// Removes the file name once every peer has mapped it: the memory lives on in the mappings,
    /// and nothing is left behind if a process dies. Only the creator unlinks.
    pub fn unlink(&self) -> Result<()> {
        if self.owner {
            match std::fs::remove_file(&self.path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&self.path, self.len)(e)),
            }
        }
        Ok(())
    }

    /// The file's path (what the peer opens).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty (never).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What backs it.
    pub fn pages(&self) -> &Pages {
        &self.pages
    }

    /// Registers the mapping with CUDA (portable, device-mapped): GPU copies from and to it run
    /// at pinned speed and streams can read and write its words (flags).
    pub fn register_with_cuda(&mut self) -> Result<()> {
        if !self.cuda_registered {
            crate::cuda::availability()?;
            let context = crate::cuda::result::registration_context()?;
            // SAFETY: CUDA is initialised and a context is current; the range is this live
            // mapping, unregistered in Drop before the unmap.
            unsafe { crate::cuda::result::host_register_mapped(self.ptr, self.len)? };
            self.cuda_registered = true;
            self.cuda_context = Some(context);
        }
        Ok(())
    }

    /// The address GPUs use for `offset` (unified addressing: the host address).
    pub(crate) fn device_address(&self, offset: usize, len: usize) -> Result<u64> {
        self.check(offset, len)?;
        if !self.cuda_registered {
            return Err(Error::InvalidArgument {
                reason: "shared memory must be registered with CUDA first".into(),
            });
        }
        Ok(self.ptr as u64 + offset as u64)
    }

    /// Reads the 32-bit word at `offset` (a flag), as the other processes and GPUs wrote it.
    pub fn read_u32(&self, offset: usize) -> Result<u32> {
        self.check(offset, 4)?;
        if offset % 4 != 0 {
            return Err(Error::InvalidArgument {
                reason: "flags are 4-byte aligned".into(),
            });
        }
        // SAFETY: in bounds and aligned; a volatile read sees writes by other agents.
        Ok(unsafe { std::ptr::read_volatile(self.ptr.add(offset).cast::<u32>()) })
    }

    /// Copies `dst.len()` bytes at `offset` out.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: in bounds; dst is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` in at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        // SAFETY: in bounds; src is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::OutOfBounds {
                what: "shared memory",
                offset: offset as u64,
                len: len as u64,
                region_len: self.len as u64,
            }),
        }
    }
}

impl Drop for SharedHostMemory {
    fn drop(&mut self) {
        if self.cuda_registered {
            if let Some(c) = &self.cuda_context {
                let _ = c.bind_to_thread();
            }
            // Failure policy: log; the unmap releases the pages either way.
            // SAFETY: registered by register_with_cuda and still mapped.
            if let Err(e) = unsafe { crate::cuda::result::host_unregister(self.ptr) } {
                tracing::warn!(error = %e, "cuMemHostUnregister failed");
            }
        }
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_file_see_each_other() {
        let a = SharedHostMemory::create(8192).unwrap();
        let b = SharedHostMemory::open(a.path(), a.len()).unwrap();
        a.write_at(100, b"shared").unwrap();
        let mut got = [0u8; 6];
        b.read_at(100, &mut got).unwrap();
        assert_eq!(&got, b"shared");
        b.write_at(0, &7u32.to_ne_bytes()).unwrap();
        assert_eq!(a.read_u32(0).unwrap(), 7);
        a.unlink().unwrap();
        assert!(!a.path().exists(), "unlinked, still mapped");
        assert_eq!(b.read_u32(0).unwrap(), 7);
        assert!(a.read_u32(2).is_err() && a.read_at(a.len(), &mut got).is_err());
    }

    #[test]
    fn bad_paths_and_sizes_are_refused() {
        assert!(SharedHostMemory::open(Path::new("/etc/passwd"), 4096).is_err());
        let a = SharedHostMemory::create(4096).unwrap();
        assert!(SharedHostMemory::open(a.path(), a.len() + 1).is_err());
        assert!(SharedHostMemory::create(0).is_err());
        let p = a.path().to_owned();
        drop(a);
        assert!(!p.exists(), "the creator removes its file");
    }
}

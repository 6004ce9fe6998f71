//! Host memory shared between processes of one host: a file on hugetlbfs (`/dev/hugepages`)
//! where the machine has one with free pages, else on tmpfs (`/dev/shm`), mapped by both and
//! registered with CUDA on each side. The staged path inside a host (the sender's GPU copies
//! into it, the receiver's GPU copies out) and the home of the in-host transports' flags.

use std::fs::File;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use memmap2::{MmapMut, MmapOptions};

use super::shm_name::{ShmDir, ShmName};
use super::{HUGE_PAGE, Pages, page_size};
use crate::error::{Error, Result};

/// A shared mapping of a file under `/dev/hugepages` or `/dev/shm`.
///
/// The file is created `O_EXCL` with mode 0600 in one of the two fixed directories, and a
/// peer's file is opened by a validated [`ShmName`] relative to that directory
/// (`openat`, `O_NOFOLLOW`), then checked with `fstat`: a regular file, owned by this user,
/// mode 0600, of the announced size. A peer never supplies a path.
pub struct SharedHostMemory {
    ptr: *mut u8,
    len: usize,
    name: ShmName,
    pages: Pages,
    owner: bool,
    // Held by every CPU access through `&self`: two threads of this process never race on the
    // bytes (the peer process and GPUs reach them outside Rust's view, never as slices).
    cpu: std::sync::Mutex<()>,
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

fn io_err(name: &ShmName, len: usize) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::AllocateHostMemory {
        len,
        source: std::io::Error::new(source.kind(), format!("{name}: {source}")),
    }
}

/// `openat(dir, name, flags, 0600)` with `O_NOFOLLOW | O_CLOEXEC` on a directory opened
/// `O_DIRECTORY | O_NOFOLLOW`: neither the directory nor the name may be a symbolic link.
fn open_in_dir(name: &ShmName, create: bool) -> std::io::Result<File> {
    let dir = std::ffi::CString::new(name.dir().path()).expect("no NUL");
    // SAFETY: a valid C string; the result is checked.
    let dfd = unsafe {
        libc::open(
            dir.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if dfd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: dfd is a fresh descriptor that nothing else owns.
    let dir = unsafe { OwnedFd::from_raw_fd(dfd) };
    let mut flags = libc::O_RDWR | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    if create {
        flags |= libc::O_CREAT | libc::O_EXCL;
    }
    let component = name.c_component();
    // SAFETY: dir is an open directory, component a valid C string of one path component.
    let fd = unsafe {
        libc::openat(
            std::os::fd::AsRawFd::as_raw_fd(&dir),
            component.as_ptr(),
            flags,
            0o600 as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// What `fstat` must show of a shared file: a regular file of this user, mode 0600, `len`
/// bytes long.
fn check_file(file: &File, name: &ShmName, len: usize) -> Result<()> {
    let bad = |reason: String| Error::InvalidArgument {
        reason: format!("{name}: {reason}"),
    };
    let m = file.metadata().map_err(io_err(name, len))?;
    if !m.file_type().is_file() {
        return Err(bad("not a regular file".into()));
    }
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(bad(format!(
            "owned by uid {}, not this user ({me})",
            m.uid()
        )));
    }
    if m.mode() & 0o7777 != 0o600 {
        return Err(bad(format!("mode {:o}, not 600", m.mode() & 0o7777)));
    }
    if m.len() != len as u64 {
        return Err(bad(format!("{} bytes, the peer said {len}", m.len())));
    }
    Ok(())
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
        let huge_len = len.next_multiple_of(HUGE_PAGE);
        let why_not = match Self::make(ShmName::fresh(ShmDir::HugePages), huge_len, Pages::Huge2M) {
            Ok(m) => return Ok(m),
            Err(e) => format!("no hugetlbfs file ({e})"),
        };
        super::host::log_base_pages_once(&why_not);
        Self::make(
            ShmName::fresh(ShmDir::Tmpfs),
            len.next_multiple_of(page_size()),
            Pages::Base(why_not),
        )
    }

    fn make(name: ShmName, len: usize, pages: Pages) -> Result<SharedHostMemory> {
        let file = open_in_dir(&name, true).map_err(io_err(&name, len))?;
        let mapped = file
            .set_len(len as u64)
            .map_err(io_err(&name, len))
            .and_then(|()| check_file(&file, &name, len))
            .and_then(|()| Self::map(&file, &name, len));
        match mapped {
            Ok(mut map) => {
                // Touch every page now: a hugetlbfs file without enough free pages fails here
                // (SIGBUS on first touch would be worse), and the peer finds the pages ready.
                // SAFETY: the mapping is len bytes of shared, writable memory.
                unsafe { std::ptr::write_bytes(map.as_mut_ptr(), 0, len) };
                Ok(SharedHostMemory {
                    ptr: map.as_mut_ptr(),
                    len,
                    name,
                    pages,
                    owner: true,
                    cpu: Default::default(),
                    cuda_registered: false,
                    cuda_context: None,
                    map,
                })
            }
            Err(e) => {
                let _ = std::fs::remove_file(name.path());
                Err(e)
            }
        }
    }

    fn map(file: &File, name: &ShmName, len: usize) -> Result<MmapMut> {
        // MAP_POPULATE on hugetlbfs reserves the pages up front (ENOMEM instead of a later SIGBUS).
        // SAFETY: the file is ours (created or opened for this job); concurrent access by the
        // peer process is the point, and happens only through raw copies and the GPU.
        unsafe { MmapOptions::new().len(len).populate().map_mut(file) }.map_err(io_err(name, len))
    }

    /// Opens a peer's shared file `name` (it must be exactly `len` bytes, this user's, mode
    /// 0600, a regular file).
    pub fn open(name: &ShmName, len: usize) -> Result<SharedHostMemory> {
        if len == 0 {
            return Err(Error::InvalidArgument {
                reason: format!("{name}: the peer announced zero bytes"),
            });
        }
        let file = open_in_dir(name, false).map_err(io_err(name, len))?;
        check_file(&file, name, len)?;
        let mut map = Self::map(&file, name, len)?;
        let pages = match name.dir() {
            ShmDir::HugePages => Pages::Huge2M,
            ShmDir::Tmpfs => Pages::Base("the peer's file is on tmpfs".into()),
        };
        Ok(SharedHostMemory {
            ptr: map.as_mut_ptr(),
            len,
            name: name.clone(),
            pages,
            owner: false,
            cpu: Default::default(),
            cuda_registered: false,
            cuda_context: None,
            map,
        })
    }

    /// Removes the file name once every peer has mapped it: the memory lives on in the mappings,
    /// and nothing is left behind if a process dies. Only the creator unlinks.
    pub fn unlink(&self) -> Result<()> {
        if self.owner {
            match std::fs::remove_file(self.name.path()) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_err(&self.name, self.len)(e)),
            }
        }
        Ok(())
    }

    /// The file's name (what the peer opens).
    pub fn name(&self) -> &ShmName {
        &self.name
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

    /// Registers the mapping with CUDA (portable, device-mapped) under `context` (the caller's
    /// GPU): GPU copies from and to it run at pinned speed and streams can read and write its
    /// words (flags).
    pub fn register_with_cuda(
        &mut self,
        context: &std::sync::Arc<cudarc::driver::CudaContext>,
    ) -> Result<()> {
        if !self.cuda_registered {
            crate::cuda::availability()?;
            context
                .bind_to_thread()
                .map_err(|e| crate::cuda::result::cuda_error("cuCtxSetCurrent", e))?;
            let context = context.clone();
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
        if !offset.is_multiple_of(4) {
            return Err(Error::InvalidArgument {
                reason: "flags are 4-byte aligned".into(),
            });
        }
        let _cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: in bounds and aligned; a volatile read sees writes by other agents.
        Ok(unsafe { std::ptr::read_volatile(self.ptr.add(offset).cast::<u32>()) })
    }

    /// Copies `dst.len()` bytes at `offset` out.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        let _cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
        // SAFETY: in bounds; dst is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Copies `src` in at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        self.check(offset, src.len())?;
        let _cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: in bounds; src is a distinct allocation.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Stores `new` into the 4-byte word at `offset` only if it holds `current`, atomically
    /// against every other agent's store (a GPU's, another process's); returns the value it
    /// held (the store happened if it equals `current`).
    pub fn compare_exchange_u32(&self, offset: usize, current: u32, new: u32) -> Result<u32> {
        self.check(offset, 4)?;
        if !offset.is_multiple_of(4) {
            return Err(Error::InvalidArgument {
                reason: "flags are 4-byte aligned".into(),
            });
        }
        let _cpu = self.cpu.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: in bounds and 4-byte aligned (checked above) in a live shared mapping that
        // outlives this call; every agent accesses the word as a whole u32, so viewing it as
        // an atomic for the duration of this call is sound.
        let word = unsafe { std::sync::atomic::AtomicU32::from_ptr(self.ptr.add(offset).cast()) };
        Ok(word
            .compare_exchange(
                current,
                new,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            )
            .unwrap_or_else(|held| held))
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
            let _ = std::fs::remove_file(self.name.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_file_see_each_other() {
        let a = SharedHostMemory::create(8192).unwrap();
        let b = SharedHostMemory::open(a.name(), a.len()).unwrap();
        a.write_at(100, b"shared").unwrap();
        let mut got = [0u8; 6];
        b.read_at(100, &mut got).unwrap();
        assert_eq!(&got, b"shared");
        b.write_at(0, &7u32.to_ne_bytes()).unwrap();
        assert_eq!(a.read_u32(0).unwrap(), 7);
        a.unlink().unwrap();
        assert!(!a.name().path().exists(), "unlinked, still mapped");
        assert_eq!(b.read_u32(0).unwrap(), 7);
        assert!(a.read_u32(2).is_err() && a.read_at(a.len(), &mut got).is_err());
    }

    /// What the stop word rests on: a value another agent stored (a GPU's latched timeout,
    /// here another mapping's) is never overwritten by a store-if-zero.
    #[test]
    fn compare_exchange_keeps_a_value_another_agent_stored() {
        let a = SharedHostMemory::create(4096).unwrap();
        let b = SharedHostMemory::open(a.name(), a.len()).unwrap();
        assert_eq!(a.compare_exchange_u32(64, 0, 1).unwrap(), 0, "stored");
        assert_eq!(b.read_u32(64).unwrap(), 1);
        b.write_at(128, &2u32.to_ne_bytes()).unwrap();
        assert_eq!(
            a.compare_exchange_u32(128, 0, 1).unwrap(),
            2,
            "kept the other's 2"
        );
        assert_eq!(b.read_u32(128).unwrap(), 2);
        assert!(
            a.compare_exchange_u32(2, 0, 1).is_err() && a.compare_exchange_u32(4096, 0, 1).is_err()
        );
    }

    #[test]
    fn files_are_created_private() {
        let a = SharedHostMemory::create(4096).unwrap();
        let m = std::fs::metadata(a.name().path()).unwrap();
        assert_eq!(m.mode() & 0o777, 0o600, "not readable by others");
    }

    #[test]
    fn bad_sizes_are_refused() {
        let a = SharedHostMemory::create(4096).unwrap();
        assert!(SharedHostMemory::open(a.name(), a.len() + 1).is_err());
        assert!(SharedHostMemory::open(a.name(), 0).is_err());
        assert!(SharedHostMemory::create(0).is_err());
        let p = a.name().path();
        drop(a);
        assert!(!p.exists(), "the creator removes its file");
    }

    fn planted() -> ShmName {
        ShmName::fresh(ShmDir::Tmpfs)
    }

    #[test]
    fn links_foreign_modes_and_wrong_files_are_refused() {
        // A symbolic link with a valid name pointing at a file the peer wants written.
        let target = tempfile::NamedTempFile::new().unwrap();
        target.as_file().set_len(4096).unwrap();
        let link = planted();
        std::os::unix::fs::symlink(target.path(), link.path()).unwrap();
        let r = SharedHostMemory::open(&link, 4096);
        let _ = std::fs::remove_file(link.path());
        assert!(r.is_err(), "a symbolic link is not followed");

        // A file readable by others (not one nodetour made).
        let loose = planted();
        std::fs::write(loose.path(), vec![0u8; 4096]).unwrap();
        std::fs::set_permissions(
            loose.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .unwrap();
        let r = SharedHostMemory::open(&loose, 4096);
        let _ = std::fs::remove_file(loose.path());
        match r {
            Err(Error::InvalidArgument { reason }) => assert!(reason.contains("mode"), "{reason}"),
            other => panic!("{:?}", other.err()),
        }

        // A directory of the right name.
        let dir = planted();
        std::fs::create_dir(dir.path()).unwrap();
        let r = SharedHostMemory::open(&dir, 4096);
        let _ = std::fs::remove_dir(dir.path());
        assert!(r.is_err(), "a directory is not a shared file");

        // A name that does not exist.
        assert!(SharedHostMemory::open(&planted(), 4096).is_err());
    }

    #[test]
    fn a_name_cannot_be_created_twice() {
        let a = SharedHostMemory::create(4096).unwrap();
        assert!(open_in_dir(a.name(), true).is_err(), "O_EXCL");
    }
}

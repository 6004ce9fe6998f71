//! The on-disk cache of compiled GPU kernels (CUBIN images), trusted only as far as it is safe:
//!
//! - the directory must be a real directory (not a symbolic link) owned by this user and not
//!   writable by group or others; nodetour creates it with mode 0700. Anything else is not used
//!   (the kernels are compiled and not cached), with the reason logged once;
//! - an entry's name is a SHA-256 of the kernel source, the compiler's and driver's versions and
//!   the architecture, so a change to any of them is a miss, never a stale image;
//! - an entry holds the SHA-256 of its image before the image; a short, altered or foreign
//!   entry is a miss (recompiled and rewritten), not an error;
//! - entries are written to a private temporary file (`O_EXCL`, mode 0600) and renamed in.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

const DIGEST: usize = 32;
const MAGIC: &[u8; 8] = b"NTCUBIN1";
/// Larger entries are not read (a CUBIN of every kernel is a few MiB).
const MAX_ENTRY: u64 = 256 << 20;

/// A cache directory that passed the ownership and permission checks.
#[derive(Debug, Clone)]
pub struct KernelCache {
    dir: PathBuf,
}

/// Where the cache lives by default: `$NODETOUR_CACHE_DIR`, else `$XDG_CACHE_HOME` or
/// `~/.cache`, then `nodetour/kernels`. `None` when no such place is set (or it is set empty).
pub fn default_dir() -> Option<PathBuf> {
    let env = crate::knobs::Env::process();
    if env.is_set("NODETOUR_CACHE_DIR") {
        return env.get("NODETOUR_CACHE_DIR").map(PathBuf::from);
    }
    env.foreign("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| env.foreign("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|c| c.join("nodetour").join("kernels"))
}

/// The entry name for a kernel `source` compiled by `compiler` for `arch` under `driver`.
pub fn entry_name(prefix: &str, source: &str, compiler: &str, driver: &str, arch: &str) -> String {
    let mut h = Sha256::new();
    for part in [source, compiler, driver, arch] {
        h.update((part.len() as u64).to_be_bytes());
        h.update(part.as_bytes());
    }
    format!("{prefix}-{arch}-{}.cubin", hex(&h.finalize()[..16]))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl KernelCache {
    /// Opens (creating with mode 0700 if missing) the cache at `dir`, or says why it is not
    /// safe to use.
    pub fn open(dir: &Path) -> Result<KernelCache, String> {
        if !dir.exists() {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        }
        let m = fs::symlink_metadata(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        if !m.file_type().is_dir() {
            return Err(format!(
                "{} is not a directory (a symbolic link is not followed)",
                dir.display()
            ));
        }
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if m.uid() != me {
            return Err(format!(
                "{} is owned by uid {}, not this user ({me})",
                dir.display(),
                m.uid()
            ));
        }
        if m.mode() & 0o022 != 0 {
            return Err(format!(
                "{} is writable by group or others (mode {:o})",
                dir.display(),
                m.mode() & 0o777
            ));
        }
        Ok(KernelCache {
            dir: dir.to_owned(),
        })
    }

    /// The path of entry `name`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The image stored under `name`, if it is there, intact, and an ELF image. What is wrong
    /// with an entry that is there but unusable comes back as `Err` (a miss to recompile).
    pub fn load(&self, name: &str) -> Result<Option<Vec<u8>>, String> {
        let path = self.path(name);
        let mut f = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let m = f.metadata().map_err(|e| e.to_string())?;
        // SAFETY: geteuid has no preconditions.
        if !m.file_type().is_file() || m.uid() != unsafe { libc::geteuid() } {
            return Err(format!(
                "{}: not a regular file of this user",
                path.display()
            ));
        }
        if m.len() > MAX_ENTRY {
            return Err(format!("{}: {} bytes", path.display(), m.len()));
        }
        let mut b = Vec::with_capacity(m.len() as usize);
        f.read_to_end(&mut b).map_err(|e| e.to_string())?;
        let header = MAGIC.len() + DIGEST;
        if b.len() <= header || &b[..MAGIC.len()] != MAGIC {
            return Err(format!("{}: not a nodetour cache entry", path.display()));
        }
        let image = b.split_off(header);
        if Sha256::digest(&image)[..] != b[MAGIC.len()..] {
            return Err(format!("{}: digest mismatch", path.display()));
        }
        if !image.starts_with(b"\x7fELF") {
            return Err(format!("{}: not an ELF image", path.display()));
        }
        Ok(Some(image))
    }

    /// Stores `image` under `name` (private temporary file, then renamed in).
    pub fn store(&self, name: &str, image: &[u8]) -> Result<(), String> {
        let path = self.path(name);
        let tmp = self.dir.join(format!(
            ".{name}.{}.{}",
            std::process::id(),
            hex(&crate::random::bytes::<4>())
        ));
        let write = || -> std::io::Result<()> {
            let mut f: File = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&Sha256::digest(image))?;
            f.write_all(image)?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            let _ = fs::remove_file(&tmp);
            format!("{}: {e}", path.display())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    const ELF: &[u8] = b"\x7fELF and the rest of a cubin";

    #[test]
    fn entries_round_trip_and_names_follow_every_input() {
        let d = tempfile::tempdir().unwrap();
        let dir = d.path().join("kernels");
        let c = KernelCache::open(&dir).unwrap();
        assert_eq!(
            fs::metadata(&dir).unwrap().mode() & 0o777,
            0o700,
            "created private"
        );
        let n = entry_name("reduce", "src", "nvrtc 12.8", "12080", "sm_90");
        assert_eq!(c.load(&n).unwrap(), None);
        c.store(&n, ELF).unwrap();
        assert_eq!(c.load(&n).unwrap().as_deref(), Some(ELF));
        assert_eq!(
            fs::metadata(c.path(&n)).unwrap().mode() & 0o777,
            0o600,
            "entries are private"
        );
        for other in [
            entry_name("reduce", "src2", "nvrtc 12.8", "12080", "sm_90"),
            entry_name("reduce", "src", "nvrtc 12.9", "12080", "sm_90"),
            entry_name("reduce", "src", "nvrtc 12.8", "12090", "sm_90"),
            entry_name("reduce", "src", "nvrtc 12.8", "12080", "sm_80"),
        ] {
            assert_ne!(other, n);
        }
    }

    #[test]
    fn altered_truncated_and_foreign_entries_are_misses() {
        let d = tempfile::tempdir().unwrap();
        let c = KernelCache::open(d.path()).unwrap();
        let n = entry_name("reduce", "s", "c", "d", "sm_90");
        c.store(&n, ELF).unwrap();
        let mut b = fs::read(c.path(&n)).unwrap();
        let last = b.len() - 1;
        b[last] ^= 1;
        fs::write(c.path(&n), &b).unwrap();
        assert!(c.load(&n).unwrap_err().contains("digest"));
        fs::write(c.path(&n), &b[..20]).unwrap();
        assert!(c.load(&n).is_err());
        fs::write(c.path(&n), ELF).unwrap();
        assert!(c.load(&n).is_err(), "a bare image without the digest");
        // A symbolic link planted under the entry's name is not followed.
        fs::remove_file(c.path(&n)).unwrap();
        let elsewhere = d.path().join("elsewhere");
        fs::write(&elsewhere, ELF).unwrap();
        std::os::unix::fs::symlink(&elsewhere, c.path(&n)).unwrap();
        assert!(c.load(&n).is_err());
        // Rewritten after a miss, it loads again.
        fs::remove_file(c.path(&n)).unwrap();
        c.store(&n, ELF).unwrap();
        assert_eq!(c.load(&n).unwrap().as_deref(), Some(ELF));
    }

    #[test]
    fn directories_others_can_write_or_links_are_not_used() {
        let d = tempfile::tempdir().unwrap();
        let open = d.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(KernelCache::open(&open).unwrap_err().contains("writable"));
        fs::set_permissions(&open, fs::Permissions::from_mode(0o775)).unwrap();
        assert!(KernelCache::open(&open).is_err(), "group-writable");
        let link = d.path().join("link");
        let private = d.path().join("private");
        fs::create_dir(&private).unwrap();
        std::os::unix::fs::symlink(&private, &link).unwrap();
        assert!(KernelCache::open(&link).unwrap_err().contains("symbolic"));
        let file = d.path().join("file");
        fs::write(&file, b"").unwrap();
        assert!(KernelCache::open(&file).is_err());
    }
}

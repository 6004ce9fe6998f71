//! nodetour's own look for the CUDA libraries, the same whichever way the program's cudarc
//! reaches them (loaded at run time, or linked by a runtime such as candle): cudarc's
//! `is_culib_present` and `culib` exist only when it loads at run time, and nodetour cannot see
//! another crate's features. Where the program links libcuda, the library is already in the
//! process and the look finds it; where cudarc loads it, the look answers before cudarc would
//! panic on a missing library.

use std::ffi::{CStr, CString, c_void};
use std::sync::OnceLock;

/// A shared library opened for the life of the process (never closed: its functions may be
/// called from anywhere until exit).
pub(crate) struct Library(*mut c_void);

// SAFETY: a dlopen handle is a process-wide token; dlsym on it is thread-safe.
unsafe impl Send for Library {}
// SAFETY: as above.
unsafe impl Sync for Library {}

impl Library {
    /// Opens the first of `names` that loads.
    fn open(names: &[&str]) -> Option<Library> {
        names.iter().find_map(|n| {
            let c = CString::new(*n).ok()?;
            // SAFETY: c is a valid C string; RTLD_NOW | RTLD_LOCAL has no other requirement.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            (!h.is_null()).then_some(Library(h))
        })
    }

    /// The address of `symbol`, if the library exports it.
    pub(crate) fn symbol(&self, symbol: &CStr) -> Option<*mut c_void> {
        // SAFETY: self.0 is a live handle (never closed) and symbol a valid C string.
        let p = unsafe { libc::dlsym(self.0, symbol.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// The names cudarc looks for (its `get_lib_name_candidates`, for the CUDA majors it binds).
fn candidates(lib: &str) -> Vec<String> {
    let mut v = vec![format!("lib{lib}.so")];
    v.extend(["13", "12", "11", "10", "9", "1"].map(|m| format!("lib{lib}.so.{m}")));
    v
}

/// libcuda (the driver), where this process can load it.
pub(crate) fn libcuda() -> Option<&'static Library> {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| Library::open(&["libcuda.so.1", "libcuda.so"]))
        .as_ref()
}

/// Whether libnvrtc (the runtime compiler) loads here.
pub(crate) fn nvrtc_present() -> bool {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        let names = candidates("nvrtc");
        Library::open(&names.iter().map(String::as_str).collect::<Vec<_>>())
    })
    .is_some()
}

/// Whether libnccl loads in this process. nodetour never uses NCCL; tools that compare
/// against it (through cudarc, which panics where the library is missing) look here first.
pub fn nccl_loadable() -> bool {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| Library::open(&["libnccl.so.2", "libnccl.so"]))
        .is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_that_is_not_there_is_none_and_libc_is_found() {
        assert!(Library::open(&["libnodetour-no-such-library.so"]).is_none());
        let c = Library::open(&["libc.so.6"]).expect("libc loads");
        assert!(c.symbol(c"strlen").is_some());
        assert!(c.symbol(c"nodetour_no_such_symbol").is_none());
        assert!(candidates("nvrtc").contains(&"libnvrtc.so.12".to_owned()));
    }
}

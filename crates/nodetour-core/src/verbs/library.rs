//! libibverbs, loaded at run time.
//!
//! nodetour links no RDMA library: `rdma-sys` supplies only the C types and the inline verbs
//! (which call through the provider's function table in `ibv_context`), and every exported
//! libibverbs function is resolved here with `dlopen`/`dlvsym`, by the symbol version rdma-core
//! exports it under (as NCCL does). A program that links nodetour therefore starts on machines
//! without libibverbs, and on rdma-core releases too old for a newer call; what is missing turns
//! into [`Error::Unsupported`] with the reason, at the first verbs call.
//!
//! The library is opened once per process and never closed: providers may keep threads and
//! static state, and verbs objects can outlive any scope we could tie a `dlclose` to.

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::sync::OnceLock;

use rdma_sys::{
    ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr, ibv_gid, ibv_mr, ibv_pd,
    ibv_port_attr, ibv_qp, ibv_qp_attr, ibv_qp_init_attr,
};

use crate::error::{Error, Result};

/// The file name asked of the dynamic loader (the SONAME of rdma-core's libibverbs).
pub const LIBIBVERBS_SONAME: &str = "libibverbs.so.1";

/// Environment variable naming another libibverbs to load (a path or a SONAME). Meant for
/// diagnosis and for tests that prove the library's absence is handled.
pub const LIBIBVERBS_ENV: &str = "NODETOUR_IBVERBS_LIBRARY";

/// The exported libibverbs functions nodetour calls, resolved from the loaded library.
///
/// Optional entries are `None` when the installed rdma-core predates them.
#[allow(missing_docs)] // each field is the C function of the same name
pub(crate) struct VerbsLibrary {
    pub get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    pub free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    pub get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    pub get_device_guid: unsafe extern "C" fn(*mut ibv_device) -> u64,
    pub open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    pub close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    pub query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    pub query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int,
    pub query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    pub dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    pub reg_mr_iova2:
        Option<unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, u64, u32) -> *mut ibv_mr>,
    pub reg_dmabuf_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
    pub dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    pub create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    pub destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    pub get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    pub ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, u32),
    pub create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    // The event is a `struct ibv_async_event`, read through our own layout (see result.rs).
    pub get_async_event: unsafe extern "C" fn(*mut ibv_context, *mut c_void) -> c_int,
    pub ack_async_event: unsafe extern "C" fn(*mut c_void),
}

// SAFETY: the table holds only function pointers into a library that is never unloaded; the
// functions themselves are thread-safe per the libibverbs documentation.
unsafe impl Send for VerbsLibrary {}
// SAFETY: as above; the table is immutable after loading.
unsafe impl Sync for VerbsLibrary {}

static LIBRARY: OnceLock<std::result::Result<VerbsLibrary, String>> = OnceLock::new();

/// The loaded library, loading it on first use. The outcome (success or the reason of the
/// failure) is cached for the life of the process.
pub(crate) fn library() -> Result<&'static VerbsLibrary> {
    LIBRARY
        .get_or_init(load)
        .as_ref()
        .map_err(|reason| Error::Unsupported {
            what: "RDMA verbs",
            reason: reason.clone(),
        })
}

/// Whether libibverbs could be loaded, and if not, why.
pub fn availability() -> std::result::Result<(), String> {
    LIBRARY
        .get_or_init(load)
        .as_ref()
        .map(|_| ())
        .map_err(Clone::clone)
}

/// Which optional entry points the installed rdma-core has.
pub fn optional_entry_points() -> Result<OptionalEntryPoints> {
    let lib = library()?;
    Ok(OptionalEntryPoints {
        reg_mr_iova2: lib.reg_mr_iova2.is_some(),
        reg_dmabuf_mr: lib.reg_dmabuf_mr.is_some(),
    })
}

/// Entry points that newer rdma-core releases add.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptionalEntryPoints {
    /// `ibv_reg_mr_iova2` (rdma-core 29, IBVERBS_1.8): registration with an IOVA and optional
    /// access flags such as relaxed ordering.
    pub reg_mr_iova2: bool,
    /// `ibv_reg_dmabuf_mr` (rdma-core 34, IBVERBS_1.12): registration of a dma-buf (GPU memory).
    pub reg_dmabuf_mr: bool,
}

fn load() -> std::result::Result<VerbsLibrary, String> {
    let name = crate::knobs::Env::process().get(LIBIBVERBS_ENV);
    load_named(name.as_deref().unwrap_or(LIBIBVERBS_SONAME))
}

/// Loads libibverbs from `name` (a path or a SONAME), uncached.
pub(crate) fn load_named(name: &str) -> std::result::Result<VerbsLibrary, String> {
    let name = name.to_owned();
    let cname =
        CString::new(name.clone()).map_err(|_| format!("{LIBIBVERBS_ENV} contains a NUL byte"))?;
    // SAFETY: dlopen with a valid NUL-terminated name; RTLD_NOW resolves everything up front so
    // a broken install fails here, not at some later call.
    let handle = unsafe { libc::dlopen(cname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return Err(format!(
            "cannot load {name}: {} (install rdma-core's libibverbs1 and ibverbs-providers)",
            dlerror_text()
        ));
    }
    let symbols = Symbols {
        handle,
        library: &name,
    };
    // SAFETY: (for every `get`/`optional` below) each symbol is transmuted to the function type
    // that rdma-core's <infiniband/verbs.h> declares for that name and symbol version.
    unsafe {
        Ok(VerbsLibrary {
            get_device_list: symbols.get("ibv_get_device_list", "IBVERBS_1.1")?,
            free_device_list: symbols.get("ibv_free_device_list", "IBVERBS_1.1")?,
            get_device_name: symbols.get("ibv_get_device_name", "IBVERBS_1.1")?,
            get_device_guid: symbols.get("ibv_get_device_guid", "IBVERBS_1.1")?,
            open_device: symbols.get("ibv_open_device", "IBVERBS_1.1")?,
            close_device: symbols.get("ibv_close_device", "IBVERBS_1.1")?,
            query_device: symbols.get("ibv_query_device", "IBVERBS_1.1")?,
            query_port: symbols.get("ibv_query_port", "IBVERBS_1.1")?,
            query_gid: symbols.get("ibv_query_gid", "IBVERBS_1.1")?,
            alloc_pd: symbols.get("ibv_alloc_pd", "IBVERBS_1.1")?,
            dealloc_pd: symbols.get("ibv_dealloc_pd", "IBVERBS_1.1")?,
            reg_mr: symbols.get("ibv_reg_mr", "IBVERBS_1.1")?,
            reg_mr_iova2: symbols.optional("ibv_reg_mr_iova2", "IBVERBS_1.8"),
            reg_dmabuf_mr: symbols.optional("ibv_reg_dmabuf_mr", "IBVERBS_1.12"),
            dereg_mr: symbols.get("ibv_dereg_mr", "IBVERBS_1.1")?,
            create_comp_channel: symbols.get("ibv_create_comp_channel", "IBVERBS_1.0")?,
            destroy_comp_channel: symbols.get("ibv_destroy_comp_channel", "IBVERBS_1.0")?,
            create_cq: symbols.get("ibv_create_cq", "IBVERBS_1.1")?,
            destroy_cq: symbols.get("ibv_destroy_cq", "IBVERBS_1.1")?,
            get_cq_event: symbols.get("ibv_get_cq_event", "IBVERBS_1.1")?,
            ack_cq_events: symbols.get("ibv_ack_cq_events", "IBVERBS_1.1")?,
            create_qp: symbols.get("ibv_create_qp", "IBVERBS_1.1")?,
            modify_qp: symbols.get("ibv_modify_qp", "IBVERBS_1.1")?,
            destroy_qp: symbols.get("ibv_destroy_qp", "IBVERBS_1.1")?,
            get_async_event: symbols.get("ibv_get_async_event", "IBVERBS_1.1")?,
            ack_async_event: symbols.get("ibv_ack_async_event", "IBVERBS_1.0")?,
        })
    }
}

struct Symbols<'a> {
    handle: *mut c_void,
    library: &'a str,
}

impl Symbols<'_> {
    /// Resolves `name` at `version`, then at the default version (libraries built without
    /// symbol versions, such as some distribution rebuilds).
    fn lookup(&self, name: &str, version: &str) -> *mut c_void {
        let cname = CString::new(name).expect("symbol names are literals without NUL");
        let cversion = CString::new(version).expect("versions are literals without NUL");
        // SAFETY: handle came from a successful dlopen and is never closed; names are valid C
        // strings.
        let versioned = unsafe { libc::dlvsym(self.handle, cname.as_ptr(), cversion.as_ptr()) };
        if !versioned.is_null() {
            return versioned;
        }
        // SAFETY: as above.
        unsafe { libc::dlsym(self.handle, cname.as_ptr()) }
    }

    /// # Safety
    /// `F` must be the function pointer type of the C symbol `name`.
    unsafe fn get<F: Copy>(&self, name: &str, version: &str) -> std::result::Result<F, String> {
        // SAFETY: forwarded to the caller.
        unsafe { self.optional(name, version) }.ok_or_else(|| {
            format!(
                "{} has no {name}@{version}: rdma-core is too old or damaged (need rdma-core 17 or newer)",
                self.library
            )
        })
    }

    /// # Safety
    /// `F` must be the function pointer type of the C symbol `name`.
    unsafe fn optional<F: Copy>(&self, name: &str, version: &str) -> Option<F> {
        assert_eq!(
            size_of::<F>(),
            size_of::<*mut c_void>(),
            "F must be a function pointer"
        );
        let ptr = self.lookup(name, version);
        if ptr.is_null() {
            None
        } else {
            // SAFETY: ptr is a non-null function address and F is a function pointer of the
            // same size whose signature the caller vouches for.
            Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&ptr) })
        }
    }
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns NULL or a valid C string owned by the loader.
    let msg = unsafe { libc::dlerror() };
    if msg.is_null() {
        "unknown dynamic loader error".to_owned()
    } else {
        // SAFETY: non-null, NUL-terminated, valid until the next dl* call on this thread.
        unsafe { CStr::from_ptr(msg) }
            .to_string_lossy()
            .into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_a_reason_not_a_crash() {
        let reason = load_named("/nonexistent/libibverbs.so.1")
            .err()
            .expect("must not load");
        assert!(
            reason.contains("cannot load /nonexistent/libibverbs.so.1"),
            "{reason}"
        );
        assert!(reason.contains("install rdma-core"), "{reason}");
    }

    #[test]
    fn a_library_without_verbs_symbols_is_too_old() {
        // libc is loadable but exports no ibv_* symbol: that is what an rdma-core too old for
        // a required call looks like.
        let reason = load_named("libc.so.6").err().expect("libc has no verbs");
        assert!(
            reason.contains("has no ibv_get_device_list@IBVERBS_1.1"),
            "{reason}"
        );
    }
}

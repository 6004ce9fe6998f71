//! The result layer: one thin fallible function per verbs call.
//!
//! Each function turns the C convention (NULL + errno, or a returned errno) into
//! `Result<_, io::Error>` and does nothing else; the safe types in the sibling modules add
//! ownership, context and hints. Every function first consults the [`inject`](super::inject)
//! seam, so tests can make any call fail without hardware.
//!
//! # Safety
//! All functions take raw verbs handles. Callers guarantee the handles are live (created by
//! the matching create call and not yet destroyed), and that pointed-to structures are valid for
//! the duration of the call.

use std::ffi::{c_int, c_void};
use std::io;
use std::ptr;

use rdma_sys::{
    ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr, ibv_gid, ibv_mr, ibv_pd,
    ibv_port_attr, ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_recv_wr, ibv_send_wr, ibv_wc,
};

use super::inject::{self, Call};
use super::library::{VerbsLibrary, library};
use crate::error::Result as CoreResult;

/// errno of the last failed call on this thread (defaulting to EIO when a library returned
/// failure without setting it).
fn last_errno() -> io::Error {
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(0) | None => io::Error::from_raw_os_error(libc::EIO),
        _ => e,
    }
}

fn injected(call: Call) -> io::Result<()> {
    inject::check(call).map_err(io::Error::from_raw_os_error)
}

fn nonnull<T>(p: *mut T) -> io::Result<*mut T> {
    if p.is_null() {
        Err(last_errno())
    } else {
        Ok(p)
    }
}

fn zero_ok(rc: c_int) -> io::Result<()> {
    // Verbs calls return 0, or an errno (positive; some providers return -errno or -1 and set
    // errno instead).
    match rc {
        0 => Ok(()),
        -1 => Err(last_errno()),
        rc => Err(io::Error::from_raw_os_error(rc.abs())),
    }
}

/// The loaded libibverbs (or `Unsupported`).
pub(crate) fn lib() -> CoreResult<&'static VerbsLibrary> {
    library()
}

/// `ibv_get_device_list`: the device array and its length. `Ok((null, 0))` never happens: no
/// devices gives an empty list or `Err(ENOSYS)` (no RDMA subsystem in the kernel).
pub(crate) unsafe fn get_device_list(
    lib: &VerbsLibrary,
) -> io::Result<(*mut *mut ibv_device, usize)> {
    injected(Call::GetDeviceList)?;
    let mut n: c_int = 0;
    // SAFETY: n is a valid out-pointer.
    let list = nonnull(unsafe { (lib.get_device_list)(&mut n) })?;
    Ok((list, n.max(0) as usize))
}

/// `ibv_free_device_list`.
pub(crate) unsafe fn free_device_list(lib: &VerbsLibrary, list: *mut *mut ibv_device) {
    // SAFETY: list came from get_device_list (caller's contract).
    unsafe { (lib.free_device_list)(list) }
}

/// `ibv_get_device_name`, copied out.
pub(crate) unsafe fn device_name(lib: &VerbsLibrary, dev: *mut ibv_device) -> String {
    // SAFETY: dev is live; the returned string lives as long as the device list.
    let p = unsafe { (lib.get_device_name)(dev) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null NUL-terminated string owned by libibverbs.
    unsafe { std::ffi::CStr::from_ptr(p) }
        .to_string_lossy()
        .into_owned()
}

/// `ibv_get_device_guid` (network byte order, as returned).
pub(crate) unsafe fn device_guid(lib: &VerbsLibrary, dev: *mut ibv_device) -> u64 {
    // SAFETY: dev is live.
    unsafe { (lib.get_device_guid)(dev) }
}

/// `ibv_open_device`.
pub(crate) unsafe fn open_device(
    lib: &VerbsLibrary,
    dev: *mut ibv_device,
) -> io::Result<*mut ibv_context> {
    injected(Call::OpenDevice)?;
    // SAFETY: dev is live.
    nonnull(unsafe { (lib.open_device)(dev) })
}

/// `ibv_close_device`.
pub(crate) unsafe fn close_device(lib: &VerbsLibrary, ctx: *mut ibv_context) -> io::Result<()> {
    // SAFETY: ctx is live and no child object remains (caller's contract).
    zero_ok(unsafe { (lib.close_device)(ctx) })
}

/// `ibv_query_device`.
pub(crate) unsafe fn query_device(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
) -> io::Result<ibv_device_attr> {
    // SAFETY: an all-zero ibv_device_attr is a valid value (integers and arrays).
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is live; attr is a valid out-pointer.
    zero_ok(unsafe { (lib.query_device)(ctx, &mut attr) })?;
    Ok(attr)
}

/// `ibv_query_port` (the exported, compatible form: it fills the fields every rdma-core
/// release has, the rest stay zero).
pub(crate) unsafe fn query_port(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
    port: u8,
) -> io::Result<ibv_port_attr> {
    injected(Call::QueryPort)?;
    // SAFETY: all-zero is a valid ibv_port_attr.
    let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: ctx is live; attr is a valid out-pointer at least as large as the compat struct.
    zero_ok(unsafe { (lib.query_port)(ctx, port, &mut attr) })?;
    Ok(attr)
}

/// `ibv_query_gid`.
pub(crate) unsafe fn query_gid(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
    port: u8,
    index: u32,
) -> io::Result<[u8; 16]> {
    let mut gid = ibv_gid { raw: [0; 16] };
    let index = c_int::try_from(index).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: ctx is live; gid is a valid out-pointer.
    zero_ok(unsafe { (lib.query_gid)(ctx, port, index, &mut gid) })?;
    // SAFETY: every bit pattern of the union is a valid [u8; 16].
    Ok(unsafe { gid.raw })
}

/// `ibv_alloc_pd`.
pub(crate) unsafe fn alloc_pd(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
) -> io::Result<*mut ibv_pd> {
    injected(Call::AllocPd)?;
    // SAFETY: ctx is live.
    nonnull(unsafe { (lib.alloc_pd)(ctx) })
}

/// `ibv_dealloc_pd`.
pub(crate) unsafe fn dealloc_pd(lib: &VerbsLibrary, pd: *mut ibv_pd) -> io::Result<()> {
    // SAFETY: pd is live and has no children (caller's contract).
    zero_ok(unsafe { (lib.dealloc_pd)(pd) })
}

/// `ibv_reg_mr_iova2` when the library has it, else `ibv_reg_mr` (then `iova` must equal the
/// address and optional access flags are not passed; the bool says which call ran).
pub(crate) unsafe fn reg_mr(
    lib: &VerbsLibrary,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    len: usize,
    iova: u64,
    access: u32,
    optional_access: u32,
) -> io::Result<(*mut ibv_mr, bool)> {
    injected(Call::RegMr)?;
    match lib.reg_mr_iova2 {
        // SAFETY: pd is live; [addr, addr+len) is mapped memory that outlives the MR.
        Some(f) => Ok((
            nonnull(unsafe { f(pd, addr, len, iova, access | optional_access) })?,
            true,
        )),
        None => {
            let access =
                c_int::try_from(access).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
            // SAFETY: as above.
            Ok((
                nonnull(unsafe { (lib.reg_mr)(pd, addr, len, access) })?,
                false,
            ))
        }
    }
}

/// `ibv_reg_dmabuf_mr`: `Err(EOPNOTSUPP)` when the library predates it.
pub(crate) unsafe fn reg_dmabuf_mr(
    lib: &VerbsLibrary,
    pd: *mut ibv_pd,
    offset: u64,
    len: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> io::Result<*mut ibv_mr> {
    injected(Call::RegDmabufMr)?;
    let f = lib
        .reg_dmabuf_mr
        .ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
    // SAFETY: pd is live; fd is a dma-buf (or any fd: the kernel validates it).
    nonnull(unsafe { f(pd, offset, len, iova, fd, access) })
}

/// `ibv_dereg_mr`.
pub(crate) unsafe fn dereg_mr(lib: &VerbsLibrary, mr: *mut ibv_mr) -> io::Result<()> {
    // SAFETY: mr is live and no posted work references it (caller's contract).
    zero_ok(unsafe { (lib.dereg_mr)(mr) })
}

/// `ibv_create_comp_channel`.
pub(crate) unsafe fn create_comp_channel(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
) -> io::Result<*mut ibv_comp_channel> {
    // SAFETY: ctx is live.
    nonnull(unsafe { (lib.create_comp_channel)(ctx) })
}

/// `ibv_destroy_comp_channel`.
pub(crate) unsafe fn destroy_comp_channel(
    lib: &VerbsLibrary,
    ch: *mut ibv_comp_channel,
) -> io::Result<()> {
    // SAFETY: ch is live and no CQ uses it any more.
    zero_ok(unsafe { (lib.destroy_comp_channel)(ch) })
}

/// `ibv_create_cq`.
pub(crate) unsafe fn create_cq(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
    entries: u32,
    channel: *mut ibv_comp_channel,
) -> io::Result<*mut ibv_cq> {
    injected(Call::CreateCq)?;
    let entries =
        c_int::try_from(entries).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: ctx is live; channel is live or null.
    nonnull(unsafe { (lib.create_cq)(ctx, entries, ptr::null_mut(), channel, 0) })
}

/// `ibv_destroy_cq`.
pub(crate) unsafe fn destroy_cq(lib: &VerbsLibrary, cq: *mut ibv_cq) -> io::Result<()> {
    // SAFETY: cq is live, no QP uses it, and all its events were acknowledged.
    zero_ok(unsafe { (lib.destroy_cq)(cq) })
}

/// `ibv_req_notify_cq` (inline in C: the provider's `req_notify_cq` op).
pub(crate) unsafe fn req_notify_cq(cq: *mut ibv_cq) -> io::Result<()> {
    // SAFETY: cq and its context are live.
    let op = unsafe { (*(*cq).context).ops.req_notify_cq };
    let op = op.ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
    // SAFETY: provider op called with its own CQ.
    zero_ok(unsafe { op(cq, 0) })
}

/// `ibv_get_cq_event`: blocks until an event is queued on the channel (callers `poll` first).
pub(crate) unsafe fn get_cq_event(
    lib: &VerbsLibrary,
    ch: *mut ibv_comp_channel,
) -> io::Result<*mut ibv_cq> {
    let mut cq: *mut ibv_cq = ptr::null_mut();
    let mut cq_ctx: *mut c_void = ptr::null_mut();
    // SAFETY: ch is live; out-pointers are valid.
    zero_ok(unsafe { (lib.get_cq_event)(ch, &mut cq, &mut cq_ctx) })?;
    Ok(cq)
}

/// `ibv_ack_cq_events`.
pub(crate) unsafe fn ack_cq_events(lib: &VerbsLibrary, cq: *mut ibv_cq, n: u32) {
    // SAFETY: cq is live; n events were received for it.
    unsafe { (lib.ack_cq_events)(cq, n) }
}

/// `struct ibv_async_event` as rdma-core lays it out: a union of pointers and an `int` port
/// number, then the event type. The type is read as a plain integer (rdma-sys's Rust enum
/// would be undefined behaviour for a value a newer kernel adds).
#[repr(C)]
struct RawAsyncEvent {
    element: usize,
    event_type: c_int,
}

/// `ibv_get_async_event` on a context whose event file is non-blocking, then
/// `ibv_ack_async_event`: the next event as (type, port, queue pair number), or `None` when
/// there is none (EAGAIN).
pub(crate) unsafe fn next_async_event(
    lib: &VerbsLibrary,
    ctx: *mut ibv_context,
) -> io::Result<Option<(u32, u8, u32)>> {
    let mut ev = RawAsyncEvent {
        element: 0,
        event_type: 0,
    };
    // SAFETY: ctx is live; ev has the layout of struct ibv_async_event.
    let rc = unsafe { (lib.get_async_event)(ctx, (&mut ev as *mut RawAsyncEvent).cast()) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) => Ok(None),
            _ => Err(e),
        };
    }
    let event_type = ev.event_type as u32;
    let port = if super::AsyncEvent::names_port(event_type) {
        // The union's int member: the low 32 bits of the element on little-endian targets.
        ev.element as u32 as u8
    } else {
        0
    };
    let qpn = if super::AsyncEvent::names_qp(event_type) && ev.element != 0 {
        // SAFETY: for queue pair events the element is the affected struct ibv_qp *, live
        // until the event is acknowledged below.
        unsafe { (*(ev.element as *mut ibv_qp)).qp_num }
    } else {
        0
    };
    // SAFETY: ev was returned by ibv_get_async_event and is acknowledged once.
    unsafe { (lib.ack_async_event)((&mut ev as *mut RawAsyncEvent).cast()) };
    Ok(Some((event_type, port, qpn)))
}

/// `ibv_poll_cq` (inline in C: the provider's `poll_cq` op). Returns how many entries of `wc`
/// were filled.
pub(crate) unsafe fn poll_cq(cq: *mut ibv_cq, wc: &mut [ibv_wc]) -> io::Result<usize> {
    injected(Call::PollCq)?;
    // SAFETY: cq and its context are live.
    let op = unsafe { (*(*cq).context).ops.poll_cq };
    let op = op.ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
    let n = c_int::try_from(wc.len()).unwrap_or(c_int::MAX);
    // SAFETY: wc has room for n entries.
    let got = unsafe { op(cq, n, wc.as_mut_ptr()) };
    if got < 0 {
        return Err(io::Error::from_raw_os_error(if got == -1 {
            libc::EIO
        } else {
            -got
        }));
    }
    let got = got as usize;
    if got > 0
        && let Some(status) = inject::take_completion_status()
    {
        wc[0].status = status;
    }
    Ok(got)
}

/// `ibv_create_qp`.
pub(crate) unsafe fn create_qp(
    lib: &VerbsLibrary,
    pd: *mut ibv_pd,
    attr: &mut ibv_qp_init_attr,
) -> io::Result<*mut ibv_qp> {
    injected(Call::CreateQp)?;
    // SAFETY: pd and the CQs named in attr are live.
    nonnull(unsafe { (lib.create_qp)(pd, attr) })
}

/// `ibv_modify_qp`.
pub(crate) unsafe fn modify_qp(
    lib: &VerbsLibrary,
    qp: *mut ibv_qp,
    attr: &mut ibv_qp_attr,
    mask: u32,
) -> io::Result<()> {
    injected(Call::ModifyQp)?;
    let mask = c_int::try_from(mask).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: qp is live; attr is valid.
    zero_ok(unsafe { (lib.modify_qp)(qp, attr, mask) })
}

/// `ibv_destroy_qp`.
pub(crate) unsafe fn destroy_qp(lib: &VerbsLibrary, qp: *mut ibv_qp) -> io::Result<()> {
    // SAFETY: qp is live.
    zero_ok(unsafe { (lib.destroy_qp)(qp) })
}

/// `ibv_post_send` (inline in C: the provider's `post_send` op).
pub(crate) unsafe fn post_send(qp: *mut ibv_qp, wr: &mut ibv_send_wr) -> io::Result<()> {
    injected(Call::PostSend)?;
    // SAFETY: qp and its context are live.
    let op = unsafe { (*(*qp).context).ops.post_send };
    let op = op.ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
    let mut bad: *mut ibv_send_wr = ptr::null_mut();
    // SAFETY: wr (and its sg_list) is valid for the call; memory it names is registered.
    zero_ok(unsafe { op(qp, wr, &mut bad) })
}

/// `ibv_post_recv` (inline in C: the provider's `post_recv` op).
pub(crate) unsafe fn post_recv(qp: *mut ibv_qp, wr: &mut ibv_recv_wr) -> io::Result<()> {
    injected(Call::PostRecv)?;
    // SAFETY: qp and its context are live.
    let op = unsafe { (*(*qp).context).ops.post_recv };
    let op = op.ok_or_else(|| io::Error::from_raw_os_error(libc::EOPNOTSUPP))?;
    let mut bad: *mut ibv_recv_wr = ptr::null_mut();
    // SAFETY: wr is valid for the call.
    zero_ok(unsafe { op(qp, wr, &mut bad) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn return_codes_map_to_errno() {
        assert!(zero_ok(0).is_ok());
        assert_eq!(
            zero_ok(libc::EINVAL).unwrap_err().raw_os_error(),
            Some(libc::EINVAL)
        );
        assert_eq!(
            zero_ok(-libc::ENOMEM).unwrap_err().raw_os_error(),
            Some(libc::ENOMEM)
        );
    }

    #[test]
    fn injected_faults_fire_once_per_arm() {
        inject::fail_next(Call::RegMr, libc::EFAULT);
        assert_eq!(
            injected(Call::RegMr).unwrap_err().raw_os_error(),
            Some(libc::EFAULT)
        );
        assert!(injected(Call::RegMr).is_ok());
        assert!(injected(Call::PostSend).is_ok());
    }
}

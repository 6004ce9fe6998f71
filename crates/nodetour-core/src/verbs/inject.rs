//! Fault injection into the result layer, so that every error branch above it runs in unit
//! tests without hardware.
//!
//! With the `fault-injection` feature (on in this crate's tests), a test arms a fault for one
//! C call on its own thread: the next call of that kind returns the errno (or, for
//! `ibv_poll_cq`, a work completion with the status) instead of reaching libibverbs. Without
//! the feature, `check` is an inline no-op and nothing here exists at run time.

/// The C calls whose failure can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Call {
    /// `ibv_get_device_list`.
    GetDeviceList,
    /// `ibv_open_device`.
    OpenDevice,
    /// `ibv_query_port`.
    QueryPort,
    /// `ibv_alloc_pd`.
    AllocPd,
    /// `ibv_reg_mr` / `ibv_reg_mr_iova2`.
    RegMr,
    /// `ibv_reg_dmabuf_mr`.
    RegDmabufMr,
    /// `ibv_create_cq`.
    CreateCq,
    /// `ibv_create_qp`.
    CreateQp,
    /// `ibv_modify_qp`.
    ModifyQp,
    /// `ibv_post_send`.
    PostSend,
    /// `ibv_post_recv`.
    PostRecv,
    /// `ibv_poll_cq` failing as a call.
    PollCq,
}

#[cfg(feature = "fault-injection")]
mod imp {
    use super::Call;
    use std::cell::RefCell;

    thread_local! {
        static ERRNOS: RefCell<Vec<(Call, i32)>> = const { RefCell::new(Vec::new()) };
        static WC_STATUS: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    }

    /// Makes the next `call` on this thread fail with `errno`.
    pub fn fail_next(call: Call, errno: i32) {
        ERRNOS.with(|f| f.borrow_mut().push((call, errno)));
    }

    /// Makes the next completion polled on this thread carry `status` (an `ibv_wc_status`).
    pub fn next_completion_status(status: u32) {
        WC_STATUS.with(|f| f.borrow_mut().push(status));
    }

    /// Forgets every armed fault of this thread.
    pub fn clear() {
        ERRNOS.with(|f| f.borrow_mut().clear());
        WC_STATUS.with(|f| f.borrow_mut().clear());
    }

    pub(crate) fn check(call: Call) -> Result<(), i32> {
        ERRNOS.with(|f| {
            let mut faults = f.borrow_mut();
            match faults.iter().position(|(c, _)| *c == call) {
                Some(i) => Err(faults.remove(i).1),
                None => Ok(()),
            }
        })
    }

    pub(crate) fn take_completion_status() -> Option<u32> {
        WC_STATUS.with(|f| {
            let mut s = f.borrow_mut();
            if s.is_empty() {
                None
            } else {
                Some(s.remove(0))
            }
        })
    }
}

#[cfg(feature = "fault-injection")]
pub use imp::{clear, fail_next, next_completion_status};

/// `Err(errno)` if a fault is armed for `call` on this thread.
#[inline(always)]
pub(crate) fn check(call: Call) -> Result<(), i32> {
    #[cfg(feature = "fault-injection")]
    {
        imp::check(call)
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        let _ = call;
        Ok(())
    }
}

/// An armed work-completion status for the next polled completion, if any.
#[inline(always)]
pub(crate) fn take_completion_status() -> Option<u32> {
    #[cfg(feature = "fault-injection")]
    {
        imp::take_completion_status()
    }
    #[cfg(not(feature = "fault-injection"))]
    {
        None
    }
}

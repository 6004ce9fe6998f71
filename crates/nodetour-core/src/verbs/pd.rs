//! Protection domains (`ibv_pd`): the scope within which regions and queue pairs may be used
//! together.

use std::sync::Arc;

use rdma_sys::ibv_pd;

use super::context::Context;
use super::result;
use crate::error::{Error, Result};

/// A protection domain. Memory regions and queue pairs hold an `Arc` to it.
pub struct ProtectionDomain {
    raw: *mut ibv_pd,
    // Dropped after `raw` is deallocated (in Drop::drop), so the device outlives the domain.
    context: Arc<Context>,
}

// SAFETY: ibv_pd is usable from any thread.
unsafe impl Send for ProtectionDomain {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for ProtectionDomain {}

impl ProtectionDomain {
    /// Allocates a protection domain on `context`'s device.
    pub fn new(context: &Arc<Context>) -> Result<Arc<ProtectionDomain>> {
        // SAFETY: the context is live (we hold an Arc).
        let raw = unsafe { result::alloc_pd(context.lib(), context.raw()) }.map_err(|source| {
            Error::AllocateProtectionDomain {
                device: context.name().to_owned(),
                source,
            }
        })?;
        Ok(Arc::new(ProtectionDomain {
            raw,
            context: context.clone(),
        }))
    }

    /// The device this domain belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.context
    }

    /// Asks the provider whether it can register dma-buf memory (GPU memory without
    /// nvidia-peermem), without any GPU: `ibv_reg_dmabuf_mr` with fd −1 fails with EBADF where
    /// dma-buf registration is implemented, and with EOPNOTSUPP/EPROTONOSUPPORT where it is not.
    pub fn probe_dmabuf(&self) -> DmabufSupport {
        // Access: LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ.
        // SAFETY: self.raw is live; fd −1 is never a valid descriptor, so nothing is registered.
        let r = unsafe { result::reg_dmabuf_mr(self.context.lib(), self.raw, 0, 4096, 0, -1, 7) };
        match r {
            Ok(mr) => {
                // Impossible with fd −1, but never leak a registration.
                // SAFETY: mr is live and unused.
                let _ = unsafe { result::dereg_mr(self.context.lib(), mr) };
                DmabufSupport::Supported
            }
            Err(e) => match e.raw_os_error() {
                Some(libc::EBADF) | Some(libc::EINVAL) => DmabufSupport::Supported,
                Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT) | Some(libc::ENOSYS) => {
                    DmabufSupport::Unsupported(if self.context.lib().reg_dmabuf_mr.is_none() {
                        "rdma-core lacks ibv_reg_dmabuf_mr (needs rdma-core 34 or newer)".into()
                    } else {
                        format!(
                            "{} refuses dma-buf registration ({e}): its provider or kernel driver lacks dma-buf support (needs Linux 5.12+ and a provider that implements it, such as mlx5)",
                            self.context.name()
                        )
                    })
                }
                _ => DmabufSupport::Unknown(format!("ibv_reg_dmabuf_mr(fd=-1) answered {e}")),
            },
        }
    }

    pub(crate) fn raw(&self) -> *mut ibv_pd {
        self.raw
    }
}

/// Whether a device can register dma-buf memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DmabufSupport {
    /// The provider implements dma-buf registration.
    Supported,
    /// It does not, and why.
    Unsupported(String),
    /// The probe's answer was unexpected.
    Unknown(String),
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        // Failure policy: EBUSY here means a child leaked; log and continue.
        // SAFETY: regions and queue pairs hold an Arc to self, so none is alive.
        if let Err(e) = unsafe { result::dealloc_pd(self.context.lib(), self.raw) } {
            tracing::warn!(device = %self.context.name(), error = %e, "ibv_dealloc_pd failed");
        }
    }
}

impl std::fmt::Debug for ProtectionDomain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProtectionDomain")
            .field("device", &self.context.name())
            .finish()
    }
}

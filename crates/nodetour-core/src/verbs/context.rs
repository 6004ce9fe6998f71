//! An opened RDMA device (`ibv_context`): the root every other verbs object hangs from.

use std::sync::Arc;

use rdma_sys::ibv_context;

use super::async_event::AsyncEvent;
use super::device::{self, DeviceChoice, DeviceInfo, Near};
use super::gid::{self, GidChoice};
use super::library::VerbsLibrary;
use super::port::{DeviceAttributes, PortAttributes, PortState};
use super::result;
use super::sysfs::SysfsRoot;
use crate::config::Config;
use crate::error::{Error, Result};

/// An open RDMA device. Children (protection domains, completion queues) hold an `Arc` to it,
/// so it is closed only after the last of them is gone.
pub struct Context {
    raw: *mut ibv_context,
    lib: &'static VerbsLibrary,
    info: DeviceInfo,
    attributes: DeviceAttributes,
    // Every asynchronous event read so far (the last 256), oldest first.
    events: std::sync::Mutex<Vec<AsyncEvent>>,
    // Whether the event file could be made non-blocking (else events are not read: a read
    // would block).
    watch_events: bool,
}

// SAFETY: an ibv_context may be used from any thread; libibverbs serialises internally where
// providers need it.
unsafe impl Send for Context {}
// SAFETY: as above; Context exposes no interior mutability of its own.
unsafe impl Sync for Context {}

impl Context {
    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Arc<Context>> {
        let devices = device::devices()?;
        let choice = device::choose_device(&devices, Some(name), Near::Host)?;
        Self::open_info(choice.device)
    }

    /// Opens the device the configuration and the memory's location call for
    /// (`NODETOUR_IB_DEVICE`, else the nearest NIC to a GPU, else the first active device), and
    /// says why it was chosen. Applies the configuration's spin time to every waiter.
    pub fn open_chosen(config: &Config, near: Near<'_>) -> Result<(Arc<Context>, DeviceChoice)> {
        super::set_spin(config.spin);
        let devices = device::devices()?;
        let choice = device::choose_device(&devices, config.ib_device.as_deref(), near)?;
        tracing::info!(device = %choice.device.name, reason = %choice.reason, "RDMA device chosen");
        Ok((Self::open_info(choice.device.clone())?, choice))
    }

    fn open_info(info: DeviceInfo) -> Result<Arc<Context>> {
        let lib = result::lib()?;
        // SAFETY: the list is live until freed below; the opened context keeps its own reference
        // to the device, so freeing the list after opening is allowed.
        let (list, n) = unsafe { result::get_device_list(lib) }.map_err(|e| Error::NoDevice {
            reason: format!("ibv_get_device_list failed: {e}"),
        })?;
        let mut opened = Err(Error::DeviceNotFound {
            name: info.name.clone(),
            available: "none".into(),
        });
        for i in 0..n {
            // SAFETY: i < n.
            let dev = unsafe { *list.add(i) };
            // SAFETY: dev is a live list entry.
            if unsafe { result::device_name(lib, dev) } == info.name {
                // SAFETY: as above.
                opened =
                    unsafe { result::open_device(lib, dev) }.map_err(|source| Error::OpenDevice {
                        device: info.name.clone(),
                        hint: open_hint(source.raw_os_error()),
                        source,
                    });
                break;
            }
        }
        // SAFETY: list came from get_device_list and no entry is used after this.
        unsafe { result::free_device_list(lib, list) };
        let raw = opened?;
        // SAFETY: raw is a live context we own.
        let attributes = match unsafe { result::query_device(lib, raw) } {
            Ok(a) => DeviceAttributes::from_raw(&a),
            Err(source) => {
                // SAFETY: raw is live and has no children.
                let _ = unsafe { result::close_device(lib, raw) };
                return Err(Error::QueryDevice {
                    device: info.name,
                    source,
                });
            }
        };
        // The event file is read without blocking, by whoever waits (see `check_async`).
        // SAFETY: raw is a live context; async_fd is its open event file.
        let fd = unsafe { (*raw).async_fd };
        // SAFETY: fcntl on a valid descriptor.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        let watch_events =
            flags >= 0 && unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } >= 0;
        if !watch_events {
            tracing::warn!(device = %info.name, "cannot make the asynchronous event file non-blocking; events will not be watched");
        }
        Ok(Arc::new(Context {
            raw,
            lib,
            info,
            attributes,
            events: std::sync::Mutex::new(Vec::new()),
            watch_events,
        }))
    }

    /// The file descriptor asynchronous events arrive on (for waiters' `poll`).
    pub(crate) fn async_fd(&self) -> std::os::fd::RawFd {
        if !self.watch_events {
            return -1; // poll ignores negative descriptors
        }
        // SAFETY: raw is live for &self.
        unsafe { (*self.raw).async_fd }
    }

    /// Reads the asynchronous events queued since the last read (port up/down, fatal errors),
    /// logs them, keeps them, and returns them.
    pub fn async_events(&self) -> Result<Vec<AsyncEvent>> {
        let mut new = Vec::new();
        if !self.watch_events {
            return Ok(new);
        }
        loop {
            // SAFETY: raw is live; its event file was made non-blocking at open.
            match unsafe { result::next_async_event(self.lib, self.raw) } {
                Ok(Some((t, port, qpn))) => new.push(AsyncEvent::classify(t, port, qpn)),
                Ok(None) => break,
                Err(source) => {
                    return Err(Error::WaitCompletionChannel { source });
                }
            }
        }
        for e in &new {
            tracing::warn!(device = %self.info.name, event = %e, hint = e.hint(), "RDMA asynchronous event");
        }
        let mut all = self.events.lock().unwrap_or_else(|p| p.into_inner());
        all.extend_from_slice(&new);
        let excess = all.len().saturating_sub(256);
        all.drain(..excess);
        Ok(new)
    }

    /// `Err(AsyncEvent)` if an event read so far (or now) ends the work of queue pair `qpn` on
    /// `port`: the device failed, the port is down, or the queue pair was killed.
    pub(crate) fn check_async(&self, port: u8, qpn: u32) -> Result<()> {
        self.async_events()?;
        let all = self.events.lock().unwrap_or_else(|p| p.into_inner());
        for (i, e) in all.iter().enumerate() {
            if e.is_fatal_for(port, qpn, &all[i + 1..]) {
                return Err(Error::AsyncEvent {
                    device: self.info.name.clone(),
                    event: *e,
                    hint: e.hint(),
                });
            }
        }
        Ok(())
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// What was known of the device when it was opened.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Limits and identity of the device.
    pub fn attributes(&self) -> &DeviceAttributes {
        &self.attributes
    }

    /// Attributes of `port` (1-based).
    pub fn port(&self, port: u8) -> Result<PortAttributes> {
        if port == 0 || port > self.attributes.ports {
            return Err(Error::PortOutOfRange {
                device: self.info.name.clone(),
                port,
                ports: self.attributes.ports,
            });
        }
        // SAFETY: self.raw is live for &self.
        let raw = unsafe { result::query_port(self.lib, self.raw, port) }.map_err(|source| {
            Error::QueryPort {
                device: self.info.name.clone(),
                port,
                source,
            }
        })?;
        Ok(PortAttributes::from_raw(port, &raw))
    }

    /// Attributes of `port`, or `PortNotActive` if it cannot carry traffic.
    pub fn active_port(&self, port: u8) -> Result<PortAttributes> {
        let attr = self.port(port)?;
        if attr.state != PortState::Active {
            return Err(Error::PortNotActive {
                device: self.info.name.clone(),
                port,
                state: attr.state.name(),
            });
        }
        Ok(attr)
    }

    /// The first ACTIVE port.
    pub fn first_active_port(&self) -> Result<PortAttributes> {
        let mut last = None;
        for port in 1..=self.attributes.ports {
            match self.active_port(port) {
                Ok(p) => return Ok(p),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| Error::NoDevice {
            reason: format!("{} reports no ports", self.info.name),
        }))
    }

    /// Reads GID `index` of `port` through libibverbs.
    pub fn gid(&self, port: u8, index: u32) -> Result<[u8; 16]> {
        // SAFETY: self.raw is live.
        unsafe { result::query_gid(self.lib, self.raw, port, index) }.map_err(|source| {
            Error::QueryGid {
                device: self.info.name.clone(),
                port,
                index,
                source,
            }
        })
    }

    /// Chooses the GID `port` sends from (see [`gid::choose_gid`]); `override_index` is
    /// `NODETOUR_IB_GID_INDEX`.
    pub fn choose_gid(
        &self,
        port: &PortAttributes,
        override_index: Option<u32>,
    ) -> Result<GidChoice> {
        let table = SysfsRoot::default().gid_table(&self.info.name, port.port);
        let mut choice = gid::choose_gid(
            &self.info.name,
            port.port,
            port.link_layer,
            &table,
            port.gid_table_len,
            override_index,
        )?;
        // The kernel's answer is authoritative for the bytes; sysfs only guided the choice.
        choice.gid = self.gid(port.port, choice.index)?;
        Ok(choice)
    }

    pub(crate) fn raw(&self) -> *mut ibv_context {
        self.raw
    }

    pub(crate) fn lib(&self) -> &'static VerbsLibrary {
        self.lib
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // Failure policy: closing can only fail if children leaked (a bug elsewhere); log it and
        // go on, since panicking in drop would abort a process that may be unwinding.
        // SAFETY: every child holds an Arc<Context>, so none is alive when this runs.
        if let Err(e) = unsafe { result::close_device(self.lib, self.raw) } {
            tracing::warn!(device = %self.info.name, error = %e, "ibv_close_device failed");
        }
    }
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("device", &self.info.name)
            .finish_non_exhaustive()
    }
}

fn open_hint(errno: Option<i32>) -> &'static str {
    match errno {
        Some(libc::EACCES) | Some(libc::EPERM) => {
            "no permission on /dev/infiniband/uverbs*: run with access to it (containers: --device=/dev/infiniband)"
        }
        Some(libc::ENOENT) | Some(libc::ENODEV) => {
            "the uverbs device node is missing (containers: --device=/dev/infiniband)"
        }
        Some(libc::ENOMEM) => "out of memory, or the memlock limit is too small (ulimit -l)",
        _ => "",
    }
}

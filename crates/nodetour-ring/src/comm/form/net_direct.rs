//! The direct path of a GPU ring's network links (issue 15): slots in GPU memory registered
//! with the RDMA device through the registration ladder (dma-buf, then nvidia-peermem), so that
//! the NIC writes the previous rank's chunks straight into this rank's GPU slots and reads the
//! chunks for the next rank straight out of its GPU send slots; and what makes a landed chunk
//! visible to the receive stream before it is released ([`nodetour_core::visibility`]).
//!
//! [`send_side`] and [`recv_side`] are pure: from the requested landing, the link's transport,
//! `NODETOUR_GDR` and the visibility decision, whether to run the ladder for that side, or why
//! not. [`register`] runs it. Whatever is refused is said in `paths()` with its reason, and the
//! link falls back to host slots (or host bounce slots, for `NODETOUR_NET_LANDING=gpu`); under
//! `NODETOUR_GDR=force` a refusal is an error instead.
//!
//! Not run here: no machine of this project has an RDMA NIC beside a GPU (soft-RoCE refuses
//! dma-buf and the VM has no GPU; the GPU machines have no RDMA device). The ladder itself runs
//! over soft-RoCE with a stand-in buffer (core's `verbs_rxe` tests), the GPU-slot stream code
//! runs on the GPU behind tcp links (`NODETOUR_NET_LANDING=gpu`), and the decisions are tested
//! here on fixtures.

use std::sync::Arc;

use nodetour_core::memory::DeviceBuffer;
use nodetour_core::registration::{self, GdrMode, Probe, Registration, Rung};
use nodetour_core::transport::read_flush::ReadFlush;
use nodetour_core::transport::{SlotRegion, TransportKind};
use nodetour_core::verbs::{Access, LocalSide, MemoryRegion};
use nodetour_core::visibility::{self, Flush, FlushMethod};

use super::table::Why;
use crate::comm::gpu_options::NetLanding;
use crate::error::{Error, Result};
use crate::flag;
use crate::net_link::{Lander, WordPage};

/// Whether the send side of a network link may try the ladder for GPU send slots, or why not.
/// Pure.
pub(crate) fn send_side(
    landing: NetLanding,
    kind: TransportKind,
    mode: GdrMode,
) -> std::result::Result<(), Why> {
    common(landing, kind, mode)
}

/// Whether the receive side of a network link may try the ladder for GPU receive slots (with
/// the flush that will make each landed chunk visible), or why not. Pure.
pub(crate) fn recv_side(
    landing: NetLanding,
    kind: TransportKind,
    mode: GdrMode,
    flush: &std::result::Result<Flush, Why>,
) -> std::result::Result<Flush, Why> {
    common(landing, kind, mode)?;
    flush.clone()
}

fn common(landing: NetLanding, kind: TransportKind, mode: GdrMode) -> std::result::Result<(), Why> {
    if kind != TransportKind::Verbs {
        return Err(Why::CpuCarries(kind));
    }
    if landing == NetLanding::Host {
        return Err(Why::LandingHost);
    }
    if mode == GdrMode::Off {
        return Err(Why::GdrOff);
    }
    Ok(())
}

/// What the ladder decides on for this rank's GPU, gathered once per formation.
pub(crate) struct Ladder {
    /// The probe (the GPU's attributes, the RDMA device, dma-buf and peermem support).
    pub probe: Probe,
    /// `NODETOUR_GDR`.
    pub mode: GdrMode,
    /// The visibility decision for chunks landing in this GPU's memory.
    pub flush: std::result::Result<Flush, Why>,
}

impl Ladder {
    /// Probes `context`'s GPU and `local`'s RDMA device, under the job's `NODETOUR_GDR` and
    /// `NODETOUR_GDR_FLUSH`.
    pub(crate) fn gather(
        context: &Arc<cudarc::driver::CudaContext>,
        local: &LocalSide,
        config: &nodetour_core::Config,
    ) -> Result<Ladder> {
        let (mode, over) = (config.gdr, config.gdr_flush);
        let info = nodetour_core::cuda::gpus()
            .map_err(|e| e.to_string())
            .and_then(|g| {
                g.into_iter()
                    .find(|i| i.ordinal == context.ordinal())
                    .ok_or_else(|| format!("CUDA lists no GPU {}", context.ordinal()))
            });
        let flush = match &info {
            Ok(i) => visibility::decide(&i.gdr, i.compute_capability, over)
                .map_err(|e| Why::NoVisibility(e.to_string())),
            Err(why) => Err(Why::NoVisibility(why.clone())),
        };
        let probe = Probe::gather(info.map(|i| i.gdr), Ok(&local.pd));
        Ok(Ladder { probe, mode, flush })
    }
}

/// GPU slots the NIC reaches: the region, how it was registered and what the ladder said.
#[derive(Clone)]
pub(crate) struct DirectSlots {
    /// The slots, as a region the link writes from or grants.
    pub slots: SlotRegion,
    /// Their registration (for the flush by read's second one).
    pub region: Arc<MemoryRegion<DeviceBuffer>>,
    /// The rung that registered them.
    pub rung: Rung,
    /// The ladder's account (for `paths()`).
    pub said: String,
}

/// Allocates `len` bytes of GPU slots on `context` and runs the ladder for them with `access`:
/// the registered slots (the direct path), or why the slots stay in host memory. Under
/// `NODETOUR_GDR=force` ending on staging is an error carrying every reason.
pub(crate) fn register(
    ladder: &Ladder,
    local: &LocalSide,
    context: &Arc<cudarc::driver::CudaContext>,
    len: usize,
    access: Access,
) -> Result<std::result::Result<DirectSlots, Why>> {
    let buffer = DeviceBuffer::new(context, len.max(4096))?;
    match registration::register_gpu(&local.pd, buffer, &ladder.probe, ladder.mode, access)? {
        outcome @ Registration::Direct { .. } => {
            let said = outcome.describe();
            let Registration::Direct { region, rung, .. } = outcome else {
                unreachable!("matched above")
            };
            let region = Arc::new(region);
            Ok(Ok(DirectSlots {
                slots: SlotRegion::device(region.clone()),
                region,
                rung,
                said,
            }))
        }
        outcome @ Registration::Staged { .. } => Ok(Err(Why::LadderStaged(outcome.describe()))),
    }
}

/// Under `NODETOUR_GDR=force`, a side that cannot take the direct path fails the formation.
pub(crate) fn forced(mode: GdrMode, side: &str, why: &Why) -> Result<()> {
    if mode == GdrMode::Force {
        return Err(Error::Unsupported {
            reason: format!("NODETOUR_GDR=force, but {side} cannot take the direct path: {why}"),
        });
    }
    Ok(())
}

/// Releases chunks the NIC wrote into GPU slots: makes them visible first where the GPU needs
/// it (an RDMA read of the chunk on the flush's loopback queue pair, or
/// `cuFlushGPUDirectRDMAWrites`), then sets `ready` in this rank's page.
pub(crate) struct Reveal<F> {
    /// The flush of the chunk at (offset, length) in the slots, before its release.
    pub flush: F,
    /// This rank's page (where the receive stream waits).
    pub page: Arc<dyn WordPage>,
}

impl<F: FnMut(usize, usize) -> nodetour_core::Result<()> + Send> Lander for Reveal<F> {
    fn land(&mut self, offset: usize, len: usize, ready: u32) -> nodetour_core::Result<()> {
        (self.flush)(offset, len)?;
        self.page.store(flag::READY, ready)
    }
}

/// The lander of direct receive slots under `flush`: none where nothing needs flushing (the
/// thread stores `ready` itself), else a [`Reveal`] with the flush by read (its own protection
/// domain, registration and loopback queue pair) or by host call.
pub(crate) fn lander(
    flush: FlushMethod,
    direct: &DirectSlots,
    local: &LocalSide,
    config: &nodetour_core::Config,
    context: &Arc<cudarc::driver::CudaContext>,
    page: Arc<dyn WordPage>,
) -> Result<Option<Box<dyn Lander>>> {
    Ok(match flush {
        FlushMethod::None => None,
        FlushMethod::HostCall => {
            let ctx = context.clone();
            Some(Box::new(Reveal {
                flush: move |_: usize, _: usize| nodetour_core::cuda::flush_rdma_writes(&ctx),
                page,
            }))
        }
        FlushMethod::RdmaRead => {
            let mut read = ReadFlush::new(
                &local.context,
                &local.port,
                &local.gid,
                config,
                &direct.region,
                direct.rung,
                config.timeout,
            )?;
            Some(Box::new(Reveal {
                flush: move |offset: usize, len: usize| read.flush(offset, len),
                page,
            }))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_streams::HostPage;

    fn flush(method: FlushMethod) -> std::result::Result<Flush, Why> {
        Ok(Flush {
            method,
            reason: "fixture".into(),
        })
    }

    #[test]
    fn only_verbs_links_not_forced_to_host_try_the_ladder() {
        use NetLanding::*;
        let v = TransportKind::Verbs;
        assert!(send_side(Auto, v, GdrMode::Auto).is_ok());
        assert!(send_side(Gpu, v, GdrMode::Force).is_ok());
        let why = send_side(Auto, TransportKind::Tcp, GdrMode::Auto).unwrap_err();
        assert_eq!(why, Why::CpuCarries(TransportKind::Tcp));
        let said = why.to_string();
        assert!(said.contains("tcp") && said.contains("verbs"), "{said}");
        let host = send_side(Host, v, GdrMode::Auto).unwrap_err();
        assert_eq!(
            (&host, host.to_string().as_str()),
            (&Why::LandingHost, "NODETOUR_NET_LANDING=host")
        );
        let off = send_side(Gpu, v, GdrMode::Off).unwrap_err();
        assert_eq!(
            (&off, off.to_string().as_str()),
            (&Why::GdrOff, "NODETOUR_GDR=off")
        );
    }

    #[test]
    fn the_receive_side_needs_a_flush_it_can_do() {
        let v = TransportKind::Verbs;
        let ok = recv_side(
            NetLanding::Auto,
            v,
            GdrMode::Auto,
            &flush(FlushMethod::None),
        );
        assert_eq!(ok.unwrap().method, FlushMethod::None);
        let host = recv_side(
            NetLanding::Gpu,
            v,
            GdrMode::Auto,
            &flush(FlushMethod::HostCall),
        );
        assert_eq!(host.unwrap().method, FlushMethod::HostCall);
        let read = recv_side(
            NetLanding::Auto,
            v,
            GdrMode::Auto,
            &flush(FlushMethod::RdmaRead),
        );
        assert_eq!(read.unwrap().method, FlushMethod::RdmaRead);
        let no_gpu = Err(Why::NoVisibility("no GPU 3".into()));
        let no_gpu = recv_side(NetLanding::Auto, v, GdrMode::Auto, &no_gpu).unwrap_err();
        assert_eq!(no_gpu.to_string(), "no GPU 3");
        // The link's own refusals come first.
        let tcp = recv_side(
            NetLanding::Auto,
            TransportKind::Tcp,
            GdrMode::Auto,
            &flush(FlushMethod::RdmaRead),
        );
        assert_eq!(tcp.unwrap_err(), Why::CpuCarries(TransportKind::Tcp));
    }

    #[test]
    fn force_turns_a_refusal_into_an_error() {
        let tcp = Why::CpuCarries(TransportKind::Tcp);
        assert!(forced(GdrMode::Auto, "the link to rank 1", &tcp).is_ok());
        let e = forced(GdrMode::Force, "the link to rank 1", &tcp).unwrap_err();
        assert!(e.to_string().contains("NODETOUR_GDR=force"), "{e}");
    }

    #[test]
    fn reveal_flushes_before_it_releases_and_a_failed_flush_releases_nothing() {
        let page = HostPage::new();
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = order.clone();
        let p = page.clone();
        let mut r = Reveal {
            flush: move |offset: usize, len: usize| {
                seen.lock()
                    .unwrap()
                    .push((offset, len, p.read(flag::READY).unwrap()));
                Ok(())
            },
            page: page.clone(),
        };
        r.land(0, 64, 1).unwrap();
        r.land(64, 64, 2).unwrap();
        assert_eq!(*order.lock().unwrap(), [(0, 64, 0), (64, 64, 1)]);
        assert_eq!(page.read(flag::READY).unwrap(), 2);
        let mut failing = Reveal {
            flush: |_: usize, _: usize| {
                Err(nodetour_core::Error::Unsupported {
                    what: "cuFlushGPUDirectRDMAWrites",
                    reason: "fixture".into(),
                })
            },
            page: page.clone(),
        };
        assert!(failing.land(128, 64, 3).is_err());
        assert_eq!(page.read(flag::READY).unwrap(), 2);
    }
}

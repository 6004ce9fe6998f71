//! `nodetour doctor`: for each GPU, whether the direct path (the NIC writing straight into GPU
//! memory) works on this machine, and if not, why and how to fix it.
//!
//! It gathers the facts (operating system, RDMA devices and their dma-buf support, GPUs and their
//! GPUDirect attributes, PCIe topology and ACS, peermem, limits), asks the pure verdict of
//! `nodetour_core::probe`, and runs live checks where the hardware allows: the staged path's copy
//! bandwidth, peer access between local GPUs, and for every GPU whose verdict is "direct" a
//! loopback RDMA write into its memory, read back (ACS and IOMMU problems show only on the data
//! path; a failure turns the verdict to staged with the reason).
//!
//! Exit status: 0 when every GPU has the direct path, 3 when some GPU stages, 2 when there is no
//! usable GPU. `--json` prints the same as one JSON document (schema in docs/doctor.md).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaContext;
use nodetour_core::cuda::{self, GpuStream, enable_peer_access};
use nodetour_core::knobs::Env;
use nodetour_core::memory::{DeviceBuffer, HostBuffer};
use nodetour_core::probe::{
    self, AcsState, Distance, Facts, GpuFacts, NicFacts, PciLevel, Problem, Verdict,
};
use nodetour_core::registration::{self, GdrMode, Probe, Registration};
use nodetour_core::verbs::{
    self, Access, Completion, Context, DmabufSupport, MemoryRegion, PathOptions, ProtectionDomain,
    QueuePair, QueuePairOptions,
};
use nodetour_core::{Config, Deadline, Error, Result};
use serde_json::{Value, json};

/// The doctor's findings.
pub struct Report {
    /// The facts the verdicts were made from.
    pub facts: Facts,
    /// The GPUs, or why there are none.
    pub gpus: std::result::Result<Vec<GpuFacts>, String>,
    /// Host-memory RDMA: the NIC it would use, and the problems that apply without a GPU.
    pub host: (Option<String>, Vec<Problem>),
    /// One verdict per GPU.
    pub verdicts: Vec<Verdict>,
    /// Live checks: (what, outcome).
    pub live: Vec<(String, String)>,
}

impl Report {
    /// 0: every GPU direct; 3: some GPU stages; 2: no usable GPU.
    pub fn exit_code(&self) -> u8 {
        match &self.gpus {
            Err(_) => 2,
            Ok(g) if g.is_empty() => 2,
            Ok(_) if self.verdicts.iter().all(Verdict::direct) => 0,
            Ok(_) => 3,
        }
    }
}

fn gdr_level() -> Result<PciLevel> {
    PciLevel::parse(Env::process().choice("NODETOUR_GDR_LEVEL")?)
}

fn topology() -> Result<Vec<(String, String, PciLevel)>> {
    match Env::process().get("NODETOUR_TOPOLOGY_FILE") {
        Some(path) => {
            let text = std::fs::read_to_string(&path).map_err(|source| Error::InvalidConfig {
                name: "NODETOUR_TOPOLOGY_FILE",
                value: path.clone(),
                reason: format!("cannot read it: {source}"),
            })?;
            probe::pci::parse_topology_file(&text)
        }
        _ => Ok(Vec::new()),
    }
}

fn nics(root: &Path) -> (std::result::Result<bool, String>, Vec<NicFacts>) {
    let verbs_state = match verbs::library::optional_entry_points() {
        Ok(e) => Ok(e.reg_dmabuf_mr),
        Err(e) => return (Err(e.to_string()), Vec::new()),
    };
    let providers = probe::system::verbs_providers(root);
    let sys = verbs::sysfs::SysfsRoot::default();
    let list = verbs::devices().unwrap_or_default();
    let nics = list
        .into_iter()
        .map(|d| {
            let dmabuf = match Context::open(&d.name).and_then(|c| ProtectionDomain::new(&c)) {
                Ok(pd) => pd.probe_dmabuf(),
                Err(e) => DmabufSupport::Unknown(e.to_string()),
            };
            NicFacts {
                link_layer: sys
                    .ports(&d.name)
                    .first()
                    .and_then(|p| sys.link_layer(&d.name, *p)),
                provider_installed: providers.contains(&probe::system::provider_for(&d.name)),
                name: d.name,
                pci_path: d.pci_path,
                numa: d.numa_node,
                active: d.active,
                dmabuf,
            }
        })
        .collect();
    (verbs_state, nics)
}

fn gpus(root: &Path) -> std::result::Result<Vec<GpuFacts>, String> {
    let list = cuda::gpus().map_err(|e| e.to_string())?;
    Ok(list
        .into_iter()
        .map(|g| {
            let dmabuf_export = CudaContext::new(g.ordinal)
                .map_err(|e| format!("{e:?}"))
                .and_then(|ctx| DeviceBuffer::new(&ctx, 64 << 10).map_err(|e| e.to_string()))
                .and_then(|b| b.export_dmabuf().map(|_| ()).map_err(|e| e.to_string()));
            GpuFacts {
                bar1_bytes: probe::system::pci_bar_bytes(root, &g.pci_bus_id, 1),
                pci_path: g.pci_path(),
                numa: probe::system::pci_numa_node(root, &g.pci_bus_id),
                ordinal: g.ordinal,
                name: g.name,
                bus_id: g.pci_bus_id,
                gdr: g.gdr,
                dmabuf_export,
            }
        })
        .collect())
}

fn acs(gpus: &[GpuFacts], nics: &[NicFacts]) -> Vec<(std::path::PathBuf, AcsState)> {
    let mut seen = std::collections::BTreeMap::new();
    let paths = gpus
        .iter()
        .filter_map(|g| g.pci_path.clone())
        .chain(nics.iter().filter_map(|n| n.pci_path.clone()));
    for p in paths {
        for bridge in probe::system::bridges_above(&p) {
            seen.entry(bridge.clone()).or_insert_with(|| {
                match std::fs::read(bridge.join("config")) {
                    Ok(c) => probe::pci::acs_state(&c),
                    Err(_) => AcsState::Unreadable,
                }
            });
        }
    }
    seen.into_iter().collect()
}

/// Gathers everything and decides; `live` runs the live checks.
pub fn examine(config: &Config, live: bool) -> Result<Report> {
    let root = Path::new("/");
    let (verbs_state, nic_list) = nics(root);
    let gpu_list = gpus(root);
    let facts = Facts {
        system: probe::read_system(root),
        memlock: probe::system::memlock_limit(),
        ipc_lock: probe::system::has_ipc_lock(),
        job_token: Env::process().get("NODETOUR_JOB_TOKEN").is_some(),
        peermem: registration::peermem_state(root),
        verbs: verbs_state,
        acs: acs(gpu_list.as_deref().unwrap_or(&[]), &nic_list),
        nics: nic_list,
        gdr_level: gdr_level()?,
        topology: topology()?,
    };
    let mut verdicts: Vec<Verdict> = gpu_list
        .as_deref()
        .unwrap_or(&[])
        .iter()
        .map(|g| probe::verdict(g, &facts))
        .collect();
    let mut checks = Vec::new();
    if live && let Ok(list) = &gpu_list {
        live_checks(config, list, &mut verdicts, &mut checks);
    }
    let host = probe::verdict::host_verdict(&facts);
    Ok(Report {
        facts,
        gpus: gpu_list,
        host,
        verdicts,
        live: checks,
    })
}

fn live_checks(
    config: &Config,
    gpus: &[GpuFacts],
    verdicts: &mut [Verdict],
    out: &mut Vec<(String, String)>,
) {
    let contexts: Vec<Option<Arc<CudaContext>>> = gpus
        .iter()
        .map(|g| CudaContext::new(g.ordinal).ok())
        .collect();
    for (g, ctx) in gpus.iter().zip(&contexts) {
        let Some(ctx) = ctx else { continue };
        let what = format!(
            "GPU {} staged-path copies (64 MiB, hugepage host buffer registered with CUDA)",
            g.ordinal
        );
        out.push((
            what,
            staged_bandwidth(ctx).unwrap_or_else(|e| format!("failed: {e}")),
        ));
    }
    for (i, a) in contexts.iter().enumerate() {
        for (j, b) in contexts.iter().enumerate().skip(i + 1) {
            if let (Some(a), Some(b)) = (a, b) {
                let r = match enable_peer_access(a, b) {
                    Ok(true) => "yes".to_owned(),
                    Ok(false) => "no (the hardware does not allow it: the in-host path stages through host memory)".to_owned(),
                    Err(e) => format!("failed: {e}"),
                };
                out.push((format!("peer access GPU {i} -> GPU {j}"), r));
            }
        }
    }
    for v in verdicts.iter_mut().filter(|v| v.direct()) {
        let (Some(nic), Some(Some(ctx))) = (v.nic.clone(), contexts.get(v.gpu)) else {
            continue;
        };
        let what = format!(
            "loopback RDMA write into GPU {} memory through {nic}",
            v.gpu
        );
        match loopback_into_gpu(config, &nic, ctx, &gpus[v.gpu]) {
            Ok(msg) => out.push((what, msg)),
            Err(e) => {
                out.push((what, format!("FAILED: {e}")));
                v.problems.insert(0, Problem {
                    what: format!("registration works but data does not arrive in GPU memory: {e}"),
                    fix: "check ACS on the bridges between GPU and NIC (needs root) and boot with iommu=pt".into(),
                    blocking: true,
                });
                v.rung = None;
            }
        }
    }
}

fn staged_bandwidth(ctx: &Arc<CudaContext>) -> Result<String> {
    const LEN: usize = 64 << 20;
    let mut host = HostBuffer::new(LEN)?;
    host.register_with_cuda(ctx)?;
    let dev = DeviceBuffer::new(ctx, LEN)?;
    let mut best = (0f64, 0f64);
    for _ in 0..3 {
        let t = Instant::now();
        dev.copy_to_host(0, host.as_mut_slice())?;
        best.0 = best.0.max(LEN as f64 / t.elapsed().as_secs_f64() / 1e9);
        let t = Instant::now();
        dev.copy_from_host(0, host.as_slice())?;
        best.1 = best.1.max(LEN as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let _ = GpuStream::new(ctx)?;
    Ok(format!(
        "D2H {:.1} GB/s, H2D {:.1} GB/s (host pages: {:?})",
        best.0,
        best.1,
        host.pages()
    ))
}

/// Registers a GPU buffer on `nic` through the ladder, RDMA-writes a pattern into it from host
/// memory over a loopback queue pair pair, and reads it back through the GPU.
fn loopback_into_gpu(
    config: &Config,
    nic: &str,
    ctx: &Arc<CudaContext>,
    gpu: &GpuFacts,
) -> Result<String> {
    const LEN: usize = 1 << 20;
    let context = Context::open(nic)?;
    let port = context.first_active_port()?;
    let gid = context.choose_gid(&port, config.gid_index)?;
    let pd = ProtectionDomain::new(&context)?;
    let probe = Probe::gather(Ok(gpu.gdr.clone()), Ok(&pd));
    let region = match registration::register_gpu(
        &pd,
        DeviceBuffer::new(ctx, LEN)?,
        &probe,
        GdrMode::Force,
        Access::REMOTE,
    )? {
        Registration::Direct { region, .. } => Arc::new(region),
        Registration::Staged { .. } => unreachable!("force mode never stages"),
    };
    let src = Arc::new(MemoryRegion::register(
        &pd,
        HostBuffer::new(LEN)?,
        Access::LOCAL,
    )?);
    src.fill_with(0..LEN, |i| (i * 13 % 251) as u8)?;
    let options = QueuePairOptions {
        send_depth: 4,
        recv_depth: 2,
        max_inline: 0,
    };
    let (a, b) = (
        QueuePair::new(&pd, port.port, options)?,
        QueuePair::new(&pd, port.port, options)?,
    );
    b.post_receives(1)?;
    let path = PathOptions::new(port.port, &gid, config);
    a.connect(&b.endpoint(&gid), &path)?;
    b.connect(&a.endpoint(&gid), &path)?;
    a.post_write(&src, 0..LEN, &region.remote(), 0, Some(1), true)?;
    let deadline = Deadline::after(config.timeout);
    a.wait_idle(deadline)?;
    let mut done = Vec::new();
    while !done
        .iter()
        .any(|c| matches!(c, Completion::WriteWithImmediate { .. }))
    {
        b.wait(&mut done, deadline)?;
    }
    cuda::flush_rdma_writes(ctx)?;
    let mut back = vec![0u8; LEN];
    region.device_buffer().copy_to_host(0, &mut back)?;
    match back
        .iter()
        .enumerate()
        .position(|(i, x)| *x != (i * 13 % 251) as u8)
    {
        None => Ok(format!(
            "ok: {LEN} bytes written by the NIC into GPU memory and verified"
        )),
        Some(at) => Err(Error::PeerMismatch {
            reason: format!("byte {at} of {} differs after the write", region.len()),
        }),
    }
}

/// The report as text.
pub fn render_text(r: &Report) -> String {
    let f = &r.facts;
    let s = &f.system;
    let mut out = String::new();
    let mut line = |t: String| {
        out.push_str(&t);
        out.push('\n');
    };
    line("nodetour doctor".into());
    line(format!(
        "system: Linux {} | IOMMU {:?} ({} groups) | memlock {} | vm.max_map_count {} | container: {}",
        s.kernel,
        s.iommu,
        s.iommu_groups,
        f.memlock
            .map_or("unlimited".into(), |m| format!("{} KiB", m / 1024)),
        s.max_map_count.map_or("unknown".into(), |m| m.to_string()),
        s.container.as_deref().unwrap_or("no"),
    ));
    let huge: Vec<String> = s
        .hugepages
        .iter()
        .map(|h| format!("{} kB: {} free of {}", h.size_kib, h.free, h.total))
        .collect();
    line(format!(
        "hugepages: {}",
        if huge.is_empty() {
            "none".into()
        } else {
            huge.join(", ")
        }
    ));
    line(format!(
        "NVIDIA driver: {} | open kernel module: {} | peermem: {} | PeerMappingOverride: {}",
        s.nvidia_driver.as_deref().unwrap_or("not loaded"),
        s.nvidia_open_module
            .map_or("unknown".into(), |o| o.to_string()),
        if f.peermem.loaded {
            format!("loaded ({})", f.peermem.evidence)
        } else {
            "not loaded".into()
        },
        s.peer_mapping_override.as_deref().unwrap_or("not set"),
    ));
    let dev_ib: Vec<String> = s
        .infiniband_nodes
        .iter()
        .map(|(n, ok)| format!("{n}{}", if *ok { "" } else { " (no access)" }))
        .collect();
    line(format!(
        "rdma-core {}: {} | /dev/infiniband: {}",
        probe::system::rdma_core_version(Path::new("/"))
            .unwrap_or_else(|| "(version unknown)".into()),
        match &f.verbs {
            Ok(true) => "libibverbs loaded, ibv_reg_dmabuf_mr present".to_owned(),
            Ok(false) => "libibverbs loaded, no ibv_reg_dmabuf_mr (rdma-core < 34)".to_owned(),
            Err(e) => format!("unusable: {e}"),
        },
        if dev_ib.is_empty() {
            "missing".into()
        } else {
            dev_ib.join(", ")
        }
    ));
    if f.nics.is_empty() {
        line("RDMA devices: none".into());
    }
    for n in &f.nics {
        line(format!(
            "RDMA device {}: {} | link {} | pci {} | numa {} | provider {} | dma-buf: {}",
            n.name,
            match n.active {
                Some(true) => "ACTIVE",
                Some(false) => "no active port",
                None => "port state unknown",
            },
            n.link_layer.as_deref().unwrap_or("unknown"),
            n.pci_path
                .as_ref()
                .map_or("none (software device)".into(), |p| p.display().to_string()),
            n.numa.map_or("unknown".into(), |x| x.to_string()),
            if n.provider_installed {
                "installed"
            } else {
                "MISSING"
            },
            match &n.dmabuf {
                DmabufSupport::Supported => "supported".to_owned(),
                DmabufSupport::Unsupported(w) => format!("unsupported ({w})"),
                DmabufSupport::Unknown(w) => format!("unknown ({w})"),
            }
        ));
    }
    let (host_nic, host_problems) = &r.host;
    line(match host_nic {
        Some(n) if !host_problems.iter().any(|p| p.blocking) => {
            format!("host memory: RDMA via {n}")
        }
        Some(n) => format!("host memory: RDMA via {n} blocked"),
        None => "host memory: no RDMA (TCP only)".to_owned(),
    });
    for p in host_problems {
        line(format!(
            "  {} {}\n      fix: {}",
            if p.blocking { "✗" } else { "!" },
            p.what,
            p.fix
        ));
    }
    for (bridge, state) in &f.acs {
        line(format!("ACS at {}: {state:?}", bridge.display()));
    }
    match &r.gpus {
        Err(e) => line(format!("GPUs: none usable ({e})")),
        Ok(g) if g.is_empty() => line("GPUs: none".into()),
        Ok(g) => {
            for (gpu, v) in g.iter().zip(&r.verdicts) {
                line(format!(
                    "GPU {} ({} at {}, numa {}): {}",
                    gpu.ordinal,
                    gpu.name,
                    gpu.bus_id,
                    gpu.numa.map_or("?".into(), |n| n.to_string()),
                    v.headline()
                ));
                for p in &v.problems {
                    line(format!(
                        "  {} {}\n      fix: {}",
                        if p.blocking { "✗" } else { "!" },
                        p.what,
                        p.fix
                    ));
                }
            }
        }
    }
    for (what, outcome) in &r.live {
        line(format!("live: {what}: {outcome}"));
    }
    if r.verdicts.iter().any(Verdict::direct) {
        line(format!("note: {}", registration::NOT_VERIFIED));
    }
    out
}

/// The report as a JSON document (`schema` 1; see docs/doctor.md).
pub fn render_json(r: &Report) -> Value {
    let f = &r.facts;
    let s = &f.system;
    let problems = |v: &Verdict| -> Vec<Value> {
        v.problems
            .iter()
            .map(|p| json!({"what": p.what, "fix": p.fix, "blocking": p.blocking}))
            .collect()
    };
    json!({
        "schema": 1,
        "system": {
            "kernel": s.kernel,
            "iommu": format!("{:?}", s.iommu).to_lowercase(),
            "iommu_groups": s.iommu_groups,
            "hugepages": s.hugepages.iter().map(|h| json!({"size_kib": h.size_kib, "total": h.total, "free": h.free})).collect::<Vec<_>>(),
            "memlock_bytes": f.memlock,
            "max_map_count": s.max_map_count,
            "container": s.container,
            "infiniband_nodes": s.infiniband_nodes.iter().map(|(n, ok)| json!({"name": n, "accessible": ok})).collect::<Vec<_>>(),
            "nvidia_driver": s.nvidia_driver,
            "nvidia_open_module": s.nvidia_open_module,
            "peermem_loaded": f.peermem.loaded,
        },
        "rdma_core": match &f.verbs {
            Ok(d) => json!({"loaded": true, "reg_dmabuf_mr": d, "version": probe::system::rdma_core_version(Path::new("/"))}),
            Err(e) => json!({"loaded": false, "reason": e}),
        },
        "rdma_devices": f.nics.iter().map(|n| json!({
            "name": n.name,
            "active": n.active,
            "link_layer": n.link_layer,
            "pci_path": n.pci_path.as_ref().map(|p| p.display().to_string()),
            "numa_node": n.numa,
            "provider_installed": n.provider_installed,
            "dmabuf": match &n.dmabuf {
                DmabufSupport::Supported => json!({"supported": true}),
                DmabufSupport::Unsupported(w) => json!({"supported": false, "reason": w}),
                DmabufSupport::Unknown(w) => json!({"supported": null, "reason": w}),
            },
        })).collect::<Vec<_>>(),
        "gpus": match &r.gpus {
            Err(e) => json!({"error": e}),
            Ok(g) => Value::Array(g.iter().zip(&r.verdicts).map(|(gpu, v)| json!({
                "ordinal": gpu.ordinal,
                "name": gpu.name,
                "pci_bus_id": gpu.bus_id,
                "numa_node": gpu.numa,
                "bar1_bytes": gpu.bar1_bytes,
                "gpudirect": {
                    "rdma_supported": gpu.gdr.gpu_direct_rdma,
                    "flush_writes_options": gpu.gdr.flush_writes_options,
                    "writes_ordering": gpu.gdr.writes_ordering,
                    "dma_buf_supported": gpu.gdr.dma_buf,
                    "dma_buf_export": gpu.dmabuf_export.as_ref().err(),
                },
                "verdict": {
                    "direct": v.direct(),
                    "rung": v.rung.map(|r| r.to_string()),
                    "nic": v.nic,
                    "distance": match &v.distance {
                        Some(Distance::Known(l)) => json!(l.name()),
                        Some(Distance::Unknown(w)) => json!({"unknown": w}),
                        None => Value::Null,
                    },
                    "summary": v.headline(),
                    "problems": problems(v),
                },
            })).collect()),
        },
        "host_memory": {
            "nic": r.host.0,
            "problems": r.host.1.iter().map(|p| json!({"what": p.what, "fix": p.fix, "blocking": p.blocking})).collect::<Vec<_>>(),
        },
        "live_checks": r.live.iter().map(|(w, o)| json!({"check": w, "outcome": o})).collect::<Vec<_>>(),
        "exit_code": r.exit_code(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_doctor_runs_on_any_machine_and_its_json_is_stable() {
        let r = examine(&Config::default(), false).unwrap();
        let text = render_text(&r);
        assert!(text.starts_with("nodetour doctor\nsystem: Linux"), "{text}");
        let j = render_json(&r);
        assert_eq!(j["schema"], 1);
        for key in [
            "system",
            "rdma_core",
            "rdma_devices",
            "host_memory",
            "gpus",
            "live_checks",
            "exit_code",
        ] {
            assert!(j.get(key).is_some(), "missing {key}");
        }
        assert!([0, 2, 3].contains(&r.exit_code()));
    }
}

//! The `nodetour` command: inspect RDMA devices and measure the verbs path.
//!
//! Exit status: 0 success, 1 failure, 2 the machine lacks what the command needs (no
//! libibverbs, no RDMA device), with the reason on stderr.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use nodetour::write_bw::{self, WriteBwOptions};
use nodetour_core::verbs::{self, Context, library};
use nodetour_core::{Config, Error};

#[derive(Parser)]
#[command(
    name = "nodetour",
    version,
    about = "GPUDirect RDMA transport: devices, bandwidth, readiness"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List RDMA devices with their ports, link layer, MTU and the GID nodetour would use.
    Devices,
    /// RDMA WRITE bandwidth between two processes, measured like perftest's ib_write_bw.
    WriteBw {
        /// Listen for the client on this address (server side).
        #[arg(long, conflicts_with = "connect", required_unless_present = "connect")]
        listen: Option<String>,
        /// Connect to the server at this address and measure (client side).
        #[arg(long)]
        connect: Option<String>,
        /// Bytes per write.
        #[arg(long, short = 's', default_value_t = 65536)]
        size: usize,
        /// Number of writes.
        #[arg(long, short = 'n', default_value_t = 1000)]
        iters: u64,
        /// Writes in flight (send queue depth).
        #[arg(long, short = 't', default_value_t = 128)]
        tx_depth: u32,
        /// Skip the server-side data check.
        #[arg(long)]
        no_verify: bool,
    },
}

fn main() -> ExitCode {
    nodetour::logging::init();
    let cli = Cli::parse();
    let result = Config::from_env().and_then(|config| {
        tracing::debug!(settings = %config.describe(), "nodetour starting");
        match cli.command {
            Command::Devices => devices(&config),
            Command::WriteBw {
                listen,
                connect,
                size,
                iters,
                tx_depth,
                no_verify,
            } => {
                let opts = WriteBwOptions {
                    size,
                    iters,
                    tx_depth,
                    verify: !no_verify,
                };
                let report = match (listen, connect) {
                    (Some(addr), _) => write_bw::run_server(&config, &addr, opts)?,
                    (None, Some(addr)) => write_bw::run_client(&config, &addr, opts)?,
                    (None, None) => unreachable!("clap requires one of them"),
                };
                println!("{}", report.line());
                Ok(())
            }
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_unsupported() => {
            eprintln!("nodetour: {e}");
            ExitCode::from(2)
        }
        Err(e) => {
            eprintln!("nodetour: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn devices(config: &Config) -> Result<(), Error> {
    let list = verbs::devices()?;
    if list.is_empty() {
        return Err(Error::NoDevice {
            reason: "libibverbs lists no device (no RDMA NIC, no driver loaded, or /dev/infiniband not visible in this container)".into(),
        });
    }
    let entry = library::optional_entry_points()?;
    println!(
        "libibverbs: loaded; ibv_reg_mr_iova2 {}; ibv_reg_dmabuf_mr {}",
        if entry.reg_mr_iova2 {
            "present"
        } else {
            "missing"
        },
        if entry.reg_dmabuf_mr {
            "present"
        } else {
            "missing (rdma-core < 34)"
        }
    );
    for info in &list {
        println!(
            "{}: guid {:016x} pci {} numa {}",
            info.name,
            info.guid,
            info.pci_path
                .as_ref()
                .map_or("none (software device)".into(), |p| p.display().to_string()),
            info.numa_node.map_or("unknown".into(), |n| n.to_string())
        );
        let context = match Context::open(&info.name) {
            Ok(c) => c,
            Err(e) => {
                println!("  cannot open: {e}");
                continue;
            }
        };
        let a = context.attributes();
        println!(
            "  firmware {} vendor {:#x}:{:#x} ports {} max_qp_wr {} max_cqe {} max_mr_size {}",
            a.firmware,
            a.vendor_id,
            a.vendor_part_id,
            a.ports,
            a.max_qp_wr,
            a.max_cqe,
            a.max_mr_size
        );
        for port in 1..=a.ports {
            match context.port(port) {
                Ok(p) => {
                    let gid = context.choose_gid(&p, config.gid_index).map_or_else(
                        |e| format!("none ({e})"),
                        |g| format!("{} [{}]", g.index, g.reason),
                    );
                    println!(
                        "  port {}: {} {:?} mtu {} (max {}) lid {} rate {} gid {}",
                        port,
                        p.state.name(),
                        p.link_layer,
                        p.active_mtu.map_or(0, |m| m.bytes()),
                        p.max_mtu.map_or(0, |m| m.bytes()),
                        p.lid,
                        p.rate_gbps()
                            .map_or("unknown".into(), |r| format!("{r} Gb/s")),
                        gid
                    );
                }
                Err(e) => println!("  port {port}: {e}"),
            }
        }
        if let Ok(pd) = verbs::ProtectionDomain::new(&context) {
            println!("  dma-buf registration: {:?}", pd.probe_dmabuf());
        }
    }
    Ok(())
}

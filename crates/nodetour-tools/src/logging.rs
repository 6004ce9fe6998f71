//! Logging set-up shared by the command and the examples: `NODETOUR_LOG` is a `tracing`
//! filter (`info`, `nodetour_core=debug`, ...); the default shows warnings and the decisions
//! nodetour makes (device chosen, path taken, and why).

/// Installs a stderr logger filtered by `NODETOUR_LOG` (default `info`).
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NODETOUR_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

//! Which host, and which namespaces, a process lives in: "same host" is decided from the kernel's
//! boot id plus namespace ids, never from the hostname (containers share hostnames and hosts
//! share names across clusters). Transports still confirm by mapping the peer's memory.

use std::path::Path;

/// A process's host and namespaces.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`: unique per boot of a kernel.
    pub boot_id: String,
    /// Network namespace inode.
    pub net_ns: u64,
    /// IPC namespace inode (System V shared memory, CUDA IPC needs the same).
    pub ipc_ns: u64,
    /// Mount namespace inode (whether `/dev/shm` is the same).
    pub mnt_ns: u64,
}

impl HostIdentity {
    /// This process's identity, read under `root` ("/" on a live system). Unreadable parts read
    /// as empty/zero, which never compares equal to a real peer's.
    pub fn read(root: &Path) -> HostIdentity {
        let boot_id = std::fs::read_to_string(root.join("proc/sys/kernel/random/boot_id"))
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        let ns = |name: &str| {
            std::fs::read_link(root.join("proc/self/ns").join(name))
                .ok()
                .and_then(|l| {
                    let s = l.to_string_lossy().into_owned();
                    s.split('[').nth(1)?.trim_end_matches(']').parse().ok()
                })
                .unwrap_or(0)
        };
        HostIdentity {
            boot_id,
            net_ns: ns("net"),
            ipc_ns: ns("ipc"),
            mnt_ns: ns("mnt"),
        }
    }

    /// The identity of this process: as read from the kernel, or, with `NODETOUR_HOST_ID` set,
    /// a "host" of that name (one machine split into several hosts, to run the paths between
    /// hosts there: ranks with different names never count as one host; the namespaces are
    /// kept, so ranks of one name still share memory as before).
    pub fn current() -> HostIdentity {
        Self::with_override(
            Self::read(Path::new("/")),
            nodetour_core::knobs::Env::process()
                .get("NODETOUR_HOST_ID")
                .as_deref(),
        )
    }

    /// `read`'s identity under a `NODETOUR_HOST_ID` value (none or empty: unchanged).
    pub fn with_override(mut real: HostIdentity, host_id: Option<&str>) -> HostIdentity {
        if let Some(name) = host_id.map(str::trim).filter(|n| !n.is_empty()) {
            real.boot_id = format!("{}/host-id:{name}", real.boot_id);
        }
        real
    }

    /// Same kernel (same machine, same boot): GPU peer access and CUDA IPC may work.
    pub fn same_host(&self, other: &HostIdentity) -> bool {
        !self.boot_id.is_empty() && self.boot_id == other.boot_id
    }

    /// Same kernel and the same mount and IPC namespaces: shared memory under `/dev/shm` is the
    /// same for both.
    pub fn shares_memory(&self, other: &HostIdentity) -> bool {
        self.same_host(other)
            && self.mnt_ns == other.mnt_ns
            && self.ipc_ns == other.ipc_ns
            && self.mnt_ns != 0
    }
}

/// The local IP address this host uses to reach `host:port` (what peers should dial), found by
/// "connecting" a UDP socket (no packet is sent). Falls back to 127.0.0.1.
pub fn local_ip_towards(host: &str, port: u16) -> std::net::IpAddr {
    use std::net::{IpAddr, Ipv4Addr, ToSocketAddrs, UdpSocket};
    let fallback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let Some(target) = (host, port)
        .to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
    else {
        return fallback;
    };
    let bind = if target.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    UdpSocket::bind(bind)
        .and_then(|s| s.connect(target).and_then(|()| s.local_addr()))
        .map(|a| a.ip())
        .ok()
        .filter(|ip| !ip.is_unspecified())
        .unwrap_or(fallback)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_id_splits_one_machine_into_hosts() {
        let real = HostIdentity::read(Path::new("/"));
        let a = HostIdentity::with_override(real.clone(), Some("a"));
        let b = HostIdentity::with_override(real.clone(), Some("b"));
        let a2 = HostIdentity::with_override(real.clone(), Some(" a "));
        if !real.boot_id.is_empty() {
            assert!(!a.same_host(&b) && a.same_host(&a2) && !a.same_host(&real));
        }
        assert_eq!(HostIdentity::with_override(real.clone(), Some("")), real);
        assert_eq!(HostIdentity::with_override(real.clone(), None), real);
    }

    #[test]
    fn this_process_has_an_identity_and_matches_itself() {
        let me = HostIdentity::current();
        assert_eq!(me.boot_id.len(), 36, "{me:?}");
        assert!(me.net_ns != 0 && me.mnt_ns != 0);
        assert!(me.same_host(&me) && me.shares_memory(&me));
    }

    #[test]
    fn other_boots_and_namespaces_differ() {
        let me = HostIdentity::current();
        let other_boot = HostIdentity {
            boot_id: "00000000-0000-0000-0000-000000000000".into(),
            ..me.clone()
        };
        assert!(!me.same_host(&other_boot));
        let other_mnt = HostIdentity {
            mnt_ns: me.mnt_ns + 1,
            ..me.clone()
        };
        assert!(me.same_host(&other_mnt) && !me.shares_memory(&other_mnt));
        let unknown = HostIdentity::read(Path::new("/nonexistent"));
        assert!(
            !unknown.same_host(&unknown),
            "unreadable identities never match"
        );
    }
}

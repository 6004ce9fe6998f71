//! Port and device attributes as the device reports them (`ibv_query_port`,
//! `ibv_query_device`), in Rust types. Limits used elsewhere come from here, never from
//! constants tuned on one device.

use rdma_sys::{ibv_device_attr, ibv_port_attr};

use super::gid::LinkLayer;

/// Path MTU of a RoCE/InfiniBand link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mtu {
    /// 256 bytes.
    Mtu256 = 1,
    /// 512 bytes.
    Mtu512 = 2,
    /// 1024 bytes.
    Mtu1024 = 3,
    /// 2048 bytes.
    Mtu2048 = 4,
    /// 4096 bytes.
    Mtu4096 = 5,
}

impl Mtu {
    /// From the `ibv_mtu` code (1..=5).
    pub fn from_code(code: u32) -> Option<Mtu> {
        Some(match code {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            _ => return None,
        })
    }

    /// The `ibv_mtu` code.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// Bytes.
    pub fn bytes(self) -> u32 {
        128 << self.code()
    }
}

/// State of a port.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortState {
    /// Link down.
    Down,
    /// Link up, not yet configured by the subnet manager.
    Init,
    /// Configured, not yet forwarding.
    Armed,
    /// Carrying traffic.
    Active,
    /// Anything else the device reports.
    Other(u32),
}

impl PortState {
    fn from_code(code: u32) -> Self {
        match code {
            1 => PortState::Down,
            2 => PortState::Init,
            3 => PortState::Armed,
            4 => PortState::Active,
            c => PortState::Other(c),
        }
    }

    /// The state's name.
    pub fn name(self) -> String {
        match self {
            PortState::Down => "DOWN".into(),
            PortState::Init => "INIT".into(),
            PortState::Armed => "ARMED".into(),
            PortState::Active => "ACTIVE".into(),
            PortState::Other(c) => format!("state {c}"),
        }
    }
}

/// What `ibv_query_port` says of a port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortAttributes {
    /// Port number (1-based).
    pub port: u8,
    /// Link state.
    pub state: PortState,
    /// The MTU the link runs at (`None` if the code is unknown).
    pub active_mtu: Option<Mtu>,
    /// The largest MTU the port supports.
    pub max_mtu: Option<Mtu>,
    /// Local identifier (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// InfiniBand or Ethernet.
    pub link_layer: LinkLayer,
    /// Size of the GID table.
    pub gid_table_len: u32,
    /// Largest message the port can carry.
    pub max_message_size: u32,
    /// `active_speed` code.
    pub active_speed: u8,
    /// `active_width` code.
    pub active_width: u8,
}

impl PortAttributes {
    pub(crate) fn from_raw(port: u8, a: &ibv_port_attr) -> Self {
        PortAttributes {
            port,
            state: PortState::from_code(a.state),
            active_mtu: Mtu::from_code(a.active_mtu),
            max_mtu: Mtu::from_code(a.max_mtu),
            lid: a.lid,
            // IBV_LINK_LAYER_ETHERNET is 2; UNSPECIFIED (0) and INFINIBAND (1) are InfiniBand.
            link_layer: if a.link_layer == 2 {
                LinkLayer::Ethernet
            } else {
                LinkLayer::InfiniBand
            },
            gid_table_len: a.gid_tbl_len.max(0) as u32,
            max_message_size: a.max_msg_sz,
            active_speed: a.active_speed,
            active_width: a.active_width,
        }
    }

    /// Link rate in Gbit/s from the width and speed codes, if both are known.
    pub fn rate_gbps(&self) -> Option<f64> {
        let lanes = match self.active_width {
            1 => 1.0,
            2 => 4.0,
            4 => 8.0,
            8 => 12.0,
            16 => 2.0,
            _ => return None,
        };
        let per_lane = match self.active_speed {
            1 => 2.5,
            2 => 5.0,
            4 | 8 => 10.0,
            16 => 14.0625,
            32 => 25.78125,
            64 => 53.125,
            128 => 106.25,
            _ => return None,
        };
        Some(lanes * per_lane)
    }
}

/// What `ibv_query_device` says of a device: the limits nodetour sizes its queues by.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceAttributes {
    /// Firmware version string.
    pub firmware: String,
    /// PCI vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Largest registrable region.
    pub max_mr_size: u64,
    /// Most work requests per queue.
    pub max_qp_wr: u32,
    /// Most scatter/gather entries per work request.
    pub max_sge: u32,
    /// Most entries per completion queue.
    pub max_cqe: u32,
    /// Most outstanding RDMA READs as target.
    pub max_qp_rd_atom: u32,
    /// Most outstanding RDMA READs as initiator.
    pub max_qp_init_rd_atom: u32,
    /// Number of ports.
    pub ports: u8,
}

impl DeviceAttributes {
    pub(crate) fn from_raw(a: &ibv_device_attr) -> Self {
        let fw: Vec<u8> = a
            .fw_ver
            .iter()
            .take_while(|c| **c != 0)
            .map(|c| *c as u8)
            .collect();
        let nonneg = |v: i32| v.max(0) as u32;
        DeviceAttributes {
            firmware: String::from_utf8_lossy(&fw).into_owned(),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            max_mr_size: a.max_mr_size,
            max_qp_wr: nonneg(a.max_qp_wr),
            max_sge: nonneg(a.max_sge),
            max_cqe: nonneg(a.max_cqe),
            max_qp_rd_atom: nonneg(a.max_qp_rd_atom),
            max_qp_init_rd_atom: nonneg(a.max_qp_init_rd_atom),
            ports: a.phys_port_cnt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mtu_codes_round_trip() {
        for code in 1..=5 {
            let m = Mtu::from_code(code).unwrap();
            assert_eq!(m.code(), code);
        }
        assert_eq!(Mtu::Mtu1024.bytes(), 1024);
        assert_eq!(Mtu::Mtu4096.bytes(), 4096);
        assert_eq!(Mtu::from_code(0), None);
        assert_eq!(Mtu::from_code(6), None);
        assert!(Mtu::Mtu1024 < Mtu::Mtu4096);
    }

    #[test]
    fn port_attributes_from_raw() {
        // SAFETY: all-zero is a valid ibv_port_attr (plain integers).
        let mut raw: ibv_port_attr = unsafe { std::mem::zeroed() };
        raw.state = 4;
        raw.active_mtu = 3;
        raw.max_mtu = 5;
        raw.link_layer = 2;
        raw.gid_tbl_len = 16;
        raw.active_width = 2;
        raw.active_speed = 32;
        let p = PortAttributes::from_raw(1, &raw);
        assert_eq!(p.state, PortState::Active);
        assert_eq!(p.active_mtu, Some(Mtu::Mtu1024));
        assert_eq!(p.link_layer, LinkLayer::Ethernet);
        assert_eq!(p.gid_table_len, 16);
        assert_eq!(p.rate_gbps(), Some(103.125));
        raw.state = 1;
        assert_eq!(PortAttributes::from_raw(1, &raw).state.name(), "DOWN");
    }
}

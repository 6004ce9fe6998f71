//! What `paths()` reports, through the public API.

use nodetour_core::transport::TransportKind;
use nodetour_ring::comm::{DevicePath, Direction, Landing, LinkPath, Paths};

#[test]
fn the_report_reads_as_one_line() {
    let p = Paths {
        rank: 1,
        world: 3,
        order: vec![0, 1, 2],
        links: vec![LinkPath {
            peer: 2,
            direction: Direction::Next,
            transport: TransportKind::Tcp,
            landing: Landing::SoftwareHost,
            reason: "no RDMA device on rank 2".into(),
        }],
        security: "authenticated (job token)".into(),
        device: DevicePath::Staged {
            reason: "the ranks are on several hosts".into(),
        },
        peers: vec![],
    };
    let line = p.to_string();
    assert!(!line.contains('\n'));
    assert!(line.contains("next rank 2 tcp"), "{line}");
    assert!(line.contains("GPU buffers: staged"), "{line}");
    assert!(p.all(TransportKind::Tcp) && !p.all(TransportKind::Verbs));
}

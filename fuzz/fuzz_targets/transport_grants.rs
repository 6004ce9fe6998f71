//! What peers send about their slot regions (slot grants and neighbour setups at formation,
//! host rings' and GPU rings', cuda-ipc grants and shared-memory names) and the tcp transport's frame headers: any bytes decode or fail with a typed error; accepted values re-encode to the
//! same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodetour_core::memory::ShmName;
use nodetour_core::transport::SlotGrant;
use nodetour_core::transport::gpu::IpcGrant;
use nodetour_core::transport::setup::{GpuNeighbourSetup, NeighbourSetup};
use nodetour_core::transport::wire::WriteHeader;

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = SlotGrant::decode(data) {
        assert_eq!(&g.encode()[..], data);
    }
    if let Ok(g) = IpcGrant::decode(data) {
        assert_eq!(&g.encode()[..], data);
    }
    // What a neighbour sends at formation (grants, its queue pair for us).
    if let Ok(s) = NeighbourSetup::decode(data) {
        assert_eq!(s.encode(), data);
    }
    // What a GPU-ring neighbour sends at formation (flag pages, slots): names stay strict.
    if let Ok(s) = GpuNeighbourSetup::decode(data) {
        assert_eq!(s.encode(), data);
        for n in std::iter::once(&s.flags).chain(s.slots.as_ref().map(|(_, n, _)| n)) {
            assert!(!n.component().contains('/') && n.component() != "..");
        }
    }
    if let Ok(h) = WriteHeader::decode(data) {
        assert_eq!(&h.encode()[..], data);
    }
    // A shared-memory name a peer announces: one strict component in a fixed directory.
    if let Ok(n) = ShmName::decode(data) {
        assert_eq!(&n.encode()[..], data);
        assert!(!n.component().contains('/') && n.component() != "..");
        assert_eq!(n.path().parent().unwrap().to_str(), Some(n.dir().path()));
    }
});

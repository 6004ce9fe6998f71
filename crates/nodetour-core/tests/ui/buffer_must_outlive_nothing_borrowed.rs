// Registration needs an owned, 'static buffer: a borrowed stack array (which could be freed
// while the NIC still writes it) cannot be registered.
use std::sync::Arc;
use nodetour_core::verbs::{Access, MemoryRegion, ProtectionDomain};

fn register(pd: &Arc<ProtectionDomain>) {
    let mut local = [0u8; 4096];
    let _region = MemoryRegion::register(pd, &mut local[..], Access::REMOTE).unwrap();
}

fn main() {}

// Registration takes the buffer by value: the caller cannot keep writing it through its old
// handle while the NIC may be reading or writing it.
use std::sync::Arc;
use nodetour_core::memory::HostBuffer;
use nodetour_core::verbs::{Access, MemoryRegion, ProtectionDomain};

fn register(pd: &Arc<ProtectionDomain>) {
    let mut buffer = HostBuffer::new(4096).unwrap();
    let _region = MemoryRegion::register(pd, buffer, Access::REMOTE).unwrap();
    buffer.as_mut_slice()[0] = 1;
}

fn main() {}

// A registered region hands out copies, never a slice into memory the NIC may write.
use nodetour_core::memory::HostBuffer;
use nodetour_core::verbs::MemoryRegion;

fn peek(region: &MemoryRegion<HostBuffer>) -> &[u8] {
    &region[..]
}

fn main() {}

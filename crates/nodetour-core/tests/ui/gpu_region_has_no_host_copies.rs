// GPU memory is not host-accessible: a region over it has no read_at/write_at (copy with the
// GPU instead), so the CPU never dereferences a device address.
use nodetour_core::memory::DeviceBuffer;
use nodetour_core::verbs::MemoryRegion;

fn peek(region: &MemoryRegion<DeviceBuffer>) {
    let mut out = [0u8; 16];
    region.read_at(0, &mut out).unwrap();
}

fn main() {}

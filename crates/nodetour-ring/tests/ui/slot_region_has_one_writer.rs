// A slot region's bytes have one lock: its own methods. Its verbs registration (which has
// `read_at`/`write_at` under a lock of its own) is never handed out, so no second writer can
// reach the same bytes (issue 48).
use nodetour_core::transport::SlotRegion;

fn second_writer(region: &SlotRegion) {
    let mr = region.memory_region().unwrap();
    mr.write_at(0, &[1, 2, 3]).unwrap();
}

fn main() {}

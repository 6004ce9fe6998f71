//! Arbitrary bytes as a peer's bootstrap announcement to a communicator (protocol version,
//! transport, RDMA device, GPU, pid): typed errors, exact round trips, and the same link chosen
//! from both ends; never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodetour_ring::fuzzing::announcements(data);
});

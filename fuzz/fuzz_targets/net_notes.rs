//! Arbitrary notifications from a network link's neighbours, interleaved with what the streams
//! store, completions, flushes, aborts and losses, against both ends of the link: no panic, no
//! write without credit, no `ready` past what landed, cells only from the role that may write
//! them.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodetour_ring::fuzzing::net_notes(data);
});

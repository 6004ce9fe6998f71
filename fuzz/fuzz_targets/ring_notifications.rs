//! Arbitrary notifications from peers against one rank's ring schedule (immediates, grants,
//! completions, timeouts, lost peers): typed errors, never a panic or an endless action stream.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    nodetour_ring::fuzzing::drive(data);
    nodetour_ring::fuzzing::descriptors(data);
});

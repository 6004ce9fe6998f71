//! Endpoint descriptions come from the peer over the network: decoding any bytes must return a
//! value or a typed error, and whatever decodes must encode back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodetour_core::verbs::EndpointDescription;

fuzz_target!(|data: &[u8]| {
    if let Ok(d) = EndpointDescription::decode(data) {
        assert_eq!(d.encode().expect("a decoded description encodes"), data);
    }
});

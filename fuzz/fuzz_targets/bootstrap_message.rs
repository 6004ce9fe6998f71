//! Bootstrap messages come from anyone who reaches the rendezvous port: any bytes decode or fail
//! with a typed error, and what decodes re-encodes to the same frame.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodetour_net::bootstrap::wire::Message;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Message::decode(data) {
        assert_eq!(m.encode().expect("a decoded message encodes"), data);
    }
});

//! Out-of-band frame headers come from the peer: any 12 bytes decode or fail with a typed error,
//! and an accepted header never announces more than the payload limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nodetour_tools::oob::{HEADER_LEN, MAX_PAYLOAD, decode_header, encode_frame};

fuzz_target!(|data: &[u8]| {
    let header = &data[..data.len().min(HEADER_LEN)];
    if let Ok((kind, len)) = decode_header(header) {
        assert!(len <= MAX_PAYLOAD);
        let frame = encode_frame(kind, &vec![0; len as usize]).expect("an accepted length encodes");
        assert_eq!(&frame[..HEADER_LEN], header);
    }
});
